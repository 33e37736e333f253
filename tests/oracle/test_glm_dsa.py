"""GLM-5 (`glm-dsa`: MLA whose keys the DSA lightning indexer picks) against llama.cpp on the same GGUF, in RAM and
streamed: a prompt, then decode steps; quantised across a 256-position boundary (a new decode window)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import ModelFactory
from tests.oracle.test_families import clear_top1, steps
from tests.oracle.test_logits import _repacked, _tokens, kl_per_position, llama_logits
from tokenwing.format.gguf_io import read_header
from tokenwing.format.reader import ModelFile
from tokenwing.models import kv_bytes_per_token
from tokenwing.models.glm_dsa import GlmDsa, hadamard, indexer_full
from tokenwing.models.hparams import read_hparams
from tokenwing.runtime.session import Session, SessionOptions

pytestmark = pytest.mark.oracle

A = "glm-dsa"
# Geometries: the tiny preset (an indexer of 4 heads of 64 keeping 8 of 160 tokens), GLM-5.2's shared layers (each
# after its full one; three after two full ones, keeping 5; by llama.cpp's defaults), one indexer head keeping one
# token over wider MLA heads, a top-k above the context (every key: plain MLA), an MTP block in the file.
VARIANTS: dict[str, dict[str, object]] = {
    "tiny": {"n_layer": 3},
    "glm-5.2": {"n_layer": 4, "indexer_types": (1, 0, 1, 0)},
    "glm-5.2-runs": {"n_layer": 5, "indexer_types": (1, 1, 0, 0, 0), "indexer_top_k": 5},
    # a million-token context without the types key: llama.cpp's GLM-5.2 defaults (layers 0-2 full, 3 and 4 shared)
    "glm-5.2-defaults": {"n_layer": 5, "context_length": 1048576},
    "one-pick": {"n_layer": 2, "indexer_n_head": 1, "indexer_top_k": 1, "head_dim": 80, "n_rot": 32},
    "dense": {"n_layer": 2, "indexer_top_k": 4096, "n_dense_lead": 0},
    "mtp": {"n_layer": 3, "n_mtp": 1, "indexer_head_size": 128, "indexer_top_k": 24},
}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_f32_matches_llama_cpp(model_factory: ModelFactory, tmp_path: Path, variant: str) -> None:
    src = model_factory(arch=A, **VARIANTS[variant])
    tokens = _tokens(160, 512, seed=11)
    ref = llama_logits(src, tokens, tmp_path)
    got, _ = steps(_repacked(src, tmp_path), tokens, 80)
    assert np.abs(ref - got).max() <= 1e-4
    assert kl_per_position(ref, got).mean() <= 1e-8


@pytest.mark.parametrize("type_name", ["Q8_0", "Q4_K_M", "MXFP4_MOE"])
def test_quantized_matches_llama_cpp(model_factory: ModelFactory, tmp_path: Path, type_name: str) -> None:
    """300 positions (a 200-token prompt, then 100 decode steps across position 256), weights at 0.03 (tame, as
    the other families' tests), GLM-5.2's sharing: mean KL ≤ 1e-4 and no larger than llama.cpp's with only its KV
    cache in F16, and the same top-1 where llama.cpp's leads by more than 0.1 logit."""
    shape: dict[str, object] = {"n_layer": 3, "weight_std": 0.03, "indexer_types": (1, 0, 1)}
    if type_name.startswith("Q4_K"):
        shape["preset"] = "kquant"
    src = model_factory(arch=A, type=type_name, **shape)
    tokens = _tokens(300, 512, seed=12)
    ref = llama_logits(src, tokens, tmp_path)
    floor = kl_per_position(ref, llama_logits(src, tokens, tmp_path, f16_kv=True)).mean()
    got, _ = steps(_repacked(src, tmp_path), tokens, 200)
    kl = kl_per_position(ref, got).mean()
    assert kl <= 1e-4 and kl <= max(floor, 1e-12), (kl, floor)
    assert clear_top1(ref, got) >= 0.99


def test_streamed_at_a_quarter_is_resident_and_llama_cpp(model_factory: ModelFactory, tmp_path: Path) -> None:
    """A quarter of the expert bytes (experts read as they are selected, lookahead 2): the logits of every expert in
    RAM, bit for bit, and llama.cpp's (Q8_0: bit-exact there too)."""
    src = model_factory(
        arch=A, type="Q8_0", n_layer=4, n_expert=16, n_expert_used=4, weight_std=0.03, indexer_types=(1, 0, 1, 0)
    )
    model = _repacked(src, tmp_path)
    tokens = _tokens(160, 512, seed=13)
    with ModelFile.open(str(model)) as mf:
        budget = mf.index.total_bytes // 4
    resident, _ = steps(model, tokens, 100, cpu_repack=False)
    streamed, s = steps(model, tokens, 100, cpu_repack=False, ram_budget=budget, lookahead=2)
    assert s.slots_per_layer < s.hp.n_expert
    assert np.array_equal(resident, streamed)
    ref = llama_logits(src, tokens, tmp_path)
    assert kl_per_position(ref, streamed).mean() <= 1e-8


def test_kv_bytes_per_token_holds_the_latent_and_the_indexer_keys(model_factory: ModelFactory) -> None:
    """Per layer the latent and rope key (MLA) and the indexer's key, in the cache's type — llama.cpp's two caches;
    GLM-5 (78 layers of 512 + 64 + 128 at F16) 109,824 bytes a token; GLM-5.2 (21 of its 78 layers with an
    indexer, by llama.cpp's default types for a million-token context) 95,232, and the 2,048 picks its shared layers
    read, 8,192 more."""
    path = model_factory(arch=A, n_layer=3)
    meta = {k: v.value for k, v in read_header(str(path)).kv.items()}
    hp = read_hparams(meta, A, "t")
    assert kv_bytes_per_token(meta, A, "t") == 3 * (64 + 16 + 64) * 2
    indexer = {"attention.indexer.key_length": 128, "attention.indexer.top_k": 2048}
    glm5 = dataclasses.replace(hp, n_layer=78, kv_lora_rank=512, n_rot=64, keys={**hp.keys, **indexer})
    assert GlmDsa.kv_bytes_per_token(glm5) == 109_824
    glm52 = dataclasses.replace(glm5, n_ctx_train=1_048_576)
    assert sum(indexer_full(glm52, il) for il in range(78)) == 21
    assert GlmDsa.kv_bytes_per_token(glm52) == 95_232 + 4 * 2048


def test_hadamard_is_llama_cpps_rotation() -> None:
    h = hadamard(128)
    assert h.dtype == np.float32 and np.allclose(h @ h, np.eye(128), atol=1e-6)
    assert np.all(np.abs(h) == np.float32(1.0) / np.sqrt(np.float32(128)))
    assert np.all(h[0] > 0) and h[1, 1] < 0  # Sylvester's order: [[H, H], [H, -H]]


@pytest.mark.parametrize("budget", [None, 1])
def test_sequences_decoded_together_get_what_each_gets_alone(
    repacked_factory: ModelFactory, budget: int | None
) -> None:
    """The server's parallel slots: three sequences (two at the same positions, one joining two steps late) in steps
    of all of them, in RAM and streamed, GLM-5.2's sharing with a top-k of 4 (each sequence's picks kept apart:
    a buffer shared by the sequences fails this). Each gets the logits it gets alone, bit for bit."""
    from tests.engine.test_batch_decode import _alone, _options, _together

    prompts = [[5, 17, 99, 3, 42, 7], [8, 8, 150, 61, 9, 12], [120, 33, 2, 77, 91, 14, 60]]
    model = str(repacked_factory(arch=A, type="Q8_0", n_layer=4, indexer_types=(1, 0, 1, 0), indexer_top_k=4))
    want = [_alone(model, _options(1, budget), p) for p in prompts]
    got = _together(model, _options(len(prompts), budget), prompts)
    for w, g in zip(want, got, strict=True):
        assert len(g) == len(w)
        for step, (a, b) in enumerate(zip(w, g, strict=True)):
            assert np.array_equal(a, b), f"step {step}: max |diff| {np.abs(a - b).max()}"


def test_the_default_f16_cache_is_llama_cpps_f16_cache(model_factory: ModelFactory, tmp_path: Path) -> None:
    """The engine's default KV type against llama.cpp's default (both caches F16, the indexer's keys too), 300
    positions across 256 with GLM-5.2's sharing: far closer than the two KV types are to each other."""
    src = model_factory(arch=A, n_layer=3, indexer_types=(1, 0, 1))
    tokens = _tokens(300, 512, seed=5)
    ref16 = llama_logits(src, tokens, tmp_path, f16_kv=True)
    floor = kl_per_position(llama_logits(src, tokens, tmp_path), ref16).mean()
    s = Session(str(_repacked(src, tmp_path)), SessionOptions(kv_type="f16", n_ctx=512), log=lambda line: None)
    try:
        got = np.concatenate(
            [
                s.forward(tokens[:200].tolist(), all_logits=True),
                *(s.forward([int(t)]).reshape(1, -1) for t in tokens[200:]),
            ]
        )
    finally:
        s.close()
    kl = kl_per_position(ref16, got).mean()
    assert kl <= 1e-7 and kl <= floor / 100, (kl, floor)
