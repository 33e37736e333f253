"""bench/memcap.py, the one home of memory caps: cgroup v2 against a tree laid out as the kernel lays one out
(Documentation/admin-guide/cgroup-v2.rst: cgroup.controllers, cgroup.subtree_control, memory.max, memory.peak,
memory.events), cgroup v1 the same way, and a real cap where this machine can make one."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from bench.memcap import PARENT_ENV, CapUnavailable, cap_support, memory_cap, run_capped

V2_MOUNTS = "cgroup2 /sys/fs/cgroup cgroup2 rw,nosuid,nodev,noexec,relatime,nsdelegate,memory_recursiveprot 0 0\n"
V1_MOUNTS = (
    "tmpfs /sys/fs/cgroup tmpfs rw,relatime,mode=755 0 0\n"
    "cgroup /sys/fs/cgroup/cpu cgroup rw,relatime,cpu 0 0\n"
    "cgroup /sys/fs/cgroup/memory cgroup rw,nosuid,nodev,noexec,relatime,memory 0 0\n"
    "cgroup2 /sys/fs/cgroup/unified cgroup2 rw,relatime 0 0\n"
)


def tree(tmp_path: Path, mounts: str, files: dict[str, str]) -> Path:
    (tmp_path / "proc/self").mkdir(parents=True)
    (tmp_path / "proc/self/mounts").write_text(mounts)
    for rel, text in files.items():
        p = tmp_path / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
    return tmp_path


def v2_root(tmp_path: Path, subtree: str = "cpu io pids\n") -> Path:
    """The root group of a unified hierarchy: every controller available, memory not yet handed to children."""
    return tree(
        tmp_path,
        V2_MOUNTS,
        {
            "sys/fs/cgroup/cgroup.controllers": "cpuset cpu io memory hugetlb pids rdma misc\n",
            "sys/fs/cgroup/cgroup.subtree_control": subtree,
            "sys/fs/cgroup/cgroup.procs": "1\n",
            "sys/fs/cgroup/memory.stat": "anon 0\nfile 0\n",
        },
    )


def kernel_removes(group: Path) -> None:
    """What rmdir of a cgroup does to its interface files (a plain folder needs them gone first)."""
    for f in group.iterdir():
        f.unlink()


def test_v2_cap(tmp_path: Path) -> None:
    root = v2_root(tmp_path)
    assert cap_support(str(root)) == (2, "")
    group = root / "sys/fs/cgroup/tw-x"
    with memory_cap(512 << 20, "tw-x", str(root)) as cap:
        assert (cap.version, Path(cap.path), cap.limit) == (2, group, 512 << 20)
        assert (root / "sys/fs/cgroup/cgroup.subtree_control").read_text() == "+memory"  # handed to the children
        assert (group / "memory.max").read_text() == str(512 << 20)
        assert cap.peak() is None and cap.oom_kills() == 0  # a kernel before 5.19 keeps no memory.peak
        # what the kernel keeps in the group while the capped process runs
        (group / "memory.peak").write_text("400556032\n")
        (group / "memory.events").write_text("low 0\nhigh 0\nmax 17\noom 1\noom_kill 1\noom_group_kill 0\n")
        assert cap.peak() == 400556032 and cap.oom_kills() == 1
        # the child joins before it execs: the pid in cgroup.procs is the command's own
        out = subprocess.run(
            cap.argv([sys.executable, "-c", "import os; print(os.getpid())"]),
            capture_output=True,
            text=True,
            check=True,
        )
        assert (group / "cgroup.procs").read_text().split() == [out.stdout.strip()]
        kernel_removes(group)
    assert not group.exists()


def test_v2_memory_already_enabled_and_a_delegated_subtree(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    root = v2_root(tmp_path, subtree="cpu io memory pids\n")
    user = root / "sys/fs/cgroup/user.slice/user-1000.slice/user@1000.service"
    user.mkdir(parents=True)
    (user / "cgroup.controllers").write_text("cpu io memory pids\n")
    (user / "cgroup.subtree_control").write_text("memory pids\n")
    monkeypatch.setenv(PARENT_ENV, "/user.slice/user-1000.slice/user@1000.service")
    with memory_cap(1 << 30, "tw-y", str(root)) as cap:
        assert Path(cap.path) == user / "tw-y" and (user / "tw-y/memory.max").read_text() == str(1 << 30)
        assert (user / "cgroup.subtree_control").read_text() == "memory pids\n"  # already on: left alone
        kernel_removes(Path(cap.path))


def test_v1_cap(tmp_path: Path) -> None:
    root = tree(
        tmp_path,
        V1_MOUNTS,
        {
            "sys/fs/cgroup/memory/cgroup.procs": "1\n",
            "sys/fs/cgroup/memory/memory.limit_in_bytes": "9223372036854771712\n",
            "sys/fs/cgroup/unified/cgroup.controllers": "\n",  # hybrid: the unified hierarchy has no controllers
        },
    )
    assert cap_support(str(root)) == (1, "")
    group = root / "sys/fs/cgroup/memory/tw-z"
    with memory_cap(256 << 20, "tw-z", str(root)) as cap:
        assert (cap.version, Path(cap.path)) == (1, group)
        assert (group / "memory.limit_in_bytes").read_text() == str(256 << 20)
        assert (group / "memory.max_usage_in_bytes").read_text() == "0"  # the peak starts afresh
        (group / "memory.max_usage_in_bytes").write_text("268435456\n")
        (group / "memory.oom_control").write_text("oom_kill_disable 0\nunder_oom 0\noom_kill 2\n")
        assert cap.peak() == 256 << 20 and cap.oom_kills() == 2
        kernel_removes(group)


def test_no_cap_says_what_each_version_lacks(tmp_path: Path) -> None:
    hybrid = tree(
        tmp_path / "a", V1_MOUNTS.replace(",memory ", " "), {"sys/fs/cgroup/unified/cgroup.controllers": "hugetlb\n"}
    )
    version, why = cap_support(str(hybrid))
    assert version is None
    assert "cgroup v2: no memory controller at" in why and "(controllers: hugetlb)" in why
    assert "cgroup v1: no memory controller mounted" in why
    with pytest.raises(CapUnavailable, match=r"cgroup v2: .*; cgroup v1: "), memory_cap(1 << 30, "x", str(hybrid)):
        pass
    nothing = tree(tmp_path / "b", "proc /proc proc rw 0 0\n", {})
    assert cap_support(str(nothing))[1].endswith(
        "cgroup v2: no unified hierarchy mounted; cgroup v1: no memory controller mounted"
    )


def test_real_cap_holds_a_process(tmp_path: Path) -> None:
    """On this machine: a real cap (v1 here, v2 where that is what is mounted) that the process sees and that
    charges it, its peak read back."""
    version, why = cap_support()
    if version is None:
        pytest.skip(why)
    grab = "import os; b = bytearray(64 << 20); b[::4096] = b'x' * len(b[::4096]); print(os.getpid())"
    r = run_capped([sys.executable, "-c", grab], 256 << 20, 120, name="tw-test-memcap")
    assert r.returncode == 0, r.stderr
    assert 64 << 20 <= r.peak_bytes <= 256 << 20 and r.oom_kills == 0
    starved = run_capped(
        [sys.executable, "-c", "b = bytearray(512 << 20); b[::4096] = b'x' * len(b[::4096])"],
        128 << 20,
        120,
        name="tw-test-memcap",
    )
    assert starved.returncode != 0 and starved.oom_kills >= 1  # held to the cap: the kernel's OOM killer ended it
