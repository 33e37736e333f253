"""Qwen3-VL MoE's text part (qwen3vlmoe) against llama.cpp on the same GGUF, and streamed against resident.

Its IMRoPE (ggml_rope_multi with the file's sections, a text position on three axes and 0 on the fourth) is checked
by the logits: 160 positions in F32 within 1e-4 of llama.cpp's, prompt and decode steps across a 128-position
window boundary; plain NEOX RoPE is 0.28 off on the second geometry.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from tests.conftest import ModelFactory
from tests.oracle.test_families import clear_top1, steps, streamed_matches_resident
from tests.oracle.test_logits import _repacked, _tokens, kl_per_position, llama_logits

pytestmark = pytest.mark.oracle

VARIANTS: dict[str, dict[str, object]] = {
    # the factory's model: 4 layers, 16 experts, top-4, heads of 16 (IMRoPE sections [4, 2, 2, 0])
    "factory": {"arch": "qwen3vlmoe", "n_layer": 4, "n_expert": 16, "n_expert_used": 4},
    # a second geometry: 8 query heads of 32 over 2 KV heads, 3 layers, 32 experts, top-8; sections [6, 4, 4, 0]
    # leave two of the 16 pairs to the fourth axis (not rotated for text), and rope base 10,000 turns the slow pairs
    # far enough that plain NEOX RoPE is 0.28 off llama.cpp's logits here
    "wide-heads": {
        "arch": "qwen3vlmoe",
        "n_layer": 3,
        "n_head": 8,
        "head_dim": 32,
        "n_expert": 32,
        "n_expert_used": 8,
        "rope_sections": (6, 4, 4, 0),
        "rope_base": 10000.0,
    },
}


@pytest.mark.parametrize("variant", VARIANTS)
def test_f32_matches_llama_cpp(model_factory: ModelFactory, tmp_path: Path, variant: str) -> None:
    src = model_factory(type="F32", **VARIANTS[variant])  # type: ignore[arg-type]
    tokens = _tokens(160, 512, seed=11)
    ref = llama_logits(src, tokens, tmp_path)
    got, _ = steps(_repacked(src, tmp_path), tokens, 80)
    assert np.abs(ref - got).max() <= 1e-4
    assert kl_per_position(ref, got).mean() <= 1e-8


@pytest.mark.parametrize(("variant", "type_name"), [("factory", "Q8_0"), ("factory", "Q4_K_M"), ("wide-heads", "Q8_0")])
def test_quantized_matches_llama_cpp(model_factory: ModelFactory, tmp_path: Path, variant: str, type_name: str) -> None:
    """300 positions (a 200-token prompt, then 100 decode steps across position 256): mean KL <= 1e-4 and the same
    top-1 where llama.cpp's is clear, at test_families' tame weights (std 0.03)."""
    shape = dict(VARIANTS[variant], weight_std=0.03)
    if type_name.startswith("Q4_K"):
        shape["preset"] = "kquant"  # rows of 256: heads of 64, IMRoPE sections [12, 10, 10, 0]
    src = model_factory(type=type_name, **shape)  # type: ignore[arg-type]
    tokens = _tokens(300, 512, seed=12)
    ref = llama_logits(src, tokens, tmp_path)
    got, _ = steps(_repacked(src, tmp_path), tokens, 200)
    kl = kl_per_position(ref, got)
    assert kl.mean() <= 1e-4, kl.mean()
    assert clear_top1(ref, got) >= 0.99


@pytest.mark.parametrize("variant", VARIANTS)
def test_streamed_at_a_quarter_is_bit_identical_to_resident(
    model_factory: ModelFactory, tmp_path: Path, variant: str
) -> None:
    """25 % of the expert bytes, lookahead 0 and 2: the same logits as every expert in RAM."""
    model = _repacked(model_factory(type="Q8_0", **VARIANTS[variant]), tmp_path)  # type: ignore[arg-type]
    streamed_matches_resident(model, _tokens(160, 512, seed=13), percent=25)
