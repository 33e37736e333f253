"""A decode token's experts on the device.

Per decode layer: the layer graph (attention, router, shared expert, lookahead) where its weights are; then the
selected experts the VRAM holds are queued on the device while the CPU computes the others (from RAM, or as they
land from the drive), and the two sets of weighted outputs are summed on the CPU in rank order, as the CPU path
sums them — which device computed an expert changes its rounding, never the order of the sum.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tokenwing.compute.backend import DeviceGraph, Readback
from tokenwing.compute.ggml_lib import Tensor
from tokenwing.runtime.lookahead import Ahead
from tokenwing.runtime.vram.graphs import DeviceGraphs
from tokenwing.runtime.vram.source import GraphSource
from tokenwing.runtime.vram.weights import VramWeights


@dataclass
class _ExpertPart:
    """A decode token's experts held in one buffer of their layer's slots (two with a lendable segment)."""

    x: Tensor
    ids: Tensor
    w: Tensor
    eids: Tensor | None
    out: Tensor


@dataclass
class _ExpertStep:
    graph: DeviceGraph
    parts: list[_ExpertPart]


@dataclass
class Launch:
    """Experts queued on the device for one decode token: the graph, and per part their ranks in the selection."""

    step: _ExpertStep
    ranks: list[list[int]]


class DecodeExperts:
    def __init__(self, source: GraphSource, graphs: DeviceGraphs, weights: VramWeights, reads: Readback) -> None:
        self.source, self.graphs, self.weights = source, graphs, weights
        self._steps: dict[tuple[int, int, int], _ExpertStep] = {}  # (layer, experts per buffer)
        self._reads = reads  # the device's share of a token's experts, read into pinned memory behind their graph

    def held(self, block: int, experts: list[int]) -> list[int]:
        """Which of a layer's experts the VRAM holds."""
        cache = self.weights.experts
        return cache.held(block, experts) if cache is not None else []

    def not_held(self, a: Ahead) -> Ahead:
        """A prediction without the experts the VRAM holds (they are never read into RAM)."""
        held = set(self.held(a.target, a.experts))
        if not held:
            return a
        keep = [i for i, e in enumerate(a.experts) if e not in held]
        return a._replace(experts=[a.experts[i] for i in keep], probs=[a.probs[i] for i in keep])

    def _step(self, block: int, counts: tuple[int, int]) -> _ExpertStep:
        """The decode graph over `counts` experts in each buffer of a layer's slots (kept, lendable segment)."""
        key = (block, *counts)
        st = self._steps.get(key)
        if st is None:
            cache = self.weights.experts
            assert cache is not None
            g = self.source.graph(64)
            try:
                segments = cache.segments(block)
                parts = [
                    _ExpertPart(*self.graphs.expert_graph(g, block, pool.views, m))
                    for (pool, _, _), m in zip(segments, counts, strict=False)
                    if m
                ]
                g.finish(*(p.out for p in parts), check=True)
            except Exception:
                g.close()
                raise
            st = self._steps[key] = _ExpertStep(g, parts)
        return st

    def launch(self, block: int, cur: np.ndarray, sel: np.ndarray, weights: np.ndarray, held: list[int]) -> Launch:
        """Queues one decode token's experts that the VRAM holds on the device (the CPU goes on with the others):
        cur [1, n_embd], sel and weights [1, k]; `collect` waits for them."""
        cache = self.weights.experts
        assert cache is not None
        held_set = set(held)
        ranks = [j for j, e in enumerate(sel[0].tolist()) if e in held_set]
        slot_of = dict(zip(ranks, cache.slots(block, sel[0, ranks]).tolist(), strict=True))
        segments = cache.segments(block)
        groups = [[r for r in ranks if lo <= slot_of[r] < hi] for _, lo, hi in segments]
        st = self._step(block, (len(groups[0]), len(groups[1]) if len(groups) > 1 else 0))
        used = [(grp, lo) for grp, (_, lo, _) in zip(groups, segments, strict=True) if grp]
        g = st.graph
        for part, (grp, lo) in zip(st.parts, used, strict=True):
            experts = sel[0, grp]
            g.set(part.x, np.ascontiguousarray(np.repeat(cur[:1], len(grp), axis=0), np.float32))
            g.set(part.ids, np.array([slot_of[r] - lo for r in grp], np.int32))
            g.set(part.w, np.ascontiguousarray(weights[0, grp], np.float32))
            if part.eids is not None:
                g.set(part.eids, experts.astype(np.int32))
        g.compute(wait=False)
        self._reads.queue([p.out for p in st.parts])  # (copied behind the graph, into pinned memory)
        return Launch(st, [grp for grp, _ in used])

    def collect(self, launch: Launch, weighted: np.ndarray) -> None:
        """Waits for `launch`'s experts and puts their weighted outputs at their ranks of weighted [1, k, n]."""
        for out, ranks in zip(self._reads.wait(), launch.ranks, strict=True):
            weighted[0, ranks] = out.reshape(len(ranks), -1)

    def reserve_experts(self) -> None:
        """Places the largest graph of a token's experts: k rows over each pool of a layer's slots (a token's
        experts split between them fit)."""
        cache = self.weights.experts
        k = self.weights.hp.n_expert_used
        for el in self.weights.streamer.layers:
            segments = cache.segments(el.layer) if cache is not None else []
            if not segments:
                continue
            g = self.source.graph(64)
            try:
                g.finish(*(self.graphs.expert_graph(g, el.layer, pool.views, k)[-1] for pool, _, _ in segments))
            finally:
                g.close()

    def close(self) -> None:
        for st in self._steps.values():
            st.graph.close()
        self._steps.clear()
