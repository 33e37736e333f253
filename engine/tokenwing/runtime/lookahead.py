"""Router lookahead (spec §6): the routers of the next streamed layers, applied to a layer's hidden state plus
its shared expert's output, each after its own layer's norm, predict which experts those layers will select; the
predictions go to the core with the router's probabilities, which reads them ahead (most likely first) when no
demand read waits. Predictions only decide what to read early, never which experts are used.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

from tokenwing.compute.ggml_lib import F16, Tensor, ops, to_numpy
from tokenwing.models import common
from tokenwing.models.base import MoEModel


class Ahead(NamedTuple):
    """A prediction for a later layer: its top-k experts in rank order and the router's probability of each."""

    target: int
    experts: list[int]
    distance: int
    probs: list[float]
    predictors: int  # how many layers predict the target (a prediction's votes can reach no more)


class Lookahead:
    def __init__(self, model: MoEModel, distance: int) -> None:
        self.model, self.distance = model, distance
        self.n_expert, self.k = model.hp.n_expert, model.hp.n_expert_used
        self.fused = self._fused_routers(distance)
        self.predictors: dict[int, int] = {}
        for _, targets in self.fused.values():
            for t in targets:
                self.predictors[t] = self.predictors.get(t, 0) + 1
        self._biases: dict[int, np.ndarray] = {}
        self.made: dict[tuple[int, int], list[int]] = {}  # (target layer, distance - 1) → predicted experts
        self.recall_hits = np.zeros(max(distance, 1), np.int64)
        self.recall_total = np.zeros(max(distance, 1), np.int64)

    def _fused_routers(self, distance: int) -> dict[int, tuple[Tensor, list[int]]]:
        """For each layer: the routers of the next `distance` streamed layers stacked into one matrix, each with
        its own layer's norm weight folded in (router · diag(norm weight)), so that one product of the unweighted
        RMS norm gives every target the input its own layer would give it (spec §6). Before, every target saw the
        first target's norm weight."""
        out: dict[int, tuple[Tensor, list[int]]] = {}
        if distance <= 0:
            return out
        m = self.model
        folded: dict[int, np.ndarray] = {}
        for il in range(m.hp.n_layer):
            targets = [s for s in m.streamed if s > il][:distance]
            names = [m.router_weight_name(t) for t in targets]
            if not targets or not all(m.weights.types.get(n) == 0 for n in names):
                continue
            for t, name in zip(targets, names, strict=True):
                if t not in folded:
                    norm = to_numpy(m.router_norm(t)).reshape(-1).astype(np.float32)
                    folded[t] = m.weights.array(name) * norm[None, :]
            # F16: predictions only rank experts (they never change which are used), and in RAM these routers
            # are read every token (F32: ~4 % of a decode token on the bench model)
            stacked = np.ascontiguousarray(np.concatenate([folded[t] for t in targets], axis=0).astype(np.float16))
            out[il] = (m.weights.arena.wrap(stacked, F16, (stacked.shape[1], stacked.shape[0])), targets)
        return out

    def graph(self, ctx: Any, il: int, lo: common.LayerOut, routers: Tensor | None = None) -> Tensor | None:
        """The next layers' router logits [n_expert · targets, n] from layer il's hidden state plus its shared
        expert's output (adding the shared expert cut misses by 11 % on Ling, spec §6) — for a dense layer, its
        output (its FFN plays the shared expert's part), so that the first streamed layer after the dense ones
        is predicted too (on Ling this halved its demand reads, spec §6). `routers`: a device's copy of the stacked
        routers (a device graph takes nothing from RAM)."""
        la = self.fused.get(il)
        if la is None:
            return None
        pred_in = self.model.router_input(ctx, lo)  # (the family's: its state may be wider than one vector)
        # (the families' norm is RMSNorm times a weight, folded into the stacked routers above)
        norm = ops.ggml_rms_norm(ctx, pred_in, self.model.hp.rms_eps)
        return ops.ggml_mul_mat(ctx, la[0] if routers is None else routers, norm)

    def predict(self, il: int, ahead: np.ndarray) -> list[Ahead]:
        """Each target's top-k (the model's own selection width) from the last token's lookahead logits, with
        the router's probability of each (softmax, or sigmoid normalised over the experts): the core reads the
        likeliest first, so the prefetch caps drop the least likely."""
        la = self.fused.get(il)
        if la is None:
            return []
        out = []
        for d, target in enumerate(la[1]):
            logits = ahead[-1, d * self.n_expert : (d + 1) * self.n_expert]
            scores = self._selection_scores(target, logits)
            top = np.argsort(-scores, kind="stable")[: self.k]
            probs = self._probabilities(logits)[top]
            self.made[(target, d)] = top.tolist()
            out.append(Ahead(target, top.tolist(), d + 1, probs.tolist(), self.predictors[target]))
        return out

    def _probabilities(self, logits: np.ndarray) -> np.ndarray:
        x = logits.astype(np.float64)
        p = 1.0 / (1.0 + np.exp(-x)) if self.model.router.sigmoid else np.exp(x - x.max())
        out: np.ndarray = p / p.sum()
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
