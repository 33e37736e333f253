"""`tokenwing autotune`: it probes for real and sizes from what the process may use."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ModelFactory, run_cli


def test_autotune_json(repacked_factory: ModelFactory) -> None:
    model = repacked_factory(type="Q8_0", n_layer=3)
    r = run_cli("autotune", str(model), "--json", "--probe-bytes", "4M")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    m, s = out["machine"], out["settings"]
    assert m["cores"] >= 1 and m["memory"]["usable"] > 0
    assert set(m["drive"]["mb_per_s_by_threads"]) == {"1", "2", "4", "8", "16"}
    assert all(v > 0 for v in m["drive"]["mb_per_s_by_threads"].values())
    assert s["moe_stream_io_threads"] in (1, 2, 4, 8, 16)
    assert s["expert_cache_share"] == 1.0  # a tiny model fits
    assert set(out["reasons"]) == set(s)


def test_autotune_follows_the_memory_limit(repacked_factory: ModelFactory) -> None:
    base = "/sys/fs/cgroup/memory"
    if os.geteuid() != 0 or not os.access(base, os.W_OK):
        pytest.skip("needs root and the cgroup v1 memory controller")
    model = repacked_factory(type="F32", n_layer=2, n_embd=512, n_ff_exp=512, n_expert=64, n_expert_used=4)
    group = f"{base}/tw-autotune-{os.getpid()}"
    os.mkdir(group)
    try:
        cap = 500 << 20
        Path(group, "memory.limit_in_bytes").write_text(str(cap))
        cmd = [
            sys.executable,
            "-m",
            "tokenwing",
            "autotune",
            str(model),
            "--json",
            "--probe-bytes",
            "4M",
            "--ctx",
            "256",
        ]
        out = subprocess.run(
            ["sh", "-c", f'echo $$ > {group}/cgroup.procs && exec "$@"', "sh", *cmd],
            capture_output=True,
            text=True,
            check=True,
        )
        s = json.loads(out.stdout)
        assert s["machine"]["memory"]["limit"] == cap
        assert s["settings"]["ram_budget"] < cap
        assert s["settings"]["expert_cache_share"] < 1.0  # 384 MiB of experts do not fit beside the rest
    finally:
        os.rmdir(group)
