"""llama.cpp loads the factory's Qwen3.8 Flash Next (`qwen4exp`) files in the types the real files come in and runs
them with finite, spread logits over a long prompt, batch and stepped, on geometries the engine's tests will not
use; the n-gram table and the QSA indexer change what llama.cpp computes (a file on which they did not would test
nothing)."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest

from tests.conftest import ModelFactory
from tests.oracle.test_deepseek4_loads import _tokens, long_probe
from tests.oracle.test_llama_loads import TEXTS, probe_models
from tokenwing.format.gguf_io import read_header
from tokenwing.text.tokenizer import tokenizer_from_metadata

pytestmark = pytest.mark.oracle

A = "qwen4exp"
TYPES: list[dict[str, Any]] = [
    {"type": "F32"},
    {"type": "BF16"},
    {"type": "Q8_0"},
    {"type": "Q4_K_M", "preset": "kquant"},
]


def test_llama_cpp_loads_qwen4exp_in_every_type(model_factory: ModelFactory) -> None:
    paths = [model_factory(arch=A, **t) for t in TYPES]
    results = probe_models(paths, TEXTS)
    assert len(results) == len(paths)
    meta = {k: v.value for k, v in read_header(str(paths[0])).kv.items()}
    tok = tokenizer_from_metadata(meta, str(paths[0]))
    for r in results:
        assert r["n_vocab"] == 512
        assert r["logits_finite"], r["path"]
        assert float(r["logits_std"]) > 0.1, r["path"]
        assert r["tokens"] == [tok.encode(t, special=False, add_bos=False) for t in TEXTS]


# Each part alone and together: no table, the table on a later layer, bigrams only, 4-grams with many heads, a
# two-tap convolution, two streams, a low rank of 1, one indexer head keeping one block, several full layers.
GEOMETRIES: dict[str, dict[str, Any]] = {
    "tiny": {},
    "no-table": {"ple_layer": -1},
    "table-later": {"n_layer": 8, "ple_layer": 6, "full_attention_interval": 2},
    "bigrams": {"ple_ngram": 2, "ple_heads_per_ngram": 4, "ple_conv_kernel": 2},
    "four-grams": {"ple_ngram": 4, "ple_heads_per_ngram": 8, "n_embd": 96, "ple_head_rows": 50},
    "two-streams": {"hc_mult": 2, "hc_low_rank": 1, "indexer_n_head": 1, "indexer_top_k": 4, "qsa_ratio": 4},
    "wide": {"n_embd": 128, "n_expert": 16, "n_expert_used": 10, "hc_low_rank": 64, "type": "Q8_0"},
}
N_TOKENS, PREFILL = 200, 120


def test_long_prompts_on_several_geometries(model_factory: ModelFactory) -> None:
    """Past the indexer's budget (64 + 4 - 1 cells in tiny): batch and stepped agree (the carried n-gram context and
    convolution histories, the indexer's cache)."""
    paths = []
    for changes in GEOMETRIES.values():
        shape = dict(changes)
        paths.append(model_factory(arch=A, type=shape.pop("type", "F32"), **shape))
    results = long_probe(paths, _tokens(n=N_TOKENS), PREFILL, n_ctx=256)
    for name, r in zip(GEOMETRIES, results, strict=True):
        assert r["finite"], name
        assert r["min_position_std"] > 0.1, (name, r)
        assert r["distinct_argmax"] > 30, (name, r)
        if GEOMETRIES[name].get("type", "F32") == "F32":
            assert r["max_diff_stepped"] < 0.01 * r["std"], (name, r)
        else:
            assert r["top1_agree_stepped"] > 0.9, (name, r)


def test_the_ngram_table_is_read(model_factory: ModelFactory, tmp_path: Path) -> None:
    """Other values in the n-gram table change llama.cpp's logits: the factory's table and hash reach the graph."""
    src = model_factory(arch=A)
    moved = tmp_path / "moved.gguf"
    shutil.copyfile(src, moved)
    t = next(x for x in gguf.GGUFReader(str(moved), "r+").tensors if x.name == "per_layer_token_embd.weight")
    rows = np.asarray(t.data)
    rows[...] = np.roll(rows, 1, axis=0)
    del t, rows  # flush the memory map
    results = long_probe([src, moved], _tokens(n=48), 24, n_ctx=64)
    assert all(r["finite"] for r in results)
    a, b = (np.load(str(p) + ".logits.npy") for p in (src, moved))
    assert np.abs(a - b).max() > 0.05


def test_the_indexer_selects_past_its_budget(model_factory: ModelFactory) -> None:
    """A budget of 8 cells (blocks of 4) against one of 64: the same up to position 8 + 4 - 2, different after."""
    small, large = model_factory(arch=A, indexer_top_k=8), model_factory(arch=A, indexer_top_k=64)
    long_probe([small, large], _tokens(n=64), 32, n_ctx=64)
    a, b = (np.load(str(p) + ".logits.npy") for p in (small, large))
    assert np.abs(a[:11] - b[:11]).max() < 1e-4
    assert np.abs(a[20:] - b[20:]).max() > 0.05
