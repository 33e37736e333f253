"""A chat reply that fills the engine's context says so in the app: the stored reply ends with "context_full"
and its footer tells the user, not "max tokens reached" (real engine, small context)."""

from __future__ import annotations

import asyncio
from pathlib import Path

from runmyai.chat.session import ChatSession, Reply, footer
from runmyai.chat.store import ConversationStore
from runmyai.engine.client import ChatClient, ChatSettings
from runmyai.engine.endpoint import Endpoint
from tests.conftest import ModelFactory
from tests.engine.test_server import KEY, Server
from tokenwing.format.reader import ModelFile
from tokenwing.text.chat import ChatTemplate
from tokenwing.text.tokenizer import tokenizer_from_metadata


def test_reply_that_fills_the_context(repacked_factory: ModelFactory, tmp_path: Path) -> None:
    model = repacked_factory(type="Q8_0", n_layer=3)
    with ModelFile.open(str(model)) as mf:
        meta = {k: v.value for k, v in mf.header.kv.items()}
    tok, template = tokenizer_from_metadata(meta, "m"), ChatTemplate(meta["tokenizer.chat_template"])
    words = "Once upon a time"
    while len(tok.encode(template.render([{"role": "user", "content": words}]), special=True)) < 61:
        words += " and"  # 3 tokens of room in a 64-token context (or 2, if the last word took two)
    server = Server(model, "--ctx", "64")
    store = ConversationStore(":memory:")
    try:
        conv = store.create(settings=ChatSettings(temperature=0.0, max_tokens=400))
        client = ChatClient(Endpoint(server.url + "/v1", KEY, "m"))

        async def send() -> Reply:
            try:
                return await ChatSession(store, lambda: client).send(conv.id, words, lambda _: None)
            finally:
                await client.aclose()

        reply = asyncio.run(send())
    finally:
        server.stop()
    assert reply.message.finish_reason == "context_full"
    assert "the context is full" in footer(reply.message)
