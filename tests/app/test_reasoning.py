"""A thinking model's reasoning in the app: the client reads it (gpt-oss through the real engine, with the harmony
reply scripted; other servers' field names from canned streams), the session saves it as it streams and never
sends it back."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
from PySide6.QtWidgets import QApplication
from pytestqt.qtbot import QtBot

from runmyai.chat import session as session_module
from runmyai.chat.session import ChatSession
from runmyai.chat.store import ConversationStore
from runmyai.engine.client import ChatClient, ChatDelta, ChatSettings
from tests.app.hubserver import HubServer
from tests.app.test_app_scenario import make_controller
from tests.app.test_engine_client import HELLO, KEY, Engine, FakeServer, collect, sse
from tests.app.test_widgets import click_text
from tests.conftest import ModelFactory
from tests.engine.test_server_reasoning import REPLY, scripted
from tests.qtloop import run_qt
from tokenwing.format.reader import ModelFile
from tokenwing.text.tokenizer import tokenizer_from_metadata

THOUGHT, ANSWER = "The user greets; answer briefly.", "Hello there!"


@pytest.fixture(scope="module")
def gptoss(repacked_factory: ModelFactory) -> Iterator[Engine]:
    """The engine on a random gpt-oss model whose every reply is REPLY's tokens (analysis, then final)."""
    model = repacked_factory(arch="gpt-oss", type="Q8_0")
    e = Engine(model, TOKENWING_TEST_TOKENS=scripted(model, REPLY))
    yield e
    e.stop()


def token_count(model: Path, text: str) -> int:
    with ModelFile.open(str(model)) as mf:
        tok = tokenizer_from_metadata({k: v.value for k, v in mf.header.kv.items()}, str(model))
    return len(tok.encode(text, special=True))


def joined(deltas: list[ChatDelta]) -> tuple[str, str]:
    return "".join(d.reasoning for d in deltas), "".join(d.text for d in deltas)


def test_client_reads_the_reasoning_then_the_content(gptoss: Engine) -> None:
    async def main() -> tuple[list[ChatDelta], ChatClient]:
        client = ChatClient(gptoss.endpoint)
        try:
            return await collect(client, HELLO, ChatSettings(max_tokens=64)), client
        finally:
            await client.aclose()

    deltas, client = asyncio.run(main())
    assert joined(deltas) == (THOUGHT, ANSWER)
    kinds = [("r" if d.reasoning else "") + ("t" if d.text else "") for d in deltas if d.reasoning or d.text]
    assert kinds == sorted(kinds) and kinds[0] == "r" and kinds[-1] == "t"  # all the reasoning first
    assert [d.finish_reason for d in deltas if d.finish_reason] == ["stop"]
    usage = [d.usage for d in deltas if d.usage][-1]
    st = client.last_stats  # the thinking counts: its first piece is the first token, its tokens are tokens
    assert st is not None and st.ttft_s is not None and st.tokens == usage["completion_tokens"]


def test_client_reasoning_cut_by_max_tokens(gptoss: Engine) -> None:
    """The reply ends inside the analysis channel: the parser's last flush is all there is, no content."""
    head = token_count(gptoss.model, "<|channel|>analysis<|message|>")

    async def main() -> list[ChatDelta]:
        client = ChatClient(gptoss.endpoint)
        try:
            return await collect(client, HELLO, ChatSettings(max_tokens=head + 5))
        finally:
            await client.aclose()

    deltas = asyncio.run(main())
    reasoning, text = joined(deltas)
    assert text == "" and reasoning and THOUGHT.startswith(reasoning) and reasoning != THOUGHT
    assert [d.finish_reason for d in deltas if d.finish_reason] == ["length"]


class RecordingClient(ChatClient):
    """The real client; it also keeps the messages each request carried."""

    sent: list[list[dict[str, Any]]]

    async def stream_chat(
        self, messages: list[dict[str, Any]], settings: ChatSettings, tools: list[dict[str, Any]] | None = None
    ) -> AsyncIterator[ChatDelta]:
        self.sent = [*getattr(self, "sent", []), [dict(m) for m in messages]]
        async for d in super().stream_chat(messages, settings, tools):
            yield d


def test_session_saves_reasoning_as_it_streams_and_never_sends_it_back(
    gptoss: Engine, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(session_module, "SAVE_EVERY_S", -1.0)  # every piece is saved as it comes
    store = ConversationStore(tmp_path / "c.sqlite3")
    client = RecordingClient(gptoss.endpoint)
    session = ChatSession(store, lambda: client)
    conv = store.create(settings=ChatSettings(max_tokens=64))
    got = {"reasoning": "", "text": ""}
    held: list[tuple[str, str] | None] = []  # what the store held when each piece arrived

    def stored() -> tuple[str, str] | None:
        last = store.messages(conv.id)[-1]
        return (last.reasoning, last.content) if last.role == "assistant" else None

    def sink(kind: str) -> session_module.Sink:
        def take(piece: str) -> None:
            held.append(stored())
            got[kind] += piece

        return take

    async def main() -> None:
        try:
            first = await session.send(conv.id, "Hi", sink("text"), sink("reasoning"))
            assert (first.message.reasoning, first.message.content) == (THOUGHT, ANSWER)
            assert (got["reasoning"], got["text"]) == (THOUGHT, ANSWER)
            await session.send(conv.id, "And again?", lambda _: None)  # no reasoning sink: saved all the same
        finally:
            await client.aclose()

    asyncio.run(main())
    # before each piece, the store held every piece before it: reasoning too is saved as it streams
    assert held[0] is None and all(h is not None for h in held[1:])
    assert held[-1] is not None and held[-1][0] == THOUGHT and ANSWER.startswith(held[-1][1])
    reasonings = [h[0] for h in held[1:] if h is not None]
    assert reasonings == sorted(reasonings, key=len) and len(set(reasonings)) > 1
    msgs = store.messages(conv.id)
    assert [(m.role, m.content, m.reasoning) for m in msgs] == [
        ("user", "Hi", ""),
        ("assistant", ANSWER, THOUGHT),
        ("user", "And again?", ""),
        ("assistant", ANSWER, THOUGHT),
    ]
    # the second request carried the first reply's content only
    assert client.sent[1] == [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": ANSWER},
        {"role": "user", "content": "And again?"},
    ]
    store.close()


def test_other_servers_reasoning_field_names() -> None:
    """SYNTHETIC streams (FakeServer): the engine sends `reasoning_content` only; DeepSeek-style servers (vLLM,
    OpenRouter, Ollama) send `reasoning`, and some send both with the same text."""

    def delta(**fields: str) -> str:
        return "data: " + json.dumps({"choices": [{"delta": fields, "finish_reason": None}]}) + "\n\n"

    end = "data: " + json.dumps({"choices": [{"delta": {}, "finish_reason": "stop"}]}) + "\n\ndata: [DONE]\n\n"
    response = sse(
        "200 OK",
        delta(role="assistant", content=""),
        delta(reasoning="Plan: "),
        delta(reasoning_content="greet", reasoning="greet"),  # both names, one text: taken once
        delta(reasoning_content="."),
        delta(content="Hi", reasoning=""),
        delta(content="!"),
        end,
    )

    async def main() -> list[ChatDelta]:
        async with FakeServer(response) as srv:
            client = ChatClient(srv.endpoint)
            try:
                return await collect(client, HELLO, ChatSettings())
            finally:
                await client.aclose()

    deltas = asyncio.run(main())
    assert joined(deltas) == ("Plan: greet.", "Hi!")


def test_the_window_shows_the_reasoning_folded_and_keeps_it(
    qapp: QApplication, qtbot: QtBot, gptoss: Engine, tmp_path: Path
) -> None:
    """File → Connect to the engine, one turn: the reply's reasoning folded above it while it is in the window and
    when the conversation is opened again from the store."""
    with HubServer() as hub:
        window, c = make_controller(tmp_path, hub, b"")
        transcript = window.chat.transcript

        async def turn() -> str:
            await c.engine.use_endpoint(gptoss.url, KEY)
            c.talks.new_conversation()
            try:
                return await c.chat.chat_once("Hi")
            finally:
                await c.shutdown()

        assert run_qt(qapp, turn) == ANSWER
    text = transcript.toPlainText()
    assert THOUGHT not in text and text.index("Thought for 5 words — show") < text.index(ANSWER)
    click_text(transcript, qtbot, "Thought for")
    assert transcript.reasoning_shown(1) and THOUGHT in transcript.toPlainText()
    cid = c.talks.conversation_id
    assert cid is not None
    # shutdown closed it; the file is what is kept (the conversations room shows the chat from it)
    c.talks.store = store = ConversationStore(c.paths.conversations_db)
    c.talks.open_conversation(cid)
    assert transcript.toPlainText() == text  # from the store: the same, folded again
    store.close()
