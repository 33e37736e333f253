"""The hybrid linear-attention MoEs against llama.cpp on the same GGUF — Qwen3-Next (gated DeltaNet), Qwen3.5
(its separate α/β projections and IMRoPE), Ling 3.0 (KDA with gated MLA) — and their recurrent state: streamed,
split into passes and resumed from checkpoints, bit-identical to resident and to one fresh pass.

Each test prompt spans several layer-major chunks (max_batch 64: 200 tokens are 4 chunks) and the decode steps run
past position 256 (a new decode window); the recurrent state carries across all of them.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from tests.conftest import ModelFactory
from tests.oracle.test_families import VARIANTS as FAMILY_VARIANTS
from tests.oracle.test_families import clear_top1, steps, streamed_matches_resident
from tests.oracle.test_logits import _repacked, _tokens, kl_per_position, llama_logits
from tokenwing.format.reader import ModelFile
from tokenwing.runtime.session import Session, SessionOptions

pytestmark = pytest.mark.oracle

VARIANTS: dict[str, dict[str, object]] = {
    # 3 linear layers (2 key heads shared by 4 value heads) and 1 gated full-attention layer
    "qwen3next": {"arch": "qwen3next", "n_layer": 4},
    "qwen3next-ssm-in": {"arch": "qwen3next", "n_layer": 4, "legacy_ssm_in": True},  # the older converter's files
    # IMRoPE with a fourth-axis section: one of every three rotary pairs takes position 0 (unrotated), so that text
    # positions on three axes differ from plain NEOX RoPE (Qwen3.5's own sections cover every pair)
    "qwen35moe": {"arch": "qwen35moe", "n_layer": 4, "n_rot": 8, "rope_sections": (1, 1, 0, 1)},
    # KDA, KDA, MLA, MLA (layer_group_size 3), a leading dense layer
    "ling": {"arch": "bailingmoe3", "n_layer": 4},
    # + expert groups, SwiGLU limits in the last layer, an MTP block (neither loaded nor run)
    "ling-groups-limits-mtp": {
        "arch": "bailingmoe3",
        "n_layer": 5,
        "n_expert": 16,
        "n_expert_used": 4,
        "n_expert_group": 4,
        "n_group_used": 2,
        "swiglu_limit": 0.4,
        "n_mtp": 1,
    },
}
QUANTIZED = ["qwen3next", "qwen35moe", "ling"]


@pytest.mark.parametrize("variant", VARIANTS)
def test_f32_matches_llama_cpp(model_factory: ModelFactory, tmp_path: Path, variant: str) -> None:
    """320 positions: a 200-token prompt (4 chunks), then 120 decode steps across position 256."""
    src = model_factory(type="F32", **VARIANTS[variant])  # type: ignore[arg-type]
    tokens = _tokens(320, 512, seed=21)
    ref = llama_logits(src, tokens, tmp_path)
    got, s = steps(_repacked(src, tmp_path), tokens, 200)
    assert s.one_graph_steps  # type: ignore[attr-defined]
    assert np.abs(ref - got).max() <= 1e-4
    assert kl_per_position(ref, got).mean() <= 1e-8


@pytest.mark.parametrize("variant", QUANTIZED)
@pytest.mark.parametrize("type_name", ["Q8_0", "Q4_K_M"])
def test_quantized_matches_llama_cpp(model_factory: ModelFactory, tmp_path: Path, variant: str, type_name: str) -> None:
    """300 positions (a 200-token prompt, then 100 decode steps across position 256): mean KL ≤ 1e-4 and the same
    top-1 on ≥ 99 % of the positions where llama.cpp's top-1 leads by more than 0.1 logit (weights at 0.03, as
    test_families.py explains)."""
    shape = dict(VARIANTS[variant], weight_std=0.03)
    if type_name.startswith("Q4_K"):
        shape["preset"] = "kquant"  # row lengths that are multiples of 256
    src = model_factory(type=type_name, **shape)  # type: ignore[arg-type]
    tokens = _tokens(300, 512, seed=22)
    ref = llama_logits(src, tokens, tmp_path)
    got, _ = steps(_repacked(src, tmp_path), tokens, 200)
    kl = kl_per_position(ref, got)
    assert kl.mean() <= 1e-4, kl.mean()
    assert clear_top1(ref, got) >= 0.99, clear_top1(ref, got)


@pytest.mark.parametrize("variant", ["qwen3next", "qwen35moe", "ling-groups-limits-mtp"])
def test_streamed_is_bit_identical_to_resident(model_factory: ModelFactory, tmp_path: Path, variant: str) -> None:
    """A 10 % expert budget (prompt experts in waves, decode experts read as they are selected or predicted, the
    routers of the next layers applied to every layer's output whatever its attention), lookahead 0 and 2: the
    same logits as every expert in RAM (decode as one graph per token there)."""
    model = _repacked(model_factory(type="Q8_0", **VARIANTS[variant]), tmp_path)  # type: ignore[arg-type]
    streamed_matches_resident(model, _tokens(160, 512, seed=23))


def _session(model: Path, **opts: object) -> Session:
    options = SessionOptions(kv_type="f32", n_ctx=512, max_batch=16, **opts)  # type: ignore[arg-type]
    return Session(str(model), options, log=lambda line: None)


@pytest.mark.parametrize("variant", ["qwen35moe", "ling", "kimi-k3"])
def test_prompt_split_into_passes_is_identical(model_factory: ModelFactory, tmp_path: Path, variant: str) -> None:
    """No free memory beyond a 2-slot cache: a 120-token prompt runs as passes of one chunk each, every layer's
    state carried from pass to pass — the same logits, to the bit, as one pass (and as one pass with all experts
    in RAM). (Kimi K3: its residual's checkpoints are per token, rebuilt by each pass.)"""
    shape = VARIANTS.get(variant) or FAMILY_VARIANTS[variant]
    model = _repacked(model_factory(type="Q8_0", **shape), tmp_path)  # type: ignore[arg-type]
    tokens = _tokens(120, 512, seed=24).tolist()
    lines: list[str] = []
    split = Session(
        str(model), SessionOptions(kv_type="f32", n_ctx=512, max_batch=16, ram_budget=1, prompt_memory=0), lines.append
    )
    try:
        got = split.forward(tokens, all_logits=True)
        after = split.forward([7])
    finally:
        split.close()
    assert any("running it 16 tokens at a time" in line for line in lines), lines
    for opts in ({"ram_budget": 1, "prompt_memory": 1 << 30}, {"cpu_repack": False}):
        one = _session(model, **opts)
        try:
            assert np.array_equal(one.forward(tokens, all_logits=True), got), opts
            assert np.array_equal(one.forward([7]), after), opts
        finally:
            one.close()


def test_mtp_block_of_ling_is_neither_loaded_nor_streamed(model_factory: ModelFactory, tmp_path: Path) -> None:
    """Ling 3.0's next-token-prediction block: kept in the file, never read (the F32 comparison above shows the
    output is llama.cpp's, which runs the main model without it)."""
    model = _repacked(model_factory(type="Q8_0", **VARIANTS["ling-groups-limits-mtp"]), tmp_path)  # type: ignore[arg-type]
    _, s = steps(model, _tokens(40, 512, seed=25), 20)
    mtp = s.hp.n_layer
    assert s.hp.n_mtp == 1 and mtp == 5
    assert not [name for name in s.model.weights.tensors if name.startswith(f"blk.{mtp}.")]
    assert mtp not in s.scheduler.layers and s.counters().shape[0] == len(s.streamed)
    with ModelFile.open(str(model)) as mf:
        assert any(t.name.startswith(f"blk.{mtp}.nextn.") for t in mf.kept)
