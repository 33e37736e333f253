"""Router lookahead (spec §6): the routers of the next streamed layers, applied to a layer's hidden state plus
its shared expert's output, predict which experts those layers will select; the predictions go to the core,
which reads them ahead when no demand read waits. Predictions only decide what to read early, never which
experts are used.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from tokenwing.compute.ggml_lib import Tensor, ops, to_numpy
from tokenwing.models import common
from tokenwing.models.base import MoEModel


class Lookahead:
    def __init__(self, model: MoEModel, distance: int) -> None:
        self.model, self.distance = model, distance
        self.n_expert, self.k = model.hp.n_expert, model.hp.n_expert_used
        self.fused = self._fused_routers(distance)
        self._biases: dict[int, np.ndarray] = {}
        self.made: dict[tuple[int, int], list[int]] = {}  # (target layer, distance - 1) → predicted experts
        self.recall_hits = np.zeros(max(distance, 1), np.int64)
        self.recall_total = np.zeros(max(distance, 1), np.int64)

    def _fused_routers(self, distance: int) -> dict[int, tuple[Tensor, list[int]]]:
        """For each layer: the routers of the next `distance` streamed layers stacked into one matrix."""
        out: dict[int, tuple[Tensor, list[int]]] = {}
        if distance <= 0:
            return out
        m = self.model
        for il in range(m.hp.n_layer):
            targets = [s for s in m.streamed if s > il][:distance]
            names = [m.router_weight_name(t) for t in targets]
            if targets and all(m.weights.types.get(n) == 0 for n in names):
                # F16: predictions only rank experts (they never change which are used), and in RAM these
                # routers are read every token (F32: ~4 % of a decode token on the bench model)
                out[il] = (m.weights.stacked(names, half=True), targets)
        return out

    def graph(
        self, ctx: Any, il: int, lo: common.LayerOut, model: MoEModel | None = None, routers: Tensor | None = None
    ) -> Tensor | None:
        """The next layers' router logits [n_expert · targets, n] from layer il's hidden state plus its shared
        expert's output (adding the shared expert cut misses by 11 % on Ling, spec §6) — for a dense layer, its
        output (its FFN plays the shared expert's part), so that the first streamed layer after the dense ones
        is predicted too (on Ling this halved its demand reads, spec §6). `model` and `routers`: a device's view
        of the model and its copy of the stacked routers (a device graph takes nothing from RAM)."""
        la = self.fused.get(il)
        if la is None:
            return None
        m = model if model is not None else self.model
        stacked = routers if model is not None else la[0]
        r = lo.routed
        if r is None:
            assert lo.out is not None
            pred_in = lo.out
        else:
            pred_in = r.residual if r.shared is None else ops.ggml_add(ctx, r.residual, r.shared)
        norm = m.norm(ctx, pred_in, m.router_norm(la[1][0]))
        return ops.ggml_mul_mat(ctx, stacked, norm)

    def predict(self, il: int, ahead: np.ndarray) -> list[tuple[int, list[int], int]]:
        """Each target's top-k (the model's own selection width) from the last token's lookahead logits:
        (target layer, experts in rank order, distance)."""
        la = self.fused.get(il)
        if la is None:
            return []
        out = []
        for d, target in enumerate(la[1]):
            scores = self._selection_scores(target, ahead[-1, d * self.n_expert : (d + 1) * self.n_expert])
            top = np.argsort(-scores, kind="stable")[: self.k].tolist()
            self.made[(target, d)] = top
            out.append((target, top, d + 1))
        return out

    def _selection_scores(self, block: int, logits: np.ndarray) -> np.ndarray:
        name = self.model.router_bias_name(block)
        bias = None
        if name is not None:
            bias = self._biases.get(block)
            if bias is None:
                bias = self._biases[block] = to_numpy(self.model.weights.get(name)).reshape(-1)
        return self.model.router.selection_scores(logits, bias)

    def score(self, il: int, sel: np.ndarray) -> None:
        """Recall per distance: the share of layer il's selected experts that were predicted."""
        chosen = set(sel[-1].tolist())
        for d in range(self.distance):
            pred = self.made.get((il, d))
            if pred is not None:
                self.recall_hits[d] += len(chosen & set(pred))
                self.recall_total[d] += len(chosen)

    def row(self, il: int) -> np.ndarray:
        """The predictions made for layer il this token ([distance, k], -1 where none), for the trace."""
        out = np.full((max(self.distance, 0), self.k), -1, np.int32)
        for d in range(out.shape[0]):
            got = self.made.get((il, d))
            if got is not None:
                out[d] = got
        return out

    def recall(self) -> list[float | None]:
        return [float(h / t) if t else None for h, t in zip(self.recall_hits, self.recall_total, strict=True)]
