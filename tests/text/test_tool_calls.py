"""Each family's native tool calls read back into OpenAI's calls (text/tools/), the format chosen by what the
publisher's own chat template contains (the templates come from llama.cpp's pinned source distribution,
tests/llama_source.py): one hand-written native reply per format, read whole and in any pieces into the same
reasoning, content and calls; every template's own rendering of a turn with calls read back into those calls;
text that is not a valid call stays text, and a marker never goes out as content."""

from __future__ import annotations

import copy
import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.llama_source import chat_templates
from tokenwing.testmodel.templates import HARMONY
from tokenwing.text.chat import CHATML, ChatTemplate
from tokenwing.text.tools.base import Tools, cut_arguments, typed_value
from tokenwing.text.tools.reply import GENERIC, ReplyReader, prepare, syntax

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather now, in °C",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                "required": ["city"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "description": "The time in a zone",
            "parameters": {"type": "object", "properties": {"zone": {"type": "string"}}},
        },
    },
]
WEATHER = ("get_weather", {"city": "Zürich", "days": 2})
TIME = ("get_time", {"zone": "Europe/Zürich"})
THOUGHT = "The user wants the weather; call the tool."
NS = "]<]minimax[>["  # MiniMax M3's namespace token, before each of its tags

# (template, format, the prompt's end, a native reply as the model writes it, reasoning, content, calls)
NATIVE: list[tuple[str, str, str, str, str, str, list[tuple[str, dict[str, Any]]]]] = [
    (
        "Qwen-Qwen3-0.6B.jinja",
        "qwen",
        "<|im_start|>assistant\n",
        f"<think>\n{THOUGHT}\n</think>\n\nLet me check.\n<tool_call>\n"
        '{"name": "get_weather", "arguments": {"city": "Zürich", "days": 2}}\n</tool_call>\n<tool_call>\n'
        '{"name": "get_time", "arguments": {"zone": "Europe/Zürich"}}\n</tool_call>',
        THOUGHT,
        "Let me check.",
        [WEATHER, TIME],
    ),
    (
        "Qwen3.5-4B.jinja",
        "qwen",
        "<|im_start|>assistant\n<think>\n",
        f"{THOUGHT}\n</think>\n\nLet me check.\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\nZürich\n"
        "</parameter>\n<parameter=days>\n2\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n"
        "<function=get_time>\n<parameter=zone>\nEurope/Zürich\n</parameter>\n</function>\n</tool_call>",
        THOUGHT,
        "Let me check.",
        [WEATHER, TIME],
    ),
    (
        "Qwen3-Coder.jinja",
        "qwen",
        "<|im_start|>assistant\n",
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nZürich\n</parameter>\n<parameter=days>\n2\n"
        "</parameter>\n</function>\n</tool_call>",
        "",
        "",
        [WEATHER],
    ),
    (
        "deepseek-ai-DeepSeek-V3.1.jinja",
        "deepseek-v3",
        "<｜Assistant｜><think>",
        f"{THOUGHT}</think>Let me check.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>"
        '{"city": "Zürich", "days": 2}<｜tool▁call▁end｜><｜tool▁call▁begin｜>get_time<｜tool▁sep｜>'
        '{"zone": "Europe/Zürich"}<｜tool▁call▁end｜><｜tool▁calls▁end｜>',
        THOUGHT,
        "Let me check.",
        [WEATHER, TIME],
    ),
    (
        "deepseek-ai-DeepSeek-V3.2.jinja",
        "deepseek-dsml",
        "<｜Assistant｜><think>",
        f'{THOUGHT}</think>Let me check.\n\n<｜DSML｜function_calls>\n<｜DSML｜invoke name="get_weather">\n'
        '<｜DSML｜parameter name="city" string="true">Zürich</｜DSML｜parameter>\n'
        '<｜DSML｜parameter name="days" string="false">2</｜DSML｜parameter>\n</｜DSML｜invoke>\n'
        '<｜DSML｜invoke name="get_time">\n<｜DSML｜parameter name="zone" string="true">Europe/Zürich'
        "</｜DSML｜parameter>\n</｜DSML｜invoke>\n</｜DSML｜function_calls>",
        THOUGHT,
        "Let me check.",
        [WEATHER, TIME],
    ),
    (
        "deepseek-ai-DeepSeek-V4.jinja",
        "deepseek-dsml",
        "<｜Assistant｜></think>",
        '\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name="get_weather">\n'
        '<｜DSML｜parameter name="city" string="true">Zürich</｜DSML｜parameter>\n'
        '<｜DSML｜parameter name="days" string="false">2</｜DSML｜parameter>\n</｜DSML｜invoke>\n</｜DSML｜tool_calls>',
        "",
        "",
        [WEATHER],
    ),
    (
        "moonshotai-Kimi-K2.jinja",
        "kimi-k2",
        "<|im_assistant|>assistant<|im_middle|>",
        "Let me check.<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0"
        '<|tool_call_argument_begin|>{"city": "Zürich", "days": 2}<|tool_call_end|><|tool_call_begin|>'
        'functions.get_time:1<|tool_call_argument_begin|>{"zone": "Europe/Zürich"}<|tool_call_end|>'
        "<|tool_calls_section_end|>",
        "",
        "Let me check.",
        [WEATHER, TIME],
    ),
    (
        "Kimi-K2-Thinking.jinja",
        "kimi-k2",
        "<|im_assistant|>assistant<|im_middle|>",
        f"<think>{THOUGHT}</think><|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0"
        '<|tool_call_argument_begin|>{"city": "Zürich", "days": 2}<|tool_call_end|><|tool_calls_section_end|>',
        THOUGHT,
        "",
        [WEATHER],
    ),
    (
        "Kimi-K3.jinja",
        "kimi-k3",
        '<|open|>message role="assistant"<|sep|><|open|>think<|sep|>',
        f"{THOUGHT}<|close|>think<|sep|><|open|>response<|sep|>Let me check.<|close|>response<|sep|>"
        '<|open|>tools<|sep|><|open|>call tool="get_weather" index="1"<|sep|><|open|>argument key="city" '
        'type="string"<|sep|>Zürich<|close|>argument<|sep|><|open|>argument key="days" type="number"<|sep|>2'
        '<|close|>argument<|sep|><|close|>call<|sep|><|open|>call tool="get_time" index="2"<|sep|>'
        '<|open|>json type="object"<|sep|>{"zone": "Europe/Zürich"}<|close|>json<|sep|><|close|>call<|sep|>'
        "<|close|>tools<|sep|><|close|>message<|sep|><|end_of_msg|>",
        THOUGHT,
        "Let me check.",
        [WEATHER, TIME],
    ),
    (
        "GLM-4.6.jinja",
        "glm",
        "<|assistant|>",
        f"\n<think>{THOUGHT}</think>\nLet me check.\n<tool_call>get_weather\n<arg_key>city</arg_key>\n"
        "<arg_value>Zürich</arg_value>\n<arg_key>days</arg_key>\n<arg_value>2</arg_value>\n</tool_call>\n"
        "<tool_call>get_time\n<arg_key>zone</arg_key>\n<arg_value>Europe/Zürich</arg_value>\n</tool_call>",
        THOUGHT,
        "Let me check.",
        [WEATHER, TIME],
    ),
    (
        "GLM-4.7-Flash.jinja",
        "glm",
        "<|assistant|><think>",
        f"{THOUGHT}</think>Let me check.<tool_call>get_weather<arg_key>city</arg_key><arg_value>Zürich"
        "</arg_value><arg_key>days</arg_key><arg_value>2</arg_value></tool_call>",
        THOUGHT,
        "Let me check.",
        [WEATHER],
    ),
    (
        "inclusionai-ling-3.0-flash.jinja",
        "glm",
        "<role>ASSISTANT</role>",
        f"\n<think>{THOUGHT}</think>Let me check.\n<tool_call>get_weather<arg_key>city</arg_key>\n<arg_value>"
        "Zürich</arg_value><arg_key>days</arg_key>\n<arg_value>2</arg_value>\n</tool_call>",
        THOUGHT,
        "Let me check.",
        [WEATHER],
    ),
    (
        "MiniMax-M2.jinja",
        "minimax-m2",
        "]~b]ai\n<think>\n",
        f'{THOUGHT}\n</think>\n\nLet me check.\n<minimax:tool_call>\n<invoke name="get_weather">\n'
        '<parameter name="city">Zürich</parameter>\n<parameter name="days">2</parameter>\n</invoke>\n'
        '<invoke name="get_time">\n<parameter name="zone">Europe/Zürich</parameter>\n</invoke>\n'
        "</minimax:tool_call>",
        THOUGHT,
        "Let me check.",
        [WEATHER, TIME],
    ),
    (
        "MiniMax-M3.jinja",
        "minimax-m3",
        "]~b]ai\n",  # thinking "adaptive" (the default): the model opens its thinking itself
        f'<mm:think>{THOUGHT}</mm:think>Let me check.{NS}<tool_call>\n{NS}<invoke name="get_weather">{NS}<city>Zürich'
        f'{NS}</city>{NS}<days>2{NS}</days>{NS}</invoke>\n{NS}<invoke name="get_time">{NS}<zone>Europe/Zürich'
        f"{NS}</zone>{NS}</invoke>\n{NS}</tool_call>",
        THOUGHT,
        "Let me check.",
        [WEATHER, TIME],
    ),
    (
        "openai-gpt-oss-120b.jinja",
        "harmony",
        "<|start|>assistant",
        f"<|channel|>analysis<|message|>{THOUGHT}<|end|><|start|>assistant<|channel|>commentary<|message|>"
        "Let me check.<|end|><|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json"
        '<|message|>{"city": "Zürich", "days": 2}',  # <|call|> ends generation: it is not in the text
        THOUGHT,
        "Let me check.",
        [WEATHER],
    ),
]

Merged = list[tuple[Any, ...]]


def read(
    template: str,
    reply: str,
    prompt: str = "",
    *,
    tools: list[dict[str, Any]] | None = TOOLS,
    only: str | None = None,
    parallel: bool = True,
    cuts: list[int] | None = None,
) -> Merged:
    """The reply's events, text of one kind merged, calls as (name, arguments object); in pieces cut at `cuts`
    (None: one character at a time)."""
    reader = ReplyReader(syntax(template), prompt, Tools(tools, only) if tools is not None else None, parallel)
    points = sorted(set(cuts)) if cuts is not None else list(range(1, len(reply)))
    events = []
    last = 0
    for c in [*points, len(reply)]:
        events += reader.push(reply[last:c])
        last = c
    events += reader.finish()
    out: Merged = []
    for e in events:
        if e.call is not None:
            assert e.call.id and e.index == sum(1 for o in out if o[0] == "call")
            out.append(("call", e.call.name, json.loads(e.call.arguments)))
        elif out and out[-1][0] == e.kind:
            out[-1] = (e.kind, out[-1][1] + e.text)
        else:
            out.append((e.kind, e.text))
    assert [c.name for c in reader.calls] == [o[1] for o in out if o[0] == "call"]
    return out


def expected(reasoning: str, content: str, calls: list[tuple[str, dict[str, Any]]]) -> Merged:
    out: Merged = [("reasoning", reasoning)] if reasoning else []
    out += [("content", content)] if content else []
    return out + [("call", name, args) for name, args in calls]


@pytest.mark.parametrize(("name", "fmt", "prompt", "reply", "reasoning", "content", "calls"), NATIVE)
def test_native_calls_read_back(
    name: str,
    fmt: str,
    prompt: str,
    reply: str,
    reasoning: str,
    content: str,
    calls: list[tuple[str, dict[str, Any]]],
) -> None:
    source = chat_templates()[name]
    syn = syntax(source)
    assert syn.name == fmt
    # the model is shown the tools, by its template or (DeepSeek V3.1's shows none) by the engine, in the form
    # its family was trained on: the call format it is read back in is the one it is taught
    shown = ChatTemplate(source, "<s>", "</s>").render(
        prepare(syn, [{"role": "user", "content": "Hi"}], TOOLS), tools=TOOLS
    )
    assert "get_weather" in shown and "Weather now, in °C" in shown
    assert syn.describes_tools == (name != "deepseek-ai-DeepSeek-V3.1.jinja")
    want = expected(reasoning, content, calls)
    assert read(source, reply, prompt, cuts=[]) == want  # whole
    assert read(source, reply, prompt) == want  # a character at a time: no marker ever goes out as content


# Templates whose rendering of an assistant turn with calls is read back (every one: Kimi K2-Instruct's and
# K2-Thinking's too, which append to a list as they render calls — text/chat.py `_Mutable`)
ROUND_TRIP = [n for n, *_ in NATIVE]


@pytest.mark.parametrize("name", ROUND_TRIP)
@pytest.mark.parametrize("thinking", [None, True])
def test_the_templates_own_calls_read_back(name: str, thinking: bool | None) -> None:
    """A turn with reasoning and two calls, as the template writes it after the generation prompt, reads back
    into those calls (and that reasoning where the template keeps it): what the model learnt to write is what
    is read."""
    source = chat_templates()[name]
    template = ChatTemplate(source, "<s>", "</s>")
    # thinking on, and the template's default (DeepSeek V3.2's, off, opens its reply with "<think></think>" where
    # its turns write "</think>": a reply there is not a continuation of the prompt, so that one is left out)
    if thinking is None and name == "deepseek-ai-DeepSeek-V3.2.jinja":
        return
    variables: dict[str, Any] = {"enable_thinking": True, "thinking": True} if thinking else {}
    user = [{"role": "user", "content": "Weather?"}]
    n_calls = 1 if syntax(source).name == "harmony" else 2  # gpt-oss's template writes a turn's first call only
    calls = [
        {"id": f"functions.{n}:{i}", "type": "function", "function": {"name": n, "arguments": a}}
        for i, (n, a) in enumerate([WEATHER, TIME][:n_calls])
    ]
    turn = {"role": "assistant", "content": "", "reasoning_content": THOUGHT, "tool_calls": calls}
    prompt = template.render(user, tools=TOOLS, **variables)
    full = template.render([*user, turn], add_generation_prompt=False, tools=TOOLS, **variables)
    assert full.startswith(prompt)
    got = read(source, full[len(prompt) :], prompt, cuts=[])
    assert [o[1:] for o in got if o[0] == "call"] == [WEATHER, TIME][:n_calls]
    assert all(o[1] == THOUGHT for o in got if o[0] == "reasoning")
    # what is left is the turn's end (an end-of-turn token the model's generation stops at)
    assert all(
        o[0] != "content" or o[1].strip() in ("<|im_end|>", "<｜end▁of▁sentence｜>", "<|role_end|>", "[e~[")
        for o in got
    )


def qwen3() -> str:
    return chat_templates()["Qwen-Qwen3-0.6B.jinja"]


def block(name: str, args: Any) -> str:
    call = json.dumps({"name": name, "arguments": args}, ensure_ascii=False)
    return f"<tool_call>\n{call}\n</tool_call>"


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_pieces_do_not_matter(data: st.DataObject) -> None:
    name, _, prompt, reply, reasoning, content, calls = data.draw(st.sampled_from(NATIVE))
    cuts = data.draw(st.lists(st.integers(0, len(reply)), max_size=12))
    assert read(chat_templates()[name], reply, prompt, cuts=cuts) == expected(reasoning, content, calls)


@pytest.mark.parametrize(
    "bad",
    [
        block("delete_everything", {}),  # not a declared function
        '<tool_call>\n{"name": "get_weather", "arguments": [1, 2]}\n</tool_call>',  # arguments not an object
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "x"}} trailing words\n</tool_call>',
        "<tool_call>I would call the weather tool here.</tool_call>",
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nBern\n</function>\n</tool_call>",  # unclosed
    ],
)
def test_what_is_not_a_valid_call_stays_text(bad: str) -> None:
    reply = f"Maybe: {bad} Done."
    got = read(qwen3(), reply)
    assert got == [("content", reply)]
    assert read(qwen3(), reply, cuts=[]) == got


def test_a_marker_is_held_back_until_it_is_whole_or_is_not_one() -> None:
    reader = ReplyReader(syntax(qwen3()), "", Tools(TOOLS))
    assert [e.text for e in reader.push("Sure <tool_")] == ["Sure"]  # (the space waits too: a call may follow)
    assert [e.text for e in reader.push("box> and")] == [" <tool_box> and"]
    reader = ReplyReader(syntax(qwen3()), "", Tools(TOOLS))
    out = reader.push("Sure <tool_") + reader.push("cal") + reader.finish()
    # a call's marker that the reply's end cut off is no text (test_a_reply_cut_anywhere_...); one of no call is
    assert "".join(e.text for e in out) == "Sure" and reader.cut == "dropped"
    reader = ReplyReader(syntax(qwen3()), "", Tools(TOOLS))
    out = reader.push("Sure <tool_") + reader.push("box") + reader.finish()
    assert "".join(e.text for e in out) == "Sure <tool_box" and reader.cut is None


def test_tool_choice_and_parallel_calls() -> None:
    two = block(*WEATHER) + "\n" + block(*TIME)
    # tool_choice naming a function: a call to another one is text
    assert read(qwen3(), two, only="get_weather") == [("call", *WEATHER), ("content", block(*TIME))]
    assert read(qwen3(), two, parallel=False) == [("call", *WEATHER)]  # one call: the rest are dropped
    assert read(qwen3(), two, tools=None) == [("content", two)]  # no tools (tool_choice none): nothing is read


def test_values_are_typed_by_the_schema() -> None:
    assert typed_value("\n2\n", frozenset({"integer"})) == 2
    assert typed_value("2", frozenset({"string"})) == "2"
    assert typed_value("2", None) == "2"  # a parameter the schema does not type stays text
    assert typed_value('{"a": [1]}', frozenset({"object"})) == {"a": [1]}
    assert typed_value("True", frozenset({"boolean"})) is True  # Qwen3.5's template writes Python's str()
    assert typed_value("soon", frozenset({"integer"})) == "soon"  # not JSON: the text, not an error
    assert typed_value("\n  two lines\nof text \n", frozenset({"string"})) == "  two lines\nof text "


def test_older_deepseek_form_and_a_lone_call() -> None:
    v3 = chat_templates()["deepseek-ai-DeepSeek-V3.1.jinja"]
    fenced = (
        "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n"
        '{"city": "Zürich", "days": 2}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>'
    )
    assert read(v3, fenced) == [("call", *WEATHER)]
    lone = '<｜tool▁call▁begin｜>get_time<｜tool▁sep｜>{"zone": "Europe/Zürich"}<｜tool▁call▁end｜><｜tool▁calls▁end｜>'
    assert read(v3, lone) == [("call", *TIME)]


def test_kimi_k3_structure_is_not_content_without_tools() -> None:
    k3 = chat_templates()["Kimi-K3.jinja"]
    reply = "<|open|>response<|sep|>Hello!<|close|>response<|sep|><|close|>message<|sep|>"
    assert read(k3, reply, '<|open|>message role="assistant"<|sep|><|open|>response<|sep|>', tools=None) == [
        ("content", "Hello!")
    ]


def test_a_template_without_tools_gets_the_engines_own_format() -> None:
    """The ChatML fallback (and any template that knows no tools): the tools go into the system message, a
    turn's calls and their results into the messages as text, and the reply is read in that same form."""
    syn = syntax(CHATML)
    assert syn.name == GENERIC and not syn.describes_tools and not syn.renders_calls
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": WEATHER[1]}}
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "21"},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]
    prompt = ChatTemplate(CHATML).render(prepare(syn, messages, TOOLS))
    system, rest = prompt.split("<|im_end|>", 1)
    assert system.startswith("<|im_start|>system\nBe brief.\n\n# Tools") and "Weather now, in °C" in system
    assert "<|im_start|>assistant\n" + block(*WEATHER) + "<|im_end|>" in rest
    assert "<|im_start|>user\n<tool_response>\n21\n</tool_response>\n<tool_response>\nsunny\n</tool_response>" in rest
    assert read(CHATML, block(*WEATHER)) == [("call", *WEATHER)]
    # without tools nothing is added
    assert prepare(syn, messages[:2], None) == messages[:2]


NESTED = [
    {
        "type": "function",
        "function": {
            "name": "plan",
            "parameters": {
                "type": "object",
                "properties": {
                    "title": {"type": "string"},
                    "steps": {
                        "type": "array",
                        "items": {"type": "object", "properties": {"n": {"type": "integer"}, "do": {"type": "string"}}},
                    },
                    "opts": {
                        "type": "object",
                        "properties": {
                            "loud": {"type": "boolean"},
                            "ratio": {"type": "number"},
                            "tags": {"type": "array", "items": {"type": "string"}},
                            "item": {"type": "string"},  # an object's key may be "item" too
                        },
                    },
                    "none_yet": {"type": "array"},
                    "empty": {"type": "object"},
                    "code": {"type": "string"},
                },
            },
        },
    }
]


def test_minimax_m3_nested_arguments_read_back_as_the_template_writes_them() -> None:
    """MiniMax M3 writes an object or array argument as nested elements (its template's to_xml): the reader
    rebuilds the value by the schema, for every type the template writes (an empty array or object is no
    elements at all; a string that holds the format's tags stays that string)."""
    m3 = chat_templates()["MiniMax-M3.jinja"]
    args = {
        "title": "Trip <to> Zürich",
        "steps": [{"n": 1, "do": "pack"}, {"n": 2, "do": "go"}],
        "opts": {"loud": False, "ratio": 0.5, "tags": ["a", "2"], "item": "x"},
        "none_yet": [],
        "empty": {},
        "code": f"{NS}<b>bold{NS}</b>",
    }
    call = {"id": "c", "type": "function", "function": {"name": "plan", "arguments": args}}
    user = [{"role": "user", "content": "Plan it"}]
    template = ChatTemplate(m3, "]~!b[", "[e~[")
    prompt = template.render(user, tools=NESTED)
    full = template.render([*user, {"role": "assistant", "content": "", "tool_calls": [call]}], False, tools=NESTED)
    assert full.startswith(prompt) and f"{NS}<item>{NS}<n>1{NS}</n>" in full
    reply = full[len(prompt) :]
    assert read(m3, reply, prompt, tools=NESTED, cuts=[]) == [("call", "plan", args), ("content", "[e~[\n")]
    # without a schema for them, elements that are all <item> are an array, others an object, text a string
    loose = [{"type": "function", "function": {"name": "plan", "parameters": {"type": "object"}}}]
    got = read(m3, reply, prompt, tools=loose, cuts=[])
    assert got[0][2]["steps"] == [{"n": "1", "do": "pack"}, {"n": "2", "do": "go"}]
    assert got[0][2]["opts"]["tags"] == ["a", "2"] and got[0][2]["empty"] == ""
    # a tag closed out of turn is not a call: the text as written
    bad = f'{NS}<tool_call>\n{NS}<invoke name="plan">{NS}<steps>{NS}<item>{NS}</steps>{NS}</invoke>\n{NS}</tool_call>'
    assert read(m3, bad, prompt, tools=NESTED) == [("content", bad)]


def test_minimax_m3_reply_without_thinking() -> None:
    """M3 answers without thinking after a bare closing tag (its template writes one for a turn without
    reasoning, and its prompt ends with one when thinking is disabled): the tag is the format's, not content."""
    m3 = chat_templates()["MiniMax-M3.jinja"]
    prompt = ChatTemplate(m3).render([{"role": "user", "content": "Hi"}])
    assert read(m3, "</mm:think>Hello!", prompt, tools=None) == [("content", "Hello!")]
    off = ChatTemplate(m3).render([{"role": "user", "content": "Hi"}], thinking_mode="disabled")
    assert off.endswith("</mm:think>") and read(m3, "Hello!", off, tools=None) == [("content", "Hello!")]
    on = ChatTemplate(m3).render([{"role": "user", "content": "Hi"}], thinking_mode="enabled")
    assert read(m3, f"{THOUGHT}</mm:think>Hello!", on, tools=None) == [("reasoning", THOUGHT), ("content", "Hello!")]


def test_a_harmony_template_without_tools_gets_their_definitions() -> None:
    """The generated gpt-oss models' template shows no tools: the engine lists them for the model, which calls
    a function by its own harmony means, and writes a turn's calls into the messages."""
    syn = syntax(HARMONY)
    assert syn.name == "harmony" and not syn.describes_tools and not syn.renders_calls
    system = prepare(syn, [{"role": "user", "content": "Weather?"}], TOOLS)[0]
    assert (
        system["role"] == "system"
        and "Weather now, in °C" in system["content"]
        and "<tool_call>" not in system["content"]
    )


# ------------------------------------------------------------------------------- calls streamed in pieces
def streamed(
    template: str,
    reply: str,
    prompt: str,
    step: int,
    tools: list[dict[str, Any]] | None = None,
) -> tuple[list[Any], dict[int, list[str]], list[Any]]:
    """The reply read `step` characters at a time by a reader that streams calls (a reply under the calls'
    grammar): its events, each call's argument pieces, and its calls; checked on the way: a call's head goes
    out once, before its pieces, with the id and name of the call that follows, and its pieces put together
    are the call's arguments, all of them but at most the closing brace (which the server sends with the
    call)."""
    reader = ReplyReader(syntax(template), prompt, Tools(tools or TOOLS), True, stream_calls=True)
    events = [e for k in range(0, len(reply), step) for e in reader.push(reply[k : k + step])] + reader.finish()
    heads: dict[int, Any] = {}
    pieces: dict[int, list[str]] = {}
    for e in events:
        if e.kind == "call_head":
            assert e.index not in heads and e.call is not None and e.call.arguments == ""
            heads[e.index], pieces[e.index] = e.call, []
        elif e.kind == "call_args":
            assert e.index in heads and e.text
            pieces[e.index].append(e.text)
        elif e.kind == "call":
            assert e.call is not None
            if e.index in heads:  # (else its block ended in the text just pushed: the call goes out whole)
                assert (heads[e.index].id, heads[e.index].name) == (e.call.id, e.call.name)
                sent = "".join(pieces[e.index])
                assert e.call.arguments.startswith(sent) and len(e.call.arguments) - len(sent) <= 1, (step, sent)
    return events, pieces, reader.calls


@pytest.mark.parametrize(("name", "fmt", "prompt", "reply", "reasoning", "content", "calls"), NATIVE)
def test_every_format_streams_a_calls_arguments_in_pieces(
    name: str,
    fmt: str,
    prompt: str,
    reply: str,
    reasoning: str,
    content: str,
    calls: list[tuple[str, dict[str, Any]]],
) -> None:
    """Each format's native reply, read under the calls' grammar in pieces of 1, 2, 3, 5 and 8 characters:
    every call streams (a head, then pieces: one per argument at least, where the text comes a character at a
    time), the pieces make that call's arguments, and the reply reads into the same reasoning, content and
    calls as the non-streaming reader's."""
    source = chat_templates()[name]
    whole = read(source, reply, prompt, cuts=[])
    assert whole == expected(reasoning, content, calls)
    for step in (1, 2, 3, 5, 8):
        events, pieces, got = streamed(source, reply, prompt, step)
        assert [(c.name, json.loads(c.arguments)) for c in got] == calls
        assert "".join(e.text for e in events if e.kind == "content") == content
        assert sorted(pieces) == list(range(len(calls))), step  # every call streamed: its head went out
        if step == 1:
            assert [len(pieces[i]) >= len(args) for i, (_, args) in enumerate(calls)] == [True] * len(calls)
    if fmt == "kimi-k2":  # K2 writes each call's id itself: the head carries it
        _, _, got = streamed(source, reply, prompt, 1)
        assert [c.id for c in got] == [f"functions.{n}:{i}" for i, (n, _) in enumerate(calls)]


def test_minimax_m3_streams_nested_arguments_whole() -> None:
    """MiniMax M3's nested elements (an object, an array of objects) go out as one piece each, once the
    element's own closing tag is written: a nested element's inner closing tags fix nothing yet. Every kind of
    value its template writes (empty arrays and objects, a string holding the format's tags, a key named
    item) streams into the arguments the whole read gives."""
    m3 = chat_templates()["MiniMax-M3.jinja"]
    template = ChatTemplate(m3, "]~!b[", "[e~[")
    user: list[dict[str, Any]] = [{"role": "user", "content": "Plan it"}]
    prompt = template.render(user, tools=NESTED)

    def reply(args: dict[str, Any]) -> str:
        call = {"id": "c", "type": "function", "function": {"name": "plan", "arguments": args}}
        turn = [*user, {"role": "assistant", "content": "", "tool_calls": [call]}]
        return template.render(turn, False, tools=NESTED)[len(prompt) :]

    args = {"title": "Trip", "steps": [{"n": 1, "do": "pack"}, {"n": 2, "do": "go"}], "opts": {"loud": False}}
    assert f"{NS}<steps>{NS}<item>" in reply(args)
    _, pieces, got = streamed(m3, reply(args), prompt, 1, tools=NESTED)
    assert [(c.name, json.loads(c.arguments)) for c in got] == [("plan", args)]
    steps = '[{"n": 1, "do": "pack"}, {"n": 2, "do": "go"}]'
    assert pieces[0] == ["{", '"title": "Trip"', f', "steps": {steps}', ', "opts": {"loud": false}', "}"]
    every = {
        "title": "Trip <to> Zürich",
        "steps": [{"n": 1, "do": "pack"}],
        "opts": {"loud": False, "ratio": 0.5, "tags": ["a", "2"], "item": "x"},
        "none_yet": [],
        "empty": {},
        "code": f"{NS}<b>bold{NS}</b>",
    }
    for step in (1, 3):
        _, pieces, got = streamed(m3, reply(every), prompt, step, tools=NESTED)
        assert [(c.name, json.loads(c.arguments)) for c in got] == [("plan", every)]
        # "{", one piece per argument, and the closing brace where the invoke ends before the block does
        assert pieces[0][0] == "{" and len(pieces[0]) - (pieces[0][-1] == "}") == 1 + len(every), pieces


def test_a_streamed_harmony_call_cut_off_is_not_sent_again() -> None:
    """gpt-oss: a call's head goes out at its header's <|message|>, its arguments as the JSON is written; a
    reply cut off inside the arguments ends the call with its arguments so far, no text. A message to a
    function the request does not allow streams nothing and is text at its end, as without streaming."""
    source = chat_templates()["openai-gpt-oss-120b.jinja"]
    head = "<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
    events, pieces, got = streamed(source, head + '{"city": "Zürich", "da', "<|start|>assistant", 1)
    assert pieces == {0: ["{", '"city": "Zürich"']}
    assert [(c.name, c.arguments) for c in got] == [("get_weather", '{"city": "Zürich"')]
    assert not [e for e in events if e.kind == "content"]
    other = head.replace("get_weather", "rm_rf") + "{}"
    events, pieces, got = streamed(source, other, "<|start|>assistant", 1)
    assert not got and not pieces and [(e.kind, e.text, e.streamed) for e in events] == [("content", "{}", False)]


# ------------------------------------------------------------------------------- calls cut off by the reply's end
def _merged(events: list[Any]) -> tuple[str, str, list[Any], dict[int, str]]:
    reasoning = "".join(e.text for e in events if e.kind == "reasoning")
    content = "".join(e.text for e in events if e.kind == "content" and not e.streamed)
    calls = [e.call for e in events if e.kind == "call"]
    sent: dict[int, str] = {}
    for e in events:
        if e.kind == "call_head":
            sent[e.index] = ""
        elif e.kind == "call_args":
            sent[e.index] += e.text
    return reasoning, content, calls, sent


@pytest.mark.parametrize(("name", "fmt", "prompt", "reply", "reasoning", "content", "calls"), NATIVE)
@pytest.mark.parametrize("stream", [False, True])
def test_a_reply_cut_anywhere_never_shows_a_call_as_text(
    name: str,
    fmt: str,
    prompt: str,
    reply: str,
    reasoning: str,
    content: str,
    calls: list[tuple[str, dict[str, Any]]],
    stream: bool,
) -> None:
    """Each format's native reply cut off after every one of its characters (max_tokens, or the model stopping
    inside a block), read a character at a time, tool_choice auto (`stream` False) and under the calls' grammar
    (calls streamed in pieces): the content is always a start of the whole reply's content, never any of the
    block's markup; each call that went out is one of the reply's calls with its arguments so far, a start of
    the JSON text its whole arguments have; what went out at one cut is kept at the next (a call's arguments
    only grow, a call once out stays out); a call whose function's name is not whole yet is not sent at all;
    `cut` says "arguments" exactly where a call went out with arguments that are not whole."""
    syn = syntax(chat_templates()[name])
    ends = (*(syn.think or ()), "<|end|>", "<|call|>", "<|return|>")
    whole = [(n, json.dumps(a, ensure_ascii=False)) for n, a in calls]
    reader = ReplyReader(syn, prompt, Tools(TOOLS), True, stream_calls=stream)
    pushed: list[Any] = []
    before: list[tuple[str, str]] = []
    checked = 0
    for n in range(len(reply) + 1):
        if n:
            pushed += reader.push(reply[n - 1])
        done = copy.deepcopy(reader)
        said, text, got, sent = _merged(pushed + done.finish())
        at = f"cut after {n} characters: {reply[:n]!r}"
        # (a reasoning tag's or a harmony message end's start at the very end is their reader's text: it may be
        # the reply's own; those are one token each in the families' vocabularies, which no max_tokens splits;
        # whitespace that would have been the format's before a block is the reply's own where none follows)
        assert content.startswith(_less_start(text, ends).rstrip()), (at, text)
        assert _squeezed(reasoning).startswith(_squeezed(_less_start(said, ends))), (at, said)
        got_pairs = [(c.name, c.arguments) for c in got]
        assert len(got_pairs) <= len(whole), at
        for (fn, args), (want_fn, want_args) in zip(got_pairs, whole, strict=False):
            assert fn == want_fn and want_args.startswith(args), (at, got_pairs)
        for c in got:  # a streamed call ends with what its pieces sent, and more
            assert c.arguments.startswith(sent.get(got.index(c), "")), at
        for (fn, args), (was_fn, was_args) in zip(got_pairs, before, strict=False):
            assert fn == was_fn and args.startswith(was_args), (at, before, got_pairs)
        assert len(got_pairs) >= len(before), (at, before, got_pairs)
        assert [c.name for c in done.calls] == [c.name for c in got]
        open_args = any(not isinstance(json.loads(a) if _is_json(a) else None, dict) for _, a in got_pairs)
        assert (done.cut == "arguments") == open_args, (at, done.cut, got_pairs)
        if reply[:n].endswith("Zür"):  # a call cut inside its first argument's value goes out with it so far
            k = len(got_pairs) - 1
            assert k >= 0 and got_pairs[k][1] == whole[k][1][: whole[k][1].index("Zür") + 3], (at, got_pairs)
            assert got_pairs[:k] == whole[:k] and done.cut == "arguments", (at, got_pairs)
            checked += 1
        before = got_pairs
    assert checked == len(calls)  # (every call of the reply was cut there once: its first value has "Zür")
    assert before == whole  # the whole reply: every call, whole


def _less_start(text: str, markers: tuple[str, ...]) -> str:
    """`text` less an end that is the start of one of `markers`."""
    for k in range(len(text), 0, -1):
        if any(m.startswith(text[-k:].lstrip()) and text[-k:].strip() for m in markers):
            return text[:-k]
    return text


def _squeezed(text: str) -> str:
    return "".join(text.split())


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


@pytest.mark.parametrize(
    ("text", "read"),
    [
        ("", {}),
        ("{", {}),
        ('{"city": "Zü', {}),
        ('{"city": "Zürich", "da', {"city": "Zürich"}),
        ('{"city": "Zürich", "days": 2', {"city": "Zürich"}),  # (2 could be 21)
        ('{"a": [1, {"b": "x\\u00', {}),
        ('{"a": tr', {}),
        ('{"a": -', {}),
        ("{oops", None),
        ("not json", None),
        ("[1", None),
        ('{"a": 1} and more', None),
        ('{"a": tx', None),
        ('{"a": -}', None),
        ('{"a": "\\q', None),
        ('{"a" 1', None),
    ],
)
def test_a_cut_calls_arguments_sent_back_read_as_their_whole_members(text: str, read: dict[str, Any] | None) -> None:
    """A client sends a call max_tokens cut back as it got it (an agent: the call, then its tool's error): its
    arguments' JSON so far reads as the members written whole; text that is no start of an object's JSON is
    not a cut call (the server's 400)."""
    assert cut_arguments(text) == read


ALARM = [
    {
        "type": "function",
        "function": {
            "name": "set_alarm",
            "parameters": {
                "type": "object",
                "properties": {"days": {"type": "array", "items": {"type": "string"}}, "at": {"type": "number"}},
            },
        },
    }
]
ALARM_ARGS = {"days": ["mon", "tue"], "at": 7.5}
# nested values as the calls' grammar writes them: compact JSON (the JSON formats) or JSON inside an element
J = '{"days":["mon","tue"],"at":7.50}'
COMPACT = [
    ("Qwen-Qwen3-0.6B.jinja", f'<tool_call>\n{{"name": "set_alarm", "arguments": {J}}}'),
    ("Qwen3.5-4B.jinja", '<tool_call>\n<function=set_alarm>\n<parameter=days>\n["mon","tue"]\n</parameter>\n'),
    ("deepseek-ai-DeepSeek-V3.1.jinja", f"<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>set_alarm<｜tool▁sep｜>{J}"),
    ("moonshotai-Kimi-K2.jinja", f"<|tool_calls_section_begin|><|tool_call_begin|>functions.set_alarm:0"
                                 f"<|tool_call_argument_begin|>{J}"),
    ("GLM-4.7-Flash.jinja", '<tool_call>set_alarm<arg_key>days</arg_key><arg_value>["mon","tue"]</arg_value>'),
    ("MiniMax-M2.jinja", '<minimax:tool_call>\n<invoke name="set_alarm">\n<parameter name="days">["mon","tue"]'
                         "</parameter>"),
    ("openai-gpt-oss-120b.jinja", f"<|channel|>commentary to=functions.set_alarm <|constrain|>json<|message|>{J}"),
]  # fmt: skip


@pytest.mark.parametrize(("name", "reply"), COMPACT)
def test_a_cut_calls_arguments_are_a_start_of_their_json_as_sent(name: str, reply: str) -> None:
    """A call cut inside a nested value that the model (its grammar) wrote compact: its arguments so far are
    still the start of the JSON text the whole call's arguments are sent as (json.dumps: `, ` and `: `, numbers
    re-serialised), after every character, streamed or not."""
    whole = json.dumps(ALARM_ARGS, ensure_ascii=False)
    for stream in (False, True):
        reader = ReplyReader(syntax(chat_templates()[name]), "", Tools(ALARM), True, stream_calls=stream)
        seen = 0
        for n in range(len(reply)):
            reader.push(reply[n])
            got = copy.deepcopy(reader).finish()
            calls = [e.call for e in got if e.call is not None and e.kind == "call"]
            if calls:
                assert whole.startswith(calls[0].arguments), (reply[: n + 1], calls[0].arguments)
                seen = max(seen, len(calls[0].arguments))
        assert seen >= len('{"days": ["mon", "tue"]'), seen
