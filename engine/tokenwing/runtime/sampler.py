"""Token sampling: greedy, temperature, top-k, top-p, min-p, repetition/presence/frequency penalties, seed."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from tokenwing.errors import BadInputError


@dataclass
class SamplerSettings:
    temperature: float = 0.0  # 0: greedy
    top_k: int = 40  # 0: off
    top_p: float = 1.0
    min_p: float = 0.0
    repeat_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    penalty_last_n: int = 64
    seed: int | None = None

    def check(self) -> None:
        if self.temperature < 0 or not 0 < self.top_p <= 1 or not 0 <= self.min_p <= 1 or self.top_k < 0:
            raise BadInputError("sampling settings out of range (temperature ≥ 0, 0 < top_p ≤ 1, 0 ≤ min_p ≤ 1)")
        if self.repeat_penalty <= 0:
            raise BadInputError("repeat_penalty must be positive")


class Sampler:
    def __init__(self, settings: SamplerSettings) -> None:
        settings.check()
        self.s = settings
        self.rng = np.random.default_rng(settings.seed)

    def penalize(self, logits: np.ndarray, history: Sequence[int]) -> np.ndarray:
        s = self.s
        if s.penalty_last_n == 0 or (s.repeat_penalty == 1 and not s.presence_penalty and not s.frequency_penalty):
            return logits
        out = logits.astype(np.float64).copy()
        recent = history[-s.penalty_last_n :] if s.penalty_last_n > 0 else history
        for tok, count in Counter(recent).items():
            v = out[tok]
            out[tok] = v / s.repeat_penalty if v > 0 else v * s.repeat_penalty
            out[tok] -= count * s.frequency_penalty + s.presence_penalty
        return out

    def sample(self, logits: np.ndarray, history: Sequence[int] = ()) -> int:
        s = self.s
        z = self.penalize(np.asarray(logits, dtype=np.float64), history)
        if s.temperature == 0:
            return int(np.argmax(z))
        order = np.argsort(-z, kind="stable")
        if s.top_k > 0:
            order = order[: s.top_k]
        vals = z[order]
        p = np.exp(vals - vals[0])
        p /= p.sum()
        if s.top_p < 1:
            keep = int(np.searchsorted(np.cumsum(p), s.top_p) + 1)
            order, vals = order[:keep], vals[:keep]
        if s.min_p > 0:
            p = np.exp(vals - vals[0])
            keep_mask = p >= s.min_p  # relative to the most likely token
            order, vals = order[keep_mask], vals[keep_mask]
        q = np.exp((vals - vals[0]) / s.temperature)
        q /= q.sum()
        return int(order[self.rng.choice(len(order), p=q)])
