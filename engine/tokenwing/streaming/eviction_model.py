"""The learned eviction policy's model (issue 43): a linear score of an expert's past use, loaded for the core.

The RAM cache keeps, per expert of a layer, its last use and its use counts decayed at several half-lives
(`cache_policy.hpp`, kept through evictions as history's counts are); the score is a linear function of
log2(1 + age) and log2(1 + count) per half-life, and the cache evicts the lowest. `learned.py` fits it on recorded
traces; the shipped default is `eviction_default.py`, written by `bench/train_eviction.py`.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokenwing.errors import BadInputError
from tokenwing.fsutil import write_json_atomic
from tokenwing.streaming.eviction_default import MODEL as SHIPPED

MAX_COUNTS = 6  # cache_policy.hpp's kLearnedCounts


@dataclass
class EvictionModel:
    """score = bias + w_age · log2(1 + age) + Σ w_h · log2(1 + count_h); the lowest score leaves first."""

    half_lives: tuple[float, ...]
    weights: tuple[float, ...]  # age's, then one per half-life
    bias: float = 0.0
    recipe: str = ""

    def check(self) -> None:
        if not 1 <= len(self.half_lives) <= MAX_COUNTS or len(self.weights) != len(self.half_lives) + 1:
            raise BadInputError(
                f"eviction model: {len(self.half_lives)} half-lives (1-{MAX_COUNTS}) need "
                f"{len(self.half_lives) + 1} weights, not {len(self.weights)}"
            )
        if any(h <= 0 or not math.isfinite(h) for h in self.half_lives):
            raise BadInputError("eviction model: half-lives must be positive")
        if not all(math.isfinite(w) for w in self.weights):
            raise BadInputError("eviction model: weights must be finite")

    def core_weights(self) -> list[float]:
        """The flat form the native core takes: [n, h_1..h_n, w_age, w_1..w_n]."""
        return [float(len(self.half_lives)), *self.half_lives, *self.weights]

    def to_json(self) -> dict[str, Any]:
        return {
            "half_lives": list(self.half_lives),
            "weights": list(self.weights),
            "bias": self.bias,
            "recipe": self.recipe,
        }

    def save(self, path: str | Path) -> None:
        write_json_atomic(str(path), self.to_json(), indent=1)


def model_from_json(data: Any, where: str) -> EvictionModel:
    try:
        m = EvictionModel(
            tuple(float(h) for h in data["half_lives"]),
            tuple(float(w) for w in data["weights"]),
            float(data.get("bias", 0.0)),
            recipe=str(data.get("recipe", "")),
        )
    except (KeyError, TypeError, ValueError) as e:
        raise BadInputError(f"{where}: not an eviction model ({e})") from None
    m.check()
    return m


def load_model(path: str | Path | None = None) -> EvictionModel:
    """A trained model file, or (None) the shipped default."""
    if path is None:
        return model_from_json(SHIPPED, "the shipped eviction model")
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise BadInputError(f"{path}: not an eviction model ({e})") from None
    return model_from_json(data, str(path))
