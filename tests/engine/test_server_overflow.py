"""A chat that outgrows the context (`tokenwing serve --context-overflow`, the request's `context_overflow`),
through a real `tokenwing serve` of the built-in demo model (a 512-token context: a few turns fill it) and the
official `openai` client: rolling drops the oldest turns and keeps the system prompt and the last user message,
trim-middle keeps the first user turn, stop refuses with OpenAI's `context_length_exceeded`, a tool's result goes
with its call, the response says what was dropped (streamed: first and last chunk), a max_tokens beyond the
context is clamped, not refused; and `POST /v1/chat/count` counts a chat as the engine runs it.

What was kept is checked twice: the reply's prompt tokens equal /v1/chat/count's of the expected conversation,
and its greedy reply equals the reply to that conversation sent whole (the same prompt gives the same tokens)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.conftest import run_cli
from tests.engine.test_server import KEY, Server
from tokenwing.server.overflow import drop_order, turns

MODEL = Path(__file__).resolve().parents[2] / "resources" / "demo-model" / "tokenwing-demo-moe.gguf"
AUTH = {"Authorization": f"Bearer {KEY}"}
N_CTX = 512  # (the Server's --ctx)

WORDS = "the king walked to the river and sang a song about the moon . "
SYSTEM = {"role": "system", "content": "You are a storyteller who answers in one short sentence."}
LAST = {"role": "user", "content": "Tell me a story about a king."}


def _text(i: int, repeats: int) -> str:
    return f"Part {i}: " + WORDS * repeats


# Eight turns before the last question, each shorter than the one before (from about 200 tokens to 80): about
# 1,100 tokens, twice the context. Which end goes changes how many go and the prompt's length.
TURNS = [
    [{"role": "user", "content": _text(i, 8 - i)}, {"role": "assistant", "content": _text(100 + i, 2 + i % 2)}]
    for i in range(8)
]
CONVERSATION = [SYSTEM, *(m for turn in TURNS for m in turn), LAST]


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("demo") / "tokenwing-demo-moe.tw.gguf"
    r = run_cli("repack", str(MODEL), "-o", str(out), "-q")
    assert r.returncode == 0, r.stderr
    return out


@pytest.fixture(scope="module")
def server(demo: Path) -> Iterator[Server]:
    s = Server(demo)  # the default policy: rolling
    yield s
    s.stop()


def _count(server: Server, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> Any:
    body: dict[str, Any] = {"messages": messages, **({"tools": tools} if tools else {})}
    r = httpx.post(server.url + "/v1/chat/count", json=body, headers=AUTH, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def _chat(server: Server, messages: list[dict[str, Any]], **kw: Any) -> Any:
    kw.setdefault("max_tokens", 4)
    return server.client().chat.completions.create(model="x", messages=messages, temperature=0, **kw)


def _same_prompt(a: Any, b: Any) -> bool:
    """Two replies to one prompt: the same greedy text and the same log-probabilities of its tokens (the model's
    distribution after the whole prompt: another history moves them)."""
    la = [t.logprob for t in a.choices[0].logprobs.content]
    lb = [t.logprob for t in b.choices[0].logprobs.content]
    same = a.choices[0].message.content == b.choices[0].message.content and len(la) == len(lb)
    return same and all(abs(x - y) < 1e-4 for x, y in zip(la, lb, strict=False))


def _expected(server: Server, keep: Any, reserve: int) -> tuple[int, list[dict[str, Any]]]:
    """The fewest turns dropped (`keep(k)`: the conversation without k of them) that leave `reserve` tokens."""
    for k in range(len(TURNS) + 1):
        kept = keep(k)
        if _count(server, kept)["prompt_tokens"] + reserve <= N_CTX:
            return k, kept
    raise AssertionError("the test's conversation never fits")


def _overflow(response: Any) -> Any:
    return (response.model_extra.get("tokenwing") or {}).get("context_overflow")


def _first_chunk(server: Server, messages: list[dict[str, Any]], **kw: Any) -> Any:
    """The first chunk of a streamed reply (what was dropped, said before any token is generated), then the
    stream closed: the fitting checked whatever the reply's length, at no cost of decoding on a slow machine."""
    stream = server.client().chat.completions.create(model="x", messages=messages, stream=True, **kw)  # type: ignore[call-overload]
    try:
        return next(iter(stream))
    finally:
        stream.close()


def _kept_tokens(server: Server, report: Any) -> int:
    """The prompt that ran, from the report: the whole conversation's tokens less those dropped."""
    return int(_count(server, CONVERSATION)["prompt_tokens"]) - int(report["dropped_tokens"])


def test_rolling_drops_the_oldest_turns_and_keeps_system_and_last(server: Server) -> None:
    full = _count(server, CONVERSATION)["prompt_tokens"]
    assert full > N_CTX  # the conversation alone overflows
    k, kept = _expected(server, lambda k: [SYSTEM, *(m for t in TURNS[k:] for m in t), LAST], 4)
    assert 0 < k < len(TURNS)
    assert kept[0] == SYSTEM and kept[-1] == LAST and kept[1] == TURNS[k][0]
    r = _chat(server, CONVERSATION, logprobs=True)
    assert r.usage is not None and r.usage.prompt_tokens == _count(server, kept)["prompt_tokens"]
    report = _overflow(r)
    assert report == {
        "policy": "rolling",
        "dropped_messages": 2 * k,
        "dropped_tokens": full - r.usage.prompt_tokens,
    }
    whole = _chat(server, kept, logprobs=True)  # the kept conversation sent as it is: the same prompt
    assert _overflow(whole) is None and whole.usage is not None
    assert whole.usage.prompt_tokens == r.usage.prompt_tokens
    assert _same_prompt(whole, r)
    # (one turn more dropped is another prompt: the check tells histories apart)
    fewer = [SYSTEM, *(m for t in TURNS[k + 1 :] for m in t), LAST]
    assert not _same_prompt(_chat(server, fewer, logprobs=True), r)
    # a conversation that fits is not touched
    short = _chat(server, [SYSTEM, *TURNS[-1], LAST])
    assert _overflow(short) is None
    # (counted: one overflowing request so far at least)
    metrics = httpx.get(server.url + "/metrics").text
    assert "tokenwing_context_overflows_total" in metrics
    assert int(metrics.split("tokenwing_context_overflows_total ")[1].split()[0]) >= 1


def test_trim_middle_keeps_the_first_user_turn(server: Server) -> None:
    def keep(k: int) -> list[dict[str, Any]]:
        return [SYSTEM, *TURNS[0], *(m for t in TURNS[1 + k :] for m in t), LAST]

    k, kept = _expected(server, keep, 4)
    assert 0 < k < len(TURNS) - 1
    r = _chat(server, CONVERSATION, logprobs=True, extra_body={"context_overflow": "trim-middle"})
    assert r.usage is not None and r.usage.prompt_tokens == _count(server, kept)["prompt_tokens"]
    assert _overflow(r)["policy"] == "trim-middle" and _overflow(r)["dropped_messages"] == 2 * k
    assert _same_prompt(_chat(server, kept, logprobs=True), r)


def test_the_reply_room_is_max_tokens_else_a_quarter(server: Server) -> None:
    def keep(k: int) -> list[dict[str, Any]]:
        return [SYSTEM, *(m for t in TURNS[k:] for m in t), LAST]

    # max_tokens 300: the prompt leaves 300 tokens
    k300, kept300 = _expected(server, keep, 300)
    report = _first_chunk(server, CONVERSATION, max_tokens=300).model_extra["tokenwing"]["context_overflow"]
    assert report["dropped_messages"] == 2 * k300
    assert _kept_tokens(server, report) == _count(server, kept300)["prompt_tokens"]
    # no max_tokens: a quarter of the context (128)
    k128, kept128 = _expected(server, keep, N_CTX // 4)
    assert k128 < k300
    report = _first_chunk(server, CONVERSATION).model_extra["tokenwing"]["context_overflow"]
    assert report["dropped_messages"] == 2 * k128
    assert _kept_tokens(server, report) == _count(server, kept128)["prompt_tokens"]


def test_a_max_tokens_beyond_the_context_is_clamped_not_refused(server: Server) -> None:
    # one message (nothing to drop) leaving a few tokens of room, asking for far more than the context: served,
    # and the reply runs to the context's end
    words = (WORDS * 60).split()
    lo, hi = 1, len(words)  # the most words whose prompt leaves at least 8 tokens (a binary search)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        n = _count(server, [{"role": "user", "content": " ".join(words[:mid])}])["prompt_tokens"]
        lo, hi = (mid, hi) if n <= N_CTX - 8 else (lo, mid)
    question = [{"role": "user", "content": " ".join(words[:lo])}]
    assert _count(server, question)["prompt_tokens"] > N_CTX - 20  # (a short reply: fast on a slow machine)
    r = _chat(server, question, max_tokens=100_000, extra_body={"ignore_eos": True})
    assert r.usage is not None and r.choices[0].finish_reason == "length"
    assert r.usage.prompt_tokens + r.usage.completion_tokens == N_CTX
    assert r.model_extra["tokenwing"]["finish_detail"] == "context_full" and _overflow(r) is None
    # an overflowing conversation, asking for the impossible: rolled to leave the default quarter, not refused
    k, kept = _expected(server, lambda k: [SYSTEM, *(m for t in TURNS[k:] for m in t), LAST], N_CTX // 4)
    report = _first_chunk(server, CONVERSATION, max_tokens=100_000).model_extra["tokenwing"]["context_overflow"]
    assert report["policy"] == "rolling" and report["dropped_messages"] == 2 * k
    assert _kept_tokens(server, report) == _count(server, kept)["prompt_tokens"]


def test_the_report_is_in_the_first_and_last_chunk_of_a_stream(server: Server) -> None:
    whole = _chat(server, CONVERSATION)
    chunks = list(_chat(server, CONVERSATION, stream=True))
    assert chunks[0].model_extra["tokenwing"]["context_overflow"] == _overflow(whole)
    last = [c for c in chunks if c.choices and c.choices[0].finish_reason][-1]
    assert last.model_extra["tokenwing"]["context_overflow"] == _overflow(whole)
    assert last.model_extra["tokenwing"]["n_ctx"] == N_CTX
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    # nothing dropped: no report in either
    chunks = list(_chat(server, [SYSTEM, LAST], stream=True))
    assert "tokenwing" not in (chunks[0].model_extra or {})
    assert "context_overflow" not in chunks[-1].model_extra["tokenwing"]


def test_a_rolled_prompt_is_reused_from_the_cache(server: Server) -> None:
    first = _chat(server, CONVERSATION)
    again = _chat(server, CONVERSATION)
    assert _overflow(again) == _overflow(first)
    assert again.usage is not None
    assert again.model_extra["tokenwing"]["prompt_cached_tokens"] >= again.usage.prompt_tokens - 1


CALL = {"id": "call_1", "type": "function", "function": {"name": "get_time", "arguments": '{"city": "Paris"}'}}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "description": "The time in a city.",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    }
]


def test_a_tool_result_is_dropped_with_its_call(server: Server) -> None:
    # the first turn: a question, the call, a long result, the answer; dropping up to the result would fit, and
    # leave the answer without its question (dropping messages one by one drops 3)
    first = [
        {"role": "user", "content": "What time is it in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [CALL]},
        {"role": "tool", "tool_call_id": "call_1", "content": _text(7, 25)},
        {"role": "assistant", "content": "It is noon in Paris."},
    ]
    conversation = [SYSTEM, *first, *TURNS[0], LAST]
    assert _count(server, conversation, TOOLS)["prompt_tokens"] > N_CTX - 4
    assert _count(server, [SYSTEM, first[3], *TURNS[0], LAST], TOOLS)["prompt_tokens"] <= N_CTX - 4
    r = _chat(server, conversation, tools=TOOLS, tool_choice="none")  # (none: the model is not shown them)
    kept = [SYSTEM, *TURNS[0], LAST]
    assert _overflow(r)["dropped_messages"] == 4
    assert r.usage is not None and r.usage.prompt_tokens == _count(server, kept)["prompt_tokens"]
    r = _chat(server, conversation, tools=TOOLS)  # shown: the definitions are kept, the turn still goes whole
    assert _overflow(r)["dropped_messages"] == 4
    assert r.usage is not None and r.usage.prompt_tokens == _count(server, kept, TOOLS)["prompt_tokens"]


def test_stop_refuses_and_the_flag_sets_the_default(demo: Path) -> None:
    s = Server(demo, "--context-overflow", "stop")
    try:
        for stream in (False, True):  # refused with its status before any stream starts
            with pytest.raises(openai.BadRequestError) as e:
                _chat(s, CONVERSATION, stream=stream)
            assert e.value.code == "context_length_exceeded" and e.value.param == "messages"
            assert "context_overflow is 'stop'" in e.value.message and f"the {N_CTX}-token context" in e.value.message
        r = _chat(s, CONVERSATION, extra_body={"context_overflow": "rolling"})  # the request's field overrides it
        assert _overflow(r)["policy"] == "rolling"
        assert _overflow(_chat(s, [SYSTEM, LAST])) is None  # what fits is served under stop too
    finally:
        s.stop()


def test_what_is_never_dropped_not_fitting_is_a_400_naming_its_parts(server: Server) -> None:
    big = [
        {
            "type": "function",
            "function": {"name": f"tool_{i}", "description": _text(i, 6), "parameters": {"type": "object"}},
        }
        for i in range(4)
    ]
    counted = _count(server, [SYSTEM, LAST], big)
    assert counted["prompt_tokens"] >= N_CTX and counted["n_ctx"] == N_CTX
    system_alone = _count(server, [SYSTEM, LAST])["prompt_tokens"] - _count(server, [LAST])["prompt_tokens"]
    last_alone = _count(server, [LAST])["prompt_tokens"]
    with pytest.raises(openai.BadRequestError) as e:
        _chat(server, [SYSTEM, *TURNS[0], LAST], tools=big)
    assert e.value.code == "context_length_exceeded"
    assert e.value.body["message"] == (
        f"the system prompt ({system_alone} tokens), the tool definitions ({counted['tools_tokens']:,} tokens) and "
        f"the last user message ({last_alone} tokens) take {counted['prompt_tokens']:,} tokens of the "
        f"{N_CTX}-token context, leaving no room for a reply"
    )
    # a last message alone too long for the context: named alone
    huge = {"role": "user", "content": _text(1, 60)}
    with pytest.raises(openai.BadRequestError) as e:
        _chat(server, [huge])
    n = _count(server, [huge])["prompt_tokens"]
    assert (
        e.value.body["message"]
        == f"the last user message takes {n:,} tokens of the {N_CTX}-token context, leaving no room for a reply"
    )
    # a bad policy is the client's mistake, named
    with pytest.raises(openai.BadRequestError) as e:
        _chat(server, [LAST], extra_body={"context_overflow": "sideways"})
    assert e.value.param == "context_overflow"


def test_count_is_the_engine_s_prompt(server: Server) -> None:
    conversation = [SYSTEM, *TURNS[0], LAST]
    for tools in (None, TOOLS):
        body: dict[str, Any] = {"messages": conversation, **({"tools": tools} if tools else {})}
        prompt = httpx.post(server.url + "/apply-template", json=body, headers=AUTH, timeout=60).json()["prompt"]
        tokens = httpx.post(
            server.url + "/tokenize", json={"content": prompt, "add_special": True}, headers=AUTH, timeout=60
        ).json()["tokens"]
        counted = _count(server, conversation, tools)
        assert counted["prompt_tokens"] == len(tokens) and counted["n_ctx"] == N_CTX
        r = _chat(server, conversation, **({"tools": tools} if tools else {}))
        assert r.usage is not None and r.usage.prompt_tokens == counted["prompt_tokens"]
        without = _count(server, conversation)["prompt_tokens"]
        assert counted["tools_tokens"] == counted["prompt_tokens"] - without
        assert (counted["tools_tokens"] > 0) == (tools is not None)
    # the other routes' key
    assert httpx.post(server.url + "/v1/chat/count", json={"messages": [LAST]}).status_code == 401
    r = httpx.post(server.url + "/v1/chat/count", json={"messages": []}, headers=AUTH)
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"


def test_turns_keep_calls_with_their_results() -> None:
    """The turns' bounds where a result does not follow its call at once (OpenAI allows a user message between
    them): the turns join, and a result in the kept end keeps the turn of its call."""

    def call(i: str) -> dict[str, Any]:
        return {"role": "assistant", "content": "", "tool_calls": [{"id": i, "type": "function"}]}

    def result(i: str) -> dict[str, Any]:
        return {"role": "tool", "tool_call_id": i, "content": "r"}

    u, a, sys_ = {"role": "user", "content": "u"}, {"role": "assistant", "content": "a"}, SYSTEM
    assert turns([sys_, u, a, u, call("c"), result("c"), a, u]) == ([[1, 2], [3, 4, 5, 6]], 7)
    assert turns([u, call("c"), u, result("c"), a, u]) == ([[0, 1, 2, 3, 4]], 5)
    assert turns([u, a, u, call("c"), u, result("c")]) == ([[0, 1]], 2)  # the last user message's answer: kept
    assert turns([a, u, a, sys_, u, a, u]) == ([[0], [1, 2], [4, 5]], 6)  # a greeting; a system message stays
    messages = [a, u, a, u, a, u, a, u]
    groups, _ = turns(messages)
    assert drop_order(messages, groups, "rolling") == [[0], [1, 2], [3, 4], [5, 6]]
    assert drop_order(messages, groups, "trim-middle") == [[0], [3, 4], [5, 6], [1, 2]]
