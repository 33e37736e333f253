"""Memory caps for benchmarks and tests: a cgroup of its own with a limit (v1 or v2), and page-cache eviction.

The one place that makes caps (bench/*.py and the tests import it). Page cache of files a capped process reads or
writes is charged to its group, so a cap bounds it too.

* cgroup v2 (the unified hierarchy, what current desktop distributions mount alone): a child group under a parent
  whose controllers include memory (the hierarchy's root, or a delegated subtree named by TW_CGROUP_PARENT),
  "+memory" written to the parent's cgroup.subtree_control, the cap in memory.max; the peak from memory.peak
  (Linux 5.19+), OOM kills from memory.events.
* cgroup v1 (the memory controller in a hierarchy of its own, as on our machines): a group under that hierarchy's
  root, the cap in memory.limit_in_bytes; the peak from memory.max_usage_in_bytes, OOM kills from
  memory.oom_control.

Either needs root or a delegated subtree. Where neither can be made, CapUnavailable says what each lacked.
"""

from __future__ import annotations

import contextlib
import errno
import itertools
import os
import subprocess
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

PARENT_ENV = "TW_CGROUP_PARENT"  # a delegated cgroup v2 subtree to create caps under (absolute, in the mount)


class CapUnavailable(Exception):
    """No memory cap can be made here; the message names what cgroup v2 and cgroup v1 each lacked."""


@dataclass
class MemoryCap:
    version: int  # 1 or 2
    path: str  # the group's folder
    limit: int

    def argv(self, cmd: Sequence[str]) -> list[str]:
        """`cmd`, joining the group from inside the child before it execs, so every byte it touches is charged."""
        return ["sh", "-c", f'echo $$ > "{self.path}/cgroup.procs" && exec "$@"', "sh", *cmd]

    def peak(self) -> int | None:
        """The group's peak charge (RSS plus page cache) so far; None where the kernel keeps none (v2 before 5.19)."""
        name = "memory.peak" if self.version == 2 else "memory.max_usage_in_bytes"
        try:
            return int(_read(self.path, name))
        except (OSError, ValueError):
            return None

    def oom_kills(self) -> int:
        """Processes the OOM killer ended in this group."""
        name = "memory.events" if self.version == 2 else "memory.oom_control"
        with contextlib.suppress(OSError):
            for line in _read(self.path, name).splitlines():
                key, _, value = line.partition(" ")
                if key == "oom_kill":
                    return int(value)
        return 0


def _read(folder: str, name: str) -> str:
    with open(os.path.join(folder, name)) as f:
        return f.read().strip()


def _write(folder: str, name: str, value: str) -> None:
    with open(os.path.join(folder, name), "w") as f:
        f.write(value)


def _mounts(root: str) -> list[tuple[str, str, set[str]]]:
    """(mount point under root, file system type, options) of each cgroup mount, from /proc/self/mounts."""
    found = []
    with contextlib.suppress(OSError), open(os.path.join(root, "proc/self/mounts")) as f:
        for line in f:
            fields = line.split()
            if len(fields) >= 4 and fields[2] in ("cgroup", "cgroup2"):
                point = fields[1].replace("\\040", " ")
                found.append((os.path.join(root, point.lstrip("/")), fields[2], set(fields[3].split(","))))
    return found


def _v2_parent(root: str) -> tuple[str | None, str]:
    """A folder to create a v2 cap in, or None and why not."""
    points = [p for p, kind, _ in _mounts(root) if kind == "cgroup2"]
    if not points:
        return None, "cgroup v2: no unified hierarchy mounted"
    mount = points[0]
    delegated = os.environ.get(PARENT_ENV)
    parent = os.path.join(mount, delegated.lstrip("/")) if delegated else mount
    try:
        controllers = _read(parent, "cgroup.controllers").split()
    except OSError as e:
        return None, f"cgroup v2: cannot read {parent}/cgroup.controllers ({e.strerror})"
    if "memory" not in controllers:
        offered = " ".join(controllers) or "none"
        return None, f"cgroup v2: no memory controller at {parent} (controllers: {offered})"
    if not os.access(parent, os.W_OK):
        return None, f"cgroup v2: {parent} is not writable (needs root, or a delegated subtree in ${PARENT_ENV})"
    return parent, ""


def _v1_parent(root: str) -> tuple[str | None, str]:
    points = [p for p, kind, opts in _mounts(root) if kind == "cgroup" and "memory" in opts]
    if not points:
        return None, "cgroup v1: no memory controller mounted"
    if not os.access(points[0], os.W_OK):
        return None, f"cgroup v1: {points[0]} is not writable (needs root)"
    return points[0], ""


def cap_support(root: str = "/") -> tuple[int | None, str]:
    """(2 or 1: the cgroup version caps are made with here, or None; why not, naming both versions)."""
    v2, why2 = _v2_parent(root)
    if v2 is not None:
        return 2, ""
    v1, why1 = _v1_parent(root)
    if v1 is not None:
        return 1, ""
    return None, f"no memory cap can be made here: {why2}; {why1}"


@contextlib.contextmanager
def memory_cap(limit: int, name: str, root: str = "/") -> Iterator[MemoryCap]:
    """A fresh group limited to `limit` bytes (removed afterwards). `root` points at a stand-in of / for tests."""
    version, why = cap_support(root)
    if version is None:
        raise CapUnavailable(why)
    if version == 2:
        parent, _ = _v2_parent(root)
        assert parent is not None
        if "memory" not in _read(parent, "cgroup.subtree_control").split():
            try:
                _write(parent, "cgroup.subtree_control", "+memory")
            except OSError as e:  # EBUSY: a non-root group with processes of its own cannot hand out controllers
                raise CapUnavailable(f"cgroup v2: cannot enable memory for the children of {parent}: {e}") from None
        path = os.path.join(parent, name)
        os.makedirs(path, exist_ok=True)
        _write(path, "memory.max", str(limit))
    else:
        parent, _ = _v1_parent(root)
        assert parent is not None
        path = os.path.join(parent, name)
        os.makedirs(path, exist_ok=True)
        _write(path, "memory.limit_in_bytes", str(limit))
        with contextlib.suppress(OSError):
            _write(path, "memory.max_usage_in_bytes", "0")  # a reused group starts its peak afresh
    try:
        yield MemoryCap(version, path, limit)
    finally:
        _remove(path)


def _remove(path: str) -> None:
    """rmdir of a group: the kernel refuses (EBUSY) while its last processes are still exiting."""
    for _ in range(50):
        try:
            os.rmdir(path)
            return
        except OSError as e:
            if e.errno != errno.EBUSY:
                return
        time.sleep(0.1)


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
    oom_kills: int = 0


_RUN_IDS = itertools.count()


def run_capped(cmd: Sequence[str], limit: int | None, timeout: float, name: str = "tw-bench") -> CappedRun:
    """Runs cmd (optionally inside a memory cap); returns its output, time and peak memory."""
    t0 = time.monotonic()
    before = _children_maxrss()
    if limit is None:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)
        rss = max(_children_maxrss(), before)
        return CappedRun(proc.returncode, proc.stdout, proc.stderr, time.monotonic() - t0, rss, rss)
    # A fresh group per run: a group whose last run's processes were still exiting when it was to be removed
    # (`_remove` gives up after 5 s) is left behind with that run's charges, and a next run that reused its name
    # started inside them (one was left after a glm5-bench run, 2026-12-03).
    with memory_cap(limit, f"{name}-{os.getpid()}-{next(_RUN_IDS)}") as cap:
        proc = subprocess.run(cap.argv(cmd), capture_output=True, text=True, timeout=timeout, check=False)
        seconds = time.monotonic() - t0
        peak, kills = cap.peak(), cap.oom_kills()
    rss = _children_maxrss()
    return CappedRun(proc.returncode, proc.stdout, proc.stderr, seconds, peak if peak is not None else rss, rss, kills)


def _children_maxrss() -> int:
    import resource

    return resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024
