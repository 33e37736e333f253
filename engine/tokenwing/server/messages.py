"""`POST /v1/messages` and `POST /v1/messages/count_tokens`: Anthropic's Messages API (docs/api.md), for the clients
built for it (the official `anthropic` SDK, Claude Code).

A body is turned into the chat endpoint's own body (OpenAI's shape) and read by `protocol.parse_chat`, so that
messages, tools, tool_choice, schemas and sampling are checked in one place and the request is the one
`GenerationRequest` every route runs: the same worker, slots, templates, tool-call formats and grammars. Its
errors are said back in Anthropic's words (its field names, its message indexes). The worker's events
(server/jobs.py) come back as Anthropic's content blocks (`thinking`, `text`, `tool_use`), stop reasons and
server-sent events, as the official SDK reads them."""

from __future__ import annotations

import asyncio
import hashlib
import json
import re
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from tokenwing.errors import BadInputError
from tokenwing.server import jobs
from tokenwing.server.protocol import GenerationRequest, RequestError, parse_chat
from tokenwing.server.worker import EngineWorker, Job
from tokenwing.text.tools.base import cut_arguments

PATH = "/v1/messages"

# Anthropic's error types by HTTP status (https://docs.anthropic.com/en/api/errors); other 4xx are invalid requests
_ERROR_TYPES = {
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
}
_STOP_REASONS = {"tool_calls": "tool_use", "length": "max_tokens"}
# Fields of Anthropic's that need what this server does not have (its hosted containers, MCP connectors): refused,
# never ignored, as the chat endpoint refuses what it does not implement
_UNSUPPORTED = {
    "container": "'container' (Anthropic's hosted code containers) is not supported by this server",
    "mcp_servers": "'mcp_servers' (Anthropic's MCP connector) is not supported by this server: run the MCP client "
    "yourself and pass its tools as tools",
}
# TokenWing's own fields, passed on to the chat endpoint's reading as they are (the SDK sends them in extra_body)
_PASSED = ("context_overflow", "wait", "ignore_eos", "seed", "min_p", "repeat_penalty")
# `thinking` as the families' templates read it: Qwen3, GLM, Ling (enable_thinking; DeepSeek's templates take it
# too), DeepSeek V3.1-V4 and Kimi K3 (thinking), MiniMax M3 (thinking_mode). Templates ignore the others.
_THINKING_ON = {"enable_thinking": True, "thinking": True, "thinking_mode": "enabled"}
_THINKING_OFF = {"enable_thinking": False, "thinking": False, "thinking_mode": "disabled"}
# output_config.effort as gpt-oss's, DeepSeek V4's and others' `reasoning_effort` (low, medium, high)
_EFFORT = {"low": "low", "medium": "medium", "high": "high", "xhigh": "high", "max": "high"}


def error(e: RequestError, headers: Mapping[str, str] | None = None) -> JSONResponse:
    """A refusal in Anthropic's format: `{"type": "error", "error": {"type", "message"}}`."""
    return JSONResponse(_error_body(e), status_code=e.status, headers=headers)


def _error_body(e: RequestError) -> dict[str, Any]:
    kind = _ERROR_TYPES.get(e.status, "api_error" if e.status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": e.message}}


def routed(path: str) -> bool:
    """Whether a path is this API's (its refusals before the route, a 404 or 405, go out in its format too)."""
    return path == PATH or path.startswith(PATH + "/")


def as_anthropic(response: Response) -> Response:
    """A refusal made in OpenAI's format before a route ran (the guard's 403 and 415, Starlette's 404 and 405), in
    Anthropic's, its status and headers kept."""
    try:
        doc = json.loads(bytes(response.body))
        message = str(doc["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return response
    kept = {k: v for k, v in response.headers.items() if k.lower() not in ("content-length", "content-type")}
    return error(RequestError(message, status=response.status_code), kept)


# ---------------------------------------------------------------------------------------------------- requests
@dataclass
class MessagesRequest:
    req: GenerationRequest
    omit_thinking: bool = False  # thinking.display "omitted": thinking blocks go out empty, with their signature


def parse(body: Any, count: bool = False) -> MessagesRequest:
    """A Messages body (`count`: count_tokens', where max_tokens is not asked for) as the engine's request."""
    chat, origin, omit = _chat_body(body, count)
    try:
        req = parse_chat(chat)
    except RequestError as e:
        raise RequestError(_anthropic_words(e.message, origin), e.param, e.status, e.kind, e.code) from None
    return MessagesRequest(req, omit)


def _chat_body(body: Any, count: bool) -> tuple[dict[str, Any], list[int], bool]:
    """The chat endpoint's body for a Messages body; for each of its messages, the index of the Anthropic message
    it came from (-1: the system prompt); whether thinking is to be omitted."""
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
    for key, message in _UNSUPPORTED.items():
        if body.get(key) not in (None, [], {}):
            raise RequestError(message, key)
    chat: dict[str, Any] = {k: body[k] for k in _PASSED if k in body}
    messages: list[dict[str, Any]] = []
    origin: list[int] = []
    system = body.get("system")
    if system is not None and system != "" and system != []:
        # a string or text blocks: parse_chat reads both (a block's cache_control is Anthropic's cache: not read)
        messages.append({"role": "system", "content": _text_parts(system) if isinstance(system, list) else system})
        origin.append(-1)
    turns = body.get("messages")
    if not isinstance(turns, list) or not turns:
        raise RequestError("'messages' must be a non-empty list", "messages")
    for i, turn in enumerate(turns):
        for m in _message(turn, i):
            messages.append(m)
            origin.append(i)
    if turns[-1].get("role") == "assistant":
        raise RequestError(
            "the last message is the assistant's: continuing a reply (prefill) is not supported; end with a user "
            "message",
            "messages",
        )
    chat["messages"] = messages

    if not count and body.get("max_tokens") is None:
        raise RequestError("'max_tokens' is required", "max_tokens")
    if body.get("max_tokens") is not None:
        chat["max_tokens"] = body["max_tokens"]
    for key in ("temperature", "top_p", "top_k", "stream"):
        if key in body:
            chat[key] = body[key]
    stops = body.get("stop_sequences")
    if stops is not None:
        if not isinstance(stops, list):
            raise RequestError("'stop_sequences' must be a list of strings", "stop_sequences")
        chat["stop"] = stops

    tools = _tools(body.get("tools"))
    if tools is not None:
        chat["tools"] = tools
    choice, parallel = _tool_choice(body.get("tool_choice"), bool(tools))
    if choice is not None:
        chat["tool_choice"] = choice
    if parallel is not None:
        chat["parallel_tool_calls"] = parallel

    variables, omit = _thinking(body.get("thinking"))
    output = body.get("output_config")
    if output is not None:
        if not isinstance(output, dict):
            raise RequestError("'output_config' must be an object", "output_config")
        effort = output.get("effort")
        if effort is not None:
            if effort not in _EFFORT:
                raise RequestError(f"output_config.effort must be one of {', '.join(_EFFORT)}", "output_config")
            variables["reasoning_effort"] = _EFFORT[effort]
        fmt = output.get("format")
        if fmt is not None:
            if not isinstance(fmt, dict) or fmt.get("type") != "json_schema" or "schema" not in fmt:
                raise RequestError(
                    "output_config.format must be {'type': 'json_schema', 'schema': {...}}", "output_config"
                )
            chat["response_format"] = {
                "type": "json_schema",
                "json_schema": {"name": "output", "schema": fmt["schema"]},
            }
    kwargs = body.get("chat_template_kwargs")  # (TokenWing's: the template's variables, over those above)
    chat["chat_template_kwargs"] = {**variables, **kwargs} if isinstance(kwargs, dict) else kwargs or variables
    return chat, origin, omit


def _text_parts(blocks: list[Any]) -> list[Any]:
    """Text blocks as the chat endpoint's text parts (their cache_control and citations left behind); anything
    else as it is, for parse_chat to refuse."""
    return [
        {"type": "text", "text": b.get("text")} if isinstance(b, dict) and b.get("type") == "text" else b
        for b in blocks
    ]


def _message(m: Any, i: int) -> list[dict[str, Any]]:
    """One Anthropic message as chat messages: a user turn's tool_result blocks become tool messages, in order
    with its text; an assistant turn's tool_use blocks its tool_calls and its thinking its reasoning."""
    where = f"messages[{i}]"
    if not isinstance(m, dict):
        raise RequestError(f"{where} must be an object", "messages")
    role = m.get("role")
    if role not in ("user", "assistant"):
        raise RequestError(f"{where}.role must be 'user' or 'assistant' (the system prompt is 'system')", "messages")
    content = m.get("content")
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    if not isinstance(content, list):
        raise RequestError(f"{where}.content must be a string or a list of content blocks", "messages")
    if role == "assistant":
        return [_assistant(content, where)]
    out: list[dict[str, Any]] = []
    text: list[Any] = []
    for j, block in enumerate(content):
        kind = _block_type(block, f"{where}.content[{j}]")
        if kind == "text":
            text += _text_parts([block])
        elif kind == "image":
            text.append(_image(block, f"{where}.content[{j}]"))
        elif kind == "tool_result":
            if text:
                out.append({"role": "user", "content": text})
                text = []
            out.append(_tool_result(block, f"{where}.content[{j}]"))
        else:
            raise _unsupported_block(kind, f"{where}.content[{j}]", "a user")
    if text or not out:
        out.append({"role": "user", "content": text})
    return out


def _assistant(content: list[Any], where: str) -> dict[str, Any]:
    text: list[Any] = []
    thinking: list[str] = []
    calls: list[dict[str, Any]] = []
    for j, block in enumerate(content):
        at = f"{where}.content[{j}]"
        kind = _block_type(block, at)
        if kind == "text":
            text += _text_parts([block])
        elif kind == "tool_use":
            if not isinstance(block.get("id"), str) or not block["id"]:
                raise RequestError(f"{at}.id must be a non-empty string", "messages")
            if not isinstance(block.get("input"), dict):
                raise RequestError(f"{at}.input must be an object (the tool's arguments)", "messages")
            fn = {"name": block.get("name"), "arguments": block["input"]}
            calls.append({"id": block["id"], "type": "function", "function": fn})
        elif kind == "thinking":
            if not isinstance(block.get("thinking"), str):
                raise RequestError(f"{at}.thinking must be a string", "messages")
            thinking.append(block["thinking"])
        elif kind == "redacted_thinking":
            continue  # Anthropic's encrypted thinking: nothing a template could show
        else:
            raise _unsupported_block(kind, at, "an assistant")
    out: dict[str, Any] = {"role": "assistant", "content": text}
    if thinking:
        out["reasoning_content"] = "\n\n".join(thinking)
    if calls:
        out["tool_calls"] = calls
    return out


def _image(block: dict[str, Any], where: str) -> dict[str, Any]:
    """An image block (its source base64 data, or a url) as the chat endpoint's image_url part
    (server/image_parts.py reads it)."""
    src = block.get("source")
    kind = src.get("type") if isinstance(src, dict) else None
    if kind == "base64" and isinstance(src, dict) and isinstance(src.get("data"), str):
        media = src.get("media_type") if isinstance(src.get("media_type"), str) else "image/png"
        return {"type": "image_url", "image_url": {"url": f"data:{media};base64,{src['data']}"}}
    if kind == "url" and isinstance(src, dict) and isinstance(src.get("url"), str):
        return {"type": "image_url", "image_url": {"url": src["url"]}}
    raise RequestError(f"{where}: image blocks take a source of type base64 (media_type, data) or url", "messages")


def _block_type(block: Any, where: str) -> str:
    if not isinstance(block, dict) or not isinstance(block.get("type"), str):
        raise RequestError(f"{where} must be a content block (an object with a 'type')", "messages")
    return str(block["type"])


def _unsupported_block(kind: str, where: str, whose: str) -> RequestError:
    if kind in ("image", "document"):  # (a user message's images are read: `_image`)
        return RequestError(f"{where}: {kind} blocks are not read in {whose} message", "messages")
    return RequestError(f"{where}: {kind[:60]!r} blocks are not supported in {whose} message", "messages")


def _tool_result(block: dict[str, Any], where: str) -> dict[str, Any]:
    """A tool_result block as the tool message of the call it answers (its id checked by parse_chat)."""
    tid = block.get("tool_use_id")
    if not isinstance(tid, str) or not tid:
        raise RequestError(f"{where}.tool_use_id must be a non-empty string", "messages")
    content = block.get("content")
    if isinstance(content, list):
        for k, part in enumerate(content):
            kind = _block_type(part, f"{where}.content[{k}]")
            if kind != "text":
                raise _unsupported_block(kind, f"{where}.content[{k}]", "a tool_result")
        content = _text_parts(content)
    elif content is not None and not isinstance(content, str):
        raise RequestError(f"{where}.content must be a string or a list of text blocks", "messages")
    is_error = block.get("is_error", False)
    if not isinstance(is_error, bool):
        raise RequestError(f"{where}.is_error must be a boolean", "messages")
    if is_error:
        # chat templates have no word for a failed call: said in the result's text, where the model reads it
        content = [{"type": "text", "text": "Error: "}, *(content if isinstance(content, list) else [content or ""])]
        content = [p if isinstance(p, dict) else {"type": "text", "text": p} for p in content]
    return {"role": "tool", "tool_call_id": tid, "content": content}


def _tools(value: Any) -> list[dict[str, Any]] | None:
    """Anthropic's tool definitions as OpenAI function definitions (their checks are parse_chat's)."""
    if value is None:
        return None
    if not isinstance(value, list):
        raise RequestError("'tools' must be a list of tool definitions", "tools")
    out = []
    for j, tool in enumerate(value):
        if not isinstance(tool, dict):
            raise RequestError(f"tools[{j}] must be an object", "tools")
        kind = tool.get("type")
        if kind not in (None, "custom"):
            raise RequestError(
                f"tools[{j}]: {str(kind)[:60]!r} is one of Anthropic's own tools, which this server does not run; "
                "define it as a custom tool (name, description, input_schema)",
                "tools",
            )
        if "input_schema" not in tool:
            raise RequestError(f"tools[{j}].input_schema is required (a JSON schema of the tool's input)", "tools")
        # in the order OpenAI's clients send a function's keys: templates show the definition as it is, so the
        # prompt (and its count) is the chat endpoint's for the same tools
        fn = {"name": tool.get("name")}
        if "description" in tool:
            fn["description"] = tool["description"]
        fn["parameters"] = tool["input_schema"]
        if "strict" in tool:
            fn["strict"] = tool["strict"]
        out.append({"type": "function", "function": fn})
    return out


def _tool_choice(value: Any, tools: bool) -> tuple[Any, bool | None]:
    """Anthropic's tool_choice as OpenAI's, and parallel_tool_calls (from disable_parallel_tool_use)."""
    if value is None:
        return None, None
    shape = "'tool_choice' must be {'type': 'auto' | 'any' | 'none'} or {'type': 'tool', 'name': NAME}"
    if not isinstance(value, dict):
        raise RequestError(shape, "tool_choice")
    kind = value.get("type")
    choice: Any
    if kind == "auto":
        choice = "auto"
    elif kind == "none":
        choice = "none"
    elif kind == "any":
        choice = "required"
    elif kind == "tool":
        name = value.get("name")
        if not isinstance(name, str) or not name:
            raise RequestError("tool_choice.name must be a non-empty string", "tool_choice")
        choice = {"type": "function", "function": {"name": name}}
    else:
        raise RequestError(shape, "tool_choice")
    if kind in ("any", "tool") and not tools:
        raise RequestError(f"tool_choice {{'type': {kind!r}}} needs tools to choose from", "tool_choice")
    no_parallel = value.get("disable_parallel_tool_use", False)
    if not isinstance(no_parallel, bool):
        raise RequestError("tool_choice.disable_parallel_tool_use must be a boolean", "tool_choice")
    return choice, not no_parallel


def _thinking(value: Any) -> tuple[dict[str, Any], bool]:
    """`thinking` as the template's variables: enabled turns the family's reasoning on, disabled off; adaptive
    and between_tools leave the template's own default. `budget_tokens` is checked, not enforced: thinking counts
    toward max_tokens, as Anthropic's does. And whether its display is omitted."""
    if value is None:
        return {}, False
    if not isinstance(value, dict):
        raise RequestError("'thinking' must be an object: {'type': 'enabled', 'budget_tokens': N}", "thinking")
    kind = value.get("type")
    display = value.get("display")
    if display not in (None, "summarized", "omitted"):
        raise RequestError("thinking.display must be 'summarized' or 'omitted'", "thinking")
    if kind == "enabled":
        budget = value.get("budget_tokens")
        if isinstance(budget, bool) or not isinstance(budget, int) or budget < 1:
            raise RequestError("thinking.budget_tokens must be a positive integer", "thinking")
        return dict(_THINKING_ON), display == "omitted"
    if kind == "disabled":
        return dict(_THINKING_OFF), False
    if kind in ("adaptive", "between_tools"):
        return {}, display == "omitted"
    raise RequestError("thinking.type must be 'enabled', 'disabled', 'adaptive' or 'between_tools'", "thinking")


# parse_chat's words for what Anthropic calls otherwise (its messages are renumbered by `origin`)
_WORDS = [
    (re.compile(r"(tools\[\d+\])\.function\.parameters"), r"\1.input_schema"),
    (re.compile(r"(tools\[\d+\])\.function\."), r"\1."),
    (re.compile(r"\btool_call_id\b"), "tool_use_id"),
    (re.compile(r"\.tool_calls\[\d+\]\.function\.arguments"), ".content (a tool_use block's input)"),
    (re.compile(r"\.tool_calls\[\d+\](\.function)?"), ".content (a tool_use block)"),
    (re.compile(r"tool_choice names the function"), "tool_choice names the tool"),
    (re.compile(r"'stop'"), "'stop_sequences'"),
    (re.compile(r"\bresponse_format\b"), "output_config.format"),
    (re.compile(r"chat_template_kwargs cannot set .*"), "chat_template_kwargs cannot set the request's own fields"),
]


def _anthropic_words(message: str, origin: list[int]) -> str:
    def renumber(m: re.Match[str]) -> str:
        k = int(m.group(1))
        if k >= len(origin):
            return m.group(0)
        return "system" if origin[k] < 0 else f"messages[{origin[k]}]"

    message = re.sub(r"messages\[(\d+)\]", renumber, message)
    for pattern, words in _WORDS:
        message = pattern.sub(words, message)
    return message


# ---------------------------------------------------------------------------------------------------- replies
def _stop(ev: dict[str, Any], req: GenerationRequest) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence) of the worker's final event: a stop string of the request's is a
    stop_sequence; the template's own (its end-of-turn text) is the end of the turn."""
    stats = ev.get("stats", {})
    if ev["finish_reason"] == "length" and stats.get("finish_detail") == "context_full":
        return "model_context_window_exceeded", None
    matched = stats.get("stop_string")
    if ev["finish_reason"] == "stop" and stats.get("finish_detail") == "stop" and matched in req.stop:
        return "stop_sequence", matched
    return _STOP_REASONS.get(ev["finish_reason"], "end_turn"), None


def _signature(thinking: str) -> str:
    """A thinking block's `signature`, which Anthropic's clients keep and send back: here a digest of the text
    (not a secret, and not checked when it comes back: the engine reads thinking from the conversation as sent)."""
    return "tokenwing-" + hashlib.sha256(thinking.encode("utf-8", "replace")).hexdigest()[:32]


def _input(arguments: str) -> dict[str, Any]:
    """A call's arguments (JSON text) as tool_use's `input` object; a call cut by max_tokens keeps the members
    written whole (the arguments are then a prefix of the object)."""
    try:
        value = json.loads(arguments)
    except ValueError:
        return cut_arguments(arguments) or {}
    return value if isinstance(value, dict) else {}


def _usage(ev: dict[str, Any]) -> dict[str, int]:
    u = jobs.usage(ev)
    return {"input_tokens": u["prompt_tokens"], "output_tokens": u["completion_tokens"]}


def _sse(event: str, data: dict[str, Any]) -> bytes:
    return f"event: {event}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n".encode()


class _Blocks:
    """A streamed reply's content blocks as Anthropic streams them: one open at a time, each with its
    content_block_start, deltas and content_block_stop (a thinking block's signature_delta just before its stop)."""

    def __init__(self, omit_thinking: bool) -> None:
        self.omit = omit_thinking
        self.index = -1
        self.open: str | None = None  # the open block's type
        self.thinking: list[str] = []  # the open thinking block's text, for its signature
        self.calls: dict[int, int] = {}  # a call's index -> its block's
        self.sent: dict[int, str] = {}  # a call's index -> the arguments sent

    def _delta(self, index: int, delta: dict[str, Any]) -> bytes:
        return _sse("content_block_delta", {"type": "content_block_delta", "index": index, "delta": delta})

    def start(self, block: dict[str, Any]) -> list[bytes]:
        out = self.stop()
        self.index += 1
        self.open = block["type"]
        out.append(
            _sse("content_block_start", {"type": "content_block_start", "index": self.index, "content_block": block})
        )
        return out

    def stop(self) -> list[bytes]:
        if self.open is None:
            return []
        out = []
        if self.open == "thinking":
            out.append(
                self._delta(self.index, {"type": "signature_delta", "signature": _signature("".join(self.thinking))})
            )
            self.thinking = []
        out.append(_sse("content_block_stop", {"type": "content_block_stop", "index": self.index}))
        self.open = None
        return out

    def text(self, text: str) -> list[bytes]:
        out = [] if self.open == "text" else self.start({"type": "text", "text": ""})
        return [*out, self._delta(self.index, {"type": "text_delta", "text": text})]

    def reasoning(self, text: str) -> list[bytes]:
        out = [] if self.open == "thinking" else self.start({"type": "thinking", "thinking": "", "signature": ""})
        self.thinking.append(text)
        if self.omit:
            return out
        return [*out, self._delta(self.index, {"type": "thinking_delta", "thinking": text})]

    def call_head(self, ev: dict[str, Any]) -> list[bytes]:
        i = ev["index"]
        if i in self.calls:
            return []
        out = self.start({"type": "tool_use", "id": ev["id"], "name": ev["name"], "input": {}})
        self.calls[i], self.sent[i] = self.index, ""
        return out

    def call_args(self, i: int, text: str) -> list[bytes]:
        if not text:
            return []
        self.sent[i] += text
        return [self._delta(self.calls[i], {"type": "input_json_delta", "partial_json": text})]


def routes(
    worker: EngineWorker,
    model_id: str,
    guarded: Callable[..., Callable[[Request], Awaitable[Response]]],
    read_json: Callable[[Request], Awaitable[Any]],
) -> list[Route]:
    """The two routes, for create_app's list: `guarded` with this API's error format."""

    def message(mid: str, content: list[dict[str, Any]], usage: dict[str, int]) -> dict[str, Any]:
        return {
            "id": mid,
            "type": "message",
            "role": "assistant",
            "model": model_id,
            "content": content,
            "stop_reason": None,
            "stop_sequence": None,
            "usage": usage,
        }

    async def create(request: Request) -> Response:
        parsed = parse(await read_json(request))
        req = parsed.req
        job = await jobs.submit(worker, req)
        accepted = await jobs.accepted(request, job)
        if accepted is None:
            return Response(status_code=499)
        mid = "msg_" + uuid.uuid4().hex[:24]
        # the schema keywords the grammar dropped (a tool's input_schema, output_config.format), known once the
        # engine took the request: X-TokenWing-Unenforced
        headers = jobs.unenforced_headers(req)
        if req.stream:
            headers.update({"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
            events = stream(request, job, parsed, mid, int(accepted.get("prompt_tokens", 0)))
            return StreamingResponse(events, media_type="text/event-stream", headers=headers)
        content: list[dict[str, Any]] = []
        try:
            while True:
                ev = await jobs.next_event(request, job)
                if ev is None:
                    return Response(status_code=499)
                kind = ev["type"]
                if kind in ("text", "reasoning"):
                    block = "text" if kind == "text" else "thinking"
                    if not content or content[-1]["type"] != block:
                        content.append({"type": block, block: ""})
                    content[-1][block] += ev["text"]
                elif kind == "tool_call":
                    content.append(
                        {"type": "tool_use", "id": ev["id"], "name": ev["name"], "input": _input(ev["arguments"])}
                    )
                elif kind == "error":
                    raise jobs.event_error(ev)
                elif "finish_reason" in ev:
                    break
                # (tool_call_head and tool_call_args are a call's pieces, for streaming; logprob is not Anthropic's)
        finally:
            job.cancelled.set()
        for done in content:
            if done["type"] == "thinking":
                done["signature"] = _signature(done["thinking"])
                if parsed.omit_thinking:
                    done["thinking"] = ""
        body = message(mid, content, _usage(ev))
        body["stop_reason"], body["stop_sequence"] = _stop(ev, req)
        extra: dict[str, Any] = dict(ev.get("stats", {}))
        if ev.get("context_overflow"):  # what was dropped to fit the context (server/overflow.py)
            extra["context_overflow"] = ev["context_overflow"]
        extra["unenforced"] = req.unenforced  # (as the chat endpoint's tokenwing object says it)
        body["tokenwing"] = extra
        return JSONResponse(body, headers=headers)

    async def stream(
        request: Request, job: Job, parsed: MessagesRequest, mid: str, prompt_tokens: int
    ) -> AsyncIterator[bytes]:
        blocks = _Blocks(parsed.omit_thinking)
        try:
            start = message(mid, [], {"input_tokens": prompt_tokens, "output_tokens": 0})
            yield _sse("message_start", {"type": "message_start", "message": start})
            yield _sse("ping", {"type": "ping"})
            while True:
                ev = await jobs.next_event(request, job)
                if ev is None:
                    return
                kind = ev["type"]
                out: list[bytes] = []
                if kind == "text" and ev["text"] and not ev.get("streamed"):  # (streamed: its call's pieces went)
                    out = blocks.text(ev["text"])
                elif kind == "reasoning" and ev["text"]:
                    out = blocks.reasoning(ev["text"])
                elif kind == "tool_call_head":
                    out = blocks.call_head(ev)
                elif kind == "tool_call_args":
                    out = blocks.call_args(ev["index"], ev["text"])
                elif kind == "tool_call":
                    # whole: its head where no piece of it went out yet, then what its pieces did not send
                    out = blocks.call_head(ev)
                    out += blocks.call_args(ev["index"], ev["arguments"][len(blocks.sent[ev["index"]]) :])
                elif kind == "error":
                    yield _sse("error", _error_body(jobs.event_error(ev)))
                    return
                elif "finish_reason" in ev:
                    for chunk in blocks.stop():
                        yield chunk
                    stop_reason, stop_sequence = _stop(ev, parsed.req)
                    delta: dict[str, Any] = {
                        "type": "message_delta",
                        "delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence},
                    }
                    delta["usage"] = _usage(ev)
                    stats = ev.get("stats", {})
                    delta["tokenwing"] = {
                        "finish_detail": stats.get("finish_detail"),
                        "n_ctx": stats.get("n_ctx"),
                        "unenforced": parsed.req.unenforced,
                    }
                    if ev.get("context_overflow"):
                        delta["tokenwing"]["context_overflow"] = ev["context_overflow"]
                    yield _sse("message_delta", delta)
                    yield _sse("message_stop", {"type": "message_stop"})
                    return
                for chunk in out:
                    yield chunk
        finally:
            job.cancelled.set()

    async def count_tokens(request: Request) -> Response:
        # the prompt's tokens as /v1/messages would run it (its template, its tools), beside the engine's thread
        req = parse(await read_json(request), count=True).req
        tools = req.tools if req.tool_choice != "none" else None  # (none: the model is not shown them)
        try:
            n = await asyncio.to_thread(
                jobs.prompt_tokens, worker, req.messages, tools, req.variables, True, req.images
            )
        except BadInputError as e:
            raise RequestError(str(e), "tools" if str(e).startswith("tools:") else "messages") from None
        return JSONResponse({"input_tokens": n})

    return [
        Route(PATH, guarded(create, render=error), methods=["POST"]),
        Route(PATH + "/count_tokens", guarded(count_tokens, render=error), methods=["POST"]),
    ]
