"""The server's slots: requests served at once, decoded together, each reply what it is alone; a cancelled one
frees its slot without touching the others; with every slot busy a request waits, or gets a 503 if it asked not
to wait. The requests gather at a test pause (`serve.admit`) so that they run together whatever the machine's
speed: nothing here races the engine."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.conftest import ModelFactory
from tests.engine.test_server import KEY, Server
from tests.pauses import TIMEOUT_S, Pauses

QUESTIONS = [
    "Tell me about the sea.",
    "What is a prime number?",
    "Name three colours.",
    "Write a short poem about trains and the rain at night.",
]


def _requests() -> list[dict[str, Any]]:
    """Greedy and seeded sampled requests of different lengths, one with log-probabilities and a stop string."""
    out: list[dict[str, Any]] = []
    for i, q in enumerate(QUESTIONS):
        body: dict[str, Any] = {"messages": [{"role": "user", "content": q}], "max_tokens": 10 + 3 * i}
        if i % 2:
            body.update(temperature=0.9, seed=100 + i, top_p=0.95)
        else:
            body.update(temperature=0)
        if i == 2:
            body.update(logprobs=True, top_logprobs=2, stop=["\n\n"])
        out.append(body)
    return out


def _ask(client: openai.OpenAI, body: dict[str, Any]) -> dict[str, Any]:
    r = client.chat.completions.create(model="x", **body)
    c = r.choices[0]
    lp = [(e.token, e.logprob) for e in c.logprobs.content] if c.logprobs and c.logprobs.content else None
    extra = r.model_extra or {}
    return {"text": c.message.content, "finish": c.finish_reason, "logprobs": lp, "stats": extra.get("tokenwing")}


def _wait_queued(server: Server, n: int) -> None:
    """Until the server holds n requests in its queue (they arrive over HTTP: awaited, never raced)."""
    import time

    deadline = time.monotonic() + TIMEOUT_S
    while httpx.get(server.url + "/health").json()["queued"] < n:
        assert server.proc.poll() is None and time.monotonic() < deadline
        time.sleep(0.01)


def _together(server: Server, pauses: Pauses, threads: list[threading.Thread]) -> None:
    """Runs the requests' threads so that the engine admits them together: the first one's arrival stops the
    engine at `serve.admit`, the others join the queue, then it goes on; returns when all have ended."""
    threads[0].start()
    pauses.wait("serve.admit", lambda: server.proc.poll() is None)
    for t in threads[1:]:
        t.start()
    _wait_queued(server, len(threads))
    pauses.release("serve.admit")
    for t in threads:
        t.join(TIMEOUT_S)


@pytest.fixture(scope="module")
def model(repacked_factory: ModelFactory) -> Path:
    return repacked_factory(type="Q8_0", n_layer=3)


@pytest.fixture(scope="module")
def alone(model: Path) -> list[dict[str, Any]]:
    """Each request on a server with one slot and no prompt cache: what a reply is alone."""
    server = Server(model, "--parallel", "1", "--no-prompt-cache", "--ram-budget", "30%")
    try:
        return [_ask(server.client(), body) for body in _requests()]
    finally:
        server.stop()


def test_concurrent_requests_get_what_they_get_alone(
    model: Path, alone: list[dict[str, Any]], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pauses = Pauses(tmp_path / "pauses", "serve.admit")
    pauses.arm(monkeypatch)
    server = Server(model, "--parallel", "4", "--ram-budget", "30%")
    try:
        got: list[dict[str, Any] | None] = [None] * len(QUESTIONS)

        def one(i: int, body: dict[str, Any]) -> None:
            got[i] = _ask(server.client(), body)

        threads = [threading.Thread(target=one, args=(i, b)) for i, b in enumerate(_requests())]
        _together(server, pauses, threads)
        for want, reply in zip(alone, got, strict=True):
            assert reply is not None
            assert reply["stats"]["largest_batch"] >= 2  # (decoded together with others)
            assert {k: reply[k] for k in ("text", "finish", "logprobs")} == {
                k: want[k] for k in ("text", "finish", "logprobs")
            }
        assert len({r["stats"]["slot"] for r in got if r is not None}) == len(QUESTIONS)
    finally:
        server.stop()


def test_a_cancelled_reply_leaves_the_others_as_they_are(
    model: Path, alone: list[dict[str, Any]], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Four streamed requests start together; one client goes after its first piece. The others' replies are
    their replies alone, and the freed slot serves the next request."""
    pauses = Pauses(tmp_path / "pauses", "serve.admit")
    pauses.arm(monkeypatch)
    server = Server(model, "--parallel", "4", "--ram-budget", "30%")
    try:
        texts: list[str | None] = [None] * len(QUESTIONS)
        gone = 1  # the request whose client goes

        def one(i: int, body: dict[str, Any]) -> None:
            stream = server.client().chat.completions.create(model="x", stream=True, **body)
            parts = []
            for chunk in stream:
                if chunk.choices and chunk.choices[0].delta.content:
                    parts.append(chunk.choices[0].delta.content)
                    if i == gone:
                        stream.close()
                        return
            texts[i] = "".join(parts)

        bodies = [{k: v for k, v in b.items() if k not in ("logprobs", "top_logprobs")} for b in _requests()]
        threads = [threading.Thread(target=one, args=(i, b)) for i, b in enumerate(bodies)]
        _together(server, pauses, threads)
        for i, want in enumerate(alone):
            if i != gone:
                assert texts[i] == want["text"]
        again = _ask(server.client(), _requests()[gone])  # a slot is free for it (no 503, no wait)
        assert again["text"] == alone[gone]["text"]
    finally:
        server.stop()


def test_with_every_slot_busy_a_request_waits_or_gets_a_503(
    model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One slot, held by a reply paused at its first piece: a request that may not wait gets a 503 naming why;
    one that may wait is queued (`queued` in /health) and served once the slot is free."""
    pauses = Pauses(tmp_path / "pauses", "serve.piece1")
    pauses.arm(monkeypatch)
    server = Server(model, "--parallel", "1", "--ram-budget", "30%")
    try:
        body = _requests()[0]
        first: list[dict[str, Any]] = []
        holder = threading.Thread(target=lambda: first.append(_ask(server.client(), body)))
        holder.start()
        pauses.wait("serve.piece1", lambda: server.proc.poll() is None)
        health = httpx.get(server.url + "/health").json()
        assert (health["slots"], health["busy"], health["queued"]) == (1, 1, 0)
        slots = httpx.get(server.url + "/v1/tokenwing/stats", headers={"Authorization": f"Bearer {KEY}"}).json()
        assert slots["slots"]["count"] == 1 and [v["slot"] for v in slots["slots"]["busy"]] == [0]
        metrics = httpx.get(server.url + "/metrics").text
        assert "tokenwing_slots 1" in metrics and "tokenwing_busy_slots 1" in metrics
        with pytest.raises(openai.APIStatusError) as refused:
            server.client().chat.completions.create(model="x", extra_body={"wait": False}, **body)
        assert refused.value.status_code == 503 and "slots are busy" in refused.value.message
        later: list[dict[str, Any]] = []
        waiter = threading.Thread(target=lambda: later.append(_ask(server.client(), body)))
        waiter.start()
        _wait_queued(server, 1)
        pauses.release("serve.piece1")
        holder.join(TIMEOUT_S)
        waiter.join(TIMEOUT_S)
        assert first and later and later[0]["text"] == first[0]["text"]
        assert httpx.get(server.url + "/health").json()["queued"] == 0
    finally:
        server.stop()
