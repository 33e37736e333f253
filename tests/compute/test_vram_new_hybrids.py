"""Issue 25's linear-attention families with a GPU (lavapipe here) — Qwen3.8 Flash Next (`qwen4exp`: DeltaNet, 4
hyper-connection streams between layers, the n-gram table) and Kimi K3 (KDA, the residual's checkpoints): their
layers stay on the CPU (the recurrent state and the widened residual live in RAM), every expert and the head sit in
VRAM, and the logits are llama.cpp's; then streamed, a quarter of the experts in VRAM and the RAM cache at its
minimum, llama.cpp's again. (test_vram.py's HYBRIDS test has them all in VRAM only.)"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from tests.compute.test_vram import _tier_use, budgets, case, check, run
from tests.compute.test_vram import kind as kind  # (the device fixture: each device ggml shows)
from tests.conftest import ModelFactory
from tests.oracle.test_logits import kl_per_position

pytestmark = [pytest.mark.oracle, pytest.mark.own_process]


@pytest.mark.parametrize("family", ["qwen4exp", "kimi-k3"])
def test_layers_on_the_cpu_and_experts_streamed_through_vram(
    kind: str, model_factory: ModelFactory, tmp_path: Path, family: str
) -> None:
    path, tokens, ref = case(f"vram-{family}-Q8_0", model_factory, tmp_path)
    cpu = run(path, tokens, None)
    check(ref, cpu.logits)
    everything = run(path, tokens, kind, 256 << 20)
    layers, slots, hits = _tier_use(everything, 0)
    assert layers == 0 and slots == everything.costs[0].n_expert and hits > 0, (layers, slots, hits)
    assert everything.stats["vram"]["head"]
    check(ref, everything.logits)
    budget, opts = budgets(everything)["some layers, some experts, streamed"]
    part = run(path, tokens, kind, budget, **opts)
    layers, slots, hits = _tier_use(part, 0)
    assert layers == 0 and 0 < slots < everything.costs[0].n_expert and hits > 0, (layers, slots, hits)
    assert part.stats["slots_per_layer"] < everything.costs[0].n_expert  # the drive streams the rest
    check(ref, part.logits)
    # the device changes only the rounding of the experts' and the head's products
    assert kl_per_position(cpu.logits, part.logits).mean() <= 1e-4
    print(
        family, "KL vs llama.cpp: cpu", kl_per_position(ref, cpu.logits).mean(),
        "vram", kl_per_position(ref, everything.logits).mean(),
        "streamed", kl_per_position(ref, part.logits).mean(),
        "max |d| streamed vs cpu", float(np.abs(cpu.logits - part.logits).max()),
    )  # fmt: skip
