"""A whole decode step as one ggml graph, for when every expert is in RAM.

With the whole model resident there is nothing to stream: the router's top-k can stay inside the graph (the
selected experts' slots come from the fixed expert→slot map), so a token is one graph computation — embedding,
every layer, output head — instead of a graph per layer with a round trip through Python between them. The graph
is built once per 64 positions of the KV cache (decode attends over a masked window rounded up to
common.DECODE_WINDOW) and rerun with new inputs: a token costs a few input copies and one call into ggml, as in
llama.cpp.

The same ggml ops in the same order as the per-layer path (the family's layer graph, the experts through the
slot pool, the family's `tail`), so outputs are bit-identical to it (tested).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tokenwing.compute.ggml_lib import F32, I32, I64, Graph, StaticGraph, Tensor, ops
from tokenwing.models import common
from tokenwing.models.base import MoEModel
from tokenwing.runtime.experts import ExpertCompute
from tokenwing.runtime.kvcache import KVCaches, v_width
from tokenwing.runtime.rows import groups_of, rows_cache, rows_placement


class TokenGraph:
    """A decode step as one graph, for one sequence or several (the server's batch, runtime/batch.py): each
    sequence's step is its own subgraph — its token, its KV cache and window, every layer, its logits — side by
    side in one graph, the one computation of the step; the experts' slot tables are shared. Each subgraph is
    the one a sequence alone gets, so its numbers are too."""

    def __init__(
        self,
        model: MoEModel,
        kvs: list[KVCaches],
        windows: list[int],
        experts: ExpertCompute,
        slot_map: dict[int, np.ndarray],
        pool_owner: Graph,
        group: int = 1,
    ) -> None:
        """kvs, windows: each sequence's KV cache and attention window; slot_map: for each layer with routed
        experts, the slot of each expert; `group`: the sequences' tokens as the rows of one subgraph, this many at a
        time (runtime/batch.py `rows_group`: as many as this CPU's kernels give each row its own bits), 1: a
        subgraph each."""
        hp = model.hp
        self.model = model
        self.windows, self.n_ctx = windows, kvs[0].n_ctx
        self.width = v_width([model.kv_spec(il) for il in range(hp.n_layer)])
        self.axes = model.position_axes
        self.swa = model.window
        # ~90 nodes per layer at top-8 (each expert's output is a view and an addition), ~60 more in a KDA layer
        # (three convolutions and their state writes): room to spare
        per_seq = hp.n_layer * (model.graph_nodes + 8 * hp.n_expert_used) + 256
        g = self.g = StaticGraph(per_seq * len(kvs), pool_owner)
        ctx = g.ctx
        tables = {il: g.constant(m.astype(np.int32).reshape(-1, 1)) for il, m in slot_map.items()}
        self.seqs: list[_Seq] = []
        self.rows: list[_Rows] = []
        if group > 1:
            for idx in groups_of(list(range(len(kvs))), group):
                windows_i = [windows[i] for i in idx]
                self.rows.append(self._build_rows(model, [kvs[i] for i in idx], windows_i, experts, tables))
            g.finish(*(b.logits for b in self.rows), *(ids for b in self.rows for _, ids in b.routed))
            return
        xs: list[Tensor] = []
        per_token = model.token_width  # (what `embed` reads of a token: its id, and qwen4exp's rows)
        for window in windows:
            token = g.input(I32, (per_token,))
            at = self._placement(window)
            self.seqs.append(_Seq(token, at, token, []))
            xs.append(model.embed(ctx, token))
        # Layer by layer, every sequence's layer before the next layer (each sequence's nodes are still those of
        # its own graph): a layer's weights are read for the first sequence and found in the CPU's caches by the
        # others where they fit.
        for il in range(hp.n_layer):
            for i, (q, kv) in enumerate(zip(self.seqs, kvs, strict=True)):
                lo = model.layer(ctx, il, xs[i], q.at, kv[il])
                for w in lo.writes:
                    g.expand(w)  # before the attention reads of the cache
                if lo.routed is None:
                    assert lo.out is not None
                    xs[i] = lo.out
                    continue
                r = lo.routed
                slots = ops.ggml_reshape_2d(ctx, ops.ggml_get_rows(ctx, tables[il], r.ids), hp.n_expert_used, 1)
                total = experts.token(ctx, il, r.cur, slots, r.weights, r.ids)
                xs[i] = model.tail(ctx, il, total, r.shared, r.residual)
                q.routed.append((il, r.ids))
            if len(kvs) > 1:
                for x in xs:
                    g.expand(x)  # (the nodes' order is their expansion's: layer by layer)
        for q, x in zip(self.seqs, xs, strict=True):
            q.logits = model.head(ctx, x)
        g.finish(*(q.logits for q in self.seqs), *(ids for q in self.seqs for _, ids in q.routed))

    def _build_rows(
        self,
        model: MoEModel,
        kvs: list[KVCaches],
        windows: list[int],
        experts: ExpertCompute,
        tables: dict[int, Tensor],
    ) -> _Rows:
        hp, g, n = model.hp, self.g, len(kvs)
        ctx = g.ctx
        parts = [self._placement(window) for window in windows]
        per_token = model.token_width
        tokens, positions = g.input(I32, (per_token * n,)), g.input(I32, (self.axes * n,))
        x = model.embed(ctx, tokens)
        routed: list[tuple[int, Tensor]] = []
        at = rows_placement(ctx, parts, positions, kvs)
        for il in range(hp.n_layer):
            lo = model.layer(ctx, il, x, at, rows_cache(kvs, il))
            for w in lo.writes:
                g.expand(w)
            if lo.routed is None:
                assert lo.out is not None
                x = lo.out
                continue
            r = lo.routed
            k = hp.n_expert_used
            flat = ops.ggml_view_1d(ctx, r.ids, k * n, 0)  # (the ids are contiguous: a flat view)
            slots = ops.ggml_reshape_2d(ctx, ops.ggml_get_rows(ctx, tables[il], flat), k, n)
            total = experts.tokens(ctx, il, r.cur, slots, r.weights, r.ids)
            x = model.tail(ctx, il, total, r.shared, r.residual)
            routed.append((il, r.ids))
        return _Rows(tokens, positions, parts, windows, model.head(ctx, x), routed)

    def _placement(self, window: int) -> common.Placement:
        """One token's placement over `window` positions, its inputs written before each run."""
        g = self.g
        return common.Placement(
            n=1,
            n_kv=window,
            positions=g.input(I32, (self.axes,)),
            mask=g.input(F32, (window, 1)),
            k_rows=g.input(I64, (1,)),
            v_cells=g.input(I64, (self.width,)) if self.width else None,
            mask_swa=g.input(F32, (window, 1)) if self.swa else None,
        )

    @property
    def window(self) -> int:
        return self.windows[0]

    @property
    def bytes(self) -> int:
        return self.g.bytes

    def run(
        self, token: int, pos: int, before: list[int] | None = None
    ) -> tuple[np.ndarray, list[tuple[int, np.ndarray]]]:
        """The token at `pos` (within this graph's window): its logits and each routed layer's experts. `before`:
        the last `token_context` tokens of its sequence (the family's `token_input`)."""
        return self.run_all([token], [pos], None if before is None else [before])[0]

    def run_all(
        self, tokens: list[int], positions: list[int], befores: list[list[int]] | None = None
    ) -> list[tuple[np.ndarray, list[tuple[int, np.ndarray]]]]:
        """Each sequence's token at its position (within its window): its logits and each routed layer's experts."""
        g = self.g
        befores = befores or [[] for _ in tokens]
        if self.rows:
            return self._run_rows(tokens, positions, befores)
        for q, window, token, pos, before in zip(self.seqs, self.windows, tokens, positions, befores, strict=True):
            a = common.placement_arrays(pos, 1, window, self.n_ctx, self.width, self.swa, self.axes)
            self._put(q.token, self.model.token_input([token], before))
            for name, values in a.items():
                self._put(getattr(q.at, name), values)
            self.model.set_inputs(q.at, pos)
        g.compute()
        return [(self._got(q.logits), [(il, self._got(ids)) for il, ids in q.routed]) for q in self.seqs]

    def _put(self, t: Tensor, values: np.ndarray) -> None:
        """An input's values for this run, unless no node reads it (then ggml did not place it: positions where
        nothing rotates)."""
        into = self.g.array(t)
        if into is not None:
            np.copyto(into, values.reshape(into.shape), casting="no")

    def _got(self, t: Tensor) -> np.ndarray:
        """A copy of an output's values (flat), before the next run overwrites them."""
        out = self.g.array(t)
        assert out is not None
        return out.reshape(-1).copy()

    def _run_rows(
        self, tokens: list[int], positions: list[int], befores: list[list[int]]
    ) -> list[tuple[np.ndarray, list[tuple[int, np.ndarray]]]]:
        g = self.g
        at = 0
        for b in self.rows:  # (the groups take the sequences in order)
            n = len(b.parts)
            inputs = [
                self.model.token_input([t], bf) for t, bf in zip(tokens[at : at + n], befores[at : at + n], strict=True)
            ]
            self._put(b.tokens, np.concatenate(inputs))
            pos = np.array(positions[at : at + n], np.int32)
            if self.axes > 1:  # (multi-axis RoPE: a text position on three axes, 0 on the fourth)
                pos = np.concatenate([np.tile(pos, 3), np.zeros(n * (self.axes - 3), np.int32)])
            self._put(b.positions, pos)
            for part, window, p in zip(b.parts, b.windows, positions[at : at + n], strict=True):
                a = common.placement_arrays(p, 1, window, self.n_ctx, self.width, self.swa, self.axes)
                for name, values in a.items():
                    if name != "positions":  # (the group's, above)
                        self._put(getattr(part, name), values)
            at += n
        g.compute()
        out = []
        for b in self.rows:
            n = len(b.parts)
            logits = self._got(b.logits).reshape(n, -1)
            ids = [(il, self._got(t).reshape(n, -1)) for il, t in b.routed]
            out += [(logits[i], [(il, v[i]) for il, v in ids]) for i in range(n)]  # (rows of fresh copies)
        return out

    def close(self) -> None:
        self.g.close()


@dataclass
class _Rows:
    """A group of sequences whose tokens are the rows of one subgraph."""

    tokens: Tensor
    positions: Tensor
    parts: list[common.Placement]
    windows: list[int]
    logits: Tensor
    routed: list[tuple[int, Tensor]]


@dataclass
class _Seq:
    token: Tensor
    at: common.Placement
    logits: Tensor
    routed: list[tuple[int, Tensor]]
