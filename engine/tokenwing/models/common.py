"""Graph builders shared by the MoE architectures: norms, attention over the KV cache, routed experts.

They follow llama.cpp's graphs op for op (same ggml kernels, same order), so results match it to rounding.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from tokenwing.compute.ggml_lib import ROPE_NEOX, Graph, Tensor, ops
from tokenwing.models.hparams import HParams


@dataclass(frozen=True)
class AttentionSpec:
    qk_norm: bool = True
    qkv_bias: bool = False
    rope_type: int = ROPE_NEOX


def rms_norm(ctx: Any, x: Tensor, weight: Tensor, eps: float) -> Tensor:
    return ops.ggml_mul(ctx, ops.ggml_rms_norm(ctx, x, eps), weight)


def attention(
    g: Graph,
    hp: HParams,
    spec: AttentionSpec,
    w: dict[str, Tensor],
    x: Tensor,
    positions: Tensor,
    kv: tuple[Tensor, Tensor, int],
    pos0: int,
    n_tokens: int,
    mask: Tensor,
) -> tuple[Tensor, list[Tensor]]:
    """Self-attention of `n_tokens` new tokens at `pos0` over the cache.

    kv: (k_cache [head_dim·n_kv, n_ctx], v_cache transposed [n_ctx, head_dim·n_kv], bytes per element).
    Returns the output and the cache writes, which the caller must put in the graph first (as llama.cpp
    does) so that the attention reads see them.
    """
    ctx = g.ctx
    hd, nh, nkv = hp.head_dim, hp.n_head, hp.n_head_kv
    q = ops.ggml_mul_mat(ctx, w["attn_q"], x)
    k = ops.ggml_mul_mat(ctx, w["attn_k"], x)
    v = ops.ggml_mul_mat(ctx, w["attn_v"], x)
    if spec.qkv_bias:
        q = ops.ggml_add(ctx, q, w["attn_q.bias"])
        k = ops.ggml_add(ctx, k, w["attn_k.bias"])
        v = ops.ggml_add(ctx, v, w["attn_v.bias"])
    q = ops.ggml_reshape_3d(ctx, q, hd, nh, n_tokens)
    k = ops.ggml_reshape_3d(ctx, k, hd, nkv, n_tokens)
    if spec.qk_norm:
        q = rms_norm(ctx, q, w["attn_q_norm"], hp.rms_eps)
        k = rms_norm(ctx, k, w["attn_k_norm"], hp.rms_eps)
    q = ops.ggml_rope_ext(
        ctx, q, positions, None, hd, spec.rope_type, hp.n_ctx_train, hp.rope_base, 1.0, 0.0, 1.0, 32.0, 1.0
    )
    k = ops.ggml_rope_ext(
        ctx, k, positions, None, hd, spec.rope_type, hp.n_ctx_train, hp.rope_base, 1.0, 0.0, 1.0, 32.0, 1.0
    )
    k_cache, v_cache, elt = kv
    n_ctx = int(v_cache.contents.ne[0])
    row = hd * nkv * elt
    k_dst = ops.ggml_view_2d(ctx, k_cache, hd * nkv, n_tokens, row, pos0 * row)
    v_dst = ops.ggml_view_2d(ctx, v_cache, n_tokens, hd * nkv, n_ctx * elt, pos0 * elt)
    k_write = ops.ggml_cpy(ctx, ops.ggml_reshape_2d(ctx, k, hd * nkv, n_tokens), k_dst)
    v_write = ops.ggml_cpy(ctx, ops.ggml_transpose(ctx, v), v_dst)
    n_kv = pos0 + n_tokens
    k_all = ops.ggml_view_3d(ctx, k_cache, hd, nkv, n_kv, hd * elt, row, 0)
    v_all = ops.ggml_view_3d(ctx, v_cache, n_kv, hd, nkv, n_ctx * elt, n_ctx * elt * hd, 0)
    kq = ops.ggml_mul_mat(ctx, ops.ggml_permute(ctx, k_all, 0, 2, 1, 3), ops.ggml_permute(ctx, q, 0, 2, 1, 3))
    kq = ops.ggml_soft_max_ext(ctx, kq, mask, 1.0 / math.sqrt(hd), 0.0)
    kqv = ops.ggml_mul_mat(ctx, v_all, kq)
    cur = ops.ggml_cont_2d(ctx, ops.ggml_permute(ctx, kqv, 0, 2, 1, 3), hd * nh, n_tokens)
    return ops.ggml_mul_mat(ctx, w["attn_output"], cur), [k_write, v_write]


def causal_mask(pos0: int, n_tokens: int) -> np.ndarray:
    """[n_tokens, n_kv] additive mask: token i (at pos0+i) sees positions ≤ pos0+i."""
    n_kv = pos0 + n_tokens
    m = np.zeros((n_tokens, n_kv), np.float32)
    for i in range(n_tokens):
        m[i, pos0 + i + 1 :] = -np.inf
    return m


def swiglu_ffn(ctx: Any, gate: Tensor, up: Tensor, down: Tensor, x: Tensor) -> Tensor:
    g = ops.ggml_mul_mat(ctx, gate, x)
    u = ops.ggml_mul_mat(ctx, up, x)
    return ops.ggml_mul_mat(ctx, down, ops.ggml_swiglu_split(ctx, g, u))


def routed_experts(
    g: Graph,
    views: tuple[Tensor, Tensor, Tensor],
    rows: np.ndarray,
    slots: np.ndarray,
    weights: np.ndarray,
) -> Tensor:
    """w · down(silu(gate x) · up x) for m (token, expert) pairs, one pair per row, read from the slot pool.

    rows: [m, n_embd] (each pair's token input), slots, weights: [m]. Returns [n_embd, 1, m]. One selected
    expert per row: a wave computes exactly its own pairs (no masked entries), and ggml's mul_mat_id never
    sees one slot twice for one row (its row tables hold at most one entry per expert and row).
    """
    ctx = g.ctx
    m, n_embd = rows.shape
    ids = g.input(slots.astype(np.int32).reshape(m, 1))
    w = g.input(weights.astype(np.float32).reshape(m, 1, 1))
    xin = ops.ggml_reshape_3d(ctx, g.input(rows), n_embd, 1, m)
    gate_v, up_v, down_v = views
    gt = ops.ggml_mul_mat_id(ctx, gate_v, xin, ids)
    up = ops.ggml_mul_mat_id(ctx, up_v, xin, ids)
    par = ops.ggml_swiglu_split(ctx, gt, up)
    experts = ops.ggml_mul_mat_id(ctx, down_v, par, ids)
    return ops.ggml_mul(ctx, experts, w)


def sum_rows(ctx: Any, weighted: Tensor, k: int, n_embd: int) -> Tensor:
    """[n_embd, 1, k] → [n_embd]: row 0, plus row 1, plus row 2 … — `sum_experts`' order, in a graph."""
    row = n_embd * 4
    total = ops.ggml_view_1d(ctx, weighted, n_embd, 0)
    for i in range(1, k):
        total = ops.ggml_add(ctx, total, ops.ggml_view_1d(ctx, weighted, n_embd, i * row))
    return total


def sum_experts(experts: np.ndarray) -> np.ndarray:
    """[n_tokens, k, n_embd] → [n_tokens, n_embd], adding expert 0, then 1, … as llama.cpp's graph does.

    Every expert's output is computed independently of the others, so when experts come in several waves
    the result is still bit-identical to one pass.
    """
    out = experts[:, 0].copy()
    for i in range(1, experts.shape[1]):
        out += experts[:, i]
    return out


def select_experts(probs: np.ndarray, k: int, normalize: bool) -> tuple[np.ndarray, np.ndarray]:
    """Top-k of each token's router probabilities (ties to the lower ID), and their weights.

    With `normalize`, the weights are divided by their sum taken in double precision, in order — as ggml's
    sum_rows does — so the result matches llama.cpp bit for bit.
    """
    order = np.argsort(-probs, axis=1, kind="stable")[:, :k]
    w = np.take_along_axis(probs, order, axis=1).astype(np.float32)
    if normalize:
        sums = np.array([np.float32(_seq_sum(row)) for row in w], dtype=np.float32)
        w = (w / sums[:, None]).astype(np.float32)
    return order.astype(np.int32), w


def _seq_sum(row: np.ndarray) -> float:
    s = 0.0
    for v in row:
        s += float(v)
    return s
