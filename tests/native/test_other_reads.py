"""Another file's reads through the streaming core (StreamCore.start_other: a prompt-cache snapshot's, issue 44):
exact bytes, queued behind every expert read, a failed read raised."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from tests.conftest import ModelFactory
from tokenwing import _core
from tokenwing.format.reader import ModelFile
from tokenwing.streaming.settings import StreamSettings
from tokenwing.streaming.streamer import ExpertStreamer

ALIGN = _core.DIRECT_ALIGNMENT


def _aligned(n: int) -> np.ndarray:
    raw = np.zeros(n + ALIGN, dtype=np.uint8)
    skip = -raw.ctypes.data % ALIGN
    return raw[skip : skip + n]


@pytest.fixture(scope="module")
def model(repacked_factory: ModelFactory) -> Path:
    # F32 experts of 3 MiB: a demand read is one request, read while the other file's 4 KiB chunks wait
    return repacked_factory(type="F32", n_layer=2, n_embd=1024, n_ff_exp=256, n_expert=8, n_expert_used=2)


@pytest.mark.parametrize("engine", ["threads", "io_uring"])
def test_a_demand_read_goes_before_the_other_files_reads(model: Path, tmp_path: Path, engine: str) -> None:
    data = np.random.default_rng(0).integers(0, 256, 16 * ALIGN, dtype=np.uint8)
    other = tmp_path / "other.bin"
    other.write_bytes(data.tobytes())
    settings = StreamSettings(verify=True, chunk_kib=4, io_threads=4, idle_fill_ms=-1, io_engine=engine)
    with ModelFile.open(str(model)) as mf, ExpertStreamer(mf, 4, settings) as s:
        want = mf.read_expert(1, 5)
        with _core.DirectFile(str(other), True) as f:
            dst = _aligned(data.size)
            s.core.hold_io_after(0)  # nothing starts: both are queued, the other file's reads first
            job = s.core.start_other(f, 0, dst, ALIGN)
            s.begin_token()
            s.begin_layer(1, [5])  # a demand read
            assert s.core.other_depths() == [data.size, 0]
            s.core.hold_io_after(1)  # one read may start: the demand read, queued after them
            if engine == "io_uring":  # (taken as hold_io_after returns: submitted under the core's lock)
                assert s.core.other_depths() == [data.size, 0]
            assert s.expert_bytes(1, s.wait(1, 5)).tobytes() == want
            assert s.core.other_depths() == [data.size, 0]  # none of the other file's was started
            s.core.hold_io_after(-1)
            s.core.wait_other(job)
            assert dst.tobytes() == data.tobytes() and s.core.other_depths() == [0, 0]


def test_a_failed_read_is_raised(model: Path, tmp_path: Path) -> None:
    other = tmp_path / "short.bin"
    other.write_bytes(bytes(4 * ALIGN))
    settings = StreamSettings(verify=True, idle_fill_ms=-1)
    with ModelFile.open(str(model)) as mf, ExpertStreamer(mf, 4, settings) as s:
        with _core.DirectFile(str(other), True) as f:
            dst = _aligned(8 * ALIGN)  # past the file's end
            job = s.core.start_other(f, 0, dst, ALIGN)
            with pytest.raises(OSError, match=r"short\.bin"):
                s.core.wait_other(job)
            if f.direct:
                with pytest.raises(OSError, match="unaligned"):
                    s.core.start_other(f, 100, dst, ALIGN)
        # the core goes on: an expert read after it
        s.begin_token()
        s.begin_layer(1, [3])
        assert s.expert_bytes(1, s.wait(1, 3)).tobytes() == mf.read_expert(1, 3)
