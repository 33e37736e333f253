"""Issue 41, the HTTP layer: any local program can talk to the server. Bodies are refused as they pass the size
limit (a 1,000 MB body took the server to 2.49 GB before its 413), deep JSON is a 400 (1,000 levels were a
RecursionError, a 500), every error — 404 and 405 included — is the one JSON format, and the auth scheme is
case-insensitive. Raw bytes on a socket, as a hostile client sends them."""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator

import httpx
import pytest

from tests.conftest import ModelFactory
from tests.engine.test_server import KEY, Server
from tests.engine.test_server_guard import Reply, raw
from tokenwing.server.app import MAX_JSON_DEPTH, json_depth
from tokenwing.server.protocol import MAX_BODY


@pytest.fixture(scope="module")
def server(repacked_factory: ModelFactory) -> Iterator[Server]:
    s = Server(repacked_factory(type="Q8_0", n_layer=3), "--no-usage-table")
    yield s
    s.stop()


def _head(server: Server, extra: list[str]) -> bytes:
    port = int(server.handshake["port"])
    lines = [
        "POST /v1/chat/completions HTTP/1.1",
        f"Host: 127.0.0.1:{port}",
        f"Authorization: Bearer {KEY}",
        "Content-Type: application/json",
        *extra,
        "Connection: close",
    ]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def _answer(s: socket.socket) -> Reply:
    got = b""
    while b"\r\n\r\n" not in got or len(got.partition(b"\r\n\r\n")[2]) < _length(got):
        chunk = s.recv(65536)
        if not chunk:
            break
        got += chunk
    head, _, body = got.partition(b"\r\n\r\n")
    status_line, *header_lines = head.decode("latin-1").split("\r\n")
    headers = [(k.strip().lower(), v.strip()) for k, _, v in (ln.partition(":") for ln in header_lines)]
    return Reply(int(status_line.split()[1]), headers, body)


def _length(got: bytes) -> int:
    for line in got.partition(b"\r\n\r\n")[0].split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            return int(line.split(b":")[1])
    return 0


def test_a_declared_huge_body_is_refused_before_it_is_sent(server: Server) -> None:
    """The answer comes with no byte of the body sent: nothing was waited for or buffered (before, the server
    read the whole body first — here it would wait for it forever)."""
    port = int(server.handshake["port"])
    with socket.create_connection(("127.0.0.1", port), timeout=60) as s:
        s.sendall(_head(server, ["Content-Length: 1000000000"]))
        r = _answer(s)
    assert r.status == 413
    assert "request body too large" in r.error()["message"]


def test_a_streamed_body_is_refused_once_it_passes_the_limit(server: Server) -> None:
    """Chunked, with no length: 413 once 8 MiB have come, while the body has not ended (before, the server read
    to its end, so this would hang)."""
    port = int(server.handshake["port"])
    piece = b"[" + b" " * (1 << 20) + b"]"
    chunk = f"{len(piece):x}\r\n".encode() + piece + b"\r\n"
    with socket.create_connection(("127.0.0.1", port), timeout=60) as s:
        s.sendall(_head(server, ["Transfer-Encoding: chunked"]))
        for _ in range(MAX_BODY // len(piece) + 2):  # past the limit, and no last chunk
            s.sendall(chunk)
        r = _answer(s)
    assert r.status == 413
    assert httpx.get(server.url + "/health").status_code == 200


@pytest.mark.parametrize("depth", [MAX_JSON_DEPTH + 1, 1000, 100_000])
def test_deep_json_is_a_400(server: Server, depth: int) -> None:
    port = int(server.handshake["port"])
    auth = {"Host": f"127.0.0.1:{port}", "Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    for body in (b"[" * depth + b"]" * depth, b'{"messages": ' + b'{"a":' * depth + b"1" + b"}" * depth + b"}"):
        r = raw(port, "POST", "/v1/chat/completions", auth, body)
        assert r.status == 400, r.body[:300]
        assert f"nests deeper than {MAX_JSON_DEPTH} levels" in r.error()["message"]


def test_json_depth_counts_brackets_outside_strings_only() -> None:
    assert json_depth(b'{"a": [1, {"b": "[[[[{{{{"}]}') == 3
    assert json_depth(b'"\\"[[[["') == 0  # an escaped quote does not end the string
    assert json_depth(b"[" * 70 + b"]" * 70) == 70
    assert json_depth(b"") == 0


def test_every_error_is_the_json_format(server: Server) -> None:
    port = int(server.handshake["port"])
    auth = {"Host": f"127.0.0.1:{port}", "Authorization": f"Bearer {KEY}"}
    r = raw(port, "GET", "/v1/chat/completions", auth)
    assert r.status == 405 and r.header("allow") == "POST"
    assert "Method Not Allowed" in r.error()["message"]
    r = raw(port, "GET", "/v1/nothing-here", auth)
    assert r.status == 404 and r.error()["type"] == "not_found_error"


def _raw_bytes(server: Server, data: bytes) -> Reply:
    """These bytes on a fresh connection, the answer read to the server's close."""
    port = int(server.handshake["port"])
    with socket.create_connection(("127.0.0.1", port), timeout=60) as s:
        s.sendall(data)
        got = b""
        while chunk := s.recv(65536):
            got += chunk
    head, _, body = got.partition(b"\r\n\r\n")
    status_line, *header_lines = head.decode("latin-1").split("\r\n")
    headers = [(k.strip().lower(), v.strip()) for k, _, v in (ln.partition(":") for ln in header_lines)]
    return Reply(int(status_line.split()[1]), headers, body)


@pytest.mark.parametrize(
    "data",
    [
        b"GARBAGE\r\n\r\n",  # no method, path or version
        b"GET /health HTTP/9\r\nHost: x\r\n\r\n",  # a version h11 does not know
        b"GET /health HTTP/1.1\r\nHost: x\r\nno colon in this header\r\n\r\n",
        b"GET /health HTTP/1.1\r\nHost: x\r\nX-Bad: a\x00b\r\n\r\n",  # a NUL in a value
        b"GET /health HTTP/1.1\r\nX-Long: " + b"a" * (64 << 10),  # a header block past h11's 16 KiB, unended
        b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + bytes(64),  # a TLS hello on the plain port
    ],
)
def test_an_unparseable_request_is_a_json_400(server: Server, data: bytes) -> None:
    """uvicorn answered these itself, before any app code, with a plain-text 'Invalid HTTP request received.'"""
    r = _raw_bytes(server, data)
    assert r.status == 400 and r.header("content-type") == "application/json", (r.headers, r.body)
    assert "invalid HTTP request" in r.error()["message"]
    assert httpx.get(server.url + "/health").status_code == 200


def test_head_on_the_stats_stream_ends(server: Server) -> None:
    """HEAD gets the stream's headers and no body (it streamed keep-alives forever: this read to the server's close
    never ended)."""
    port = int(server.handshake["port"])
    head = f"HEAD /v1/tokenwing/stats/stream HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nAuthorization: Bearer {KEY}\r\n"
    r = _raw_bytes(server, (head + "Connection: close\r\n\r\n").encode())
    assert r.status == 200 and r.header("content-type") is not None
    assert str(r.header("content-type")).startswith("text/event-stream")
    assert r.body == b""


@pytest.mark.parametrize("scheme", ["Bearer", "bearer", "BEARER", "bEaReR"])
def test_the_auth_scheme_is_case_insensitive(server: Server, scheme: str) -> None:
    r = httpx.get(server.url + "/v1/models", headers={"Authorization": f"{scheme} {KEY}"})
    assert r.status_code == 200


@pytest.mark.parametrize("value", ["Basic " + KEY, KEY, f"Bearer{KEY}", f"Bearer {KEY}x", "bearer", ""])
def test_other_credentials_are_refused(server: Server, value: str) -> None:
    r = httpx.get(server.url + "/v1/models", headers={"Authorization": value} if value else {})
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"


def test_still_serving_after_the_attacks(server: Server) -> None:
    r = server.client().chat.completions.create(model="x", messages=[{"role": "user", "content": "Hi"}], max_tokens=3)
    assert r.choices[0].message.role == "assistant"
    assert json.loads(httpx.get(server.url + "/health").text)["status"] == "ok"
