"""Qwen3-VL MoE's text part (qwen3vlmoe) against llama.cpp on the same GGUF, and streamed against resident.

Its IMRoPE (ggml_rope_multi with the file's sections, a text position on three axes and 0 on the fourth) is checked
by the logits: 160 positions in F32 within 1e-4 of llama.cpp's, prompt and decode steps across a 128-position
window boundary; plain NEOX RoPE is 0.28 off on the second geometry.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import ModelFactory
from tests.oracle.test_families import (
    f32_matches_llama_cpp,
    family_streamed_matches,
    quantized_matches_llama_cpp,
)

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
    f32_matches_llama_cpp(model_factory(type="F32", **VARIANTS[variant]), tmp_path)  # type: ignore[arg-type]


@pytest.mark.parametrize(("variant", "type_name"), [("factory", "Q8_0"), ("factory", "Q4_K_M"), ("wide-heads", "Q8_0")])
def test_quantized_matches_llama_cpp(model_factory: ModelFactory, tmp_path: Path, variant: str, type_name: str) -> None:
    """test_families' bar (300 positions: mean KL <= 1e-4, clear top-1s kept) at its tame weights (std 0.03)."""
    shape = dict(VARIANTS[variant], weight_std=0.03)
    if type_name.startswith("Q4_K"):
        shape["preset"] = "kquant"  # rows of 256: heads of 64, IMRoPE sections [12, 10, 10, 0]
    quantized_matches_llama_cpp(model_factory(type=type_name, **shape), tmp_path)  # type: ignore[arg-type]


@pytest.mark.parametrize("variant", VARIANTS)
def test_streamed_at_a_quarter_is_bit_identical_to_resident(
    model_factory: ModelFactory, tmp_path: Path, variant: str
) -> None:
    """25 % of the expert bytes, lookahead 0 and 2: the same logits as every expert in RAM."""
    family_streamed_matches(model_factory, tmp_path, VARIANTS[variant], percent=25)
