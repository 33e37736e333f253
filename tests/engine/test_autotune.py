"""`tokenwing autotune`: it probes for real and sizes from what the process may use."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from bench.memcap import cap_support, memory_cap
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
    version, why = cap_support()
    if version is None:
        pytest.skip(why)
    model = repacked_factory(type="F32", n_layer=2, n_embd=512, n_ff_exp=512, n_expert=64, n_expert_used=4)
    cap = 500 << 20
    cmd = [sys.executable, "-m", "tokenwing", "autotune", str(model), "--json", "--probe-bytes", "4M", "--ctx", "256"]
    cmd += ["--replay-tokens", "4"]
    with memory_cap(cap, f"tw-autotune-{os.getpid()}") as group:
        out = subprocess.run(group.argv(cmd), capture_output=True, text=True, check=True)
    s = json.loads(out.stdout)
    assert s["machine"]["memory"]["limit"] == cap
    assert s["settings"]["ram_budget"] < cap
    assert s["settings"]["expert_cache_share"] < 1.0  # 384 MiB of experts do not fit beside the rest
    # streaming: the I/O settings and the lookahead come from a decode replayed through the core at each setting
    replay = s["machine"]["replay"]
    assert replay["slots_per_layer"] < 64 and all(v > 0 for v in replay["tok_s"].values())
    chosen = s["settings"]
    best_io = max(v for k, v in replay["tok_s"].items() if "lookahead" not in k)
    picked = f"{chosen['moe_stream_io_engine']} {chosen['moe_stream_io_threads']}"
    assert replay["tok_s"][picked] >= 0.97 * best_io  # the fastest, or the fewest reads in flight within 3 %
    assert chosen["lookahead"] in (0, 1, 2) and chosen["moe_stream_prefetch_votes"] in (1, 2)
    assert "replayed" in s["reasons"]["moe_stream_io_threads"] and set(s["reasons"]) == set(chosen)
