"""The ggml ops of DSA's lightning indexer (GLM-5's `glm-dsa`, DeepSeek V3.2/V4) against their definitions in
numpy: the fused indexer score, the unordered top-k and LayerNorm with weight and bias, as the family files call
them (ggml.h:2463-2468, 2662-2678; ggml-cpu/ops.cpp:12355-12440)."""

from __future__ import annotations

import numpy as np

from tokenwing.compute.ggml_lib import Graph, ops, to_numpy


def test_lightning_indexer_is_the_weighted_sum_of_relu_scores_plus_the_mask() -> None:
    rng = np.random.default_rng(7)
    di, heads, n, n_kv = 64, 4, 5, 40
    q = rng.standard_normal((n, heads, di)).astype(np.float32)
    k = rng.standard_normal((n_kv, 1, di)).astype(np.float16)  # the indexer cache's rows, F16 as llama.cpp stores them
    w = rng.standard_normal((n, heads)).astype(np.float32)
    mask = np.zeros((n, n_kv), np.float16)
    mask[:, 30:] = -np.inf
    g = Graph(16 << 20, 2)
    try:
        out = ops.ggml_lightning_indexer(g.ctx, g.input(q), g.input(k), g.input(w), g.input(mask))
        g.compute(out)
        got = to_numpy(out)
    finally:
        g.close()
    qk = np.einsum("thd,kd->thk", q.astype(np.float64), k[:, 0].astype(np.float64))
    want = np.einsum("th,thk->tk", w.astype(np.float64), np.maximum(qk, 0.0)) + mask.astype(np.float64)
    assert got.shape == (n, n_kv)
    assert np.all(np.isneginf(got[:, 30:]))
    np.testing.assert_allclose(got[:, :30], want[:, :30], rtol=1e-5, atol=1e-4)


def test_top_k_returns_the_k_largest_of_each_row() -> None:
    rng = np.random.default_rng(3)
    rows = rng.permutation(np.arange(6 * 300, dtype=np.float32)).reshape(6, 300)  # distinct values: no ties
    rows[2, 100:] = -np.inf
    g = Graph(16 << 20, 2)
    try:
        out = ops.ggml_top_k(g.ctx, g.input(rows), 32)
        g.compute(out)
        got = to_numpy(out)
    finally:
        g.close()
    assert got.shape == (6, 32)
    for r in range(6):
        assert set(got[r].tolist()) == set(np.argsort(-rows[r], kind="stable")[:32].tolist())


def test_norm_is_layer_norm() -> None:
    rng = np.random.default_rng(5)
    x = (3.0 + rng.standard_normal((4, 128))).astype(np.float32)
    g = Graph(4 << 20, 2)
    try:
        out = ops.ggml_norm(g.ctx, g.input(x), 1e-6)
        g.compute(out)
        got = to_numpy(out)
    finally:
        g.close()
    x64 = x.astype(np.float64)
    want = (x64 - x64.mean(1, keepdims=True)) / np.sqrt(x64.var(1, keepdims=True) + 1e-6)
    np.testing.assert_allclose(got, want, atol=1e-5)
