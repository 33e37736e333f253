"""Mistral's tool calls (text/tools/mistral.py): `[TOOL_CALLS]NAME[ARGS]{JSON}` as Ministral 3's and Mistral
Small 4's templates write them (Small 3.2's with its `[CALL_ID]`), read through the same checks as every other
format's (tests/text/test_tool_calls.py's, which is at the file-size limit: its checks are called here with
Mistral's replies) — whole and a character at a time, streamed in pieces under the calls' grammar, cut after any
character — and the template's own rendering of a turn with calls and results read back."""

from __future__ import annotations

import json
from typing import Any

import pytest

from tests.llama_source import chat_templates
from tests.text import test_tool_calls as shared  # (its test functions by module: not collected here again)
from tests.text.test_tool_calls import THOUGHT, TIME, TOOLS, WEATHER, read, streamed
from tokenwing.text.chat import ChatTemplate
from tokenwing.text.tools.reply import GENERIC, syntax

MINISTRAL = "mistralai-Ministral-3-14B-Reasoning-2512.jinja"  # Small 4's form: [THINK], [TOOL_CALLS]…[ARGS]
SMALL_32 = "Mistral-Small-3.2-24B-Instruct-2506.jinja"  # the same with [CALL_ID]
CALLS = '[TOOL_CALLS]get_weather[ARGS]{"city": "Zürich", "days": 2}[TOOL_CALLS]get_time[ARGS]{"zone": "Europe/Zürich"}'

# (template, format, the prompt's end, a native reply as the model writes it, reasoning, content, calls)
NATIVE: list[tuple[str, str, str, str, str, str, list[tuple[str, dict[str, Any]]]]] = [
    (
        MINISTRAL,
        "mistral",
        "[/INST]",
        f"[THINK]{THOUGHT}[/THINK]Let me check.{CALLS}",
        THOUGHT,
        "Let me check.",
        [WEATHER, TIME],
    ),
    (
        SMALL_32,
        "mistral",
        "[/INST]",
        'Let me check.[TOOL_CALLS]get_weather[CALL_ID]a1B2c3D4e[ARGS]{"city":"Zürich","days":2}',
        "",
        "Let me check.",
        [WEATHER],
    ),
]


@pytest.mark.parametrize("case", NATIVE)
def test_mistral_calls_read_back(case: tuple[Any, ...]) -> None:
    shared.test_native_calls_read_back(*case)


@pytest.mark.parametrize("case", NATIVE)
def test_mistral_calls_stream_in_pieces(case: tuple[Any, ...]) -> None:
    shared.test_every_format_streams_a_calls_arguments_in_pieces(*case)


@pytest.mark.parametrize("case", NATIVE)
@pytest.mark.parametrize("stream", [False, True])
def test_a_mistral_reply_cut_anywhere_never_shows_a_call_as_text(case: tuple[Any, ...], stream: bool) -> None:
    shared.test_a_reply_cut_anywhere_never_shows_a_call_as_text(*case, stream=stream)


def test_small_32s_call_id_is_the_calls_id() -> None:
    """Small 3.2 writes each call's id itself ([CALL_ID]): the call carries it, streamed or not."""
    source = chat_templates()[SMALL_32]
    for step in (1, 4):
        _, _, got = streamed(source, NATIVE[1][3], "[/INST]", step)
        assert [c.id for c in got] == ["a1B2c3D4e"]


def test_the_templates_own_turn_reads_back_and_renders_the_results() -> None:
    """A turn with two calls as Ministral 3's template writes it after the prompt reads back into those calls
    (what is left is its </s>); the results that follow are written by the template itself."""
    source = chat_templates()[MINISTRAL]
    template = ChatTemplate(source, "<s>", "</s>")
    user = [{"role": "user", "content": "Weather?"}]
    calls = [
        {"id": f"call{i}", "type": "function", "function": {"name": n, "arguments": json.dumps(a)}}
        for i, (n, a) in enumerate([WEATHER, TIME])
    ]
    turn = {"role": "assistant", "content": "", "tool_calls": calls}
    prompt = template.render(user, tools=TOOLS)
    full = template.render([*user, turn], add_generation_prompt=False, tools=TOOLS)
    assert full.startswith(prompt)
    got = read(source, full[len(prompt) :], prompt, cuts=[])
    assert got == [("call", *WEATHER), ("call", *TIME), ("content", "</s>")]
    results = [{"role": "tool", "tool_call_id": f"call{i}", "content": f"result {i}"} for i in range(2)]
    after = template.render([*user, turn, *results], tools=TOOLS)
    assert after.endswith("[TOOL_RESULTS]result 0[/TOOL_RESULTS][TOOL_RESULTS]result 1[/TOOL_RESULTS]")


@pytest.mark.parametrize(
    "bad",
    [
        "[TOOL_CALLS]get weather[ARGS]{}",  # a space in the name: not a call's head
        '[TOOL_CALLS]get_weather[ARGS]["Zürich"]',  # arguments not an object
        '[TOOL_CALLS]get_weather[ARGS]{"city": Zürich}',  # not JSON
        '[TOOL_CALLS]set_alarm[ARGS]{"at": "7:00"}',  # a function the request does not declare
    ],
)
def test_what_is_not_a_valid_call_stays_text(bad: str) -> None:
    source = chat_templates()[MINISTRAL]
    for cuts in ([], None):
        assert read(source, f"Sure.{bad} Done.", "[/INST]", cuts=cuts) == [("content", f"Sure.{bad} Done.")]


def test_nemos_older_form_is_not_this_format() -> None:
    """Mistral Nemo's template ([TOOL_CALLS] before a JSON list, no [ARGS]) gets the engine's own format."""
    assert syntax(chat_templates()["mistralai-Mistral-Nemo-Instruct-2407.jinja"]).name == GENERIC
    assert syntax(chat_templates()["unsloth-mistral-Devstral-Small-2507.jinja"]).name == "mistral"
