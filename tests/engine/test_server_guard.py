"""`tokenwing serve` answers only the user's own programs (docs/api.md, "Who may call the server"): the requests
a web page in the user's browser can send to it — a `text/plain` POST (no CORS preflight), a cross-site `Origin`,
a DNS-rebinding `Host` — are refused before the model runs, as raw bytes on a socket exactly as a browser sends
them; clients (the official `openai` client, the app's own) still work, and origins the user allowed get CORS."""

from __future__ import annotations

import asyncio
import ipaddress
import json
import socket
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import psutil
import pytest

from runmyai.engine.client import ChatClient, ChatError, ChatSettings
from runmyai.engine.endpoint import Endpoint
from tests.conftest import ModelFactory, assert_clean_error, run_cli
from tests.engine.test_server import KEY, Server
from tokenwing.server.guard import Access, host_name, origin_key

ALLOWED = "http://app.example:5173"
CHAT = json.dumps({"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 4, "temperature": 0}).encode()


@dataclass
class Reply:
    status: int
    headers: list[tuple[str, str]]  # names lower-cased, in order
    body: bytes

    def header(self, name: str) -> str | None:
        return next((v for k, v in self.headers if k == name), None)

    def cors(self) -> list[str]:
        return [k for k, _ in self.headers if k.startswith("access-control-")]

    def error(self) -> dict[str, object]:
        """The refusal: one line of JSON, an OpenAI-style error."""
        assert self.body.count(b"\n") == 0, self.body
        err = json.loads(self.body)["error"]
        assert isinstance(err, dict) and isinstance(err["message"], str)
        return err


def raw(
    port: int,
    method: str,
    path: str,
    headers: dict[str, str] | list[tuple[str, str]],
    body: bytes = b"",
    address: str = "127.0.0.1",
    version: str = "HTTP/1.1",
) -> Reply:
    """One request as these bytes and no others (no client library adds or fixes a header)."""
    pairs = list(headers.items()) if isinstance(headers, dict) else headers
    lines = [f"{method} {path} {version}", *(f"{k}: {v}" for k, v in pairs)]
    if body or method == "POST":
        lines.append(f"Content-Length: {len(body)}")
    lines.append("Connection: close")
    with socket.create_connection((address, port), timeout=120) as s:
        s.sendall(("\r\n".join(lines) + "\r\n\r\n").encode() + body)
        got = b""
        while chunk := s.recv(65536):
            got += chunk
    head, _, rest = got.partition(b"\r\n\r\n")
    status_line, *header_lines = head.decode("latin-1").split("\r\n")
    got_headers = [(k.strip().lower(), v.strip()) for k, _, v in (ln.partition(":") for ln in header_lines)]
    if ("transfer-encoding", "chunked") in got_headers:
        out = b""
        while True:
            size, _, rest = rest.partition(b"\r\n")
            n = int(size, 16)
            if n == 0:
                break
            out, rest = out + rest[:n], rest[n + 2 :]
        rest = out
    return Reply(int(status_line.split()[1]), got_headers, rest)


def requests_served(server: Server) -> int:
    r = httpx.get(server.url + "/v1/tokenwing/stats", headers={"Authorization": f"Bearer {KEY}"})
    return int(r.json()["totals"]["requests"])


@pytest.fixture(scope="module")
def model(repacked_factory: ModelFactory) -> Path:
    return repacked_factory(type="Q8_0", n_layer=3)


@pytest.fixture(scope="module")
def plain(model: Path) -> Iterator[Server]:
    """The default server with no key: the worst case, every refusal below is the guard's."""
    s = Server(model, "--no-usage-table", key=None)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def opened(model: Path) -> Iterator[Server]:
    """Bound to every address, with a key, one allowed origin and one allowed host name."""
    s = Server(
        model, "--no-usage-table", "--host", "0.0.0.0", "--cors-origin", ALLOWED, "--allowed-host", "box.lan", key=KEY
    )
    yield s
    s.stop()


def port(server: Server) -> int:
    return int(server.handshake["port"])


# ------------------------------------------------------------------------------------------------- the attacks
def test_a_simple_cross_site_post_is_refused(plain: Server) -> None:
    """A page can POST `text/plain` (or a form) to 127.0.0.1 with no preflight; some browsers and privacy settings
    send no Origin. The JSON endpoints take JSON only."""
    p = port(plain)
    before = requests_served(plain)
    for ctype in ("text/plain;charset=UTF-8", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x"):
        for path in ("/v1/chat/completions", "/v1/completions"):
            r = raw(p, "POST", path, {"Host": f"127.0.0.1:{p}", "Content-Type": ctype}, CHAT)
            assert r.status == 415, (ctype, path, r.body)
            assert "application/json" in str(r.error()["message"])
    r = raw(p, "POST", "/v1/chat/completions", {"Host": f"127.0.0.1:{p}"}, CHAT)  # a Blob body: no type at all
    assert r.status == 415
    assert requests_served(plain) == before  # the model never ran


def test_a_cross_site_origin_is_refused(plain: Server) -> None:
    p = port(plain)
    before = requests_served(plain)
    host = {"Host": f"127.0.0.1:{p}"}
    for origin in ("http://evil.example", "https://evil.example", "null", f"http://localhost:{p + 1}"):
        for ctype in ("text/plain;charset=UTF-8", "application/json"):
            r = raw(p, "POST", "/v1/chat/completions", {**host, "Origin": origin, "Content-Type": ctype}, CHAT)
            assert r.status == 403, (origin, ctype, r.body)
            assert r.error()["code"] == "origin_not_allowed" and "--cors-origin" in str(r.error()["message"])
            assert r.cors() == []
        for path in ("/v1/models", "/v1/tokenwing/stats", "/health", "/metrics"):
            assert raw(p, "GET", path, {**host, "Origin": origin}).status == 403
    assert requests_served(plain) == before


def test_a_dns_rebinding_host_is_refused(plain: Server) -> None:
    """evil.example's page, its name now resolving to 127.0.0.1, calls "its own" server: the request is
    same-origin to the browser (no CORS, no Origin on a GET) and only the Host names the attacker."""
    p = port(plain)
    before = requests_served(plain)
    for name in ("evil.example", "localhost.evil.example", "127.0.0.1.nip.io", "evil.example."):
        host = {"Host": f"{name}:{p}"}
        for path in ("/v1/models", "/v1/tokenwing/stats", "/health"):
            r = raw(p, "GET", path, host)
            assert r.status == 403, (name, path, r.body)
            assert r.error()["code"] == "host_not_allowed" and "--allowed-host" in str(r.error()["message"])
        json_post = {**host, "Content-Type": "application/json"}
        assert raw(p, "POST", "/v1/chat/completions", json_post, CHAT).status == 403
        browser_post = {**host, "Origin": f"http://{name}:{p}", "Content-Type": "text/plain;charset=UTF-8"}
        assert raw(p, "POST", "/v1/chat/completions", browser_post, CHAT).status == 403
    two = [("Host", f"127.0.0.1:{p}"), ("Host", f"evil.example:{p}")]  # whichever one a server reads
    assert raw(p, "GET", "/v1/models", two).status in (400, 403)
    assert requests_served(plain) == before


# ----------------------------------------------------------------------------------------- what still works
def test_local_names_and_addresses_are_served(plain: Server) -> None:
    p = port(plain)
    for host in (f"127.0.0.1:{p}", f"localhost:{p}", "localhost", f"LocalHost.:{p}", "127.0.0.1"):
        r = raw(p, "GET", "/v1/models", {"Host": host})
        assert r.status == 200, (host, r.body)
        assert r.cors() == []  # no CORS headers unless an origin is allowed
    assert raw(p, "GET", "/v1/models", {}, version="HTTP/1.0").status == 200  # no Host: no browser sent it
    # the server's own origin is no other site (a page it served, were there one)
    same = {"Host": f"127.0.0.1:{p}", "Origin": f"http://127.0.0.1:{p}", "Content-Type": "application/json"}
    r = raw(p, "POST", "/v1/chat/completions", same, CHAT)
    assert r.status == 200 and json.loads(r.body)["choices"][0]["message"]["role"] == "assistant"
    assert r.cors() == []
    typed = {"Host": f"localhost:{p}", "Content-Type": "Application/JSON; charset=utf-8"}
    assert raw(p, "POST", "/v1/completions", typed, b'{"prompt": "Hi", "max_tokens": 2}').status == 200


def test_no_cors_by_default(plain: Server) -> None:
    """A browser's preflight for a JSON POST from any site is refused, with no CORS headers."""
    p = port(plain)
    pre = {
        "Host": f"127.0.0.1:{p}",
        "Origin": ALLOWED,
        "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "content-type",
    }
    r = raw(p, "OPTIONS", "/v1/chat/completions", pre)
    assert r.status == 403 and r.cors() == []


def test_the_openai_client_and_the_apps_client_work(plain: Server) -> None:
    c = plain.client(key="unused")  # no key on this server: the client's header is ignored
    r = c.chat.completions.create(model="x", messages=[{"role": "user", "content": "Hi"}], max_tokens=4)
    assert r.choices[0].message.role == "assistant"
    streamed = c.completions.create(model="x", prompt="Once", max_tokens=4, temperature=0, stream=True)
    assert [ch.choices[0].finish_reason for ch in streamed if ch.choices][-1] in ("length", "stop")

    async def app() -> None:
        client = ChatClient(Endpoint(plain.url + "/v1", None, "test"))
        try:
            assert len(await client.models()) == 1
            deltas = [d async for d in client.stream_chat([{"role": "user", "content": "Hi"}], ChatSettings())]
            assert [d.finish_reason for d in deltas if d.finish_reason] in (["length"], ["stop"])
        finally:
            await client.aclose()

    asyncio.run(app())


# ------------------------------------------------------------------------------------------- what the user allows
def test_an_allowed_origin_gets_cors_and_its_preflight(opened: Server) -> None:
    p = port(opened)
    host = {"Host": f"127.0.0.1:{p}"}
    asked = "authorization, content-type, x-stainless-os"  # the openai JS client's own headers among them
    pre = {**host, "Origin": ALLOWED, "Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": asked}
    r = raw(p, "OPTIONS", "/v1/chat/completions", pre)
    assert r.status == 204, r.body
    assert r.header("access-control-allow-origin") == ALLOWED
    assert "POST" in (r.header("access-control-allow-methods") or "")
    assert {h.strip() for h in (r.header("access-control-allow-headers") or "").split(",")} >= {
        "authorization",
        "content-type",
        "x-stainless-os",
    }
    assert int(r.header("access-control-max-age") or 0) > 0 and "origin" in (r.header("vary") or "").lower()
    assert r.header("access-control-allow-credentials") is None  # no cookies here: the key is a header
    # Chrome's private-network preflight (a public page calling a local server)
    pna = raw(p, "OPTIONS", "/v1/models", {**pre, "Access-Control-Request-Private-Network": "true"})
    assert pna.status == 204 and pna.header("access-control-allow-private-network") == "true"
    # the request itself
    auth = {"Authorization": f"Bearer {KEY}"}
    post = {**host, **auth, "Origin": ALLOWED, "Content-Type": "application/json"}
    r = raw(p, "POST", "/v1/chat/completions", post, CHAT)
    assert r.status == 200 and json.loads(r.body)["object"] == "chat.completion"
    assert r.header("access-control-allow-origin") == ALLOWED and "origin" in (r.header("vary") or "").lower()
    streamed = json.dumps({"prompt": "Hi", "max_tokens": 3, "stream": True}).encode()
    r = raw(p, "POST", "/v1/completions", post, streamed)
    assert r.status == 200 and r.body.endswith(b"data: [DONE]\n\n")
    assert r.header("access-control-allow-origin") == ALLOWED
    # the page can read why it was refused
    r = raw(p, "GET", "/v1/models", {**host, "Origin": ALLOWED})
    assert r.status == 401 and r.header("access-control-allow-origin") == ALLOWED
    r = raw(p, "POST", "/v1/completions", {**post, "Content-Type": "text/plain"}, streamed)
    assert r.status == 415 and r.header("access-control-allow-origin") == ALLOWED
    # other sites still are not
    for origin in ("http://evil.example", "http://app.example", "https://app.example:5173"):
        r = raw(p, "OPTIONS", "/v1/chat/completions", {**pre, "Origin": origin})
        assert r.status == 403 and r.cors() == [], origin
        assert raw(p, "POST", "/v1/chat/completions", {**post, "Origin": origin}, CHAT).status == 403


def _real_address() -> str | None:
    """One of this machine's own non-loopback IPv4 addresses."""
    for addrs in psutil.net_if_addrs().values():
        for a in addrs:
            if a.family == socket.AF_INET and not ipaddress.ip_address(a.address).is_loopback:
                return str(a.address)
    return None


def test_bound_to_every_address_the_machines_addresses_are_served(opened: Server) -> None:
    p = port(opened)
    auth = {"Authorization": f"Bearer {KEY}"}
    for host in (f"127.0.0.1:{p}", f"localhost:{p}", f"0.0.0.0:{p}", f"box.lan:{p}", "BOX.LAN."):
        assert raw(p, "GET", "/v1/models", {"Host": host, **auth}).status == 200, host
    for host in (f"other.lan:{p}", f"evil.example:{p}", f"192.0.2.123:{p}"):  # an address that is not this one's
        assert raw(p, "GET", "/v1/models", {"Host": host, **auth}).status == 403, host
    ip = _real_address()
    if ip is None:
        pytest.skip("this machine has no non-loopback IPv4 address")
    r = raw(p, "GET", "/v1/models", {"Host": f"{ip}:{p}", **auth}, address=ip)  # a LAN client, by address
    assert r.status == 200, r.body
    c = httpx.get(f"http://{ip}:{p}/v1/models", headers=auth)
    assert c.status_code == 200


def test_the_api_key(opened: Server) -> None:
    p = port(opened)
    host = {"Host": f"127.0.0.1:{p}"}
    assert raw(p, "GET", "/health", host).status == 200  # a supervisor's probe needs no key
    assert raw(p, "GET", "/v1/models", host).status == 401
    assert raw(p, "GET", "/v1/models", {**host, "Authorization": "Bearer wrong"}).status == 401
    assert raw(p, "GET", "/v1/models", {**host, "Authorization": f"Bearer {KEY}"}).status == 200
    r = opened.client().chat.completions.create(model="x", messages=[{"role": "user", "content": "Hi"}], max_tokens=3)
    assert r.choices[0].message.role == "assistant"


def test_bad_settings_are_one_line_errors(model: Path) -> None:
    for args in (
        ("--cors-origin", "http://app.example/path"),
        ("--cors-origin", "app.example"),
        ("--cors-origin", "http://app.example:port"),
        ("--allowed-host", "http://box.lan"),
        ("--allowed-host", "box lan"),
        ("--allowed-host", "box.lan:8080"),
    ):
        r = run_cli("serve", str(model), "--ctx", "512", *args, timeout=120)
        assert_clean_error(r, 2)
        assert args[0] in r.stderr


def test_host_and_origin_parsing() -> None:
    """The parts real requests above do not reach: IPv6 and IPv4-mapped addresses, odd Host values."""
    assert host_name("[::1]:8080") == "::1" and host_name("[::1]") == "::1"
    assert host_name("Box.Lan.:80") == "box.lan" and host_name("box.lan:") == "box.lan"
    for bad in ("::1", "[::1", "[::1]x", "[box.lan]", "box.lan:x", "a b", "", "evil.example/x", "u@box.lan"):
        assert host_name(bad) is None, bad
    assert origin_key("HTTP://App.Example:80/") == "http://app.example"
    assert origin_key("https://app.example:443") == "https://app.example"
    assert origin_key("tauri://localhost") == "tauri://localhost" and origin_key("null") == "null"
    for bad in ("app.example", "http://", "http://a.example/x", "http://u@a.example", "http://a.example:x"):
        assert origin_key(bad) is None, bad
    dual = Access("::")
    assert dual.host_allowed("::1", None) and dual.host_allowed("::", None)
    assert dual.host_allowed("192.0.2.2", "::ffff:192.0.2.2")  # an IPv4 client of a dual-stack socket
    assert not dual.host_allowed("192.0.2.3", "::ffff:192.0.2.2") and not dual.host_allowed("box.lan", None)
    lan = Access("127.0.0.1", ["[fe80::1]", "192.168.1.5", "Box.Lan"])
    assert (
        lan.host_allowed("fe80::1", None)
        and lan.host_allowed("192.168.1.5", None)
        and lan.host_allowed("box.lan", None)
    )
    assert Access("127.0.0.1", ["*"]).host_allowed("anything.example", None)
    assert Access("127.0.0.1", [], ["*"]).origin_listed("http://any.example")
    assert not Access("127.0.0.1", [], [ALLOWED]).origin_listed("http://app.example")


def test_the_app_says_why_a_name_was_refused(plain: Server) -> None:
    """File → Connect to a TokenWing server by a name it was not told about: the app says so, not "the key"."""
    name = socket.gethostname().lower()
    try:
        ip = ipaddress.ip_address(socket.gethostbyname(name))
    except OSError:
        pytest.skip(f"this machine's name {name!r} does not resolve")
    if not ip.is_loopback:
        pytest.skip(f"this machine's name {name!r} is not a loopback address here")

    async def app() -> str:
        client = ChatClient(Endpoint.remote(f"http://{name}:{port(plain)}"))
        try:
            with pytest.raises(ChatError) as e:
                await client.models()
            return str(e.value)
        finally:
            await client.aclose()

    said = asyncio.run(app())
    assert said.startswith("The server refused the request") and f"--allowed-host {name}" in said, said
