"""Llama 4 (llama4) against llama.cpp on the same GGUF, and streamed at a 25 % budget against resident.

Two geometries: the factory's (Scout's form: 16 experts, the L2 norms of q and k on the RoPE layers; dense and MoE
layers interleaved as Maverick's, step 2; RoPE factors) and Maverick's (128 experts, so no L2 norms; every layer
with experts, step 1), the latter over 8,300 positions: past llama.cpp's first attention chunk (8,192), so that its
RoPE layers attend within the new chunk and its NoPE layers scale their queries by the next temperature (from
position 8,191), in the prompt and in decode steps.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from tests.conftest import ModelFactory, assert_clean_error
from tests.format.test_hostile_header import run_limited, set_int
from tests.oracle.test_families import family_quantized_matches, family_streamed_matches, steps
from tests.oracle.test_logits import _repacked, _tokens, kl_per_position, llama_logits

pytestmark = pytest.mark.oracle

VARIANTS: dict[str, dict[str, object]] = {
    "factory": {"arch": "llama4", "n_layer": 4, "n_expert": 16},
    "maverick": {
        "arch": "llama4",
        "n_layer": 4,
        "n_embd": 64,
        "n_head": 4,
        "n_head_kv": 1,
        "head_dim": 16,
        "n_expert": 128,
        "n_ff_exp": 16,
        "n_ff_shexp": 16,
        "moe_layer_step": 1,
        "context_length": 16384,
    },
}
# Positions of each geometry's F32 test and its prompt (the rest decode steps, one at a time)
POSITIONS = {"factory": (160, 80), "maverick": (8208, 8200)}
# The quantized files' rows are multiples of 256 for the K-quants (the `kquant` preset)
KQUANT: dict[str, dict[str, object]] = {"factory": {}, "maverick": {"n_embd": 256, "head_dim": 64, "n_ff_exp": 256}}
KQUANT["maverick"]["n_ff_shexp"] = 256


@pytest.mark.parametrize("variant", VARIANTS)
def test_f32_matches_llama_cpp(model_factory: ModelFactory, tmp_path: Path, variant: str) -> None:
    """Within 1e-4 of llama.cpp's logits at every position: 160 on the factory's geometry, 8,300 on Maverick's
    (a prompt of 8,250 that crosses the first chunk's end, then decode steps in the second chunk)."""
    src = model_factory(type="F32", **VARIANTS[variant])  # type: ignore[arg-type]
    n, n_prompt = POSITIONS[variant]
    tokens = _tokens(n, 512, seed=11)
    ref = llama_logits(src, tokens, tmp_path)
    got, _ = steps(_repacked(src, tmp_path), tokens, n_prompt, max_batch=512)  # (16 prompt graphs, not 128)
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


def test_more_than_one_expert_a_token_is_refused(repacked_factory: ModelFactory, tmp_path: Path) -> None:
    """The router weights the expert's input, which the engine computes for one expert a token (both Llama 4
    models): a file routing two is refused by verify (as a start would) in one line, exit 4 (unsupported), not
    computed otherwise (inspect and repack still show and convert such a variant, as for any family)."""
    crafted = set_int(repacked_factory(arch="llama4"), tmp_path / "m.tw.gguf", "llama4.expert_used_count", 2)
    r = run_limited("verify", str(crafted))
    assert_clean_error(r, 4)
    assert "llama4 with 2 experts a token is not run" in r.stderr, r.stderr
