"""Issue 48: Anthropic's Messages API (`POST /v1/messages`, `/v1/messages/count_tokens`) through the official
`anthropic` SDK against a real `tokenwing serve` of a generated model carrying Qwen3's own chat template (its
`<think>` tags and `<tool_call>` format).

Two servers: one of the random-weight model as it is (text, streams, stop sequences, max_tokens, forced tool calls
under the calls' grammar, counts, errors, the fuzz), and one whose replies are scripted (TOKENWING_TEST_TOKENS,
test-only: random weights never think or call on their own; the tokenizer, the reply's reader and the HTTP shapes
are the real ones) for thinking, an auto tool call and the round trip with its result."""

from __future__ import annotations

import dataclasses
import json
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import pytest

from tests.conftest import ModelFactory
from tests.engine import http_fuzz
from tests.engine.test_server import KEY, Server
from tests.engine.test_server_apply_template import _templated
from tests.engine.test_server_tools import script
from tokenwing.server import messages

TEMPLATE = "Qwen-Qwen3-0.6B.jinja"
# typed loosely: the SDK's parameter types are unions of TypedDicts
TOOLS: list[Any] = [
    {
        "name": "get_weather",
        "description": "The weather now in a city, in °C",
        "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    }
]
# a schema a random model completes under the calls' grammar: the city is one of two, and no other key (a random
# model given the schema's open object writes keys until max_tokens)
ENUM_TOOLS: list[Any] = [
    {
        "name": "get_weather",
        "description": "The weather now in a city, in °C",
        "input_schema": {
            "type": "object",
            "properties": {"city": {"type": "string", "enum": ["Bern", "Zürich"]}},
            "required": ["city"],
            "additionalProperties": False,
        },
    }
]
USER: list[Any] = [{"role": "user", "content": "What is the weather in Zürich?"}]
THOUGHT = "The user wants the weather."
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Zürich"}}\n</tool_call>'
ANSWER = "It is 21 °C in Zürich."
RESULT = "21 °C, sunny"
# the sampling fields are the server's (Anthropic's API has dropped them, and the SDK's methods with them): sent in
# the body as its other fields are
GREEDY: dict[str, Any] = {"temperature": 0}


@pytest.fixture(scope="module")
def model(model_factory: ModelFactory, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _templated(model_factory, tmp_path_factory.mktemp("qwen3-template"), TEMPLATE)


@pytest.fixture(scope="module")
def plain(model: Path) -> Iterator[tuple[Server, list[str]]]:
    """The model as it is, and its log as it comes (read, so that a full pipe never blocks the server)."""
    s = Server(model, "--ctx", "4096")  # Qwen3's tool descriptions are long in the test vocabulary
    with s.logged() as log:
        yield s, log


def client(server: Server, key: str = KEY) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key=key, max_retries=0, timeout=60)


def _text(message: Any) -> str:
    return "".join(b.text for b in message.content if b.type == "text")


# ----------------------------------------------------------------------------------------------------- text
def test_text_is_the_chat_endpoints_reply(plain: tuple[Server, list[str]]) -> None:
    """A system prompt (text blocks) and a user turn: the reply and its prompt are the chat endpoint's for the
    same conversation (greedy), in Anthropic's shape."""
    server, _ = plain
    system: list[Any] = [{"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}}]
    r = client(server).messages.create(
        model="m", system=system, messages=USER, max_tokens=8, extra_body=GREEDY, metadata={"user_id": "u1"}
    )
    assert r.type == "message" and r.role == "assistant" and r.id.startswith("msg_")
    assert r.model == server.handshake["model"]
    assert r.content and all(b.type == "text" for b in r.content)
    assert r.stop_reason in ("end_turn", "max_tokens") and r.stop_sequence is None
    openai_messages: list[Any] = [{"role": "system", "content": "Be brief."}, *USER]
    chat = server.client().chat.completions.create(model="m", messages=openai_messages, max_tokens=8, temperature=0)
    assert _text(r) == chat.choices[0].message.content
    assert chat.usage is not None
    assert r.usage.input_tokens == chat.usage.prompt_tokens and r.usage.output_tokens == chat.usage.completion_tokens
    assert r.stop_reason == {"stop": "end_turn", "length": "max_tokens"}[chat.choices[0].finish_reason]


def test_stream_is_the_non_streamed_reply(plain: tuple[Server, list[str]]) -> None:
    """`messages.stream` and its final message, and the raw events in Anthropic's order."""
    server, _ = plain
    c = client(server)
    whole = c.messages.create(model="m", system="Be brief.", messages=USER, max_tokens=8, extra_body=GREEDY)
    with c.messages.stream(model="m", system="Be brief.", messages=USER, max_tokens=8, extra_body=GREEDY) as s:
        pieces = list(s.text_stream)
        final = s.get_final_message()
    assert "".join(pieces) == _text(final) == _text(whole)
    assert final.stop_reason == whole.stop_reason and final.usage.output_tokens == whole.usage.output_tokens
    assert final.usage.input_tokens == whole.usage.input_tokens > 0
    raw = list(c.messages.create(model="m", messages=USER, max_tokens=8, extra_body=GREEDY, stream=True))
    kinds = [e.type for e in raw]
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"]
    assert kinds[1:-2] == ["content_block_start", *["content_block_delta"] * (len(kinds) - 5), "content_block_stop"]
    start: Any = raw[0]
    assert start.message.usage.input_tokens > 0 and start.message.content == [] and start.message.stop_reason is None


def test_max_tokens_and_stop_sequences(plain: tuple[Server, list[str]]) -> None:
    """max_tokens ends a reply with stop_reason max_tokens; a stop sequence from the middle of that reply ends it
    there, with stop_sequence naming it (the first of the two to occur), streamed and not."""
    server, _ = plain
    c = client(server)
    long = c.messages.create(model="m", messages=USER, max_tokens=12, extra_body={**GREEDY, "ignore_eos": True})
    assert long.stop_reason == "max_tokens" and long.usage.output_tokens == 12
    text = _text(long)
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    assert stop.strip(), text
    cut = text[: text.index(stop)]
    stops = ["never in it \u2603", stop]
    r = c.messages.create(model="m", messages=USER, max_tokens=12, extra_body=GREEDY, stop_sequences=stops)
    assert (r.stop_reason, r.stop_sequence, _text(r)) == ("stop_sequence", stop, cut)
    with c.messages.stream(model="m", messages=USER, max_tokens=12, extra_body=GREEDY, stop_sequences=stops) as s:
        final = s.get_final_message()
    assert (final.stop_reason, final.stop_sequence, _text(final)) == ("stop_sequence", stop, cut)


# ----------------------------------------------------------------------------------------------- tool calls
def test_forced_tool_calls(plain: tuple[Server, list[str]]) -> None:
    """tool_choice any and tool: the reply is a call under the calls' grammar, whatever the model's weights; and
    one that max_tokens cuts is still a call (its input so far), never the template's markup as text."""
    server, _ = plain
    c = client(server)
    one: Any = {"disable_parallel_tool_use": True}
    r = c.messages.create(
        model="m",
        messages=USER,
        tools=ENUM_TOOLS,
        tool_choice={"type": "any", **one},
        max_tokens=200,
        extra_body={"seed": 1},
    )
    assert r.stop_reason == "tool_use", r
    (call,) = r.content
    assert call.type == "tool_use" and call.name == "get_weather" and call.id
    assert call.input in ({"city": "Bern"}, {"city": "Zürich"})
    choice: Any = {"type": "tool", "name": "get_weather", **one}
    with c.messages.stream(
        model="m", messages=USER, tools=ENUM_TOOLS, tool_choice=choice, max_tokens=200, extra_body={"seed": 2}
    ) as s:
        events = list(s)
        final = s.get_final_message()
    assert final.stop_reason == "tool_use"
    (streamed,) = final.content
    assert streamed.type == "tool_use" and streamed.name == "get_weather"
    assert streamed.input in ({"city": "Bern"}, {"city": "Zürich"})
    deltas = [e for e in events if e.type == "content_block_delta"]
    assert deltas and all(e.delta.type == "input_json_delta" for e in deltas)  # the arguments, as they were written
    assert json.loads("".join(e.delta.partial_json for e in deltas)) == streamed.input

    # the same call (the same seed) cut two tokens before its end: a tool_use block, stop_reason max_tokens
    short = r.usage.output_tokens - 2
    kw: dict[str, Any] = {"tools": ENUM_TOOLS, "tool_choice": {"type": "any", **one}, "extra_body": {"seed": 1}}
    cut = c.messages.create(model="m", messages=USER, max_tokens=short, **kw)
    assert cut.stop_reason == "max_tokens" and cut.usage.output_tokens == short, cut
    (use,) = cut.content
    assert use.type == "tool_use" and use.name == "get_weather" and use.input in ({}, call.input), cut
    with c.messages.stream(model="m", messages=USER, max_tokens=short, **kw) as s:
        cut_streamed = s.get_final_message()
    assert cut_streamed.stop_reason == "max_tokens" and [b.type for b in cut_streamed.content] == ["tool_use"]


def test_tool_choice_none_hides_the_tools(plain: tuple[Server, list[str]]) -> None:
    server, _ = plain
    c = client(server)
    bare = c.messages.count_tokens(model="m", messages=USER)
    with_tools = c.messages.count_tokens(model="m", messages=USER, tools=TOOLS)
    hidden = c.messages.count_tokens(model="m", messages=USER, tools=TOOLS, tool_choice={"type": "none"})
    assert with_tools.input_tokens > bare.input_tokens == hidden.input_tokens
    r = c.messages.create(model="m", messages=USER, tools=TOOLS, tool_choice={"type": "none"}, max_tokens=4)
    assert r.usage.input_tokens == bare.input_tokens and all(b.type == "text" for b in r.content)


def test_unenforced_keywords_are_named(plain: tuple[Server, list[str]]) -> None:
    """A schema keyword the grammar cannot enforce (uniqueItems) is dropped, not refused (Anthropic's API has no
    strict), and named in X-TokenWing-Unenforced and the tokenwing object: output_config.format's schema, and a
    forced call's input_schema (known once the engine took the request)."""
    server, _ = plain
    c = client(server)
    tags = {"type": "array", "items": {"type": "string"}, "uniqueItems": True}
    schema = {"type": "object", "properties": {"tags": tags}, "required": ["tags"], "additionalProperties": False}
    fmt: Any = {"format": {"type": "json_schema", "schema": schema}}
    raw = c.messages.with_raw_response.create(model="m", messages=USER, max_tokens=4, output_config=fmt)
    assert raw.headers.get("x-tokenwing-unenforced") == "uniqueItems"
    assert raw.parse().tokenwing["unenforced"] == ["uniqueItems"]  # type: ignore[attr-defined]
    tools: Any = [{**ENUM_TOOLS[0], "input_schema": schema}]
    with c.messages.with_streaming_response.create(
        model="m", messages=USER, max_tokens=4, tools=tools, tool_choice={"type": "any"}, stream=True
    ) as streamed:
        assert streamed.headers.get("x-tokenwing-unenforced") == "uniqueItems"
    plain_reply = c.messages.with_raw_response.create(model="m", messages=USER, max_tokens=2)
    assert "x-tokenwing-unenforced" not in plain_reply.headers


# ------------------------------------------------------------------------- thinking, an auto call, round trip
@pytest.fixture(scope="module")
def scripted(model: Path) -> Iterator[Server]:
    """Each reply in order, one per generating request: a thought and a call (three times: created, streamed,
    streamed with its thinking omitted),
    then a thought and the answer after the call's result."""
    mp = pytest.MonkeyPatch()
    call = f"<think>\n{THOUGHT}\n</think>\n\n{CALL}"
    mp.setenv("TOKENWING_TEST_TOKENS", script(model, [call, call, call, f"<think>\n{THOUGHT}\n</think>\n\n{ANSWER}"]))
    s = Server(model, "--ctx", "4096")
    mp.undo()
    yield s
    s.stop()


def test_thinking_tool_use_and_the_round_trip(scripted: Server) -> None:
    c = client(scripted)
    thinking: Any = {"type": "enabled", "budget_tokens": 1024}
    # thinking turns Qwen3's reasoning on: its template then leaves the generation prompt open (off: an empty
    # <think></think> after it)
    on = c.messages.count_tokens(model="m", messages=USER, tools=TOOLS, thinking=thinking)
    off = c.messages.count_tokens(model="m", messages=USER, tools=TOOLS, thinking={"type": "disabled"})
    assert off.input_tokens > on.input_tokens

    # 1. the thought as a thinking block with its signature, the call as tool_use
    r = c.messages.create(model="m", messages=USER, tools=TOOLS, thinking=thinking, max_tokens=400)
    assert r.stop_reason == "tool_use" and r.usage.input_tokens == on.input_tokens
    think, use = r.content
    assert think.type == "thinking" and think.thinking == THOUGHT and think.signature
    assert use.type == "tool_use" and use.name == "get_weather" and use.input == {"city": "Zürich"}

    # 2. streamed: Anthropic's event sequence, put together by the SDK into the same message
    with c.messages.stream(model="m", messages=USER, tools=TOOLS, thinking=thinking, max_tokens=400) as s:
        events = list(s)
        final = s.get_final_message()
    # (the helper's own events, text and input_json, come beside the raw ones: only the raw ones are looked at)
    raw = [(e.type, getattr(getattr(e, "delta", None), "type", None)) for e in events]
    kinds = [k for k, _ in raw if k in ("message_start", "content_block_start", "content_block_stop", "message_stop")]
    assert kinds == ["message_start", *["content_block_start", "content_block_stop"] * 2, "message_stop"]
    deltas = [d for k, d in raw if k == "content_block_delta"]
    assert deltas[0] == "thinking_delta" and "signature_delta" in deltas and deltas[-1] == "input_json_delta"
    assert [b.type for b in final.content] == ["thinking", "tool_use"] and final.stop_reason == "tool_use"
    assert final.content[0].thinking == THOUGHT and final.content[0].signature == think.signature
    assert final.content[1].input == {"city": "Zürich"} and final.content[1].name == "get_weather"

    # 3. thinking's display omitted: the block comes empty, its signature the same, and no thinking_delta goes out
    omitted: Any = {**thinking, "display": "omitted"}
    with c.messages.stream(model="m", messages=USER, tools=TOOLS, thinking=omitted, max_tokens=400) as s:
        hidden = [getattr(getattr(e, "delta", None), "type", None) for e in s]
        quiet = s.get_final_message()
    assert "thinking_delta" not in hidden and "signature_delta" in hidden
    assert quiet.content[0].type == "thinking" and quiet.content[0].thinking == ""
    assert quiet.content[0].signature == think.signature and quiet.content[1].type == "tool_use"

    # 4. the result goes back (its turn as the SDK's blocks, the thinking included), and the model answers
    turn2: list[Any] = [
        *USER,
        {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in r.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": RESULT}]},
    ]
    counted = c.messages.count_tokens(model="m", messages=turn2, tools=TOOLS, thinking=thinking)
    # the same prompt as the chat endpoint's for the same conversation in OpenAI's words
    call = {"id": use.id, "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Zürich"}}}
    openai_turn2 = [
        *USER,
        {"role": "assistant", "content": "", "reasoning_content": THOUGHT, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": use.id, "content": RESULT},
    ]
    openai_tools = [{"type": "function", "function": {**TOOLS[0], "parameters": TOOLS[0]["input_schema"]}}]
    for t in openai_tools:
        del t["function"]["input_schema"]
    body = {"messages": openai_turn2, "tools": openai_tools, "chat_template_kwargs": {"enable_thinking": True}}
    chat = httpx.post(scripted.url + "/v1/chat/count", json=body, headers={"x-api-key": KEY}, timeout=60).json()
    assert counted.input_tokens == chat["prompt_tokens"]
    r2 = c.messages.create(model="m", messages=turn2, tools=TOOLS, thinking=thinking, max_tokens=400)
    assert r2.usage.input_tokens == counted.input_tokens
    assert [b.type for b in r2.content] == ["thinking", "text"] and r2.stop_reason == "end_turn"
    assert r2.content[0].thinking == THOUGHT and _text(r2) == ANSWER


# -------------------------------------------------------------------------------------------- count, errors
def test_count_tokens(plain: tuple[Server, list[str]]) -> None:
    server, _ = plain
    c = client(server)
    n = c.messages.count_tokens(model="m", system="Be brief.", messages=USER, tools=TOOLS).input_tokens
    r = c.messages.create(model="m", system="Be brief.", messages=USER, tools=TOOLS, max_tokens=2)
    assert n == r.usage.input_tokens > c.messages.count_tokens(model="m", messages=USER, tools=TOOLS).input_tokens
    # a failed call's result says so where the model reads it
    use: Any = {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Bern"}}
    result: Any = {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "down"}]}
    turn = [*USER, {"role": "assistant", "content": [use]}, {"role": "user", "content": [result]}]
    ok = c.messages.count_tokens(model="m", messages=turn, tools=TOOLS).input_tokens
    failed = [*turn[:2], {"role": "user", "content": [{**result, "is_error": True}]}]
    assert c.messages.count_tokens(model="m", messages=failed, tools=TOOLS).input_tokens > ok


def test_errors_in_anthropics_format(plain: tuple[Server, list[str]]) -> None:
    server, _ = plain
    with pytest.raises(anthropic.AuthenticationError) as auth:
        client(server, key="wrong").messages.create(model="m", messages=USER, max_tokens=2)
    assert auth.value.status_code == 401
    body: Any = auth.value.body
    assert body["type"] == "error" and body["error"]["type"] == "authentication_error" and body["error"]["message"]
    c = client(server)
    bad: list[tuple[dict[str, Any], str]] = [
        ({"tool_choice": {"type": "tool", "name": "get_time"}, "tools": TOOLS}, "'get_time', which is not in tools"),
        ({"tool_choice": {"type": "any"}}, "needs tools"),
        (
            {"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
            "messages[0].content[0]: image",
        ),
        ({"messages": [*USER, {"role": "assistant", "content": "It is"}]}, "prefill"),
        ({"stop_sequences": "x"}, "'stop_sequences' must be a list"),
        ({"stop_sequences": ["x"] * 17}, "'stop_sequences' must be"),
        ({"tools": [{"name": "f", "input_schema": {"type": "strng"}}]}, "tools[0].input_schema.type 'strng'"),
        ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "Anthropic's own tools"),
        ({"thinking": {"type": "enabled"}}, "budget_tokens"),
        (
            {
                "messages": [
                    *USER,
                    {"role": "assistant", "content": [{"type": "text", "text": "ok"}]},
                    {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_9", "content": "x"}]},
                ]
            },
            "messages[2].tool_use_id 'toolu_9' answers no tool call",
        ),
        ({"extra_body": {"temperature": 5}}, "'temperature' must be a number"),
    ]
    for extra, words in bad:
        kw: dict[str, Any] = {"model": "m", "messages": USER, "max_tokens": 2, **extra}
        with pytest.raises(anthropic.BadRequestError) as e:
            c.messages.create(**kw)
        err: Any = e.value.body
        assert e.value.status_code == 400 and err["type"] == "error", err
        assert err["error"]["type"] == "invalid_request_error" and words in err["error"]["message"], (extra, err)
    # max_tokens is required (the SDK requires it too: sent raw), and the routes' other refusals are Anthropic's
    auth = {"x-api-key": KEY}
    for method, path, kw2, status in [
        ("POST", "/v1/messages", {"json": {"model": "m", "messages": USER}}, 400),
        ("GET", "/v1/messages", {}, 405),
        ("POST", "/v1/messages/nope", {"json": {}}, 404),
        ("POST", "/v1/messages", {"content": b"{}", "headers": {"content-type": "text/plain"}}, 415),
    ]:
        headers = {**auth, **kw2.pop("headers", {})}
        got = httpx.request(method, server.url + path, headers=headers, timeout=60, **kw2)
        assert got.status_code == status and got.json()["type"] == "error", got.text
        assert set(got.json()["error"]) == {"type", "message"}


# ------------------------------------------------------------------------------------------------- the fuzz
SEED, CASES = 48, 200
MESSAGES: dict[str, Any] = {
    "model": "m",
    "system": [{"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}}],
    "messages": [
        {"role": "user", "content": [{"type": "text", "text": "Hello"}]},
        {
            "role": "assistant",
            "content": [
                {"type": "thinking", "thinking": "Call it.", "signature": "s"},
                {"type": "text", "text": "Checking."},
                {"type": "tool_use", "id": "toolu_1", "name": "f", "input": {"a": "x"}},
            ],
        },
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "42"}]},
                {"type": "text", "text": "And?"},
            ],
        },
    ],
    "tools": [
        {
            "name": "f",
            "description": "d",
            "input_schema": {"type": "object", "properties": {"a": {"type": "string"}}, "required": ["a"]},
        }
    ],
    "tool_choice": {"type": "auto", "disable_parallel_tool_use": False},
    "max_tokens": 2,
    "temperature": 0,
    "top_p": 0.9,
    "top_k": 5,
    "stop_sequences": ["\n\n"],
    "metadata": {"user_id": "u"},
    "thinking": {"type": "enabled", "budget_tokens": 1024},
    "stream": False,
}
COUNT = {k: v for k, v in MESSAGES.items() if k not in ("max_tokens", "temperature", "top_p", "top_k", "stream")}
ROUTES = {"/v1/messages": MESSAGES, "/v1/messages/count_tokens": COUNT}


def fuzz_cases(seed: int, n: int) -> Iterator[http_fuzz.Case]:
    """http_fuzz.py's mutated requests (a field of any depth given each wrong type or dropped, raw JSON values,
    random and flipped bytes, truncated, deep and huge bodies, bad headers, methods and paths) of the two routes'
    bodies, with the key as Anthropic's clients send it (x-api-key) where a case is not about the key."""
    for case in http_fuzz.cases(seed, n, ROUTES):
        if any(h.lower().startswith("authorization:") for h in case.headers):
            yield case  # (a wrong or malformed key: Anthropic's 401 or 400)
        else:
            yield dataclasses.replace(case, headers=[*case.headers, f"x-api-key: {KEY}"])


def test_fuzzed_bodies_get_clean_anthropic_answers(plain: tuple[Server, list[str]]) -> None:
    server, log = plain
    port = int(server.handshake["port"])
    failures: list[str] = []
    statuses: Counter[int] = Counter()
    for case in fuzz_cases(SEED, CASES):
        try:
            answer = http_fuzz.send(case, port, None)
        except (OSError, ConnectionError) as e:
            failures.append(f"{case.kind}: {type(e).__name__}: {e}")
            continue
        statuses[answer.status] += 1
        problem = answer.problem(head=case.method == "HEAD")
        if problem is None and answer.status >= 400 and answer.body and messages.routed(case.path.split("?")[0]):
            doc = json.loads(answer.body)
            if doc.get("type") != "error" or set(doc["error"]) != {"type", "message"}:
                problem = f"{answer.status} not in Anthropic's error format: {answer.body[:200]!r}"
        if problem:
            failures.append(f"{case.kind}: {problem}")
    assert not failures, "\n".join(failures[:20])
    assert statuses[200] > 0 and statuses[400] > 0 and sum(statuses.values()) == CASES, statuses
    assert httpx.get(server.url + "/health", timeout=30).json()["status"] == "ok"
    r = client(server).messages.create(model="m", messages=USER, max_tokens=2)
    assert r.type == "message"
    assert not [line for line in log if "Traceback" in line], "".join(log[-40:])
