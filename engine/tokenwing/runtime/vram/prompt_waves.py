"""A prompt's experts on the device (runtime/experts.py's `DeviceExperts`).

A prompt runs layer-major: device layers' chunks on the device (a chunk whose tensors cannot be allocated is
split in two), the experts the VRAM holds computed there, and large waves of the others copied from their RAM
slots into two sets of VRAM places and computed on the GPU (one set computes while the next is copied in).
"""

from __future__ import annotations

import numpy as np

from tokenwing.compute.backend import DeviceGraph, get_tensor
from tokenwing.compute.ggml_lib import Tensor
from tokenwing.runtime.placement import WAVE_PLACES
from tokenwing.runtime.vram.experts import BYTES_UP
from tokenwing.runtime.vram.graphs import DeviceGraphs, Views
from tokenwing.runtime.vram.source import GraphSource
from tokenwing.runtime.vram.weights import VramWeights

WAVE_MIN_TOKENS = 32  # a prompt wave's experts go to the GPU from this many tokens per expert (ggml's own bar)


class PromptWaves:
    def __init__(self, source: GraphSource, graphs: DeviceGraphs, weights: VramWeights, min_tokens: int) -> None:
        self.source, self.graphs, self.weights = source, graphs, weights
        self.hp = weights.hp
        self.min_tokens = min_tokens  # tokens per expert from which a wave runs on the GPU

    def count_prompt_hits(self, block: int, n: int) -> None:
        if self.weights.experts is not None:
            self.weights.experts.count_prompt_hits(block, n)

    def from_vram(
        self, block: int, cur: np.ndarray, tokens: np.ndarray, experts: np.ndarray, weights: np.ndarray
    ) -> np.ndarray:
        """Weighted outputs [m, width] of m (token, expert) pairs whose experts the VRAM holds."""
        cache = self.weights.experts
        assert cache is not None
        slots = cache.slots(block, experts)
        out = np.empty((len(tokens), cur.shape[1]), np.float32)  # (the experts' width)
        for pool, lo, hi in cache.segments(block):
            at = np.flatnonzero((slots >= lo) & (slots < hi))
            if at.size:
                args = (cur, tokens[at], slots[at] - lo, experts[at], weights[at])
                out[at] = self._pairs(block, pool.views, *args)
        return out

    def wave_on_gpu(self, n_pairs: int, n_experts: int) -> bool:
        """A prompt wave runs on the GPU when its experts serve enough tokens each to pay for their copies."""
        places = bool(self.weights.places)
        return self.weights.experts is not None and places and n_pairs >= self.min_tokens * max(n_experts, 1)

    def observe_prompt(self, block: int, sel: np.ndarray) -> None:
        if self.weights.experts is not None:
            self.weights.experts.observe_prompt(block, sel)

    def from_ram(
        self,
        block: int,
        cur: np.ndarray,
        tokens: np.ndarray,
        experts: np.ndarray,
        weights: np.ndarray,
        slot_of: np.ndarray,
    ) -> np.ndarray:
        """A prompt wave's pairs (sorted by expert) on the GPU: its experts are copied from their RAM slots into
        VRAM places, WAVE_PLACES at a time in two alternating sets (the next set's copies are queued before the
        current set computes: the host never waits for a copy), and computed there. Weighted outputs [m, width]
        in pair order."""
        assert self.weights.experts is not None
        streamer = self.weights.streamer
        row = streamer.li(block)
        n = WAVE_PLACES
        stage = self.weights.places[block]
        bounds = np.r_[0, np.flatnonzero(np.diff(experts)) + 1, len(experts)].tolist()
        groups = [(bounds[i], bounds[min(i + n, len(bounds) - 1)]) for i in range(0, len(bounds) - 1, n)]
        out = np.empty((len(experts), cur.shape[1]), np.float32)
        places: list[dict[int, int]] = []

        def copy_up(i: int) -> None:
            lo, hi = groups[i]
            distinct = dict.fromkeys(experts[lo:hi].tolist())
            place = {e: (i % 2) * n + p for p, e in enumerate(distinct)}
            for e, p in place.items():
                self.experts_counters_add(block, stage.upload(p, streamer.pools[row][int(slot_of[e])], wait=False))
            places.append(place)

        copy_up(0)
        for i, (lo, hi) in enumerate(groups):
            if i + 1 < len(groups):
                copy_up(i + 1)  # (its set was last read by group i - 1, which is done)
            slots = np.array([places[i][e] for e in experts[lo:hi].tolist()], np.int32)
            out[lo:hi] = self._pairs(block, stage.views, cur, tokens[lo:hi], slots, experts[lo:hi], weights[lo:hi])
        return out

    def experts_counters_add(self, block: int, nbytes: int) -> None:
        cache = self.weights.experts
        assert cache is not None
        cache.counters[cache.row_of[block], BYTES_UP] += nbytes

    def _set_pairs(
        self,
        g: DeviceGraph,
        x: Tensor,
        ids: Tensor,
        w: Tensor,
        eids: Tensor | None,
        cur: np.ndarray,
        tokens: np.ndarray,
        slots: np.ndarray,
        experts: np.ndarray,
        weights: np.ndarray,
    ) -> None:
        g.set(x, np.ascontiguousarray(cur[tokens], np.float32))
        g.set(ids, np.ascontiguousarray(slots, np.int32))
        g.set(w, np.ascontiguousarray(weights, np.float32))
        if eids is not None:
            g.set(eids, np.ascontiguousarray(experts, np.int32))

    def _pairs(
        self,
        block: int,
        views: Views,
        cur: np.ndarray,
        tokens: np.ndarray,
        slots: np.ndarray,
        experts: np.ndarray,
        weights: np.ndarray,
    ) -> np.ndarray:
        """Weighted outputs of (token, slot) pairs through `views`, at most a prompt chunk's rows per graph."""
        out = np.empty((len(tokens), cur.shape[1]), np.float32)  # (the experts' width)
        step = self.source.device_chunk * self.hp.n_expert_used
        for lo in range(0, len(tokens), step):
            hi = min(lo + step, len(tokens))
            g = self.source.graph(64, prompt=True)
            try:
                x, ids, w, eids, o = self.graphs.expert_graph(g, block, views, hi - lo)
                g.finish(o)
                self._set_pairs(g, x, ids, w, eids, cur, tokens[lo:hi], slots[lo:hi], experts[lo:hi], weights[lo:hi])
                g.compute()
                out[lo:hi] = get_tensor(o).reshape(hi - lo, -1)
            finally:
                g.close()
        return out
