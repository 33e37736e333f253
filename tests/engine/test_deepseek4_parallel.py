"""DeepSeek V4 (`deepseek4`) with several sequences at once (runtime/batch.py, the server's `--parallel` slots): each
sequence's raw-key ring, compressed blocks, indexer keys and compressors' carried rows are its own, its
hyper-connection streams go through its own layer graph, the experts are each layer's union; every sequence gets
the logits it gets alone, bit for bit, and the hash layers' experts of every sequence are read from the step's
start as their union."""

from __future__ import annotations

import dataclasses
import threading
from pathlib import Path
from typing import Any

import gguf
import httpx
import numpy as np
import pytest

from tests.conftest import ModelFactory
from tests.engine.test_batch_decode import _alone, _options, _together
from tests.engine.test_server import Server
from tests.engine.test_server_parallel import _ask, _requests
from tests.engine.test_server_parallel import _together as _admitted_together
from tests.pauses import Pauses
from tokenwing.format.reader import ModelFile
from tokenwing.runtime.batch import decode_step
from tokenwing.runtime.session import Session, SessionOptions

A = "deepseek4"
# Three sequences at different positions: the first decodes across position 127 (an HCA block completes in a
# batched step) with its CSA indexer picking 8 of ~31 blocks, the second starts inside the first window (16), the
# third joins two steps late (`_together`); CSA blocks complete every 4 positions in every sequence.
PROMPTS = [
    [(7 * i + 3) % 500 + 1 for i in range(124)],
    [5, 17, 99, 3, 42, 7, 260],
    [(11 * i + 5) % 480 + 2 for i in range(37)],
]

# HCA first, a CSA indexer keeping one block, one output group, one hash layer, YaRN, top-3
HCA_FIRST: dict[str, object] = {
    "compress_ratios": (128, 4, 0, 4), "n_layer": 4, "hash_layer_count": 1, "o_group_count": 1,
    "indexer_n_head": 2, "indexer_top_k": 1, "sliding_window": 24, "yarn_factor": 4.0, "yarn_orig_ctx": 128,
    "n_expert_used": 3,
}  # fmt: skip


def _opts(parallel: int, budget: int | None, lookahead: int = 2) -> SessionOptions:
    return dataclasses.replace(_options(parallel, budget, lookahead), n_ctx=256)


@pytest.mark.parametrize(
    ("shape", "budget"),
    [
        ({}, None),  # the tiny preset (window, window, CSA, HCA; two hash layers), every expert in RAM
        ({}, 1),  # streamed, k slots a layer: the union runs in waves
        (HCA_FIRST, 1),
    ],
    ids=["in-ram", "streamed", "hca-first"],
)
def test_each_sequence_gets_what_it_gets_alone(
    repacked_factory: ModelFactory, shape: dict[str, object], budget: int | None
) -> None:
    model = str(repacked_factory(arch=A, type="Q8_0", **shape))
    want = [_alone(model, _opts(1, budget), p) for p in PROMPTS]
    got = _together(model, _opts(len(PROMPTS), budget), PROMPTS)
    for w, g in zip(want, got, strict=True):
        assert len(g) == len(w)
        for step, (a, b) in enumerate(zip(w, g, strict=True)):
            assert np.array_equal(a, b), f"step {step}: max |diff| {np.abs(a - b).max()}"


def test_the_hash_layers_union_is_read_from_the_steps_start(
    model_factory: ModelFactory, repacked_factory: ModelFactory
) -> None:
    """At a quarter of the expert bytes with lookahead 2: before a batched step's first layer begins, each hash
    layer's experts are read as known (`read_known`, in layer order) once, the union of the sequences' table rows
    in the sequences' order; the lookahead never guesses a hash layer."""
    src = model_factory(arch=A, type="Q8_0")
    model = repacked_factory(arch=A, type="Q8_0")
    with ModelFile.open(str(model)) as mf:
        budget = mf.index.total_bytes // 4
    tables = {
        int(t.name.split(".")[1]): np.asarray(t.data).copy()
        for t in gguf.GGUFReader(str(src)).tensors
        if t.name.endswith(".ffn_gate_tid2eid.weight")
    }
    assert sorted(tables) == [0, 1]
    s = Session(str(model), _opts(len(PROMPTS), budget), log=lambda line: None)
    events: list[tuple[str, int, list[int], list[float]]] = []
    predict, begin, read_known = s.scheduler.predict, s.scheduler.begin_layer, s.scheduler.read_known

    def on_predict(block: int, experts: Any, distance: int, probs: Any = (), predictors: int = 0) -> None:
        events.append(("predict", block, list(experts), list(probs)))
        predict(block, experts, distance, probs, predictors)

    def on_known(block: int, experts: Any) -> None:
        events.append(("known", block, list(experts), []))
        read_known(block, experts)

    def on_begin(block: int, experts: Any, keep: Any = ()) -> list[bool]:
        events.append(("begin", block, list(experts), []))
        return begin(block, experts, keep)

    s.scheduler.predict, s.scheduler.begin_layer = on_predict, on_begin  # type: ignore[method-assign]
    s.scheduler.read_known = on_known  # type: ignore[method-assign]
    try:
        last = []
        for slot, prompt in enumerate(PROMPTS):
            s.use(slot)
            last.append(int(s.forward(prompt, prompt=True).argmax()))
        for _ in range(4):
            events.clear()
            got = decode_step(s, list(enumerate(last)))
            start = next(i for i, e in enumerate(events) if e[0] == "begin" and e[1] == 0)
            want = []
            for il in sorted(tables):
                union = list(dict.fromkeys(x for t in last for x in tables[il][t].tolist()))
                want.append((il, union))
            assert [(b, ex) for kind, b, ex, _ in events[:start] if kind == "known"] == want
            assert not [e for e in events[start:] if e[0] == "known"]
            assert not [e for e in events if e[0] == "predict" and e[1] in tables]
            last = [int(lg.argmax()) for lg in got]
    finally:
        s.close()


def test_concurrent_requests_through_the_server_get_what_they_get_alone(
    repacked_factory: ModelFactory, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Four official-client requests (greedy and seeded sampled, one with log-probabilities and a stop string)
    admitted together on a 4-slot server at 30 % of the expert bytes: each reply is the one it gets alone, and they
    were decoded in one batch."""
    model = repacked_factory(arch=A, type="Q8_0")
    server = Server(model, "--parallel", "1", "--no-prompt-cache", "--ram-budget", "30%")
    try:
        alone = [_ask(server.client(), body) for body in _requests()]
    finally:
        server.stop()
    pauses = Pauses(tmp_path / "pauses", "serve.admit")
    pauses.arm(monkeypatch)
    server = Server(model, "--parallel", "4", "--ram-budget", "30%")
    try:
        assert httpx.get(server.url + "/health").json()["slots"] == 4  # (one a time before this change)
        got: list[dict[str, Any] | None] = [None] * len(alone)

        def one(i: int, body: dict[str, Any]) -> None:
            got[i] = _ask(server.client(), body)

        threads = [threading.Thread(target=one, args=(i, b)) for i, b in enumerate(_requests())]
        _admitted_together(server, pauses, threads)
        for want, reply in zip(alone, got, strict=True):
            assert reply is not None
            assert reply["stats"]["largest_batch"] >= 2  # (decoded together with others)
            assert {k: reply[k] for k in ("text", "finish", "logprobs")} == {
                k: want[k] for k in ("text", "finish", "logprobs")
            }
        assert len({r["stats"]["slot"] for r in got if r is not None}) == len(alone)
    finally:
        server.stop()
