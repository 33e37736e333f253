"""Training the learned eviction policy's model on recorded routing traces (issue 43).

Features depend only on the routing, never on what the cache held, so a trace gives every expert's features in
every token at once; `features` computes them exactly as the core's incremental update does (`cache_policy.hpp`).
`fit` learns from Belady's choices: at each eviction the replay meets, the candidate used furthest ahead.
"""

from __future__ import annotations

import numpy as np

from tokenwing.streaming.eviction_model import EvictionModel
from tokenwing.streaming.trace import Trace, load_trace, simulate

# Half-lives in tokens of the decayed use counts (the core takes up to 6).
HALF_LIVES = (2.0, 8.0, 32.0, 128.0, 512.0)
MAX_AGE = 65536.0  # an expert never used is this many tokens old (cache_policy.hpp's kMaxAge)


def features(trace: Trace, half_lives: tuple[float, ...] = HALF_LIVES) -> np.ndarray:
    """float64 (tokens, layers, experts, 1 + len(half_lives)): each expert's features as a victim is chosen in that
    token (its uses in earlier tokens, at this token's clock), as the core computes them."""
    n_tok, n_layers, _ = trace.selected.shape
    n_e = trace.n_expert
    out = np.empty((n_tok, n_layers, n_e, 1 + len(half_lives)))
    last = np.full((n_layers, n_e), -np.inf)
    counts = np.zeros((len(half_lives), n_layers, n_e))
    at = np.zeros((n_layers, n_e))
    hl = np.asarray(half_lives)[:, None, None]
    clock = 0.0
    rows = np.arange(n_layers)[:, None]
    for t in range(n_tok):
        p = int(trace.prompt_tokens[t])
        clock += p if p > 0 else 1
        out[t, :, :, 0] = np.log2(1.0 + np.minimum(clock - last, MAX_AGE))
        out[t, :, :, 1:] = np.moveaxis(np.log2(1.0 + counts * np.exp2(-(clock - at) / hl)), 0, -1)
        sel = trace.selected[t]
        mask = np.zeros((n_layers, n_e), bool)
        mask[np.broadcast_to(rows, sel.shape)[sel >= 0], sel[sel >= 0]] = True
        counts = np.where(mask, counts * np.exp2(-(clock - at) / hl) + 1.0, counts)
        at = np.where(mask, clock, at)
        last = np.where(mask, clock, last)
    return out


def score(model: EvictionModel, feats: np.ndarray) -> np.ndarray:
    """The model's score of `features(trace, model.half_lives)` (the core ranks slots by the same numbers)."""
    return np.asarray(feats @ np.asarray(model.weights) + model.bias)


def next_use(trace: Trace) -> np.ndarray:
    """int64 (tokens, layers, experts): rows until the expert is selected again after this row (a large number
    when never)."""
    n_tok, n_layers, _ = trace.selected.shape
    out = np.empty((n_tok, n_layers, trace.n_expert), np.int64)
    upcoming = np.full((n_layers, trace.n_expert), 1 << 30, np.int64)
    rows = np.arange(n_layers)[:, None]
    for t in range(n_tok - 1, -1, -1):
        out[t] = upcoming - t
        sel = trace.selected[t]
        upcoming[np.broadcast_to(rows, sel.shape)[sel >= 0], sel[sel >= 0]] = t
    return out


def _decisions(
    trace: Trace, slots: int, scores: np.ndarray, feats: np.ndarray, nxt: np.ndarray
) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Replays the trace (demand reads, as the core does: the selected experts pinned, the lowest score leaves,
    ties to the least recently used) and returns, at each eviction, the candidates' features and next uses."""
    xs: list[np.ndarray] = []
    ds: list[np.ndarray] = []
    for li in range(trace.selected.shape[1]):
        resident: list[int] = []
        last: dict[int, int] = {}
        for t in range(trace.n_tokens):
            sel = [int(e) for e in trace.selected[t, li] if e >= 0]
            for e in sel:
                if e not in resident:
                    if len(resident) < slots:
                        resident.append(e)
                    else:
                        cands = [r for r in resident if r not in sel]
                        xs.append(feats[t, li, cands])
                        ds.append(nxt[t, li, cands])
                        victim = min(cands, key=lambda r: (scores[t, li, r], last[r], r))
                        resident[resident.index(victim)] = e
                last[e] = t
    return xs, ds


def _listwise(xs: list[np.ndarray], ds: list[np.ndarray], w: np.ndarray, l2: float) -> np.ndarray:
    """Newton's method on the softmax likelihood that the victim (P ∝ exp(-score)) is the one Belady evicts: the
    candidate used furthest ahead (shared among ties)."""
    n, width, nf = len(xs), max(len(x) for x in xs), xs[0].shape[1]
    x = np.zeros((n, width, nf))
    valid = np.zeros((n, width), bool)
    target = np.zeros((n, width))
    for i, (xi, di) in enumerate(zip(xs, ds, strict=True)):
        x[i, : len(xi)] = xi
        valid[i, : len(xi)] = True
        far = (di == di.max()).astype(np.float64)
        target[i, : len(xi)] = far / far.sum()
    for _ in range(50):
        z = np.where(valid, -(x @ w), -np.inf)
        p = np.exp(z - z.max(axis=1, keepdims=True))
        p /= p.sum(axis=1, keepdims=True)
        grad = np.einsum("ij,ijf->f", target - p, x) / n + 2 * l2 * w
        mean = np.einsum("ij,ijf->if", p, x)
        hess = (np.einsum("ij,ijf,ijg->fg", p, x, x) - mean.T @ mean) / n + 2 * l2 * np.eye(nf)
        step = np.linalg.solve(hess, grad)
        w = w - step
        if np.abs(step).max() < 1e-9:
            break
    return w


def fit(
    traces: list[Trace],
    slots_share: float = 0.25,
    rounds: int = 3,
    l2: float = 1e-4,
    half_lives: tuple[float, ...] = HALF_LIVES,
    recipe: str = "",
) -> EvictionModel:
    """Fits the score to Belady's choices: replay each trace at `slots_share` of a layer's experts with the current
    model, collect every eviction's candidates, and fit the weights so the lowest score is the candidate used
    furthest ahead; repeat with the new model (its own decisions' states join the set), `rounds` times. Starts
    from a long-memory count (history's rule)."""
    feats = [features(t, half_lives) for t in traces]
    nexts = [next_use(t) for t in traces]
    w = np.zeros(1 + len(half_lives))
    w[-2] = 1.0
    xs: list[np.ndarray] = []
    ds: list[np.ndarray] = []
    for _ in range(rounds):
        for tr, f, nu in zip(traces, feats, nexts, strict=True):
            slots = max(tr.k, round(slots_share * tr.n_expert))
            x, d = _decisions(tr, slots, f @ w, f, nu)
            xs += x
            ds += d
        if not xs:
            break
        w = _listwise(xs, ds, w, l2)
    return EvictionModel(tuple(half_lives), tuple(float(v) for v in w), 0.0, recipe)


def train(paths: list[str], slots_share: float = 0.25) -> EvictionModel:
    """`tokenwing trace train`: the model fitted on these traces at this cache size, its recipe noted."""
    traces = [load_trace(p) for p in paths]
    recipe = f"tokenwing trace train {' '.join(paths)} --slots {slots_share:.0%}"
    return fit(traces, slots_share=slots_share, recipe=recipe)


def _rows(t: Trace, a: int, b: int) -> Trace:
    return Trace(t.selected[a:b], t.predicted[a:b], t.prompt_tokens[a:b], t.layers, t.n_expert)


def retrain(paths: list[str], slots: int, recipe: str) -> tuple[EvictionModel, dict[str, int]]:
    """`autotune --trace`: this model's own traces decide. Fitted on the first half of each trace, the learned
    policy and history replay the second half at `slots` per layer (their reads returned); the model returned is
    fitted on the whole traces."""
    traces = [load_trace(p) for p in paths]
    share = slots / traces[0].n_expert
    first = [_rows(t, 0, t.n_tokens // 2) for t in traces]
    second = [_rows(t, t.n_tokens // 2, t.n_tokens) for t in traces]
    held = fit(first, slots_share=share).core_weights()
    reads = {p: sum(int(simulate(t, slots, p, learned=held)["reads"]) for t in second) for p in ("history", "learned")}
    return fit(traces, slots_share=share, recipe=recipe), reads
