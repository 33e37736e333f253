"""Step-3.5-Flash (step35) against llama.cpp on the same GGUF, and streamed at a 25 % budget against resident.

Two geometries, both past their sliding window: the factory's (Step 3.5's proportions: a full layer with 4 query
heads, then three sliding-window layers with 6, 2 KV heads each, half of a 16-wide head rotated in the full layer
and all of it in the others, q/k norms, the head-wise gate, the RoPE factors, a dense first layer, the SwiGLU limit
in the last layer, a window of 128 over 160 positions) and another (a window of 32, full layers 0 and 3 of 6 with
one KV head against two, 6 query heads against 9, heads of 32 with 16 rotated in the sliding-window layers and 8 in
the full ones, 12 experts top-3, a tight SwiGLU limit that clamps): each of the window's mask, its rope base, the
per-layer heads, the halved rotary dims, the gate and the limits moves the logits far past the bar (break-checked,
docs/test-models.md).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from tests.conftest import ModelFactory
from tests.oracle.test_families import family_quantized_matches, family_streamed_matches, steps
from tests.oracle.test_logits import _repacked, _tokens, kl_per_position, llama_logits

pytestmark = pytest.mark.oracle

VARIANTS: dict[str, dict[str, object]] = {
    "factory": {"arch": "step35"},
    "other": {
        "arch": "step35",
        "n_layer": 6,
        "n_embd": 128,
        "n_head": 6,
        "n_head_kv": 2,
        "head_kv_full": 1,
        "head_dim": 32,
        "n_rot": 16,
        "full_attention_interval": 3,
        "sliding_window": 32,
        "n_expert": 12,
        "n_expert_used": 3,
        "rope_base": 1_000_000.0,
        "swiglu_limit": 0.5,
    },
}
# The quantized files' rows are multiples of 256 for the K-quants (the `kquant` preset)
KQUANT: dict[str, dict[str, object]] = {
    "factory": {},
    "other": {"n_embd": 256, "head_dim": 64, "n_rot": 32},
}


@pytest.mark.parametrize("variant", VARIANTS)
def test_f32_matches_llama_cpp(model_factory: ModelFactory, tmp_path: Path, variant: str) -> None:
    """160 positions, an 80-token prompt then decode steps past the window: within 1e-4 of llama.cpp's logits."""
    src = model_factory(type="F32", **VARIANTS[variant])  # type: ignore[arg-type]
    tokens = _tokens(160, 512, seed=11)
    ref = llama_logits(src, tokens, tmp_path)
    got, _ = steps(_repacked(src, tmp_path), tokens, 80)
    assert np.abs(ref - got).max() <= 1e-4
    assert kl_per_position(ref, got).mean() <= 1e-8


@pytest.mark.parametrize("type_name", ["Q8_0", "Q4_K_M"])
@pytest.mark.parametrize("variant", VARIANTS)
def test_quantized_matches_llama_cpp(model_factory: ModelFactory, tmp_path: Path, variant: str, type_name: str) -> None:
    """300 positions (a 200-token prompt, then 100 decode steps across position 256): mean KL <= 1e-4 and the same
    top-1 where llama.cpp's is clear, at test_families' tame weights (std 0.03)."""
    family_quantized_matches(model_factory, tmp_path, VARIANTS[variant], KQUANT[variant], type_name)


@pytest.mark.parametrize("variant", VARIANTS)
def test_streamed_at_a_quarter_is_bit_identical_to_resident(
    model_factory: ModelFactory, tmp_path: Path, variant: str
) -> None:
    """25 % of the expert bytes, lookahead 0 and 2: the same logits as every expert in RAM."""
    family_streamed_matches(model_factory, tmp_path, VARIANTS[variant], percent=25)
