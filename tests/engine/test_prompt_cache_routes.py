"""The prompt cache on disk as a client such as the app uses it (server/prompt_cache_routes.py, issue 44 item 4),
through the official `openai` client and httpx on a real server with one slot: two conversations take turns in
it, so each comes back to a slot holding the other's context and restores its own from the disk; the stream's last
chunk says so; `prompt_cache_key` tags a conversation's snapshots, which `…/forget` deletes (the other's stay);
`…/clear` empties the folder; bad input is a 400 in the OpenAI error format."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

import httpx
import openai
import pytest

from tests.conftest import ModelFactory
from tests.engine.test_server import KEY, Server
from tokenwing.runtime.snapshot import SUFFIX

A = [{"role": "user", "content": "Tell me something about the weather today, and about the sea."}]
B = [{"role": "user", "content": "Write a short list of fruit that grows on trees in the north."}]


@pytest.fixture(scope="module")
def server(repacked_factory: ModelFactory, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    folder = tmp_path_factory.mktemp("pc")
    s = Server(repacked_factory(type="Q8_0", n_layer=3), "--prompt-cache-dir", str(folder), "--parallel", "1")
    s.folder = folder  # type: ignore[attr-defined]
    yield s
    log = s.stop()
    assert "Traceback" not in log, log


def _stream(server: Server, messages: list[dict[str, str]], key: str | None) -> tuple[str, dict[str, Any]]:
    """A streamed reply (as the app asks for it) and its last chunk's `tokenwing` object."""
    stream = server.client().chat.completions.create(
        model="x",
        messages=cast(Any, messages),
        max_tokens=4,
        temperature=0,
        stream=True,
        prompt_cache_key=key if key is not None else openai.omit,  # (the client's own field)
    )
    text, last = "", {}
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            text += chunk.choices[0].delta.content
        if chunk.choices and chunk.choices[0].finish_reason is not None:
            last = (chunk.model_extra or {})["tokenwing"]
    return text, last


def _post(server: Server, route: str, body: Any) -> httpx.Response:
    headers = {"Authorization": f"Bearer {KEY}"}
    return httpx.post(f"{server.url}/v1/tokenwing/prompt-cache/{route}", json=body, headers=headers, timeout=60)


def _usage(server: Server) -> dict[str, Any]:
    r = httpx.get(f"{server.url}/v1/tokenwing/prompt-cache", headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 200, r.text
    return dict(r.json())


def _turn(messages: list[dict[str, str]], reply: str, text: str) -> list[dict[str, str]]:
    return [*messages, {"role": "assistant", "content": reply}, {"role": "user", "content": text}]


def test_conversations_restore_their_own_and_forget_deletes_only_its_snapshots(server: Server) -> None:
    assert _post(server, "clear", {}).status_code == 200
    reply_a, last = _stream(server, A, "conv-a")
    assert "prompt_restored_tokens" not in last  # (nothing on the disk yet)
    reply_b, _ = _stream(server, B, "conv-b")  # takes the one slot: A's context is now on the disk only
    a2 = _turn(A, reply_a, "And tomorrow?")
    reply_a2, last = _stream(server, a2, "conv-a")
    # back to A: its first turn (prompt and reply) read from the disk, not computed again
    assert last["prompt_restored_tokens"] > 0 and last["prompt_restore_ms"] > 0 and last["prompt_restore_bytes"] > 0
    assert last["prompt_restored_tokens"] >= last["prompt_cached_tokens"] > 0  # (the prompt's share of it)
    _, last = _stream(server, _turn(B, reply_b, "And apples?"), "conv-b")
    assert last["prompt_restored_tokens"] > 0
    held = _usage(server)
    assert held["enabled"] is True and held["count"] >= 2 and held["used"] > 0 and held["size"] > 0
    files = set(Path(held["folder"]).glob("*" + SUFFIX))

    gone = _post(server, "forget", {"prompt_cache_key": "conv-a"})
    assert gone.status_code == 200, gone.text
    assert gone.json()["deleted"] >= 1 and gone.json()["bytes"] > 0
    left = set(Path(held["folder"]).glob("*" + SUFFIX))
    assert left and left < files  # B's stay
    assert _usage(server)["count"] == len(left)
    # A's next turn finds nothing of its own on the disk (the slot holds B's): computed again
    _, last = _stream(server, _turn(a2, reply_a2, "And the day after?"), "conv-a")
    assert "prompt_restored_tokens" not in last
    # a key nothing was tagged with: nothing deleted
    assert _post(server, "forget", {"prompt_cache_key": "never-sent"}).json() == {"deleted": 0, "bytes": 0}


def test_a_snapshot_two_keys_tagged_goes_with_the_second(server: Server) -> None:
    """The same conversation under two keys (greedy: the same tokens, one snapshot): it stays while a key lists it.
    (A conversation of its own: B's first turn is the same state, which conv-b lists.)"""
    c = [{"role": "user", "content": "Name three colours of the sky at dusk."}]
    _stream(server, c, "one")
    _stream(server, c, "two")
    assert _post(server, "forget", {"prompt_cache_key": "one"}).json() == {"deleted": 0, "bytes": 0}
    gone = _post(server, "forget", {"prompt_cache_key": "two"}).json()
    assert gone["deleted"] == 1 and gone["bytes"] > 0


def test_clear_empties_the_folder(server: Server) -> None:
    _stream(server, A, None)  # (a client without a key: its snapshot is kept and cleared the same way)
    _stream(server, B, None)
    cleared = _post(server, "clear", {})
    assert cleared.status_code == 200 and cleared.json()["deleted"] >= 1
    assert _usage(server)["count"] == 0 and _usage(server)["used"] == 0
    assert not list(Path(_usage(server)["folder"]).glob("*" + SUFFIX))
    _, last = _stream(server, A, None)  # the slot holds B's: A's came from nowhere
    assert "prompt_restored_tokens" not in last


@pytest.mark.parametrize(
    ("route", "body", "param"),
    [
        ("forget", {}, "prompt_cache_key"),
        ("forget", {"prompt_cache_key": 5}, "prompt_cache_key"),
        ("forget", {"prompt_cache_key": ""}, "prompt_cache_key"),
        ("forget", {"prompt_cache_key": "x" * 257}, "prompt_cache_key"),
        ("forget", ["conv-a"], None),
        ("clear", "all", None),
    ],
)
def test_bad_input_is_a_400(server: Server, route: str, body: Any, param: str | None) -> None:
    r = _post(server, route, body)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_a_chat_with_a_bad_key_is_a_400(server: Server) -> None:
    r = httpx.post(
        f"{server.url}/v1/chat/completions",
        json={"messages": A, "max_tokens": 2, "prompt_cache_key": ["a"]},
        headers={"Authorization": f"Bearer {KEY}"},
        timeout=60,
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt_cache_key", r.text
