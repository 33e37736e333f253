"""DeepSeek V4's hash layers (`deepseek4`, the first layers routed by the token id through `ffn_gate_tid2eid`): their
experts are known before the layer runs, so the session reads them at the token's start (`read_known`), as demand
reads ahead of every prediction. A hash layer then never makes a demand read: each of its experts is a hit or a wait
on a known read (`known_late`), even when no read has started by the time the layer begins."""

from __future__ import annotations

import dataclasses

import gguf
import numpy as np

from tests.conftest import ModelFactory
from tests.engine.test_batch_decode import _options
from tokenwing.format.reader import ModelFile
from tokenwing.runtime.session import SESSION_COUNTERS, Session

A = "deepseek4"
C = {name: i for i, name in enumerate(SESSION_COUNTERS)}


def test_hash_layers_make_no_demand_reads_even_when_no_read_has_started(
    model_factory: ModelFactory, repacked_factory: ModelFactory
) -> None:
    """At a quarter of the expert bytes with lookahead 2, the I/O held at each decode token's start (the core starts
    no read) until the first layer has begun: every expert of the first hash layer not in RAM was read as a known
    read and is still on its way when the layer begins (`known_late`, the layer waits on it), and no hash layer
    makes a demand read. Issued as predictions (the earlier design), the unstarted reads became demand reads at the
    layer's start: this failed at the first decode token ("layer 0: 1 demand reads")."""
    src = model_factory(arch=A, type="Q8_0")
    model = repacked_factory(arch=A, type="Q8_0")
    tables = {
        int(t.name.split(".")[1]): np.asarray(t.data).copy()
        for t in gguf.GGUFReader(str(src)).tensors
        if t.name.endswith(".ffn_gate_tid2eid.weight")
    }
    assert sorted(tables) == [0, 1]
    with ModelFile.open(str(model)) as mf:
        budget = mf.index.total_bytes // 4
    s = Session(str(model), dataclasses.replace(_options(1, budget), n_ctx=256), log=lambda line: None)
    core = s.scheduler.streamer.core
    begin = s.scheduler.begin_layer
    rows = {block: s.scheduler.row(block) for block in tables}

    def on_begin(block: int, experts: list[int], keep: list[int] = []) -> list[bool]:  # noqa: B006
        ready = begin(block, experts, keep)
        if block == 0:
            core.hold_io_after(-1)  # (the layer's reads may start now: it waits on them)
        return ready

    s.scheduler.begin_layer = on_begin  # type: ignore[method-assign]
    try:
        tokens = [(7 * i + 3) % 500 + 1 for i in range(40)]
        s.forward(tokens[:24], prompt=True)
        known_reads = 0
        for token in tokens[24:]:
            core.hold_io_after(0)  # no read starts until layer 0 has begun
            row = tables[0][token].tolist()
            missing = len(row) - sum(s.scheduler.streamer.holding(0, row))
            before = s.counters()
            s.forward([token])
            d = s.counters() - before
            for block, r in rows.items():
                assert d[r, C["demand_reads"]] == 0, f"layer {block}: {d[r, C['demand_reads']]} demand reads"
            assert d[rows[0], C["known_reads"]] == missing
            assert d[rows[0], C["known_late"]] == missing  # (none could land before the layer began)
            assert d[rows[0], C["hits"]] == len(row) - missing
            known_reads += missing
        assert known_reads > 0  # (the cache holds a quarter of the experts: most tokens read some)
        total = s.counters()
        assert total[:, C["known_wait_ns"]].sum() <= total[:, C["wait_ns"]].sum()
    finally:
        s.close()
