"""`tokenwing autotune` sees the GPU: its VRAM (the Vulkan memory budget, CUDA's count, or NVML's on NVIDIA), the
copy speed between RAM and the device (measured), and the split of the model the VRAM tier would make."""

from __future__ import annotations

import json

import pytest

from tests.compute.conftest import DEVICES, device
from tests.conftest import ModelFactory, run_cli

pytestmark = pytest.mark.skipif(not DEVICES, reason="no device (ggml built for the CPU only)")


def test_autotune_measures_the_gpu_and_plans_the_split(repacked_factory: ModelFactory) -> None:
    model = repacked_factory(type="Q8_0", n_layer=3)
    kind = device(DEVICES[0]).kind
    r = run_cli("autotune", str(model), "--json", "--probe-bytes", "4M", "--ctx", "512", "--device", kind)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    g, s = out["machine"]["gpu"], out["settings"]
    assert g["name"] == DEVICES[0] and 0 < g["free"] <= g["total"] and g["budget"] <= g["free"]
    assert g["memory_source"] in ("NVML", "CUDA", "the Vulkan memory budget")
    assert g["up_gb_per_s"] > 0 and g["down_gb_per_s"] > 0
    assert s["device"] == kind
    assert "3 layers' attention" in s["vram_plan"] and s["vram_expert_share"] == 1.0  # a tiny model fits whole
    assert s["gpu_copy_gb_per_s"]["up"] > 0
    assert set(out["reasons"]) == set(s)
    r = run_cli("autotune", str(model), "--json", "--probe-bytes", "4M", "--device", "cpu")
    s = json.loads(r.stdout)["settings"]
    assert s["device"] == "cpu" and "vram_plan" not in s
