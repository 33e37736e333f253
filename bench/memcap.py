"""Holding a benchmarked process to a memory cap (cgroup v1 or v2) and evicting files from the page cache.

Page cache of files a capped process reads or writes is charged to its group, so a cap bounds it too.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

V1 = "/sys/fs/cgroup/memory"
V2 = "/sys/fs/cgroup"


def evict_from_page_cache(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


@dataclass
class CappedRun:
    returncode: int
    stdout: str
    stderr: str
    seconds: float
    peak_bytes: int  # the group's peak charge (RSS plus page cache), or the child's max RSS without a cap
    max_rss: int


@contextlib.contextmanager
def memory_group(name: str, limit: int) -> Iterator[str]:
    """A fresh cgroup limited to `limit` bytes; yields the path of its cgroup.procs file."""
    if os.path.isdir(V1) and os.access(V1, os.W_OK):
        path = os.path.join(V1, name)
        os.makedirs(path, exist_ok=True)
        _write(os.path.join(path, "memory.limit_in_bytes"), str(limit))
        with contextlib.suppress(OSError):
            _write(os.path.join(path, "memory.max_usage_in_bytes"), "0")
    else:
        path = os.path.join(V2, name)
        os.makedirs(path, exist_ok=True)
        _write(os.path.join(path, "memory.max"), str(limit))
    try:
        yield path
    finally:
        for _ in range(50):
            with contextlib.suppress(OSError):
                os.rmdir(path)
                break
            time.sleep(0.1)


def _write(path: str, value: str) -> None:
    with open(path, "w") as f:
        f.write(value)


def _peak(group: str) -> int:
    for name in ("memory.max_usage_in_bytes", "memory.peak"):
        p = os.path.join(group, name)
        if os.path.exists(p):
            with open(p) as f:
                return int(f.read().strip())
    return 0


def run_capped(cmd: Sequence[str], limit: int | None, timeout: float, name: str = "tw-bench") -> CappedRun:
    """Runs cmd (optionally inside a memory cap); returns its output, time and peak memory."""
    t0 = time.monotonic()
    before = _children_maxrss()
    if limit is None:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)
        rss = max(_children_maxrss(), before)
        return CappedRun(proc.returncode, proc.stdout, proc.stderr, time.monotonic() - t0, rss, rss)
    with memory_group(f"{name}-{os.getpid()}", limit) as group:
        # Join the group from inside the child before it execs, so every byte it touches is charged.
        procs = os.path.join(group, "cgroup.procs")
        proc = subprocess.run(
            ["sh", "-c", f'echo $$ > {procs} && exec "$@"', "sh", *cmd],
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
        peak = _peak(group)
    return CappedRun(proc.returncode, proc.stdout, proc.stderr, time.monotonic() - t0, peak, _children_maxrss())


def _children_maxrss() -> int:
    import resource

    return resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024
