"""Request validation for the OpenAI-compatible API (requests are untrusted: every field is checked)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tokenwing.runtime.sampler import SamplerSettings

MAX_TOKENS_LIMIT = 1 << 20
MAX_BODY = 8 << 20
MAX_TOP_LOGPROBS = 20  # OpenAI's limit for chat (5 for completions; llama.cpp takes any: 20 for both here)


class RequestError(Exception):
    def __init__(
        self, message: str, param: str | None = None, status: int = 400, kind: str = "invalid_request_error"
    ) -> None:
        super().__init__(message)
        self.message, self.param, self.status, self.kind = message, param, status, kind

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": None}}


@dataclass
class GenerationRequest:
    prompt: str | None = None  # completions
    messages: list[dict[str, str]] = field(default_factory=list)  # chat
    max_tokens: int = 256
    stream: bool = False
    stop: list[str] = field(default_factory=list)
    sampler: SamplerSettings = field(default_factory=SamplerSettings)
    include_usage: bool = False
    logprobs: int | None = None  # None: off; else how many alternatives per token (top_logprobs)


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


def _content(value: Any, where: str) -> str:
    if isinstance(value, str):
        return _text(value, where, "messages")
    if isinstance(value, list):  # [{"type": "text", "text": ...}, ...]
        parts = []
        for part in value:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise RequestError(f"{where}: only text content parts are supported", "messages")
            parts.append(_text(part["text"], where, "messages"))
        return "".join(parts)
    if value is None:
        return ""
    raise RequestError(f"{where}: content must be a string or a list of text parts", "messages")


def _common(body: dict[str, Any], req: GenerationRequest) -> None:
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    req.max_tokens = _integer({"max_tokens": max_tokens}, "max_tokens", 256, 1, MAX_TOKENS_LIMIT) or 256
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise RequestError("'stream' must be a boolean", "stream")
    req.stream = stream
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
    _refuse_unsupported(body)
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


# Fields that would change the answer and that this server does not implement: refused with a 400 rather than
# silently ignored (a client asking for function calling or JSON output must not get plain text back).
_UNSUPPORTED: dict[str, str] = {
    "tools": "tools (function calling) are not supported by this server",
    "functions": "functions (function calling) are not supported by this server",
    "function_call": "function calling is not supported by this server",
    "tool_choice": "tool_choice: tools (function calling) are not supported by this server",
    "response_format": "response_format: only plain text output is supported",
    "logit_bias": "logit_bias is not supported by this server",
    "echo": "echo is not supported by this server",
    "suffix": "suffix (insertion) is not supported by this server",
    "best_of": "best_of is not supported (only 1)",
    "audio": "audio output is not supported",
    "modalities": "only text output is supported",
}
_HARMLESS: dict[str, Any] = {  # values of those fields that ask for nothing beyond plain text
    "tool_choice": ("none", "auto"),  # (reached only without tools: nothing to choose from)
    "response_format": ({"type": "text"},),
    "best_of": (1,),
    "echo": (False,),
    "modalities": (["text"],),
}


def _refuse_unsupported(body: dict[str, Any]) -> None:
    for key, message in _UNSUPPORTED.items():
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
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise RequestError("'messages' must be a non-empty list", "messages")
    req = GenerationRequest()
    for i, m in enumerate(msgs):
        if not isinstance(m, dict):
            raise RequestError(f"messages[{i}] must be an object", "messages")
        role = m.get("role")
        if role not in ("system", "user", "assistant", "tool", "developer"):
            raise RequestError(f"messages[{i}].role must be system, user, assistant or tool", "messages")
        if m.get("tool_calls") or m.get("function_call"):
            raise RequestError(f"messages[{i}]: tool calls are not supported by this server", "messages")
        req.messages.append(
            {"role": "system" if role == "developer" else role, "content": _content(m.get("content"), f"messages[{i}]")}
        )
    _common(body, req)
    _chat_logprobs(body, req)
    return req


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
