"""llama.cpp loads the factory's DeepSeek V4 (`deepseek4`) files in every type the real files come in and runs them
with finite, spread logits, on geometries that exercise each part of its attention over a long prompt."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest

from tests.conftest import ModelFactory
from tests.oracle.test_llama_loads import TEXTS, probe_models
from tokenwing.format.gguf_io import read_header
from tokenwing.testmodel import preset_shape
from tokenwing.text.tokenizer import tokenizer_from_metadata

pytestmark = pytest.mark.oracle

A = "deepseek4"
# The types DeepSeek V4 ships in: the converter's MXFP4 experts with the rest in Q8_0 (MXFP4_MOE) or BF16, and
# llama.cpp's quantizer's K-quants; F32 and Q8_0 for the KL tests to come.
TYPES: list[dict[str, Any]] = [
    {"type": "F32"},
    {"type": "BF16"},
    {"type": "Q8_0"},
    {"type": "MXFP4_MOE"},
    {"type": "BF16", "expert_type": "MXFP4"},
    {"type": "Q4_K_M", "preset": "kquant"},
    {"type": "Q6_K", "preset": "kquant"},
]


def test_llama_cpp_loads_deepseek4_in_every_type(model_factory: ModelFactory) -> None:
    paths = [model_factory(arch=A, **t) for t in TYPES]
    results = probe_models(paths, TEXTS)
    assert len(results) == len(paths)
    meta = {k: v.value for k, v in read_header(str(paths[0])).kv.items()}
    tok = tokenizer_from_metadata(meta, str(paths[0]))  # the engine's, as it will read these files
    for r in results:
        assert r["n_vocab"] == 512
        assert r["logits_finite"], r["path"]
        assert float(r["logits_std"]) > 0.1, r["path"]
        assert r["detokenized"] == TEXTS
        assert r["tokens"] == [tok.encode(t, special=False, add_bos=False) for t in TEXTS]


def test_the_engine_tokenizes_deepseek4_files_as_llama_cpp(model_factory: ModelFactory) -> None:
    """V4's files name the pre-tokenizer `joyai-llm`: llama.cpp's vocabulary alone (vocab_only) and the engine's
    tokenizer give the same ids on our multilingual corpus and every family's markers, and the same pieces."""
    from tests.oracle.test_tokenizer import MARKERS, MIXED, TRICKY, vocab_probe
    from tokenwing.testmodel.corpus import CORPUS, MULTILINGUAL

    path = model_factory(arch=A, vocab_size=4096, n_layer=1, hash_layer_count=1)
    meta = {k: v.value for k, v in read_header(str(path)).kv.items()}
    assert meta["tokenizer.ggml.pre"] == "joyai-llm"
    texts = [*CORPUS.splitlines(), *MULTILINGUAL.splitlines(), MULTILINGUAL, *TRICKY, *MIXED, *MARKERS]
    (r,) = vocab_probe([path], texts)
    tok = tokenizer_from_metadata(meta, str(path))
    assert tok.add_bos == r["add_bos"] is True
    for text, plain, special, with_bos in zip(texts, r["plain"], r["special"], r["with_bos"], strict=True):
        assert tok.encode(text, special=False, add_bos=False) == plain, text
        assert tok.encode(text, special=True, add_bos=False) == special, text
        assert tok.encode(text, special=True) == with_bos, text
    assert [tok.piece_bytes(i).hex() for i in range(tok.vocab_size)] == r["pieces"]


# Geometries the tests of the engine's family file will not have seen: each layer kind alone and together, hash
# layers none to all, 1 to 4 output groups, one indexer head keeping one block, a head as wide as the indexer's
# (llama.cpp then rotates every cache, not only the indexer's), all experts used, wider models.
GEOMETRIES: dict[str, dict[str, Any]] = {
    "tiny": {},
    "two-layers": {"n_layer": 2},
    "all-hashed": {"n_layer": 3, "hash_layer_count": 3},
    "csa-only": {"compress_ratios": (4, 4, 4, 4), "hash_layer_count": 0},
    "one-group": {"o_group_count": 1, "indexer_n_head": 1, "indexer_top_k": 1, "compress_ratios": (128, 4, 0, 4)},
    "four-groups": {"o_group_count": 4, "n_expert_used": 8, "hash_layer_count": 4},
    "head-64": {"head_dim": 64, "n_rot": 64, "sliding_window": 1, "type": "Q8_0"},
    "wide": {
        "n_layer": 6, "n_embd": 128, "n_head": 8, "o_group_count": 4, "n_expert": 16, "n_expert_used": 6,
        "indexer_top_k": 64, "sliding_window": 128, "hash_layer_count": 3, "type": "MXFP4_MOE",
    },
}  # fmt: skip
# Past the window, past a full HCA block (128), and 75 CSA blocks for the indexer to choose from.
N_TOKENS, PREFILL = 300, 200


def long_probe(paths: list[Path], tokens: list[int], prefill: int, n_ctx: int = 512) -> list[dict[str, Any]]:
    req = paths[0].with_suffix(".long.json")
    req.write_text(json.dumps({"paths": [str(p) for p in paths], "tokens": tokens, "prefill": prefill, "n_ctx": n_ctx}))
    script = Path(__file__).with_name("llama_long_probe.py")
    proc = subprocess.run(
        [sys.executable, str(script), str(req)], capture_output=True, text=True, timeout=900, check=False
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    return [json.loads(line) for line in proc.stdout.splitlines()]


def _tokens(vocab: int = 512, n: int = N_TOKENS) -> list[int]:
    return [int(t) for t in np.random.default_rng(7).integers(0, vocab - 20, n)]  # below the special tokens


def test_long_prompts_on_several_geometries(model_factory: ModelFactory) -> None:
    """Every position's logits are finite and spread, whole-batch and token-by-token alike (the window, the
    compressors' carried state and the indexer's choices agree between llama.cpp's two paths)."""
    paths = []
    for changes in GEOMETRIES.values():
        shape = dict(changes)
        paths.append(model_factory(arch=A, type=shape.pop("type", "F32"), **shape))
    results = long_probe(paths, _tokens(), PREFILL)
    for name, r in zip(GEOMETRIES, results, strict=True):
        assert r["finite"], name
        assert r["min_position_std"] > 0.3, (name, r)
        assert r["distinct_argmax"] > 50, (name, r)  # the prediction moves with the context
        if GEOMETRIES[name].get("type", "F32") == "F32":
            assert r["max_diff_stepped"] < 0.01 * r["std"], (name, r)
        else:  # quantised activations: a near-tie (an expert, a block) may go the other way on one path
            assert r["top1_agree_stepped"] > 0.9, (name, r)


def test_llama_cpp_routes_hash_layers_by_the_table(model_factory: ModelFactory, tmp_path: Path) -> None:
    """Another valid table in the first hash layer (each token's experts shifted by one) changes the logits of
    llama.cpp: the factory's table is what routes those layers."""
    src = model_factory(arch=A, type="Q8_0")
    moved = tmp_path / "moved.gguf"
    shutil.copyfile(src, moved)
    s = preset_shape("tiny", A)
    t = next(x for x in gguf.GGUFReader(str(moved), "r+").tensors if x.name == "blk.0.ffn_gate_tid2eid.weight")
    ids = np.asarray(t.data)
    ids[...] = (ids + 1) % s.n_expert
    del t, ids  # flush the memory map
    results = long_probe([src, moved], _tokens(n=64), 32)
    assert all(r["finite"] for r in results)
    a, b = (np.load(str(p) + ".logits.npy") for p in (src, moved))
    assert np.abs(a - b).max() > 0.1


def test_compressed_attention_carries_what_the_window_does_not(model_factory: ModelFactory) -> None:
    """Two prompts that differ only before the window: llama.cpp's logits after it still differ, through the CSA
    and HCA caches (a factory file on which the compressed attention did not matter would test nothing)."""
    path = model_factory(arch=A)
    tail = _tokens(n=50)
    seen = []
    for seed in (1, 2):
        head = [int(t) for t in np.random.default_rng(seed).integers(0, 492, N_TOKENS - len(tail))]
        (r,) = long_probe([path], head + tail, PREFILL)
        assert r["finite"]
        seen.append(np.load(str(path) + ".logits.npy")[-20:])
    assert preset_shape("tiny", A).sliding_window < 20
    assert np.abs(seen[0] - seen[1]).mean() > 0.05
