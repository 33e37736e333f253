"""Tool calls through a real `tokenwing serve`, with the official `openai` client: a generated model carrying
each family's own chat template (the publisher's, from llama.cpp's pinned source distribution, written into
the GGUF by gguf-py's metadata copier), a request with tools, the family's native call as the reply, OpenAI's
`tool_calls` back (non-streaming, and streamed as OpenAI streams them), the result sent back, and the next
prompt rendering it.

Random weights never write a call, so the replies' tokens are scripted (TOKENWING_TEST_TOKENS, test-only, one
reply per request): the tokenizer, the text stream, the readers and the HTTP shapes are the real ones."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.conftest import ModelFactory
from tests.engine.test_server import KEY, Server
from tests.engine.test_server_apply_template import _templated
from tests.llama_source import chat_templates
from tokenwing.format.reader import ModelFile
from tokenwing.format.repack import repack
from tokenwing.text.tokenizer import tokenizer_from_metadata
from tokenwing.text.tools.reply import preserved_ids, syntax

EOS = "<｜end▁of▁sentence｜>"  # the generated deepseek2 model's end of generation
# typed loosely: the client's own parameter types are unions of TypedDicts
TOOLS: list[Any] = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather now in a city, in °C",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    }
]
ARGS = {"city": "Zürich"}
RESULT = "21 °C, sunny"
ANSWER = "It is 21 °C in Zürich."
USER: list[Any] = [{"role": "user", "content": "What is the weather in Zürich?"}]
THOUGHT = "The user wants the weather."
NS = "]<]minimax[>["  # MiniMax M3's namespace token, before each of its tags

# template → (the native call as the family writes it, the answer after the result, reasoning, content)
FAMILIES: dict[str, tuple[str, str, str | None, str | None]] = {
    "Qwen-Qwen3-0.6B.jinja": (
        f'<think>\n{THOUGHT}\n</think>\n\n<tool_call>\n{{"name": "get_weather", "arguments": {{"city": "Zürich"}}}}'
        "\n</tool_call>",
        f"<think>\n\n</think>\n\n{ANSWER}",
        THOUGHT,
        None,
    ),
    "Qwen3.5-4B.jinja": (  # its prompt opens the thinking
        f"{THOUGHT}\n</think>\n\nLet me check.\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\nZürich\n"
        "</parameter>\n</function>\n</tool_call>",
        f"Got it.\n</think>\n\n{ANSWER}",
        THOUGHT,
        "Let me check.",
    ),
    "deepseek-ai-DeepSeek-V3.1.jinja": (
        '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Zürich"}<｜tool▁call▁end｜>'
        "<｜tool▁calls▁end｜>",
        ANSWER,
        None,
        None,
    ),
    "deepseek-ai-DeepSeek-V4.jinja": (
        '\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name="get_weather">\n<｜DSML｜parameter name="city" string="true">'
        "Zürich</｜DSML｜parameter>\n</｜DSML｜invoke>\n</｜DSML｜tool_calls>",
        ANSWER,
        None,
        None,
    ),
    "moonshotai-Kimi-K2.jinja": (
        "Checking.<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>"
        '{"city": "Zürich"}<|tool_call_end|><|tool_calls_section_end|>',
        ANSWER,
        None,
        "Checking.",
    ),
    "Kimi-K3.jinja": (  # its prompt opens the think section
        f"{THOUGHT}<|close|>think<|sep|><|open|>response<|sep|><|close|>response<|sep|><|open|>tools<|sep|>"
        '<|open|>call tool="get_weather" index="1"<|sep|><|open|>argument key="city" type="string"<|sep|>Zürich'
        "<|close|>argument<|sep|><|close|>call<|sep|><|close|>tools<|sep|><|close|>message<|sep|>",
        f"Done.<|close|>think<|sep|><|open|>response<|sep|>{ANSWER}<|close|>response<|sep|><|close|>message<|sep|>",
        THOUGHT,
        None,
    ),
    "GLM-4.7-Flash.jinja": (  # its prompt opens the thinking
        f"{THOUGHT}</think><tool_call>get_weather<arg_key>city</arg_key><arg_value>Zürich</arg_value></tool_call>",
        f"</think>{ANSWER}",
        THOUGHT,
        None,
    ),
    "MiniMax-M2.jinja": (  # its prompt opens the thinking
        f'{THOUGHT}\n</think>\n\n<minimax:tool_call>\n<invoke name="get_weather">\n<parameter name="city">Zürich'
        "</parameter>\n</invoke>\n</minimax:tool_call>",
        f"Done.\n</think>\n\n{ANSWER}",
        THOUGHT,
        None,
    ),
    "MiniMax-M3.jinja": (  # its thinking "adaptive" by default: the model opens it, or answers after </mm:think>
        f'<mm:think>{THOUGHT}</mm:think>{NS}<tool_call>\n{NS}<invoke name="get_weather">{NS}<city>Zürich{NS}</city>'
        f"{NS}</invoke>\n{NS}</tool_call>",
        f"</mm:think>{ANSWER}",
        THOUGHT,
        None,
    ),
    "openai-gpt-oss-120b.jinja": (
        f"<|channel|>analysis<|message|>{THOUGHT}<|end|><|start|>assistant<|channel|>commentary "
        'to=functions.get_weather <|constrain|>json<|message|>{"city":"Zürich"}<|call|>',
        f"<|channel|>final<|message|>{ANSWER}<|return|>",
        THOUGHT,
        None,
    ),
    "mistralai-Ministral-3-14B-Reasoning-2512.jinja": (  # Mistral Small 4's form: no end marker after the JSON
        f'[THINK]{THOUGHT}[/THINK][TOOL_CALLS]get_weather[ARGS]{{"city": "Zürich"}}',
        ANSWER,
        THOUGHT,
        None,
    ),
}


def script(model: Path, replies: list[str], ends: list[str] | None = None) -> str:
    """TOKENWING_TEST_TOKENS for these replies, one per request, each ended by a token that ends generation
    (`ends`: each reply's own; the model's EOS by default)."""
    with ModelFile.open(str(model)) as mf:
        kv = {k: v.value for k, v in mf.header.kv.items()}
    tok = tokenizer_from_metadata(kv, str(model))
    shown = preserved_ids(syntax(str(kv.get("tokenizer.chat_template") or "")), tok)
    out = []
    for text, end in zip(replies, ends or [EOS] * len(replies), strict=True):
        (eos,) = tok.encode(end, special=True, add_bos=False)
        assert eos in tok.eos_ids
        ids = tok.encode(text, special=True, add_bos=False)
        # every marker comes back as its text (as a token, one the format's reply prints, or as plain text)
        assert b"".join(tok.piece_bytes(i) if i in shown else tok.token_bytes(i) for i in ids).decode() == text
        out.append(",".join(str(i) for i in [*ids, eos]))
    return ";".join(out)


@pytest.fixture(scope="module")
def base_model(repacked_factory: ModelFactory) -> Path:
    return repacked_factory(arch="deepseek2", type="Q8_0")


def _serve(model: Path, replies: list[str], monkeypatch: pytest.MonkeyPatch) -> Server:
    monkeypatch.setenv("TOKENWING_TEST_TOKENS", script(model, replies))
    return Server(model, "--ctx", "4096")  # the templates' tool descriptions are long for the test vocabulary


def _post(server: Server, path: str, body: dict[str, Any]) -> Any:
    r = httpx.post(server.url + path, json=body, headers={"Authorization": f"Bearer {KEY}"}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


@pytest.mark.parametrize("template", list(FAMILIES))
def test_round_trip(
    template: str, tmp_path: Path, model_factory: ModelFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    round_trip(_templated(model_factory, tmp_path, template), template, monkeypatch)


# Issue 25 and 27's families: a generated model of the family itself (its architecture and its own vocabulary, whose
# markers are its tokens), carrying the publisher's template in its native call format, and the token that ends
# its replies. GLM-5: llama.cpp ships no GLM-5 template; GLM-4.7-Flash's is its vocabulary's (GLM-5 uses GLM-4.7's
# tokenizer: docs/families/glm-dsa.md) and writes the same <arg_key>/<arg_value> calls. Qwen3.8 Flash Next has
# Qwen3.5's vocabulary and its XML calls; its QSA keeps every cell of the server's 4096-position context (top-k 4096:
# QSA is dense attention up to top-k + ratio - 2 positions, and the engine caps the context there).
NATIVE: dict[str, tuple[str, str, dict[str, object]]] = {
    "kimi-k3": ("Kimi-K3.jinja", "[EOS]", {}),
    "minimax-m2": ("MiniMax-M2.jinja", "[e~[", {}),
    "glm-dsa": ("GLM-4.7-Flash.jinja", "<|endoftext|>", {"n_layer": 3, "indexer_types": (1, 0, 1)}),
    "qwen4exp": ("Qwen3.5-4B.jinja", "<|im_end|>", {"indexer_top_k": 4096}),
    "deepseek4": ("deepseek-ai-DeepSeek-V4.jinja", EOS, {}),  # DSML on V3's markers (its joyai-llm vocabulary)
    "mistral4": ("mistralai-Ministral-3-14B-Reasoning-2512.jinja", "</s>", {}),  # its tekken vocabulary
}


@pytest.mark.parametrize("arch", list(NATIVE))
def test_round_trip_on_the_new_families_models(
    arch: str, tmp_path: Path, model_factory: ModelFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    template, end, shape = NATIVE[arch]
    src = model_factory(arch=arch, type="Q8_0", **shape)
    round_trip(_with_template(src, tmp_path, template), template, monkeypatch, end)


def _with_template(src: Path, root: Path, template: str) -> Path:
    """`src` carrying `template` (gguf-py's own metadata copier), repacked."""
    jinja = root / "template.jinja"
    jinja.write_text(chat_templates()[template], encoding="utf-8")
    gguf = root / "templated.gguf"
    copier = [sys.executable, "-m", "gguf.scripts.gguf_new_metadata"]
    r = subprocess.run(
        [*copier, str(src), str(gguf), "--force", "--chat-template-file", str(jinja)], capture_output=True, text=True
    )
    assert r.returncode == 0, r.stderr
    out = root / "templated.tw.gguf"
    repack([str(gguf)], str(out), show_progress=False)
    return out


def round_trip(model: Path, template: str, monkeypatch: pytest.MonkeyPatch, end: str = EOS) -> None:
    """The family's native call through the official client (non-streaming, streamed, the streaming helper), the
    result sent back, and the answer, each reply ended by `end`."""
    call, answer, reasoning, content = FAMILIES[template]
    monkeypatch.setenv("TOKENWING_TEST_TOKENS", script(model, [call, call, call, answer], [end] * 4))
    server = Server(model, "--ctx", "4096")  # the templates' tool descriptions are long for the test vocabulary
    try:
        client = server.client()
        # 1. non-streaming: the native call comes back as OpenAI's tool_calls
        r = client.chat.completions.create(model="m", messages=USER, tools=TOOLS, max_tokens=400)
        choice = r.choices[0]
        assert choice.finish_reason == "tool_calls", choice
        msg = choice.message
        assert msg.content == content
        assert (msg.model_extra or {}).get("reasoning_content") == reasoning
        assert msg.tool_calls is not None and len(msg.tool_calls) == 1
        tc: Any = msg.tool_calls[0]
        assert tc.type == "function" and tc.id and tc.function.name == "get_weather"
        assert json.loads(tc.function.arguments) == ARGS

        # 2. streamed: the call's id, type and name first (arguments empty), then its arguments
        stream = client.chat.completions.create(
            model="m",
            messages=USER,
            tools=TOOLS,
            max_tokens=400,
            stream=True,
        )
        deltas: list[Any] = []
        finish, text = None, []
        for chunk in stream:
            if not chunk.choices:
                continue
            d = chunk.choices[0].delta
            text.append(d.content or "")
            deltas += d.tool_calls or []
            finish = chunk.choices[0].finish_reason or finish
        assert finish == "tool_calls"
        assert "".join(text) == (content or "")  # no marker ever went out as text
        first, rest = deltas[0], deltas[1:]
        assert first.index == 0 and first.id and first.type == "function"
        assert first.function is not None and first.function.name == "get_weather" and first.function.arguments == ""
        assert all(d.index == 0 and d.id is None and d.function and d.function.name is None for d in rest)
        assert json.loads("".join(d.function.arguments or "" for d in rest if d.function)) == ARGS

        # 2b. the official client's streaming helper puts those deltas together into the call
        with client.chat.completions.stream(model="m", messages=USER, tools=TOOLS, max_tokens=400) as helper:
            done = [e for e in helper if e.type == "tool_calls.function.arguments.done"]
            final = helper.get_final_completion()
        assert [(e.name, json.loads(e.arguments)) for e in done] == [("get_weather", ARGS)]
        # (its content is "" rather than None: the stream's first delta opens the message with an empty content)
        assert final.choices[0].finish_reason == "tool_calls" and (final.choices[0].message.content or None) == content
        (whole,) = final.choices[0].message.tool_calls or []
        assert whole.id and whole.function.name == "get_weather" and json.loads(whole.function.arguments) == ARGS

        # 3. the result goes back; the next prompt renders the call and the result, and the model answers
        assistant = msg.model_dump(exclude_none=True)
        turn2: list[Any] = [*USER, assistant, {"role": "tool", "tool_call_id": tc.id, "content": RESULT}]
        prompt = _post(server, "/apply-template", {"messages": turn2, "tools": TOOLS})["prompt"]
        after_user = prompt.split("What is the weather in Zürich?", 1)[1]
        assert "get_weather" in after_user and "Zürich" in after_user and RESULT in after_user
        tokens = _post(server, "/tokenize", {"content": prompt, "add_special": True})["tokens"]
        r2 = client.chat.completions.create(model="m", messages=turn2, tools=TOOLS, max_tokens=400)
        assert r2.choices[0].finish_reason == "stop"
        assert r2.choices[0].message.content == ANSWER and not r2.choices[0].message.tool_calls
        assert r2.usage is not None and r2.usage.prompt_tokens == len(tokens)  # the chat ran that very prompt
    finally:
        server.stop()


def test_gpt_oss_vocabulary(repacked_factory: ModelFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    """The generated gpt-oss model, its own vocabulary and template: <|call|> is a token that ends generation,
    so the call's end never reaches the text; the template shows no tools, so the engine lists them."""
    model = repacked_factory(arch="gpt-oss", type="Q8_0")
    call = (
        f"<|channel|>analysis<|message|>{THOUGHT}<|end|><|start|>assistant<|channel|>commentary "
        'to=functions.get_weather <|constrain|>json<|message|>{"city": "Zürich"}'
    )
    answer = f"<|channel|>final<|message|>{ANSWER}"
    monkeypatch.setenv("TOKENWING_TEST_TOKENS", script(model, [call, answer], ["<|call|>", "<|return|>"]))
    server = Server(model, "--ctx", "4096")
    try:
        client = server.client()
        r = client.chat.completions.create(model="m", messages=USER, tools=TOOLS, max_tokens=200)
        msg: Any = r.choices[0].message
        assert r.choices[0].finish_reason == "tool_calls" and msg.reasoning_content == THOUGHT
        assert msg.tool_calls[0].function.name == "get_weather"
        assert json.loads(msg.tool_calls[0].function.arguments) == ARGS
        turn2 = [*USER, msg.model_dump(exclude_none=True), {"role": "tool", "tool_call_id": msg.tool_calls[0].id}]
        turn2[-1]["content"] = RESULT
        r2 = client.chat.completions.create(model="m", messages=turn2, tools=TOOLS, max_tokens=200)
        assert r2.choices[0].message.content == ANSWER and r2.choices[0].finish_reason == "stop"
    finally:
        server.stop()


# ------------------------------------------------------------------------------------ the generic format, rules
@pytest.fixture(scope="module")
def generic(base_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Server, Path]]:
    """The generated model with the factory's own template, which knows no tools: the engine's format. Every
    reply is first a call, then not a call, then a call to an undeclared function, then that last repeats."""
    mp = pytest.MonkeyPatch()
    replies = [
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Zürich"}}\n</tool_call>',
        ANSWER,
        'Calling. <tool_call>\n{"name": "rm_rf", "arguments": {}}\n</tool_call>',
    ]
    server = _serve(base_model, replies, mp)
    try:
        yield server, base_model
    finally:
        server.stop()
        mp.undo()


def test_generic_format_and_what_is_not_a_call(generic: tuple[Server, Path]) -> None:
    server, _ = generic
    client = server.client()
    r = client.chat.completions.create(model="m", messages=USER, tools=TOOLS, max_tokens=100)
    assert r.choices[0].finish_reason == "tool_calls"
    calls: list[Any] | None = r.choices[0].message.tool_calls
    assert calls is not None and json.loads(calls[0].function.arguments) == ARGS
    # the engine described the tools in the system message (the template would not)
    prompt = _post(server, "/apply-template", {"messages": USER, "tools": TOOLS})["prompt"]
    assert prompt.startswith("# Tools") and "The weather now in a city, in °C" in prompt
    # required without a call: said plainly (the content, finish_reason stop), no error
    r = client.chat.completions.create(model="m", messages=USER, tools=TOOLS, tool_choice="required", max_tokens=50)
    assert r.choices[0].finish_reason == "stop" and r.choices[0].message.content == ANSWER
    # a call to a function that was not declared is not a call: the text as written, never a 500
    bad = 'Calling. <tool_call>\n{"name": "rm_rf", "arguments": {}}\n</tool_call>'
    r = client.chat.completions.create(model="m", messages=USER, tools=TOOLS, max_tokens=100)
    assert r.choices[0].finish_reason == "stop" and r.choices[0].message.content == bad
    assert not r.choices[0].message.tool_calls
    # tool_choice none: the model is not shown the tools, and nothing is read as a call
    r = client.chat.completions.create(model="m", messages=USER, tools=TOOLS, tool_choice="none", max_tokens=100)
    plain = client.chat.completions.create(model="m", messages=USER, max_tokens=100)
    assert r.usage is not None and plain.usage is not None and r.usage.prompt_tokens == plain.usage.prompt_tokens
    assert r.choices[0].message.content == bad and r.choices[0].finish_reason == "stop"


CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Bern"}'}}


@pytest.mark.parametrize(
    ("extra", "param", "words"),
    [
        ({"tools": {"get_weather": {}}}, "tools", "'tools' must be a list"),
        ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools", "tools[0].function.name"),
        ({"tools": [*TOOLS, *TOOLS]}, "tools", "declared twice"),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "strng"}}}]},
            "tools",
            "tools[0].function.parameters.type 'strng' is not a JSON Schema type",
        ),
        (
            {
                "tools": [
                    {
                        "type": "function",
                        "function": {"name": "f", "parameters": {"type": "object", "properties": {"x": {"type": 5}}}},
                    }
                ]
            },
            "tools",
            "tools[0].function.parameters.properties.x.type",
        ),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"required": "x"}}}]},
            "tools",
            "parameters.required must be a list",
        ),
        (
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "get_time"}}},
            "tool_choice",
            "'get_time', which is not in tools",
        ),
        ({"tools": TOOLS, "tool_choice": "always"}, "tool_choice", "'tool_choice' must be"),
        ({"tool_choice": "required"}, "tool_choice", "needs tools"),
        ({"tools": TOOLS, "parallel_tool_calls": "yes"}, "parallel_tool_calls", "boolean"),
        ({"functions": [{"name": "f"}]}, "functions", "use tools"),
        (
            {"messages": [*USER, {"role": "assistant", "tool_calls": [CALL]}, {"role": "tool", "content": "21"}]},
            "messages",
            "messages[2].tool_call_id is required",
        ),
        (
            {
                "messages": [
                    *USER,
                    {"role": "assistant", "tool_calls": [CALL]},
                    {"role": "tool", "tool_call_id": "call_9", "content": "21"},
                ]
            },
            "messages",
            "messages[2].tool_call_id 'call_9' answers no tool call",
        ),
        (
            {"messages": [*USER, {"role": "assistant", "tool_calls": [{**CALL, "id": None}]}]},
            "messages",
            "messages[1].tool_calls[0].id is required",
        ),
        (
            {
                "messages": [
                    *USER,
                    {"role": "assistant", "tool_calls": [{**CALL, "function": {"name": "f"} | {"arguments": "{x"}}]},
                ]
            },
            "messages",
            "arguments is not valid JSON",
        ),
    ],
)
def test_bad_tool_input_is_a_400_naming_the_field(
    generic: tuple[Server, Path], extra: dict[str, Any], param: str, words: str
) -> None:
    server, _ = generic
    body = {"model": "m", "messages": USER, **extra}
    r = httpx.post(
        server.url + "/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {KEY}"}, timeout=60
    )
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and words in err["message"] and "\n" not in err["message"], err


def test_tools_are_for_chat_only(generic: tuple[Server, Path]) -> None:
    server, _ = generic
    with pytest.raises(openai.BadRequestError, match="chat/completions only"):
        server.client().completions.create(model="m", prompt="x", extra_body={"tools": TOOLS})


# ------------------------------------------------------------------------------- calls streamed in pieces
ALARM: list[Any] = [
    {
        "type": "function",
        "function": {
            "name": "set_alarm",
            "parameters": {
                "type": "object",
                "properties": {
                    "label": {"type": "string"},
                    "loud": {"type": "boolean"},
                    "days": {"type": "array", "items": {"type": "string"}},
                },
                "required": ["label", "loud", "days"],
            },
        },
    },
    *TOOLS,
]
ALARM_ARGS = {"label": "wake up", "loud": True, "days": ["mon", "tue"]}
NAMED: Any = {"type": "function", "function": {"name": "set_alarm"}}

# template → (what the reply writes first: the reasoning its prompt opened, closed; the call as the format's grammar
# writes it; a call to an undeclared function in the same format)
PIECES: dict[str, tuple[str, str, str]] = {
    "Qwen-Qwen3-0.6B.jinja": (
        "",
        '<tool_call>\n{"name": "set_alarm", "arguments": {"label":"wake up","loud":true,"days":["mon","tue"]}}\n'
        "</tool_call>",
        '<tool_call>\n{"name": "rm_rf", "arguments": {}}\n</tool_call>',
    ),
    "Qwen3.5-4B.jinja": (
        "</think>\n\n",
        "<tool_call>\n<function=set_alarm>\n<parameter=label>\nwake up\n</parameter>\n<parameter=loud>\ntrue\n"
        '</parameter>\n<parameter=days>\n["mon","tue"]\n</parameter>\n</function>\n</tool_call>',
        "<tool_call>\n<function=rm_rf>\n</function>\n</tool_call>",
    ),
    "GLM-4.7-Flash.jinja": (
        "</think>",
        "<tool_call>set_alarm<arg_key>label</arg_key><arg_value>wake up</arg_value><arg_key>loud</arg_key>"
        '<arg_value>true</arg_value><arg_key>days</arg_key><arg_value>["mon","tue"]</arg_value></tool_call>',
        "<tool_call>rm_rf</tool_call>",
    ),
    "MiniMax-M2.jinja": (
        "</think>\n\n",
        '<minimax:tool_call>\n<invoke name="set_alarm">\n<parameter name="label">wake up</parameter>\n'
        '<parameter name="loud">true</parameter>\n<parameter name="days">["mon","tue"]</parameter>\n</invoke>\n'
        "</minimax:tool_call>",
        '<minimax:tool_call>\n<invoke name="rm_rf">\n</invoke>\n</minimax:tool_call>',
    ),
    "deepseek-ai-DeepSeek-V3.1.jinja": (
        "",
        '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>set_alarm<｜tool▁sep｜>{"label":"wake up","loud":true,'
        '"days":["mon","tue"]}<｜tool▁call▁end｜><｜tool▁calls▁end｜>',
        "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>rm_rf<｜tool▁sep｜>{}<｜tool▁call▁end｜><｜tool▁calls▁end｜>",
    ),
    "moonshotai-Kimi-K2.jinja": (  # (the call's id, functions.NAME:N, is the format's)
        "",
        "<|tool_calls_section_begin|><|tool_call_begin|>functions.set_alarm:0<|tool_call_argument_begin|>"
        '{"label":"wake up","loud":true,"days":["mon","tue"]}<|tool_call_end|><|tool_calls_section_end|>',
        "<|tool_calls_section_begin|><|tool_call_begin|>functions.rm_rf:0<|tool_call_argument_begin|>{}"
        "<|tool_call_end|><|tool_calls_section_end|>",
    ),
    "Kimi-K3.jinja": (  # its prompt opens the think section; the grammar writes an empty response section first
        "<|close|>think<|sep|><|open|>response<|sep|><|close|>response<|sep|>",
        '<|open|>tools<|sep|><|open|>call tool="set_alarm" index="0"<|sep|><|open|>argument key="label" '
        'type="string"<|sep|>wake up<|close|>argument<|sep|><|open|>argument key="loud" type="boolean"<|sep|>true'
        '<|close|>argument<|sep|><|open|>argument key="days" type="array"<|sep|>["mon","tue"]<|close|>argument'
        "<|sep|><|close|>call<|sep|><|close|>tools<|sep|>",
        '<|open|>tools<|sep|><|open|>call tool="rm_rf" index="0"<|sep|><|close|>call<|sep|><|close|>tools<|sep|>',
    ),
    "MiniMax-M3.jinja": (  # a string as its text, anything else as JSON
        "",
        f'{NS}<tool_call>\n{NS}<invoke name="set_alarm">{NS}<label>wake up{NS}</label>{NS}<loud>true{NS}</loud>'
        f'{NS}<days>["mon","tue"]{NS}</days>{NS}</invoke>\n{NS}</tool_call>',
        f'{NS}<tool_call>\n{NS}<invoke name="rm_rf">{NS}</invoke>\n{NS}</tool_call>',
    ),
}


def _streamed(client: openai.OpenAI, **kw: Any) -> tuple[list[Any], str]:
    """A streamed reply's tool-call deltas and its content."""
    deltas: list[Any] = []
    text: list[str] = []
    for chunk in client.chat.completions.create(model="m", messages=USER, max_tokens=400, stream=True, **kw):
        if chunk.choices:
            deltas += chunk.choices[0].delta.tool_calls or []
            text.append(chunk.choices[0].delta.content or "")
    return deltas, "".join(text)


@pytest.mark.parametrize("template", list(PIECES))
def test_calls_under_the_grammar_stream_in_pieces(
    template: str, tmp_path: Path, model_factory: ModelFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """tool_choice required or a named function: a streamed call's arguments come in several deltas (one per
    argument as it is written), which put together are exactly the non-streamed reply's arguments, also as the
    official client's streaming helper puts them together. tool_choice auto sends the call whole once it is
    complete, and a block that is not a valid call comes back as text."""
    first, call, bad = PIECES[template]
    model = _templated(model_factory, tmp_path, template)
    tokens = script(model, [first + call] * 4 + [first + bad, first + call])
    monkeypatch.setenv("TOKENWING_TEST_TOKENS", tokens)
    stream_in_pieces(model, tokens, bad)


def test_a_harmony_call_under_the_grammar_streams_in_pieces(
    repacked_factory: ModelFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """gpt-oss, its own vocabulary: the same for a harmony call, whose head goes out at its header's <|message|>
    and whose body is the arguments' JSON (<|call|>, the token that ends the reply, never reaches the text); a
    message to an undeclared function is its body as text."""
    model = repacked_factory(arch="gpt-oss", type="Q8_0")
    head = "<|channel|>commentary to=functions.{} <|constrain|>json<|message|>"
    call = head.format("set_alarm") + '{"label":"wake up","loud":true,"days":["mon","tue"]}'
    tokens = script(model, [call] * 4 + [head.format("rm_rf") + "{}", call], ["<|call|>"] * 6)
    monkeypatch.setenv("TOKENWING_TEST_TOKENS", tokens)
    stream_in_pieces(model, tokens, "{}")


def stream_in_pieces(model: Path, tokens: str, bad: str) -> None:
    """The server on `model` scripted with `tokens` (the call four times, one to an undeclared function, `bad` as
    text, then the call again), read as the tests above say."""
    server = Server(model, "--ctx", "4096")
    try:
        client = server.client()
        # the non-streamed reply: the reference
        r = client.chat.completions.create(
            model="m", messages=USER, tools=ALARM, tool_choice="required", max_tokens=400
        )  # (Kimi K3's call is 328 tokens where this vocabulary spells its markers out)
        calls: list[Any] = list(r.choices[0].message.tool_calls or [])
        (whole,) = calls
        assert whole.function.name == "set_alarm" and json.loads(whole.function.arguments) == ALARM_ARGS

        # required, streamed: the head, then the arguments in pieces, which make exactly those arguments
        deltas, text = _streamed(client, tools=ALARM, tool_choice="required")
        head, rest = deltas[0], deltas[1:]
        assert text == "" and head.id and head.function.name == "set_alarm" and head.function.arguments == ""
        assert all(d.index == 0 and d.id is None and d.function.name is None for d in rest)
        pieces = [d.function.arguments for d in rest]
        assert len(pieces) >= 3 and all(pieces), pieces  # one per argument at least (and the closing brace)
        assert "".join(pieces) == whole.function.arguments

        # a named function, through the official streaming helper: the same call
        with client.chat.completions.stream(
            model="m", messages=USER, tools=ALARM, tool_choice=NAMED, max_tokens=400
        ) as helper:
            done = [e for e in helper if e.type == "tool_calls.function.arguments.done"]
            final = helper.get_final_completion()
        assert [(e.name, e.arguments) for e in done] == [("set_alarm", whole.function.arguments)]
        got: Any
        (got,) = final.choices[0].message.tool_calls or []
        assert (got.function.name, got.function.arguments) == ("set_alarm", whole.function.arguments)

        # auto: the call goes out whole once its block ends (it could still have turned out not to be one)
        deltas, text = _streamed(client, tools=ALARM)
        assert [d.function.arguments for d in deltas] == ["", whole.function.arguments]
        # ... and a block that is no valid call (an undeclared function) is text
        deltas, text = _streamed(client, tools=ALARM)
        assert not deltas and text == bad

        # required, cut off by max_tokens inside the block's end marker: the call as far as it went (all of its
        # arguments, or all but their end), no text (tests/engine/test_server_cut_calls.py: cut anywhere)
        n = len(tokens.split(";")[0].split(",")) - 1  # the reply's tokens, less the end of generation
        chunks = list(
            client.chat.completions.create(
                model="m", messages=USER, tools=ALARM, tool_choice="required", stream=True, max_tokens=n - 2
            )
        )
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
        deltas = [d for c in chunks if c.choices for d in c.choices[0].delta.tool_calls or []]
        assert not "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        cut = "".join(d.function.arguments for d in deltas)
        assert deltas[0].function.name == "set_alarm" and whole.function.arguments.startswith(cut) and len(cut) > 30
    finally:
        server.stop()
