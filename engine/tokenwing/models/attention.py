"""Attention over the KV cache: RoPE with the file's scaling (`rope_of`, `rope`), `attend` (K-only caches, sinks,
a second mask, per-head V decompression; tiled flash attention for prompts; a batch's sequences stacked or each
on its own) and grouped-query `attention`; `attend_alone` for picked keys."""

from __future__ import annotations

import ctypes
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from tokenwing.compute.ggml_lib import F32, Tensor, ops
from tokenwing.models.caches import BatchKV, KVCache
from tokenwing.models.hparams import HParams
from tokenwing.models.placement import FLASH_ALIGN, Placement, Run
from tokenwing.models.tensors import rms_norm, split_rows


# ------------------------------------------------------------------------------------------- attention
@dataclass(frozen=True)
class Rope:
    n_rot: int  # dimensions rotated (partial rotary: fewer than the head)
    mode: int  # ROPE_NEOX or ROPE_NORM
    n_ctx_orig: int
    base: float
    freq_scale: float = 1.0  # YaRN / linear scaling: 1 / factor
    ext_factor: float = 0.0  # 1 with YaRN
    attn_factor: float = 1.0
    beta_fast: float = 32.0  # llama.cpp's defaults; it does not read the file's
    beta_slow: float = 1.0
    sections: tuple[int, ...] = ()  # multi-axis RoPE (ggml_rope_multi): rotary pairs per axis


def rope_of(hp: HParams, mode: int, yarn_log_mul: float, mscale_from_all_dims: bool = False) -> Rope:
    """RoPE with the file's scaling, as llama.cpp sets it up (llama-context.cpp): with YaRN the attention factor
    is the ratio of the two mscales (or the one mscale) divided by the (1 + 0.1 ln factor) that ggml's rope
    multiplies in again; then the file's attn_factor."""
    freq_scale = 1.0 if hp.rope_scaling == "none" else hp.rope_freq_scale
    ext = 1.0 if hp.rope_scaling == "yarn" else 0.0
    attn = np.float32(1.0)
    if ext:
        factor = np.float32(1.0) / np.float32(freq_scale)

        def mscale(m: float) -> np.float32:
            return np.float32(1.0) if factor <= 1 else np.float32(0.1) * np.float32(m) * np.log(factor) + 1

        if yarn_log_mul != 0.0:
            m = yarn_log_mul if mscale_from_all_dims and yarn_log_mul != 1.0 else 1.0
            attn = mscale(m) / mscale(yarn_log_mul)
        else:
            attn = mscale(1.0)
        attn *= np.float32(1.0) / (np.float32(1.0) + np.float32(0.1) * np.log(factor))
    attn *= np.float32(hp.rope_attn_factor)
    return Rope(hp.n_rot, mode, hp.n_ctx_orig or hp.n_ctx_train, hp.rope_base, freq_scale, ext, float(attn))


def rope(ctx: Any, x: Tensor, positions: Tensor, r: Rope) -> Tensor:
    scaling = (r.n_ctx_orig, r.base, r.freq_scale, r.ext_factor, r.attn_factor, r.beta_fast, r.beta_slow)
    if r.sections:
        sections = (ctypes.c_int * 4)(*r.sections[:4], *([0] * (4 - len(r.sections[:4]))))
        return ops.ggml_rope_multi(ctx, x, positions, None, r.n_rot, sections, r.mode, *scaling)
    return ops.ggml_rope_ext(ctx, x, positions, None, r.n_rot, r.mode, *scaling)


def attend(
    ctx: Any,
    q: Tensor,
    k: Tensor,
    v: Tensor | None,
    at: Placement,
    kv: KVCache,
    scale: float,
    mask: Tensor | None = None,
    sinks: Tensor | None = None,
    v_up: Tensor | None = None,
) -> tuple[Tensor, list[Tensor]]:
    """Attention of the `at.n` new tokens over the cache, after their K (and V) are written to it.

    q [hd, n_head, n], k [hd, n_kv_heads, n], v [hd_v, n_kv_heads, n] (None with a K-only cache). `mask`: another
    mask than the placement's (a sliding window); `sinks`: per-head logits that join every softmax (gpt-oss);
    `v_up`: per-head matrices applied to the result (MLA's decompression of the latent to the value heads).
    Returns [hd_v · n_head, n] and the cache writes, which the caller must put in the graph first (as llama.cpp
    does) so that the attention reads see them. llama.cpp's ops (build_attn_mha without flash attention).
    """
    if isinstance(kv, BatchKV):
        return _attend_each(ctx, q, k, v, at, kv, scale, mask, sinks, v_up)
    hd, nh, n = int(q.contents.ne[0]), int(q.contents.ne[1]), at.n
    nkv = int(k.contents.ne[1])
    elt, kc = kv.elt, kv.k
    row = hd * nkv * elt
    writes = _cache_writes(ctx, k, v, at, kv)
    flash_mask = at.flash_mask if mask is None else at.flash_mask_swa if mask is at.mask_swa else None
    if flash_mask is not None and (kv.v_width // nkv) % FLASH_ALIGN == 0:
        return _flash(ctx, q, nkv, at, kv, scale, flash_mask, sinks, v_up), writes
    k_all = ops.ggml_view_3d(ctx, kc, hd, nkv, at.n_kv, hd * elt, row, 0)
    if kv.v is not None:
        hd_v, n_ctx = kv.v_width // nkv, int(kv.v.contents.ne[0])
        v_all = ops.ggml_view_3d(ctx, kv.v, at.n_kv, hd_v, nkv, n_ctx * elt, n_ctx * elt * hd_v, 0)
    else:  # V is the start of each K row: a transposed copy of the window, as llama.cpp makes it
        v_view = ops.ggml_view_3d(ctx, kc, kv.v_width, nkv, at.n_kv, hd * elt, row, 0)
        v_all = ops.ggml_cont(ctx, ops.ggml_transpose(ctx, ops.ggml_permute(ctx, v_view, 0, 2, 1, 3)))
    kq = ops.ggml_mul_mat(ctx, ops.ggml_permute(ctx, k_all, 0, 2, 1, 3), ops.ggml_permute(ctx, q, 0, 2, 1, 3))
    # In place: the scores' memory holds their softmax (ggml's kernel copies each row out first, so the same bits).
    # A CPU graph context keeps every intermediate; at 16k positions a 64-token chunk's scores are 136 MB a copy.
    kq = ops.ggml_soft_max_ext_inplace(ctx, kq, at.mask if mask is None else mask, scale, 0.0)
    if sinks is not None:
        ops.ggml_soft_max_add_sinks(kq, sinks)
    kqv = ops.ggml_mul_mat(ctx, v_all, kq)
    if v_up is not None:
        kqv = ops.ggml_mul_mat(ctx, v_up, kqv)
    return ops.ggml_cont_2d(ctx, ops.ggml_permute(ctx, kqv, 0, 2, 1, 3), int(kqv.contents.ne[0]) * nh, n), writes


def _cache_writes(ctx: Any, k: Tensor, v: Tensor | None, at: Placement, kv: KVCache) -> list[Tensor]:
    """The new tokens' K (and V) into their rows of the cache."""
    hd, nkv, n = int(k.contents.ne[0]), int(k.contents.ne[1]), at.n
    writes = [ops.ggml_set_rows(ctx, kv.k, ops.ggml_reshape_2d(ctx, k, hd * nkv, n), at.k_rows)]
    if kv.v is not None:
        assert v is not None and at.v_cells is not None
        n_ctx = int(kv.v.contents.ne[0])
        v_flat = ops.ggml_view_2d(ctx, kv.v, 1, n_ctx * kv.v_width, kv.elt, 0)  # one row per element
        cells, widest = at.v_cells, int(at.v_cells.contents.ne[0]) // n
        if kv.v_width < widest:  # a narrower layer (Gemma 4's full layers): the first cells of each token's
            view = ops.ggml_view_2d(ctx, cells, kv.v_width, n, widest * int(cells.contents.nb[0]), 0)
            cells = ops.ggml_reshape_2d(ctx, ops.ggml_cont(ctx, view), kv.v_width * n, 1)
        writes.append(ops.ggml_set_rows(ctx, v_flat, ops.ggml_reshape_2d(ctx, v, 1, kv.v_width * n), cells))
    return writes


def _attend_stacked(
    ctx: Any,
    q: Tensor,
    nkv: int,
    run: Run,
    n_kv: int,
    caches: tuple[KVCache, ...],
    scale: float,
    mask: Tensor,
    sinks: Tensor | None,
    v_up: Tensor | None,
) -> Tensor:
    """The attention reads of a run's sequences (q [hd, n_head, count], their K and V already written) as one
    product over their slots of the stack: each (sequence, head) slice of the 4-D products is the product that
    sequence gets alone, over the same window, so the same bits (ggml computes a 4-D product slice by slice; the
    window is equal within a run). One node each instead of one per sequence: on the demo model, 4 sequences'
    attention was ~400 of a decode step's ~700 nodes."""
    hd, nh, r = int(q.contents.ne[0]), int(q.contents.ne[1]), run.count
    first = caches[0]
    stack = first.stack
    consecutive = all(c.stack is stack and c.index == first.index + i for i, c in enumerate(caches))
    assert stack is not None and consecutive, "a run's caches are consecutive slots of one stack"
    elt, kc = first.elt, stack.k
    row = hd * nkv * elt
    n_ctx = int(kc.contents.ne[1])
    k_all = ops.ggml_view_4d(ctx, kc, hd, nkv, n_kv, r, hd * elt, row, n_ctx * row, first.index * n_ctx * row)
    nb = q.contents.nb
    q4 = ops.ggml_view_4d(ctx, q, hd, nh, 1, r, int(nb[1]), int(nb[2]), int(nb[2]), 0)
    kq = ops.ggml_mul_mat(ctx, ops.ggml_permute(ctx, k_all, 0, 2, 1, 3), ops.ggml_permute(ctx, q4, 0, 2, 1, 3))
    kq = ops.ggml_soft_max_ext_inplace(ctx, kq, mask, scale, 0.0)  # [n_kv, 1, n_head, r]
    if sinks is not None:
        ops.ggml_soft_max_add_sinks(kq, sinks)
    if stack.v is not None:
        hd_v = first.v_width // nkv
        col = n_ctx * elt  # the transposed V: a row per element
        per_slot = col * first.v_width
        v_all = ops.ggml_view_4d(ctx, stack.v, n_kv, hd_v, nkv, r, col, col * hd_v, per_slot, first.index * per_slot)
    else:  # V is the start of each K row: a transposed copy of the window, as one sequence makes it
        v_view = ops.ggml_view_4d(
            ctx, kc, first.v_width, nkv, n_kv, r, hd * elt, row, n_ctx * row, first.index * n_ctx * row
        )
        v_all = ops.ggml_cont(ctx, ops.ggml_transpose(ctx, ops.ggml_permute(ctx, v_view, 0, 2, 1, 3)))
    kqv = ops.ggml_mul_mat(ctx, v_all, kq)  # [hd_v, 1, n_head, r]
    if v_up is not None:
        kqv = ops.ggml_mul_mat(ctx, v_up, kqv)
    return ops.ggml_cont_2d(ctx, ops.ggml_permute(ctx, kqv, 0, 2, 1, 3), int(kqv.contents.ne[0]) * nh, r)


def _attend_each(
    ctx: Any,
    q: Tensor,
    k: Tensor,
    v: Tensor | None,
    at: Placement,
    kv: BatchKV,
    scale: float,
    mask: Tensor | None,
    sinks: Tensor | None,
    v_up: Tensor | None,
) -> tuple[Tensor, list[Tensor]]:
    """Several sequences' tokens (one each, `at.parts`): each attends over its own cache with its own placement,
    through the ops it gets alone; the results side by side as the tokens are."""

    def token(t: Tensor, i: int) -> Tensor:
        """Token i's slice of [a, b, n] (or of [a, n]: a projection not yet split into heads)."""
        ne, nb = t.contents.ne, t.contents.nb
        if int(ne[2]) == at.n:
            return ops.ggml_view_3d(ctx, t, int(ne[0]), int(ne[1]), 1, int(nb[1]), int(nb[2]), i * int(nb[2]))
        assert int(ne[1]) == at.n and int(ne[2]) == 1
        return ops.ggml_view_2d(ctx, t, int(ne[0]), 1, int(nb[1]), i * int(nb[1]))

    assert mask is None or mask is at.mask_swa, "a batch attends with the placement's masks only"
    outs, writes = [], []
    runs = {run.start: run for run in at.runs}
    nkv = int(k.contents.ne[1])
    i = 0
    while i < at.n:
        run = runs.get(i)
        if run is None:
            part, cache = at.parts[i], kv.caches[i]
            m = None if mask is None else part.mask_swa
            out, w = attend(
                ctx, token(q, i), token(k, i), None if v is None else token(v, i), part, cache, scale, m, sinks, v_up
            )
            outs.append(out)
            writes += w
            i += 1
            continue
        for j in range(i, i + run.count):
            writes += _cache_writes(ctx, token(k, j), None if v is None else token(v, j), at.parts[j], kv.caches[j])
        m = run.mask if mask is None else run.mask_swa
        assert m is not None
        ne, nb = q.contents.ne, q.contents.nb
        q_run = ops.ggml_view_3d(ctx, q, int(ne[0]), int(ne[1]), run.count, int(nb[1]), int(nb[2]), i * int(nb[2]))
        caches = kv.caches[i : i + run.count]
        outs.append(_attend_stacked(ctx, q_run, nkv, run, at.parts[i].n_kv, caches, scale, m, sinks, v_up))
        i += run.count
    cur = outs[0]
    for out in outs[1:]:
        cur = ops.ggml_concat(ctx, cur, out, 1)
    return cur, writes


def _flash(
    ctx: Any,
    q: Tensor,
    nkv: int,
    at: Placement,
    kv: KVCache,
    scale: float,
    mask: Tensor,
    sinks: Tensor | None,
    v_up: Tensor | None,
) -> Tensor:
    """A prompt chunk's attention through ggml's flash attention, in the form whose CPU kernel accumulates in F32:
    its tiled kernel, which needs ≥ 64 queries (a chunk is padded with zero queries; their rows are dropped), K and
    V of one type, and value rows of a multiple of 16. Each query's keys are then visited in 64-key tiles from
    position 0, masked keys adding exact zeros: a token's result does not depend on how its prompt was chunked
    (tested). The flash attention rejected earlier (docs/results.md) ran ggml's other kernel, which accumulates V in
    F16, for chunks of fewer than 64 tokens."""
    hd, nh, n = int(q.contents.ne[0]), int(q.contents.ne[1]), at.n
    elt, kc = kv.elt, kv.k
    row = hd * nkv * elt
    k_all = ops.ggml_view_3d(ctx, kc, hd, at.n_kv, nkv, row, hd * elt, 0)  # [hd, n_kv, heads]: rows contiguous
    if kv.v is not None:  # the transposed V cache: its window copied out row by row
        hd_v, n_ctx = kv.v_width // nkv, int(kv.v.contents.ne[0])
        v_t = ops.ggml_view_3d(ctx, kv.v, at.n_kv, hd_v, nkv, n_ctx * elt, n_ctx * elt * hd_v, 0)
        v_all = ops.ggml_cont(ctx, ops.ggml_transpose(ctx, v_t))
    else:  # V is the start of each K row (MLA's latent): already rows
        v_all = ops.ggml_view_3d(ctx, kc, kv.v_width, at.n_kv, nkv, row, hd * elt, 0)
    q_rows = ops.ggml_permute(ctx, q, 0, 2, 1, 3)  # [hd, n, heads]
    pad = int(mask.contents.ne[1]) - n
    if pad > 0:
        q_rows = ops.ggml_pad(ctx, ops.ggml_cont(ctx, q_rows), 0, pad, 0, 0)
    out = ops.ggml_flash_attn_ext(ctx, q_rows, k_all, v_all, mask, scale, 0.0, 0.0)
    ops.ggml_prec_set_acc(out, ops.GGML_PREC_F32)  # (GPU backends: F32 accumulation too)
    if sinks is not None:
        ops.ggml_flash_attn_ext_add_sinks(out, sinks)
    hd_v = int(v_all.contents.ne[0])
    out = ops.ggml_view_3d(ctx, out, hd_v, nh, n, hd_v * 4, hd_v * nh * 4, 0)  # [hd_v, heads, n]: the real queries
    if v_up is not None:  # MLA: each head's latent result up to its value head
        up = ops.ggml_mul_mat(ctx, v_up, ops.ggml_permute(ctx, out, 0, 2, 1, 3))  # [hd_out, n, heads]
        return ops.ggml_cont_2d(ctx, ops.ggml_permute(ctx, up, 0, 2, 1, 3), int(up.contents.ne[0]) * nh, n)
    return ops.ggml_cont_2d(ctx, out, hd_v * nh, n)


def attention(
    ctx: Any,
    hp: HParams,
    w: dict[str, Tensor],
    x: Tensor,
    at: Placement,
    kv: KVCache,
    r: Rope,
    qk_norm: bool,
    qkv_bias: bool,
    whole_qk_norm: bool = False,
) -> tuple[Tensor, list[Tensor]]:
    """Grouped-query self-attention (q/k/v from their own projections or a fused attn_qkv, optional biases, and q/k
    RMSNorm before RoPE: per head, or over the whole query and key vectors with `whole_qk_norm`, as MiniMax M2):
    the output projection of `attend`."""
    hd, nh, nkv, n_tokens = hp.head_dim, hp.n_head, hp.n_head_kv, at.n
    if "attn_qkv" in w:  # one fused projection (Ling 2.0): each token's query, key and value rows in turn
        q, k, v = split_rows(ctx, ops.ggml_mul_mat(ctx, w["attn_qkv"], x), (hd * nh, hd * nkv, hd * nkv))
    else:
        q = ops.ggml_mul_mat(ctx, w["attn_q"], x)
        k = ops.ggml_mul_mat(ctx, w["attn_k"], x)
        v = ops.ggml_mul_mat(ctx, w["attn_v"], x)
    if qkv_bias:
        q = ops.ggml_add(ctx, q, w["attn_q.bias"])
        k = ops.ggml_add(ctx, k, w["attn_k.bias"])
        v = ops.ggml_add(ctx, v, w["attn_v.bias"])
    if whole_qk_norm:
        q = rms_norm(ctx, q, w["attn_q_norm"], hp.rms_eps)
        k = rms_norm(ctx, k, w["attn_k_norm"], hp.rms_eps)
    q = ops.ggml_reshape_3d(ctx, q, hd, nh, n_tokens)
    k = ops.ggml_reshape_3d(ctx, k, hd, nkv, n_tokens)
    if qk_norm:
        q = rms_norm(ctx, q, w["attn_q_norm"], hp.rms_eps)
        k = rms_norm(ctx, k, w["attn_k_norm"], hp.rms_eps)
    q = rope(ctx, q, at.positions, r)
    k = rope(ctx, k, at.positions, r)
    cur, writes = attend(ctx, q, k, v, at, kv, 1.0 / math.sqrt(hd))
    return ops.ggml_mul_mat(ctx, w["attn_output"], cur), writes


def picks_mask(ctx: Any, top_k: Tensor, at: Placement) -> Tensor:
    """An indexer's attention mask: -inf everywhere but at its picks top_k (I32 [k, n], cells of the window: 0),
    then the placement's mask added, so that surplus picks of masked cells stay -inf (llama.cpp's sparse mask,
    llama-graph.cpp:3068-3095; glm-dsa's DSA, qwen4exp's QSA)."""
    picks, n = int(top_k.contents.ne[0]), at.n
    blank = ops.ggml_fill(ctx, ops.ggml_new_tensor_2d(ctx, F32, at.n_kv, n), -np.inf)
    rows = ops.ggml_reshape_4d(ctx, blank, 1, at.n_kv, n, 1)
    zeros = ops.ggml_fill(ctx, ops.ggml_new_tensor_4d(ctx, F32, 1, picks, n, 1), 0.0)
    picked = ops.ggml_set_rows(ctx, rows, zeros, ops.ggml_reshape_3d(ctx, top_k, picks, n, 1))
    return ops.ggml_add(ctx, ops.ggml_reshape_2d(ctx, picked, at.n_kv, n), at.mask)


def attend_alone(
    ctx: Any,
    x: Tensor,
    at: Placement,
    cache: BatchKV,
    attention: Callable[[Tensor, Placement, KVCache], tuple[Tensor, list[Tensor]]],
) -> tuple[Tensor, list[Tensor]]:
    """A batch's tokens x [n_embd, n] (one a sequence, `at.parts`) each through `attention` alone, over its own
    cache: the same ops on the same numbers as its own step, so the same bits (a family whose attention selects
    cells per query: DSA, QSA); their outputs side by side, and every token's cache writes."""
    e, nb1 = int(x.contents.ne[0]), int(x.contents.nb[1])
    outs, writes = [], []
    for i, (part, c) in enumerate(zip(at.parts, cache.caches, strict=True)):
        out, w = attention(ops.ggml_view_2d(ctx, x, e, 1, nb1, i * nb1), part, c)
        outs.append(out)
        writes += w
    cur = outs[0]
    for out in outs[1:]:
        cur = ops.ggml_concat(ctx, cur, out, 1)
    return cur, writes
