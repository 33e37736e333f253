"""Gemma 4 (gemma4) against llama.cpp on the same GGUF, and streamed at a 25 % budget against resident.

Two geometries, both past their sliding window: the factory's (every fourth layer full, its heads twice as wide with
half the KV heads and V from the key projection; sliding-window layers over 128 positions; every layer MoE, its gate
and up experts fused as the converter writes them) and
another (a dense layer first, every second layer full, a window of 32, a quarter of the sliding-window heads
rotated, and V caches of different widths, as 26B-A4B's: four KV heads of 32 in the sliding-window layers, one of 64
in the full ones, which write the first cells of the placement's; with those cells misplaced F32 fails).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from tests.conftest import ModelFactory
from tests.oracle.test_families import family_quantized_matches, family_streamed_matches, steps
from tests.oracle.test_logits import _repacked, _tokens, kl_per_position, llama_logits
from tokenwing.errors import BadInputError, UnsupportedError
from tokenwing.models.gemma4 import keys
from tokenwing.models.hparams import read_hparams
from tokenwing.testmodel import preset_shape
from tokenwing.testmodel.architectures import architecture

pytestmark = pytest.mark.oracle

VARIANTS: dict[str, dict[str, object]] = {
    "factory": {"arch": "gemma4", "n_layer": 4, "n_expert": 16, "n_expert_used": 4},
    "other": {
        "arch": "gemma4",
        "n_layer": 4,
        "n_embd": 128,
        "n_head": 4,
        "n_head_kv": 4,
        "head_dim": 32,
        "n_rot": 8,
        "head_dim_full": 64,
        "head_kv_full": 1,
        "full_attention_interval": 2,
        "sliding_window": 32,
        "n_dense_lead": 1,
        "n_expert": 12,
        "n_expert_used": 3,
        "rope_base": 10000.0,
        "fused_gate_up": False,  # (llama.cpp's loader takes both forms; the factory's is the converter's, fused)
    },
}
# The quantized files' rows are multiples of 256 for the K-quants (the `kquant` preset)
KQUANT: dict[str, dict[str, object]] = {"factory": {}, "other": {"n_embd": 256, "head_dim": 64, "head_dim_full": 128}}


@pytest.mark.parametrize("variant", VARIANTS)
def test_f32_matches_llama_cpp(model_factory: ModelFactory, tmp_path: Path, variant: str) -> None:
    """160 positions, an 80-token prompt then decode steps: within 1e-4 of llama.cpp's logits, or within llama.cpp's
    own distance from itself where that is larger. ggml's GELU reads an F16 table (GGML_GELU_FP16): an input one ulp
    apart can land on the next entry, so where F32 rounding differs (a batch of 512 tokens or one at a time)
    llama.cpp's own logits part by 8e-5 to 1e-4 on the factory's geometry, as far as ours do."""
    src = model_factory(type="F32", **VARIANTS[variant])  # type: ignore[arg-type]
    tokens = _tokens(160, 512, seed=11)
    ref = llama_logits(src, tokens, tmp_path)
    own = llama_logits(src, tokens, tmp_path, n_batch=1)
    got, _ = steps(_repacked(src, tmp_path), tokens, 80)
    assert np.abs(ref - got).max() <= max(1e-4, np.abs(ref - own).max())
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


@pytest.mark.parametrize(
    ("key", "value", "says"),
    [
        ("embedding_length_per_layer_input", 256, "per-layer embeddings and shared KV layers"),
        ("attention.shared_kv_layers", 2, "per-layer embeddings and shared KV layers"),
        ("attention.sliding_window_pattern", 4, "sliding_window_pattern must have one flag per layer"),
        ("attention.value_length_swa", 8, "key and value heads must be of one size"),
        ("final_logit_softcapping", "30", "final_logit_softcapping must be a number"),
    ],
)
def test_a_file_it_cannot_run_is_refused_in_one_line(key: str, value: object, says: str) -> None:
    """Gemma 4 E2B/E4B's per-layer embeddings and shared KV layers are not run; malformed keys are named."""
    s = preset_shape("tiny", "gemma4")
    meta = {k: v.value for k, v in architecture("gemma4").metadata(s).items()} | {f"gemma4.{key}": value}
    with pytest.raises((BadInputError, UnsupportedError), match=says):
        keys(read_hparams(meta, "gemma4", "m.gguf"), "m.gguf")


def test_without_a_full_layer_there_is_no_rope_freqs(model_factory: ModelFactory, tmp_path: Path) -> None:
    """Two sliding-window layers and no full one: llama.cpp creates rope_freqs with the first full layer, so such a
    file has none (the family's list leaves it out; llama.cpp refuses a file with a tensor it does not create)."""
    src = model_factory(type="F32", arch="gemma4", n_layer=2, full_attention_interval=4)
    tokens = _tokens(40, 512, seed=3)
    ref = llama_logits(src, tokens, tmp_path)
    got, s = steps(_repacked(src, tmp_path), tokens, 20)
    assert not s.model.weights.has("rope_freqs.weight")
    assert np.abs(ref - got).max() <= 1e-4
