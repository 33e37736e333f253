"""Prompt caching: a request that starts like the previous one computes only the new tokens, and gets what a
fresh engine would have given."""

from __future__ import annotations

import numpy as np
import pytest

from tests.conftest import ModelFactory
from tests.engine.test_server import Server
from tokenwing.runtime.session import Session, SessionOptions


def _session(model: str) -> Session:
    return Session(model, SessionOptions(kv_type="f32", n_ctx=256, max_batch=16), log=lambda line: None)


def test_reused_prefix_gives_the_logits_of_a_fresh_pass(repacked_factory: ModelFactory) -> None:
    model = str(repacked_factory())  # F32 weights: differences would show
    rng = np.random.default_rng(3)
    first = [int(t) for t in rng.integers(0, 200, 40)]
    second = first[:30] + [int(t) for t in rng.integers(0, 200, 25)]  # shares 30 tokens, then differs

    cached = _session(model)
    cached.forward(first)
    kept = cached.reuse_prefix(second)
    assert kept == 30 and cached.pos == 30 and cached.history == second[:30]
    got = cached.forward(second[kept:], all_logits=True)

    fresh = _session(model)
    want = fresh.forward(second, all_logits=True)[kept:]
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-4)
    assert (got.argmax(-1) == want.argmax(-1)).all()

    # the same prompt again: all but the last token is kept (its logits must be computed)
    assert cached.reuse_prefix(second) == len(second) - 1
    # a prompt that shares nothing: nothing kept
    assert cached.reuse_prefix([second[0] + 1, 5, 6]) == 0 and cached.history == []
    for s in (cached, fresh):
        s.close()


@pytest.mark.parametrize("shape", [{}, {"arch": "bailingmoe3", "n_layer": 4}], ids=["qwen3moe", "ling"])
def test_server_reuses_the_previous_conversation(repacked_factory: ModelFactory, shape: dict[str, object]) -> None:
    """The next turn starts from what the first one left (its prompt is the conversation so far: Ling 3.0's
    recurrent layers from their live state), a regenerated reply from all but the prompt's last token (Ling:
    from the checkpoint one token before its end); the replies are those of a server without prompt caching."""
    model = repacked_factory(type="Q8_0", **shape)
    turn1 = [{"role": "user", "content": "Tell me something about the weather today."}]
    with_cache = Server(model)
    without = Server(model, "--no-prompt-cache")
    try:
        for server in (with_cache, without):
            c = server.client()
            r1 = c.chat.completions.create(model="x", messages=turn1, max_tokens=8, temperature=0)
            turn2 = [*turn1, {"role": "assistant", "content": r1.choices[0].message.content or ""}]
            turn2.append({"role": "user", "content": "And tomorrow?"})
            r2 = c.chat.completions.create(model="x", messages=turn2, max_tokens=8, temperature=0)
            r3 = c.chat.completions.create(model="x", messages=turn2, max_tokens=8, temperature=0)  # regenerate
            server.replies = (r1, r2, r3)  # type: ignore[attr-defined]
        got = [r.choices[0].message.content for r in with_cache.replies]  # type: ignore[attr-defined]
        assert got == [r.choices[0].message.content for r in without.replies]  # type: ignore[attr-defined]
        a1, a2, a3 = (r.model_extra["tokenwing"]["prompt_cached_tokens"] for r in with_cache.replies)  # type: ignore[attr-defined]
        assert with_cache.replies[1].usage is not None  # type: ignore[attr-defined]
        prompt2 = with_cache.replies[1].usage.prompt_tokens  # type: ignore[attr-defined]
        assert a1 == 0 and 0 < a2 < prompt2 and a3 == prompt2 - 1
        assert all(r.model_extra["tokenwing"]["prompt_cached_tokens"] == 0 for r in without.replies)  # type: ignore[attr-defined]
    finally:
        with_cache.stop()
        without.stop()


HYBRIDS = {
    "qwen35moe": {"arch": "qwen35moe", "n_layer": 4},  # gated DeltaNet ×3, gated attention
    "ling": {"arch": "bailingmoe3", "n_layer": 4},  # KDA ×2, MLA ×2
    "kimi-k3": {"arch": "kimi-k3", "n_layer": 6},  # KDA ×3, MLA ×3, the residual's checkpoints every 2 layers
    # gated DeltaNet ×3, QSA attention selecting past 14 cells (blocks of 3; the indexer's keys kept beside K),
    # 4 streams, the n-gram table
    "qwen4exp": {"arch": "qwen4exp", "qsa_ratio": 3, "indexer_top_k": 12, "indexer_n_head": 3},
}


@pytest.mark.parametrize("variant", HYBRIDS)
def test_recurrent_state_resumes_from_checkpoints(repacked_factory: ModelFactory, variant: str) -> None:
    """A linear-attention layer's state cannot be cut back: a prompt that shares part of the last one resumes from
    the longest checkpoint within the shared part (every 32 tokens here, and one token before each prompt's end);
    one that continues the conversation, from the live state. Either way the logits of a fresh pass, to the bit."""
    model = str(repacked_factory(**HYBRIDS[variant]))  # F32 weights: differences would show
    rng = np.random.default_rng(5)
    first = [int(t) for t in rng.integers(0, 500, 120)]
    second = first[:70] + [int(t) for t in rng.integers(0, 500, 50)]
    third = second + [int(t) for t in rng.integers(0, 500, 30)]
    cached, fresh = _hybrid_session(model), _hybrid_session(model)
    try:
        cached.forward(first)
        assert [c.pos for c in cached.checkpoints.saved] == [32, 64, 96, 119]
        kept = cached.reuse_prefix(second)
        assert kept == 64 and cached.history == second[:64]  # 70 shared: the checkpoint at 64
        assert [c.pos for c in cached.checkpoints.saved] == [32, 64]  # the later ones held the old tokens
        got = cached.forward(second[kept:], all_logits=True)
        assert np.array_equal(got, fresh.forward(second, all_logits=True)[kept:])
        # the next turn continues the conversation: from the live state, nothing recomputed (from position 120,
        # inside a chunk of a fresh pass: its chunk ends where the fresh pass's does)
        assert cached.reuse_prefix(third) == len(second)
        got = cached.forward(third[len(second) :], all_logits=True)
        assert np.array_equal(got, _fresh(model, third)[len(second) :])
        # the same prompt again: from the checkpoint one token before its end (its last token as a decode step:
        # the same numbers up to the rounding of a one-token graph, as for every family)
        assert cached.reuse_prefix(third) == len(third) - 1
        np.testing.assert_allclose(cached.forward(third[-1:]), _fresh(model, third)[-1], rtol=0, atol=1e-5)
        # a prompt that shares nothing: a fresh state
        other = [third[0] + 1, *third[1:40]]
        assert cached.reuse_prefix(other) == 0 and not cached.checkpoints.saved
        assert np.array_equal(cached.forward(other, all_logits=True), _fresh(model, other))
    finally:
        cached.close()
        fresh.close()


def test_failed_pass_leaves_no_half_updated_state(
    repacked_factory: ModelFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Mock (a pass that fails in its middle layer — a read error, an interrupt — is not reproducible on demand
    here): the layers before it have advanced their state; the next request restores a checkpoint instead of
    trusting the live state, and gets a fresh pass's logits. Without checkpoints (`--state-checkpoints 0`), only a
    continued conversation resumes."""
    model = str(repacked_factory(**HYBRIDS["ling"]))
    rng = np.random.default_rng(6)
    first = [int(t) for t in rng.integers(0, 500, 50)]
    more = first + [int(t) for t in rng.integers(0, 500, 20)]
    s = _hybrid_session(model)
    try:
        s.forward(first)
        real_layer = Session._layer

        def failing(self: Session, il: int, *args: object) -> object:
            if il == 2:
                raise OSError("mock: the drive went away")
            return real_layer(self, il, *args)  # type: ignore[arg-type]

        monkeypatch.setattr(Session, "_layer", failing)
        with pytest.raises(OSError):
            s.forward(more[len(first) :])
        monkeypatch.undo()
        assert s.history == first  # nothing was added ...
        assert s.reuse_prefix(more) == 49  # ... but the live state is not trusted: the checkpoint before the end
        assert np.array_equal(s.forward(more[49:], all_logits=True), _fresh(model, more)[49:])
    finally:
        s.close()
    none = _hybrid_session(model, state_checkpoints=0)
    try:
        none.forward(first)
        assert none.reuse_prefix(more) == len(first)  # the live state continues
        none.forward(more[len(first) :])
        assert none.reuse_prefix([*first, 1, 2]) == 0 and not none.checkpoints.saved  # nothing to go back to
    finally:
        none.close()


def _hybrid_session(model: str, **opts: object) -> Session:
    options = SessionOptions(kv_type="f32", n_ctx=256, max_batch=16, checkpoint_interval=32, **opts)  # type: ignore[arg-type]
    return Session(model, options, log=lambda line: None)


def _fresh(model: str, tokens: list[int]) -> np.ndarray:
    """Every position's logits from one pass of a new session."""
    s = _hybrid_session(model)
    try:
        return s.forward(tokens, all_logits=True)
    finally:
        s.close()


def test_checkpoints_stay_spread_out() -> None:
    """Past its capacity, the store drops the checkpoint closest to the one before it, never the newest."""
    from tokenwing.compute.ggml_lib import TensorArena
    from tokenwing.runtime.recurrent import Checkpoint, Checkpoints, StateBuffers

    empty = StateBuffers(TensorArena(4), [])
    store = Checkpoints(empty, empty, capacity=3, interval=0)
    for pos in (100, 110, 400, 900):
        store._pending[pos] = Checkpoint(pos)
        store.commit()
    assert [c.pos for c in store.saved] == [100, 400, 900]
    assert store.best(399) is not None and store.best(399).pos == 100 and store.best(99) is None
    store.drop_after(400)
    assert [c.pos for c in store.saved] == [100, 400]
