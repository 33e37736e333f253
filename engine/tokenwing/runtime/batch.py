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

import dataclasses
from typing import TYPE_CHECKING

import numpy as np

from tokenwing.compute.ggml_lib import Tensor, ops, to_numpy
from tokenwing.errors import BadInputError
from tokenwing.models import common
from tokenwing.runtime.experts import selected
from tokenwing.runtime.lookahead import Ahead
from tokenwing.runtime.rows import groups_of, rows_cache, rows_placement
from tokenwing.runtime.token_graph import TokenGraph

if TYPE_CHECKING:
    from tokenwing.runtime.passes import Parts
    from tokenwing.runtime.session import Session


def decode_step(s: Session, steps: list[tuple[int, int]]) -> list[np.ndarray]:
    """One decode token for each (slot, token) pair, the slots distinct; returns each one's logits. One pair is
    the session's ordinary decode step (with every expert in RAM, one graph for the whole token)."""
    if len(steps) == 1:
        slot, token = steps[0]
        s.use(slot)
        return [s.forward([token])]
    slots = _checked(s, steps)
    assert s.vram is None  # (a session with the VRAM tier holds one sequence)
    if s._prompt_memory_held:
        s.graph.release()  # what a prompt's graphs touched: decode needs a few MB of it
        s._prompt_memory_held = False
    s.scheduler.after_prompt()
    s.scheduler.begin_token(0)
    _read_known(s, [token for _, token in steps])
    whole = _one_graph(s, steps)
    if whole is not None:
        return whole
    s.lookahead.made.clear()
    hs = _embedded(s, steps)
    group = rows_group(s, len(steps))
    try:
        for il in range(s.hp.n_layer):
            hs = _layer(s, il, slots, hs, group)
    except BaseException:
        _abandon(s, slots)
        raise
    return _ended(s, steps, hs)


def _checked(s: Session, steps: list[tuple[int, int]], also: tuple[int, ...] = ()) -> list[int]:
    """The steps' slots, once each and with room for their token (`also`: another sequence's slot in the
    step)."""
    slots = [slot for slot, _ in steps]
    if len({*slots, *also}) != len(slots) + len(also):
        raise ValueError("a sequence appears twice in one step")
    for slot, token in steps:
        if not 0 <= token < s.hp.vocab_size:
            raise BadInputError("token id outside the vocabulary")
        if s.seqs[slot].pos + 1 > s.n_ctx:
            raise BadInputError(f"the context is full ({s.n_ctx} tokens)")
    return slots


def _embedded(s: Session, steps: list[tuple[int, int]]) -> list[np.ndarray]:
    hs = []
    for slot, token in steps:
        s.use(slot)
        hs.append(s._embed([token]))
    return hs


def _abandon(s: Session, slots: list[int]) -> None:
    """A failed step leaves no half-updated recurrent state behind."""
    for slot in slots:
        seq = s.seqs[slot]
        if seq.kv.states is not None:
            seq.checkpoints.abandon()
            seq.state_dirty = True


def _ended(s: Session, steps: list[tuple[int, int]], hs: list[np.ndarray]) -> list[np.ndarray]:
    """Each sequence's step done: its token in its history, its checkpoints kept, its logits."""
    logits = []
    for (slot, token), h in zip(steps, hs, strict=True):
        s.use(slot)
        s._advance([token])
        s.checkpoints.commit()
        logits.append(s._logits(h)[-1])
    return logits


@dataclasses.dataclass(frozen=True)
class PromptPart:
    """A part of one sequence's prompt (the server's: at most a chunk while others decode). `end`: the prompt
    ends with it (its state a token before is kept as a checkpoint)."""

    slot: int
    tokens: list[int]
    end: bool = True


def step(
    s: Session, steps: list[tuple[int, int]], part: PromptPart | None
) -> tuple[list[np.ndarray], np.ndarray | None]:
    """A decode token for each (slot, token) pair and a part of another sequence's prompt, in one layer-major
    pass where the experts stream (`joins`): per layer the prompt's experts and the decode tokens' are one
    order of waves, each expert read once for both (the prompt's own first, then what only the decode tokens
    need). Returns the decode tokens' logits and the prompt part's last logits (None without a part). Each
    sequence's numbers are those it gets alone: the prompt's expert sums are its own in its own order (other
    sequences' experts add nothing to them), the decode tokens' are computed row by row and summed in rank order
    as in `decode_step` (tested: `tests/engine/test_batch_decode.py`). Elsewhere (every expert in RAM, where a
    decode step is one graph, or the VRAM tier) the part runs, then the step."""
    if part is None:
        return decode_step(s, steps), None
    if not steps or not joins(s, part):
        s.use(part.slot)
        logits = s.forward(part.tokens, prompt=True, end=part.end)
        return (decode_step(s, steps) if steps else []), logits
    return _joint_step(s, steps, part)


def joins(s: Session, part: PromptPart) -> bool:
    """Whether a prompt part goes in the same pass as the decode tokens: where experts stream (with every expert
    in RAM nothing is read twice anyway, and the decode step is one graph), without the VRAM tier (one
    sequence) or a routing trace (the benchmarks', one sequence's), and one chunk at most (a pass that fits
    without splitting). A part that would fail (ids outside the vocabulary, the context full) runs alone, so
    that its error is its own."""
    return (
        s.vram is None
        and s.scheduler.slot_map is None
        and s.trace is None
        and 0 < len(part.tokens) <= s.options.max_batch
        and all(0 <= t < s.hp.vocab_size for t in part.tokens)
        and s.seqs[part.slot].pos + len(part.tokens) <= s.n_ctx
    )


def _joint_step(s: Session, steps: list[tuple[int, int]], part: PromptPart) -> tuple[list[np.ndarray], np.ndarray]:
    slots = _checked(s, steps, (part.slot,))  # (the part's own ids and room: `joins`, which `step` asked)
    s.use(part.slot)
    s._open_pass(part.tokens, part.end, decode=False, others=len(steps))  # (no known experts: see _joint_layer)
    h = s._pass_input(part.tokens)
    hs = _embedded(s, steps)
    group = rows_group(s, len(steps))
    try:
        for il in range(s.hp.n_layer):
            h, hs = _joint_layer(s, il, part.slot, h, slots, hs, group)
    except BaseException:
        _abandon(s, [part.slot, *slots])
        raise
    s.use(part.slot)
    s._advance(part.tokens)
    s.checkpoints.commit()
    last = s._logits(h[-1:])[-1]
    return _ended(s, steps, hs), last


def _joint_layer(
    s: Session, il: int, pslot: int, h: np.ndarray, slots: list[int], hs: list[np.ndarray], group: int
) -> tuple[np.ndarray, list[np.ndarray]]:
    """One layer of a prompt part (`h`, sequence `pslot`) and decode tokens: the prompt's layer graph as its
    pass computes it (Session._layer_parts: its chunks, checkpoints), the decode tokens' as `_layer` does; one
    order of waves for the experts of both (`ExpertPools.prompt` with `also` and `each_wave`)."""
    s.use(pslot)
    s.scheduler.read_ahead(il, h.shape[0])
    r = s._layer_parts(il, h, False)
    # No predictions, so the decode tokens' graphs leave the lookahead's routers out: the prompt's waves read each
    # layer's experts anyway, and the decode tokens' guesses for later layers only took slots from those waves
    # (bench/prompt_join_bench.py, bench model at a 25 % budget, 3 streams and a 256-token prompt: 11.9 GB read
    # with them, 9.4 GB without, 11.3 GB with the prompt apart).
    parts = _parts(s, il, slots, hs, group, lookahead=False)
    if "out" in r:  # a dense layer (for every sequence: the same layer)
        _written(s, pslot, il)
        return r["out"], [p["out"] for p in parts]
    s.scheduler.observe(il, r["ids"])
    sel, union = _selected(s, il, parts)
    mine = set(r["ids"].reshape(-1).tolist())
    cur = np.concatenate([p["cur"] for p in parts])
    weights = np.concatenate([p["weights"] for p in parts])
    weighted = np.zeros((sel.shape[0], sel.shape[1], cur.shape[1]), np.float32)
    needed = set(union)

    def each_wave(wave: list[int]) -> None:
        theirs = [e for e in wave if e in needed]
        if theirs:
            _put_wave(s, il, cur, sel, weights, theirs, [True] * len(theirs), weighted)

    also = [e for e in union if e not in mine]
    summed = s.experts.prompt(il, r["cur"], r["ids"], r["weights"], None, also, each_wave)
    s.use(pslot)
    out = s._tail(il, summed, r)
    _written(s, pslot, il)
    return out, _tails(s, il, slots, parts, weighted)


def _written(s: Session, slot: int, il: int) -> None:
    """A prompt writes a layer's positions at once: a spilled cache's are reclaimable now (as in its pass)."""
    s.use(slot)
    if s.kv.spilled:
        s.kv.write_back(il)


def _read_known(s: Session, tokens: list[int]) -> None:
    """The layers routed by the token id alone (DeepSeek V4's hash layers): each one's union of the step's
    sequences' experts is read from the step's start, as the session reads one token's (`read_known`: demand reads
    ahead of every prediction, in layer order), and the lookahead's guesses for these layers are dropped
    (`_merge`)."""
    known: dict[int, list[int]] = {}
    for token in tokens:
        for block, experts in s.model.known_experts(token).items():
            known[block] = list(dict.fromkeys([*known.get(block, []), *experts]))
    s._known = known
    for block, experts in sorted(known.items()):
        s.scheduler.read_known(block, experts)


def rows_group(s: Session, n: int) -> int:
    """How many of n sequences' tokens may share each dense product as its rows (`rows_batch` for every count up
    to it): the sequences then go in groups of that many, each matrix read once per group (1: each sequence
    apart). ggml's repacked K-quant products keep their 1-row kernel up to 3 rows, so a Q4_K_M model's 8
    sequences go as 3 + 3 + 2 rather than 8 apart."""
    group = 1
    while group < n and rows_batch(s, group + 1):
        group += 1
    return group


def rows_batch(s: Session, n: int) -> bool:
    """Whether n decode tokens of different sequences may go through the dense products as the n rows of one
    product (each matrix read once a step, one graph node instead of n), their attention still each over its own
    cache (`common.BatchKV`): only where that gives every row the bits it gets alone. That is a property of
    ggml's kernels on this CPU, so it is measured, once per n: every resident matrix (and the lookahead's
    routers) times n random rows against each row alone. Q8_0 and F32 products are row by row; ggml's repacked
    K-quant products run a 4-row kernel on groups of four that rounds differently from its 1-row one, so a model
    in those runs each sequence's products apart (each matrix then read once per sequence). Linear-attention
    layers (a recurrent state per sequence) and resident 3-D matrices (MLA's per-head ones) are not batched."""
    if n in s.rows_ok:
        return s.rows_ok[n]
    ok = s.kv.states is None and s.vram is None
    w = s.model.weights
    seen: set[tuple[int, bool, int, int]] = set()
    mats = [w.get(name) for name in w.tensors if name != "token_embd.weight"]
    mats += [t for t, _ in s.lookahead.fused.values()]
    rng = np.random.default_rng(0)
    for t in mats if ok else []:
        ne = [int(t.contents.ne[i]) for i in range(4)]
        if ne[1] == 1:
            continue  # a vector (norms, biases): elementwise
        if ne[2] > 1 or ne[3] > 1:
            ok = False
            break
        key = (int(t.contents.type), bool(t.contents.extra), ne[0], ne[1])
        if key in seen:
            continue
        seen.add(key)
        x = rng.standard_normal((n, ne[0])).astype(np.float32)
        together = _product(s, t, x)
        if not all(np.array_equal(_product(s, t, x[i : i + 1])[0], together[i]) for i in range(n)):
            ok = False
    s.rows_ok[n] = ok
    return ok


def _product(s: Session, t: Tensor, x: np.ndarray) -> np.ndarray:
    g = s.graph
    ctx = g.reset()
    y = ops.ggml_mul_mat(ctx, t, g.input(x))
    g.compute(y)
    return to_numpy(y).reshape(x.shape[0], -1).copy()


def _one_graph(s: Session, steps: list[tuple[int, int]]) -> list[np.ndarray] | None:
    """With every expert in RAM: the step as one graph (runtime/token_graph.py, every sequence's subgraph side
    by side), rebuilt when the sequences or one's attention window change; None when that graph is off or does
    not fit (the per-layer path runs instead). The scheduler still sees each layer's union and each sequence's
    selection, as in the per-layer path."""
    if not s._token_graph_on or s.scheduler.slot_map is None:
        return None
    if any(s.seqs[slot].media is not None for slot, _ in steps):
        return None  # (its positions are text's: after an image they are not, vision/prompt.py)
    if not all(s.model.one_graph_at(s.seqs[slot].pos, s.n_ctx) for slot, _ in steps):
        return None
    windows = [common.decode_window(s.seqs[slot].pos, s.n_ctx) for slot, _ in steps]
    group = rows_group(s, len(steps))
    key = (group, *((slot, w) for (slot, _), w in zip(steps, windows, strict=True)))
    if s.batch_graph is None or s.batch_graph[0] != key:
        if s.batch_graph is not None:
            s.batch_graph[1].close()
            s.batch_graph = None
        try:
            kvs = [s.seqs[slot].kv for slot, _ in steps]
            graph = TokenGraph(s.model, kvs, windows, s.experts, s.scheduler.slot_map, s.graph, group)
        except MemoryError as e:
            s._token_graph_on = False
            s.log(f"decode runs one graph per layer: the one-graph step did not fit in memory ({e})")
            return None
        s.batch_graph = (key, graph)
    k = s.model.token_context  # (the tokens each step's embedding reads before it)
    befores = [s.seqs[slot].history[-k:] if k else [] for slot, _ in steps]
    got = s.batch_graph[1].run_all([t for _, t in steps], [s.seqs[slot].pos for slot, _ in steps], befores)
    by_layer: dict[int, list[np.ndarray]] = {}
    for _, routed in got:
        for il, experts in routed:
            by_layer.setdefault(il, []).append(experts)
    k = s.hp.n_expert_used
    for il, chosen in by_layer.items():
        s.scheduler.touch(il, list(dict.fromkeys(np.concatenate(chosen).tolist())))
        for row in chosen:
            s.scheduler.observe(il, row.reshape(1, k))
    logits = []
    for (slot, token), (lg, _) in zip(steps, got, strict=True):
        s.use(slot)
        s._advance([token])
        logits.append(lg)
    return logits


def _layer(s: Session, il: int, slots: list[int], hs: list[np.ndarray], group: int) -> list[np.ndarray]:
    parts = _parts(s, il, slots, hs, group)
    merged = _merge(s, [s.lookahead.predict(il, r["ahead"]) if "ahead" in r else [] for r in parts])
    if "out" in parts[0]:  # a dense layer: it predicts the streamed layers after it, as a MoE layer does
        _predict(s, merged)
        return [r["out"] for r in parts]
    sel, union = _selected(s, il, parts)
    return _tails(s, il, slots, parts, _experts(s, il, parts, sel, union, merged))


def _parts(
    s: Session, il: int, slots: list[int], hs: list[np.ndarray], group: int, lookahead: bool = True
) -> list[Parts]:
    """Every sequence's layer graph results: as the rows of shared products in groups where `rows_batch` allows,
    else side by side; the lookahead's router logits ("ahead") with `lookahead`."""
    if group <= 1:
        return _layer_parts(s, il, slots, hs, lookahead)
    parts = []
    for idx in groups_of(list(range(len(slots))), group):
        parts += _rows_parts(s, il, [slots[i] for i in idx], [hs[i] for i in idx], lookahead)
    return parts


def _predict(s: Session, merged: list[Ahead]) -> None:
    for a in merged:
        s.scheduler.predict(a.target, a.experts, a.distance, a.probs, a.predictors)


def _selected(s: Session, il: int, parts: list[Parts]) -> tuple[np.ndarray, list[int]]:
    """The step's selections (a row per sequence), counted and scored, and their union in the order the
    sequences name them."""
    sel = np.concatenate([r["ids"] for r in parts])
    for row in sel:
        s.scheduler.observe(il, row.reshape(1, -1))
    union = list(dict.fromkeys(sel.reshape(-1).tolist()))
    s.lookahead.score(il, np.array([union]))  # recall over the step: the share of the union predicted
    return sel, union


def _tails(s: Session, il: int, slots: list[int], parts: list[Parts], weighted: np.ndarray) -> list[np.ndarray]:
    out = []
    for i, r in enumerate(parts):
        summed = common.sum_experts(weighted[i : i + 1])  # (each sequence's own k, in rank order)
        s.use(slots[i])
        out.append(s._tail(il, summed, r))
    return out


def _layer_parts(s: Session, il: int, slots: list[int], hs: list[np.ndarray], lookahead: bool) -> list[Parts]:
    """Every sequence's layer graph, side by side in one graph (one computation per layer, not one per
    sequence)."""
    g = s.graph
    ctx = g.reset()
    outs, writes = [], []
    for slot, h in zip(slots, hs, strict=True):
        s.use(slot)
        out, w = s._layer_graph(ctx, il, g.input(h), s._placement(s.pos, 1, True), lookahead)
        outs.append(out)
        writes += w
    g.compute(*writes, *[t for out in outs for t in out.values()])
    return [{name: to_numpy(t).reshape(1, -1).copy() for name, t in out.items()} for out in outs]


def _rows_parts(s: Session, il: int, slots: list[int], hs: list[np.ndarray], lookahead: bool) -> list[Parts]:
    """The layer for every sequence as the rows of one graph (`rows_batch`), split back into each one's
    results."""
    g = s.graph
    ctx = g.reset()
    parts = []
    for slot in slots:
        s.use(slot)
        parts.append(s._placement(s.pos, 1, True))
    axes = s.model.position_axes
    pos = np.array([s.seqs[slot].pos for slot in slots], np.int32)
    positions = np.concatenate([np.tile(pos, 3), np.zeros(len(slots) * (axes - 3), np.int32)]) if axes > 1 else pos
    for i, slot in enumerate(slots):  # a sequence with images in its history: its text's positions after them
        media = s.seqs[slot].media
        if media is not None and axes > 1:
            positions[i :: len(slots)] = media.positions(int(pos[i]), 1)
    kvs = [s.seqs[slot].kv for slot in slots]
    at = rows_placement(ctx, parts, g.input(positions), kvs)
    out, writes = s._layer_graph(ctx, il, g.input(np.concatenate(hs)), at, lookahead, cache=rows_cache(kvs, il))
    g.compute(*writes, *out.values())
    n = len(slots)
    got = {name: to_numpy(t).reshape(n, -1).copy() for name, t in out.items()}
    return [{name: v[i : i + 1] for name, v in got.items()} for i in range(n)]


def _merge(s: Session, ahead: list[list[Ahead]]) -> list[Ahead]:
    """The sequences' predictions for each later layer as one (its experts ordered by their highest
    probability): the core counts a call as one layer's vote, so each predicting layer calls once per target.
    The lookahead's record of what was predicted (its recall, the trace) is the merged one; a layer whose experts
    the step's token ids give (`_read_known`) is recorded, not predicted again."""
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
        if a.target in s._known:
            continue  # (a hash layer: its experts are read from the step's start, `_read_known`)
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
    size = sched.wave_size(il)
    weighted = np.zeros((sel.shape[0], sel.shape[1], cur.shape[1]), np.float32)
    # Those already in RAM (or on their way) first, each wave with the later waves' held experts kept in place:
    # in the union's own order a first wave's misses evicted experts a later wave then read again (demo model,
    # 25 % budget, 4 streams: 12.2 reads a token against 8.5 alone). Waves compute disjoint (sequence, expert)
    # pairs placed at their ranks, so their order does not change a bit.
    held = sched.streamer.holding(il, union)
    rest = [e for e, h in zip(union, held, strict=True) if h] + [e for e, h in zip(union, held, strict=True) if not h]
    first = True
    while rest:
        wave, keep = sched.next_wave(il, rest, size)
        rest = rest[len(wave) :]
        ready = sched.begin_layer(il, wave, keep)
        if first:
            _predict(s, ahead)
            first = False
        _put_wave(s, il, cur, sel, weights, wave, ready, weighted)
        sched.end_layer(il)
    return weighted


def _put_wave(
    s: Session,
    il: int,
    cur: np.ndarray,
    sel: np.ndarray,
    weights: np.ndarray,
    wave: list[int],
    ready: list[bool],
    weighted: np.ndarray,
) -> None:
    """The sequences' pairs with the experts of one wave, written into `weighted` at their ranks."""
    got = s.experts.decode_weighted(il, cur, sel, weights, wave, ready)
    mask = selected(sel, wave)
    weighted[mask] = got[mask]
