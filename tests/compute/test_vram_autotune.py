"""`tokenwing autotune` sees the GPU: its VRAM (the Vulkan memory budget, CUDA's count, or NVML's on NVIDIA), the
copy speed between RAM and the device and the CPU's RAM read speed (measured), the split of the model the VRAM
tier would make, and whether lending the VRAM expert cache to prompts pays (`lend_pays`)."""

from __future__ import annotations

import dataclasses
import json

import pytest

from tests.compute.conftest import DEVICES, device
from tests.conftest import ModelFactory, run_cli
from tokenwing.autotune.probe import MachineProbe
from tokenwing.autotune.solver import REPLY_TOKENS, LendCase, choose, lend_pays
from tokenwing.format.reader import ModelFile
from tokenwing.runtime.placement import plan_for_file
from tokenwing.runtime.preflight import preflight
from tokenwing.streaming.memory import memory_info

GiB, MiB = 1 << 30, 1 << 20


@pytest.mark.skipif(not DEVICES, reason="no device (ggml built for the CPU only)")
def test_autotune_measures_the_gpu_and_plans_the_split(repacked_factory: ModelFactory) -> None:
    model = repacked_factory(type="Q8_0", n_layer=3)
    kind = device(DEVICES[0]).kind
    r = run_cli("autotune", str(model), "--json", "--probe-bytes", "4M", "--ctx", "512", "--device", kind)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    g, s = out["machine"]["gpu"], out["settings"]
    assert g["name"] == DEVICES[0] and 0 < g["free"] <= g["total"] and g["budget"] <= g["free"]
    assert g["memory_source"] in ("NVML", "CUDA", "the Vulkan memory budget")
    assert g["up_gb_per_s"] > 0 and g["down_gb_per_s"] > 0 and g["ram_gb_per_s"] > 0
    assert s["device"] == kind
    assert "3 layers' attention" in s["vram_plan"] and s["vram_expert_share"] == 1.0  # a tiny model fits whole
    assert s["vram_lend"] is False and "every expert fits" in out["reasons"]["vram_lend"]
    assert s["gpu_copy_gb_per_s"]["up"] > 0
    assert set(out["reasons"]) == set(s)
    r = run_cli("autotune", str(model), "--json", "--probe-bytes", "4M", "--device", "cpu")
    s = json.loads(r.stdout)["settings"]
    assert s["device"] == "cpu" and "vram_plan" not in s


# A big GPU's case: 60 streamed layers of 256 experts (3 MiB each, top-8), lending 1 GiB of compute buffer for 30
# more experts per layer; every expert in RAM
BIG = LendCase(
    slots=100,
    slots_lent=130,
    n_expert=256,
    n_used=8,
    layers=60,
    expert_bytes=3 * MiB,
    lent_bytes=GiB,
    lendable_bytes=20 * GiB,
    hit_share=30 / 256,
    up_gb_per_s=25.0,
    ram_gb_per_s=50.0,
    ram_share=1.0,
    drive_mb_per_s=2000.0,
)


def test_lending_pays_where_the_refill_is_repaid_within_a_reply() -> None:
    # refill 2^30 B / 25 GB/s = 42.9 ms; 60 · 8 · 30/256 = 56.25 more VRAM experts a token, each 3 MiB / 50 GB/s
    # = 63 µs of CPU: 3.54 ms a token, so 12 tokens pay the refill back
    on, why = lend_pays(BIG)
    assert on and "paid back after 12 decode tokens" in why and "42.9 ms a prompt" in why and "56.25" in why
    # a slow link (PCIe x1-like): 2.1 s a prompt, 607 tokens
    on, why = lend_pays(dataclasses.replace(BIG, up_gb_per_s=0.5))
    assert not on and "607 decode tokens" in why and f"more than {REPLY_TOKENS}" in why


def test_a_refill_the_ram_cannot_serve_reads_the_drive() -> None:
    # half the experts in RAM: half the refill from the drive, 2^29 B at 2000 MB/s = 268 ms (88 tokens: on), at
    # 1000 MB/s 537 ms (164 tokens: off)
    on, why = lend_pays(dataclasses.replace(BIG, ram_share=0.5))
    assert on and "50% of it from the drive at 2000 MB/s" in why and "88 decode tokens" in why
    assert not lend_pays(dataclasses.replace(BIG, ram_share=0.5, drive_mb_per_s=1000.0))[0]


def test_lending_is_off_where_it_cannot_help() -> None:
    assert lend_pays(dataclasses.replace(BIG, slots=256, slots_lent=256)) == (
        False,
        "every expert fits in VRAM without lending",
    )
    assert not lend_pays(dataclasses.replace(BIG, slots_lent=100))[0]
    # a small GPU: the cache cannot lend what a prompt computes with (spec §11: long prompts got slower)
    on, why = lend_pays(dataclasses.replace(BIG, lendable_bytes=GiB // 2))
    assert not on and "chunks would shrink" in why


def test_the_autotuner_costs_lending_from_the_plans(repacked_factory: ModelFactory) -> None:
    """The solver's inputs: the VRAM plans with and without lending for a budget that holds a quarter of the
    experts, and the probe's speeds (given here: the device's probe is the test above). A fast link turns lending
    on, a slow one off, each with its numbers."""
    path = repacked_factory(type="Q8_0", arch="qwen3moe", n_layer=3, n_expert=32, n_ff_exp=256)
    with ModelFile.open(str(path)) as mf:
        hp = preflight(mf).hp
        whole = plan_for_file(mf, hp, 1 << 30, 512)
        row = whole.expert_bytes // whole.n_expert
        budget = whole.reserve + whole.layer_bytes + whole.head_bytes + 8 * row
        gpu = {"kind": "vulkan", "free": budget, "total": budget, "memory_source": "the Vulkan memory budget"}
        gpu |= {"budget": budget, "budget_reason": "a test", "up_gb_per_s": 25.0, "down_gb_per_s": 20.0}
        gpu |= {"pinned": True, "ram_gb_per_s": 50.0}
        probe = MachineProbe(memory_info(), 2, [], [], None, [], gpu, "computing on Vulkan0")
        fast = choose(mf, probe, 512)
        probe.gpu = {**gpu, "up_gb_per_s": 0.001}
        slow = choose(mf, probe, 512)
    assert fast.settings["vram_lend"] is True and slow.settings["vram_lend"] is False
    why = fast.reasons["vram_lend"]
    assert why.startswith("8 → ") and "hits every expert alike: no usage table yet" in why, why
    assert "refilled at the measured 25.0 GB/s" in why and "50.0 GB/s RAM read speed" in why
