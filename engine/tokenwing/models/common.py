"""Graph pieces shared by the MoE families: norms, attention over the KV cache, routers, dense and routed FFNs,
and the tail that adds a layer's experts, its shared expert and the residual.

They follow llama.cpp's graphs op for op (same ggml kernels, same order), so results match it to rounding. A
family module (`models/<arch>.py`) builds its layer graph from these, the way llama.cpp's `src/models/*.cpp`
do; nothing here knows a family by name.
"""

from __future__ import annotations

import ctypes
import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any

import numpy as np

from tokenwing.compute.ggml_lib import F32, Graph, Tensor, ops
from tokenwing.models.hparams import HParams


def rms_norm(ctx: Any, x: Tensor, weight: Tensor, eps: float) -> Tensor:
    return ops.ggml_mul(ctx, ops.ggml_rms_norm(ctx, x, eps), weight)


def split_rows(ctx: Any, x: Tensor, widths: tuple[int, ...]) -> tuple[Tensor, ...]:
    """x [sum(widths), n] as consecutive parts of each column, each [width, n] and contiguous (a fused
    projection's outputs; copies hold the same values as llama.cpp's views of it)."""
    nb1, elt, start, parts = int(x.contents.nb[1]), int(x.contents.nb[0]), 0, []
    for width in widths:
        parts.append(ops.ggml_cont(ctx, ops.ggml_view_2d(ctx, x, width, int(x.contents.ne[1]), nb1, start * elt)))
        start += width
    return tuple(parts)


# ------------------------------------------------------------------------------------------ where tokens go
# Decode attends over the cache rounded up to this many positions, masked (llama.cpp pads to 256): one graph
# serves that many positions, and the masked keys add exact zeros to sums whose SIMD blocks (32 F16 values) are
# unchanged, so the bits do not depend on it (tested: 384 decode steps of the demo model give identical logits with
# 64 and 256). Why not 256: a query's dot products with masked keys are most of a short context's attention — on
# the demo model at 512 positions of context, one thread, a token took 1.04 ms over 256-position windows and
# 0.69 ms over 64-position ones, and 4 sequences' step 3.26 against 2.06 ms; a graph is rebuilt 4× as often.
DECODE_WINDOW = 64


@dataclass(frozen=True)
class Placement:
    """Where a graph's `n` tokens go: positions pos0…pos0+n-1 of the KV cache, attending over its first `n_kv`
    positions (decode: rounded up to DECODE_WINDOW and masked, so that one graph, and one rounding of the
    attention sums, serves DECODE_WINDOW positions). The tensors are inputs of the graph, shared by its layers."""

    n: int
    n_kv: int
    positions: Tensor  # I32 [n] (multi-axis RoPE: [4 n], the text positions on three axes and 0 on the fourth)
    mask: Tensor  # F32 [n_kv, n]
    k_rows: Tensor  # I64 [n]: the tokens' rows in the K cache
    v_cells: Tensor | None  # I64 [n · v_width]: their elements in the (transposed) V cache; None: no V cache
    mask_swa: Tensor | None = None  # F32 [n_kv, n]: the mask of sliding-window layers (gpt-oss), if any
    # A prompt's chunks attend through F32 tiled flash attention: these masks in F16, padded to FLASH_ROWS queries
    # (see `attend`); None: the two matrix products
    flash_mask: Tensor | None = None
    flash_mask_swa: Tensor | None = None
    # Several sequences' decode tokens in one graph (runtime/batch.py): token i is sequence i's, at its own
    # position of its own cache (`BatchKV`), placed by parts[i]; `attend` attends each over its cache alone
    parts: tuple[Placement, ...] = ()
    # The first position, where the graph is built for its positions (`placement`); None in a graph reused for
    # several (the one-graph decode step): a family whose layer graph depends on it (DeepSeek V4's compressed
    # blocks) is never given one (`MoEModel.position_graphs`)
    pos0: int | None = None
    # ... and which of them attend in one product (`batch_runs`): consecutive tokens of consecutive slots of the
    # caches' stack with equal windows; empty: each apart
    runs: tuple[Run, ...] = ()


@dataclass(frozen=True)
class Run:
    """`count` consecutive tokens of a batch, from `start`, whose sequences' caches are consecutive slots of one
    `KVStack` and whose windows are equal: their attention reads go through one product over the stack (the
    parts' masks stacked, [n_kv, 1, 1, count])."""

    start: int
    count: int
    mask: Tensor
    mask_swa: Tensor | None


def batch_runs(ctx: Any, parts: list[Placement], slots: list[int]) -> tuple[Run, ...]:
    """The runs of a batch whose tokens belong to the caches' stack slots `slots` (in token order): maximal
    stretches of consecutive slots with equal windows; a run of one attends on its own. The stacked masks are
    built here, once per graph (every layer reads them)."""

    def stacked(masks: list[Tensor]) -> Tensor:
        m = ops.ggml_reshape_4d(ctx, masks[0], int(masks[0].contents.ne[0]), 1, 1, 1)
        for other in masks[1:]:
            m = ops.ggml_concat(ctx, m, ops.ggml_reshape_4d(ctx, other, int(other.contents.ne[0]), 1, 1, 1), 3)
        return m

    runs: list[Run] = []
    start = 0
    for i in range(1, len(parts) + 1):
        if i < len(parts) and slots[i] == slots[i - 1] + 1 and parts[i].n_kv == parts[start].n_kv:
            continue
        group = parts[start:i]
        if len(group) > 1:
            swa_masks = [p.mask_swa for p in group if p.mask_swa is not None]
            swa = stacked(swa_masks) if swa_masks else None
            runs.append(Run(start, len(group), stacked([p.mask for p in group]), swa))
        start = i
    return tuple(runs)


FLASH_ROWS = 64  # ggml's CPU flash attention runs its F32 tiled kernel for 64 queries or more (GGML_FA_TILE_Q)
FLASH_ALIGN = 16  # ... and value rows of a multiple of the widest SIMD vector (16 floats)


def placement_arrays(
    pos0: int, n: int, n_kv: int, n_ctx: int, v_width: int, window: int = 0, axes: int = 1, flash: bool = False
) -> dict[str, np.ndarray]:
    """The input data of a `Placement` (numpy order); `window`: the sliding window's span, for its own mask (a
    key is masked when the query is `window` or more positions after it, as llama.cpp's standard SWA); `axes`:
    4 for multi-axis RoPE (a text token's position on the first three axes, 0 on the fourth, as llama.cpp);
    `flash`: the F16 masks of flash attention too, each padded to FLASH_ROWS rows with copies of its last
    (padding queries then need no key tile the real ones do not)."""
    mask = np.zeros((n, n_kv), np.float32)
    for i in range(n):
        mask[i, pos0 + i + 1 :] = -np.inf
    rows = np.arange(pos0, pos0 + n, dtype=np.int64)
    positions = rows.astype(np.int32)
    if axes > 1:
        positions = np.concatenate([np.tile(positions, 3), np.zeros(n * (axes - 3), np.int32)])
    out: dict[str, np.ndarray] = {"positions": positions, "mask": mask, "k_rows": rows}
    if v_width:
        out["v_cells"] = (np.arange(v_width, dtype=np.int64)[None, :] * n_ctx + rows[:, None]).reshape(-1)
    if window:
        swa = mask.copy()
        for i in range(n):
            swa[i, : max(0, pos0 + i - window + 1)] = -np.inf
        out["mask_swa"] = swa
    if flash:
        for name in ("mask", "mask_swa") if window else ("mask",):
            m = out[name]
            pad = np.repeat(m[-1:], max(0, FLASH_ROWS - n), axis=0)
            out["flash_" + name] = np.concatenate([m, pad], axis=0).astype(np.float16)
    return out


# The VRAM tier's persistent per-layer device graphs are built per window: there a rebuild costs a device
# allocation per layer, so its windows stay llama.cpp's 256 positions.
DEVICE_DECODE_WINDOW = 256


def decode_window(pos: int, n_ctx: int, step: int = DECODE_WINDOW) -> int:
    return min(n_ctx, -(-(pos + 1) // step) * step)


def placement(
    g: Graph,
    pos0: int,
    n: int,
    n_kv: int,
    n_ctx: int,
    v_width: int,
    window: int = 0,
    axes: int = 1,
    flash: bool = False,
) -> Placement:
    """A `Placement` whose inputs are filled now (a graph built for one use); `flash`: a prompt's, which attends
    through flash attention."""
    a = placement_arrays(pos0, n, n_kv, n_ctx, v_width, window, axes, flash)
    inputs = {name: g.input(v) for name, v in a.items()}
    return Placement(
        n,
        n_kv,
        inputs["positions"],
        inputs["mask"],
        inputs["k_rows"],
        inputs.get("v_cells"),
        inputs.get("mask_swa"),
        inputs.get("flash_mask"),
        inputs.get("flash_mask_swa"),
        pos0=pos0,
    )


@dataclass(frozen=True)
class KVSpec:
    """A layer's cache widths (elements per position): K, and V — stored apart, or (`v_in_k`) the first
    `v` values of each K row, as MLA's compressed latent is both."""

    k: int
    v: int
    v_in_k: bool = False

    @property
    def v_stored(self) -> int:
        """V elements per position stored apart from K (0 when V lives in K)."""
        return 0 if self.v_in_k else self.v

    def bytes_per_position(self, elt: int) -> int:
        """What one position of this layer's cache takes, K and V at `elt` bytes an element (the runtime's cache
        allocates exactly this per position: runtime/kvcache.py)."""
        return (self.k + self.v_stored) * elt


@dataclass(frozen=True)
class KVStack:
    """One layer's caches of every slot in one tensor each (the server's sequences, runtime/kvcache.py): K [k_width,
    n_ctx, slots] and V [n_ctx, v_width, slots] (None: V lives in K). Several sequences' attention then reads
    them as one product (`Run`)."""

    k: Tensor
    v: Tensor | None


@dataclass(frozen=True)
class KVCache:
    """One layer's cache: K [k_width, n_ctx] (a row per position) and V transposed [n_ctx, v_width]; or K alone
    (`v` None: V is the first `v_width` values of each K row, as MLA's latent is). `stack`: the every-slot tensors
    whose slot `index` this cache is, if it is one."""

    k: Tensor
    v: Tensor | None
    elt: int  # bytes per element
    v_width: int
    stack: KVStack | None = None
    index: int = 0


@dataclass(frozen=True)
class StateSpec:
    """A linear-attention layer's recurrent state (F32, GGUF shape order): the last inputs of its short
    convolution, and the delta rule's state matrices, one per value head."""

    conv: tuple[int, ...]
    state: tuple[int, ...]

    @property
    def elements(self) -> int:
        return math.prod(self.conv) + math.prod(self.state)


@dataclass(frozen=True)
class RecurrentCache:
    """One linear-attention layer's state, updated in place by each graph that runs the layer (a prompt's
    chunks one after the other, then each decode step): there is one state, that of the last position.

    `snapshot`: where the graph also writes the state as it was one token before its last (a prompt's end,
    kept as a checkpoint: a request that repeats the prompt resumes there and computes its last token); the
    graph must have at least two tokens then."""

    conv: Tensor
    state: Tensor
    snapshot: RecurrentCache | None = None
    # A layer with a KV cache too (DeepSeek V4's compressing attention: its positions in K, the rows its
    # compressors carry between graphs in the state)
    kv: KVCache | None = None


@dataclass(frozen=True)
class BatchKV(KVCache):
    """One layer's caches of several sequences whose decode tokens share a graph (`Placement.parts`): the
    fields are the first sequence's (what a family reads of a cache's shape), `caches` every one's."""

    caches: tuple[KVCache, ...] = ()


LayerCache = KVCache | RecurrentCache


def kv_cache(cache: LayerCache) -> KVCache:
    """The cache of an attention layer (a family asks for the kind its layer has)."""
    assert isinstance(cache, KVCache), "an attention layer was given a recurrent state"
    return cache


def recurrent_cache(cache: LayerCache) -> RecurrentCache:
    assert isinstance(cache, RecurrentCache), "a linear-attention layer was given a KV cache"
    return cache


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
        writes.append(ops.ggml_set_rows(ctx, v_flat, ops.ggml_reshape_2d(ctx, v, 1, kv.v_width * n), at.v_cells))
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


# --------------------------------------------------------------------------------------------- routing
@dataclass(frozen=True)
class Router:
    """How a router turns logits into experts and weights."""

    k: int
    sigmoid: bool  # probabilities by sigmoid, not softmax
    normalize: bool  # renormalise the top-k weights to sum 1
    scale: float = 1.0  # then multiply them by this
    bias: bool = False  # top-k of probabilities + a per-expert selection bias (weights from the probabilities)
    groups: int = 1  # expert groups: the top-k is taken within the `groups_used` groups whose two best
    groups_used: int = 1  # experts score highest (DeepSeek-V3)
    softmax_selected: bool = False  # weights: softmax over the k selected logits (gpt-oss), no probabilities
    sqrt_softplus: bool = False  # ranked by sqrt(softplus(logits)) + bias (DeepSeek V4: the lookahead's numpy ranking)

    def selection_scores(self, logits: np.ndarray, bias: np.ndarray | None) -> np.ndarray:
        """What the router ranks experts by, from its logits (numpy, for the lookahead's predictions): the
        logits themselves for a plain softmax or sigmoid (same order); else the probabilities plus the
        selection bias, with -inf for the experts of the groups left out."""
        if bias is None and self.groups == 1:
            return logits
        if self.softmax_selected:
            scores = logits.astype(np.float64)
        elif self.sqrt_softplus:
            scores = np.sqrt(np.logaddexp(0.0, logits.astype(np.float64)))
        elif self.sigmoid:
            scores = 1.0 / (1.0 + np.exp(-logits.astype(np.float64)))
        else:
            scores = np.exp(logits - logits.max())
            scores /= scores.sum()
        if bias is not None:
            scores = scores + bias
        if self.groups > 1:
            by_group = scores.reshape(self.groups, -1)
            best2 = np.sort(by_group, axis=1)[:, -2:].sum(axis=1)
            keep = np.argsort(-best2, kind="stable")[: self.groups_used]
            masked = np.full_like(by_group, -np.inf)
            masked[keep] = by_group[keep]
            scores = masked.reshape(-1)
        out: np.ndarray = scores
        return out


def route(ctx: Any, logits: Tensor, router: Router, bias: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Router logits [n_expert, n] → the top-k experts I32 [k, n] (highest first) and their weights F32 [k, n]:
    softmax (or sigmoid) probabilities; the top-k of probabilities + `bias` when given (DeepSeek-V3, GLM-4.5:
    the bias steers the choice only), within the best expert groups where there are groups; weights
    renormalised over the k when asked, then scaled — or (gpt-oss) a softmax over the k selected logits.
    llama.cpp's ops in llama.cpp's order (build_moe_ffn)."""
    n_expert, n, k = int(logits.contents.ne[0]), int(logits.contents.ne[1]), router.k
    if router.softmax_selected:
        probs = logits
    else:
        probs = ops.ggml_sigmoid(ctx, logits) if router.sigmoid else ops.ggml_soft_max(ctx, logits)
    selection = probs if bias is None else ops.ggml_add(ctx, probs, bias)
    if router.groups > 1:
        selection = _best_groups(ctx, selection, router.groups, router.groups_used, n)
    ids = ops.ggml_cont(ctx, ops.ggml_argsort_top_k(ctx, selection, k))
    picked = ops.ggml_get_rows(ctx, ops.ggml_reshape_3d(ctx, probs, 1, n_expert, n), ids)
    weights = ops.ggml_reshape_2d(ctx, picked, k, n)
    if router.softmax_selected:
        weights = ops.ggml_soft_max(ctx, weights)
    if router.normalize:
        total = ops.ggml_clamp(ctx, ops.ggml_sum_rows(ctx, weights), 6.103515625e-5, math.inf)  # (never 0)
        weights = ops.ggml_div(ctx, weights, total)
    if router.scale not in (0.0, 1.0):
        weights = ops.ggml_scale(ctx, weights, router.scale)
    return ids, weights


def _best_groups(ctx: Any, selection: Tensor, groups: int, used: int, n: int) -> Tensor:
    """Scores of the experts outside the `used` groups whose two best experts score highest set to -inf."""
    per = int(selection.contents.ne[0]) // groups
    by_group = ops.ggml_reshape_3d(ctx, selection, per, groups, n)
    top2 = ops.ggml_argsort_top_k(ctx, by_group, 2)  # [2, groups, n]
    best2 = ops.ggml_get_rows(ctx, ops.ggml_reshape_4d(ctx, by_group, 1, per, groups, n), top2)  # [1, 2, groups, n]
    scores = ops.ggml_sum_rows(ctx, ops.ggml_reshape_3d(ctx, best2, 2, groups, n))  # [1, groups, n]
    chosen = ops.ggml_argsort_top_k(ctx, ops.ggml_reshape_2d(ctx, scores, groups, n), used)  # [used, n]
    kept = ops.ggml_get_rows(ctx, by_group, chosen)  # [per, used, n]
    masked = ops.ggml_set_rows(ctx, ops.ggml_fill(ctx, by_group, -math.inf), kept, chosen)
    return ops.ggml_reshape_2d(ctx, masked, per * groups, n)


# ------------------------------------------------------------------------------------------------ FFNs
def swiglu(ctx: Any, g: Tensor, u: Tensor, limit: float = 0.0) -> Tensor:
    """silu(g) · u; with a `limit` (Ling 3.0's swiglu_clamp_*), min(silu(g), limit) · clamp(u, ±limit), in
    llama.cpp's ops (it takes a limit above 1e-6 as set)."""
    if limit > 1e-6:
        u = ops.ggml_clamp(ctx, u, -limit, limit)
        return ops.ggml_mul(ctx, ops.ggml_clamp(ctx, ops.ggml_silu(ctx, g), -math.inf, limit), u)
    return ops.ggml_swiglu_split(ctx, g, u)


def swiglu_ffn(ctx: Any, gate: Tensor, up: Tensor, down: Tensor, x: Tensor, limit: float = 0.0) -> Tensor:
    g = ops.ggml_mul_mat(ctx, gate, x)
    u = ops.ggml_mul_mat(ctx, up, x)
    return ops.ggml_mul_mat(ctx, down, swiglu(ctx, g, u, limit))


def dense_ffn(ctx: Any, w: dict[str, Tensor], x: Tensor, limit: float = 0.0) -> Tensor:
    return swiglu_ffn(ctx, w["ffn_gate"], w["ffn_up"], w["ffn_down"], x, limit)


def shared_expert(ctx: Any, w: dict[str, Tensor], x: Tensor, gated: bool, limit: float = 0.0) -> Tensor:
    """The shared expert(s) of a MoE layer; `gated`: scaled by sigmoid(ffn_gate_inp_shexp · x) (qwen2moe)."""
    out = swiglu_ffn(ctx, w["ffn_gate_shexp"], w["ffn_up_shexp"], w["ffn_down_shexp"], x, limit)
    if gated:
        out = ops.ggml_mul(ctx, out, ops.ggml_sigmoid(ctx, ops.ggml_mul_mat(ctx, w["ffn_gate_inp_shexp"], x)))
    return out


# -------------------------------------------------------------------------------------- a layer's result
@dataclass
class Routed:
    """A MoE layer's graph up to its routed experts, which the runtime computes from wherever they are."""

    cur: Tensor  # the experts' input (after the FFN norm)
    residual: Tensor  # added after the experts (the attention output plus the layer input)
    ids: Tensor  # I32 [k, n]: the selected experts, highest first
    weights: Tensor  # F32 [k, n]
    shared: Tensor | None = None  # the shared expert's output, when the layer has one

    def outputs(self) -> dict[str, Tensor]:
        return {f.name: t for f in fields(self) if (t := getattr(self, f.name)) is not None}


@dataclass
class LayerOut:
    """What a family's `layer` graph gives: the cache writes (to put in the graph first), and either the layer's
    output (a dense layer) or its routed part."""

    writes: list[Tensor]
    out: Tensor | None = None
    routed: Routed | None = None


def moe_tail(ctx: Any, experts: Tensor, shared: Tensor | None, residual: Tensor) -> Tensor:
    """The layer's output: (routed experts + shared expert) + residual, as llama.cpp's graph adds them."""
    total = experts if shared is None else ops.ggml_add(ctx, experts, shared)
    return ops.ggml_add(ctx, total, residual)


def moe_tail_array(experts: np.ndarray, shared: np.ndarray | None, residual: np.ndarray) -> np.ndarray:
    """`moe_tail` on arrays, in place in `experts` (the prompt path: same additions, same order)."""
    if shared is not None:
        experts += shared
    experts += residual
    return experts


# ----------------------------------------------------------------------------------------- routed experts
@dataclass(frozen=True)
class ExpertFFN:
    """How a family's routed experts compute: SwiGLU, or gpt-oss's clamped swiglu_oai; optional per-expert
    biases of the gate, up and down projections ([n_ff or n_embd, n_expert], indexed by expert id)."""

    oai: bool = False
    biases: tuple[Tensor, Tensor, Tensor] | None = None
    limit: float = 0.0  # a SwiGLU limit (`swiglu`)
    situ: tuple[float, float] | None = None  # SiTU's (beta, linear beta) in place of SwiGLU (Kimi K3, `situ`)
    clamp_gate: bool = False  # the limit clamps the gate before the SiLU (ggml_swiglu_clamp: DeepSeek V4)


SWIGLU = ExpertFFN()
OAI_ALPHA, OAI_LIMIT = 1.702, 7.0  # llama.cpp hard-codes gpt-oss's swiglu_oai parameters (build_moe_ffn)


def situ(ctx: Any, gate: Tensor, up: Tensor, beta: float, linear_beta: float) -> Tensor:
    """Kimi K3's SiTU: β·tanh(gate/β)·sigmoid(gate) · β'·tanh(up/β') (up as it is where β' ≤ 0), as llama.cpp writes
    it; 1/β in float32, as C divides it (a Python division rounded to float could differ in the last bit)."""
    f32 = np.float32
    act = ops.ggml_scale(ctx, ops.ggml_tanh(ctx, ops.ggml_scale(ctx, gate, float(f32(1.0) / f32(beta)))), beta)
    act = ops.ggml_mul(ctx, act, ops.ggml_sigmoid(ctx, gate))
    if linear_beta > 0.0:
        up = ops.ggml_tanh(ctx, ops.ggml_scale(ctx, up, float(f32(1.0) / f32(linear_beta))))
        up = ops.ggml_scale(ctx, up, linear_beta)
    return ops.ggml_mul(ctx, act, up)


def _activate(ctx: Any, gate: Tensor, up: Tensor, ffn: ExpertFFN) -> Tensor:
    if ffn.situ is not None:
        return situ(ctx, gate, up, *ffn.situ)
    if ffn.oai:
        return ops.ggml_swiglu_oai(ctx, gate, up, OAI_ALPHA, OAI_LIMIT)
    if ffn.clamp_gate and ffn.limit > 1e-6:
        return ops.ggml_swiglu_clamp(ctx, gate, up, ffn.limit)
    return swiglu(ctx, gate, up, ffn.limit)


def routed_experts(
    g: Graph,
    views: tuple[Tensor, Tensor, Tensor],
    cur: np.ndarray,
    tokens: np.ndarray,
    slots: np.ndarray,
    weights: np.ndarray,
    experts: np.ndarray,
    ffn: ExpertFFN = SWIGLU,
) -> Tensor:
    """w · down(act(gate x, up x)) for m (token, expert) pairs, one pair per row, read from the slot pool.

    Pair i's input is the row cur[tokens[i]] (gathered straight into the graph: one copy); slots, weights,
    experts (ids, for biases): [m]. Returns [n_embd, 1, m]. One selected expert per row: a wave computes exactly
    its own pairs (no masked entries), and ggml's mul_mat_id never sees one slot twice for one row (its row
    tables hold at most one entry per expert and row).
    """
    m, n_embd = len(tokens), cur.shape[1]
    ids = g.input(slots.astype(np.int32).reshape(m, 1))
    w = g.input(weights.astype(np.float32).reshape(m, 1, 1))
    eids = g.input(experts.astype(np.int32).reshape(m, 1)) if ffn.biases is not None else None
    x = ops.ggml_reshape_3d(g.ctx, g.gather(cur, tokens), n_embd, 1, m)
    return weighted_experts(g.ctx, views, x, ids, w, ffn, eids)


GEMM_ROWS = 4  # ggml's repacked 2-D product runs its 4-row kernel on each group of four rows, its 1-row one on the rest


def _segments(slots: np.ndarray) -> list[tuple[int, int, int]]:
    """(slot, first row, rows) of each run of equal slots in `slots` (sorted by slot)."""
    bounds = np.r_[0, np.flatnonzero(np.diff(slots)) + 1, len(slots)].tolist()
    return [(int(slots[lo]), lo, hi - lo) for lo, hi in itertools.pairwise(bounds)]


def grouped_rows(slots: np.ndarray) -> np.ndarray:
    """Where each of m pairs sorted by slot lands among `grouped_experts`' padded rows."""
    out, at = np.empty(len(slots), np.int64), 0
    for _, lo, n in _segments(slots):
        out[lo : lo + n] = np.arange(at, at + n)
        at += -(-n // GEMM_ROWS) * GEMM_ROWS
    return out


def grouped_experts(
    g: Graph,
    views: tuple[Tensor, Tensor, Tensor],
    per_slot: list[list[Tensor] | None],
    cur: np.ndarray,
    tokens: np.ndarray,
    slots: np.ndarray,
    weights: np.ndarray,
    experts: np.ndarray,
    ffn: ExpertFFN = SWIGLU,
) -> tuple[Tensor, list[Tensor]]:
    """`routed_experts` for m pairs sorted by slot (pair i: the input row cur[tokens[i]]), a projection in ggml's
    repacked layout multiplied as one 2-D product per expert (`per_slot[p]`: that projection's 2-D tensor of each
    slot; None: a plain projection, multiplied by mul_mat_id over all rows as before). Each expert's rows are
    padded to a multiple of GEMM_ROWS with copies of its last row (weight 0), so that every row runs through the
    repacked 4-row kernel (a padded row's output is dropped).

    Returns the weighted outputs [n_embd, 1, M] over the padded rows (`grouped_rows` picks the pairs' rows) and the
    copies into the activations' buffer, which must run before the graph's other nodes read it: compute them
    first (`Graph.compute(*copies, out)`)."""
    segs = _segments(slots)
    n_embd = cur.shape[1]
    padded = [(slot, lo, n, -(-n // GEMM_ROWS) * GEMM_ROWS) for slot, lo, n in segs]
    total = sum(p for *_, p in padded)
    rows = np.empty(total, np.int64)
    ids = np.zeros(total, np.int32)
    w = np.zeros(total, np.float32)
    eids = np.zeros(total, np.int32)
    at = 0
    for slot, lo, n, p in padded:
        rows[at : at + n] = tokens[lo : lo + n]
        rows[at + n : at + p] = tokens[lo + n - 1]
        ids[at : at + p] = slot
        w[at : at + n] = weights[lo : lo + n]
        eids[at : at + p] = experts[lo]
        at += p
    ctx = g.ctx
    xt = g.gather(cur, rows)  # [n_embd, M]
    ids_t = g.input(ids.reshape(total, 1))
    eids_t = g.input(eids.reshape(total, 1)) if ffn.biases is not None else None

    def project(p: int, inp: Tensor, width: int, out_width: int) -> tuple[Tensor, list[Tensor]]:
        """Projection p of every padded row of inp [width, M] → [out_width, 1, M] (and its copies, if per expert)."""
        tensors = per_slot[p]
        if tensors is None:
            return ops.ggml_mul_mat_id(ctx, views[p], ops.ggml_reshape_3d(ctx, inp, width, 1, total), ids_t), []
        out = ops.ggml_new_tensor_2d(ctx, ops.GGML_TYPE_F32, out_width, total)
        copies, at = [], 0
        for slot, _, _, n_pad in padded:
            part = ops.ggml_view_2d(ctx, inp, width, n_pad, int(inp.contents.nb[1]), at * int(inp.contents.nb[1]))
            y = ops.ggml_mul_mat(ctx, tensors[slot], part)
            dst = ops.ggml_view_2d(ctx, out, out_width, n_pad, int(out.contents.nb[1]), at * int(out.contents.nb[1]))
            copies.append(ops.ggml_cpy(ctx, y, dst))
            at += n_pad
        return ops.ggml_reshape_3d(ctx, out, out_width, 1, total), copies

    n_ff = int(views[0].contents.ne[1])
    if per_slot[0] is not None and per_slot[1] is not None:
        runs = [(slot, int(experts[lo]), n_pad) for slot, lo, _, n_pad in padded]
        return _grouped_ffn(g, views, per_slot, xt, runs, ids_t, eids_t, w, ffn)
    gate, c_gate = project(0, xt, n_embd, n_ff)
    up, c_up = project(1, xt, n_embd, n_ff)
    if ffn.biases is not None:
        assert eids_t is not None
        gate = ops.ggml_add_id(ctx, gate, ffn.biases[0], eids_t)
        up = ops.ggml_add_id(ctx, up, ffn.biases[1], eids_t)
    act = _activate(ctx, gate, up, ffn)  # [n_ff, 1, M]
    act2 = ops.ggml_reshape_2d(ctx, act, n_ff, total)
    down, c_down = project(2, act2, n_ff, n_embd)
    if ffn.biases is not None:
        assert eids_t is not None
        down = ops.ggml_add_id(ctx, down, ffn.biases[2], eids_t)
    out = ops.ggml_mul(ctx, down, g.input(w.reshape(total, 1, 1)))
    # (the copies of gate and up come before the activation reads them, the down copies after it)
    return out, [*c_gate, *c_up, act, *c_down]


def _grouped_ffn(
    g: Graph,
    views: tuple[Tensor, Tensor, Tensor],
    per_slot: list[list[Tensor] | None],
    xt: Tensor,
    runs: list[tuple[int, int, int]],
    ids_t: Tensor,
    eids_t: Tensor | None,
    w: np.ndarray,
    ffn: ExpertFFN,
) -> tuple[Tensor, list[Tensor]]:
    """`grouped_experts` where gate and up are both repacked: each expert's activation — and its down product too
    where down is repacked — in one run of products, and one copy per row of what the next step reads (the
    activations for a plain down's mul_mat_id, else the expert's output): copies were 6 % of an in-RAM prompt.
    `runs`: (slot, expert id, padded rows) of each expert, in row order."""
    ctx = g.ctx
    n_embd, total = int(xt.contents.ne[0]), int(xt.contents.ne[1])
    n_ff = int(views[0].contents.ne[1])
    down_slots = per_slot[2]
    width = n_embd if down_slots is not None else n_ff
    buf = ops.ggml_new_tensor_2d(ctx, ops.GGML_TYPE_F32, width, total)
    gate_slots, up_slots = per_slot[0], per_slot[1]
    assert gate_slots is not None and up_slots is not None
    x_row, buf_row = int(xt.contents.nb[1]), int(buf.contents.nb[1])
    copies, at = [], 0
    for slot, expert, n_pad in runs:
        part = ops.ggml_view_2d(ctx, xt, n_embd, n_pad, x_row, at * x_row)
        gate = ops.ggml_mul_mat(ctx, gate_slots[slot], part)
        up = ops.ggml_mul_mat(ctx, up_slots[slot], part)
        if ffn.biases is not None:  # (the expert's column of each bias: add_id's additions)
            gate = ops.ggml_add(ctx, gate, _column(ctx, ffn.biases[0], expert))
            up = ops.ggml_add(ctx, up, _column(ctx, ffn.biases[1], expert))
        y = _activate(ctx, gate, up, ffn)
        if down_slots is not None:
            y = ops.ggml_mul_mat(ctx, down_slots[slot], y)
            if ffn.biases is not None:
                y = ops.ggml_add(ctx, y, _column(ctx, ffn.biases[2], expert))
        copies.append(ops.ggml_cpy(ctx, y, ops.ggml_view_2d(ctx, buf, width, n_pad, buf_row, at * buf_row)))
        at += n_pad
    if down_slots is None:
        down = ops.ggml_mul_mat_id(ctx, views[2], ops.ggml_reshape_3d(ctx, buf, n_ff, 1, total), ids_t)
        if ffn.biases is not None:
            assert eids_t is not None
            down = ops.ggml_add_id(ctx, down, ffn.biases[2], eids_t)
    else:
        down = ops.ggml_reshape_3d(ctx, buf, n_embd, 1, total)
    return ops.ggml_mul(ctx, down, g.input(w.reshape(total, 1, 1))), copies


def _column(ctx: Any, t: Tensor, i: int) -> Tensor:
    """Column i of a 2-D tensor [n, m] as [n] (an expert's bias)."""
    return ops.ggml_view_1d(ctx, t, int(t.contents.ne[0]), i * int(t.contents.nb[1]))


def token_experts(
    ctx: Any,
    views: tuple[Tensor, Tensor, Tensor],
    x: Tensor,
    slots: Tensor,
    weights: Tensor,
    ffn: ExpertFFN = SWIGLU,
    experts: Tensor | None = None,
) -> Tensor:
    """One token's k experts, weighted and summed: x [n_embd], slots I32 [k, 1], weights F32 [k] (and their ids
    I32 [k, 1], for biases) → [n_embd]: `tokens_experts` of one token. The same kernels and additions as
    `routed_experts` + `sum_experts` (one expert per row of mul_mat_id's table)."""
    n_embd, k = int(x.contents.ne[0]), int(slots.contents.ne[0])
    x1, w1 = ops.ggml_reshape_2d(ctx, x, n_embd, 1), ops.ggml_reshape_2d(ctx, weights, k, 1)
    return ops.ggml_view_1d(ctx, tokens_experts(ctx, views, x1, slots, w1, ffn, experts), n_embd, 0)


def weighted_experts(
    ctx: Any,
    views: tuple[Tensor, Tensor, Tensor],
    x: Tensor,
    ids: Tensor,
    w: Tensor,
    ffn: ExpertFFN,
    experts: Tensor | None,
) -> Tensor:
    """w · down(act(gate x, up x)) through mul_mat_id over the slot pool's 3-D views (biases by expert id)."""
    return weighted_down(ctx, views, expert_activations(ctx, views, x, ids, ffn, experts), ids, w, ffn, experts)


def expert_activations(
    ctx: Any, views: tuple[Tensor, Tensor, Tensor], x: Tensor, ids: Tensor, ffn: ExpertFFN, experts: Tensor | None
) -> Tensor:
    """act(gate x, up x) of each (token, expert) row [n_ff, 1, m]: the half of an expert that needs only its gate
    and up projections (a decode step computes it while down is still being read)."""
    gate_v, up_v, _ = views
    gate, up = ops.ggml_mul_mat_id(ctx, gate_v, x, ids), ops.ggml_mul_mat_id(ctx, up_v, x, ids)
    if ffn.biases is not None:
        assert experts is not None
        gate = ops.ggml_add_id(ctx, gate, ffn.biases[0], experts)
        up = ops.ggml_add_id(ctx, up, ffn.biases[1], experts)
    return _activate(ctx, gate, up, ffn)


def weighted_down(
    ctx: Any,
    views: tuple[Tensor, Tensor, Tensor],
    act: Tensor,
    ids: Tensor,
    w: Tensor,
    ffn: ExpertFFN,
    experts: Tensor | None,
) -> Tensor:
    """w · down(act): the other half (the same ops as in one graph, so the same bits)."""
    down = ops.ggml_mul_mat_id(ctx, views[2], act, ids)
    if ffn.biases is not None:
        assert experts is not None
        down = ops.ggml_add_id(ctx, down, ffn.biases[2], experts)
    return ops.ggml_mul(ctx, down, w)


def tokens_experts(
    ctx: Any,
    views: tuple[Tensor, Tensor, Tensor],
    x: Tensor,
    slots: Tensor,
    weights: Tensor,
    ffn: ExpertFFN = SWIGLU,
    experts: Tensor | None = None,
) -> Tensor:
    """`token_experts` for n tokens at once (several sequences' decode tokens, runtime/batch.py): x [n_embd, n],
    slots I32 [k, n], weights F32 [k, n] → [n_embd, n]. mul_mat_id computes each row as it does for one token
    (row by row), and each token's k outputs are added in rank order: every token's bits are those it gets
    alone."""
    n_embd, k, n = int(x.contents.ne[0]), int(slots.contents.ne[0]), int(slots.contents.ne[1])
    w = ops.ggml_reshape_3d(ctx, weights, 1, k, n)
    weighted = weighted_experts(ctx, views, ops.ggml_reshape_3d(ctx, x, n_embd, 1, n), slots, w, ffn, experts)
    row = n_embd * 4
    total = ops.ggml_view_2d(ctx, weighted, n_embd, n, row * k, 0)
    for i in range(1, k):
        total = ops.ggml_add(ctx, total, ops.ggml_view_2d(ctx, weighted, n_embd, n, row * k, i * row))
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
