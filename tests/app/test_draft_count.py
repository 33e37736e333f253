"""The token count while typing: what the draft adds to the prompt, by the real engine's template and tokenizer
(`POST /v1/chat/count`), debounced, and shown under the input box."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from PySide6.QtWidgets import QApplication

from runmyai.chat.draft_count import DraftCount, DraftCounter
from runmyai.engine.client import ChatClient
from runmyai.engine.endpoint import Endpoint
from tests.app.hubserver import HubServer
from tests.app.test_app_scenario import make_controller
from tests.app.test_engine_client import KEY, Engine
from tests.conftest import ModelFactory
from tests.qtloop import run_qt

HISTORY = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello! How can I help?"}]


@pytest.fixture(scope="module")
def engine(repacked_factory: ModelFactory) -> Iterator[Engine]:
    e = Engine(repacked_factory(type="Q8_0", n_layer=3))
    yield e
    e.stop()


def test_the_line() -> None:
    assert DraftCount(12, 120, 2048).line() == "12 tokens · 1,928 of 2,048 context tokens left"
    assert DraftCount(5, 2050, 2048).line() == "5 tokens · the chat would be 2 over the 2,048-token context"
    assert DraftCount(1, 9, None).line() == "1 token"


def test_the_count_is_what_the_draft_adds_and_typing_asks_once_per_pause(engine: Engine) -> None:
    shown: list[str] = []
    history: list[dict[str, Any]] = list(HISTORY)

    async def main() -> None:
        client = ChatClient(engine.endpoint)
        counter = DraftCounter(lambda: client, lambda: (history, None), shown.append, debounce_s=0.01)
        try:
            got = await counter.count("What is the capital of France?")
            assert got is not None and got.n_ctx == 512
            with_it = await client.count([*history, {"role": "user", "content": "What is the capital of France?"}])
            without = await client.count(history)
            assert got.tokens == with_it.prompt_tokens - without.prompt_tokens > 0
            assert got.prompt_tokens == with_it.prompt_tokens
            longer = await counter.count("What is the capital of France? " * 5)
            assert longer is not None and longer.tokens > got.tokens

            # three edits in a row: the first two are dropped before they ask anything, the last one asks once
            # (the conversation's own count is remembered from above)
            asked = counter.requests
            for text in ("W", "Wh", "Why"):
                counter.changed(text)
            task = counter.task
            assert task is not None
            result = await task
            assert result is not None and counter.requests == asked + 1
            assert shown == [result.line()] and shown[0].startswith(f"{result.tokens} token")
            counter.changed("")  # an empty box: no line, nothing asked
            assert shown[-1] == "" and counter.task is None and counter.requests == asked + 1

            # the conversation moved on: its count is asked again with the next draft
            history.append({"role": "user", "content": "Thanks"})
            counter.changed("Why")
            assert counter.task is not None
            again = await counter.task
            assert again is not None and counter.requests == asked + 3 and again.prompt_tokens > result.prompt_tokens
        finally:
            await counter.aclose()
            await client.aclose()

    asyncio.run(main())


def test_no_engine_or_a_server_that_cannot_count_shows_nothing(engine: Engine) -> None:
    async def main() -> tuple[object, object]:
        none = DraftCounter(lambda: None, lambda: ([], None), lambda _: None)
        other = ChatClient(Endpoint(engine.url + "/elsewhere/v1", KEY, "test"))  # a 404 for its count route
        try:
            cannot = DraftCounter(lambda: other, lambda: ([], None), lambda _: None)
            return await none.count("Hi"), await cannot.count("Hi")
        finally:
            await other.aclose()

    assert asyncio.run(main()) == (None, None)


def test_the_window_shows_the_count_under_the_input(qapp: QApplication, engine: Engine, tmp_path: Path) -> None:
    with HubServer() as hub:
        window, c = make_controller(tmp_path, hub, b"")
        chat = window.chat

        async def scenario() -> tuple[str, DraftCount | None, str]:
            try:
                await c.engine.use_endpoint(engine.url, KEY)
                c.talks.new_conversation()
                chat.input.setPlainText("Tell me about the sea.")  # as typing does: the text changed
                task = c.chat.draft_counter.task
                assert task is not None
                result = await task
                line = chat.token_label.text()
                chat.input.clear()
                return line, result, chat.token_label.text()
            finally:
                await c.shutdown()

        line, result, cleared = run_qt(qapp, scenario)
    assert result is not None and line == result.line() and line.endswith("of 512 context tokens left")
    assert cleared == ""
