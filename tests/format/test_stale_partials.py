"""Issue 41: a repack killed with SIGKILL leaves its `.NAME.tw.gguf.partial-PID` (115-155 MB for a real model);
the next repack of the same output removes it, and never a live writer's."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

from tests.conftest import ModelFactory, run_cli
from tests.pauses import Pauses
from tokenwing import fsutil


def test_a_killed_repacks_partial_is_removed_by_the_next(model_factory: ModelFactory, tmp_path: Path) -> None:
    src = model_factory(type="Q8_0", n_layer=3)
    out = tmp_path / "out"
    out.mkdir()
    pauses = Pauses(tmp_path / "p", "repack.write")
    proc = subprocess.Popen(
        [sys.executable, "-m", "tokenwing", "repack", str(src), "-o", str(out / "m.tw.gguf"), "-q"],
        env=pauses.env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    pid = pauses.wait("repack.write", lambda: proc.poll() is None)
    os.kill(pid, signal.SIGKILL)  # a crash: nothing of the writer runs again
    proc.wait(timeout=60)
    stale = out / f".m.tw.gguf.partial-{pid}"
    assert sorted(p.name for p in out.iterdir()) == [stale.name] and stale.stat().st_size > 0
    r = run_cli("repack", str(src), "-o", str(out / "m.tw.gguf"), "-q")
    assert r.returncode == 0, r.stderr
    assert sorted(p.name for p in out.iterdir()) == ["m.tw.gguf"]


def test_a_live_writers_partial_and_other_files_are_kept(tmp_path: Path) -> None:
    target = tmp_path / "m.tw.gguf"
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        keep = [
            tmp_path / f".m.tw.gguf.partial-{live.pid}",  # its writer is alive
            tmp_path / f".m.tw.gguf.partial-{os.getpid()}",  # this process's own
            tmp_path / ".other.tw.gguf.partial-999999999",  # another output's
            tmp_path / ".m.tw.gguf.partial-notapid",
        ]
        dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
        gone = tmp_path / f".m.tw.gguf.partial-{int(dead.stdout)}"  # its process has exited (and been reaped)
        for p in [*keep, gone]:
            p.write_bytes(b"x")
        assert fsutil.remove_stale_partials(str(target)) == [str(gone)]
        assert sorted(tmp_path.iterdir()) == sorted(keep)
    finally:
        live.kill()
        live.wait()
