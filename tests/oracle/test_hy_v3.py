"""Hy3 (hy_v3) against llama.cpp on the same GGUF, and streamed at a 25 % budget against resident.

Two geometries: the factory's (GQA with per-head q/k norms, a dense layer first, a sigmoid router with a selection
bias whose top-k weights are normalised and x2.5, one shared expert as wide as a routed one) and another (one KV
head of 32, no dense layer, weights x1, a shared expert twice a routed one's width as the converter writes
num_shared_experts 2, an MTP block kept in the file and not run). Hy3 has no sliding window or sinks: every layer
attends over the whole context, which the 300-position quantized cases cross the decode window at 256 with.
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
    "factory": {"arch": "hy_v3", "n_layer": 4, "n_expert": 16, "n_expert_used": 4},
    "other": {
        "arch": "hy_v3",
        "n_layer": 3,
        "n_mtp": 1,
        "n_embd": 128,
        "n_head": 4,
        "n_head_kv": 1,
        "head_dim": 32,
        "n_expert": 12,
        "n_expert_used": 3,
        "n_dense_lead": 0,
        "n_shared_exp": 2,
        "n_ff_shexp": 32,
        "expert_weights_scale": 1.0,
    },
}
# The quantized files' rows are multiples of 256 for the K-quants (the `kquant` preset): the other geometry at
# heads of 64 in a hidden size of 256
KQUANT: dict[str, dict[str, object]] = {"factory": {}, "other": {"n_embd": 256, "head_dim": 64, "n_ff_shexp": 128}}


@pytest.mark.parametrize("variant", VARIANTS)
def test_f32_matches_llama_cpp(model_factory: ModelFactory, tmp_path: Path, variant: str) -> None:
    """160 positions, an 80-token prompt then decode steps: within 1e-4 of llama.cpp's logits; the MTP block's
    tensors are not loaded; the dense layers are those without a router (no leading_dense_block_count key)."""
    src = model_factory(type="F32", **VARIANTS[variant])  # type: ignore[arg-type]
    tokens = _tokens(160, 512, seed=11)
    ref = llama_logits(src, tokens, tmp_path)
    got, s = steps(_repacked(src, tmp_path), tokens, 80)
    assert np.abs(ref - got).max() <= 1e-4
    assert kl_per_position(ref, got).mean() <= 1e-8
    assert s.hp.n_mtp == VARIANTS[variant].get("n_mtp", 0)
    assert s.hp.n_dense_lead == 0  # (the key is not written: the streamed layers say which run experts)
    n_dense = 1 if variant == "factory" else 0
    assert s.model.streamed == list(range(n_dense, s.hp.n_layer))
    assert not [name for name in s.model.weights.tensors if name.startswith(f"blk.{s.hp.n_layer}.")]


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
