"""Routing traces (docs/trace-format.md): load, save, synthesise, and replay through the cache policies.

The replay runs the native core's own policy code (`cache_policy.hpp`), so what it reports is what the engine
would do with the same slots; Belady's optimum is computed exactly for the same cache model.
"""

from __future__ import annotations

import zipfile
from dataclasses import dataclass
from typing import Any, BinaryIO

import numpy as np

from tokenwing import _core
from tokenwing.errors import BadInputError
from tokenwing.fsutil import write_atomic
from tokenwing.streaming.settings import DECAY_TOKENS

POLICIES = ("decay", "history", "learned", "lru", "belady")


@dataclass
class Trace:
    selected: np.ndarray  # int32 (tokens, layers, k), -1 where empty
    predicted: np.ndarray  # int32 (tokens, layers, distances, k): predictions FOR a layer, d+1 layers early
    prompt_tokens: np.ndarray  # int64 (tokens,): 0 decode, n > 0 a prompt batch of n tokens
    layers: np.ndarray  # int32 (layers,): block index of each streamed layer
    n_expert: int

    @property
    def n_tokens(self) -> int:
        return int(self.selected.shape[0])

    @property
    def k(self) -> int:
        return int(self.selected.shape[2])

    def save(self, path: str) -> None:
        def write(f: BinaryIO) -> None:
            np.savez_compressed(
                f,
                selected=self.selected,
                predicted=self.predicted,
                prompt_tokens=self.prompt_tokens,
                layers=self.layers,
                n_expert=np.int64(self.n_expert),
            )

        write_atomic(path, write)


def load_trace(path: str) -> Trace:
    try:
        with np.load(path, allow_pickle=False) as z:
            t = Trace(
                np.ascontiguousarray(z["selected"], dtype=np.int32),
                np.ascontiguousarray(z["predicted"], dtype=np.int32),
                np.ascontiguousarray(z["prompt_tokens"], dtype=np.int64),
                np.ascontiguousarray(z["layers"], dtype=np.int32),
                int(z["n_expert"]),
            )
    except (OSError, KeyError, ValueError, zipfile.BadZipFile, EOFError) as e:
        raise BadInputError(f"{path}: not a routing trace ({e})") from None
    s, p = t.selected, t.predicted
    if s.ndim != 3 or p.ndim != 4 or p.shape[:2] != s.shape[:2] or (p.size and p.shape[3] != s.shape[2]):
        raise BadInputError(f"{path}: trace arrays have inconsistent shapes {s.shape} and {p.shape}")
    if t.prompt_tokens.shape != (s.shape[0],) or t.layers.shape != (s.shape[1],) or t.n_expert <= 0:
        raise BadInputError(f"{path}: trace metadata does not match its arrays")
    if s.size and (s.max() >= t.n_expert or s.min() < -1):
        raise BadInputError(f"{path}: trace selects experts outside 0..{t.n_expert - 1}")
    return t


def _zipf(n: int, s: float, rng: np.random.Generator) -> np.ndarray:
    w = 1.0 / np.arange(1, n + 1) ** s
    return rng.permutation(w / w.sum())


def _draw(p: np.ndarray, k: int, exclude: set[int], rng: np.random.Generator) -> list[int]:
    q = p.copy()
    q[list(exclude)] = 0.0
    q /= q.sum()
    return [int(x) for x in rng.choice(len(p), size=k, replace=False, p=q)] if k else []


def synthetic_trace(
    n_tokens: int,
    n_layers: int,
    n_expert: int,
    k: int,
    zipf: float = 1.0,
    locality: float = 0.3,
    recall: tuple[float, ...] = (0.757, 0.672),
    seed: int = 0,
) -> Trace:
    """Zipf-skewed, temporally local routing (each expert of the previous token stays with probability
    `locality`), with predictions that contain each selected expert with the given recall per distance."""
    rng = np.random.default_rng(seed)
    pop = [_zipf(n_expert, zipf, rng) for _ in range(n_layers)]
    sel = np.full((n_tokens, n_layers, k), -1, np.int32)
    pred = np.full((n_tokens, n_layers, len(recall), k), -1, np.int32)
    for t in range(n_tokens):
        for li in range(n_layers):
            keep = [int(e) for e in sel[t - 1, li] if t > 0 and rng.random() < locality] if t else []
            chosen = keep + _draw(pop[li], k - len(keep), set(keep), rng)
            sel[t, li] = chosen
            for d, r in enumerate(recall):
                hit = [e for e in chosen if rng.random() < r]
                pred[t, li, d] = hit + _draw(pop[li], k - len(hit), set(chosen), rng)
    layers = np.arange(n_layers, dtype=np.int32)
    return Trace(sel, pred, np.zeros(n_tokens, np.int64), layers, n_expert)


def parse_share(text: str) -> float:
    """`--slots 25%` as a share of a layer's experts (0..1]."""
    try:
        share = float(text.removesuffix("%")) / 100
    except ValueError:
        share = -1.0
    if not text.endswith("%") or not 0 < share <= 1:
        raise BadInputError(f"--slots must be a percentage of the experts (such as 25%), not {text!r}")
    return share


def parse_slots(text: str, n_expert: int) -> int:
    """`--slots 32` or `--slots 25%` (of the experts of a layer)."""
    try:
        n = round(float(text[:-1]) / 100 * n_expert) if text.endswith("%") else int(text)
    except ValueError:
        raise BadInputError(f"--slots must be a count or a percentage, not {text!r}") from None
    return n


def simulate(
    trace: Trace,
    slots: int,
    policy: str,
    prefetch: bool = False,
    decay_tokens: int = 0,
    prefetch_votes: int = 1,
    initial: np.ndarray | None = None,
    learned: list[float] | None = None,
) -> dict[str, Any]:
    """Replays the trace through a policy at `slots` per layer (with its predictions read ahead, at once, when
    `prefetch`: those named by `prefetch_votes` distances); `initial`: the experts each layer holds at the start
    ([layers, width], -1 empty); `learned`: the learned policy's model (EvictionModel.core_weights). Reads are
    demand reads plus prefetches; Belady's are the fewest possible."""
    if policy not in POLICIES:
        raise BadInputError(f"unknown policy {policy!r} (choose from {', '.join(POLICIES)})")
    decay_tokens = decay_tokens or DECAY_TOKENS.get(policy, 64)
    if slots < trace.k:
        raise BadInputError(f"--slots must be at least k = {trace.k} (the experts one token selects)")
    slots = min(slots, trace.n_expert)
    predicted = trace.predicted if prefetch else trace.predicted[:, :, :0]
    table = _core.simulate(
        trace.selected,
        np.ascontiguousarray(predicted),
        trace.prompt_tokens,
        trace.n_expert,
        slots,
        policy,
        prefetch,
        decay_tokens,
        None if initial is None else np.ascontiguousarray(initial, dtype=np.int32),
        prefetch_votes,
        learned or [],
    )
    totals = {name: int(v) for name, v in zip(_core.SIM_COLUMNS, table.sum(axis=0), strict=True)}
    accesses = totals["hits"] + totals["misses"]
    return {
        "policy": policy,
        "slots": slots,
        "prefetch": prefetch,
        "tokens": trace.n_tokens,
        "miss_rate": totals["misses"] / accesses if accesses else 0.0,
        "reads": totals["demand_reads"] + totals["prefetch_reads"],
        "reads_per_token": (totals["demand_reads"] + totals["prefetch_reads"]) / max(trace.n_tokens, 1),
        **totals,
        "per_layer_misses": table[:, 1].tolist(),
    }


def prediction_recall(trace: Trace) -> list[float]:
    """Share of selected experts found in the prediction, per distance."""
    out = []
    for d in range(trace.predicted.shape[2]):
        hits = total = 0
        for t in range(trace.n_tokens):
            for li in range(trace.selected.shape[1]):
                sel = set(trace.selected[t, li][trace.selected[t, li] >= 0].tolist())
                pred = trace.predicted[t, li, d]
                if (pred < 0).all():
                    continue  # no prediction for this layer at this distance
                hits += len(sel & set(pred.tolist()))
                total += len(sel)
        out.append(hits / total if total else 0.0)
    return out
