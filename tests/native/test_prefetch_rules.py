"""The core's prefetch rules and request shapes: votes, the router's probabilities, split demand reads, late
prefetches, on both I/O engines. Each test holds the I/O (a test-only control of the core) so that what it looks
at happens at a fixed point, whatever the speed of the drive and the machine."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from tests.conftest import ModelFactory
from tokenwing.format.reader import ModelFile
from tokenwing.streaming.settings import StreamSettings
from tokenwing.streaming.streamer import COUNTERS, ExpertStreamer

ENGINES = ["threads", "io_uring"]


@pytest.fixture(scope="module")
def big(repacked_factory: ModelFactory) -> Path:
    # 3 layers of 8 F32 experts of 3 MiB (gate, up, down of 1024 × 256): reads that take a while
    return repacked_factory(type="F32", n_layer=3, n_embd=1024, n_ff_exp=256, n_expert=8, n_expert_used=2)


def totals(s: ExpertStreamer) -> dict[str, int]:
    return {name: int(v) for name, v in zip(COUNTERS, s.counters().sum(axis=0), strict=True)}


def _wait_for(cond: object, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():  # type: ignore[operator]
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.002)


def open_streamer(path: Path, slots: int, **kw: object) -> ExpertStreamer:
    settings = StreamSettings(verify=True, idle_fill_ms=-1, io_threads=1, chunk_kib=1024, **kw)  # type: ignore[arg-type]
    with ModelFile.open(str(path)) as mf:
        return ExpertStreamer(mf, slots, settings)


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize(("votes", "first"), [(2, 3), (1, 6)])
def test_votes_wait_for_the_nearer_prediction(big: Path, engine: str, votes: int, first: int) -> None:
    """Layer 2 is predicted from 2 layers away ([3, 4]) and then from 1 ([6, 3]). With 2 votes only 3, named
    by both, may be read; with 1 vote, 6 (the nearer router's first choice) is read first."""
    with open_streamer(big, 4, io_engine=engine, prefetch_votes=votes) as s:
        s.core.hold_io_after(0)
        s.begin_token()
        s.predict(2, [3, 4], 2)
        s.predict(2, [6, 3], 1)
        s.core.hold_io_after(1)
        _wait_for(lambda: totals(s)["prefetch_issued"] == 1)
        assert s.holding(2, [first]) == [True]
        if votes == 2:  # 4 and 6 wait: nothing else will be bound
            assert s.core.queue_depths()[2] == 2
        s.core.hold_io_after(-1)
        s.begin_layer(2, [first, 7])
        s.wait_all(2, [first, 7])
        t = totals(s)
        assert t["prefetch_used"] == 1 and t["hits"] + t["misses"] == 2


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize(("max_votes", "read"), [(1, True), (0, False)])
def test_a_layer_only_one_layer_predicts_is_still_read_ahead(
    big: Path, engine: str, max_votes: int, read: bool
) -> None:
    """Layer 1 has a single predictor (layer 0, nothing before it): with 2 votes needed a prediction could never be
    confirmed, so the votes needed are capped by the predictors the caller says the layer has."""
    with open_streamer(big, 4, io_engine=engine, prefetch_votes=2) as s:
        s.core.hold_io_after(0)
        s.begin_token()
        s.predict(1, [6], 1, [0.5], max_votes)
        s.core.hold_io_after(1)
        if read:
            _wait_for(lambda: totals(s)["prefetch_issued"] == 1)
        else:
            assert s.core.queue_depths()[2] == 1 and totals(s)["prefetch_issued"] == 0
        s.core.hold_io_after(-1)


@pytest.mark.parametrize("engine", ENGINES)
def test_likeliest_prediction_first(big: Path, engine: str) -> None:
    """With the router's probabilities, the waiting list is read likeliest first, across layers and distances:
    layer 2's 0.9 before layer 1's 0.4 and 0.3, though layer 1 is nearer."""
    with open_streamer(big, 4, io_engine=engine, prefetch_votes=1) as s:
        s.core.hold_io_after(0)
        s.begin_token()
        s.predict(1, [1, 2], 1, [0.4, 0.3])
        s.predict(2, [5], 2, [0.9])
        s.core.hold_io_after(1)
        _wait_for(lambda: totals(s)["prefetch_issued"] == 1)
        assert s.holding(2, [5]) == [True] and s.holding(1, [1, 2]) == [False, False]
        s.core.hold_io_after(-1)


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("split", [True, False])
def test_split_demand_read_gives_gate_and_up_first(big: Path, engine: str, split: bool) -> None:
    """Split, a demand read is two requests: after the first lands, gate and up are ready and down is not."""
    with ModelFile.open(str(big)) as mf:
        want = mf.read_expert(1, 4)
    with open_streamer(big, 4, io_engine=engine, split_demand=split) as s:
        s.core.hold_io_after(1)
        s.begin_token()
        s.begin_layer(1, [4])
        s.wait(1, 4, 0)
        s.wait(1, 4, 1)
        assert s.ready(1, [4]) == [not split]  # down still to come when split
        s.core.hold_io_after(-1)
        assert s.expert_bytes(1, s.wait(1, 4)).tobytes() == want
        assert totals(s)["demand_reads"] == 1


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("skip", [True, False])
def test_a_prefetch_that_cannot_land_in_time_is_not_read(big: Path, engine: str, skip: bool) -> None:
    """Layers 0 and 1 start back to back (the measured pace: microseconds per layer) with 4 demand reads of
    3 MiB queued and none allowed to start; a prediction for layer 2, due one such layer later, would land only
    after those 12 MiB at the measured read rate: skipped (counted late), or read when skipping is off."""
    with open_streamer(big, 4, io_engine=engine, skip_late=skip, prefetch_votes=1) as s:
        s.begin_token()  # a first token measures the read rate
        s.begin_layer(0, [0, 1])
        s.wait_all(0, [0, 1])
        assert s.core.estimates()[0] > 0
        s.core.hold_io_after(0)
        s.begin_token()
        s.begin_layer(0, [2, 3])
        s.begin_layer(1, [2, 3])
        assert s.core.estimates()[1] > 0
        s.predict(2, [5], 1)
        s.core.hold_io_after(-1)
        s.wait_all(0, [2, 3])
        s.wait_all(1, [2, 3])
        _wait_for(lambda: s.core.queue_depths() == [0, 0, 0, 0, 0])
        t = totals(s)
        assert (t["prefetch_late"], t["prefetch_issued"]) == ((1, 0) if skip else (0, 1))


def test_io_uring_is_used_or_falls_back_with_a_reason(big: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with open_streamer(big, 2, io_engine="io_uring") as s:
        engine, why = s.core.io_engine, s.core.io_fallback_reason
        assert engine == "io_uring" or ("io_uring" in why and engine == "threads")
    monkeypatch.setenv("TOKENWING_NO_IO_URING", "1")  # where io_uring is missing: I/O threads, and one reason
    with ModelFile.open(str(big)) as mf:
        want = mf.read_expert(0, 3)
    with open_streamer(big, 2, io_engine="io_uring") as s:
        assert s.core.io_engine == "threads" and "TOKENWING_NO_IO_URING" in s.core.io_fallback_reason
        s.begin_token()
        s.begin_layer(0, [3])
        assert s.expert_bytes(0, s.wait(0, 3)).tobytes() == want


@pytest.mark.parametrize("engine", ENGINES)
def test_known_experts_are_read_first_and_never_on_demand(big: Path, engine: str) -> None:
    """Layer 1 is predicted (6: probability 0.9, one predictor, so readable at once), then layer 0's experts 3 and 5
    are known (`read_known`: DeepSeek V4's hash layers), then layer 1's 2. With the I/O held they wait as three reads
    in chunks in the demand queue, in call order, ahead of the prediction; layer 0 begins before any has started
    and waits on its known reads (`known_late`), no demand read. Two experts' chunks allowed: layer 0's. Layer 1 then
    begins: 2 is a wait on a known read, and 6, predicted but never started, a demand read counted as predicted
    (`demand_predicted`), apart from a miss nobody saw coming."""
    with open_streamer(big, 4, io_engine=engine) as s:
        per = -(-s.layers[0].record_size // (1024 << 10))  # chunks of an expert (3 MiB in 1 MiB chunks)
        s.core.hold_io_after(0)
        s.begin_token()
        s.predict(1, [6], 1, [0.9], 1)
        s.read_known(0, [3, 5])
        s.read_known(1, [2])
        assert list(s.core.queue_depths())[:3] == [3 * per, 0, 1]  # demand queued, prefetch chunks, predictions
        assert s.begin_layer(0, [3, 5]) == [False, False]
        t = totals(s)
        assert (t["known_reads"], t["known_late"], t["demand_reads"], t["misses"]) == (3, 2, 0, 2)
        s.core.hold_io_after(2 * per)
        _wait_for(lambda: all(s.ready(0, [3, 5])))  # (another read first: never ready, the test fails)
        assert list(s.core.queue_depths())[:3] == [per, 0, 1]
        s.wait_all(0, [3, 5])
        s.end_layer(0)
        s.begin_layer(1, [2, 6])
        t = totals(s)
        assert (t["known_late"], t["demand_reads"], t["demand_predicted"], t["prefetch_issued"]) == (3, 1, 1, 0)
        s.core.hold_io_after(-1)
        s.wait_all(1, [2, 6])
        s.end_layer(1)
        assert totals(s)["known_wait_ns"] <= totals(s)["wait_ns"]
