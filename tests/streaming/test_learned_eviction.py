"""The learned eviction policy (issue 43): its model file, its features against the core's, what training buys on
held-out routing, and the engine under it (bit-identical to resident; the simulator's reads)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import ModelFactory, assert_clean_error, run_cli
from tokenwing.errors import BadInputError
from tokenwing.format.reader import ModelFile
from tokenwing.fsutil import parse_size
from tokenwing.runtime.session import Session, SessionOptions
from tokenwing.streaming.eviction_model import EvictionModel, load_model
from tokenwing.streaming.learned import features, fit, retrain, score
from tokenwing.streaming.settings import StreamSettings
from tokenwing.streaming.trace import Trace, load_trace, simulate, synthetic_trace


def phased(seeds: range, tokens: int = 100) -> Trace:
    """Routing whose popular experts change every `tokens` tokens (a new text's topic): one synthetic trace per
    seed, back to back. A long memory (history) keeps the old topic's experts; recency alone forgets counts."""
    parts = [synthetic_trace(tokens, 2, 32, 4, zipf=1.5, locality=0.3, seed=s) for s in seeds]
    return Trace(
        np.concatenate([p.selected for p in parts]),
        np.concatenate([p.predicted for p in parts]),
        np.concatenate([p.prompt_tokens for p in parts]),
        parts[0].layers,
        32,
    )


def test_the_shipped_model_loads_and_scores() -> None:
    m = load_model()
    assert len(m.weights) == len(m.half_lives) + 1 and m.recipe.startswith("python bench/train_eviction.py")
    flat = m.core_weights()
    assert flat[0] == len(m.half_lives) and len(flat) == 2 * len(m.half_lives) + 2
    trace = synthetic_trace(50, 2, 16, 4, seed=1)
    s = score(m, features(trace, m.half_lives))
    assert s.shape == (50, 2, 16) and np.isfinite(s).all()
    # Expert 0 used in every token scores above 5, used once long ago, and 7, never used: the model keeps what
    # comes back.
    sel = np.array([[[0, 5]]] + [[[0, 1 + t % 4]] for t in range(39)], np.int32)
    steady = Trace(sel, np.zeros((40, 1, 0, 2), np.int32), np.zeros(40, np.int64), np.zeros(1, np.int32), 8)
    last = score(m, features(steady, m.half_lives))[-1, 0]
    assert last[0] > last[5] > last[7]


def test_a_model_file_round_trips_and_bad_ones_are_refused(tmp_path: Path) -> None:
    m = EvictionModel((4.0, 64.0), (-0.5, 1.0, 2.0), recipe="test")
    m.save(tmp_path / "m.json")
    assert load_model(tmp_path / "m.json") == m
    (tmp_path / "bad.json").write_text(json.dumps({"half_lives": [4.0], "weights": [1.0]}))
    with pytest.raises(BadInputError, match="need 2 weights"):
        load_model(tmp_path / "bad.json")
    (tmp_path / "junk.json").write_text("{")
    with pytest.raises(BadInputError, match="not an eviction model"):
        load_model(tmp_path / "junk.json")


def _replay(trace: Trace, slots: int, scores: np.ndarray) -> int:
    """The demand-read cache written out plainly: the selected experts pinned, the lowest score leaves (prompt rows:
    the least recently used), ties to the least recently used, then the lower expert."""
    misses = 0
    for li in range(trace.selected.shape[1]):
        resident: list[int] = []
        last: dict[int, int] = {}
        tick = 0
        for t in range(trace.n_tokens):
            sel = [int(e) for e in trace.selected[t, li] if e >= 0]
            prompt = trace.prompt_tokens[t] > 0
            for e in sel:
                if e not in resident:
                    misses += 1
                    if len(resident) < slots:
                        resident.append(e)
                    else:
                        others = [r for r in resident if r not in sel]
                        victim = min(others, key=lambda r: (0.0 if prompt else scores[t, li, r], last[r], r))
                        resident[resident.index(victim)] = e
                tick += 1
                last[e] = tick
    return misses


def test_the_core_scores_what_the_features_say() -> None:
    """The core's incremental counts (cache_policy.hpp) and `features` (what training sees) are the same numbers:
    the core's replay under the learned policy misses exactly where a plain replay ranking by `score` does,
    prompt batches (which age the counts by their length) included."""
    trace = synthetic_trace(300, 3, 32, 4, zipf=1.0, locality=0.3, seed=7)
    trace.prompt_tokens[[0, 120, 121]] = [12, 30, 5]
    m = load_model()
    got = simulate(trace, 8, "learned", learned=m.core_weights())["misses"]
    assert got == _replay(trace, 8, score(m, features(trace, m.half_lives)))
    assert got != _replay(trace, 8, -score(m, features(trace, m.half_lives)))


def test_trained_on_routing_it_reads_less_than_history_on_held_out_routing() -> None:
    """Deterministic: trained on one trace whose topic changes, on another (other seeds, never seen) it reads fewer
    experts than history and LRU: the fit learned to weigh recency against long counts."""
    model = fit([phased(range(1, 5))])
    held_out = phased(range(10, 16))
    reads = {p: simulate(held_out, 8, p, learned=model.core_weights())["reads"] for p in ("history", "lru", "learned")}
    assert reads["learned"] < 0.9 * reads["history"] and reads["learned"] < reads["lru"], reads


def test_trace_train_and_simulate_from_the_command_line(tmp_path: Path) -> None:
    phased(range(1, 3)).save(str(tmp_path / "a.npz"))
    phased(range(20, 22)).save(str(tmp_path / "b.npz"))
    r = run_cli("trace", "train", str(tmp_path / "a.npz"), "-o", str(tmp_path / "m.json"))
    assert r.returncode == 0, r.stderr
    assert load_model(tmp_path / "m.json").recipe.startswith("tokenwing trace train")
    r = run_cli("trace", "simulate", str(tmp_path / "b.npz"), "--slots", "25%", "--model", str(tmp_path / "m.json"))
    assert r.returncode == 0 and "learned misses" in r.stdout, r.stderr
    r = run_cli("trace", "train", str(tmp_path / "a.npz"), "-o", "x.json", "--slots", "8")
    assert_clean_error(r, 2)
    assert "--slots must be a percentage" in r.stderr
    r = run_cli("trace", "simulate", str(tmp_path / "b.npz"), "--slots", "8", "--model", str(tmp_path / "a.npz"))
    assert_clean_error(r, 2)
    assert "not an eviction model" in r.stderr


@pytest.fixture(scope="module")
def model(repacked_factory: ModelFactory) -> Path:
    return repacked_factory(type="Q8_0", n_layer=4, n_embd=256, n_ff_exp=64, n_expert=16, n_expert_used=4)


def _decode(model: Path, tokens: list[int], budget: str | None, **stream: object) -> tuple[np.ndarray, Session]:
    with ModelFile.open(str(model)) as mf:
        ram = None if budget is None else parse_size(budget, mf.index.total_bytes)
    settings = StreamSettings(idle_fill_ms=-1, **stream)  # type: ignore[arg-type]
    opts = SessionOptions(ram_budget=ram, lookahead=0, n_ctx=128, kv_type="f32", usage_table=False, stream=settings)
    s = Session(str(model), opts, log=lambda line: None)
    s.trace = []
    logits = np.stack([np.asarray(s.forward([t])).reshape(-1) for t in tokens])
    return logits, s


def test_the_engine_under_the_learned_policy_is_bit_identical_and_reads_what_the_simulator_says(model: Path) -> None:
    tokens = np.random.default_rng(0).integers(0, 200, 40).tolist()
    resident, s0 = _decode(model, tokens, None)
    s0.close()
    capped, s = _decode(model, tokens, "50%", policy="learned")
    try:
        slots = s.slots_per_layer
        assert 6 <= slots < 16  # the cache evicts, and which expert leaves matters (at 4 slots for top-4 it does not)
        trace = s.recorded_trace()
        misses = s.counters()[:, 1].astype(int).tolist()
    finally:
        s.close()
    assert np.array_equal(resident, capped)  # the policy only changes what is read
    sim = simulate(trace, slots, "learned", learned=load_model().core_weights())
    assert misses == sim["per_layer_misses"] and sum(misses) > 0


def test_a_bad_model_file_for_the_engine_is_one_line(model: Path, tmp_path: Path) -> None:
    (tmp_path / "junk.json").write_text("[]")
    r = run_cli(
        *("run", str(model), "--prompt", "hi", "-n", "1", "--ram-budget", "25%"),
        *("--moe-stream-policy", "learned", "--moe-stream-eviction-model", str(tmp_path / "junk.json")),
    )
    assert_clean_error(r, 2)
    assert "not an eviction model" in r.stderr


def test_autotune_retrains_on_this_models_traces_and_keeps_what_reads_less(tmp_path: Path) -> None:
    """Topic-changing routing: fitted on the first halves, learned reads less than history on the second halves,
    so autotune would choose it; the model it keeps is fitted on the whole traces."""
    paths = []
    for i, seeds in enumerate((range(1, 5), range(30, 34))):
        paths.append(str(tmp_path / f"t{i}.npz"))
        phased(seeds).save(paths[-1])
    model, reads = retrain(paths, 8, "test")
    assert reads["learned"] < reads["history"], reads
    assert model.recipe == "test" and model == fit([load_trace(p) for p in paths], slots_share=0.25, recipe="test")
