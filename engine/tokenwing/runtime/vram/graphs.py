"""The family's graphs on the device, over what weights.py placed: a layer's (a persistent decode step over a
window of the KV cache, or a prompt's chunks), the output head's, and a layer's experts over a pool of VRAM slots
(`expert_graph`: what the decode experts and the prompt waves compute with).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from tokenwing.compute.backend import DeviceError, DeviceGraph, Readback, get_tensor
from tokenwing.compute.ggml_lib import F32, I32, I64, Tensor
from tokenwing.models import common
from tokenwing.runtime.kvcache import v_width
from tokenwing.runtime.placement import VramPlan
from tokenwing.runtime.vram.source import MAX_NODES, Builder, GraphSource, Parts
from tokenwing.runtime.vram.weights import Log, Place, VramWeights

Views = tuple[Tensor, Tensor, Tensor]
# (ctx, layer, input, placement, with the lookahead, place) → (named outputs, cache writes): Session._layer_graph
LayerGraph = Callable[[Any, int, Tensor, common.Placement, bool, Place], tuple[dict[str, Tensor], list[Tensor]]]
# A layer's experts over a pool's views: (input rows, slot ids, weights, expert ids or None, weighted outputs)
ExpertIO = tuple[Tensor, Tensor, Tensor, Tensor | None, Tensor]


@dataclass
class _Step:
    """A persistent decode graph (a layer over a window of the KV cache, or the head): inputs set per token."""

    graph: DeviceGraph
    x: Tensor
    at: common.Placement | None
    outputs: dict[str, Tensor]
    n_kv: int


class DeviceGraphs:
    def __init__(
        self, source: GraphSource, weights: VramWeights, reads: Readback, layer_graph: LayerGraph, log: Log
    ) -> None:
        self.source, self.weights, self.layer_graph, self.log = source, weights, layer_graph, log
        self._reads = reads  # the decode steps' outputs, read into pinned memory behind their graph
        self.hp, self.n_ctx = weights.hp, weights.n_ctx
        self.state = weights.model.state_width(self.hp)  # what a layer graph takes and gives, and the head takes
        self.layers: set[int] = set()  # the layers whose graphs run on the device
        self.head = False  # the output head's graph on the device
        self._decode: dict[int, _Step] = {}
        self._head_step: _Step | None = None

    def check_layers(self, plan: VramPlan) -> None:
        """The planned layers and head, once their weights are on the device: a layer whose graph the device
        cannot run computes on the CPU."""
        self.layers = set(plan.layers)
        self.head = plan.head
        for il in sorted(self.layers):  # every op on the device, every weight there (else: the CPU's layer)
            try:
                self._build_step(il, common.decode_window(0, self.n_ctx, common.DEVICE_DECODE_WINDOW)).graph.close()
            except (DeviceError, KeyError) as e:
                self.layers.discard(il)
                self.log(f"layer {il} computes on the CPU: {e}")
        if self.head:  # (a family's head may fold its state with an op the device lacks: Kimi K3's residual mix)
            try:
                self._build_head(1).graph.close()
            except (DeviceError, KeyError) as e:
                self.head = False
                self.log(f"the output head computes on the CPU: {e}")

    # --------------------------------------------------------------------------------------- layer graphs
    def has_layer(self, il: int) -> bool:
        return il in self.layers

    def _placement(self, g: DeviceGraph, n: int, n_kv: int) -> common.Placement:
        model = self.weights.model
        width = v_width(self.weights.kv_specs)
        return common.Placement(
            n=n,
            n_kv=n_kv,
            positions=g.input(I32, (n * model.position_axes,)),
            mask=g.input(F32, (n_kv, n)),
            k_rows=g.input(I64, (n,)),
            v_cells=g.input(I64, (n * width,)) if width else None,
            mask_swa=g.input(F32, (n_kv, n)) if model.window else None,
        )

    def _set_placement(self, g: DeviceGraph, at: common.Placement, pos0: int) -> None:
        model = self.weights.model
        width, axes = v_width(self.weights.kv_specs), model.position_axes
        a = common.placement_arrays(pos0, at.n, at.n_kv, self.n_ctx, width, model.window, axes)
        for name, values in a.items():
            t = getattr(at, name)
            if t is not None and t.contents.buffer:  # (an input no node of this graph reads is not allocated)
                g.set(t, values)

    def _layer(self, g: DeviceGraph, il: int, x: Tensor, at: common.Placement, decode: bool) -> dict[str, Tensor]:
        out, writes = self.layer_graph(g.ctx, il, x, at, decode, self.weights.place)
        for w in writes:
            g.expand(w)  # before the attention reads of the cache
        return out

    def _build_step(self, il: int, window: int) -> _Step:
        g = self.source.graph(MAX_NODES)
        try:
            x = g.input(F32, (self.state, 1))
            at = self._placement(g, 1, window)
            out = self._layer(g, il, x, at, True)
            g.finish(*out.values(), check=True)
        except Exception:
            g.close()
            raise
        return _Step(g, x, at, out, window)

    def layer_chunk(self, il: int, rows: np.ndarray, pos0: int, decode: bool) -> Parts:
        """Layer il's graph over `rows` (hidden states at positions pos0…) on the device: its named results."""
        if decode:
            window = common.decode_window(pos0, self.n_ctx, common.DEVICE_DECODE_WINDOW)
            st = self._decode.get(il)
            if st is None or st.n_kv != window:
                if st is not None:
                    st.graph.close()
                st = self._decode[il] = self._build_step(il, window)
            st.graph.set(st.x, np.ascontiguousarray(rows, np.float32))
            assert st.at is not None
            self._set_placement(st.graph, st.at, pos0)
            values = st.graph.compute_read(self._reads, list(st.outputs.values()))
            return {k: v.reshape(1, -1) for k, v in zip(st.outputs, values, strict=True)}
        return self.source.split(rows, pos0, lambda part, p0: self._prompt_chunk(il, part, p0))

    def _prompt_chunk(self, il: int, rows: np.ndarray, pos0: int) -> Parts:
        m = rows.shape[0]
        g = self.source.graph(MAX_NODES, prompt=True)
        try:
            x = g.input(F32, (self.state, m))
            # (over the KV cache rounded up as decode's, masked: the CPU's prompt chunks attend so, Session._placement)
            at = self._placement(g, m, common.decode_window(pos0 + m - 1, self.n_ctx, common.DEVICE_DECODE_WINDOW))
            out = self._layer(g, il, x, at, False)
            g.finish(*out.values())
            g.set(x, np.ascontiguousarray(rows, np.float32))
            self._set_placement(g, at, pos0)
            g.compute()
            return {k: get_tensor(t).reshape(m, -1) for k, t in out.items()}
        finally:
            g.close()

    # ---------------------------------------------------------------------------------------------- head
    def logits(self, h: np.ndarray) -> np.ndarray:
        """The output head over states h [n, state width] on the device: logits [n, vocab]."""
        if h.shape[0] == 1:
            if self._head_step is None:
                self._head_step = self._build_head(1)
            st = self._head_step
            st.graph.set(st.x, np.ascontiguousarray(h, np.float32))
            return st.graph.compute_read(self._reads, [st.outputs["logits"]])[0].reshape(1, -1)
        return self.source.split(h, 0, lambda part, _: {"logits": self._head_chunk(part)})["logits"]

    def _build_head(self, n: int, prompt: bool = False) -> _Step:
        g = self.source.graph(64, prompt)
        try:
            x = g.input(F32, (self.state, n))
            logits = self.weights.view.head(g.ctx, x)
            g.finish(logits, check=True)
        except Exception:
            g.close()
            raise
        return _Step(g, x, None, {"logits": logits}, 0)

    def _head_chunk(self, rows: np.ndarray) -> np.ndarray:
        st = self._build_head(rows.shape[0], prompt=True)
        try:
            st.graph.set(st.x, np.ascontiguousarray(rows, np.float32))
            st.graph.compute()
            return get_tensor(st.outputs["logits"]).reshape(rows.shape[0], -1)
        finally:
            st.graph.close()

    # ------------------------------------------------------------------------------------------- experts
    def expert_graph(self, g: DeviceGraph, block: int, views: Views, m: int) -> ExpertIO:
        """m (input row, slot) pairs through the experts of `views`, weighted: out [width, 1, m] at their width."""
        width = self.weights.model.expert_width(self.hp, block)
        ffn = self.weights.view.expert_ffn(block)
        x = g.input(F32, (width, 1, m))
        ids = g.input(I32, (1, m))
        w = g.input(F32, (1, 1, m))
        eids = g.input(I32, (1, m)) if ffn.biases is not None else None
        out = common.weighted_experts(g.ctx, views, x, ids, w, ffn, eids)
        return x, ids, w, eids, out

    def check_experts(self, block: int, views: Views) -> None:
        """Raises (DeviceError, KeyError) unless the device runs every op of a layer's experts over `views`."""
        g = self.source.graph(64)
        try:
            *_, out = self.expert_graph(g, block, views, 1)
            g.finish(out, check=True)
        finally:
            g.close()

    # ---------------------------------------------------------------------------------- the largest graphs
    def prompt_graphs(self, m: int) -> list[Builder]:
        """The largest graph of every kind a prompt computes at m tokens a chunk: a layer's chunk over the whole
        context, the head's, and a layer's experts over m · k rows."""
        out: list[Builder] = []
        for il in sorted(self.layers):

            def layer(g: DeviceGraph, il: int = il) -> list[Tensor]:
                x = g.input(F32, (self.state, m))
                return list(self._layer(g, il, x, self._placement(g, m, self.n_ctx), False).values())

            out.append(layer)
        if self.head:
            out.append(lambda g: [self.weights.view.head(g.ctx, g.input(F32, (self.state, m)))])
        k = self.hp.n_expert_used
        for block, places in self.weights.places.items():
            # (over the waves' places: a graph's buffer depends on its pool's geometry only, and they are there
            # before the cache is)

            def experts(g: DeviceGraph, b: int = block, v: Views = places.views) -> list[Tensor]:
                return [self.expert_graph(g, b, v, m * k)[-1]]

            out.append(experts)
        return out

    def reserve_decode(self) -> None:
        """Places the decode steps' largest graphs: each layer's over the whole context, the head's for one token."""
        for il in sorted(self.layers):
            self._build_step(il, self.n_ctx).graph.close()
        if self.head:
            self._build_head(1).graph.close()

    def close(self) -> None:
        for st in self._decode.values():
            st.graph.close()
        self._decode.clear()
        if self._head_step is not None:
            self._head_step.graph.close()
            self._head_step = None
