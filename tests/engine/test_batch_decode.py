"""Several sequences decoded together (runtime/batch.py): each gets the logits it gets alone, bit for bit, and a
step reads each layer's union of experts once."""

from __future__ import annotations

import numpy as np
import pytest

from tests.conftest import ModelFactory
from tokenwing.runtime.batch import decode_step, rows_batch
from tokenwing.runtime.session import SESSION_COUNTERS, Session, SessionOptions

PROMPTS = [[5, 17, 99, 3, 42, 7], [8, 8, 150, 61], [120, 33, 2, 77, 91, 14, 60, 9, 1]]
STEPS = 6
_C = {name: i for i, name in enumerate(SESSION_COUNTERS)}


def _options(parallel: int, budget: int | None, lookahead: int = 2) -> SessionOptions:
    return SessionOptions(
        kv_type="f32",
        n_ctx=128,
        max_batch=16,
        parallel=parallel,
        ram_budget=budget,
        lookahead=lookahead,
        usage_table=False,
    )


def _alone(model: str, options: SessionOptions, prompt: list[int]) -> list[np.ndarray]:
    """Greedy decoding of one prompt on a session of its own: the logits of every step."""
    s = Session(model, options, log=lambda line: None)
    try:
        logits = s.forward(prompt, prompt=True)
        out = [logits]
        for _ in range(STEPS):
            logits = s.forward([int(logits.argmax())])
            out.append(logits)
        return out
    finally:
        s.close()


def _together(
    model: str, options: SessionOptions, prompts: list[list[int]], mode: str = "as-measured"
) -> list[list[np.ndarray]]:
    """The same prompts in the slots of one session, then decoded in steps of all of them; the last one starts
    two steps late (a request joining a running batch)."""
    s = Session(model, options, log=lambda line: None)
    if mode == "apart":  # each sequence's dense products apart, whatever `rows_batch` measures on this CPU
        s.rows_ok.update({n: False for n in range(2, len(prompts) + 1)})
    elif mode == "pairs" and rows_batch(s, 2):  # groups of two rows (and one alone), as K-quants of 8 go 3 + 3 + 2
        s.rows_ok[3] = False
    try:
        assert s.n_seq == len(prompts)
        out: list[list[np.ndarray]] = [[] for _ in prompts]
        late = len(prompts) - 1
        for slot, prompt in enumerate(prompts[:late]):
            s.use(slot)
            out[slot].append(s.forward(prompt, prompt=True))
        for step in range(STEPS + 2):
            if step == 2:
                s.use(late)
                out[late].append(s.forward(prompts[late], prompt=True))
            active = [i for i in range(len(prompts)) if len(out[i]) and len(out[i]) <= STEPS]
            got = decode_step(s, [(i, int(out[i][-1].argmax())) for i in active])
            for i, logits in zip(active, got, strict=True):
                out[i].append(logits)
        return out
    finally:
        s.close()


@pytest.mark.parametrize(
    ("shape", "budget"),
    [
        ({"type": "Q8_0"}, None),  # every expert in RAM: alone, a decode step is one graph
        ({"type": "Q4_K_M"}, 1),  # streamed, k slots a layer: the union runs in waves
        ({"type": "Q8_0", "arch": "bailingmoe3", "n_layer": 4}, 1),  # recurrent layers, a dense first layer
        ({"type": "Q8_0", "arch": "gpt-oss"}, 1),  # sliding-window layers, attention sinks
        ({"type": "Q8_0", "arch": "deepseek2"}, 1),  # MLA
        ({"type": "Q8_0", "arch": "kimi-k3"}, None),  # a state wider than a vector between layers, KDA
        # 4 streams and each sequence's own n-gram rows (its tokens before: the table, its convolution history)
        ({"type": "Q8_0", "arch": "qwen4exp", "indexer_top_k": 512}, 1),
        # sliding-window and full layers of different V widths (each writes its own cells), GELU experts
        ({"type": "Q8_0", "arch": "gemma4", "n_layer": 4, "n_head_kv": 4, "sliding_window": 8}, 1),
        # sinks in the sliding-window layers only, their own KV heads and rope base, values narrower than keys
        ({"type": "Q8_0", "arch": "mimo2", "sliding_window": 8}, 1),
    ],
    ids=["in-ram", "streamed", "ling", "gpt-oss", "mla", "kimi-k3", "qwen4exp", "gemma4", "mimo2"],
)
@pytest.mark.parametrize("mode", ["as-measured", "apart", "pairs"])
def test_each_sequence_gets_what_it_gets_alone(
    repacked_factory: ModelFactory, shape: dict[str, object], budget: int | None, mode: str
) -> None:
    """Each sequence's logits at every step, with the dense products as rows of one product where this CPU's
    kernels allow it (`rows_batch`; the tests' small models: all but Ling's and MLA's), in groups of two, and
    apart."""
    model = str(repacked_factory(**shape))
    want = [_alone(model, _options(1, budget), p) for p in PROMPTS]
    got = _together(model, _options(len(PROMPTS), budget), PROMPTS, mode)
    for w, g in zip(want, got, strict=True):
        assert len(g) == len(w)
        for step, (a, b) in enumerate(zip(w, g, strict=True)):
            assert np.array_equal(a, b), f"step {step}: max |diff| {np.abs(a - b).max()}"


def _prompted_and_recording(s: Session) -> tuple[list[int], list[np.ndarray]]:
    """Each of PROMPTS in its slot: each one's greedy next token, and the list every later layer's selections (a
    row per sequence, in the order the scheduler sees them) are appended to."""
    last = []
    for slot, prompt in enumerate(PROMPTS):
        s.use(slot)
        last.append(int(s.forward(prompt, prompt=True).argmax()))
    sel: list[np.ndarray] = []
    observe = s.scheduler.observe

    def recording(block: int, rows: np.ndarray) -> None:
        sel.append(rows.copy())
        observe(block, rows)

    s.scheduler.observe = recording  # type: ignore[method-assign,assignment]
    return last, sel


def test_a_step_reads_each_expert_of_the_union_once(repacked_factory: ModelFactory) -> None:
    """k slots a layer and no lookahead: the union of three sequences is larger than the slots, so it runs in
    waves; each layer's drive reads are at most its union, each one record."""
    model = str(repacked_factory(type="Q4_K_M"))
    s = Session(model, _options(3, 1, lookahead=0), log=lambda line: None)
    try:
        assert s.slots_per_layer == s.hp.n_expert_used
        last, sel = _prompted_and_recording(s)
        before = s.counters()
        decode_step(s, [(i, t) for i, t in enumerate(last)])
        delta = s.counters() - before
        rows = iter(sel)
        waves = 0
        for li, layer in enumerate(s.streamed):
            union = set(np.concatenate([next(rows) for _ in PROMPTS]).reshape(-1).tolist())
            waves += len(union) > s.slots_per_layer
            misses = int(delta[li, _C["misses"]])
            assert misses <= len(union)
            assert delta[li, _C["hits"]] + misses >= len(union)
            assert delta[li, _C["bytes_read"]] == misses * s.scheduler.record_sizes[layer]
        assert waves  # (the case the test is for)
    finally:
        s.close()


def test_a_step_never_reads_again_what_ram_held_at_its_start(repacked_factory: ModelFactory) -> None:
    """k slots a layer, no lookahead, several steps: a union larger than the slots runs in waves, and an expert of
    the union that RAM held when the step began is a hit, never evicted by an earlier wave's reads and read again
    (each layer's reads are exactly the union's experts it did not hold)."""
    model = str(repacked_factory(type="Q4_K_M"))
    s = Session(model, _options(3, 1, lookahead=0), log=lambda line: None)
    try:
        last, sel = _prompted_and_recording(s)
        every = list(range(s.hp.n_expert))
        held_waves = 0
        for _ in range(STEPS):
            held = {
                b: {e for e, h in zip(every, s.scheduler.streamer.holding(b, every), strict=True) if h}
                for b in s.streamed
            }
            sel.clear()
            before = s.counters()
            got = decode_step(s, [(i, t) for i, t in enumerate(last)])
            delta = s.counters() - before
            last = [int(g.argmax()) for g in got]
            rows = iter(sel)
            for li, layer in enumerate(s.streamed):
                union = set(np.concatenate([next(rows) for _ in PROMPTS]).reshape(-1).tolist())
                held_waves += len(union) > s.slots_per_layer and bool(union & held[layer])
                assert int(delta[li, _C["misses"]]) == len(union - held[layer]), (layer, union, held[layer])
        assert held_waves  # (the case the test is for: waves, and some of the union in RAM at the start)
    finally:
        s.close()


LONG = [(7 * i + 3) % 200 + 1 for i in range(70)]  # past the first 64-position window


@pytest.mark.parametrize(
    ("slots", "prompts", "runs"),
    [
        ((0, 1, 2), [LONG, PROMPTS[0], PROMPTS[1]], [2]),  # the long one's window is wider: it attends alone
        ((0, 2, 3), PROMPTS, [2]),  # slot 1 idle: slots 2 and 3 attend in one product, slot 0 alone
        ((0, 1, 2, 3), [*PROMPTS, PROMPTS[0]], [4]),  # every slot, one product
    ],
    ids=["windows", "gap", "all"],
)
def test_stacked_attention_runs_get_what_each_gets_alone(
    repacked_factory: ModelFactory,
    monkeypatch: pytest.MonkeyPatch,
    slots: tuple[int, ...],
    prompts: list[list[int]],
    runs: list[int],
) -> None:
    """The slots' caches are one stack per layer, so sequences of consecutive slots with equal windows attend in
    one product over it (`common.Run`); a sequence with another window, or after an idle slot, attends on its own.
    Either way each one's logits are those it gets alone."""
    from tokenwing.models import attention, common

    model = str(repacked_factory(type="Q8_0"))
    want = [_alone(model, _options(1, None), p) for p in prompts]
    seen: list[int] = []
    stacked = attention._attend_stacked

    def spy(*args: object, **kwargs: object) -> object:
        run = args[3]
        assert isinstance(run, common.Run)
        seen.append(run.count)
        return stacked(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(attention, "_attend_stacked", spy)  # (where `attend` looks it up)
    s = Session(model, _options(4, None), log=lambda line: None)
    try:
        out: list[list[np.ndarray]] = []
        for slot, prompt in zip(slots, prompts, strict=True):
            s.use(slot)
            out.append([s.forward(prompt, prompt=True)])
        for _ in range(STEPS):
            got = decode_step(s, [(slot, int(o[-1].argmax())) for slot, o in zip(slots, out, strict=True)])
            for o, logits in zip(out, got, strict=True):
                o.append(logits)
    finally:
        s.close()
    assert sorted(set(seen)) == runs  # (the graphs were built with these runs)
    for w, g in zip(want, out, strict=True):
        for step, (a, b) in enumerate(zip(w, g, strict=True)):
            assert np.array_equal(a, b), f"step {step}: max |diff| {np.abs(a - b).max()}"


PART_PROMPT = LONG[:40]  # three parts at max_batch 16: 16, 16, 8


def _parts(prompt: list[int], b: int = 16) -> list[list[int]]:
    return [prompt[i : i + b] for i in range(0, len(prompt), b)]


@pytest.mark.parametrize(
    "shape",
    [
        {"type": "Q4_K_M"},  # k slots a layer: the prompt's waves and the decode tokens' extra experts
        {"type": "Q8_0", "arch": "bailingmoe3", "n_layer": 4},  # recurrent layers (checkpoints), a dense layer
        {"type": "Q8_0", "arch": "deepseek2"},  # MLA
        {"type": "Q8_0", "arch": "deepseek4"},  # hyper-connections, ring and compressed caches, hash layers
    ],
    ids=["streamed", "ling", "mla", "deepseek4"],
)
def test_a_prompt_joins_the_decode_steps(
    repacked_factory: ModelFactory, monkeypatch: pytest.MonkeyPatch, shape: dict[str, object]
) -> None:
    """A request's prompt, in parts of a chunk, runs in the same pass as the others' decode tokens (`batch.step`):
    each sequence gets the logits it gets alone (the prompt in the same parts), and each layer reads at most the
    union of the prompt's and the decode tokens' experts once."""
    from tokenwing.runtime import batch

    model = str(repacked_factory(**shape))
    want = [_alone(model, _options(1, 1), p) for p in PROMPTS[:2]]
    s = Session(model, _options(1, 1), log=lambda line: None)
    try:
        parts = _parts(PART_PROMPT)
        alone = [s.forward(p, prompt=True, end=i == len(parts) - 1) for i, p in enumerate(parts)]
        last = [alone[-1]]
        for _ in range(STEPS):
            last.append(s.forward([int(last[-1].argmax())]))
        want.append(alone + last[1:])
    finally:
        s.close()
    joint: list[int] = []
    layer = batch._joint_layer

    def spy(*args: object) -> object:
        joint.append(int(args[1]))  # type: ignore[call-overload]
        return layer(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(batch, "_joint_layer", spy)
    s = Session(model, _options(3, 1), log=lambda line: None)
    sel: list[np.ndarray] = []
    observe = s.scheduler.observe

    def recording(block: int, rows: np.ndarray) -> None:
        sel.append(rows.copy())
        observe(block, rows)

    routers: list[int] = []  # the lookahead's router graphs built (the joint pass makes no predictions)
    graph = s.lookahead.graph

    def counted(*args: object) -> object:
        routers.append(int(args[1]))  # type: ignore[call-overload]
        return graph(*args)  # type: ignore[arg-type]

    try:
        out: list[list[np.ndarray]] = [[], [], []]
        for slot in (0, 1):
            s.use(slot)
            out[slot].append(s.forward(PROMPTS[slot], prompt=True))
        s.scheduler.observe = recording  # type: ignore[method-assign,assignment]
        s.lookahead.graph = counted  # type: ignore[method-assign]
        for i, p in enumerate(parts):
            steps = [(slot, int(out[slot][-1].argmax())) for slot in (0, 1)]
            sel.clear()
            before = s.counters()
            got, logits = batch.step(s, steps, batch.PromptPart(2, p, end=i == len(parts) - 1))
            assert not routers or not joint, routers  # a joint pass computes no router logits it will not use
            delta = s.counters() - before
            assert logits is not None
            out[2].append(logits)
            for slot, lg in zip((0, 1), got, strict=True):
                out[slot].append(lg)
            rows = iter(sel)
            for li, _ in enumerate(s.streamed):  # the prompt's selections, then each decode token's
                union = set(np.concatenate([next(rows) for _ in range(3)]).reshape(-1).tolist())
                assert delta[li, _C["misses"]] <= len(union)
        s.scheduler.observe = observe  # type: ignore[method-assign]
        while any(len(o) < len(w) for o, w in zip(out, want, strict=True)):
            active = [i for i in range(3) if len(out[i]) < len(want[i])]
            got = decode_step(s, [(i, int(out[i][-1].argmax())) for i in active])
            for i, logits in zip(active, got, strict=True):
                out[i].append(logits)
    finally:
        s.close()
    assert joint  # (the parts went in the decode steps' pass)
    for w, g in zip(want, out, strict=True):
        assert len(g) == len(w)
        for step, (a, b) in enumerate(zip(w, g, strict=True)):
            assert np.array_equal(a, b), f"step {step}: max |diff| {np.abs(a - b).max()}"
