"""Prompt caching: a request that starts like the previous one computes only the new tokens, and gets what a
fresh engine would have given."""

from __future__ import annotations

import numpy as np

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


def test_server_reuses_the_previous_conversation(repacked_factory: ModelFactory) -> None:
    model = repacked_factory(type="Q8_0")
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
            server.replies = (r1, r2)  # type: ignore[attr-defined]
        a1, a2 = with_cache.replies  # type: ignore[attr-defined]
        b1, b2 = without.replies  # type: ignore[attr-defined]
        assert a1.choices[0].message.content == b1.choices[0].message.content
        assert a2.choices[0].message.content == b2.choices[0].message.content
        cached = a2.model_extra["tokenwing"]["prompt_cached_tokens"]
        assert a2.usage is not None and 0 < cached < a2.usage.prompt_tokens
        assert b2.model_extra["tokenwing"]["prompt_cached_tokens"] == 0
        assert a1.model_extra["tokenwing"]["prompt_cached_tokens"] == 0
    finally:
        with_cache.stop()
        without.stop()
