"""The native core's direct reads: aligned reads, fallback, and clean errors."""

from __future__ import annotations

import mmap
import os
from pathlib import Path

import numpy as np
import pytest

from tokenwing import _core


def aligned(n: int) -> np.ndarray:
    return np.frombuffer(mmap.mmap(-1, n), dtype=np.uint8)


@pytest.fixture
def data_file(tmp_path: Path) -> tuple[Path, bytes]:
    payload = np.random.default_rng(1).integers(0, 256, 5 * 4096 + 123, dtype=np.uint8).tobytes()
    p = tmp_path / "d.bin"
    p.write_bytes(payload)
    return p, payload


def test_direct_reads_are_exact(data_file: tuple[Path, bytes]) -> None:
    p, payload = data_file
    with _core.DirectFile(str(p)) as f:
        assert f.direct, f.fallback_reason  # ext4 and xfs allow O_DIRECT
        assert f.size == len(payload)
        buf = aligned(8192)
        f.read_into(4096, buf)
        assert buf.tobytes() == payload[4096:12288]


def test_unaligned_direct_read_is_an_error(data_file: tuple[Path, bytes]) -> None:
    p, _ = data_file
    with _core.DirectFile(str(p)) as f:
        with pytest.raises(_core.IoError, match="unaligned"):
            f.read_into(100, aligned(4096))
        with pytest.raises(_core.IoError, match="unaligned"):
            f.read_into(0, aligned(8192)[1:4097])


def test_cached_reads_take_any_offset(data_file: tuple[Path, bytes]) -> None:
    p, payload = data_file
    with _core.DirectFile(str(p), direct=False) as f:
        assert not f.direct
        buf = np.zeros(1000, dtype=np.uint8)
        f.read_into(77, buf)
        assert buf.tobytes() == payload[77:1077]


def test_read_past_end_and_truncation_after_open(data_file: tuple[Path, bytes]) -> None:
    p, payload = data_file
    f = _core.DirectFile(str(p), direct=False)
    with pytest.raises(_core.IoError, match="truncated or replaced"):
        f.read_into(len(payload) - 10, np.zeros(100, dtype=np.uint8))
    os.truncate(p, 4096)
    with pytest.raises(_core.IoError, match="file ends at offset 4096"):
        f.read_into(4096, np.zeros(10, dtype=np.uint8))
    f.close()
    with pytest.raises(_core.IoError, match="after close"):
        f.read_into(0, np.zeros(10, dtype=np.uint8))


def test_open_errors(tmp_path: Path) -> None:
    with pytest.raises(OSError, match="cannot open"):
        _core.DirectFile(str(tmp_path / "missing"))
    with pytest.raises(OSError, match="not a regular file"):
        _core.DirectFile(str(tmp_path))


def test_fallback_where_o_direct_is_refused(ramfs: Path) -> None:
    p = ramfs / "f.bin"
    p.write_bytes(b"x" * 8192)
    with _core.DirectFile(str(p)) as f:
        assert not f.direct
        assert "refuses O_DIRECT" in f.fallback_reason
        buf = aligned(4096)
        f.read_into(4096, buf)
        assert buf.tobytes() == b"x" * 4096


def test_gil_is_released_during_reads(data_file: tuple[Path, bytes]) -> None:
    import threading

    p, payload = data_file
    errors: list[BaseException] = []

    def worker() -> None:
        try:
            with _core.DirectFile(str(p)) as f:
                buf = aligned(4096)
                for i in range(200):
                    f.read_into((i % 5) * 4096, buf)
                    assert buf.tobytes() == payload[(i % 5) * 4096 : (i % 5 + 1) * 4096]
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
