"""tool_choice required and a named function: the reply is generated under a grammar of the family's own call
format (text/tools/constrain.py and each format's `grammar`), so a model of any quality writes a valid call.

In process: for every native format, 100 replies sampled at temperature 1 from random logits under the
grammar's mask (the server's Constraint, the generated model's vocabulary) read back through the format's reader
into calls to allowed functions whose arguments validate against their schemas (jsonschema). Through the
server: the official client against `tokenwing serve` on the random-weight generated model carrying each
publisher's template, required and a named function."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jsonschema  # type: ignore[import-untyped]
import numpy as np
import pytest

from tests.conftest import ModelFactory
from tests.engine.test_server import Server
from tests.engine.test_server_apply_template import _templated
from tests.engine.test_server_tools import _with_template
from tests.llama_source import chat_templates
from tokenwing.format.reader import ModelFile
from tokenwing.text.chat import ChatTemplate
from tokenwing.text.grammar import Constraint
from tokenwing.text.tokenizer import TextTokenizer, tokenizer_from_metadata
from tokenwing.text.tools.base import Tools, args_prefix, json_members
from tokenwing.text.tools.reply import ReplyReader, Syntax, call_grammar, prepare, syntax

# bounded, so that a reply of random tokens still ends within max_tokens: strings have a maximum length (or are
# an enum), arrays a maximum size; text (the XML-like formats' string values) and JSON values both appear
TOOLS: list[Any] = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "maxLength": 10},
                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                    "days": {"type": "integer", "minimum": 1, "maximum": 7},
                },
                "required": ["city", "days"],
                "additionalProperties": False,
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "set_alarm",
            "description": "An alarm",
            "parameters": {
                "type": "object",
                "properties": {
                    "label": {"type": "string", "minLength": 1, "maxLength": 6},
                    "loud": {"type": "boolean"},
                    "days": {"type": "array", "items": {"enum": ["mon", "tue"]}, "maxItems": 2},
                },
                "required": ["label", "loud"],
                "additionalProperties": False,
            },
        },
    },
]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
USER: list[Any] = [{"role": "user", "content": "What is the weather in Bern?"}]
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

MINISTRAL = "mistralai-Ministral-3-14B-Reasoning-2512.jinja"
# template → the reader's format (each native format the readers support; CHATML: the engine's own)
FORMATS = {
    "Qwen-Qwen3-0.6B.jinja": "qwen",  # JSON
    "Qwen3.5-4B.jinja": "qwen",  # XML, its prompt opens the thinking
    "deepseek-ai-DeepSeek-V3.1.jinja": "deepseek-v3",
    "deepseek-ai-DeepSeek-V3.2.jinja": "deepseek-dsml",  # function_calls
    "deepseek-ai-DeepSeek-V4.jinja": "deepseek-dsml",  # tool_calls
    "moonshotai-Kimi-K2.jinja": "kimi-k2",
    "Kimi-K3.jinja": "kimi-k3",
    "GLM-4.6.jinja": "glm",  # newlines between the arguments
    "GLM-4.7-Flash.jinja": "glm",
    "MiniMax-M2.jinja": "minimax-m2",
    "MiniMax-M3.jinja": "minimax-m3",  # a string as text, anything else as JSON (not its nested elements)
    MINISTRAL: "mistral",  # Mistral Small 4's form: a call ends with its JSON
    "CHATML": "generic",
}


def _source(template: str) -> str:
    return CHATML if template == "CHATML" else chat_templates()[template]


@pytest.fixture(scope="module")
def tokenizer(repacked_factory: ModelFactory) -> TextTokenizer:
    model = repacked_factory(arch="deepseek2", type="Q8_0")
    with ModelFile.open(str(model)) as mf:
        return tokenizer_from_metadata({k: v.value for k, v in mf.header.kv.items()}, str(model))


def _sample(tok: TextTokenizer, grammar: str, seed: int, max_tokens: int = 3000) -> list[int]:
    """A reply of random tokens at temperature 1 under the grammar: random logits, the mask, softmax."""
    rng = np.random.default_rng(seed)
    c = Constraint(tok, grammar)
    out: list[int] = []
    try:
        while len(out) < max_tokens and not c.finished:
            logits = c.apply(rng.standard_normal(tok.vocab_size).astype(np.float32) * 3)
            p = np.exp(logits - logits.max())
            t = int(rng.choice(tok.vocab_size, p=p / p.sum()))
            if t in tok.eos_ids:
                break
            c.accept(t)
            out.append(t)
    finally:
        c.close()
    return out


def check_calls(calls: list[Any], names: list[str], parallel: bool) -> None:
    assert calls and (parallel or len(calls) == 1)
    for call in calls:
        assert call.name in names
        jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])


@pytest.mark.parametrize("template", list(FORMATS))
def test_100_random_replies_are_valid_calls(template: str, tokenizer: TextTokenizer) -> None:
    source = _source(template)
    syn = syntax(source)
    assert syn.name == FORMATS[template]
    prompt = ChatTemplate(source).render(prepare(syn, USER, TOOLS), tools=TOOLS)
    cases = [(["get_weather", "set_alarm"], None, True), (["set_alarm"], "set_alarm", False)]
    for names, only, parallel in cases:
        tools = Tools(TOOLS, only)
        grammar = call_grammar(syn, tokenizer, prompt, tools, names, parallel).text
        for seed in range(50):
            ids = _sample(tokenizer, grammar, seed)
            text = tokenizer.decode(ids)
            reader = ReplyReader(syn, prompt, tools, parallel)
            events = reader.push(text) + reader.finish()
            assert not any(e.kind == "content" and e.text.strip() for e in events), (seed, text)
            check_calls(reader.calls, names, parallel)


def test_harmony_random_replies_are_valid_calls(repacked_factory: ModelFactory) -> None:
    """gpt-oss, with its own vocabulary: a commentary message to functions.NAME with the arguments' JSON (its
    <|call|> ends generation, so one call whatever parallel_tool_calls says)."""
    model = repacked_factory(arch="gpt-oss", type="Q8_0")
    with ModelFile.open(str(model)) as mf:
        tok = tokenizer_from_metadata({k: v.value for k, v in mf.header.kv.items()}, str(model))
    source = chat_templates()["openai-gpt-oss-120b.jinja"]
    syn = syntax(source)
    assert syn.name == "harmony"
    prompt = ChatTemplate(source).render(prepare(syn, USER, TOOLS), tools=TOOLS)
    for names, only in [(["get_weather", "set_alarm"], None), (["set_alarm"], "set_alarm")]:
        tools = Tools(TOOLS, only)
        grammar = call_grammar(syn, tok, prompt, tools, names, True).text
        for seed in range(30):
            text = tok.decode(_sample(tok, grammar, seed))
            reader = ReplyReader(syn, prompt, tools, True)
            events = reader.push(text) + reader.finish()
            assert not any(e.kind == "content" and e.text.strip() for e in events), (seed, text)
            check_calls(reader.calls, names, parallel=False)


# ------------------------------------------------------------------------------------ the official client
@pytest.mark.parametrize("template", [t for t in FORMATS if t != "CHATML"] + ["generic", "gpt-oss", "mistral4"])
def test_the_official_client_gets_a_valid_call(
    template: str, tmp_path: Path, model_factory: ModelFactory, repacked_factory: ModelFactory
) -> None:
    """The random-weight model, at temperature 1: required (one call, parallel_tool_calls false) and a named
    function each come back as tool_calls whose arguments validate; the model's own template, or for
    `generic` the factory's, which knows no tools (the engine's format); gpt-oss with its own vocabulary, and
    mistral4 with its own (tekken: [TOOL_CALLS] a control token, which the reply prints as llama.cpp does)."""
    if template == "mistral4":
        model = _with_template(model_factory(arch="mistral4", type="Q8_0"), tmp_path, MINISTRAL)
    elif template == "generic":
        model = repacked_factory(arch="deepseek2", type="Q8_0")
    elif template == "gpt-oss":
        model = repacked_factory(arch="gpt-oss", type="Q8_0")
    else:
        model = _templated(model_factory, tmp_path, template)
    server = Server(model, "--ctx", "4096")
    try:
        client = server.client()
        choices: list[tuple[int, Any]] = [(1, "required"), (2, {"type": "function", "function": {"name": "set_alarm"}})]
        for seed, choice in choices:
            r = client.chat.completions.create(
                model="m",
                messages=USER,
                tools=TOOLS,
                tool_choice=choice,
                parallel_tool_calls=False,
                temperature=1.0,
                seed=seed,
                max_tokens=1000,  # markers written as plain text in this vocabulary take many tokens
            )
            c = r.choices[0]
            assert c.finish_reason == "tool_calls", c
            names = ["set_alarm"] if isinstance(choice, dict) else list(SCHEMAS)
            calls: list[Any] = list(c.message.tool_calls or [])
            check_calls([tc.function for tc in calls], names, parallel=False)
    finally:
        server.stop()


# every format's calls stream in pieces under the grammar (BlockFormat.partial; harmony's below)
STREAMED = list(FORMATS)


@pytest.mark.parametrize("template", STREAMED)
def test_streamed_pieces_are_the_calls_arguments(template: str, tokenizer: TextTokenizer) -> None:
    """Replies sampled under the grammar, read a character at a time by a reader that streams calls: each call's
    head comes before its pieces, and the pieces put together start the arguments of the call that follows (the
    non-streamed reply's), all of them but at most the closing brace (sent with the call, by the server); a call
    with two or more arguments comes in more than one piece."""
    source = _source(template)
    syn = syntax(source)
    prompt = ChatTemplate(source).render(prepare(syn, USER, TOOLS), tools=TOOLS)
    many = 0
    for names, only, parallel in [(["get_weather", "set_alarm"], None, True), (["set_alarm"], "set_alarm", False)]:
        tools = Tools(TOOLS, only)
        grammar = call_grammar(syn, tokenizer, prompt, tools, names, parallel).text
        for seed in range(10):
            text = tokenizer.decode(_sample(tokenizer, grammar, seed))
            many += _streamed_as_whole(syn, prompt, tools, names, parallel, text)
    assert many >= 5  # calls of several arguments came in several pieces


def test_harmony_streamed_pieces_are_the_calls_arguments(repacked_factory: ModelFactory) -> None:
    """gpt-oss, with its own vocabulary: the same for the harmony call sampled under its grammar (the body of a
    message to functions.NAME is the arguments' JSON; one call a reply)."""
    model = repacked_factory(arch="gpt-oss", type="Q8_0")
    with ModelFile.open(str(model)) as mf:
        tok = tokenizer_from_metadata({k: v.value for k, v in mf.header.kv.items()}, str(model))
    source = chat_templates()["openai-gpt-oss-120b.jinja"]
    syn = syntax(source)
    prompt = ChatTemplate(source).render(prepare(syn, USER, TOOLS), tools=TOOLS)
    many = 0
    for names, only in [(["get_weather", "set_alarm"], None), (["set_alarm"], "set_alarm")]:
        tools = Tools(TOOLS, only)
        grammar = call_grammar(syn, tok, prompt, tools, names, True).text
        for seed in range(10):
            text = tok.decode(_sample(tok, grammar, seed))
            many += _streamed_as_whole(syn, prompt, tools, names, False, text)
    assert many >= 5


def _streamed_as_whole(syn: Syntax, prompt: str, tools: Tools, names: list[str], parallel: bool, text: str) -> int:
    """`text` read a character at a time by a reader that streams calls, checked against the same text read
    whole (see the tests above); the number of calls of two or more arguments that came in several pieces."""
    reader = ReplyReader(syn, prompt, tools, parallel, stream_calls=True)
    events = [e for c in text for e in reader.push(c)] + reader.finish()
    heads: dict[int, Any] = {}
    pieces: dict[int, list[str]] = {}
    many = 0
    for e in events:
        if e.kind == "call_head":
            assert e.index not in heads
            heads[e.index], pieces[e.index] = e.call, []
        elif e.kind == "call_args":
            pieces[e.index].append(e.text)
        elif e.kind == "call":
            assert e.call is not None and e.index in heads, text  # streamed, not only whole
            assert (heads[e.index].id, heads[e.index].name) == (e.call.id, e.call.name)
            # what the pieces sent starts the arguments; the server sends the rest (at most the end)
            sent = "".join(pieces[e.index])
            assert e.call.arguments.startswith(sent) and len(e.call.arguments) - len(sent) <= 1, text
            many += len(json.loads(e.call.arguments)) >= 2 and len(pieces[e.index]) >= 2
    check_calls(reader.calls, names, parallel)
    # the same reply read whole, as the non-streaming reader does: the same calls
    whole = ReplyReader(syn, prompt, tools, parallel)
    whole.push(text)
    whole.finish()
    assert [(c.name, c.arguments) for c in whole.calls] == [(c.name, c.arguments) for c in reader.calls]
    return many


def test_a_json_value_is_fixed_only_by_what_follows_it() -> None:
    """The JSON forms' pieces: a member goes out once the `,` or `}` after its value is written (a number's
    next digit, an escape's next character could still change it), in json.dumps's own spacing."""
    text = '{"n":12,"s":"a\\u00e9","t":true}'

    def fixed(written: str) -> str:
        found = json_members(written)
        assert found is not None
        return args_prefix(found[0], found[1])

    sent = [fixed(text[:k]) for k in range(1, len(text) + 1)]
    assert sent[text.index(",") - 1] == "{"  # "12" written, the "," not yet
    assert sorted(set(sent), key=len) == ["{", '{"n": 12', '{"n": 12, "s": "aé"', '{"n": 12, "s": "aé", "t": true}']
    assert sent[-1] == json.dumps(json.loads(text), ensure_ascii=False)
