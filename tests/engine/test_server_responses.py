"""`POST /v1/responses` (OpenAI's Responses API, issue 48) through a real `tokenwing serve`, with the official
`openai` client and an OpenAI Agents SDK agent: text, streams, structured output, forced and round-tripped tool
calls, previous_response_id and the kept responses, incomplete replies, reasoning, errors, and 200 fuzzed bodies.

The generated model's random weights write text of no meaning, so what is checked is what does not depend on
meaning: the same text as the chat endpoint for the same request, the prompt the input makes (its token count
against /v1/chat/count of the chat request it means), replies under a grammar (schemas, forced calls) that
validate. Where a reply of known form is needed (an agent's call then its answer, gpt-oss's reasoning), its tokens
are scripted (TOKENWING_TEST_TOKENS, test-only): the tokenizer, readers and HTTP shapes are the real ones."""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from collections.abc import Iterator
from typing import Any

import httpx
import jsonschema  # type: ignore[import-untyped]
import openai
import pydantic
import pytest
from agents import Agent, ModelSettings, OpenAIResponsesModel, Runner, function_tool, set_tracing_disabled

from tests.conftest import ModelFactory
from tests.engine import http_fuzz
from tests.engine.test_server import KEY, Server
from tests.engine.test_server_reasoning import REPLY, scripted
from tests.engine.test_server_tools import ANSWER, script
from tokenwing.server import responses
from tokenwing.server.responses import ResponseStore, parse_responses

CITY = {"type": "string", "maxLength": 8}  # bounded: a random model's reply under the grammar still ends
SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {"city": CITY, "days": {"type": "integer", "minimum": 1, "maximum": 7}},
    "required": ["city", "days"],
    "additionalProperties": False,
}
TOOLS: list[Any] = [{"type": "function", "name": "get_weather", "description": "The weather", "parameters": SCHEMA}]
CHAT_TOOLS = [{"type": "function", "function": {k: v for k, v in TOOLS[0].items() if k != "type"}}]
QUESTION = "What is the weather in Bern?"
RESULT = "21 °C, sunny"


@pytest.fixture(scope="module")
def server(repacked_factory: ModelFactory) -> Iterator[tuple[Server, list[str]]]:
    """The generated model, random weights, the engine's own call format (its template shows no tools); its log
    read as it comes (the fuzz checks it for tracebacks)."""
    s = Server(repacked_factory(arch="deepseek2", type="Q8_0"), "--ctx", "4096", "--no-usage-table")
    with s.logged() as log:
        yield s, log


def _post(s: Server, path: str, body: Any) -> httpx.Response:
    return httpx.post(s.url + path, json=body, headers={"Authorization": f"Bearer {KEY}"}, timeout=60)


def _count(s: Server, messages: list[Any], tools: list[Any] | None = None, **extra: Any) -> int:
    """The prompt tokens of the chat request these messages make (what the Responses input must make)."""
    r = _post(s, "/v1/chat/count", {"messages": messages, "tools": tools, **extra})
    assert r.status_code == 200, r.text
    return int(r.json()["prompt_tokens"])


def test_text_is_the_chat_endpoints_reply(server: tuple[Server, list[str]]) -> None:
    s, _ = server
    client = s.client()
    r = client.responses.create(model="m", input=QUESTION, instructions="Be brief.", max_output_tokens=12,
                                temperature=0)  # fmt: skip
    chat = client.chat.completions.create(model="m", max_tokens=12, temperature=0, messages=[
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": QUESTION}])  # fmt: skip
    assert r.id.startswith("resp_") and r.object == "response" and r.model
    assert [o.type for o in r.output] == ["message"]
    msg: Any = r.output[0]
    assert msg.role == "assistant" and msg.id.startswith("msg_") and msg.content[0].annotations == []
    assert r.output_text == chat.choices[0].message.content and r.output_text
    cut = chat.choices[0].finish_reason == "length"
    assert r.status == ("incomplete" if cut else "completed") and msg.status == r.status
    assert (r.incomplete_details.reason if r.incomplete_details else None) == ("max_output_tokens" if cut else None)
    assert r.usage is not None and chat.usage is not None
    assert r.usage.input_tokens == chat.usage.prompt_tokens == _count(s, [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": QUESTION}])  # fmt: skip
    assert r.usage.output_tokens == chat.usage.completion_tokens
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    assert r.instructions == "Be brief." and r.max_output_tokens == 12 and r.temperature == 0


def test_incomplete_at_max_output_tokens(server: tuple[Server, list[str]]) -> None:
    s, _ = server
    # ignore_eos (TokenWing's, through extra_body): the reply surely runs to max_output_tokens
    r = s.client().responses.create(model="m", input="Hi", max_output_tokens=3, extra_body={"ignore_eos": True})
    assert r.status == "incomplete" and r.incomplete_details is not None
    assert r.incomplete_details.reason == "max_output_tokens"
    assert r.usage is not None and r.usage.output_tokens == 3 and r.output[0].status == "incomplete"


def test_stream_event_sequence(server: tuple[Server, list[str]]) -> None:
    s, _ = server
    client = s.client()
    args: dict[str, Any] = {"model": "m", "input": QUESTION, "max_output_tokens": 10, "temperature": 0}
    whole = client.responses.create(**args)
    events = list(client.responses.create(**args, stream=True))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    kinds = [e.type for e in events]
    last = "response.incomplete" if whole.status == "incomplete" else "response.completed"
    deltas = kinds.count("response.output_text.delta")
    assert kinds == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        *["response.output_text.delta"] * deltas,
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        last,
    ]
    e: Any = events
    assert e[0].response.status == "in_progress" and e[0].response.output == []
    rid, item_id = e[0].response.id, e[2].item.id
    assert all(x.response.id == rid for x in (e[0], e[1], e[-1]))
    assert all(x.item_id == item_id for x in e[3:-2]) and e[-2].item.id == item_id
    text = "".join(x.delta for x in e if x.type == "response.output_text.delta")
    assert text == whole.output_text == e[-4].text == e[-1].response.output_text
    assert e[-1].response.usage.output_tokens == whole.usage.output_tokens


def test_json_schema(server: tuple[Server, list[str]]) -> None:
    s, _ = server
    client = s.client()
    fmt: Any = {"type": "json_schema", "name": "weather", "schema": SCHEMA, "strict": True}
    r = client.responses.create(model="m", input=QUESTION, text={"format": fmt}, max_output_tokens=100)
    assert r.status == "completed", r
    jsonschema.validate(json.loads(r.output_text), SCHEMA)
    assert r.text is not None and r.text.format is not None and r.text.format.type == "json_schema"

    class Weather(pydantic.BaseModel):
        model_config = pydantic.ConfigDict(extra="forbid")
        city: str = pydantic.Field(max_length=8)
        days: int = pydantic.Field(ge=1, le=7)

    # the client's own helper: the schema from a model, the reply parsed into it, streamed
    with client.responses.stream(model="m", input=QUESTION, text_format=Weather, max_output_tokens=100) as stream:
        final = stream.get_final_response()
    assert isinstance(final.output_parsed, Weather)
    # json_object: any object; a random model has no reason to close it, so only its start is certain, and that
    # it is the chat endpoint's reply under the same grammar
    obj = client.responses.create(model="m", input=QUESTION, text={"format": {"type": "json_object"}},
                                  max_output_tokens=8, temperature=0)  # fmt: skip
    chat = client.chat.completions.create(model="m", messages=[{"role": "user", "content": QUESTION}], max_tokens=8,
                                          temperature=0, response_format={"type": "json_object"})  # fmt: skip
    assert obj.output_text.startswith("{") and obj.output_text == chat.choices[0].message.content


def _call(r: Any) -> Any:
    calls = [o for o in r.output if o.type == "function_call"]
    assert len(calls) == 1, r.output
    return calls[0]


@pytest.mark.parametrize("choice", ["required", {"type": "function", "name": "get_weather"}])
def test_forced_call_and_round_trip(server: tuple[Server, list[str]], choice: Any) -> None:
    s, _ = server
    client = s.client()
    # one call (parallel_tool_calls false: "required" lets a random model go on to a second call and more)
    r = client.responses.create(model="m", input=QUESTION, tools=TOOLS, tool_choice=choice, max_output_tokens=100,
                                parallel_tool_calls=False)  # fmt: skip
    assert r.status == "completed" and r.parallel_tool_calls is False
    call = _call(r)
    assert call.name == "get_weather" and call.id.startswith("fc_") and call.call_id and call.status == "completed"
    jsonschema.validate(json.loads(call.arguments), SCHEMA)
    assert r.tools[0].name == "get_weather"  # type: ignore[union-attr]

    # the result goes back as a function_call_output: the prompt is the chat conversation it means
    items: list[Any] = [{"role": "user", "content": QUESTION}, call.model_dump(exclude_none=True),
                        {"type": "function_call_output", "call_id": call.call_id, "output": RESULT}]  # fmt: skip
    r2 = client.responses.create(model="m", input=items, tools=TOOLS, max_output_tokens=4)
    chat: list[Any] = [
        {"role": "user", "content": QUESTION},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": call.call_id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}]},
        {"role": "tool", "tool_call_id": call.call_id, "content": RESULT},
    ]  # fmt: skip
    assert r2.usage is not None and r2.usage.input_tokens == _count(s, chat, CHAT_TOOLS)

    # the same conversation from the kept response: previous_response_id and the output alone
    output: Any = [{"type": "function_call_output", "call_id": call.call_id, "output": RESULT}]
    r3 = client.responses.create(model="m", previous_response_id=r.id, input=output, tools=TOOLS, max_output_tokens=4)
    assert r3.usage is not None and r3.usage.input_tokens == r2.usage.input_tokens
    assert r3.previous_response_id == r.id


def test_forced_call_streamed(server: tuple[Server, list[str]]) -> None:
    s, _ = server
    client = s.client()
    # the client's stream helper (it builds the response from the events, as agents read it)
    with client.responses.stream(model="m", input=QUESTION, tools=TOOLS, tool_choice="required",
                                 max_output_tokens=100, parallel_tool_calls=False) as stream:  # fmt: skip
        events: list[Any] = list(stream)
        final = stream.get_final_response()
    kinds = [e.type for e in events]
    assert kinds[:3] == ["response.created", "response.in_progress", "response.output_item.added"]
    assert kinds[-3:] == ["response.function_call_arguments.done", "response.output_item.done", "response.completed"]
    assert set(kinds[3:-3]) == {"response.function_call_arguments.delta"}
    added, done = events[2].item, events[-2].item
    assert added.type == "function_call" and added.name == "get_weather" and added.arguments == ""
    args = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert args == events[-3].arguments == done.arguments and done.call_id == added.call_id
    jsonschema.validate(json.loads(args), SCHEMA)
    assert events[-1].response.output[0].arguments == args == _call(final).arguments


def test_forced_call_cut_by_max_output_tokens(server: tuple[Server, list[str]]) -> None:
    """A call max_output_tokens cuts is a function_call item with the arguments so far (the worker's cut call,
    issue 48 item 3), never text: the response and the item incomplete, streamed alike; a follow-up to it runs."""
    s, _ = server
    client = s.client()
    # 40 tokens: past this model's call markup and the name, inside the arguments
    args: dict[str, Any] = {"model": "m", "input": QUESTION, "tools": TOOLS, "tool_choice": "required",
                            "max_output_tokens": 40, "temperature": 0}  # fmt: skip
    r = client.responses.create(**args)
    assert r.status == "incomplete" and r.incomplete_details is not None
    assert r.incomplete_details.reason == "max_output_tokens" and r.output_text == ""
    call = _call(r)
    assert call.name == "get_weather" and call.status == "incomplete" and call.arguments.startswith('{"city"')
    events: list[Any] = list(client.responses.create(**args, stream=True))
    kinds = [e.type for e in events]
    assert kinds[-3:] == ["response.function_call_arguments.done", "response.output_item.done", "response.incomplete"]
    assert "response.output_text.delta" not in kinds
    streamed = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert streamed == events[-3].arguments == call.arguments and events[-2].item.status == "incomplete"
    # the kept turn's cut call (not JSON) goes back as a call the template can show
    output: Any = [{"type": "function_call_output", "call_id": call.call_id, "output": RESULT}]
    r2 = client.responses.create(model="m", previous_response_id=r.id, input=output, tools=TOOLS, max_output_tokens=2)
    assert r2.usage is not None and r2.usage.input_tokens > r.usage.input_tokens  # type: ignore[union-attr]


def test_unenforced_schema_keywords(server: tuple[Server, list[str]]) -> None:
    """Without strict, a keyword the grammar cannot enforce is dropped and named (tokenwing.unenforced and the
    X-TokenWing-Unenforced header, from the request's `unenforced`); with strict it is the 400 it was."""
    s, _ = server
    schema = {"type": "array", "items": {"type": "integer"}, "uniqueItems": True, "maxItems": 3}
    fmt: dict[str, Any] = {"type": "json_schema", "name": "a", "schema": schema}
    body = {"model": "m", "input": "Numbers.", "max_output_tokens": 30, "text": {"format": fmt}}
    r = _post(s, "/v1/responses", body)
    assert r.status_code == 200, r.text
    assert (
        r.json()["tokenwing"]["unenforced"] == ["uniqueItems"] and r.headers["x-tokenwing-unenforced"] == "uniqueItems"
    )
    with httpx.stream("POST", s.url + "/v1/responses", json={**body, "stream": True},
                      headers={"Authorization": f"Bearer {KEY}"}, timeout=60) as streamed:  # fmt: skip
        assert streamed.headers["x-tokenwing-unenforced"] == "uniqueItems"
        last = [line for line in streamed.iter_lines() if line.startswith("data: ")][-1]
    assert json.loads(last.removeprefix("data: "))["response"]["tokenwing"]["unenforced"] == ["uniqueItems"]
    plain = _post(s, "/v1/responses", {**body, "text": {"format": {"type": "json_object"}}})
    assert plain.json()["tokenwing"]["unenforced"] == [] and "x-tokenwing-unenforced" not in plain.headers
    strict = _post(s, "/v1/responses", {**body, "text": {"format": {**fmt, "strict": True}}})
    assert strict.status_code == 400 and strict.json()["error"]["param"] == "text.format"
    assert "uniqueItems" in strict.json()["error"]["message"]


def test_kept_responses(server: tuple[Server, list[str]]) -> None:
    s, _ = server
    client = s.client()
    r = client.responses.create(model="m", input="Hi", max_output_tokens=2)
    assert client.responses.retrieve(r.id).output_text == r.output_text
    # the follow-up's prompt: the first turn's input and output, then the new input
    r2 = client.responses.create(model="m", input="And?", previous_response_id=r.id, max_output_tokens=2)
    turns = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": r.output_text},
             {"role": "user", "content": "And?"}]  # fmt: skip
    assert r2.usage is not None and r2.usage.input_tokens == _count(s, turns)
    client.responses.delete(r.id)
    for gone in (r.id, "resp_unknown"):
        with pytest.raises(openai.NotFoundError) as e:
            client.responses.create(model="m", input="x", previous_response_id=gone, max_output_tokens=2)
        assert e.value.code == "previous_response_not_found" and gone in e.value.message
        with pytest.raises(openai.NotFoundError):
            client.responses.retrieve(gone)
    # store false: not kept
    unkept = client.responses.create(model="m", input="Hi", max_output_tokens=2, store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model="m", input="x", previous_response_id=unkept.id, max_output_tokens=2)


def test_store_is_bounded() -> None:
    store = ResponseStore(count=3, size=10_000)
    for i in range(5):
        store.put({"id": f"r{i}", "pad": "x" * 100}, [])
    assert list(store.entries) == ["r2", "r3", "r4"]
    store.put({"id": "big", "pad": "x" * 9_900}, [])  # over the bytes: the oldest go
    assert list(store.entries) == ["big"] and store.bytes <= 10_000
    store.put({"id": "huge", "pad": "x" * 20_000}, [])  # larger than the whole store: never kept
    assert store.get("huge") is None and store.get("big") is not None


@pytest.mark.parametrize(
    ("body", "param", "words"),
    [
        ({"input": 5}, "input", "'input' must be a string or a list"),
        ({"input": [{"type": "image_generation_call"}]}, "input", "input[0].type 'image_generation_call'"),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input",
         "input[0].content[0].image_url.url must be a data: URL"),
        ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]}, "input",
         "input[0].content[0]: only text parts"),
        ({"input": [{"role": "tool", "content": "x"}]}, "input", "input[0].role"),
        ({"input": [{"type": "function_call_output", "call_id": "c9", "output": "1"}]}, "input",
         "input[0].call_id 'c9' answers no tool call"),
        ({"input": [{"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{x"}]}, "input",
         "input[0].arguments is not valid JSON"),
        ({"input": [{"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
                    {"type": "function_call", "call_id": "c2", "name": "f", "arguments": "[]"}]}, "input",
         "input[1].arguments"),
        ({"tools": [{"type": "web_search"}]}, "tools", "only function tools"),
        ({"tools": [{"type": "function", "name": "a b"}]}, "tools", "tools[0].name"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice", "'nope'"),
        ({"tool_choice": "sometimes"}, "tool_choice", "'tool_choice' must be"),
        ({"text": {"format": {"type": "xml"}}}, "text.format", "text.format.type"),
        ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format", "text.format.schema"),
        ({"max_output_tokens": 0}, "max_output_tokens", "'max_output_tokens' must be an integer"),
        ({"reasoning": {"effort": "extreme"}}, "reasoning", "reasoning.effort"),
        ({"background": True}, "background", "background"),
        ({"store": "yes"}, "store", "'store' must be a boolean"),
        ({"temperature": 9}, "temperature", "'temperature'"),
        ({"instructions": 3}, "instructions", "'instructions' must be a string"),
    ],
)  # fmt: skip
def test_bad_bodies_are_a_400_naming_the_field(
    server: tuple[Server, list[str]], body: dict[str, Any], param: str, words: str
) -> None:
    s, _ = server
    r = _post(s, "/v1/responses", {"model": "m", "input": "Hi", "max_output_tokens": 2, **body})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and words in err["message"], err
    assert err["type"] == "invalid_request_error"


def test_key_and_methods(server: tuple[Server, list[str]]) -> None:
    s, _ = server
    with pytest.raises(openai.AuthenticationError):
        s.client(key="wrong").responses.create(model="m", input="Hi")
    key = {"Authorization": f"Bearer {KEY}"}
    for r in (httpx.put(s.url + "/v1/responses/resp_x", json={}, headers=key), httpx.get(s.url + "/v1/responses",
              headers=key)):  # fmt: skip
        assert r.status_code == 405 and r.json()["error"]["message"], r.text


# ------------------------------------------------------------------------------------------------------ fuzz
RESPONSES: dict[str, Any] = {
    "model": "m",
    "instructions": "Be brief.",
    "input": [
        {"role": "user", "content": [{"type": "input_text", "text": "Hello"}]},
        {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "Hm."}]},
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": '{"a": "x"}'},
        {"type": "function_call_output", "call_id": "c1", "output": "42"},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "42."}]},
        {"role": "developer", "content": "And?"},
    ],
    "tools": [{"type": "function", "name": "f", "description": "d", "strict": False,
               "parameters": {"type": "object", "properties": {"a": {"type": "string"}}, "required": ["a"]}}],
    "tool_choice": "auto",
    "parallel_tool_calls": True,
    "text": {"format": {"type": "text"}},
    "reasoning": {"effort": "low"},
    "max_output_tokens": 2,
    "temperature": 0,
    "top_p": 0.9,
    "store": False,
    "include": ["message.output_text.logprobs"],
    "top_logprobs": 2,
    "truncation": "auto",
    "metadata": {"k": "v"},
    "stream": False,
}  # fmt: skip
FUZZ_SEED = 48
FUZZ_CASES = 200


def test_fuzzed_bodies_get_clean_answers(server: tuple[Server, list[str]]) -> None:
    s, log = server
    assert _post(s, "/v1/responses", RESPONSES).status_code == 200  # the body the fuzz mutates is a valid one
    failures: list[str] = []
    statuses: Counter[int] = Counter()
    for case in http_fuzz.cases(FUZZ_SEED, FUZZ_CASES, {"/v1/responses": RESPONSES}):
        try:
            answer = http_fuzz.send(case, int(s.handshake["port"]), KEY)
        except (OSError, ConnectionError) as e:
            failures.append(f"{case.kind}: {type(e).__name__}: {e}")
            continue
        statuses[answer.status] += 1
        problem = answer.problem(head=case.method == "HEAD")
        if problem:
            failures.append(f"{case.kind}: {problem}")
    assert not failures, "\n".join(failures[:20])
    assert statuses[200] > 0 and statuses[400] > 0
    assert httpx.get(s.url + "/health", timeout=30).json()["status"] == "ok"
    assert not [line for line in log if "Traceback" in line], "".join(log[-40:])


@pytest.mark.parametrize(
    ("reasoning", "kwargs", "variables"),
    [
        ({"effort": "high"}, None, {"enable_thinking": True, "thinking": True, "reasoning_effort": "high"}),
        ({"effort": "medium"}, None, {"enable_thinking": True, "thinking": True, "reasoning_effort": "medium"}),
        ({"effort": "none"}, None, {"enable_thinking": False, "thinking": False, "reasoning_effort": "low"}),
        ({"effort": "minimal"}, None, {"enable_thinking": False, "thinking": False, "reasoning_effort": "low"}),
        ({"effort": "low"}, {"enable_thinking": True}, {"enable_thinking": True, "thinking": True,
                                                         "reasoning_effort": "low"}),
        ({"effort": "none"}, {"enable_thinking": True}, {"enable_thinking": True, "thinking": False,
                                                          "reasoning_effort": "low"}),
        (None, None, {}),
        ({"summary": "auto"}, {"x": 1}, {"x": 1}),
    ],
)  # fmt: skip
def test_reasoning_effort_is_the_templates_variables(reasoning: Any, kwargs: Any, variables: dict[str, Any]) -> None:
    """reasoning.effort as the variables families' templates read (Qwen3's and GLM's enable_thinking, DeepSeek
    V3.1's thinking, gpt-oss's reasoning_effort); the client's own chat_template_kwargs win. (No generated model's
    template reads them, so this reads the request the route runs.)"""
    body = {"input": "Hi", "reasoning": reasoning, "chat_template_kwargs": kwargs}
    assert parse_responses(body, ResponseStore()).req.variables == variables


# ------------------------------------------------------------------------------------- scripted: agent, reasoning
def test_agents_sdk_agent_runs_its_tool(repacked_factory: ModelFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    """An OpenAI Agents SDK agent (its default model: the Responses API) with a function tool: the first turn
    forced to call it (tool_choice required, reset after the call), the tool run, its result sent back, the
    answer the run's final output."""
    model = repacked_factory(arch="deepseek2", type="Q8_0")
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Zürich"}}\n</tool_call>'
    # two runs, each two requests: the call, then the answer
    monkeypatch.setenv("TOKENWING_TEST_TOKENS", script(model, [call, ANSWER, call, ANSWER]))
    s = Server(model, "--ctx", "4096")
    ran: list[str] = []

    @function_tool
    def get_weather(city: str) -> str:
        """The weather now in a city, in °C."""
        ran.append(city)
        return "21 °C, sunny"

    def agent() -> Agent:
        # a client per run: each run has its own event loop, and an AsyncOpenAI client belongs to one
        client = openai.AsyncOpenAI(base_url=s.url + "/v1", api_key=KEY, max_retries=0, timeout=60)
        return Agent(
            name="weather",
            instructions="Answer with the weather.",
            tools=[get_weather],
            model=OpenAIResponsesModel(model="m", openai_client=client),
            model_settings=ModelSettings(tool_choice="required", max_tokens=200),
            reset_tool_choice=True,
        )

    async def streamed() -> tuple[Any, list[str]]:
        run = Runner.run_streamed(agent(), "What is the weather in Zürich?", max_turns=4)
        kinds = [ev.type async for ev in run.stream_events()]
        return run, kinds

    try:
        set_tracing_disabled(True)
        result = Runner.run_sync(agent(), "What is the weather in Zürich?", max_turns=4)
        assert ran == ["Zürich"]
        assert result.final_output == ANSWER
        outputs = [item.type for item in result.new_items]
        assert outputs == ["tool_call_item", "tool_call_output_item", "message_output_item"]
        # the same run streamed (the SDK reads the Responses stream's events: the call, then the answer's deltas)
        run, kinds = asyncio.run(streamed())
        assert ran == ["Zürich", "Zürich"] and run.final_output == ANSWER
        assert [item.type for item in run.new_items] == outputs and "raw_response_event" in kinds
    finally:
        s.stop()


def test_reasoning_items(repacked_factory: ModelFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    """gpt-oss (it reasons): its analysis channel is a `reasoning` item, streamed as reasoning_text events;
    reasoning.effort is its template's reasoning_effort; a reasoning item sent back goes to its turn."""
    model = repacked_factory(arch="gpt-oss", type="Q8_0")
    monkeypatch.setenv("TOKENWING_TEST_TOKENS", scripted(model, REPLY))
    s = Server(model, "--ctx", "2048")
    try:
        client = s.client()
        r = client.responses.create(model="m", input="Hi", max_output_tokens=64, reasoning={"effort": "high"})
        assert [o.type for o in r.output] == ["reasoning", "message"]
        thought: Any = r.output[0]
        assert thought.id.startswith("rs_") and thought.summary == []
        assert thought.content[0].type == "reasoning_text"
        assert thought.content[0].text == "The user greets; answer briefly."
        assert r.output_text == "Hello there!" and r.status == "completed"
        assert r.usage is not None and r.usage.output_tokens_details.reasoning_tokens > 0
        # (this generated model's harmony template reads no reasoning_effort: which variables the effort sets is
        # test_reasoning_effort_is_the_templates_variables's; here, that the prompt is the one they make)
        hi = [{"role": "user", "content": "Hi"}]
        assert r.usage.input_tokens == _count(s, hi, chat_template_kwargs={"reasoning_effort": "high"})

        events: list[Any] = list(client.responses.create(model="m", input="Hi", max_output_tokens=64, stream=True))
        kinds = [e.type for e in events]
        assert kinds[2:4] == ["response.output_item.added", "response.content_part.added"]
        assert events[2].item.type == "reasoning" and events[3].part.type == "reasoning_text"
        assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == thought.content[0].text
        assert kinds.index("response.reasoning_text.done") < kinds.index("response.output_text.delta")
        assert events[-1].type == "response.completed" and events[-1].response.output_text == "Hello there!"

        # the reasoning sent back belongs to the assistant turn after it (as the chat endpoint's reasoning_content)
        items: Any = [{"role": "user", "content": "Hi"}, thought.model_dump(exclude_none=True),
                      r.output[1].model_dump(exclude_none=True), {"role": "user", "content": "And?"}]  # fmt: skip
        again = client.responses.create(model="m", input=items, max_output_tokens=8)
        chat = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello there!",
                 "reasoning_content": thought.content[0].text}, {"role": "user", "content": "And?"}]  # fmt: skip
        assert again.usage is not None and again.usage.input_tokens == _count(s, chat)
    finally:
        s.stop()


def test_a_kept_cut_call_goes_back_as_its_whole_members() -> None:
    """A stored call cut by max_output_tokens, sent back by previous_response_id, stands for the members it wrote
    whole (the chat endpoint's reading of such a call, text/tools/base.cut_arguments), not for {} nor a 400."""
    assert json.loads(responses._args({"arguments": '{"unit": "C", "city": "Zü'})) == {"unit": "C"}
    assert json.loads(responses._args({"arguments": '{"city": "Zü'})) == {}
    assert responses._args({"arguments": '{"city": "Zürich"}'}) == '{"city": "Zürich"}'
    assert responses._args({"arguments": "[1, 2]"}) == "{}" and responses._args({"arguments": ""}) == "{}"
