"""gpt-oss replies through `tokenwing serve`: the harmony analysis channel comes back as `reasoning_content`, the
final channel as `content` (as llama.cpp's server does), streamed and not, read with the official client.

Random weights never write harmony, so the reply's tokens are scripted (TOKENWING_TEST_TOKENS, test-only): the
tokenizer, the text stream, the parser and the HTTP shapes are the real ones."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import ModelFactory
from tests.engine.test_server import Server
from tokenwing.format.reader import ModelFile
from tokenwing.text.tokenizer import tokenizer_from_metadata

REPLY = (
    "<|channel|>analysis<|message|>The user greets; answer briefly.<|end|>"
    "<|start|>assistant<|channel|>final<|message|>Hello there!<|return|>"
)


def scripted(model: Path, text: str) -> str:
    with ModelFile.open(str(model)) as mf:
        tok = tokenizer_from_metadata({k: v.value for k, v in mf.header.kv.items()}, str(model))
    ids = tok.encode(text, special=True)
    assert tok.decode(ids[:-1]) == text.removesuffix("<|return|>")  # the markers are whole tokens, printed
    assert ids[-1] in tok.eos_ids  # <|return|> ends the reply
    return ",".join(str(i) for i in ids)


def test_analysis_channel_is_reasoning(
    repacked_factory: ModelFactory, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = repacked_factory(arch="gpt-oss", type="Q8_0")
    monkeypatch.setenv("TOKENWING_TEST_TOKENS", scripted(model, REPLY))
    server = Server(model)
    try:
        client = server.client()
        messages = [{"role": "user", "content": "Hi"}]
        r = client.chat.completions.create(model="m", messages=messages, max_tokens=64)  # type: ignore[arg-type]
        msg = r.choices[0].message
        assert msg.content == "Hello there!"
        assert (msg.model_extra or {}).get("reasoning_content") == "The user greets; answer briefly."
        assert r.choices[0].finish_reason == "stop"
        content, reasoning = [], []
        stream = client.chat.completions.create(model="m", messages=messages, max_tokens=64, stream=True)  # type: ignore[arg-type]
        for chunk in stream:
            if not chunk.choices:
                continue
            delta = chunk.choices[0].delta
            content.append(delta.content or "")
            reasoning.append((delta.model_extra or {}).get("reasoning_content") or "")
        assert "".join(content) == "Hello there!"
        assert "".join(reasoning) == "The user greets; answer briefly."
        # completions are text in, text out: nothing is split there
        c = client.completions.create(model="m", prompt="Hi", max_tokens=64)
        assert c.choices[0].text == REPLY.removesuffix("<|return|>")
    finally:
        server.stop()
