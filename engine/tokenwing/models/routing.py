"""Routers: the file's scoring function with a selection bias, expert groups, weights normalised and scaled
(`Router`, `route`)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from tokenwing.compute.ggml_lib import Tensor, ops


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
