"""OpenAI-compatible streaming chat over httpx: text and reasoning deltas, finish reason, usage, time to first token,
tokens/s.

Works against the local engine (docs/api.md) or any OpenAI-compatible server. Every error is a ChatError whose
str() is one sentence for the user. Cancelling the consuming task, or closing the iterator (`aclose()`, or
`contextlib.aclosing`), closes the HTTP stream at once, and the engine cancels the generation on disconnect.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from dataclasses import asdict, dataclass, field
from typing import Any

import httpx

from runmyai.engine.endpoint import Endpoint, EndpointSource, client_kind, http_client, resolve


class ChatError(Exception):
    """A chat request failed; str() is one human sentence. `status` is the HTTP status when there was one, `code`
    the OpenAI error body's code (e.g. "context_length_exceeded")."""

    def __init__(self, sentence: str, status: int | None = None, code: str | None = None) -> None:
        super().__init__(sentence)
        self.status = status
        self.code = code


OVERFLOW_POLICIES = ("rolling", "trim-middle", "stop")  # the engine's `context_overflow` (docs/api.md)


@dataclass
class ChatSettings:
    """Sampling settings; None leaves the server's default."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    max_tokens: int | None = None
    seed: int | None = None
    repeat_penalty: float | None = None
    stop: list[str] | None = None
    context_overflow: str | None = None  # what the engine drops when the chat outgrows the context (None: its default)
    # the conversation's key for the engine's prompt cache on disk (engine/prompt_cache.py), set per request by the
    # session, sent to the local engine only
    prompt_cache_key: str | None = None
    # the chat's own, never sent as such: tools offered or not (None: on), the MCP servers left out in this chat,
    # and the last reply's context notice ({"policy", "dropped_messages", "dropped_tokens", "message_id"})
    tools: bool | None = None
    tools_off: list[str] | None = None
    overflow: dict[str, Any] | None = None

    def request_fields(self) -> dict[str, Any]:
        local = ("tools", "tools_off", "overflow")
        return {k: v for k, v in asdict(self).items() if v is not None and v != [] and k not in local}

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: object) -> ChatSettings:
        """From a stored dict; unknown keys and values of the wrong type are dropped."""
        if not isinstance(data, dict):
            return cls()
        out = cls()
        for key, kind in (
            ("temperature", float),
            ("top_p", float),
            ("min_p", float),
            ("repeat_penalty", float),
            ("top_k", int),
            ("max_tokens", int),
            ("seed", int),
        ):
            v = data.get(key)
            if isinstance(v, bool) or not isinstance(v, int | float):
                continue
            setattr(out, key, kind(v))
        stop = data.get("stop")
        if isinstance(stop, list) and all(isinstance(s, str) for s in stop):
            out.stop = list(stop)
        if data.get("context_overflow") in OVERFLOW_POLICIES:
            out.context_overflow = str(data["context_overflow"])
        if isinstance(data.get("tools"), bool):
            out.tools = bool(data["tools"])
        off = data.get("tools_off")
        if isinstance(off, list) and all(isinstance(s, str) for s in off):
            out.tools_off = list(off)
        note = data.get("overflow")
        if isinstance(note, dict) and all(isinstance(note.get(k), int) for k in ("dropped_messages", "dropped_tokens")):
            out.overflow = dict(note)
        return out


@dataclass
class ChatDelta:
    text: str
    finish_reason: str | None = None
    usage: dict[str, Any] | None = None
    reasoning: str = ""  # the model's thinking (gpt-oss's analysis channel, a DeepSeek-R1 style <think>), if any
    # OpenAI's streamed tool-call pieces as they came ({"index", "id"?, "function": {"name"?, "arguments"?}}):
    # ToolCallAccumulator puts them together
    tool_calls: list[dict[str, Any]] = field(default_factory=list)


class ToolCallAccumulator:
    """A reply's tool calls from OpenAI's streamed pieces: the first piece of a call (by `index`) brings its id
    and name, later ones add to its arguments."""

    def __init__(self) -> None:
        self._calls: dict[int, dict[str, str]] = {}

    def add(self, pieces: list[dict[str, Any]]) -> None:
        for piece in pieces:
            index = piece.get("index", len(self._calls))
            if not isinstance(index, int):
                continue
            call = self._calls.setdefault(index, {"id": "", "name": "", "arguments": ""})
            if isinstance(piece.get("id"), str):
                call["id"] = piece["id"]
            fn = piece.get("function")
            if isinstance(fn, dict):
                if isinstance(fn.get("name"), str):
                    call["name"] += fn["name"]
                if isinstance(fn.get("arguments"), str):
                    call["arguments"] += fn["arguments"]

    def calls(self) -> list[dict[str, str]]:
        """{"id", "name", "arguments"} per call, in index order (an id made up where the server sent none)."""
        out = []
        for index in sorted(self._calls):
            c = dict(self._calls[index])
            c["id"] = c["id"] or f"call_{index}"
            if c["name"]:
                out.append(c)
        return out


# where servers put the thinking: `reasoning_content` (llama.cpp's server, TokenWing, DeepSeek's API), `reasoning`
# (vLLM, OpenRouter, Ollama); the first one a delta carries wins (some send both with the same text)
REASONING_FIELDS = ("reasoning_content", "reasoning")


@dataclass
class ReplyStats:
    ttft_s: float | None  # request sent -> first text or reasoning (a thinking model's first token is thinking)
    tokens: int  # completion tokens (the server's usage when it sent one, else the text chunks)
    tokens_per_s: float | None  # decode speed: tokens after the first over the time since the first
    prompt_tokens: int | None = None  # the server's usage: the prompt the reply was generated after
    n_ctx: int | None = None  # TokenWing's context length (its last chunk says it): the footer's context use
    # what the engine dropped to make the chat fit ({"policy", "dropped_messages", "dropped_tokens"}), if anything
    overflow: dict[str, Any] | None = None
    # the prompt's start read from the engine's prompt cache on disk: the prompt's tokens it gave, the time it took
    restored_tokens: int | None = None
    restore_s: float | None = None


@dataclass(frozen=True)
class TokenCount:
    """`POST /v1/chat/count`: the prompt's tokens (with the tools), the tools' share of them, the context."""

    prompt_tokens: int
    tools_tokens: int
    n_ctx: int


_CONNECT_TIMEOUT = 10.0
_READ_TIMEOUT = 600.0  # a first token on a big model streaming from a slow drive can take minutes


def _one_line(text: str, limit: int = 300) -> str:
    t = " ".join(str(text).split()).rstrip(".")
    return t if len(t) <= limit else t[: limit - 3] + "..."


def _error_message(body: bytes) -> str | None:
    """The message of an OpenAI-style error body, or of any JSON with a message/detail."""
    try:
        data = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return None
    if isinstance(data, dict):
        err = data.get("error")
        if isinstance(err, dict) and isinstance(err.get("message"), str):
            return str(err["message"])
        if isinstance(err, str):
            return err
        for key in ("message", "detail"):
            if isinstance(data.get(key), str):
                return str(data[key])
    return None


def _error_code(body: bytes) -> object:
    try:
        err = json.loads(body).get("error")
    except (ValueError, UnicodeDecodeError, AttributeError):
        return None
    return err.get("code") if isinstance(err, dict) else None


PROBE_TIMEOUT_S = 5.0  # a server that cannot list its models in this long is not one to switch to


async def probe(endpoint: Endpoint, timeout: float = PROBE_TIMEOUT_S) -> list[str]:
    """The models an endpoint serves (`GET /models` with its key), asked before the app lets go of anything local:
    File → Connect to a bad address stopped the local engine first and then failed. A short timeout; cancelling
    the awaiting task ends the request. Any failure is a ChatError with one sentence."""
    async with await http_client(endpoint, httpx.Timeout(timeout)) as client:
        try:
            r = await client.get(endpoint.url("models"), headers=endpoint.headers())
        except (httpx.ReadTimeout, httpx.WriteTimeout, httpx.PoolTimeout):
            raise ChatError(
                f"No answer from {endpoint.base_url} within {timeout:g} s; check the address and that the server "
                "is running."
            ) from None
        except httpx.TransportError as e:
            raise _transport_error(e, endpoint, started=False) from None
    return _model_ids(
        r,
        endpoint,
        f"{endpoint.base_url} answered, but not as an OpenAI-compatible API (its model list is not in that "
        "format); check the address.",
    )


def _model_ids(r: httpx.Response, endpoint: Endpoint, not_a_list: str) -> list[str]:
    """The ids of a `GET /models` answer; a ChatError in one sentence for an error status, `not_a_list` for an
    answer in another format."""
    if r.status_code != 200:
        raise _status_error(r.status_code, r.content, endpoint)
    try:
        data = r.json()
        return [str(m["id"]) for m in data["data"] if isinstance(m, dict) and "id" in m]
    except (ValueError, KeyError, TypeError):
        raise ChatError(not_a_list) from None


def _status_error(status: int, body: bytes, endpoint: Endpoint) -> ChatError:
    msg = _error_message(body)
    who = "The engine" if endpoint.local else "The server"
    if status == 403 and msg and _error_code(body) in ("host_not_allowed", "origin_not_allowed"):
        # TokenWing refusing the name it was reached by (`tokenwing serve --allowed-host`), not the key
        return ChatError(f"{who} refused the request: {_one_line(msg)}.", status)
    if status == 401 or status == 403:
        if endpoint.local:
            return ChatError("The engine refused the app's API key (it was probably restarted); try again.", status)
        return ChatError("The server refused the API key; check the key in the connection settings.", status)
    if status == 404:
        return ChatError(f"{who} has no chat API at {endpoint.base_url} (404); check the address.", status)
    if status == 413:
        return ChatError("The conversation is too large to send; start a new one or shorten it.", status)
    if status == 429:
        return ChatError(f"{who} is rate-limiting requests (429){': ' + _one_line(msg) if msg else ''}.", status)
    if status == 503:
        return ChatError(f"{who} is not ready{': ' + _one_line(msg) if msg else ''}.", status)
    if 400 <= status < 500:
        code = _error_code(body)
        return ChatError(
            f"{who} refused the request: {_one_line(msg or f'HTTP {status}')}.",
            status,
            code if isinstance(code, str) else None,
        )
    return ChatError(f"{who} failed with HTTP {status}{': ' + _one_line(msg) if msg else ''}.", status)


def _transport_error(e: httpx.TransportError, endpoint: Endpoint, started: bool) -> ChatError:
    who = "the engine" if endpoint.local else "the server"
    if isinstance(e, httpx.ConnectError | httpx.ConnectTimeout):
        if endpoint.local:
            return ChatError("Cannot connect to the engine: it is not running.")
        return ChatError(f"Cannot connect to {endpoint.base_url}; check the address and that the server is running.")
    if isinstance(e, httpx.ReadTimeout):
        return ChatError(f"No answer from {who} for {_READ_TIMEOUT:.0f} s; the request was given up.")
    if started:
        return ChatError(f"The connection to {who} broke off in the middle of the reply (did it stop?).")
    return ChatError(f"The connection to {who} failed: {_one_line(str(e) or type(e).__name__)}.")


class SSEParser:
    """Server-sent events from lines: yields (event, data) per blank-line-terminated event."""

    def __init__(self) -> None:
        self._event = ""
        self._data: list[str] = []

    def feed(self, line: str) -> tuple[str, str] | None:
        if line == "":
            if not self._data:
                self._event = ""
                return None
            out = (self._event or "message", "\n".join(self._data))
            self._event, self._data = "", []
            return out
        if line.startswith(":"):
            return None  # comment / keep-alive
        name, sep, value = line.partition(":")
        if not sep:
            name, value = line, ""
        value = value.removeprefix(" ")
        if name == "data":
            self._data.append(value)
        elif name == "event":
            self._event = value
        return None  # id, retry, unknown fields: ignored

    def flush(self) -> tuple[str, str] | None:
        return self.feed("")


class ChatClient:
    def __init__(self, endpoint: EndpointSource) -> None:
        """`endpoint`: a fixed Endpoint, or a function returning the current one (e.g. `lambda: sup.endpoint`,
        which follows the supervisor's restarts)."""
        self._source = endpoint
        self._clients: dict[tuple[bool, bool], httpx.AsyncClient] = {}
        self.last_stats: ReplyStats | None = None
        self._n_ctx: int | None = None  # the context length the engine reported in the reply being read
        self._overflow: dict[str, Any] | None = None  # what it dropped to fit that reply's prompt
        self._restored: tuple[int, float] | None = None  # its prompt's start read from the disk: tokens, seconds
        self.n_ctx: int | None = None  # the last context length the engine reported (a reply's, or a count's)
        self._counts = True  # False once the server said it has no count route (not TokenWing)
        self.last_body: dict[str, Any] | None = None
        self.skipped_lines = 0  # malformed stream lines skipped (over this client's life)

    def _endpoint(self) -> Endpoint:
        ep = resolve(self._source)
        if ep is None:
            raise ChatError("The engine is not running; start a model first.")
        return ep

    async def _client(self, endpoint: Endpoint) -> httpx.AsyncClient:
        kind = client_kind(endpoint)
        c = self._clients.get(kind)
        if c is None:
            timeout = httpx.Timeout(_READ_TIMEOUT, connect=_CONNECT_TIMEOUT, write=60.0, pool=_CONNECT_TIMEOUT)
            c = await http_client(endpoint, timeout)
            if kind in self._clients:  # another call made one meanwhile
                await c.aclose()
                return self._clients[kind]
            self._clients[kind] = c
        return c

    async def aclose(self) -> None:
        clients, self._clients = list(self._clients.values()), {}
        for c in clients:
            await c.aclose()

    async def models(self) -> list[str]:
        return [str(m["id"]) for m in await self.model_entries()]

    async def model_entries(self) -> list[dict[str, Any]]:
        """The server's `GET /models` entries as it sent them (what a model takes beyond text: `modalities`)."""
        ep = self._endpoint()
        try:
            r = await (await self._client(ep)).get(ep.url("models"), headers=ep.headers(), timeout=30)
        except httpx.TransportError as e:
            raise _transport_error(e, ep, started=False) from None
        ids = _model_ids(r, ep, "The server's model list is not in the OpenAI format.")  # (errors in one sentence)
        return [m for m in r.json()["data"] if isinstance(m, dict) and str(m.get("id")) in ids]

    async def count(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> TokenCount:
        """The tokens a chat request's prompt takes, by the model's own template (`POST /v1/chat/count`, TokenWing's
        route): with `tools`, also how many of them the tool definitions take. ChatError where the server has no
        such route (another OpenAI-compatible server: 404) or cannot count."""
        ep = self._endpoint()
        if not self._counts:
            raise ChatError("The server cannot count a prompt's tokens.", 404)
        body: dict[str, Any] = {"model": ep.model or "default", "messages": messages}
        if tools:
            body["tools"] = tools
        try:
            r = await (await self._client(ep)).post(ep.url("chat/count"), json=body, headers=ep.headers(), timeout=30)
        except httpx.TransportError as e:
            raise _transport_error(e, ep, started=False) from None
        if r.status_code != 200:
            if r.status_code in (404, 405):
                self._counts = False  # asked once, not before every message
            raise _status_error(r.status_code, r.content, ep)
        try:
            data = r.json()
            out = TokenCount(int(data["prompt_tokens"]), int(data.get("tools_tokens") or 0), int(data["n_ctx"]))
        except (ValueError, KeyError, TypeError):
            raise ChatError("The engine's token count is not in the expected format.") from None
        self.n_ctx = out.n_ctx
        return out

    async def stream_chat(
        self,
        messages: list[dict[str, Any]],
        settings: ChatSettings,
        tools: list[dict[str, Any]] | None = None,
    ) -> AsyncIterator[ChatDelta]:
        """Streams one reply. Yields text, reasoning and tool-call deltas (possibly empty) and, last, one with the
        finish reason and the usage when the server sends them. `tools`: OpenAI function definitions offered to
        the model. `last_stats` is set when the reply ends (also when it is cancelled); `last_body` is the request
        as sent."""
        ep = self._endpoint()
        body: dict[str, Any] = {
            "model": ep.model or "default",
            "messages": messages,
            "stream": True,
            "stream_options": {"include_usage": True},
            **settings.request_fields(),
        }
        if tools:
            body["tools"] = tools
        if not ep.local:  # (a key for TokenWing's cache on disk: another server has none of the app's snapshots)
            body.pop("prompt_cache_key", None)
        self.last_body = body
        self.last_stats = None
        self._restored = None
        self._n_ctx = None
        self._overflow = None
        sent = time.monotonic()
        first: float | None = None
        last: float | None = None
        chunks = 0
        usage: dict[str, Any] | None = None
        finish: str | None = None
        done = False
        started = False
        client = await self._client(ep)
        try:
            async with client.stream(
                "POST", ep.url("chat/completions"), json=body, headers={**ep.headers(), "Accept": "text/event-stream"}
            ) as r:
                if r.status_code != 200:
                    raise _status_error(r.status_code, await r.aread(), ep)
                started = True
                parser = SSEParser()
                lines = r.aiter_lines()
                while not done:
                    line = await anext(lines, None)
                    ev = parser.flush() if line is None else parser.feed(line)
                    if ev is None:
                        if line is None:
                            break
                        continue
                    data = ev[1].strip()
                    if data == "[DONE]":
                        done = True
                        break
                    parsed = self._parse_chunk(data)
                    if parsed is None:
                        continue
                    text, reasoning, fr, u, calls = parsed
                    if u is not None:
                        usage = u
                    if fr is not None:
                        finish = fr
                    if text or reasoning:
                        now = time.monotonic()
                        first = first if first is not None else now
                        last = now
                        chunks += 1
                    if text or reasoning or fr is not None or u is not None or calls:
                        yield ChatDelta(text, fr, u, reasoning, calls)
                    if line is None:
                        break
        except httpx.TransportError as e:
            raise _transport_error(e, ep, started) from None
        except httpx.StreamError as e:
            raise ChatError(f"The reply stream failed: {_one_line(str(e) or type(e).__name__)}.") from None
        finally:
            tokens = chunks
            if usage is not None and isinstance(usage.get("completion_tokens"), int):
                tokens = int(usage["completion_tokens"])
            rate = None
            if first is not None and last is not None and last > first and tokens > 1:
                rate = (tokens - 1) / (last - first)
            prompt = usage.get("prompt_tokens") if usage is not None else None
            self.last_stats = ReplyStats(
                first - sent if first is not None else None,
                tokens,
                rate,
                prompt if isinstance(prompt, int) else None,
                self._n_ctx,
                self._overflow,
                restored_tokens=self._restored[0] if self._restored else None,
                restore_s=self._restored[1] if self._restored else None,
            )
            if self._n_ctx is not None:
                self.n_ctx = self._n_ctx
        if not done and finish is None:
            raise ChatError("The reply ended before it was finished (the connection closed without an end marker).")

    def _parse_chunk(
        self, data: str
    ) -> tuple[str, str, str | None, dict[str, Any] | None, list[dict[str, Any]]] | None:
        """(text, reasoning, finish reason, usage, tool-call pieces) of one chunk; None for a malformed one
        (skipped); ChatError for an error object in the stream."""
        try:
            obj = json.loads(data)
        except ValueError:
            self.skipped_lines += 1
            return None
        if not isinstance(obj, dict):
            self.skipped_lines += 1
            return None
        if "error" in obj:
            msg = _error_message(data.encode()) or "unknown error"
            raise ChatError(f"The reply failed: {_one_line(msg)}.")
        usage = obj.get("usage") if isinstance(obj.get("usage"), dict) else None
        text = reasoning = ""
        finish: str | None = None
        calls: list[dict[str, Any]] = []
        choices = obj.get("choices")
        if isinstance(choices, list) and choices and isinstance(choices[0], dict):
            c = choices[0]
            delta = c.get("delta")
            if isinstance(delta, dict) and isinstance(delta.get("content"), str):
                text = delta["content"]
            elif isinstance(c.get("text"), str):  # a completions-style chunk
                text = c["text"]
            if isinstance(delta, dict) and isinstance(delta.get("tool_calls"), list):
                calls = [c for c in delta["tool_calls"] if isinstance(c, dict)]
            if isinstance(delta, dict):
                reasoning = next((r for f in REASONING_FIELDS if isinstance(r := delta.get(f), str) and r), "")
            if isinstance(c.get("finish_reason"), str):
                finish = c["finish_reason"]
            tw = obj.get("tokenwing")
            if isinstance(tw, dict) and isinstance(tw.get("n_ctx"), int):
                self._n_ctx = int(tw["n_ctx"])
            if isinstance(tw, dict) and isinstance(tw.get("context_overflow"), dict):
                self._overflow = dict(tw["context_overflow"])  # (the first chunk says it, the last again)
            if isinstance(tw, dict) and isinstance(tw.get("prompt_restored_tokens"), int):  # (the last chunk)
                used = tw.get("prompt_cached_tokens")  # (the prompt's tokens the restore gave)
                self._restored = (used if isinstance(used, int) else 0, float(tw.get("prompt_restore_ms") or 0) / 1e3)
            if finish == "length" and isinstance(tw, dict) and tw.get("finish_detail") == "context_full":
                finish = "context_full"  # TokenWing says which "length": the context, not max_tokens
        elif usage is None:
            self.skipped_lines += 1
            return None
        return text, reasoning, finish, usage, calls
