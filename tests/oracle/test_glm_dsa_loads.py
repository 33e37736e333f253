"""llama.cpp loads the factory's GLM-5 / GLM-5.2 (`glm-dsa`) files in the types they come in and runs them with
finite, spread logits over a long prompt, batch and stepped; the indexer's selection and GLM-5.2's shared
indexers change what llama.cpp computes (a file on which they did not matter would test nothing)."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest

from tests.conftest import ModelFactory
from tests.oracle.test_deepseek4_loads import N_TOKENS, PREFILL, _tokens, long_probe
from tests.oracle.test_llama_loads import TEXTS, probe_models
from tokenwing.format.gguf_io import read_header
from tokenwing.testmodel import preset_shape
from tokenwing.text.tokenizer import tokenizer_from_metadata

pytestmark = pytest.mark.oracle

A = "glm-dsa"
# GLM-5's GGUFs on the hub: BF16 and Q8_0 conversions, llama-quantize's K-quants, MXFP4 experts (MXFP4_MOE).
TYPES: list[dict[str, Any]] = [
    {"type": "F32"},
    {"type": "BF16"},
    {"type": "Q8_0"},
    {"type": "MXFP4_MOE"},
    {"type": "Q4_K_M", "preset": "kquant"},
    {"type": "Q6_K", "preset": "kquant"},
]


def test_llama_cpp_loads_glm_dsa_in_every_type(model_factory: ModelFactory) -> None:
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


# Geometries the family file's tests will not have seen: GLM-5 (every layer its own indexer), GLM-5.2's sharing,
# one indexer head keeping one token, a top-k above the context (dense MLA), the MTP block in the file, a head as
# wide as the indexer's Hadamard matrix, wider models in other types.
GEOMETRIES: dict[str, dict[str, Any]] = {
    "tiny": {},
    "glm-5.2": {"n_layer": 4, "indexer_types": (1, 0, 1, 0)},
    "one-pick": {"n_layer": 3, "indexer_n_head": 1, "indexer_top_k": 1},
    "dense": {"indexer_top_k": 2048},
    "mtp": {"n_layer": 3, "n_mtp": 1, "indexer_types": (1, 0, 0), "type": "Q8_0"},
    "latent-64": {"kv_lora_rank": 48, "n_rot": 16, "indexer_head_size": 64},  # MLA's cache row as wide as the indexer
    "wide": {
        "n_layer": 5, "n_embd": 128, "n_head": 8, "n_expert": 16, "n_expert_used": 6, "indexer_n_head": 8,
        "indexer_head_size": 128, "indexer_top_k": 64, "indexer_types": (1, 1, 0, 1, 0), "type": "MXFP4_MOE",
    },
}  # fmt: skip


def test_long_prompts_on_several_geometries(model_factory: ModelFactory) -> None:
    """Every position's logits are finite and spread, whole-batch and token-by-token alike (the indexer's picks
    agree between llama.cpp's two paths)."""
    paths = []
    for changes in GEOMETRIES.values():
        shape = dict(changes)
        paths.append(model_factory(arch=A, type=shape.pop("type", "F32"), **shape))
    results = long_probe(paths, _tokens(), PREFILL)
    for name, r in zip(GEOMETRIES, results, strict=True):
        assert r["finite"], name
        assert r["min_position_std"] > 0.3, (name, r)
        assert r["distinct_argmax"] > 50, (name, r)
        if GEOMETRIES[name].get("type", "F32") == "F32":
            assert r["max_diff_stepped"] < 0.01 * r["std"], (name, r)
        else:
            assert r["top1_agree_stepped"] > 0.9, (name, r)


def _set_key(path: Path, key: str, values: list[int]) -> None:
    """Overwrites a scalar or an array key of a GGUF in place (same type and length)."""
    field = gguf.GGUFReader(str(path), "r+").fields[key]
    assert len(field.data) == len(values)
    for index, v in zip(field.data, values, strict=True):
        field.parts[index][0] = v
    del field  # flush the memory map


def test_the_indexer_picks_the_keys_llama_cpp_attends(model_factory: ModelFactory, tmp_path: Path) -> None:
    """The same file with a top-k above the context attends every key: identical logits while a query sees no more
    tokens than the top-k, different ones after."""
    src = model_factory(arch=A)
    dense = tmp_path / "dense.gguf"
    shutil.copyfile(src, dense)
    _set_key(dense, f"{A}.attention.indexer.top_k", [4096])
    results = long_probe([src, dense], _tokens(), PREFILL)
    assert all(r["finite"] for r in results)
    a, b = (np.load(str(p) + ".logits.npy") for p in (src, dense))
    k = preset_shape("tiny", A).indexer_top_k
    assert np.abs(a[:k] - b[:k]).max() < 1e-4
    assert np.abs(a[k + 8 :] - b[k + 8 :]).mean() > 0.05


def test_glm_5_2_layers_share_the_last_indexers_picks(model_factory: ModelFactory, tmp_path: Path) -> None:
    """A GLM-5 file (every layer its own indexer) marked as GLM-5.2 with layers 1 and 3 shared: llama.cpp's logits
    change (those layers reuse the top-k of layers 0 and 2, their own indexer tensors unused)."""
    src = model_factory(arch=A, n_layer=4, indexer_types=(1, 1, 1, 1))
    shared = tmp_path / "shared.gguf"
    shutil.copyfile(src, shared)
    _set_key(shared, f"{A}.attention.indexer.types", [1, 0, 1, 0])
    results = long_probe([src, shared], _tokens(n=N_TOKENS // 2), PREFILL // 2)
    assert all(r["finite"] for r in results)
    a, b = (np.load(str(p) + ".logits.npy") for p in (src, shared))
    k = preset_shape("tiny", A).indexer_top_k
    assert np.abs(a[:k] - b[:k]).max() < 1e-4  # (every key is picked either way)
    assert np.abs(a[k + 8 :] - b[k + 8 :]).mean() > 0.05
