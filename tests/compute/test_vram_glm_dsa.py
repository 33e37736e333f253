"""GLM-5.2 (`glm-dsa`) with a GPU (lavapipe here): its layers compute on the CPU — the indexer's Hadamard matrix and
the shared layers' picks are host tensors of the model's, which the tier's graph check finds — while every expert
and the head sit in VRAM, and the logits are llama.cpp's; streamed with part of the experts in VRAM too."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.compute.test_vram import N_DECODE, N_PROMPT, MiB, _tier_use, budgets, check, run, seed_usage
from tests.compute.test_vram import kind as kind  # (the device fixture: each device ggml shows)
from tests.conftest import ModelFactory
from tests.oracle.test_logits import _repacked, _tokens, llama_logits

pytestmark = [pytest.mark.oracle, pytest.mark.own_process]


def test_glm_dsa_keeps_its_layers_on_the_cpu_and_the_experts_in_vram(
    kind: str, model_factory: ModelFactory, tmp_path: Path
) -> None:
    src = model_factory(arch="glm-dsa", type="Q8_0", n_layer=4, indexer_types=(1, 0, 1, 0), weight_std=0.03)
    path = _repacked(src, tmp_path)
    seed_usage(path)
    tokens = _tokens(N_PROMPT + N_DECODE, 512, seed=22)
    ref = llama_logits(src, tokens, tmp_path)
    everything = run(path, tokens, kind, 256 * MiB)
    layers, slots, hits = _tier_use(everything, 0)
    assert layers == 0 and slots == everything.costs[0].n_expert and hits > 0, (layers, slots, hits)
    assert everything.stats["vram"]["head"]
    check(ref, everything.logits)
    budget, opts = budgets(everything)["some layers, some experts, streamed"]
    part = run(path, tokens, kind, budget, **opts)
    layers, slots, hits = _tier_use(part, 0)
    assert layers == 0 and 0 < slots < everything.costs[0].n_expert and hits > 0, (layers, slots, hits)
    check(ref, part.logits)
