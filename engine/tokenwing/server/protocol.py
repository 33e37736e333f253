"""Request validation for the OpenAI-compatible API (requests are untrusted: every field is checked)."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

from tokenwing.errors import BadInputError
from tokenwing.runtime.sampler import SamplerSettings
from tokenwing.server.image_parts import MARKER as IMAGE_MARKER
from tokenwing.server.image_parts import ImageSource, image_part, marked
from tokenwing.text.grammar import grammar_of
from tokenwing.text.tools.base import cut_arguments

MAX_TOKENS_LIMIT = 1 << 20
MAX_BODY = 8 << 20
MAX_TOP_LOGPROBS = 20  # OpenAI's limit for chat (5 for completions; llama.cpp takes any: 20 for both here)


class RequestError(Exception):
    def __init__(
        self,
        message: str,
        param: str | None = None,
        status: int = 400,
        kind: str = "invalid_request_error",
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.message, self.param, self.status, self.kind, self.code = message, param, status, kind, code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


# OpenAI's error code for a prompt longer than the context (clients such as LangChain's match on it)
CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"
# What a chat request does when its messages and the reply's room do not fit the context (docs/api.md):
# rolling drops the oldest turns, trim-middle those after the first user turn, stop refuses.
OVERFLOW_POLICIES = ("rolling", "trim-middle", "stop")


@dataclass
class GenerationRequest:
    prompt: str | None = None  # completions
    messages: list[dict[str, Any]] = field(default_factory=list)  # chat, as its template reads them
    tools: list[dict[str, Any]] | None = None  # chat: OpenAI function definitions, as sent
    tool_choice: str = "none"  # none, auto, required, or function (then `tool_name`)
    tool_name: str | None = None
    parallel_tool_calls: bool = True
    variables: dict[str, Any] = field(default_factory=dict)  # chat_template_kwargs
    max_tokens: int = 256
    max_tokens_given: bool = False  # the client set max_tokens: the room a chat prompt must leave for the reply
    context_overflow: str | None = None  # a chat request's policy (OVERFLOW_POLICIES); None: the server's
    stream: bool = False
    stop: list[str] = field(default_factory=list)
    sampler: SamplerSettings = field(default_factory=SamplerSettings)
    include_usage: bool = False
    logprobs: int | None = None  # None: off; else how many alternatives per token (top_logprobs)
    grammar: str | None = None  # response_format's grammar (llguidance), enforced while sampling
    # schema keywords (JSON-pointer-ish paths) the grammar could not enforce and dropped (no `strict`): said in
    # the reply (`tokenwing.unenforced`, the X-TokenWing-Unenforced header); empty when all of it was enforced
    unenforced: list[str] = field(default_factory=list)
    wait: bool = True  # False: a 503 at once when every slot is busy, instead of waiting in the queue
    ignore_eos: bool = False  # llama.cpp's: the end-of-generation tokens are never sampled (max_tokens ends it)
    images: list[ImageSource] = field(default_factory=list)  # chat: image parts, in order (server/images.py)
    prompt_cache_key: str | None = None  # OpenAI's: tags the disk cache's snapshots (server/prompt_cache_keys.py)


def _number(body: dict[str, Any], key: str, default: float, lo: float, hi: float) -> float:
    v = body.get(key, default)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, int | float) or not lo <= v <= hi:
        raise RequestError(f"'{key}' must be a number between {lo} and {hi}", key)
    return float(v)


def _integer(body: dict[str, Any], key: str, default: int | None, lo: int, hi: int) -> int | None:
    v = body.get(key, default)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
        raise RequestError(f"'{key}' must be an integer between {lo} and {hi}", key)
    return v


def _text(value: str, where: str, param: str) -> str:
    """A string that can be tokenized: JSON allows lone UTF-16 surrogates (\\ud800), which are no text."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise RequestError(f"{where} contains a lone UTF-16 surrogate (not valid Unicode text)", param) from None
    return value


def _content(value: Any, where: str, images: list[ImageSource] | None = None) -> str:
    """A message's text; its image parts (server/image_parts.py) appended to `images` and marked where they stand
    (None: a message that may carry none)."""
    if isinstance(value, str):
        return _text(value, where, "messages")
    if isinstance(value, list):  # [{"type": "text", "text": ...}, {"type": "image_url", ...}, ...]
        parts = []
        for j, part in enumerate(value):
            kind = part.get("type") if isinstance(part, dict) else None
            try:
                if kind == "image_url" and images is not None:
                    images.append(image_part(part, f"{where}.content[{j}]"))
                    parts.append(IMAGE_MARKER.format(len(images) - 1))
                    continue
                if kind == "image_url":
                    raise RequestError(f"{where}: only user messages carry images", "messages")
                if kind != "text" or not isinstance(part.get("text"), str):
                    raise RequestError(f"{where}: content parts must be text or image_url", "messages")
                parts.append(_text(marked(part["text"], where), where, "messages"))
            except BadInputError as e:
                raise RequestError(str(e), "messages") from None
        return "".join(parts)
    if value is None:
        return ""
    raise RequestError(f"{where}: content must be a string or a list of text parts", "messages")


def _common(body: dict[str, Any], req: GenerationRequest, chat: bool = False) -> None:
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    req.max_tokens = _integer({"max_tokens": max_tokens}, "max_tokens", 256, 1, MAX_TOKENS_LIMIT) or 256
    req.max_tokens_given = max_tokens is not None
    policy = body.get("context_overflow")  # (TokenWing's: through extra_body; completions never cut a prompt)
    if policy is not None and policy not in OVERFLOW_POLICIES:
        raise RequestError(f"'context_overflow' must be one of {', '.join(OVERFLOW_POLICIES)}", "context_overflow")
    req.context_overflow = policy
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise RequestError("'stream' must be a boolean", "stream")
    req.stream = stream
    ignore_eos = body.get("ignore_eos", False)  # (llama.cpp's server's; through extra_body too)
    if not isinstance(ignore_eos, bool):
        raise RequestError("'ignore_eos' must be a boolean", "ignore_eos")
    req.ignore_eos = ignore_eos
    wait = body.get("wait", True)  # (TokenWing's: the official clients send it through extra_body)
    if not isinstance(wait, bool):
        raise RequestError("'wait' must be a boolean", "wait")
    req.wait = wait
    req.prompt_cache_key = prompt_cache_key(body)
    opts = body.get("stream_options")
    if opts is not None:
        if not isinstance(opts, dict):
            raise RequestError("'stream_options' must be an object", "stream_options")
        req.include_usage = bool(opts.get("include_usage", False))
    stop = body.get("stop")
    if isinstance(stop, str):
        req.stop = [stop]
    elif isinstance(stop, list) and all(isinstance(s, str) for s in stop) and len(stop) <= 16:
        req.stop = [s for s in stop if s]
    elif stop is not None:
        raise RequestError("'stop' must be a string or a list of at most 16 strings", "stop")
    req.stop = [_text(s, "'stop'", "stop") for s in req.stop]
    _refuse_unsupported(body, _CHAT_ONLY if chat else ())
    try:
        fmt = grammar_of(body.get("response_format"))
    except BadInputError as e:
        raise RequestError(f"response_format: {e}", "response_format") from None
    if fmt is not None:
        req.grammar, req.unenforced = fmt.text, fmt.unenforced
    n = body.get("n", 1)
    if n != 1:
        raise RequestError("only n = 1 is supported", "n")
    s = req.sampler
    s.temperature = _number(body, "temperature", 1.0, 0.0, 2.0)
    s.top_p = _number(body, "top_p", 1.0, 0.0, 1.0) or 1.0
    s.top_k = int(_integer(body, "top_k", 0, 0, 1 << 20) or 0)
    s.min_p = _number(body, "min_p", 0.0, 0.0, 1.0)
    s.presence_penalty = _number(body, "presence_penalty", 0.0, -2.0, 2.0)
    s.frequency_penalty = _number(body, "frequency_penalty", 0.0, -2.0, 2.0)
    s.repeat_penalty = _number(body, "repeat_penalty", 1.0, 0.01, 10.0)
    s.seed = _integer(body, "seed", None, -(1 << 63), (1 << 63) - 1)
    if s.seed is not None and s.seed < 0:
        s.seed = s.seed & ((1 << 63) - 1)


MAX_CACHE_KEY = 256  # characters of a prompt_cache_key (the server stores its hash, never the key)


def prompt_cache_key(body: dict[str, Any]) -> str | None:
    """`prompt_cache_key` (OpenAI's field; the app's conversation): None, or a string of 1 to MAX_CACHE_KEY
    characters."""
    key = body.get("prompt_cache_key")
    if key is not None and (not isinstance(key, str) or not 0 < len(key) <= MAX_CACHE_KEY):
        what = f"'prompt_cache_key' must be a string of 1 to {MAX_CACHE_KEY} characters"
        raise RequestError(what, "prompt_cache_key")
    return key


# Fields that would change the answer and that this server does not implement: refused with a 400 rather than
# silently ignored (a client asking for function calling or JSON output must not get plain text back).
_UNSUPPORTED: dict[str, str] = {
    "tools": "tools (function calling) are supported by /v1/chat/completions only",
    "functions": "'functions' (the legacy form of function calling) is not supported: use tools",
    "function_call": "'function_call' (the legacy form of function calling) is not supported: use tool_choice",
    "tool_choice": "tool_choice: tools (function calling) are supported by /v1/chat/completions only",
    "logit_bias": "logit_bias is not supported by this server",
    "echo": "echo is not supported by this server",
    "suffix": "suffix (insertion) is not supported by this server",
    "best_of": "best_of is not supported (only 1)",
    "audio": "audio output is not supported",
    "modalities": "only text output is supported",
}
_HARMLESS: dict[str, Any] = {  # values of those fields that ask for nothing beyond plain text
    "tool_choice": ("none", "auto"),  # (reached only without tools: nothing to choose from)
    "best_of": (1,),
    "echo": (False,),
    "modalities": (["text"],),
}


_CHAT_ONLY = ("tools", "tool_choice")  # read by the chat endpoint (parse_chat)


def _refuse_unsupported(body: dict[str, Any], allowed: tuple[str, ...]) -> None:
    for key, message in _UNSUPPORTED.items():
        if key in allowed:
            continue
        v = body.get(key)
        if v is None or v == [] or v == {} or v == "" or v in _HARMLESS.get(key, ()):
            continue
        raise RequestError(message, key)


def _chat_logprobs(body: dict[str, Any], req: GenerationRequest) -> None:
    """Chat: `logprobs` (boolean) and `top_logprobs` (0–20, only with logprobs), as OpenAI and llama.cpp."""
    on = body.get("logprobs")
    if on is not None and not isinstance(on, bool):
        raise RequestError("'logprobs' must be a boolean", "logprobs")
    top = _integer(body, "top_logprobs", None, 0, MAX_TOP_LOGPROBS)
    if top is not None and not on:
        raise RequestError("'top_logprobs' requires 'logprobs' to be true", "top_logprobs")
    req.logprobs = (top or 0) if on else None


def parse_chat(body: Any) -> GenerationRequest:
    """`POST /v1/chat/completions`: the messages as the chat template reads them (/apply-template's reading,
    with the checks OpenAI makes of a conversation with tool calls), the tools and how they may be used."""
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise RequestError("'messages' must be a non-empty list", "messages")
    images: list[ImageSource] = []
    req = GenerationRequest(messages=[_template_message(m, i, images) for i, m in enumerate(msgs)], images=images)
    _check_tool_turns(req.messages)
    req.tools = _tools(body.get("tools"))
    req.tool_choice, req.tool_name = _tool_choice(body.get("tool_choice"), req.tools)
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise RequestError("'parallel_tool_calls' must be a boolean", "parallel_tool_calls")
    req.parallel_tool_calls = parallel is not False
    req.variables = _template_variables(body)
    _common(body, req, chat=True)
    _chat_logprobs(body, req)
    return req


def _check_tool_turns(messages: list[dict[str, Any]]) -> None:
    """OpenAI's rules for a conversation with calls: each call has an id, each tool message answers one by it."""
    ids: set[str] = set()
    for i, m in enumerate(messages):
        for j, call in enumerate(m.get("tool_calls") or ()):
            if "id" not in call:
                raise RequestError(f"messages[{i}].tool_calls[{j}].id is required", "messages")
            ids.add(call["id"])
        if m["role"] == "tool":
            tid = m.get("tool_call_id")
            if tid is None:
                raise RequestError(
                    f"messages[{i}].tool_call_id is required: the id of the tool call this result answers", "messages"
                )
            if tid not in ids:
                raise RequestError(
                    f"messages[{i}].tool_call_id {tid!r} answers no tool call of an earlier assistant message",
                    "messages",
                )


def _tool_choice(value: Any, tools: list[dict[str, Any]] | None) -> tuple[str, str | None]:
    """OpenAI's tool_choice: none, auto (the default with tools), required, or one function by name."""
    if value is None:
        return ("auto" if tools else "none"), None
    if value in ("none", "auto", "required"):
        if value == "required" and not tools:
            raise RequestError("tool_choice 'required' needs tools to choose from", "tool_choice")
        return value, None
    fn = value.get("function") if isinstance(value, dict) else None
    if isinstance(value, dict) and value.get("type") == "function" and isinstance(fn, dict):
        name = fn.get("name")
        if not isinstance(name, str) or not name:
            raise RequestError("tool_choice.function.name must be a non-empty string", "tool_choice")
        names = [t["function"]["name"] for t in tools or ()]
        if name not in names:
            raise RequestError(f"tool_choice names the function {name!r}, which is not in tools", "tool_choice")
        return "function", name
    raise RequestError(
        "'tool_choice' must be 'none', 'auto', 'required' or {'type': 'function', 'function': {'name': ...}}",
        "tool_choice",
    )


def parse_completion(body: Any) -> GenerationRequest:
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if not isinstance(prompt, str):
        raise RequestError("'prompt' must be a string", "prompt")
    req = GenerationRequest(prompt=_text(prompt, "'prompt'", "prompt"))
    _common(body, req)
    req.max_tokens = _integer(body, "max_tokens", 16, 1, MAX_TOKENS_LIMIT) or 16
    req.logprobs = _integer(body, "logprobs", None, 0, MAX_TOP_LOGPROBS)  # completions: the count itself
    return req


# ------------------------------------------------------------------------------------------ /apply-template
ROLES = ("system", "user", "assistant", "tool", "developer")
REASONING_FIELDS = ("reasoning_content", "reasoning", "thinking")  # what clients send a turn's reasoning under
TEMPLATE_VARIABLES = ("messages", "tools", "documents", "add_generation_prompt")  # set by the server itself


@dataclass
class TemplateRequest:
    """A chat request as its chat template reads it: messages in the form Hugging Face's templates expect
    (a tool call's arguments as an object, not OpenAI's JSON text), the tools' definitions as sent, and the
    template's own variables (`chat_template_kwargs`: `enable_thinking`, `reasoning_effort`, …)."""

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None = None  # None also where tool_choice is none (the model is not shown them)
    add_generation_prompt: bool = True
    variables: dict[str, Any] = field(default_factory=dict)
    images: list[ImageSource] = field(default_factory=list)  # user messages' image parts (server/image_parts.py)


def _json_text(value: Any, where: str, param: str) -> Any:
    """A JSON value whose every string is valid Unicode text (see `_text`), keys included."""
    if isinstance(value, str):
        return _text(value, where, param)
    if isinstance(value, list):
        return [_json_text(v, where, param) for v in value]
    if isinstance(value, dict):
        return {_text(k, where, param): _json_text(v, where, param) for k, v in value.items()}
    return value


def _tool_call(call: Any, where: str) -> dict[str, Any]:
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict):
        raise RequestError(f"{where} must be an object with a 'function' object", "messages")
    if call.get("type", "function") != "function":
        raise RequestError(f"{where}.type must be 'function'", "messages")
    name = fn.get("name")
    if not isinstance(name, str) or not name:
        raise RequestError(f"{where}.function.name must be a non-empty string", "messages")
    args = fn.get("arguments", {})
    if isinstance(args, str):  # OpenAI sends the arguments as JSON text; templates read them as an object
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError:
            # a call that max_tokens cut, sent back as the engine returned it (its arguments' JSON so far)
            args = cut_arguments(args)
            if args is None:
                raise RequestError(f"{where}.function.arguments is not valid JSON", "messages") from None
    if not isinstance(args, dict):
        raise RequestError(f"{where}.function.arguments must be a JSON object", "messages")
    out: dict[str, Any] = {}
    if call.get("id") is not None:
        if not isinstance(call["id"], str):
            raise RequestError(f"{where}.id must be a string", "messages")
        out["id"] = _text(call["id"], where, "messages")
    out["type"] = "function"
    out["function"] = {"name": _text(name, where, "messages"), "arguments": _json_text(args, where, "messages")}
    return out


def _template_message(m: Any, i: int, images: list[ImageSource] | None = None) -> dict[str, Any]:
    """`images`: where a user message's image parts go (None: image parts are refused)."""
    where = f"messages[{i}]"
    if not isinstance(m, dict):
        raise RequestError(f"{where} must be an object", "messages")
    role = m.get("role")
    if role not in ROLES:
        raise RequestError(f"{where}.role must be system, user, assistant, tool or developer", "messages")
    if m.get("function_call") is not None:
        raise RequestError(f"{where}.function_call (the legacy form) is not supported: use tool_calls", "messages")
    # developer is OpenAI's newer name for system, as the chat endpoint reads it
    out: dict[str, Any] = {"role": "system" if role == "developer" else role}
    # A null content (OpenAI's for a turn of calls only) is empty text, as the chat endpoint reads it: left out,
    # as transformers leaves out nulls, Qwen3's template fails on such a turn; with "" all 17 of issue 28 render.
    out["content"] = _content(m.get("content"), where, images if role == "user" else None)
    for key in ("name", "tool_call_id", *REASONING_FIELDS):
        v = m.get(key)
        if v is None:
            continue
        if not isinstance(v, str):
            raise RequestError(f"{where}.{key} must be a string", "messages")
        out[key] = _text(v, f"{where}.{key}", "messages")
    calls = m.get("tool_calls")
    if calls:
        if role != "assistant":
            raise RequestError(f"{where}: only assistant messages carry tool_calls", "messages")
        if not isinstance(calls, list):
            raise RequestError(f"{where}.tool_calls must be a list", "messages")
        out["tool_calls"] = [_tool_call(c, f"{where}.tool_calls[{j}]") for j, c in enumerate(calls)]
    return out


# A function's name: OpenAI's characters (letters, digits, _ and -) and the dot MCP's tool names use; the
# names go inside the families' call markup, where quotes, brackets or spaces would break it.
_TOOL_NAME = re.compile(r"[A-Za-z0-9_.\-]{1,128}")
_JSON_TYPES = ("string", "number", "integer", "boolean", "object", "array", "null")
MAX_SCHEMA_DEPTH = 32


def _tools(value: Any) -> list[dict[str, Any]] | None:
    if value is None or value == []:
        return None
    if not isinstance(value, list):
        raise RequestError("'tools' must be a list of function definitions", "tools")
    names: set[str] = set()
    for j, tool in enumerate(value):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(fn, dict) or tool.get("type", "function") != "function":
            raise RequestError(f"tools[{j}] must be {{'type': 'function', 'function': {{...}}}}", "tools")
        name = fn.get("name")
        if not isinstance(name, str) or not name:
            raise RequestError(f"tools[{j}].function.name must be a non-empty string", "tools")
        if not _TOOL_NAME.fullmatch(name):
            raise RequestError(
                f"tools[{j}].function.name {name[:80]!r} must be 1-128 letters, digits, '_', '-' or '.'", "tools"
            )
        if name in names:
            raise RequestError(f"tools[{j}].function.name {name!r} is declared twice", "tools")
        names.add(name)
        if fn.get("description") is not None and not isinstance(fn["description"], str):
            raise RequestError(f"tools[{j}].function.description must be a string", "tools")
        if fn.get("strict") is not None and not isinstance(fn["strict"], bool):
            raise RequestError(f"tools[{j}].function.strict must be a boolean", "tools")
        if fn.get("parameters") is not None:
            if not isinstance(fn["parameters"], dict):
                raise RequestError(f"tools[{j}].function.parameters must be a JSON schema object", "tools")
            _check_schema(fn["parameters"], f"tools[{j}].function.parameters", 0)
            if fn["parameters"].get("type", "object") != "object":
                raise RequestError(f"tools[{j}].function.parameters.type must be 'object' (arguments are one)", "tools")
    # as sent: a template shows the definitions to the model as they are
    return [_json_text(tool, f"tools[{j}]", "tools") for j, tool in enumerate(value)]


def _check_schema(schema: Any, where: str, depth: int) -> None:
    """The JSON Schema keywords that say what a value is, checked for their form (a malformed schema is the
    client's mistake, said here rather than found by the model); other keywords are passed on as they are."""
    if isinstance(schema, bool):
        return  # true / false: any value, no value
    if not isinstance(schema, dict):
        raise RequestError(f"{where} must be a JSON schema (an object)", "tools")
    if depth > MAX_SCHEMA_DEPTH:
        raise RequestError(f"{where} is nested more than {MAX_SCHEMA_DEPTH} levels deep", "tools")
    t = schema.get("type")
    if t is not None:
        types = [t] if isinstance(t, str) else t
        if not isinstance(types, list) or not types or any(x not in _JSON_TYPES for x in types):
            raise RequestError(f"{where}.type {t!r} is not a JSON Schema type ({', '.join(_JSON_TYPES)})", "tools")
    props = schema.get("properties")
    if props is not None:
        if not isinstance(props, dict):
            raise RequestError(f"{where}.properties must be an object of schemas", "tools")
        for key, sub in props.items():
            _check_schema(sub, f"{where}.properties.{key}", depth + 1)
    required = schema.get("required")
    if required is not None and (not isinstance(required, list) or not all(isinstance(r, str) for r in required)):
        raise RequestError(f"{where}.required must be a list of property names", "tools")
    items = schema.get("items")
    if items is not None:
        for k, sub in enumerate(items) if isinstance(items, list) else [(None, items)]:
            _check_schema(sub, f"{where}.items" + (f"[{k}]" if k is not None else ""), depth + 1)
    for key in ("anyOf", "oneOf", "allOf"):
        subs = schema.get(key)
        if subs is not None:
            if not isinstance(subs, list) or not subs:
                raise RequestError(f"{where}.{key} must be a non-empty list of schemas", "tools")
            for k, sub in enumerate(subs):
                _check_schema(sub, f"{where}.{key}[{k}]", depth + 1)
    extra = schema.get("additionalProperties")
    if extra is not None:
        _check_schema(extra, f"{where}.additionalProperties", depth + 1)
    if "enum" in schema and (not isinstance(schema["enum"], list) or not schema["enum"]):
        raise RequestError(f"{where}.enum must be a non-empty list", "tools")


def _template_variables(body: dict[str, Any]) -> dict[str, Any]:
    variables = body.get("chat_template_kwargs")
    if variables is None:
        variables = {}
    if not isinstance(variables, dict):
        raise RequestError("'chat_template_kwargs' must be an object", "chat_template_kwargs")
    taken = [k for k in TEMPLATE_VARIABLES if k in variables]
    if taken:
        raise RequestError(
            f"chat_template_kwargs cannot set {', '.join(taken)} (the request's own fields)", "chat_template_kwargs"
        )
    return dict(_json_text(variables, "chat_template_kwargs", "chat_template_kwargs"))


def parse_apply_template(body: Any) -> TemplateRequest:
    """`POST /apply-template`: a chat request's prompt-making fields (llama.cpp's server takes the same).
    Fields that only steer generation (sampling, max_tokens, stream, …) do not change the prompt and are not
    read; those that would and are not implemented are refused."""
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise RequestError("'messages' must be a non-empty list", "messages")
    if body.get("continue_final_message"):
        raise RequestError("continue_final_message is not supported by this server", "continue_final_message")
    if body.get("functions") is not None:
        raise RequestError("'functions' (the legacy form) is not supported: use tools", "functions")
    agp = body.get("add_generation_prompt", True)
    if not isinstance(agp, bool):
        raise RequestError("'add_generation_prompt' must be a boolean", "add_generation_prompt")
    tools = _tools(body.get("tools"))
    choice = _tool_choice(body.get("tool_choice"), tools)[0]
    images: list[ImageSource] = []  # (not decoded here: the prompt shows where each goes, the count counts it)
    return TemplateRequest(
        messages=[_template_message(m, i, images) for i, m in enumerate(msgs)],
        tools=tools if choice != "none" else None,
        add_generation_prompt=agp,
        variables=_template_variables(body),
        images=images,
    )
