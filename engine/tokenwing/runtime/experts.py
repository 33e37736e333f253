"""Computing routed experts where the streaming core put them: views of its slot pools as ggml tensors, a
prompt's experts wave by wave, and a decode token's experts (in one graph with the next layer when all are in
RAM; otherwise the resident ones first, while the others land).
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import numpy as np

from tokenwing.compute.ggml_lib import Graph, Repacker, Tensor, TensorArena, ops, to_numpy
from tokenwing.format.gguf_io import tensor_nbytes
from tokenwing.models import common
from tokenwing.runtime.scheduler import ExpertScheduler

Views = tuple[Tensor, Tensor, Tensor]


def selected(sel: np.ndarray, experts: list[int]) -> np.ndarray:
    """Which entries of the expert ids `sel` are among `experts` (np.isin, without its ~20 µs a call: a decode
    step asks several times a layer, and in a 4-sequence step at a quarter of the experts it was 8 % of the
    step's Python)."""
    if not experts or not sel.size:
        return np.zeros(sel.shape, bool)
    if sel.min() < 0:  # (no id is negative; were one, it would index from the end)
        out0: np.ndarray = np.isin(sel, experts)
        return out0
    member = np.zeros(max(int(sel.max(initial=0)), max(experts)) + 1, bool)
    member[experts] = True
    out: np.ndarray = member[sel]
    return out


class DeviceExperts(Protocol):
    """What a prompt's experts need of the VRAM tier (runtime/vram/)."""

    def held(self, block: int, experts: list[int]) -> list[int]: ...

    def count_prompt_hits(self, block: int, n: int) -> None: ...

    def from_vram(
        self, block: int, cur: np.ndarray, tokens: np.ndarray, experts: np.ndarray, weights: np.ndarray
    ) -> np.ndarray: ...

    def wave_on_gpu(self, n_pairs: int, n_experts: int) -> bool: ...

    def observe_prompt(self, block: int, sel: np.ndarray) -> None: ...

    def from_ram(
        self,
        block: int,
        cur: np.ndarray,
        tokens: np.ndarray,
        experts: np.ndarray,
        weights: np.ndarray,
        slot_of: np.ndarray,
    ) -> np.ndarray: ...


def _block(gtype: int) -> int:
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    return int(GGML_QUANT_SIZES[GGMLQuantizationType(gtype)][0])


class ExpertPools:
    """Per streamed layer: gate, up and down as 3-D tensors over the slot pool (expert stride = record), for
    mul_mat_id (a token's experts, and a prompt's: rows grouped by expert).

    With `repack`, projections that have a repacked kernel on this CPU are kept in that layout: the streaming
    core's I/O threads rewrite each one as it lands (through a 2-D tensor per slot, ggml's repacking unit). Those
    per-slot tensors (`per_slot[layer][projection]`, None for a plain projection) are also what a prompt's experts
    multiply with: see `ExpertCompute._expert_matmuls`.
    """

    def __init__(self, scheduler: ExpertScheduler, arena: TensorArena, repack: bool) -> None:
        streamer = scheduler.streamer
        repacker = Repacker() if repack else None
        self._arena = TensorArena(3 * sum(pool.shape[0] for pool in streamer.pools) + 8 if repack else 8)
        self.views: dict[int, Views] = {}
        self.per_slot: dict[int, list[list[Tensor] | None]] = {}
        for li, el in enumerate(streamer.layers):
            pool = streamer.pools[li]
            n_slots = pool.shape[0]
            base = pool.ctypes.data
            out: list[Tensor] = []
            slot_tensors: list[list[Tensor] | None] = []
            for p in range(3):
                ne0, ne1 = el.shapes[p]
                row = tensor_nbytes((ne0,), el.types[p])
                elt = tensor_nbytes((_block(el.types[p]),), el.types[p])
                view = arena.wrap(
                    base + el.proj_offset[p],
                    el.types[p],
                    (ne0, ne1, n_slots),
                    owner=pool,
                    strides=(elt, row, el.record_size),
                )
                if repacker is not None and repacker.prepare(view):
                    per_slot = [
                        self._arena.wrap(base + s * el.record_size + el.proj_offset[p], el.types[p], (ne0, ne1), pool)
                        for s in range(n_slots)
                    ]
                    for t in per_slot:
                        repacker.prepare(t)
                    # each landed projection goes through ggml's repacking into its slot (an I/O thread)
                    ctx = [ctypes.addressof(t.contents) for t in per_slot]
                    streamer.set_transform(el.layer, p, repacker.setter(), ctx)
                    slot_tensors.append(per_slot)
                else:
                    slot_tensors.append(None)
                out.append(view)
            self.views[el.layer] = (out[0], out[1], out[2])
            self.per_slot[el.layer] = slot_tensors

    def close(self) -> None:
        self._arena.close()


class ExpertCompute:
    def __init__(
        self,
        scheduler: ExpertScheduler,
        pools: ExpertPools,
        graph: Graph,
        max_batch: int,
        ffn: dict[int, common.ExpertFFN],
    ) -> None:
        """ffn: how each streamed layer's experts compute (the family's activation and biases)."""
        self.scheduler, self.pools, self.graph, self.max_batch = scheduler, pools, graph, max_batch
        self.ffn = ffn
        self.k = scheduler.k
        # split demand reads land gate/up first: compute that half before down is in
        self.staged = scheduler.streamer.settings.split_demand

    # ------------------------------------------------------------------------------------------ a prompt
    def prompt(
        self,
        block: int,
        cur: np.ndarray,
        sel: np.ndarray,
        weights: np.ndarray,
        device: DeviceExperts | None = None,
        also: Sequence[int] = (),
        each_wave: Callable[[list[int]], None] | None = None,
    ) -> np.ndarray:
        """A prompt's experts in waves (recency order, `ExpertScheduler.prompt_order`), summed as they come.

        Each token adds its experts' outputs as the waves come, into a running sum in F64 (one per token, not
        every token's k outputs): k F32 outputs add exactly in F64 (unless their magnitudes span more than 2^26),
        so the sum, rounded to F32 once, is the same whatever the order — and the order does change: with the
        number of waves (the budget), and with the prompt's split into passes, since each pass orders its own
        experts. In F32 it did change the bits: a Kimi K3 prompt split into passes of 16 tokens differed from one
        pass from token 48 on, on an AVX2 machine (two of a token's experts swapped places in the passes' orders;
        1.2e-7 at the first layer, 0.49 in the logits of the random-weight model). The F64 sum costs 0.72 ms a
        layer for 512 tokens of the demo model (n_embd 256, top-4) against 0.41 in F32, ~1 % of its prompt (and
        less on a larger model, whose products grow with the experts' width). llama.cpp adds in rank order, in
        F32: the difference is rounding.

        With a `device` (the VRAM tier): the experts it holds come first, computed there and never read into RAM;
        a wave of the others whose experts serve enough tokens each runs on the GPU too (copied up from RAM).

        `also`: experts the prompt does not use, read after its own (other sequences' decode tokens in the same
        pass, runtime/batch.py), and `each_wave(wave)` called while each wave is in RAM (those sequences compute
        theirs): the prompt's own sums are those it gets alone, whatever else the waves hold.
        """
        n_expert = self.scheduler.n_expert
        unique = self.scheduler.prompt_order(sel, n_expert)
        held = device.held(block, unique) if device is not None else []
        if held:
            in_vram = set(held)
            unique = held + [e for e in unique if e not in in_vram]
        place = np.zeros(n_expert, np.int64)
        place[unique] = np.arange(len(unique))
        acc = np.zeros((sel.shape[0], cur.shape[1]), np.float64)
        if device is not None:
            device.observe_prompt(block, sel)
        if device is not None and held:
            device.count_prompt_hits(block, len(held))
            self._add_wave(acc, sel, weights, held, place, lambda t, e, w: device.from_vram(block, cur, t, e, w), False)
        for wave, slot_of in self.scheduler.waves(block, [*unique[len(held) :], *also]):
            pairs = int(selected(sel, wave).sum())
            if device is not None and device.wave_on_gpu(pairs, len(wave)):

                def on_gpu(
                    t: np.ndarray, e: np.ndarray, w: np.ndarray, so: np.ndarray = slot_of, dev: DeviceExperts = device
                ) -> np.ndarray:
                    return dev.from_ram(block, cur, t, e, w, so)

                self._add_wave(acc, sel, weights, wave, place, on_gpu, False)
            else:

                def on_cpu(t: np.ndarray, e: np.ndarray, w: np.ndarray, so: np.ndarray = slot_of) -> np.ndarray:
                    return self._expert_matmuls(block, cur, t, so[e], e, w)

                self._add_wave(acc, sel, weights, wave, place, on_cpu, True)
            if each_wave is not None:
                each_wave(wave)
        return acc.astype(np.float32)

    def _add_wave(
        self,
        acc: np.ndarray,
        sel: np.ndarray,
        weights: np.ndarray,
        wave: list[int],
        place: np.ndarray,
        compute: Callable[[np.ndarray, np.ndarray, np.ndarray], np.ndarray],
        grouped: bool,
    ) -> None:
        """Adds a wave's weighted outputs to each token's running sum, in wave order. `compute(tokens, experts,
        weights)` gives the weighted outputs of (token, expert) pairs sorted by expert; `grouped`: called per
        block of at most a graph's rows (the CPU's), else once for the whole wave."""
        tok, j = np.nonzero(selected(sel, wave))
        order = np.lexsort((tok, place[sel[tok, j]]))  # by expert in wave order, then by token
        tok, j = tok[order], j[order]
        for group in self._expert_groups(sel[tok, j]) if grouped else [slice(0, len(tok))]:
            t, jj = tok[group], j[group]
            out = compute(t, sel[t, jj], weights[t, jj])
            # each token adds its outputs in wave order: one row per token per level
            by_token = np.lexsort((place[sel[t, jj]], t))
            t = t[by_token]  # (out is indexed through by_token below: no reordered copy of it)
            occurrence = np.arange(len(t)) - np.searchsorted(t, t)
            for level in range(int(occurrence.max()) + 1 if len(t) else 0):
                m = occurrence == level
                acc[t[m]] += out[by_token[m]]

    def _expert_groups(self, experts: np.ndarray) -> list[slice]:
        """Pairs sorted by expert → slices of whole experts (an expert's rows split into fixed blocks when it
        has more than a graph holds), at most `max_batch · k` rows each. The blocks of an expert depend only on
        its own rows, so ggml's batched kernels see the same columns whatever the waves: results do not
        depend on the budget."""
        limit = self.max_batch * self.k
        bounds = np.flatnonzero(np.diff(experts)) + 1
        units: list[tuple[int, int]] = []
        for lo, hi in zip(np.r_[0, bounds].tolist(), np.r_[bounds, len(experts)].tolist(), strict=True):
            units += [(b, min(b + limit, hi)) for b in range(lo, hi, limit)]
        groups: list[slice] = []
        for lo, hi in units:
            if groups and hi - groups[-1].start <= limit:
                groups[-1] = slice(groups[-1].start, hi)
            else:
                groups.append(slice(lo, hi))
        return groups

    def _expert_matmuls(
        self,
        block: int,
        cur: np.ndarray,
        tokens: np.ndarray,
        slots: np.ndarray,
        experts: np.ndarray,
        weights: np.ndarray,
    ) -> np.ndarray:
        """Weighted outputs [m, n_embd] of m pairs sorted by slot: each projection one mul_mat_id over the
        group's experts (ggml's kernel groups the rows by expert and reads each expert's weights once per block
        of 16 rows, as a plain product does — the same bits). Before: three plain products per expert, ~5 graph
        nodes each, every node a barrier of the two threads; that cost 1.12× on an idle machine and 1.6× with
        the other core busy (one layer of a 2,048-token prompt on the bench model: 1.90 → 1.70 s).

        Projections in ggml's repacked layouts are multiplied per expert instead: ggml's repacked mul_mat_id runs
        its one-row kernel (gemv) for every row, while its 2-D product runs the 4-row kernel (gemm) on each group
        of four — 2.1–2.6× faster on Q4_K. Each expert's rows are padded with zero rows to a multiple of four,
        so every row goes through the 4-row kernel whatever its expert's count (the two kernels round
        differently): a token's result still does not depend on the waves, the chunks or the budget."""
        g = self.graph
        g.reset()
        views, ffn = self.pools.views[block], self.ffn[block]
        per_slot = self.pools.per_slot.get(block)
        if per_slot is not None and any(p is not None for p in per_slot):
            moe, order = common.grouped_experts(g, views, per_slot, cur, tokens, slots, weights, experts, ffn)
            g.compute(*order, moe)
            padded = to_numpy(moe).reshape(-1, cur.shape[1])
            picked: np.ndarray = padded[common.grouped_rows(slots)]
            return picked
        moe = common.routed_experts(g, views, cur, tokens, slots, weights, experts, ffn)
        g.compute(moe)
        return to_numpy(moe).reshape(-1, cur.shape[1])

    # -------------------------------------------------------------------------------------- a decode token
    def token(self, ctx: Any, block: int, x: Tensor, slots: Tensor, weights: Tensor, experts: Tensor | None) -> Tensor:
        """A token's experts in a graph, weighted and summed, from the slots they are in (all in RAM); `experts`:
        their ids I32 [k, 1] (needed by families whose experts have biases)."""
        return common.token_experts(ctx, self.pools.views[block], x, slots, weights, self.ffn[block], experts)

    def tokens(self, ctx: Any, block: int, x: Tensor, slots: Tensor, weights: Tensor, experts: Tensor | None) -> Tensor:
        """`token` for several tokens [n_embd, n] (slots, weights, ids [k, n]): each gets the bits it gets alone."""
        return common.tokens_experts(ctx, self.pools.views[block], x, slots, weights, self.ffn[block], experts)

    def needs_ids(self, block: int) -> bool:
        return self.ffn[block].biases is not None

    def decode_weighted(
        self, block: int, cur: np.ndarray, sel: np.ndarray, weights: np.ndarray, wave: list[int], ready: list[bool]
    ) -> np.ndarray:
        """A token's experts (or a decode step's, a row per sequence: runtime/batch.py) when some are still on
        their way: the ready ones first, then the others as they land. Returns their weighted outputs [n, k,
        n_embd] (zero at the ranks of experts computed elsewhere: the GPU's, or another wave's), which the caller
        sums in rank order (the same additions as in one graph). With split demand
        reads, the late experts' gate/up half is computed as soon as those projections are in, while their down
        projections are still being read (spec §9)."""
        weighted = np.zeros((sel.shape[0], sel.shape[1], cur.shape[1]), np.float32)
        first = [e for e, ok in zip(wave, ready, strict=True) if ok]
        rest = [e for e, ok in zip(wave, ready, strict=True) if not ok]
        for part in (first, rest) if first and rest else (wave,):
            if not part:
                continue
            if self.staged and part is not first:
                self._staged(block, cur, sel, weights, part, weighted)
                continue
            slot_of = np.zeros(self.scheduler.n_expert, np.int32)
            slot_of[part] = self.scheduler.wait_all(block, part)
            tok, j = np.nonzero(selected(sel, part))
            self.graph.reset()
            views, ffn = self.pools.views[block], self.ffn[block]
            moe = common.routed_experts(
                self.graph, views, cur, tok, slot_of[sel[tok, j]], weights[tok, j], sel[tok, j], ffn
            )
            self.graph.compute(moe)
            weighted[tok, j] = to_numpy(moe).reshape(-1, cur.shape[1])
        return weighted

    def _staged(
        self, block: int, cur: np.ndarray, sel: np.ndarray, weights: np.ndarray, part: list[int], weighted: np.ndarray
    ) -> None:
        """The experts of `part` in two graphs: act(gate x, up x) once their gate and up have landed, then
        w · down(act) once down has: the ops of one graph, the activations passed in F32, so the same bits."""
        slot_of = np.zeros(self.scheduler.n_expert, np.int32)
        slot_of[part] = self.scheduler.wait_gate_up(block, part)
        tok, j = np.nonzero(selected(sel, part))
        m, n_embd = len(tok), cur.shape[1]
        views, ffn, g = self.pools.views[block], self.ffn[block], self.graph
        experts = sel[tok, j].astype(np.int32).reshape(m, 1)

        def inputs() -> tuple[Tensor, Tensor | None]:
            ids = g.input(slot_of[sel[tok, j]].astype(np.int32).reshape(m, 1))
            return ids, (g.input(experts) if ffn.biases is not None else None)

        g.reset()
        ids, eids = inputs()
        x = ops.ggml_reshape_3d(g.ctx, g.input(cur[tok]), n_embd, 1, m)
        act = common.expert_activations(g.ctx, views, x, ids, ffn, eids)
        g.compute(act)
        act_rows = to_numpy(act).reshape(m, 1, -1).copy()
        slot_of[part] = self.scheduler.wait_all(block, part)  # down too (and the debug checksums)
        g.reset()
        ids, eids = inputs()
        w = g.input(weights[tok, j].astype(np.float32).reshape(m, 1, 1))
        out = common.weighted_down(g.ctx, views, g.input(act_rows), ids, w, ffn, eids)
        g.compute(out)
        weighted[tok, j] = to_numpy(out).reshape(-1, n_embd)
