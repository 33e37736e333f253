"""The routed experts' pieces: the family's activation and biases (`ExpertFFN`), a prompt's experts in one
product or per expert (`routed_experts`, `grouped_experts`), a token's weighted experts and their sum."""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any

import numpy as np

from tokenwing.compute.ggml_lib import Graph, Tensor, ops
from tokenwing.models.ffn import swiglu


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
    gelu: bool = False  # GELU-gated in place of SwiGLU (ggml_geglu_split: build_moe_ffn's LLM_FFN_GELU, Gemma 4)


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
    if ffn.gelu:
        return ops.ggml_geglu_split(ctx, gate, up)
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
