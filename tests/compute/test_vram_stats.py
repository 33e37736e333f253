"""The VRAM tier's counters where people see them: the served engine's per-token stats stream (per layer: VRAM hits
beside the RAM hits and drive misses, swaps in and out and the bytes they copied up; their totals), /metrics, and
`tokenwing run --stats-json`."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest

from tests.compute.conftest import DEVICES, device
from tests.conftest import ModelFactory, run_cli
from tokenwing.compute.devices import DeviceOptions
from tokenwing.compute.probe import choose_device
from tokenwing.runtime.session import Session, SessionOptions

pytestmark = [
    pytest.mark.skipif(not DEVICES, reason="no device (ggml built for the CPU only)"),
    pytest.mark.own_process,
]
SHAPE = {"arch": "qwen3moe", "n_layer": 3, "n_expert": 16, "n_expert_used": 2}


def quarter_of_the_experts(model: Path) -> str:
    """A VRAM budget holding no layer, the head and 4 of 16 experts per layer (the rest in RAM)."""
    probe = choose_device(DeviceOptions(_kind(), "256M"))
    s = Session(str(model), SessionOptions(n_ctx=512, device=probe, usage_table=False), log=lambda line: None)
    try:
        assert s.vram is not None
        return str(s.vram.plan.reserve + s.vram.head_bytes + 4 * s.vram.expert_row)
    finally:
        s.close()


def _kind() -> str:
    return device(DEVICES[0]).kind


def test_stats_stream_and_metrics_show_the_vram_tier(repacked_factory: ModelFactory) -> None:
    pytest.importorskip("uvicorn", reason="the server's dependencies are not installed (the GPU machine)")
    httpx = pytest.importorskip("httpx")
    from tests.engine.test_server import KEY, Server

    model = repacked_factory(type="Q8_0", **SHAPE)
    budget = quarter_of_the_experts(model)
    server = Server(model, "--device", _kind(), "--vram-budget", budget, "--vram-layers", "0", "--no-usage-table")
    try:
        headers = {"Authorization": f"Bearer {KEY}"}
        events: list[dict[str, object]] = []
        subscribed = threading.Event()

        def listen() -> None:
            with httpx.stream("GET", server.url + "/v1/tokenwing/stats/stream", headers=headers, timeout=120) as r:
                subscribed.set()
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        events.append(json.loads(line[6:]))
                        if len(events) >= 30:
                            return

        t = threading.Thread(target=listen)
        t.start()
        assert subscribed.wait(60)
        server.client().completions.create(model="x", prompt="Stats", max_tokens=31, temperature=0)
        t.join(timeout=120)
        assert len(events) == 30
        # the cache starts empty (no usage table): the first swaps fill it at the 8th decode token
        swaps = [int(e["vram_swaps"]) for e in events]  # type: ignore[call-overload]
        assert sum(swaps) > 0 and swaps[:7] == [0] * 7
        vram_hits = sum(int(layer["vram_hits"]) for e in events for layer in e["layers"])  # type: ignore[attr-defined]
        assert vram_hits > 0
        for e in events:  # three tiers: every selected expert came from VRAM, RAM or the drive
            for layer in e["layers"]:  # type: ignore[attr-defined]
                assert layer["vram_hits"] + layer["hits"] + layer["misses"] == 2
        # swaps per layer: the totals are their sums; each copied its expert up (one record, the same size in every
        # layer of this model); a slot is given up only for a newcomer, and at most the 4 slots are held
        fields = ("vram_swaps_in", "vram_swaps_out", "vram_bytes_up")
        layers = [[tuple(x[f] for f in fields) for x in e["layers"]] for e in events]  # type: ignore[attr-defined]
        for e, per_layer in zip(events, layers, strict=True):
            assert sum(n for n, _, _ in per_layer) == e["vram_swaps"]
            assert sum(b for _, _, b in per_layer) == e["vram_bytes_up"]
        row = sum(e["vram_bytes_up"] for e in events) // sum(swaps)  # type: ignore[misc]
        assert all(b == n * row for per_layer in layers for n, _, b in per_layer) and row > 0
        held = [sum(x[0] - x[1] for x in column) for column in zip(*layers, strict=True)]  # in − out, per layer
        assert all(0 < h <= 4 for h in held), held
        text = httpx.get(server.url + "/metrics").text
        assert 'tokenwing_expert_vram_hits_total{layer="0"}' in text
        assert 'tokenwing_expert_vram_swaps_in_total{layer="0"}' in text
    finally:
        err = server.stop()
    assert "computing on" in err and "in VRAM" in err, err


def test_run_stats_json(repacked_factory: ModelFactory, tmp_path: Path) -> None:
    model = repacked_factory(type="Q8_0", **SHAPE)
    budget = quarter_of_the_experts(model)
    out = tmp_path / "stats.json"
    r = run_cli(
        "run", str(model), "--prompt", "Hello", "-n", "24", "--ctx", "512", "--device", _kind(), "--vram-budget",
        budget, "--vram-layers", "0", "--no-usage-table", "--stats-json", str(out),
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    st = json.loads(out.read_text())
    assert st["vram"]["expert_slots"] == 4 and st["vram"]["layers"] == []
    assert st["counters"]["vram_swaps_in"] > 0 and st["vram_swaps_per_token"] > 0 and 0 < st["vram_hit_rate"] < 1
    tiers = st["tiers_per_layer"]
    for v, ram, drive in zip(tiers["vram"], tiers["ram"], tiers["drive"], strict=True):
        assert abs(v + ram + drive - 1) < 1e-9
