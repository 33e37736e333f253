"""A call that max_tokens cuts off comes back as a call, never as its template's markup (issue 48 item 3), through
a real `tokenwing serve` and the official clients: `openai`'s chat completions (tool_choice required and auto,
streamed and not) and an OpenAI Agents SDK agent on a chat-completions model, the issue's own case (a function
tool, tool_choice "required", a small max_tokens: the reply came back as `<tool_call>\n{"name": ...` text and
the agent never ran its tool). Every family's format is checked cut at every character in
tests/text/test_tool_calls.py (test_a_reply_cut_anywhere_never_shows_a_call_as_text).

The generated model, with the factory's template (it shows no tools: the engine's own call format, Qwen's JSON
form); random weights never write a call, so the reply's tokens are scripted (TOKENWING_TEST_TOKENS, test-only):
the tokenizer, the worker's reader, the grammar and the HTTP shapes are the real ones."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from agents import Agent, ModelSettings, OpenAIChatCompletionsModel, Runner, function_tool, set_tracing_disabled

from tests.conftest import ModelFactory
from tests.engine.test_server import KEY, Server
from tests.engine.test_server_tools import ANSWER, TOOLS, USER, script
from tokenwing.format.reader import ModelFile
from tokenwing.text.tokenizer import TextTokenizer, tokenizer_from_metadata

# the call as the engine's format writes it under the grammar (compact JSON)
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city":"Zürich"}}\n</tool_call>'
WHOLE = json.dumps({"city": "Zürich"}, ensure_ascii=False)


def _tokenizer(model: Path) -> TextTokenizer:
    with ModelFile.open(str(model)) as mf:
        return tokenizer_from_metadata({k: v.value for k, v in mf.header.kv.items()}, str(model))


def _cut_at(tok: TextTokenizer, text: str, inside: str) -> tuple[int, str]:
    """The fewest of `text`'s tokens whose text ends inside `inside` (its start written, not its end), and that
    text."""
    ids = tok.encode(text, special=True, add_bos=False)
    at = text.index(inside)
    for n in range(1, len(ids)):
        said = tok.decode(ids[:n])
        if at < len(said) < at + len(inside):
            return n, said
    raise AssertionError(f"no token boundary inside {inside!r}")


@pytest.fixture(scope="module")
def model(repacked_factory: ModelFactory) -> Path:
    return repacked_factory(arch="deepseek2", type="Q8_0")


@pytest.fixture(scope="module")
def server(model: Path) -> Iterator[Server]:
    """Every reply is the call (the script's last reply repeats)."""
    mp = pytest.MonkeyPatch()
    mp.setenv("TOKENWING_TEST_TOKENS", script(model, [CALL]))
    s = Server(model, "--ctx", "4096")
    try:
        yield s
    finally:
        s.stop()
        mp.undo()


@pytest.mark.parametrize("choice", ["required", "auto", {"type": "function", "function": {"name": "get_weather"}}])
def test_a_call_cut_inside_its_arguments_is_a_call_with_them_so_far(server: Server, model: Path, choice: Any) -> None:
    """max_tokens ends the reply inside the city's value: OpenAI's shape for it, a tool call whose arguments are
    the JSON written so far, content null, finish_reason "length" (the stats say the call was cut)."""
    n, said = _cut_at(_tokenizer(model), CALL, "Zürich")
    so_far = '{"city": "' + said.split('"city":"', 1)[1]  # (the arguments as the server writes JSON: ": ")
    assert WHOLE.startswith(so_far) and so_far != WHOLE
    r = server.client().chat.completions.create(model="m", messages=USER, tools=TOOLS, tool_choice=choice,
                                                max_tokens=n)  # fmt: skip
    c = r.choices[0]
    assert c.finish_reason == "length" and c.message.content is None, c
    calls: list[Any] = list(c.message.tool_calls or [])
    assert [(t.function.name, t.function.arguments) for t in calls] == [("get_weather", so_far)]
    assert calls[0].id and calls[0].type == "function"
    assert (r.model_extra or {})["tokenwing"]["cut_call"] == "arguments"


@pytest.mark.parametrize("choice", ["required", "auto"])
def test_a_streamed_call_cut_inside_its_arguments(server: Server, model: Path, choice: str) -> None:
    """The same, streamed: the call's head, then its arguments (in pieces under the grammar, whole with auto),
    which put together are the non-streamed reply's; no content delta; the last chunk's finish_reason "length"."""
    n, _ = _cut_at(_tokenizer(model), CALL, "Zürich")
    client = server.client()
    whole = client.chat.completions.create(model="m", messages=USER, tools=TOOLS, tool_choice=choice, max_tokens=n)
    (call,) = whole.choices[0].message.tool_calls or []
    chunks = list(client.chat.completions.create(model="m", messages=USER, tools=TOOLS, tool_choice=choice,
                                                 max_tokens=n, stream=True))  # fmt: skip
    deltas = [d for ch in chunks if ch.choices for d in ch.choices[0].delta.tool_calls or []]
    assert not "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "length"
    head = deltas[0]
    assert head.id and head.function is not None and head.function.name == "get_weather"
    assert all(d.index == 0 for d in deltas)
    assert "".join(d.function.arguments or "" for d in deltas if d.function) == call.function.arguments
    assert call.function.arguments.startswith('{"city": "Z') and WHOLE.startswith(call.function.arguments)


def test_a_call_cut_before_its_name_is_whole_is_nothing(server: Server, model: Path) -> None:
    """Cut inside the function's name: nothing of the call can go out (which function?), and none of its markup:
    an empty reply, finish_reason "length"."""
    n, _ = _cut_at(_tokenizer(model), CALL, "get_weather")
    r = server.client().chat.completions.create(model="m", messages=USER, tools=TOOLS, tool_choice="required",
                                                max_tokens=n)  # fmt: skip
    c = r.choices[0]
    assert c.finish_reason == "length" and not c.message.content and not c.message.tool_calls, c
    assert (r.model_extra or {})["tokenwing"]["cut_call"] == "dropped"


@pytest.mark.parametrize(("inside", "ran"), [("</tool_call>", ["Zürich"]), ("Zürich", [])])
def test_the_issues_agent_gets_its_call(
    model: Path, monkeypatch: pytest.MonkeyPatch, inside: str, ran: list[str]
) -> None:
    """The issue's case: an OpenAI Agents SDK agent, a chat-completions model, a function tool, tool_choice
    required, max_tokens cutting the forced call: the agent gets a tool call (it got the markup as its final
    output). Cut inside the block's end marker, the arguments are whole: the tool runs with them. Cut inside
    the arguments (the issue's 64 tokens), the SDK gets them so far, cannot run the tool and says so to the
    model, as with OpenAI's own cut calls; either way the run goes on to the answer (tool_choice reset)."""
    n, _ = _cut_at(_tokenizer(model), CALL, inside)
    monkeypatch.setenv("TOKENWING_TEST_TOKENS", script(model, [CALL, ANSWER]))
    s = Server(model, "--ctx", "4096")
    called: list[str] = []

    @function_tool
    def get_weather(city: str) -> str:
        """The weather now in a city, in °C."""
        called.append(city)
        return "21 °C, sunny"

    try:
        set_tracing_disabled(True)
        client = openai.AsyncOpenAI(base_url=s.url + "/v1", api_key=KEY, max_retries=0, timeout=60)
        agent = Agent(
            name="weather",
            instructions="Answer with the weather.",
            tools=[get_weather],
            model=OpenAIChatCompletionsModel(model="m", openai_client=client),
            model_settings=ModelSettings(tool_choice="required", max_tokens=n),
            reset_tool_choice=True,
        )
        result = Runner.run_sync(agent, "What is the weather in Zürich?", max_turns=4)
        assert [item.type for item in result.new_items] == ["tool_call_item", "tool_call_output_item",
                                                            "message_output_item"]  # fmt: skip
        assert called == ran
        output = str(result.new_items[1].output)  # type: ignore[union-attr]
        assert (output == "21 °C, sunny") if ran else ("error" in output), output  # (the SDK's words for it)
        # the answer, as far as the same max_tokens lets it go
        assert result.final_output and ANSWER.startswith(result.final_output), result.final_output
    finally:
        s.stop()
