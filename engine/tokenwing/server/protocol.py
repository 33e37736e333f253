"""Request validation for the OpenAI-compatible API (requests are untrusted: every field is checked)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tokenwing.runtime.sampler import SamplerSettings

MAX_TOKENS_LIMIT = 1 << 20
MAX_BODY = 8 << 20


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


def _content(value: Any, where: str) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, list):  # [{"type": "text", "text": ...}, ...]
        parts = []
        for part in value:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise RequestError(f"{where}: only text content parts are supported", "messages")
            parts.append(part["text"])
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
        req.messages.append(
            {"role": "system" if role == "developer" else role, "content": _content(m.get("content"), f"messages[{i}]")}
        )
    _common(body, req)
    return req


def parse_completion(body: Any) -> GenerationRequest:
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if not isinstance(prompt, str):
        raise RequestError("'prompt' must be a string", "prompt")
    req = GenerationRequest(prompt=prompt)
    _common(body, req)
    req.max_tokens = _integer(body, "max_tokens", 16, 1, MAX_TOKENS_LIMIT) or 16
    return req
