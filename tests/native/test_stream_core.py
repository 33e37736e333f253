"""The streaming core against a real repacked model file: exact bytes, policy, scheduler, loans, faults."""

from __future__ import annotations

import os
import shutil
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import ModelFactory
from tokenwing import _core
from tokenwing.errors import BadInputError
from tokenwing.format.reader import ModelFile
from tokenwing.streaming.eviction_model import load_model
from tokenwing.streaming.settings import StreamSettings
from tokenwing.streaming.streamer import COUNTERS, ExpertStreamer
from tokenwing.streaming.trace import Trace, simulate, synthetic_trace

C = {name: i for i, name in enumerate(COUNTERS)}


def totals(s: ExpertStreamer) -> dict[str, int]:
    return {name: int(v) for name, v in zip(COUNTERS, s.counters().sum(axis=0), strict=True)}


@pytest.fixture(scope="module")
def model(repacked_factory: ModelFactory) -> Path:
    # 4 layers of 16 Q8_0 experts, 60 KiB records: several 16 KiB chunks per expert in these tests.
    return repacked_factory(type="Q8_0", n_layer=4, n_embd=256, n_ff_exp=64, n_expert=16, n_expert_used=4)


@pytest.fixture(scope="module")
def expected(model: Path) -> dict[tuple[int, int], bytes]:
    with ModelFile.open(str(model)) as mf:
        return {(el.layer, e): mf.read_expert(el.layer, e) for el in mf.index.layers for e in range(mf.index.n_expert)}


def streamer(model: Path, slots: int, **kw: object) -> ExpertStreamer:
    settings = StreamSettings(verify=True, chunk_kib=16, idle_fill_ms=-1, prefetch_votes=1)
    for k, v in kw.items():
        setattr(settings, k, v)
    with ModelFile.open(str(model)) as mf:
        return ExpertStreamer(mf, slots, settings)


def random_steps(s: ExpertStreamer, seed: int, tokens: int) -> Iterator[tuple[int, int]]:
    """Random routing over 4 layers of 16 experts, top-4, with next-layer predictions, layer 0's experts known at
    the token's start (`read_known`): yields (layer, expert) for every selected expert after its layer began
    (eviction, prefetch, cancel, promote and known reads all happen)."""
    rng = np.random.default_rng(seed)
    for _ in range(tokens):
        s.begin_token()
        known = rng.choice(16, 4, replace=False).tolist()
        s.read_known(0, known)
        for layer in range(4):
            sel = known if layer == 0 else rng.choice(16, 4, replace=False).tolist()
            s.begin_layer(layer, sel)
            if layer < 3:
                s.predict(layer + 1, rng.choice(16, 4, replace=False).tolist(), 1)
            for e in sel:
                yield layer, e


ENGINES = ["threads", "io_uring"]


@pytest.mark.parametrize("engine", ENGINES)
def test_exact_bytes_under_eviction(model: Path, expected: dict[tuple[int, int], bytes], engine: str) -> None:
    with streamer(model, 5, io_engine=engine) as s:
        assert s.core.io_engine == engine
        for layer, e in random_steps(s, 1, 40):
            for proj in (0, 1, 2):  # each projection's ready flag, then the whole expert
                s.wait(layer, e, proj)
            slot = s.wait(layer, e)
            assert s.expert_bytes(layer, slot).tobytes() == expected[(layer, e)]
        t = totals(s)
    assert t["hits"] + t["misses"] == 40 * 4 * 4
    assert t["read_errors"] == 0
    assert t["bytes_read"] >= t["demand_reads"] * 60 * 1024


def test_transform_runs_once_per_landed_projection(model: Path, expected: dict[tuple[int, int], bytes]) -> None:
    """The post-read transform (ggml repacking in the engine; a bitwise NOT here) rewrites exactly the chosen
    projection of every expert that lands, before it counts as ready, under eviction, prefetch and cancels."""
    with streamer(model, 5, verify=False) as s, ModelFile.open(str(model)) as mf:
        for li, el in enumerate(mf.index.layers):
            base = s.pools[li].ctypes.data
            ctx = [base + slot * el.record_size + el.proj_offset[1] for slot in range(5)]
            s.core.set_transform(li, 1, _core.invert_transform(), ctx)
        for layer, e in random_steps(s, 4, 30):
            s.wait(layer, e, 1)
            slot = s.wait(layer, e)
            want = bytearray(expected[(layer, e)])
            o, n = mf.index.layers[layer].proj_offset[1], mf.index.layers[layer].proj_size[1]
            want[o : o + n] = bytes(~np.frombuffer(want[o : o + n], np.uint8))
            assert s.expert_bytes(layer, slot).tobytes() == bytes(want)


def test_all_resident_reads_each_expert_once(model: Path) -> None:
    with streamer(model, 16) as s:
        for _ in range(3):
            s.begin_token()
            for layer in range(4):
                s.begin_layer(layer, list(range(16)))
                for e in range(16):
                    s.wait(layer, e)
        t = totals(s)
    assert t["demand_reads"] == 64 and t["misses"] == 64 and t["hits"] == 128


def _replay_in_core(model: Path, trace: Trace, slots: int, policy: str) -> np.ndarray:
    with streamer(model, slots, policy=policy, verify=False) as s:
        for tok in range(trace.n_tokens):
            s.begin_token(int(trace.prompt_tokens[tok]))
            for layer in range(trace.selected.shape[1]):
                sel = [int(e) for e in trace.selected[tok, layer] if e >= 0]
                s.begin_layer(layer, sel)
                for e in sel:
                    s.wait(layer, e)
        return s.counters()


@pytest.mark.parametrize("policy", ["history", "learned", "decay", "lru"])
def test_core_and_simulator_share_the_policy(model: Path, policy: str) -> None:
    """The trace simulator runs the core's own eviction code: identical hits and misses per layer."""
    trace = synthetic_trace(120, 4, 16, 4, zipf=1.1, locality=0.4, seed=3)
    trace.prompt_tokens[:10] = 16  # a prompt first: LRU plus ageing
    counters = _replay_in_core(model, trace, 6, policy)
    sim = simulate(trace, 6, policy, learned=load_model().core_weights())
    assert counters[:, C["misses"]].tolist() == sim["per_layer_misses"]
    assert int(counters[:, C["hits"]].sum()) == sim["hits"]


@pytest.mark.parametrize(
    ("policy", "kept"), [("decay", {0, 2, 3, 4}), ("history", {0, 2, 3, 4}), ("lru", {1, 2, 3, 4})]
)
def test_eviction_order(model: Path, policy: str, kept: set[int]) -> None:
    # 4 slots, one expert per token: 0 0 0 1 2 3, then 4 forces an eviction. LRU evicts 0 (least recent);
    # decay evicts 1 (used once, like 2 and 3: the tie goes to the least recently used).
    with streamer(model, 4, policy=policy) as s:
        for e in (0, 0, 0, 1, 2, 3, 4):
            s.begin_token()
            s.begin_layer(0, [e])
            s.wait(0, e)
        assert set(s.core.resident_experts(0)) == kept


@pytest.mark.parametrize(("policy", "kept"), [("decay", {1, 3}), ("history", {0, 3})])
def test_history_keeps_the_count_of_an_expert_that_left(model: Path, policy: str, kept: set[int]) -> None:
    """2 slots, one expert per token: 0 ×3, 1 ×4; 2 evicts 0 (3 uses < 4); 0 comes back and evicts 2. Then 3
    needs a slot: decay forgot 0's uses (it restarted at 1) and evicts it; history remembers 3 + 1 = 4, ties with
    1's 4 and evicts 1, the less recent."""
    with streamer(model, 2, policy=policy) as s:
        for e in (0, 0, 0, 1, 1, 1, 1, 2, 0, 3):
            s.begin_token()
            s.begin_layer(0, [e])
            s.wait(0, e)
        assert set(s.core.resident_experts(0)) == kept


@pytest.mark.parametrize("policy", ["decay", "history", "lru"])
def test_a_miss_never_evicts_an_expert_selected_with_it(model: Path, policy: str) -> None:
    """4 slots hold 0 1 2 3 (0 least recent); the layer selects [9, 0]: the miss on 9, first in the list, must
    evict one of 1 2 3, not 0, which the same step needs (and which LRU and decay would pick first)."""
    with streamer(model, 4, policy=policy) as s:
        for e in (0, 1, 2, 3):
            s.begin_token()
            s.begin_layer(0, [e])
            s.wait(0, e)
        s.begin_token()
        assert s.begin_layer(0, [9, 0]) == [False, True]  # what is ready at once: the hit, not the miss
        s.wait_all(0, [9, 0])
        assert 0 in s.core.resident_experts(0)
        assert totals(s)["demand_reads"] == 5


def test_kept_experts_stay_for_a_later_wave(model: Path) -> None:
    """A prompt's wave can keep a later wave's experts (already in RAM) where they are: its reads evict the
    others, kept experts are not counted as used, and `holding` tells which experts have a slot."""
    with streamer(model, 4) as s:
        s.begin_token(100)
        s.begin_layer(1, [0, 1, 2, 3])
        s.wait_all(1, [0, 1, 2, 3])
        assert s.holding(1, [0, 1, 5]) == [True, True, False]
        hits = totals(s)["hits"]
        s.begin_layer(1, [5, 6], keep=[0, 1])  # 0 and 1 are the least recent: LRU would take them
        s.wait_all(1, [5, 6])
        assert set(s.core.resident_experts(1)) == {0, 1, 5, 6}
        assert totals(s)["hits"] == hits
        with pytest.raises(ValueError, match="needs 5 slots"):
            s.begin_layer(1, [7, 8, 9], keep=[0, 1])


def test_unused_prefetch_is_worth_zero_and_predictions_are_protected(model: Path) -> None:
    with streamer(model, 4, io_threads=1) as s:
        for e in (0, 1, 2):
            s.begin_token()
            s.begin_layer(1, [e, e])
            s.wait(1, e)
        s.begin_token()
        s.predict(1, [5], 1)  # loads 5 into the empty fourth slot, worth 0 until used
        _wait_for(lambda: 5 in s.core.resident_experts(1))
        s.begin_layer(1, [6])  # demand: evicts the unused prefetch, not 0..2
        s.wait(1, 6)
        assert set(s.core.resident_experts(1)) == {0, 1, 2, 6}
        assert totals(s)["prefetch_wasted"] == 1
        # A prefetch never evicts an expert predicted for a layer that has not run yet this token.
        s.begin_token()
        s.predict(2, [0, 1, 2, 3], 1)
        _wait_for(lambda: sorted(s.core.resident_experts(2)) == [0, 1, 2, 3])
        s.predict(2, [7], 2)  # every slot holds a protected prediction: dropped, nothing evicted
        _wait_for(lambda: totals(s)["prefetch_dropped"] == 1)
        assert sorted(s.core.resident_experts(2)) == [0, 1, 2, 3]


def _wait_for(cond: object, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():  # type: ignore[operator]
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.002)


@pytest.mark.parametrize("io_threads", [1, 4])
def test_cancel_and_promote(repacked_factory: ModelFactory, io_threads: int) -> None:
    # The I/O threads start one read, then hold (a test-only control of the core): expert 0's prefetch is
    # under way when its layer starts, whatever the speed of the drive and of this machine.
    big = repacked_factory(type="F32", n_layer=2, n_embd=1024, n_ff_exp=256, n_expert=8, n_expert_used=2)
    with ModelFile.open(str(big)) as mf:
        want = {e: mf.read_expert(1, e) for e in range(8)}
        settings = StreamSettings(verify=True, chunk_kib=4, io_threads=io_threads, idle_fill_ms=-1, prefetch_votes=1)
        with ExpertStreamer(mf, 4, settings) as s:
            s.core.hold_io_after(1)
            s.begin_token()
            s.predict(1, [0, 1, 2, 3], 1)
            _wait_for(lambda: totals(s)["prefetch_issued"] == 1)  # 0 got a slot and its first read
            s.begin_layer(1, [0, 5])  # 0 is being prefetched: promoted; 1..3, never started, are cancelled
            t = totals(s)
            assert (t["prefetch_issued"], t["prefetch_promoted"], t["prefetch_cancelled"]) == (1, 1, 3)
            s.core.hold_io_after(-1)
            for e in (0, 5):
                assert s.expert_bytes(1, s.wait(1, e)).tobytes() == want[e]
            assert set(s.core.resident_experts(1)) <= {0, 5, -1}  # cancelled slots were freed
            assert s.core.queue_depths() == [0, 0, 0, 0, 0]


def test_cancel_of_a_prefetch_under_way(repacked_factory: ModelFactory) -> None:
    """A started prefetch the router did not select is cancelled too: its slot is freed once its read lands."""
    big = repacked_factory(type="F32", n_layer=2, n_embd=1024, n_ff_exp=256, n_expert=8, n_expert_used=2)
    with ModelFile.open(str(big)) as mf:
        want = mf.read_expert(1, 5)
        settings = StreamSettings(verify=True, chunk_kib=4, io_threads=1, idle_fill_ms=-1, prefetch_votes=1)
        with ExpertStreamer(mf, 4, settings) as s:
            s.core.hold_io_after(1)
            s.begin_token()
            s.predict(1, [0], 1)
            _wait_for(lambda: totals(s)["prefetch_issued"] == 1)
            s.begin_layer(1, [5])
            assert totals(s)["prefetch_cancelled"] == 1 and totals(s)["prefetch_promoted"] == 0
            s.core.hold_io_after(-1)
            assert s.expert_bytes(1, s.wait(1, 5)).tobytes() == want
            _wait_for(lambda: s.core.queue_depths() == [0, 0, 0, 0, 0])
            assert set(s.core.resident_experts(1)) <= {5, -1}


def test_scheduler_caps(model: Path) -> None:
    """Never more than 2 prefetch chunks started while a demand read is in service, 4 otherwise."""
    rng = np.random.default_rng(5)
    with streamer(model, 8, io_threads=8, chunk_kib=4) as s:
        for _ in range(30):
            s.begin_token()
            for layer in range(4):
                for d in (1, 2):
                    if layer + d < 4:
                        s.predict(layer + d, rng.choice(16, 4, replace=False).tolist(), d)
                sel = rng.choice(16, 4, replace=False).tolist()
                s.begin_layer(layer, sel)
                for e in sel:
                    s.wait(layer, e)
        busy, idle, demand = s.core.scheduler_marks()
        t = totals(s)
    assert t["prefetch_issued"] > 0 and t["demand_reads"] > 0
    assert busy <= 2 and idle <= 4 and demand >= 1


def test_loans(model: Path) -> None:
    with streamer(model, 6) as s:
        record = s.index.layers[0].record_size
        s.begin_token()
        for layer in range(4):
            s.begin_layer(layer, [0, 1, 2, 3])
            for e in range(4):
                s.wait(layer, e)
            s.end_layer(layer)
        s.begin_token()
        s.begin_layer(0, [0])  # expert 0 of layer 0 becomes the hottest
        s.wait(0, 0)
        s.end_layer(0)
        got = s.core.loan(9 * record, 2)  # the 8 empty slots first, then the coldest expert
        assert got == 9 * record == s.core.loaned_bytes
        resident = [s.core.resident_experts(layer) for layer in range(4)]
        assert sum(e >= 0 for r in resident for e in r) == 15
        assert 0 in resident[0] and 1 not in resident[0]
        with pytest.raises(ValueError, match="needs 6 slots but has 4"):
            s.begin_layer(1, [0, 1, 2, 3, 4, 5])
        assert s.core.loan(1 << 30, 2) == 7 * record  # down to 2 slots in every layer, never fewer
        s.core.unloan()
        assert s.core.loaned_bytes == 0
        s.begin_layer(1, [10, 11, 12, 13, 14, 15])
        for e in range(10, 16):
            s.wait(1, e)


def test_idle_fill(model: Path) -> None:
    with streamer(model, 6, idle_fill_ms=50) as s:
        s.begin_token()
        s.begin_layer(2, [9])
        s.wait(2, 9)
        s.core.set_usage(s.li(2), [3, 9, 4, 5, 6, 7, 8])
        s.begin_token()  # activity: the idle clock restarts
        _wait_for(lambda: totals(s)["idle_fills"] == 5)
        _wait_for(lambda: sorted(s.core.resident_experts(2)) == [3, 4, 5, 6, 7, 9])
        assert all(e == -1 for e in s.core.resident_experts(1))  # no usage table there: nothing filled


@pytest.mark.parametrize("engine", ENGINES)
def test_errors_are_clean(model: Path, tmp_path: Path, expected: dict[tuple[int, int], bytes], engine: str) -> None:
    with pytest.raises(BadInputError, match="zero slots"):
        streamer(model, 0)
    with streamer(model, 4, io_engine=engine) as s:
        s.begin_token()
        with pytest.raises(IndexError, match="no expert 16"):
            s.begin_layer(0, [16])
        with pytest.raises(IndexError, match="no expert -1"):
            s.predict(1, [-1], 1)
        with pytest.raises(RuntimeError, match="was not selected"):
            s.wait(0, 3)
        with pytest.raises(ValueError, match="needs 5 slots"):
            s.begin_layer(0, [0, 1, 2, 3, 4])
    # A file truncated after open: the read fails cleanly, other layers keep working.
    copy = tmp_path / "t.tw.gguf"
    shutil.copyfile(model, copy)
    with ModelFile.open(str(copy)) as mf:
        last = mf.index.layers[-1]
        s = ExpertStreamer(mf, 4, StreamSettings(verify=True, idle_fill_ms=-1, io_engine=engine))
    with s:
        os.truncate(copy, last.offset)
        s.begin_token()
        s.begin_layer(3, [1])
        with pytest.raises(OSError, match="truncated or replaced"):
            s.wait(3, 1)
        assert totals(s)["read_errors"] >= 1
        s.begin_layer(0, [1])
        assert s.expert_bytes(0, s.wait(0, 1)).tobytes() == expected[(0, 1)]
    # A file replaced after open: the open file is still read, never the new bytes.
    shutil.copyfile(model, copy)
    with ModelFile.open(str(copy)) as mf:
        s = ExpertStreamer(mf, 4, StreamSettings(verify=True, idle_fill_ms=-1, io_engine=engine))
    with s:
        (tmp_path / "junk").write_bytes(os.urandom(copy.stat().st_size))
        os.replace(tmp_path / "junk", copy)
        s.begin_token()
        s.begin_layer(2, [7])
        assert s.expert_bytes(2, s.wait(2, 7)).tobytes() == expected[(2, 7)]


def test_closed_core_refuses(model: Path) -> None:
    s = streamer(model, 4)
    s.close()
    with pytest.raises(OSError, match="closed"):
        s.begin_token()
    s.close()  # twice is fine


@pytest.mark.parametrize("engine", ENGINES)
def test_stress_many_threads(model: Path, expected: dict[tuple[int, int], bytes], engine: str) -> None:
    """Requesting, predicting, waiting, loaning and evicting from several threads at once."""
    errors: list[BaseException] = []
    stop = time.monotonic() + 3.0
    with streamer(model, 6, io_threads=8, chunk_kib=4, idle_fill_ms=5, io_engine=engine, split_demand=True) as s:
        for layer in range(4):
            s.core.set_usage(s.li(layer), list(range(16)))

        def compute(layers: list[int], seed: int) -> None:
            rng = np.random.default_rng(seed)
            try:
                while time.monotonic() < stop:
                    for layer in layers:
                        sel = rng.choice(16, 4, replace=False).tolist()
                        s.begin_layer(layer, sel)
                        for e in rng.permutation(sel):
                            slot = s.wait(layer, int(e))
                            assert s.expert_bytes(layer, slot).tobytes() == expected[(layer, int(e))]
                        s.end_layer(layer)
            except BaseException as e:
                errors.append(e)

        def churn(seed: int) -> None:
            rng = np.random.default_rng(seed)
            try:
                while time.monotonic() < stop:
                    s.begin_token(int(rng.integers(0, 3)))
                    s.predict(int(rng.integers(0, 4)), rng.choice(16, 4, replace=False).tolist(), 1)
                    s.read_known(int(rng.integers(0, 4)), rng.choice(16, 2, replace=False).tolist())
                    s.counters()
                    s.core.queue_depths()
                    s.core.loan(int(rng.integers(0, 8)) * s.index.layers[0].record_size, 4)
                    time.sleep(0.001)
                    s.core.unloan()
            except BaseException as e:
                errors.append(e)

        threads = [
            threading.Thread(target=compute, args=([0, 1], 1)),
            threading.Thread(target=compute, args=([2, 3], 2)),
            threading.Thread(target=churn, args=(3,)),
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors, errors[0]
        assert totals(s)["read_errors"] == 0
        # prefetches and idle fills still in flight settle: nothing is stuck in service
        _wait_for(lambda: s.core.queue_depths() == [0, 0, 0, 0, 0])
