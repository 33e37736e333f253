"""A decode step for several sequences at once (the server's slots): each layer's experts are the union of what
the sequences selected, and that union is read once.

Per layer: one graph holds every sequence's layer graph side by side (each over its own KV cache and position,
with the lookahead's routers); the routed experts of all of them go to the scheduler as one wave — the union,
in the order the sequences name them — so an expert two sequences share is read and waited for once; then every
(sequence, expert) pair is computed in the same expert graph, and each sequence sums its own experts in rank
order and adds its shared expert and residual. A union larger than the layer's slots is split into waves that
fit, each read once (no expert is read twice in a step, whatever the number of sequences).

Every number a sequence gets is computed as it is when that sequence runs alone: its layer graph is its own
(no matrix product mixes rows of two sequences, so no kernel sees a different batch), the expert products give
each row the same bits whatever rows share the product (ggml's mul_mat_id computes row by row), and the sums
are the same additions in the same order. A sequence's tokens are therefore identical to those it gets alone
(tested: `tests/engine/test_batch_decode.py`). What that costs: the dense weights (attention, shared expert,
router, output head) are read once per sequence per step instead of once per step — in RAM the step's memory
traffic is N × dense + union of experts; under a memory cap, where the drive binds, the union is what counts.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from tokenwing.compute.ggml_lib import to_numpy
from tokenwing.errors import BadInputError
from tokenwing.models import common
from tokenwing.runtime.lookahead import Ahead

if TYPE_CHECKING:
    from tokenwing.runtime.session import Parts, Session


def decode_step(s: Session, steps: list[tuple[int, int]]) -> list[np.ndarray]:
    """One decode token for each (slot, token) pair, the slots distinct; returns each one's logits. One pair is
    the session's ordinary decode step (with every expert in RAM, one graph for the whole token)."""
    if len(steps) == 1:
        slot, token = steps[0]
        s.use(slot)
        return [s.forward([token])]
    slots = [slot for slot, _ in steps]
    if len(set(slots)) != len(slots):
        raise ValueError("a sequence appears twice in one decode step")
    assert s.vram is None  # (a session with the VRAM tier holds one sequence)
    for slot, token in steps:
        if not 0 <= token < s.hp.vocab_size:
            raise BadInputError("token id outside the vocabulary")
        if s.seqs[slot].pos + 1 > s.n_ctx:
            raise BadInputError(f"the context is full ({s.n_ctx} tokens)")
    if s._prompt_memory_held:
        s.graph.release()  # what a prompt's graphs touched: decode needs a few MB of it
        s._prompt_memory_held = False
    s.scheduler.after_prompt()
    s.scheduler.begin_token(0)
    s.lookahead.made.clear()
    hs = []
    for slot, token in steps:
        s.use(slot)
        hs.append(s._embed([token]))
    try:
        for il in range(s.hp.n_layer):
            hs = _layer(s, il, slots, hs)
    except BaseException:
        for slot in slots:  # a failed step leaves no half-updated recurrent state behind
            seq = s.seqs[slot]
            if seq.kv.states is not None:
                seq.checkpoints.abandon()
                seq.state_dirty = True
        raise
    logits = []
    for (slot, token), h in zip(steps, hs, strict=True):
        s.use(slot)
        s._advance([token])
        s.checkpoints.commit()
        logits.append(s._logits(h)[-1])
    return logits


def _layer(s: Session, il: int, slots: list[int], hs: list[np.ndarray]) -> list[np.ndarray]:
    parts = _layer_parts(s, il, slots, hs)
    ahead = [s.lookahead.predict(il, r["ahead"]) if "ahead" in r else [] for r in parts]
    merged = _merge(s, ahead)
    if "out" in parts[0]:  # a dense layer: it predicts the streamed layers after it, as a MoE layer does
        for a in merged:
            s.scheduler.predict(a.target, a.experts, a.distance, a.probs, a.predictors)
        return [r["out"] for r in parts]
    sel = np.concatenate([r["ids"] for r in parts])
    for row in sel:
        s.scheduler.observe(il, row.reshape(1, -1))
    union = list(dict.fromkeys(sel.reshape(-1).tolist()))
    s.lookahead.score(il, np.array([union]))  # recall over the step: the share of the union predicted
    weighted = _experts(s, il, parts, sel, union, merged)
    out = []
    for i, r in enumerate(parts):
        summed = common.sum_experts(weighted[i : i + 1])  # (each sequence's own k, in rank order)
        s.use(slots[i])
        out.append(s._tail(il, summed, r))
    return out


def _layer_parts(s: Session, il: int, slots: list[int], hs: list[np.ndarray]) -> list[Parts]:
    """Every sequence's layer graph, side by side in one graph (one computation per layer, not one per
    sequence)."""
    g = s.graph
    ctx = g.reset()
    outs, writes = [], []
    for slot, h in zip(slots, hs, strict=True):
        s.use(slot)
        out, w = s._layer_graph(ctx, il, g.input(h), s._placement(s.pos, 1, True), True)
        outs.append(out)
        writes += w
    g.compute(*writes, *[t for out in outs for t in out.values()])
    return [{name: to_numpy(t).reshape(1, -1).copy() for name, t in out.items()} for out in outs]


def _merge(s: Session, ahead: list[list[Ahead]]) -> list[Ahead]:
    """The sequences' predictions for each later layer as one (its experts ordered by their highest
    probability): the core counts a call as one layer's vote, so each predicting layer calls once per target.
    The lookahead's record of what was predicted (its recall, the trace) is the merged one."""
    by_target: dict[tuple[int, int], dict[int, float]] = {}
    first: dict[tuple[int, int], Ahead] = {}
    for seq in ahead:
        for a in seq:
            key = (a.target, a.distance)
            first.setdefault(key, a)
            best = by_target.setdefault(key, {})
            for e, p in zip(a.experts, a.probs, strict=True):
                best[e] = max(best.get(e, 0.0), p)
    out = []
    for key, best in by_target.items():
        a = first[key]
        experts = sorted(best, key=lambda e: (-best[e], e))
        s.lookahead.made[(a.target, a.distance - 1)] = experts
        out.append(Ahead(a.target, experts, a.distance, [best[e] for e in experts], a.predictors))
    return out


def _experts(
    s: Session, il: int, parts: list[Parts], sel: np.ndarray, union: list[int], ahead: list[Ahead]
) -> np.ndarray:
    """Every sequence's weighted expert outputs [n, k, width]: the union in waves that fit the layer's slots
    (one wave unless the union is larger), each wave's experts read once and computed for every sequence that
    selected them, the ready ones first while the rest land."""
    sched = s.scheduler
    cur = np.concatenate([r["cur"] for r in parts])
    weights = np.concatenate([r["weights"] for r in parts])
    size = sched.streamer.usable_slots(il) if sched.loaned else sched.slots_per_layer
    weighted = np.zeros((sel.shape[0], sel.shape[1], cur.shape[1]), np.float32)
    for start in range(0, len(union), size):
        wave = union[start : start + size]
        ready = sched.begin_layer(il, wave)
        if start == 0:
            for a in ahead:
                sched.predict(a.target, a.experts, a.distance, a.probs, a.predictors)
        got = s.experts.decode_weighted(il, cur, sel, weights, wave, ready)
        mask = np.isin(sel, wave)
        weighted[mask] = got[mask]
        sched.end_layer(il)
    return weighted
