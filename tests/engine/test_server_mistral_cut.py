"""Mistral's calls (text/tools/mistral.py) cut off by max_tokens through a real `tokenwing serve` and the official
`openai` client: the generated mistral4 model (its tekken vocabulary, where [TOOL_CALLS] is a control token the
reply prints) with Ministral 3's template, the form Mistral Small 4 writes. Mistral's call has no end marker, so a
cut inside its JSON is told from a whole call only by the JSON itself. The reply's tokens are scripted
(TOKENWING_TEST_TOKENS, test-only): tokenizer, reader, grammar and HTTP shapes are the real ones."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import ModelFactory
from tests.engine.test_server import Server
from tests.engine.test_server_tools import TOOLS, USER, _with_template, script
from tokenwing.format.reader import ModelFile
from tokenwing.text.tokenizer import tokenizer_from_metadata

CALL = '[TOOL_CALLS]get_weather[ARGS]{"city":"Zürich"}'  # as the grammar writes it (compact JSON)
WHOLE = json.dumps({"city": "Zürich"}, ensure_ascii=False)


@pytest.fixture(scope="module")
def model(model_factory: ModelFactory, tmp_path_factory: pytest.TempPathFactory) -> Path:
    src = model_factory(arch="mistral4", type="Q8_0")
    return _with_template(src, tmp_path_factory.mktemp("mistral"), "mistralai-Ministral-3-14B-Reasoning-2512.jinja")


@pytest.fixture(scope="module")
def server(model: Path) -> Iterator[Server]:
    """Every reply is the call (the script's last reply repeats)."""
    mp = pytest.MonkeyPatch()
    mp.setenv("TOKENWING_TEST_TOKENS", script(model, [CALL], ["</s>"]))
    s = Server(model, "--ctx", "4096")
    try:
        yield s
    finally:
        s.stop()
        mp.undo()


def _cut_inside_city(model: Path) -> tuple[int, str]:
    """The fewest of the call's tokens whose text ends inside "Zürich", and the arguments written so far as the
    server writes JSON ('{"city": "Z…')."""
    with ModelFile.open(str(model)) as mf:
        tok = tokenizer_from_metadata({k: v.value for k, v in mf.header.kv.items()}, str(model))
    ids = tok.encode(CALL, special=True, add_bos=False)
    for n in range(1, len(ids)):
        said = b"".join(tok.piece_bytes(i) for i in ids[:n]).decode("utf-8", errors="ignore")
        value = said.partition('"city":"')[2]
        if value and len(value) < len("Zürich") and "Zürich".startswith(value):
            return n, '{"city": "' + value
    raise AssertionError("no token boundary inside the city")


@pytest.mark.parametrize("choice", ["required", "auto"])
def test_a_mistral_call_cut_inside_its_arguments_is_a_call_with_them_so_far(
    server: Server, model: Path, choice: str
) -> None:
    n, so_far = _cut_inside_city(model)
    assert WHOLE.startswith(so_far) and so_far != WHOLE
    client = server.client()
    r = client.chat.completions.create(model="m", messages=USER, tools=TOOLS, tool_choice=choice, max_tokens=n)
    c = r.choices[0]
    assert c.finish_reason == "length" and c.message.content is None, c
    calls: list[Any] = list(c.message.tool_calls or [])
    assert [(t.function.name, t.function.arguments) for t in calls] == [("get_weather", so_far)]
    assert (r.model_extra or {})["tokenwing"]["cut_call"] == "arguments"
    # streamed: the call's head, then its arguments, together the non-streamed reply's; no content
    chunks = list(client.chat.completions.create(model="m", messages=USER, tools=TOOLS, tool_choice=choice,
                                                 max_tokens=n, stream=True))  # fmt: skip
    deltas = [d for ch in chunks if ch.choices for d in ch.choices[0].delta.tool_calls or []]
    assert not "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "length"
    assert deltas[0].id and deltas[0].function is not None and deltas[0].function.name == "get_weather"
    assert "".join(d.function.arguments or "" for d in deltas if d.function) == so_far


def test_the_whole_call_streams_under_the_grammar(server: Server) -> None:
    """tool_choice required, not cut: the call's head, then its arguments in pieces, which put together are its
    arguments (the call ends with the object's closing brace: there is no end marker after it)."""
    client = server.client()
    stream = client.chat.completions.create(
        model="m", messages=USER, tools=TOOLS, tool_choice="required", max_tokens=200, stream=True
    )
    chunks = list(stream)
    deltas = [d for ch in chunks if ch.choices for d in ch.choices[0].delta.tool_calls or []]
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "tool_calls"
    assert deltas[0].function is not None and deltas[0].function.name == "get_weather"
    assert len(deltas) >= 3  # the head, then more than one piece of arguments
    assert json.loads("".join(d.function.arguments or "" for d in deltas if d.function)) == {"city": "Zürich"}
