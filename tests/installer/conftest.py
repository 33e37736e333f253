"""The Linux installers as the installer tests share them: built once a session by installer/build-linux.sh into
build/installer/out (reused when its inputs are unchanged)."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest

from tokenwing.version import __version__

ROOT = Path(__file__).resolve().parents[2]
OUT = ROOT / "build" / "installer" / "out"
# The build is a hang only when its processes use no CPU for this long. Not a limit on its duration: a build
# under load is slow but never idle (its compiles run under `nice`; with both cores held by busy loops the
# four ggml builds it then made took more than the 25 minutes a fixed timeout allowed, and the run failed on that).
BUILD_STALL_S = 900


@dataclass(frozen=True)
class Installers:
    tarball: Path
    deb: Path
    build_s: float  # how long build-linux.sh took this session (seconds; short when it found its build current)


def _tree_cpu_s(root: psutil.Process) -> float:
    """CPU seconds used by a process tree so far: each live process's own and its finished children's."""
    total = 0.0
    for p in [root, *root.children(recursive=True)]:
        try:
            t = p.cpu_times()
        except psutil.Error:  # ended meanwhile: its parent counts it once it is reaped
            continue
        total += t.user + t.system + t.children_user + t.children_system
    return total


def _wait_while_busy(proc: subprocess.Popen[bytes], stall_s: float) -> None:
    """Waits for `proc` as long as its process tree keeps using CPU; fails once it used none for `stall_s`."""
    tree = psutil.Process(proc.pid)
    used, since = 0.0, time.monotonic()
    while proc.poll() is None:
        time.sleep(2)
        try:
            now = _tree_cpu_s(tree)
        except psutil.Error:
            continue
        if now > used + 0.5:
            used, since = now, time.monotonic()
        elif time.monotonic() - since > stall_s:
            pytest.fail(f"the installer build used no CPU for {stall_s:.0f} s: hung (see {OUT.parent / 'build.log'})")


@pytest.fixture(scope="session")
def installers() -> Installers:
    started = time.monotonic()
    log = OUT.parent / "build.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [str(ROOT / "installer" / "build-linux.sh")],
            env={**os.environ, "RUNMYAI_DIST": str(OUT)},
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its compilers go with it if it has to be stopped
        )
        try:
            _wait_while_busy(proc, BUILD_STALL_S)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    assert proc.returncode == 0, log.read_text(errors="replace")[-4000:]
    tarball = OUT / f"runmyai-{__version__}-linux-x86_64.tar.gz"
    deb = OUT / f"runmyai_{__version__}_amd64.deb"
    assert tarball.is_file() and deb.is_file()
    return Installers(tarball, deb, round(time.monotonic() - started, 1))
