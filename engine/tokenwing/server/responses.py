"""`POST /v1/responses`, `GET` and `DELETE /v1/responses/{id}`: OpenAI's Responses API (docs/api.md), the default
of the OpenAI Agents SDK and of coding agents.

A Responses body is turned into the chat body it means (its input items as chat messages, its tools, tool_choice
and text.format in their chat spelling) and read by `parse_chat`: one validation, one `GenerationRequest`, the same
worker, slots, templates, call formats and grammars as /v1/chat/completions. The worker's events come back as
output items (`reasoning`, `message`, `function_call`), whole or as the documented stream of events. Responses are
kept (bounded, in memory) so that `previous_response_id` continues a conversation."""

from __future__ import annotations

import json
import re
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from tokenwing.server import jobs
from tokenwing.server.protocol import GenerationRequest, RequestError, parse_chat
from tokenwing.server.worker import EngineWorker, Job
from tokenwing.text.tools.base import cut_arguments

# The responses kept for previous_response_id and GET: the newest KEPT_RESPONSES, at most KEPT_BYTES of JSON in
# all (a conversation's every turn is kept whole, so long agent runs are what the byte bound is for).
KEPT_RESPONSES = 256
KEPT_BYTES = 64 << 20

# reasoning.effort → the template variables families read it from: Qwen3's and GLM's enable_thinking, DeepSeek
# V3.1's thinking, gpt-oss's reasoning_effort (low/medium/high: it always reasons, so "none" is its "low")
EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh", "max")
_GPT_OSS_EFFORT = {"none": "low", "minimal": "low", "low": "low", "medium": "medium"}

# body fields passed to parse_chat as they are (sampling and TokenWing's own, read the same in both APIs)
_SAME = ("temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty", "repeat_penalty", "seed",
         "stop", "stream", "wait", "ignore_eos", "context_overflow", "parallel_tool_calls")  # fmt: skip
# fields that would change the answer and that this server does not do: refused, never ignored
_UNSUPPORTED = {
    "background": "background responses are not supported by this server",
    "conversation": "'conversation' (OpenAI's stored conversations) is not supported: use previous_response_id",
    "prompt": "'prompt' (OpenAI's stored prompt templates) is not supported",
    "context_management": "'context_management' is not supported: use truncation",
}
_TRUNCATION = {"auto": "rolling", "disabled": "stop"}  # OpenAI's truncation as the chat endpoint's overflow policy
LOGPROBS_INCLUDE = "message.output_text.logprobs"


class ResponseStore:
    """The kept responses, newest last: each its response object (GET) and its conversation in chat messages
    (previous_response_id: the input and output of every turn so far, without the instructions, which OpenAI
    does not carry over either)."""

    def __init__(self, count: int = KEPT_RESPONSES, size: int = KEPT_BYTES) -> None:
        self.count, self.size = count, size
        self.entries: OrderedDict[str, tuple[dict[str, Any], list[dict[str, Any]], int]] = OrderedDict()
        self.bytes = 0

    def put(self, response: dict[str, Any], conversation: list[dict[str, Any]]) -> None:
        n = len(json.dumps(response)) + len(json.dumps(conversation))
        if n > self.size:
            return  # (one larger than the whole store is not kept: a later previous_response_id to it is a 404)
        self.entries[response["id"]] = (response, conversation, n)
        self.bytes += n
        while len(self.entries) > self.count or self.bytes > self.size:
            self.bytes -= self.entries.popitem(last=False)[1][2]

    def get(self, rid: str) -> tuple[dict[str, Any], list[dict[str, Any]]] | None:
        entry = self.entries.get(rid)
        return (entry[0], entry[1]) if entry else None

    def delete(self, rid: str) -> bool:
        entry = self.entries.pop(rid, None)
        if entry is not None:
            self.bytes -= entry[2]
        return entry is not None


@dataclass
class ResponsesRequest:
    req: GenerationRequest
    conversation: list[dict[str, Any]]  # the chat messages of the turns so far (no instructions), to keep
    echo: dict[str, Any]  # the request's fields as the response object repeats them
    store: bool = True


def _not_found(what: str, param: str | None = None, code: str | None = None) -> RequestError:
    return RequestError(f"{what} not found", param, status=404, code=code)


def _string(body: dict[str, Any], key: str) -> str | None:
    v = body.get(key)
    if v is not None and not isinstance(v, str):
        raise RequestError(f"'{key}' must be a string", key)
    return v


def _part_text(part: Any, where: str, kinds: tuple[str, ...]) -> str:
    if isinstance(part, dict) and part.get("type") in kinds and isinstance(part.get("text"), str):
        return str(part["text"])
    if isinstance(part, dict) and part.get("type") == "refusal" and isinstance(part.get("refusal"), str):
        return str(part["refusal"])
    got = part.get("type") if isinstance(part, dict) else type(part).__name__
    raise RequestError(f"{where}: only text parts are supported ({', '.join(kinds)}), not {got!r}", "input")


def _text_of(content: Any, where: str, kinds: tuple[str, ...]) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(_part_text(p, f"{where}[{j}]", kinds) for j, p in enumerate(content))
    raise RequestError(f"{where} must be a string or a list of text parts", "input")


def _is_image(part: Any) -> bool:
    return isinstance(part, dict) and part.get("type") == "input_image"


def _with_images(content: list[Any], where: str) -> list[dict[str, Any]]:
    """A user message's parts with images as the chat endpoint's: text parts, and each `input_image` (its
    image_url, a data: URL or an http(s) URL; a file_id is not read) as an image_url part (server/image_parts.py)."""
    parts: list[dict[str, Any]] = []
    for j, part in enumerate(content):
        if not _is_image(part):
            parts.append({"type": "text", "text": _part_text(part, f"{where}[{j}]", ("input_text", "text"))})
        elif not isinstance(part.get("image_url"), str):
            raise RequestError(f"{where}[{j}].image_url must be a string (a data: URL; file_id is not read)", "input")
        else:
            parts.append({"type": "image_url", "image_url": {"url": part["image_url"]}})
    return parts


# what a chat message came from, for errors: its Responses item (or field), and its tool calls' items
Label = tuple[str, list[str]]


def input_messages(items: Any, labels: list[Label]) -> list[dict[str, Any]]:
    """`input` as chat messages: a string is one user turn; items are messages, function calls (joined to the
    assistant turn before them), their outputs (tool turns) and reasoning (the next assistant turn's). Each message
    appended to `labels` with the items it came from."""
    if isinstance(items, str):
        labels.append(("input", []))
        return [{"role": "user", "content": items}]
    if not isinstance(items, list):
        raise RequestError("'input' must be a string or a list of input items", "input")
    out: list[dict[str, Any]] = []
    thought: list[str] = []  # reasoning items not yet given to an assistant turn

    def assistant(where: str) -> dict[str, Any]:
        if not out or out[-1]["role"] != "assistant":
            out.append({"role": "assistant", "content": ""})
            labels.append((where, []))
        if thought:
            out[-1]["reasoning_content"] = out[-1].get("reasoning_content", "") + "".join(thought)
            thought.clear()
        return out[-1]

    for i, item in enumerate(items):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise RequestError(f"{where} must be an object", "input")
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise RequestError(f"{where}.role must be user, assistant, system or developer", "input")
            content = item.get("content")
            if role == "user" and isinstance(content, list) and any(_is_image(p) for p in content):
                out.append({"role": "user", "content": _with_images(content, f"{where}.content")})
                labels.append((where, []))
                continue
            text = _text_of(content, f"{where}.content", ("input_text", "output_text", "text"))
            if role == "assistant":
                out.append({"role": "assistant", "content": text})
                labels.append((where, []))
                if thought:
                    out[-1]["reasoning_content"] = "".join(thought)
                    thought.clear()
            else:
                out.append({"role": role, "content": text})
                labels.append((where, []))
        elif kind == "function_call":
            call_id, name, args = item.get("call_id"), item.get("name"), item.get("arguments", "")
            if not isinstance(call_id, str) or not call_id:
                raise RequestError(f"{where}.call_id must be a non-empty string", "input")
            if not isinstance(args, str):
                raise RequestError(f"{where}.arguments must be a string (the arguments' JSON text)", "input")
            turn = assistant(where)
            call = {"id": call_id, "type": "function", "function": {"name": name, "arguments": args}}
            turn.setdefault("tool_calls", []).append(call)
            labels[-1][1].append(where)
        elif kind == "function_call_output":
            call_id = item.get("call_id")
            if not isinstance(call_id, str) or not call_id:
                raise RequestError(f"{where}.call_id must be a non-empty string", "input")
            text = _text_of(item.get("output"), f"{where}.output", ("input_text", "output_text"))
            out.append({"role": "tool", "tool_call_id": call_id, "content": text})
            labels.append((where, []))
        elif kind == "reasoning":
            parts = item.get("content") or item.get("summary") or []
            if not isinstance(parts, list):
                raise RequestError(f"{where}.content must be a list of reasoning_text parts", "input")
            thought.append(_text_of(parts, f"{where}.content", ("reasoning_text", "summary_text")))
        else:
            raise RequestError(f"{where}.type {str(kind)[:40]!r} is not supported (message, function_call,"
                               " function_call_output and reasoning are)", "input")  # fmt: skip
    return out


def _tools(value: Any) -> tuple[list[dict[str, Any]] | None, list[dict[str, Any]]]:
    """Responses' function tools in the chat spelling (checked there), and as the response repeats them."""
    if value is None or value == []:
        return None, []
    if not isinstance(value, list):
        raise RequestError("'tools' must be a list of function tools", "tools")
    chat, echo = [], []
    for j, tool in enumerate(value):
        if not isinstance(tool, dict) or tool.get("type") != "function":
            kind = tool.get("type") if isinstance(tool, dict) else None
            raise RequestError(f"tools[{j}]: only function tools are supported, not {str(kind)[:40]!r}", "tools")
        fn = {k: tool[k] for k in ("name", "description", "parameters", "strict") if tool.get(k) is not None}
        chat.append({"type": "function", "function": fn})
        echo.append({"type": "function", "description": None, "parameters": None, "strict": None, **fn})
    return chat, echo


def _tool_choice(value: Any) -> Any:
    if value is None or value in ("none", "auto", "required"):
        return value
    if isinstance(value, dict) and value.get("type") == "function":
        return {"type": "function", "function": {"name": value.get("name")}}
    raise RequestError("'tool_choice' must be 'none', 'auto', 'required' or {'type': 'function', 'name': ...}",
                       "tool_choice")  # fmt: skip


def _text_format(value: Any) -> dict[str, Any] | None:
    """`text.format` as the chat endpoint's response_format."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise RequestError("'text' must be an object", "text")
    fmt = value.get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict):
        raise RequestError("'text.format' must be an object", "text.format")
    if fmt.get("type") == "json_schema":
        if not isinstance(fmt.get("schema"), dict):
            raise RequestError("'text.format.schema' must be a JSON schema object", "text.format")
        spec = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
        return {"type": "json_schema", "json_schema": spec}
    if fmt.get("type") in ("text", "json_object"):
        return {"type": fmt["type"]}
    raise RequestError("'text.format.type' must be 'text', 'json_object' or 'json_schema'", "text.format")


def _reasoning(value: Any, variables: dict[str, Any]) -> dict[str, Any]:
    """`reasoning.effort` as the template variables that turn a family's reasoning on or off (those the client
    set in chat_template_kwargs win)."""
    if value is None:
        return variables
    if not isinstance(value, dict):
        raise RequestError("'reasoning' must be an object", "reasoning")
    effort = value.get("effort")
    if effort is None:
        return variables
    if effort not in EFFORTS:
        raise RequestError(f"'reasoning.effort' must be one of {', '.join(EFFORTS)}", "reasoning")
    on = effort not in ("none", "minimal")
    wanted = {"enable_thinking": on, "thinking": on, "reasoning_effort": _GPT_OSS_EFFORT.get(effort, "high")}
    return {**wanted, **variables}


def parse_responses(body: Any, store: ResponseStore) -> ResponsesRequest:
    """`POST /v1/responses`: the chat body it means, read by parse_chat; errors name the Responses fields."""
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
    for key, message in _UNSUPPORTED.items():
        if body.get(key) not in (None, False, {}, []):
            raise RequestError(message, key)
    instructions = _string(body, "instructions")
    previous = _string(body, "previous_response_id")
    stored = body.get("store", True)
    if not isinstance(stored, bool):
        raise RequestError("'store' must be a boolean", "store")
    include = body.get("include") or []
    if not isinstance(include, list) or not all(isinstance(x, str) for x in include):
        raise RequestError("'include' must be a list of strings", "include")
    truncation = body.get("truncation")
    if truncation is not None and (not isinstance(truncation, str) or truncation not in _TRUNCATION):
        raise RequestError("'truncation' must be 'auto' or 'disabled'", "truncation")
    metadata = body.get("metadata")
    if metadata is not None and not isinstance(metadata, dict):
        raise RequestError("'metadata' must be an object", "metadata")
    labels: list[Label] = []
    before: list[dict[str, Any]] = []
    if previous is not None:
        kept = store.get(previous)
        if kept is None:
            raise _not_found(f"previous response with id {previous[:100]!r}", "previous_response_id",
                             "previous_response_not_found")  # fmt: skip
        before = kept[1]
        labels += [(f"previous_response_id's turn {k}", []) for k in range(len(before))]
    turn = input_messages(body.get("input"), labels)
    conversation = [*before, *turn]
    messages = [{"role": "system", "content": instructions}, *conversation] if instructions else conversation
    if instructions:
        labels.insert(0, ("instructions", []))
    tools, tools_echo = _tools(body.get("tools"))
    variables = body.get("chat_template_kwargs")
    if variables is not None and not isinstance(variables, dict):
        raise RequestError("'chat_template_kwargs' must be an object", "chat_template_kwargs")
    chat: dict[str, Any] = {k: body[k] for k in _SAME if k in body}
    chat |= {
        "messages": messages,
        "tools": tools,
        "tool_choice": _tool_choice(body.get("tool_choice")),
        "response_format": _text_format(body.get("text")),
        "max_tokens": body.get("max_output_tokens"),
        "chat_template_kwargs": _reasoning(body.get("reasoning"), variables or {}),
    }
    if truncation is not None and "context_overflow" not in body:
        chat["context_overflow"] = _TRUNCATION[truncation]
    top = body.get("top_logprobs")
    if LOGPROBS_INCLUDE in include or top:
        chat |= {"logprobs": True, "top_logprobs": top}
    try:
        req = parse_chat(chat)
    except RequestError as e:
        raise _renamed(e, labels) from None
    echo = {
        "instructions": instructions,
        "metadata": metadata or {},
        "tools": tools_echo,
        "tool_choice": body.get("tool_choice") or "auto",
        "parallel_tool_calls": req.parallel_tool_calls,
        "temperature": req.sampler.temperature,
        "top_p": req.sampler.top_p,
        "max_output_tokens": req.max_tokens if req.max_tokens_given else None,
        "previous_response_id": previous,
        "reasoning": body.get("reasoning") or {"effort": None, "summary": None},
        "text": body.get("text") or {"format": {"type": "text"}},
        "truncation": truncation or "disabled",
        "store": stored,
        "user": body.get("user"),
        "top_logprobs": top,
    }
    return ResponsesRequest(req, conversation, echo, stored)


# parse_chat's words for what the Responses API spells otherwise
_PARAMS = {"messages": "input", "max_tokens": "max_output_tokens", "response_format": "text.format"}
_WORDS = [
    (re.compile(r"'max_tokens'"), "'max_output_tokens'"),
    (re.compile(r"response_format(\.json_schema)?"), "text.format"),
    (re.compile(r"(tools\[\d+\])\.function\."), r"\1."),
    (re.compile(r"tool_call_id"), "call_id"),
]
_MESSAGE = re.compile(r"messages\[(\d+)\](\.tool_calls\[(\d+)\](\.function)?)?")


def _renamed(e: RequestError, labels: list[Label]) -> RequestError:
    """A parse_chat refusal in the Responses API's words: its fields renamed, `messages[i]` the item it came
    from, `messages[i].tool_calls[j].function` the function_call item (whose fields are the function's)."""

    def label(m: re.Match[str]) -> str:
        i = int(m.group(1))
        if i >= len(labels):
            return m.group(0)
        where, calls = labels[i]
        if m.group(3) is not None and int(m.group(3)) < len(calls):
            return calls[int(m.group(3))]
        return where + (m.group(2) or "")

    message = _MESSAGE.sub(label, e.message)
    for pattern, words in _WORDS:
        message = pattern.sub(words, message)
    param = _PARAMS.get(e.param or "", e.param)
    return RequestError(message, param, status=e.status, kind=e.kind, code=e.code)


# ------------------------------------------------------------------------------------------------ the output
def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class Output:
    """The worker's events as output items and as the stream's events (each with its sequence number); the
    whole response is the same items whether streamed or not."""

    def __init__(self, want_logprobs: bool) -> None:
        self.items: list[dict[str, Any]] = []
        self.open: dict[str, Any] | None = None  # the item the next events of its kind go on
        self.calls: dict[int, dict[str, Any]] = {}  # the engine's call index → its item
        self.seq = 0
        self.want_logprobs = want_logprobs
        self.pending: list[dict[str, Any]] = []  # log-probabilities of tokens whose text has not come yet
        self.reasoning: list[str] = []

    def event(self, kind: str, **fields: Any) -> dict[str, Any]:
        ev = {"type": kind, **fields, "sequence_number": self.seq}
        self.seq += 1
        return ev

    def _add(self, item: dict[str, Any]) -> list[dict[str, Any]]:
        out = self._close("completed")
        self.items.append(item)
        self.open = item
        added = dict(item, content=[]) if "content" in item else dict(item)
        return [*out, self.event("response.output_item.added", output_index=len(self.items) - 1, item=added)]

    def _part(self, item: dict[str, Any]) -> dict[str, Any]:
        return self.event("response.content_part.added", item_id=item["id"], output_index=self.items.index(item),
                          content_index=0, part=dict(item["content"][0], text=""))  # fmt: skip

    def feed(self, ev: dict[str, Any]) -> list[dict[str, Any]]:
        """The stream's events for one of the worker's (the final one and errors are the caller's)."""
        kind = ev["type"]
        if kind == "logprob":
            if self.want_logprobs:
                self.pending.append(ev["entry"])
            return []
        if kind == "text" and not ev.get("streamed"):
            out = []
            if self.open is None or self.open["type"] != "message":
                part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
                msg = {"id": _id("msg"), "type": "message", "role": "assistant", "status": "in_progress",
                       "content": [part]}  # fmt: skip
                out += [*self._add(msg), self._part(msg)]
            assert self.open is not None
            part = self.open["content"][0]
            part["text"] += ev["text"]
            lps, self.pending = self.pending, []
            part["logprobs"] += lps
            out.append(self.event("response.output_text.delta", item_id=self.open["id"], output_index=len(self.items)
                                  - 1, content_index=0, delta=ev["text"], logprobs=lps))  # fmt: skip
            return out
        self.pending = []  # (tokens of reasoning or of a call: no output_text's)
        if kind == "reasoning":
            out = []
            if self.open is None or self.open["type"] != "reasoning":
                item = {"id": _id("rs"), "type": "reasoning", "summary": [], "status": "in_progress",
                        "content": [{"type": "reasoning_text", "text": ""}]}  # fmt: skip
                out += [*self._add(item), self._part(item)]
            assert self.open is not None
            self.open["content"][0]["text"] += ev["text"]
            self.reasoning.append(ev["text"])
            out.append(self.event("response.reasoning_text.delta", item_id=self.open["id"],
                                  output_index=len(self.items) - 1, content_index=0, delta=ev["text"]))  # fmt: skip
            return out
        if kind in ("tool_call_head", "tool_call", "tool_call_args"):
            out = []
            call = self.calls.get(ev["index"])
            if call is None:  # its head: the call's item, arguments to come
                call = {"id": _id("fc"), "type": "function_call", "call_id": ev.get("id") or _id("call"),
                        "name": ev.get("name", ""), "arguments": "", "status": "in_progress"}  # fmt: skip
                self.calls[ev["index"]] = call
                out += self._add(call)
            more = ev["text"] if kind == "tool_call_args" else ev.get("arguments", "")[len(call["arguments"]) :]
            if more:
                call["arguments"] += more
                out.append(self.event("response.function_call_arguments.delta", item_id=call["id"],
                                      output_index=self.items.index(call), delta=more))  # fmt: skip
            return out
        return []

    def _close(self, status: str) -> list[dict[str, Any]]:
        item, self.open = self.open, None
        if item is None:
            return []
        item["status"] = status
        at = {"item_id": item["id"], "output_index": self.items.index(item)}
        out = []
        if item["type"] == "message":
            part = item["content"][0]
            out.append(self.event("response.output_text.done", **at, content_index=0, text=part["text"],
                                  logprobs=part["logprobs"]))  # fmt: skip
            out.append(self.event("response.content_part.done", **at, content_index=0, part=part))
        elif item["type"] == "reasoning":
            part = item["content"][0]
            out.append(self.event("response.reasoning_text.done", **at, content_index=0, text=part["text"]))
            out.append(self.event("response.content_part.done", **at, content_index=0, part=part))
        else:
            out.append(self.event("response.function_call_arguments.done", **at, arguments=item["arguments"]))
        return [*out, self.event("response.output_item.done", output_index=at["output_index"], item=item)]

    def finish(self, cut: bool) -> list[dict[str, Any]]:
        """Closes the last item (incomplete where max_output_tokens cut it); the earlier ones are complete."""
        return self._close("incomplete" if cut else "completed")

    def assistant(self) -> dict[str, Any]:
        """The output as the chat turn a follow-up (previous_response_id) sends back."""
        text = "".join(i["content"][0]["text"] for i in self.items if i["type"] == "message")
        turn: dict[str, Any] = {"role": "assistant", "content": text}
        if self.reasoning:
            turn["reasoning_content"] = "".join(self.reasoning)
        calls = [i for i in self.items if i["type"] == "function_call"]
        if calls:
            turn["tool_calls"] = [
                {"id": c["call_id"], "type": "function", "function": {"name": c["name"], "arguments": _args(c)}}
                for c in calls
            ]
        return turn


def _args(call: dict[str, Any]) -> str:
    """A call's arguments as a follow-up sends them: one cut by max_output_tokens (a JSON prefix) as the members
    it wrote whole (text/tools/base.cut_arguments, as the chat endpoint reads such a call sent back)."""
    text = call["arguments"] or "{}"
    try:
        whole = json.loads(text)
    except ValueError:
        return json.dumps(cut_arguments(text) or {})
    return text if isinstance(whole, dict) else "{}"


def routes(
    worker: EngineWorker,
    model_id: str,
    guarded: Callable[[Callable[[Request], Awaitable[Response]]], Callable[[Request], Awaitable[Response]]],
    read_json: Callable[[Request], Awaitable[Any]],
) -> list[Route]:
    """The Responses API's routes, with their store (one per server)."""
    store = ResponseStore()

    def body(rid: str, created: float, parsed: ResponsesRequest, status: str, output: list[dict[str, Any]],
             final: dict[str, Any] | None, reasoning_tokens: int = 0) -> dict[str, Any]:  # fmt: skip
        out: dict[str, Any] = {
            "id": rid,
            "object": "response",
            "created_at": created,
            "status": status,
            "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "model": model_id,
            "output": output,
            **parsed.echo,
            "usage": None,
        }
        # the schema keywords the grammar dropped (text/grammar.py), as the chat endpoint reports them
        tw: dict[str, Any] = {"unenforced": list(parsed.req.unenforced)}
        if final is not None:
            u = jobs.usage(final)
            stats = final.get("stats", {})
            out["completed_at"] = time.time()
            out["usage"] = {
                "input_tokens": u["prompt_tokens"],
                "input_tokens_details": {"cached_tokens": int(stats.get("prompt_cached_tokens") or 0)},
                "output_tokens": u["completion_tokens"],
                "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
                "total_tokens": u["total_tokens"],
            }
            tw |= {"finish_detail": stats.get("finish_detail"), "n_ctx": stats.get("n_ctx")}
            if final.get("context_overflow"):
                tw["context_overflow"] = final["context_overflow"]
        out["tokenwing"] = tw
        return out

    def count(text: str) -> int:
        """The reasoning's tokens (the worker counts a reply's tokens, not its parts): the text re-encoded."""
        assert worker.session is not None  # loaded before the state turns ok (guarded)
        return len(worker.session.tokenizer.encode(text, special=False, add_bos=False)) if text else 0

    def ended(rid: str, created: float, parsed: ResponsesRequest, out: Output, final: dict[str, Any]) -> dict[str, Any]:
        cut = final["finish_reason"] == "length"
        status = "incomplete" if cut else "completed"
        response = body(rid, created, parsed, status, out.items, final, count("".join(out.reasoning)))
        if parsed.store:
            store.put(response, [*parsed.conversation, out.assistant()])
        return response

    async def create(request: Request) -> Response:
        parsed = parse_responses(await read_json(request), store)
        job = await jobs.submit(worker, parsed.req)
        rid, created = _id("resp"), time.time()
        if await jobs.accepted(request, job) is None:  # (refusals come before any stream starts)
            return Response(status_code=499)
        out = Output(parsed.req.logprobs is not None)
        if parsed.req.stream:
            return StreamingResponse(
                _events(request, job, rid, created, parsed, out),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **jobs.unenforced_headers(parsed.req)},
            )
        try:
            while True:
                ev = await jobs.next_event(request, job)
                if ev is None:
                    return Response(status_code=499)
                if ev["type"] == "error":
                    raise jobs.event_error(ev)
                if "finish_reason" in ev:
                    break
                out.feed(ev)
        finally:
            job.cancelled.set()
        out.finish(ev["finish_reason"] == "length")
        return JSONResponse(ended(rid, created, parsed, out, ev), headers=jobs.unenforced_headers(parsed.req))

    async def _events(
        request: Request, job: Job, rid: str, created: float, parsed: ResponsesRequest, out: Output
    ) -> AsyncIterator[bytes]:
        def sse(ev: dict[str, Any]) -> bytes:
            return f"event: {ev['type']}\ndata: ".encode() + json.dumps(ev).encode() + b"\n\n"

        try:
            start = body(rid, created, parsed, "in_progress", [], None)
            yield sse(out.event("response.created", response=start))
            yield sse(out.event("response.in_progress", response=start))
            while True:
                ev = await jobs.next_event(request, job)
                if ev is None:
                    return
                if ev["type"] == "error":
                    e = jobs.event_error(ev)
                    yield sse(out.event("error", code=e.code or e.kind, message=e.message, param=e.param))
                    return
                if "finish_reason" in ev:
                    for done in out.finish(ev["finish_reason"] == "length"):
                        yield sse(done)
                    response = ended(rid, created, parsed, out, ev)
                    kind = "response.incomplete" if response["status"] == "incomplete" else "response.completed"
                    yield sse(out.event(kind, response=response))
                    return
                for one in out.feed(ev):
                    yield sse(one)
        finally:
            job.cancelled.set()

    async def kept(request: Request) -> Response:
        """GET: a kept response as it was returned; DELETE: forgotten (a later previous_response_id to it: 404)."""
        rid = request.path_params["rid"]
        if request.method == "DELETE":
            if not store.delete(rid):
                raise _not_found(f"response with id {rid[:100]!r}")
            return JSONResponse({"id": rid, "object": "response.deleted", "deleted": True})
        entry = store.get(rid)
        if entry is None:
            raise _not_found(f"response with id {rid[:100]!r}")
        return JSONResponse(entry[0])

    return [
        Route("/v1/responses", guarded(create), methods=["POST"]),
        Route("/v1/responses/{rid}", guarded(kept), methods=["GET", "DELETE"]),
    ]
