"""A disk that fills up in the middle of a write, for real (a small tmpfs, ENOSPC from the kernel): the free-space
check before the write passes, another file takes the space while the write runs, and the result is one line,
an exit code and nothing partial left behind. Repack and the usage table here; downloads and the conversation
store in tests/app/test_disk_full.py."""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

from tests.conftest import ModelFactory, Mount, fill_disk, run_cli
from tokenwing.format.repack import plan_repack
from tokenwing.format.source import open_source
from tokenwing.fsutil import SPACE_MARGIN


def _full_pipe() -> tuple[int, int, bytes]:
    """A pipe whose buffer is full: the first write to it blocks until the reader drains it. (read end, write
    end, what was put in)."""
    r, w = os.pipe()
    fcntl.fcntl(w, fcntl.F_SETFL, fcntl.fcntl(w, fcntl.F_GETFL) | os.O_NONBLOCK)
    stuffed = bytearray()
    try:
        while True:
            stuffed += b"#" * os.write(w, b"#" * 4096)
    except BlockingIOError:
        pass
    fcntl.fcntl(w, fcntl.F_SETFL, fcntl.fcntl(w, fcntl.F_GETFL) & ~os.O_NONBLOCK)
    return r, w, bytes(stuffed)


def test_repack_disk_fills_during_the_write(model_factory: ModelFactory, tmpfs: Mount, tmp_path: Path) -> None:
    src = model_factory(type="Q8_0", n_layer=3)
    size = plan_repack(open_source([str(src)])).file_size
    disk = tmpfs(size + SPACE_MARGIN + (1 << 20))  # the check before the write passes, with a MiB to spare
    out = disk / "out.tw.gguf"
    # The deterministic point: the repack's first progress line (after the space check and the output's
    # creation, before any data) goes to a full pipe, so it waits there until this test has filled the disk.
    r, w, stuffed = _full_pipe()
    proc = subprocess.Popen(
        [sys.executable, "-m", "tokenwing", "repack", str(src), "-o", str(out), "--progress-json"],
        stdout=subprocess.PIPE,
        stderr=w,
    )
    os.close(w)
    try:
        deadline = time.monotonic() + 120
        while not any(p.name.startswith(".out.tw.gguf.partial-") for p in disk.iterdir()):
            assert proc.poll() is None, "the repack ended before it began writing"
            assert time.monotonic() < deadline
            time.sleep(0.02)
        fill_disk(disk, size // 2)  # half of the output fits
        err = bytearray()
        reader = threading.Thread(target=lambda: err.extend(_read_all(r)))
        reader.start()
        proc.wait(timeout=120)
        reader.join(timeout=30)
    finally:
        proc.kill()
        os.close(r)
    text = bytes(err).removeprefix(stuffed).decode()
    lines = [ln for ln in text.splitlines() if ln.strip() and not ln.startswith('{"progress"')]
    assert proc.returncode == 5, text
    assert lines == [f"tokenwing: error: the disk filled up while writing {out}; nothing was kept"], text
    assert sorted(p.name for p in disk.iterdir()) == ["filler"]  # no output, no partial file


def _read_all(fd: int) -> bytes:
    chunks = []
    while chunk := os.read(fd, 65536):
        chunks.append(chunk)
    return b"".join(chunks)


def test_usage_table_disk_full_keeps_the_old_table(repacked_factory: ModelFactory, tmpfs: Mount) -> None:
    """The usage table is written through fsutil.write_atomic, whose space check (with its 16 MiB margin) now
    refuses a disk this full before writing; a fill during the write goes the repack's way above (same code)."""
    model = repacked_factory(type="Q8_0", n_layer=8, n_expert=128, n_expert_used=8)
    disk = tmpfs(model.stat().st_size + SPACE_MARGIN + (8 << 20))
    on_disk = disk / model.name
    shutil.copyfile(model, on_disk)
    args = ("run", str(on_disk), "--prompt", "Once upon a time", "-n", "4")
    first = run_cli(*args)
    assert first.returncode == 0, first.stderr
    table = disk / (model.name + ".usage.json")
    before = table.read_bytes()
    assert json.loads(before)["tokens"] > 0
    fill_disk(disk, 4096)
    second = run_cli(*args)
    assert second.returncode == 0, second.stderr  # the reply was given: the table is not worth failing for
    notes = [ln for ln in second.stderr.splitlines() if "usage table" in ln]
    assert len(notes) == 1 and notes[0].startswith("tokenwing: the usage table was not saved (not enough free space")
    assert table.read_bytes() == before  # the old table, whole
    assert sorted(p.name for p in disk.iterdir()) == sorted(["filler", model.name, table.name])
