"""The HTTP fuzz of issue 41 (shared by tests/engine/test_http_fuzz.py and bench/http_fuzz_bench.py): mutated
requests to every route of a live `tokenwing serve`, as raw bytes on a socket (a hostile client is no official
client): random bytes, truncated, huge and deep JSON, every field of chat / completions / tokenize /
apply-template / count given each wrong type, bad headers and bad methods. Each answer must be a 2xx or a 4xx in
the one JSON error format — never a 5xx, never a dropped connection, never a hang (the client's timeout)."""

from __future__ import annotations

import json
import random
import socket
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

TIMEOUT_S = 120.0  # per request: a reply of a few tokens takes well under a second; a hang is what this catches

CHAT: dict[str, Any] = {
    "messages": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "Hello"}]},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"a": "x"}'}}],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "42"},
        {"role": "user", "content": "And?", "name": "u"},
    ],
    "tools": [
        {
            "type": "function",
            "function": {
                "name": "f",
                "description": "d",
                "parameters": {"type": "object", "properties": {"a": {"type": "string"}}, "required": ["a"]},
            },
        }
    ],
    "tool_choice": "auto",
    "parallel_tool_calls": True,
    "max_tokens": 2,
    "temperature": 0,
    "top_p": 0.9,
    "top_k": 5,
    "min_p": 0.0,
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
    "repeat_penalty": 1.0,
    "seed": 1,
    "stop": ["\n\n"],
    "stream": False,
    "stream_options": {"include_usage": True},
    "logprobs": True,
    "top_logprobs": 2,
    "response_format": {"type": "text"},
    "chat_template_kwargs": {"enable_thinking": False},
    "context_overflow": "rolling",
    "wait": True,
    "ignore_eos": False,
    "n": 1,
}
COMPLETION: dict[str, Any] = {
    "prompt": "Once",
    "max_tokens": 2,
    "temperature": 0,
    "logprobs": 2,
    "stop": "\n",
    "seed": 3,
    "stream": False,
}
TEMPLATE: dict[str, Any] = {
    "messages": CHAT["messages"],
    "tools": CHAT["tools"],
    "tool_choice": "auto",
    "add_generation_prompt": True,
    "chat_template_kwargs": {"enable_thinking": False},
}
TOKENIZE: dict[str, Any] = {"content": "Hello world", "add_special": True, "with_pieces": True}
DETOKENIZE: dict[str, Any] = {"tokens": [1, 2, 3]}

POST_ROUTES: dict[str, dict[str, Any]] = {
    "/v1/chat/completions": CHAT,
    "/v1/completions": COMPLETION,
    "/apply-template": TEMPLATE,
    "/v1/chat/count": TEMPLATE,
    "/tokenize": TOKENIZE,
    "/detokenize": DETOKENIZE,
}
# (/v1/tokenwing/stats/stream is left out of the GETs: it streams until the client leaves)
GET_ROUTES = ("/health", "/metrics", "/v1/models", "/v1/tokenwing/stats")

# values of every JSON type, and the edges of each
WRONG: list[Any] = [
    None,
    True,
    False,
    0,
    -1,
    1,
    2**31,
    -(2**63) - 1,
    10**40,
    1.5,
    -0.0,
    1e308,
    "",
    "x",
    "\u0000",
    "é" * 3,
    "A" * 5000,
    [],
    [None],
    ["x"],
    [1, 2],
    [[[]]],
    {},
    {"type": "function"},
    {"": None},
]
# raw JSON texts that have no Python value to write them from
RAW_WRONG = [b"NaN", b"Infinity", b"-Infinity", b"1e999", b"9" * 5000, b'"\\ud800"', b'"\\udfff x"', b"-0"]
BAD_HEADERS: list[list[str]] = [
    [],  # no Content-Type at all
    ["Content-Type: text/plain"],
    ["Content-Type: application/x-www-form-urlencoded"],
    ["Content-Type: application/json; charset=latin-1"],
    ["Content-Type: application/json", "Content-Type: text/plain"],
    ["Content-Type: application/json", "Content-Encoding: gzip"],
    ["Content-Type: application/json", "Origin: http://evil.example"],
    ["Content-Type: application/json", "Origin: null"],
    ["Content-Type: application/json", "Expect: 100-continue"],
    ["Content-Type: application/json", "Accept: text/event-stream"],
    ["Content-Type: application/json", "Accept-Encoding: gzip, br"],
    ["Content-Type: application/json", "X-Forwarded-For: 10.0.0.1"],
    ["Content-Type: application/json", "Authorization: Basic dXNlcjpwYXNz"],
    ["Content-Type: application/json", "Authorization: Bearer"],
    ["Content-Type: application/json", "Authorization: Bearer wrong"],
    ["Content-Type: application/json", "Authorization: " + "B" * 9000],
    ["Content-Type: application/json", "Cookie: " + "a=b; " * 500],
    ["Content-Type: application/json", "X-Junk: \x01\x7f"],
]
BAD_METHODS = ("GET", "PUT", "DELETE", "PATCH", "OPTIONS", "HEAD", "TRACE", "BREW", "post")


@dataclass
class Case:
    """One request: what it is (for a failure's message) and its bytes."""

    kind: str
    method: str
    path: str
    body: bytes | None
    headers: list[str]  # beyond Host and Connection (auth included unless the case is about it)
    length: str | None = "auto"  # Content-Length: "auto" (the body's), None (left out), or as given
    # the client half-closes after its bytes, its body short of the length it declared: the server may answer
    # (a 4xx) or close with no answer, as the client left; it must neither hang nor fail
    leaves: bool = False


@dataclass
class Answer:
    status: int
    headers: dict[str, str]
    body: bytes
    cut: bool = False  # the client's send was reset: a 413 sent before the body was taken, its own body cut by TCP

    def problem(self, head: bool = False) -> str | None:
        """Why this answer breaks the contract, or None."""
        if self.status == 0:
            return None  # (only a case whose client left gets here: see Case.leaves)
        if not (200 <= self.status < 300 or 400 <= self.status < 500):
            return f"status {self.status}"
        ctype = self.headers.get("content-type", "")
        if 200 <= self.status < 300 and "event-stream" in ctype:
            return None
        if self.status == 200 and ctype.startswith("text/plain"):  # /metrics: Prometheus's text
            return None
        if head and not self.body:  # a HEAD's answer has no body
            return None
        if self.cut and self.status == 413:  # (the status came; the reset of the unread upload may cut the rest)
            return None
        try:
            doc = json.loads(self.body)
        except ValueError:
            return f"{self.status} with a body that is not JSON: {self.body[:120]!r}"
        if self.status >= 400:
            err = doc.get("error") if isinstance(doc, dict) else None
            msg = err.get("message") if isinstance(err, dict) else None
            if not isinstance(err, dict) or not isinstance(msg, str) or not msg or "\n" in msg:
                return f"{self.status} not in the JSON error format: {self.body[:200]!r}"
            if not isinstance(err.get("type"), str):
                return f"{self.status} not in the JSON error format: {self.body[:200]!r}"
            if "Traceback" in msg:
                return f"{self.status} with a traceback: {msg[:200]}"
        return None


def encode(case: Case, port: int, key: str | None) -> bytes:
    head = [f"{case.method} {case.path} HTTP/1.1", f"Host: 127.0.0.1:{port}"]
    if key is not None and not any(h.lower().startswith("authorization:") for h in case.headers):
        head.append(f"Authorization: Bearer {key}")
    head += case.headers
    if case.length == "auto" and case.body is not None:
        head.append(f"Content-Length: {len(case.body)}")
    elif case.length not in (None, "auto"):
        head.append(f"Content-Length: {case.length}")
    head.append("Connection: close")
    return ("\r\n".join(head) + "\r\n\r\n").encode("latin-1") + (case.body or b"")


def send(case: Case, port: int, key: str | None, timeout: float = TIMEOUT_S) -> Answer:
    """The answer, read to the connection's close; an OSError / socket.timeout is a dropped connection or a hang."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        # (refused before the whole body was taken, 413 at its declared length: its answer is still to read)
        cut = False
        try:
            s.sendall(encode(case, port, key))
        except (BrokenPipeError, ConnectionResetError):
            cut = True  # the server answered and closed before taking the whole body: a reset may cut its answer
        if case.leaves:
            s.shutdown(socket.SHUT_WR)
        got = bytearray()
        try:
            while chunk := s.recv(1 << 16):
                got += chunk
        except ConnectionResetError:
            if not (cut and got):
                raise
    head, sep, body = bytes(got).partition(b"\r\n\r\n")
    while sep and head.startswith(b"HTTP/1.1 1"):  # an interim answer (100 Continue): the real one follows
        head, sep, body = body.partition(b"\r\n\r\n")
    if not sep and case.leaves and not got:
        return Answer(0, {}, b"")  # closed with no answer: the client had left
    if not sep:
        raise ConnectionError(f"no complete answer ({len(got)} bytes)")
    status_line, *lines = head.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines)}
    if headers.get("transfer-encoding", "").lower() == "chunked":
        body = _dechunk(body)
    return Answer(int(status_line.split()[1]), headers, body, cut)


def _dechunk(data: bytes) -> bytes:
    out = bytearray()
    while data:
        size_line, _, rest = data.partition(b"\r\n")
        size = int(size_line.split(b";")[0] or b"0", 16)
        if size == 0:
            break
        out += rest[:size]
        data = rest[size + 2 :]
    return bytes(out)


# ------------------------------------------------------------------------------------------------ mutations
def _paths(value: Any, prefix: tuple[Any, ...] = ()) -> Iterator[tuple[Any, ...]]:
    """Every place in a JSON value (keys of objects, indexes of lists), the value itself first."""
    yield prefix
    if isinstance(value, dict):
        for k, v in value.items():
            yield from _paths(v, (*prefix, k))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            yield from _paths(v, (*prefix, i))


def _set(doc: Any, path: tuple[Any, ...], value: Any) -> Any:
    if not path:
        return value
    doc = json.loads(json.dumps(doc))
    node = doc
    for p in path[:-1]:
        node = node[p]
    node[path[-1]] = value
    return doc


def _drop(doc: Any, path: tuple[Any, ...]) -> Any:
    doc = json.loads(json.dumps(doc))
    node = doc
    for p in path[:-1]:
        node = node[p]
    del node[path[-1]]
    return doc


_MARK = "\u2603MARK\u2603"  # where a raw JSON text goes in


def _raw_at(doc: Any, path: tuple[Any, ...], raw: bytes) -> bytes:
    text = json.dumps(_set(doc, path, _MARK)).encode()
    return text.replace(json.dumps(_MARK).encode(), raw)


def _deep(rng: random.Random) -> bytes:
    depth = rng.choice([63, 64, 65, 200, 1000, 100_000])
    opener, closer = rng.choice([(b"[", b"]"), (b'{"a":', b"}")])
    inner = opener * depth + b"1" + closer * depth
    return b'{"messages": ' + inner + b"}" if rng.random() < 0.5 else inner


def cases(seed: int, n: int, routes: dict[str, dict[str, Any]] | None = None) -> Iterator[Case]:
    """n cases from `seed`: the same seed, the same requests (the fuzz is repeatable). `routes`: the POST routes
    and their valid bodies to mutate (every route's by default)."""
    posts = routes or POST_ROUTES
    rng = random.Random(seed)
    ctype = ["Content-Type: application/json"]
    kinds = ["field-type", "field-type", "field-type", "field-drop", "raw-value", "random-bytes", "truncated",
             "byte-flip", "deep", "huge", "headers", "method", "route"]  # fmt: skip
    for _ in range(n):
        kind = rng.choice(kinds)
        path = rng.choice(list(posts))
        base = posts[path]
        text = json.dumps(base).encode()
        if kind == "field-type":  # a field (at any depth) given a value of another type
            where = rng.choice(list(_paths(base)))
            value = rng.choice(WRONG)
            yield Case(
                f"{kind} {where}={str(value)[:40]!r}",
                "POST",
                path,
                json.dumps(_set(base, where, value)).encode(),
                ctype,
            )
        elif kind == "field-drop":
            where = rng.choice(list(_paths(base))[1:])
            yield Case(f"{kind} {where}", "POST", path, json.dumps(_drop(base, where)).encode(), ctype)
        elif kind == "raw-value":
            where = rng.choice(list(_paths(base)))
            raw = rng.choice(RAW_WRONG)
            yield Case(f"{kind} {where}={raw[:20]!r}", "POST", path, _raw_at(base, where, raw), ctype)
        elif kind == "random-bytes":
            body = rng.randbytes(rng.choice([0, 1, 7, 100, 4096]))
            yield Case(kind, "POST", path, body, ctype)
        elif kind == "truncated":
            cut = rng.randrange(len(text))
            if rng.random() < 0.5:  # the body ends early with its full length declared: the server waits no more
                yield Case(f"{kind} at {cut}", "POST", path, text[:cut], ctype)
            else:  # it says more than it sends: the client gives up (half-closes) and the server must not hang
                yield Case(f"{kind}+left at {cut}", "POST", path, text[:cut], ctype, length=str(len(text)), leaves=True)
        elif kind == "byte-flip":
            b = bytearray(text)
            for _ in range(rng.randint(1, 8)):
                b[rng.randrange(len(b))] = rng.randrange(256)
            yield Case(kind, "POST", path, bytes(b), ctype)
        elif kind == "deep":
            yield Case(kind, "POST", path, _deep(rng), ctype)
        elif kind == "huge":
            size = rng.choice([(8 << 20) - 100, (8 << 20) + 1, 20 << 20])
            filler = rng.choice(["a", "\u00e9", " "])
            body = json.dumps({**base, "pad": filler * (size // len(filler.encode()))}).encode()
            yield Case(f"{kind} {len(body)}", "POST", path, body, ctype)
        elif kind == "headers":
            headers = rng.choice(BAD_HEADERS)
            yield Case(f"{kind} {headers}", "POST", path, text, headers)
        elif kind == "method":
            target = rng.choice([*posts, *GET_ROUTES, "/v1/tokenwing/stats/stream"])
            # (GET and HEAD of the stats stream are its own use: it streams until the client leaves)
            method = rng.choice([m for m in BAD_METHODS if not (target.endswith("/stream") and m in ("GET", "HEAD"))])
            sent = text if rng.random() < 0.5 else None
            yield Case(f"{kind} {method} {target}", method, target, sent, ctype)
        else:  # route: paths that are none of the server's, or its own with odd suffixes
            target = rng.choice(
                [
                    "/",
                    "/v1",
                    "/v1/",
                    "/v1/chat",
                    "/v1/chat/completions/",
                    "/v1/chat/completions?x=%ff",
                    "/%2e%2e/etc",
                    "/v1/models/../health",
                    "/" + "a" * 4000,
                    "/v1/embeddings",
                    "/health?" + "q=1&" * 200,
                ]
            )
            yield Case(f"{kind} {target[:60]}", rng.choice(["GET", "POST"]), target, text, ctype)
