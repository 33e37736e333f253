"""A whole decode step as one ggml graph, for when every expert is in RAM.

With the whole model resident there is nothing to stream: the router's top-k can stay inside the graph (the
selected experts' slots come from the fixed expert→slot map), so a token is one graph computation — embedding,
every layer, output head — instead of a graph per layer with a round trip through Python between them. The graph
is built once per 256 positions of the KV cache (decode attends over a masked, rounded-up window) and rerun with
new inputs: a token costs a few input copies and one call into ggml, as in llama.cpp.

The same ggml ops in the same order as the per-layer path (the family's layer graph, the experts through the
slot pool, the family's `tail`), so outputs are bit-identical to it (tested).
"""

from __future__ import annotations

import numpy as np

from tokenwing.compute.ggml_lib import F32, I32, I64, Graph, StaticGraph, Tensor, ops, to_numpy
from tokenwing.models import common
from tokenwing.models.base import MoEModel
from tokenwing.runtime.experts import ExpertCompute
from tokenwing.runtime.kvcache import KVCaches, v_width


class TokenGraph:
    def __init__(
        self,
        model: MoEModel,
        kv: KVCaches,
        window: int,
        experts: ExpertCompute,
        slot_map: dict[int, np.ndarray],
        pool_owner: Graph,
    ) -> None:
        """slot_map: for each layer with routed experts, the slot of each expert."""
        hp = model.hp
        self.window, self.n_ctx = window, kv.n_ctx
        self.width = v_width([model.kv_spec(il) for il in range(hp.n_layer)])
        self.axes = model.position_axes
        # ~90 nodes per layer at top-8 (each expert's output is a view and an addition), ~60 more in a KDA layer
        # (three convolutions and their state writes): room to spare
        g = self.g = StaticGraph(hp.n_layer * (160 + 8 * hp.n_expert_used) + 256, pool_owner)
        ctx = g.ctx
        self.token = g.input(I32, (1,))
        self.at = common.Placement(
            n=1,
            n_kv=window,
            positions=g.input(I32, (self.axes,)),
            mask=g.input(F32, (window, 1)),
            k_rows=g.input(I64, (1,)),
            v_cells=g.input(I64, (self.width,)) if self.width else None,
            mask_swa=g.input(F32, (window, 1)) if model.window else None,
        )
        self.swa = model.window
        x = model.embed(ctx, self.token)
        self.routed: list[tuple[int, Tensor]] = []  # (layer, its selected experts)
        for il in range(hp.n_layer):
            lo = model.layer(ctx, il, x, self.at, kv[il])
            for w in lo.writes:
                g.expand(w)  # before the attention reads of the cache
            if lo.routed is None:
                assert lo.out is not None
                x = lo.out
                continue
            r = lo.routed
            table = g.constant(slot_map[il].astype(np.int32).reshape(-1, 1))
            slots = ops.ggml_reshape_2d(ctx, ops.ggml_get_rows(ctx, table, r.ids), hp.n_expert_used, 1)
            total = experts.token(ctx, il, r.cur, slots, r.weights, r.ids)
            x = model.tail(ctx, il, total, r.shared, r.residual)
            self.routed.append((il, r.ids))
        self.logits = model.head(ctx, x)
        g.finish(self.logits, *(ids for _, ids in self.routed))

    @property
    def bytes(self) -> int:
        return self.g.bytes

    def run(self, token: int, pos: int) -> tuple[np.ndarray, list[tuple[int, np.ndarray]]]:
        """The token at `pos` (within this graph's window): its logits and each routed layer's experts."""
        a = common.placement_arrays(pos, 1, self.window, self.n_ctx, self.width, self.swa, self.axes)
        g = self.g
        g.set(self.token, np.array([token], np.int32))
        for name, values in a.items():
            t = getattr(self.at, name)
            if t.contents.data:  # (an input no node reads is not allocated: positions where nothing rotates)
                g.set(t, values)
        g.compute()
        return to_numpy(self.logits).reshape(-1), [(il, to_numpy(ids).reshape(-1)) for il, ids in self.routed]

    def close(self) -> None:
        self.g.close()
