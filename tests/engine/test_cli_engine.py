"""`tokenwing run` and `tokenwing logits` end to end, as real subprocesses."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import ModelFactory, assert_clean_error, run_cli
from tests.format.test_hostile_header import set_int
from tokenwing.runtime.generate import STEADY_MIN_STEPS, steady_rate
from tokenwing.streaming.settings import StreamSettings
from tokenwing.streaming.trace import load_trace


def test_run_with_stats_and_trace(repacked_factory: ModelFactory, tmp_path: Path) -> None:
    model = repacked_factory(type="Q8_0", n_layer=3)
    stats, trace = tmp_path / "s.json", tmp_path / "t.npz"
    r = run_cli(
        "run",
        str(model),
        "--prompt",
        "Hello there",
        "-n",
        "12",
        "--ram-budget",
        "30%",
        "--stats-json",
        str(stats),
        "--record-trace",
        str(trace),
        "--chat",
    )
    assert r.returncode == 0, r.stderr
    assert "decode" in r.stderr and "tok/s" in r.stderr
    st = json.loads(stats.read_text())
    assert st["decode_tokens"] <= 12 and st["prompt_tokens"] > 0
    assert 0.0 <= st["hit_rate"] <= 1.0 and len(st["hit_rate_per_layer"]) == 3
    assert st["slots_per_layer"] == 2  # 30 % of 8 experts is below top-2... raised to the minimum
    if st["decode_tokens"] > STEADY_MIN_STEPS:  # the later half's rate and wait, beside the whole run's
        assert st["decode_steady_tokens_per_s"] > 0 and st["ssd_wait_ms_per_token_steady"] >= 0
    t = load_trace(str(trace))
    assert t.selected.shape[1:] == (3, 2) and t.n_tokens >= 2  # the prompt batch, then decode steps
    assert t.prompt_tokens[0] > 0 and (t.prompt_tokens[1:] == 0).all()
    r = run_cli("trace", "simulate", str(trace), "--slots", "2")
    assert r.returncode == 0, r.stderr


def test_the_steady_rate_leaves_the_first_half_of_the_steps_out() -> None:
    """Four steps, the first two slow (1 s each, 3 ms of SSD wait) and the last two at 10 a second with none:
    the steady rate is 10 tok/s with no wait, where the whole run's is 4 tokens in 2.2 s."""
    marks = [(1.0, 3_000_000), (2.0, 6_000_000), (2.1, 6_000_000), (2.2, 6_000_000)]
    rate = steady_rate(marks)
    assert rate is not None and rate[0] == pytest.approx(10.0) and rate[1] == 0.0
    assert steady_rate(marks[:3]) is None  # too few steps to leave any out


def test_seeded_run_is_reproducible(repacked_factory: ModelFactory) -> None:
    model = repacked_factory(type="Q4_0")

    def text(seed: str) -> str:
        r = run_cli("run", str(model), "--prompt", "Once", "-n", "10", "--temp", "0.9", "--seed", seed)
        assert r.returncode == 0 and r.stdout.strip(), r.stderr  # two failed runs print the same nothing
        return r.stdout

    first = text("3")
    assert text("3") == first
    assert text("4") != first  # and the seed is what decides the text


def test_logits_command(repacked_factory: ModelFactory, tmp_path: Path) -> None:
    model = repacked_factory(type="F32")
    np.save(tmp_path / "t.npy", np.arange(3, 20))
    r = run_cli(
        "logits", str(model), "--tokens", str(tmp_path / "t.npy"), "--out", str(tmp_path / "o.npy"), "--kv-type", "f32"
    )
    assert r.returncode == 0, r.stderr
    out = np.load(tmp_path / "o.npy")
    assert out.shape == (17, 512) and np.isfinite(out).all()


def test_engine_errors_are_one_line(
    model_factory: ModelFactory, repacked_factory: ModelFactory, tmp_path: Path
) -> None:
    assert_clean_error(run_cli("run", str(model_factory()), "--prompt", "x"), 2)  # a plain GGUF
    model = str(repacked_factory())
    assert_clean_error(run_cli("run", model, "--prompt", ""), 2)
    assert_clean_error(run_cli("run", model, "--prompt", "x", "--ram-budget", "lots"), 2)
    assert_clean_error(run_cli("run", model, "--prompt", "x", "--top-p", "0"), 2)
    np.save(tmp_path / "bad.npy", np.array([1, 2, 99999]))
    assert_clean_error(
        run_cli("logits", model, "--tokens", str(tmp_path / "bad.npy"), "--out", str(tmp_path / "o.npy")), 2
    )
    assert not (tmp_path / "o.npy").exists()


def test_inconsistent_shapes_stop_cleanly(
    model_factory: ModelFactory, repacked_factory: ModelFactory, tmp_path: Path
) -> None:
    """Metadata that contradicts the tensors (valid checksums: a re-signed model file) is refused before ggml could
    abort on it; `repack` refuses such a source in the same line (tests/format/test_family_headers.py)."""
    src = set_int(model_factory(), tmp_path / "m.gguf", "qwen3moe.attention.head_count", 8)  # the tensors: 4
    out = set_int(repacked_factory(), tmp_path / "m.tw.gguf", "qwen3moe.attention.head_count", 8)
    repacked = run_cli("repack", str(src), "-o", str(tmp_path / "out.tw.gguf"), "-q")
    for r in (repacked, run_cli("run", str(out), "--prompt", "hello")):
        assert_clean_error(r, 2)
        assert "attn_q.weight has shape" in r.stderr


def test_variants_llama_cpp_computes_unlike_the_model_are_refused(repacked_factory: ModelFactory) -> None:
    """A GLM-4.5 file without shared experts loads in llama.cpp, which then adds silu(FFN input) where the shared
    expert's output should be (KL 0.07 against our reading): there is no reference for such a file, so the
    engine refuses it with one line instead of running something else."""
    model = repacked_factory(arch="glm4moe", type="Q8_0", n_layer=3, n_dense_lead=1, n_shared_exp=0)
    r = run_cli("run", str(model), "--prompt", "hello")
    assert_clean_error(r, 4)
    assert "glm4moe model without shared experts is not run" in r.stderr
    ok = repacked_factory(arch="glm4moe", type="Q8_0", n_layer=3, n_dense_lead=1, n_shared_exp=1)
    assert run_cli("run", str(ok), "--prompt", "hello", "-n", "2").returncode == 0


def test_prefill_reads_each_expert_at_most_once(repacked_factory: ModelFactory) -> None:
    """Layer-major prefill: a 300-token prompt (5 batches) with the smallest cache reads each distinct
    expert of each layer exactly once, in waves."""
    from tokenwing.runtime.session import Session, SessionOptions
    from tokenwing.streaming.streamer import COUNTERS

    model = repacked_factory(type="Q8_0", n_layer=3, n_expert=16, n_expert_used=4)
    # (no idle fill: a pause of the machine mid-prompt would let it read experts, and this counts reads)
    opts = SessionOptions(n_ctx=512, ram_budget=1, max_batch=64, stream=StreamSettings(idle_fill_ms=-1))
    s = Session(str(model), opts, log=lambda line: None)
    try:
        s.trace = []
        tokens = np.random.default_rng(0).integers(0, 500, 300).tolist()
        s.forward(tokens)
        reads = s.counters()[:, COUNTERS.index("demand_reads")]
        assert s.slots_per_layer == 4
    finally:
        s.close()
    sel_all = s.trace[0][0]  # (tokens, layers, k) of the prompt
    distinct = [len(np.unique(sel_all[:, li])) for li in range(3)]
    assert distinct[0] > s.slots_per_layer  # more experts than slots: waves were needed
    assert reads.tolist() == distinct


def test_read_ahead_window_reads_each_expert_once_and_changes_nothing(
    repacked_factory: ModelFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """From READ_AHEAD_TOKENS (here lowered to 200), while a layer computes, the next layers' most used experts
    are read ahead into half their slots; the waves then keep them in RAM until their turn: every distinct
    expert of a layer is still read once (demand or read ahead), and the logits are those of the run without
    the window and of the run with every expert resident."""
    import tokenwing.runtime.scheduler as scheduler_module
    from tokenwing.format.reader import ModelFile
    from tokenwing.runtime.session import Session, SessionOptions
    from tokenwing.streaming.streamer import COUNTERS

    model = repacked_factory(type="Q8_0", n_layer=3, n_expert=16, n_expert_used=4)
    with ModelFile.open(str(model)) as mf:
        budget = 8 * sum(el.record_size for el in mf.index.layers)  # 8 of 16 experts per layer
    tokens = np.random.default_rng(3).integers(0, 500, 300).tolist()
    c = {name: i for i, name in enumerate(COUNTERS)}

    def prompt(threshold: int, **opts: object) -> tuple[np.ndarray, np.ndarray, Session]:
        monkeypatch.setattr(scheduler_module, "READ_AHEAD_TOKENS", threshold)
        # (no idle fill: a pause of the machine mid-prompt would let it read experts, and this counts reads)
        options = SessionOptions(n_ctx=512, max_batch=64, stream=StreamSettings(idle_fill_ms=-1), **opts)  # type: ignore[arg-type]
        s = Session(str(model), options, log=lambda line: None)
        try:
            s.trace = []
            logits = s.forward(tokens, all_logits=True)
            return logits, s.counters(), s
        finally:
            s.close()

    logits, counts, s = prompt(200, ram_budget=budget)
    assert s.slots_per_layer == 8
    distinct = [len(np.unique(s.trace[0][0][:, li])) for li in range(3)]
    assert distinct == [16, 16, 16]  # more experts than slots: waves
    read_ahead = counts[:, c["prefetch_issued"]]
    assert read_ahead[0] == 0 and read_ahead[1] > 0 and read_ahead[2] > 0  # no layer before the first one
    assert (counts[:, c["prefetch_used"]] == read_ahead).all()
    assert (counts[:, c["demand_reads"]] + read_ahead).tolist() == distinct
    off, off_counts, _ = prompt(10**9, ram_budget=budget)
    assert off_counts[:, c["prefetch_issued"]].sum() == 0
    assert np.array_equal(logits, off)
    resident, _, _ = prompt(200)
    assert np.array_equal(logits, resident)


def test_prompt_borrows_slots_and_returns_them(repacked_factory: ModelFactory) -> None:
    """A prompt's working memory comes out of the expert cache (slots on loan) and goes back at the first
    decode token; the output does not change."""
    from tokenwing.runtime.session import Session, SessionOptions

    model = repacked_factory(type="Q8_0", n_layer=3, n_expert=16, n_expert_used=4)
    tokens = np.random.default_rng(1).integers(0, 500, 120).tolist()
    # prompt_memory=0: no free memory beyond the cache, as under a tight memory limit
    ref = Session(str(model), SessionOptions(n_ctx=256, max_batch=8, prompt_memory=0), log=lambda line: None)
    try:
        want = ref.forward(tokens, all_logits=True)
        assert ref.scheduler.loaned_bytes > 0  # 120 tokens need more than the 8-token reserve
        assert ref.scheduler.slot_map is None  # experts may be evicted: no one-graph decode step until they are back
        want_step = ref.forward([5])
        assert ref.scheduler.loaned_bytes == 0
        assert ref._token_graph is not None  # the evicted experts were read back: one graph per token again
    finally:
        ref.close()
    # the same prompt with the smallest cache (waves) gives the same logits, loans or not
    small = Session(
        str(model), SessionOptions(n_ctx=256, max_batch=8, ram_budget=1, prompt_memory=1 << 30), log=lambda line: None
    )
    try:
        assert np.array_equal(small.forward(tokens, all_logits=True), want)
        assert np.array_equal(small.forward([5]), want_step)
    finally:
        small.close()
    whole = Session(str(model), SessionOptions(n_ctx=256, max_batch=128), log=lambda line: None)
    try:
        whole.forward(tokens)
        assert whole.scheduler.loaned_bytes == 0  # one batch fits the reserve: nothing to borrow
    finally:
        whole.close()


def test_prompt_leaves_the_experts_its_end_used_in_the_cache(
    repacked_factory: ModelFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Waves run in recency order: after a prompt, the experts its end used most are the ones left in RAM.

    With a half-life of a hundredth of a token, "used most by the end" is exactly the last token's experts."""
    import tokenwing.runtime.scheduler as scheduler_module
    from tokenwing.runtime.session import Session, SessionOptions

    monkeypatch.setattr(scheduler_module, "RECENCY_HALF_LIFE", 0.01)

    model = repacked_factory(type="Q8_0", n_layer=3, n_expert=32, n_expert_used=4)
    tokens = np.random.default_rng(7).integers(0, 500, 200).tolist()
    s = Session(str(model), SessionOptions(n_ctx=256, ram_budget=1, max_batch=64), log=lambda line: None)
    try:
        s.trace = []
        s.forward(tokens)
        last = s.trace[-1][0][-1]  # [layers, k]: the experts the prompt's last token chose, per layer
        for li, layer in enumerate(s.streamed):
            resident = s.scheduler.holds(layer, last[li].tolist())
            assert all(resident), (layer, last[li], resident)  # the last wave held them, and it stays
    finally:
        s.close()


def test_info_json_reports_engine_facts(repacked_factory: ModelFactory) -> None:
    """`tokenwing info --json`: what the app asks the engine instead of keeping copies."""
    from tokenwing.models import supported_architectures
    from tokenwing.runtime.vram.experts import SWAP_EVERY, SWAP_MAX
    from tokenwing.streaming.memory import HEADROOM

    model = repacked_factory(type="Q8_0")
    r = run_cli("info", "--json", "--drive", str(model), "--probe-bytes", "4M")
    assert r.returncode == 0, r.stderr
    info = json.loads(r.stdout)
    assert sorted(info["architectures"]) == supported_architectures()
    assert {"qwen3moe", "glm4moe"} <= set(info["architectures"])
    types = info["architectures"]["qwen3moe"]["weight_types"]
    assert {"F32", "Q8_0", "Q4_K", "MXFP4"} <= set(types) and "I32" not in types
    assert info["headroom_bytes"] == HEADROOM
    assert info["vram_swaps"] == {"every_tokens": SWAP_EVERY, "max_experts": SWAP_MAX}
    m = info["memory"]
    assert 0 < m["usable"] <= m["available"] <= m["total"] and m["limit"] <= m["total"]
    assert info["devices"][0]["kind"] == "cpu" and info["devices"][0]["cores"] >= 1
    assert info["drive"]["mb_per_s_by_threads"]["8"] > 0
    text = run_cli("info")
    assert text.returncode == 0 and "qwen3moe" in text.stdout and "headroom" in text.stdout


def test_first_streamed_layer_is_predicted_from_the_dense_layers(repacked_factory: ModelFactory) -> None:
    """The layers before the first streamed one are dense (no router of their own): they still apply the next
    streamed layers' routers to their output, so the first streamed layer's experts are predicted too."""
    from tokenwing.runtime.session import Session, SessionOptions

    model = repacked_factory(
        arch="glm4moe", type="Q8_0", n_layer=4, n_dense_lead=1, n_shared_exp=1, n_expert=16, n_expert_used=4
    )
    tokens = np.random.default_rng(5).integers(0, 500, 40).tolist()
    s = Session(str(model), SessionOptions(n_ctx=256, ram_budget=1, lookahead=2), log=lambda line: None)
    try:
        s.trace = []
        s.forward(tokens[:20])
        for t in tokens[20:]:
            s.forward([t])
        trace = s.recorded_trace()
        recall = s.stats()["prediction_recall"]
    finally:
        s.close()
    assert s.streamed[0] == 1
    decode = trace.prompt_tokens == 0
    first = trace.predicted[decode, 0]  # [tokens, distance, k] for the first streamed layer
    assert (first[:, 0] >= 0).all()  # predicted one layer ahead, by the dense layer 0
    assert (first[:, 1] == -1).all()  # nothing two layers before it
    assert (trace.predicted[decode, 1, 1] >= 0).all()  # layer 2, two ahead of the dense layer
    assert recall[0] is not None and recall[0] > 0
