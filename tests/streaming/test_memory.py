"""Sizing inputs: free RAM and memory limits (cgroup v1 and v2), and the slot plan from a budget."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench.memcap import cap_support, memory_cap
from tests.conftest import ModelFactory
from tokenwing.format.reader import ModelFile
from tokenwing.streaming.memory import memory_info
from tokenwing.streaming.streamer import plan_slots

GIB = 1 << 30


def fake_root(tmp_path: Path, cgroup: str, files: dict[str, str]) -> Path:
    (tmp_path / "proc/self").mkdir(parents=True)
    (tmp_path / "proc/meminfo").write_text(
        "MemTotal:       25165824 kB\nMemFree:  1000 kB\nMemAvailable:   20971520 kB\n"
    )
    (tmp_path / "proc/self/cgroup").write_text(cgroup)
    for rel, text in files.items():
        p = tmp_path / "sys/fs/cgroup" / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
    return tmp_path


def test_no_limit(tmp_path: Path) -> None:
    root = fake_root(tmp_path, "0::/\n", {"memory.max": "max"})
    m = memory_info(str(root))
    assert (m.total, m.available, m.limit) == (24 * GIB, 20 * GIB, 24 * GIB)
    assert m.usable == 20 * GIB


def test_cgroup_v2_limit_on_an_ancestor(tmp_path: Path) -> None:
    root = fake_root(
        tmp_path,
        "0::/app/engine\n",
        {
            "app/memory.max": str(4 * GIB),
            "app/memory.current": str(1 * GIB),
            "app/engine/memory.max": "max",
            "app/engine/memory.current": str(GIB // 2),
        },
    )
    m = memory_info(str(root))
    assert m.limit == 4 * GIB and m.usable == 3 * GIB


def test_cgroup_v1_limit(tmp_path: Path) -> None:
    root = fake_root(
        tmp_path,
        "5:memory:/bench\n4:cpu:/\n",
        {
            "memory/bench/memory.limit_in_bytes": str(2 * GIB),
            "memory/bench/memory.usage_in_bytes": str(GIB // 4),
            "memory/memory.limit_in_bytes": str(9223372036854771712),
        },
    )
    m = memory_info(str(root))
    assert m.limit == 2 * GIB and m.usable == 2 * GIB - GIB // 4


def test_real_memory_cap_is_seen() -> None:
    """A real cap, made as the benchmarks make it (cgroup v1 here, v2 where that is mounted): the process sees it."""
    version, why = cap_support()
    if version is None:
        pytest.skip(why)
    with memory_cap(768 << 20, f"tw-test-{os.getpid()}") as cap:
        code = "from tokenwing.streaming.memory import memory_info; print(memory_info().limit)"
        out = subprocess.run(cap.argv([sys.executable, "-c", code]), capture_output=True, text=True, check=True)
    assert int(out.stdout) == 768 << 20


def test_live_machine_is_sane() -> None:
    m = memory_info()
    assert 0 < m.available <= m.total and 0 < m.usable <= m.limit


def test_slot_plan(repacked_factory: ModelFactory) -> None:
    with ModelFile.open(str(repacked_factory(type="Q8_0", n_layer=3))) as mf:
        idx = mf.index
    row = sum(el.record_size for el in idx.layers)
    p = plan_slots(idx, 5 * row + row // 2, 2)
    assert (p.slots_per_layer, p.bytes, p.note) == (5, 5 * row, None)
    assert plan_slots(idx, 100 * row, 2).slots_per_layer == idx.n_expert  # never more than every expert
    low = plan_slots(idx, 0, 2)  # never refuse: the minimum, and one line saying so
    assert low.slots_per_layer == 2 and low.note is not None and "using the minimum of 2" in low.note


def test_expert_budget(tmp_path: Path) -> None:
    from tokenwing.streaming.memory import expert_budget

    root = fake_root(tmp_path, "0::/app\n", {"app/memory.max": str(4 * GIB), "app/memory.current": str(GIB)})
    m = memory_info(str(root))
    # under a cap, the room under the cap counts; the headroom only comes off the machine's free RAM
    assert expert_budget(m, GIB // 2, GIB) == 3 * GIB - GIB
    assert expert_budget(m, 20 * GIB, 0) == 0  # little free RAM on the machine: that wins
    free = memory_info(str(fake_root(tmp_path / "b", "0::/\n", {"memory.max": "max"})))
    assert expert_budget(free, GIB // 2, GIB) == 20 * GIB - GIB // 2 - GIB
