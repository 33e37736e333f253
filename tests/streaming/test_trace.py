"""Trace replay: Belady is exact and a lower bound, the synthetic generator does what it says, the CLI."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.conftest import assert_clean_error, run_cli
from tokenwing.streaming.trace import Trace, load_trace, prediction_recall, simulate, synthetic_trace


def make_trace(seq: list[list[int]], n_expert: int) -> Trace:
    """One layer; seq[t] = the experts token t selects."""
    k = max(len(s) for s in seq)
    sel = np.full((len(seq), 1, k), -1, np.int32)
    for t, s in enumerate(seq):
        sel[t, 0, : len(s)] = s
    return Trace(
        sel, np.zeros((len(seq), 1, 0, k), np.int32), np.zeros(len(seq), np.int64), np.zeros(1, np.int32), n_expert
    )


def brute_force_min_misses(seq: list[int], slots: int) -> int:
    """The true optimum for one expert per token, by trying every eviction choice."""

    @functools.cache
    def best(i: int, cache: frozenset[int]) -> int:
        if i == len(seq):
            return 0
        e = seq[i]
        if e in cache:
            return best(i + 1, cache)
        if len(cache) < slots:
            return 1 + best(i + 1, cache | {e})
        return 1 + min(best(i + 1, (cache - {v}) | {e}) for v in cache)

    return best(0, frozenset())


def test_known_sequences() -> None:
    t = make_trace([[0], [1], [2], [0], [1]], 3)
    assert simulate(t, 2, "belady")["misses"] == 4
    assert simulate(t, 2, "lru")["misses"] == 5
    freq = make_trace([[0], [0], [0], [1], [2], [0]], 3)
    assert simulate(freq, 2, "lru")["misses"] == 4  # evicts 0 for 2
    assert simulate(freq, 2, "decay")["misses"] == 3  # keeps the frequent 0


@settings(max_examples=200, deadline=None)
@given(seq=st.lists(st.integers(0, 5), min_size=1, max_size=12), slots=st.integers(1, 4))
def test_belady_is_the_optimum(seq: list[int], slots: int) -> None:
    t = make_trace([[e] for e in seq], 6)
    b = simulate(t, slots, "belady")["misses"]
    assert b == brute_force_min_misses(seq, slots)
    assert b <= simulate(t, slots, "lru")["misses"]
    assert b <= simulate(t, slots, "decay")["misses"]
    assert b <= simulate(t, slots, "history")["misses"]


@settings(max_examples=50, deadline=None)
@given(seed=st.integers(0, 10_000), slots=st.integers(2, 12))
def test_belady_bounds_every_policy_with_top_k(seed: int, slots: int) -> None:
    t = synthetic_trace(60, 2, 12, 2, zipf=1.0, locality=0.3, seed=seed)
    b = simulate(t, slots, "belady")
    for p in ("decay", "history", "lru"):
        r = simulate(t, slots, p)
        assert b["misses"] <= r["misses"]
        assert r["hits"] + r["misses"] == b["hits"] + b["misses"] == 60 * 2 * 2


def test_synthetic_trace_properties() -> None:
    t = synthetic_trace(400, 3, 64, 6, zipf=1.2, locality=0.5, recall=(0.75, 0.6), seed=1)
    assert t.selected.shape == (400, 3, 6) and t.predicted.shape == (400, 3, 2, 6)
    for row in t.selected.reshape(-1, 6):
        assert len(set(row.tolist())) == 6  # k distinct experts
    r1, r2 = prediction_recall(t)
    assert abs(r1 - 0.75) < 0.03 and abs(r2 - 0.6) < 0.03
    # temporal locality: consecutive tokens share about locality·k experts (plus chance)
    shared = np.mean([len(set(t.selected[i, 0]) & set(t.selected[i - 1, 0])) for i in range(1, 400)])
    assert 0.5 * 6 <= shared <= 0.5 * 6 + 1.5
    # skew: the most used expert is used far more than the median one
    counts = np.bincount(t.selected[:, 0].ravel(), minlength=64)
    assert counts.max() > 5 * np.median(counts)


def test_prefetch_replay_cuts_misses() -> None:
    t = synthetic_trace(300, 6, 64, 4, seed=2)
    plain = simulate(t, 16, "decay")
    pre = simulate(t, 16, "decay", prefetch=True)
    assert pre["misses"] < plain["misses"]
    assert pre["prefetch_reads"] > 0 and pre["prefetch_used"] > 0


def test_a_warm_cache_is_where_the_replay_starts() -> None:
    """Belady and the policies start from the experts the cache held when decoding began (the engine's own
    state after its prompt), not from an empty cache."""
    t = make_trace([[1], [2], [1], [2], [3]], 4)
    warm = np.array([[1, 2]], np.int32)
    assert simulate(t, 2, "belady")["misses"] == 3
    assert simulate(t, 2, "belady", initial=warm)["misses"] == 1  # only 3
    assert simulate(t, 2, "history", initial=warm)["misses"] == 1
    assert simulate(t, 2, "belady", initial=np.array([[0, 1]], np.int32))["misses"] == 2


def test_prefetch_votes_read_only_confirmed_predictions() -> None:
    """Layer 1 is predicted from 2 layers away (0 and 1) and from 1 layer away (0 and 2): with 2 votes only 0,
    named by both, is read ahead; with 1 vote, all three."""
    sel = np.array([[[5, -1], [0, -1]]], np.int32)  # one token, 2 layers: layer 0 selects 5, layer 1 selects 0
    pred = np.full((1, 2, 2, 2), -1, np.int32)
    pred[0, 1, 0] = [0, 2]  # for layer 1, 1 layer ahead (made by layer 0)
    pred[0, 1, 1] = [0, 1]  # 2 layers ahead (before the token)
    t = Trace(sel, pred, np.zeros(1, np.int64), np.arange(2, dtype=np.int32), 8)
    one = simulate(t, 4, "history", prefetch=True, prefetch_votes=1)
    two = simulate(t, 4, "history", prefetch=True, prefetch_votes=2)
    assert (one["prefetch_reads"], one["prefetch_used"]) == (3, 1)  # 1 and 2 read for nothing
    assert (two["prefetch_reads"], two["prefetch_used"], two["misses"]) == (1, 1, 1)  # 0 read ahead; 5 missed
    pred[0, 1, 1] = -1  # a layer with a single predictor: its predictions need one vote only (as in the core)
    t = Trace(sel, pred, np.zeros(1, np.int64), np.arange(2, dtype=np.int32), 8)
    assert simulate(t, 4, "history", prefetch=True, prefetch_votes=2)["prefetch_reads"] == 2


def test_history_beats_decay_on_synthetic_routing() -> None:
    """The counts kept through evictions cut misses on Zipf-skewed routing (docs/results.md has the table)."""
    t = synthetic_trace(1500, 2, 64, 4, zipf=1.0, locality=0.3, seed=4)
    assert simulate(t, 16, "history")["misses"] < simulate(t, 16, "decay")["misses"]


def test_cli(tmp_path: Path) -> None:
    path = tmp_path / "t.npz"
    r = run_cli("trace", "synth", str(path), "--tokens", "200", "--layers", "3", "--experts", "32", "--k", "4")
    assert r.returncode == 0, r.stderr
    r = run_cli("trace", "simulate", str(path), "--slots", "25%")
    assert r.returncode == 0, r.stderr
    assert "decay" in r.stdout and "lru" in r.stdout and "x Belady" in r.stdout
    r = run_cli("trace", "simulate", str(path), "--slots", "8", "--json", "--prefetch", "--policy", "decay")
    out = json.loads(r.stdout)
    assert out["results"][0]["slots"] == 8 and out["results"][0]["prefetch"] is True
    assert len(out["prediction_recall"]) == 2
    assert load_trace(str(path)).n_tokens == 200


@pytest.mark.parametrize("content", [b"", b"not a zip", b"PK\x03\x04garbage"])
def test_bad_trace_files(tmp_path: Path, content: bytes) -> None:
    p = tmp_path / "bad.npz"
    p.write_bytes(content)
    assert_clean_error(run_cli("trace", "simulate", str(p), "--slots", "4"), 2)


def test_bad_slots(tmp_path: Path) -> None:
    path = tmp_path / "t.npz"
    synthetic_trace(10, 1, 8, 4).save(str(path))
    assert_clean_error(run_cli("trace", "simulate", str(path), "--slots", "2"), 2)
    assert_clean_error(run_cli("trace", "simulate", str(path), "--slots", "lots"), 2)
