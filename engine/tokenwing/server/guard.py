"""Who may call the server (docs/api.md, "Who may call the server"): an ASGI middleware in front of the app.

A server on 127.0.0.1 is reachable from every web page the user's browser opens. Three kinds of request need no
cooperation from the server and would otherwise run the model for a stranger (the class of Ollama's
CVE-2024-28224):

* a DNS-rebinding page: evil.example's name turns into 127.0.0.1, so the page's calls to "its own" origin reach
  this server; the browser sees nothing cross-site, and only the `Host` header still names evil.example;
* a cross-site request with the page's `Origin`, which a browser sends on every POST;
* a "simple" POST (`text/plain`, a form) that a browser sends with no CORS preflight at all.

So: the `Host` must be this server's own (localhost, a loopback address, the address it was bound to or the one
the connection came in on) or a name the user allowed; a request with an `Origin` must come from an origin the
user allowed or from the server's own; a POST must be JSON. CORS headers are sent only to allowed origins.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Callable, Iterable
from typing import Any

from starlette.datastructures import Headers, MutableHeaders
from starlette.responses import JSONResponse, Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from tokenwing.errors import BadInputError
from tokenwing.server import messages

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address

_NAME = re.compile(r"[a-z0-9_-]+(\.[a-z0-9_-]+)*")  # a DNS name, as a browser writes it (IDNs in punycode)
_ORIGIN = re.compile(r"([a-z][a-z0-9+.-]*)://([^/?#@\s]+)/?")  # scheme://host[:port], a trailing slash at most
_TOKENS = re.compile(r"[!#$%&'*+.^_`|~0-9a-z-]+(\s*,\s*[!#$%&'*+.^_`|~0-9a-z-]+)*")  # a list of header names
_DEFAULT_PORTS = {"http": ":80", "https": ":443"}
_BODY_METHODS = frozenset({"POST", "PUT", "PATCH"})
PREFLIGHT_MAX_AGE = 600  # seconds a browser may keep a preflight's answer
_LOGGED_LIMIT = 64  # distinct refused names logged, then quiet (a page can make up names without end)


def _ip(text: str) -> IPAddress | None:
    """`text` as an IP address (IPv4-mapped IPv6 as the IPv4 it maps, a zone dropped), or None for a name."""
    try:
        ip = ipaddress.ip_address(text.partition("%")[0])
    except ValueError:
        return None
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return ip.ipv4_mapped
    return ip


def host_name(authority: str) -> str | None:
    """The host of a `Host` header (`name`, `name:port`, `1.2.3.4:port`, `[v6]:port`): lower case, without the port
    or a final dot; None when it is no host at all."""
    v = authority.strip().lower()
    if v.startswith("["):
        end = v.find("]")
        rest = v[end + 1 :]
        if end < 0 or (rest and not (rest[0] == ":" and rest[1:].isdigit())):
            return None
        inner = v[1:end]
        return inner if isinstance(_ip(inner), ipaddress.IPv6Address) else None
    name, sep, port = v.rpartition(":")
    if not sep:
        name = v
    elif port and not port.isdigit():
        return None
    if name.endswith("."):
        name = name[:-1]
    return name if _NAME.fullmatch(name) else None


def origin_key(value: str) -> str | None:
    """An `Origin` as compared: `null`, or scheme://host[:port] in lower case without a default port or a final
    slash; None when it is no origin."""
    v = value.strip().lower()
    if v == "null":
        return v
    m = _ORIGIN.fullmatch(v)
    if m is None or host_name(m.group(2)) is None:
        return None
    scheme, authority = m.groups()
    default = _DEFAULT_PORTS.get(scheme)
    if default and authority.endswith(default):
        authority = authority[: -len(default)]
    return f"{scheme}://{authority}"


def _error(status: int, kind: str, code: str, message: str) -> Response:
    body = {"error": {"message": message, "type": kind, "param": None, "code": code}}
    return JSONResponse(body, status_code=status)  # compact: one line


class Access:
    """Who may call, from the flags: `bound_host` is `--host`; `allowed_hosts` (`--allowed-host`) are more names or
    addresses the server answers to, `*` for any; `cors_origins` (`--cors-origin`) are the web origins whose pages
    may call it, `*` for any. Bad settings raise BadInputError naming the flag (before anything binds or loads)."""

    def __init__(self, bound_host: str, allowed_hosts: Iterable[str] = (), cors_origins: Iterable[str] = ()) -> None:
        self.any_host = False
        self.names: set[str] = {"localhost"}
        self.ips: set[IPAddress] = set()
        for value, flag in [(bound_host, "--host"), *((h, "--allowed-host") for h in allowed_hosts)]:
            if value.strip() == "*" and flag == "--allowed-host":
                self.any_host = True
                continue
            ip = _ip(value.strip().strip("[]"))  # an IPv6 address may come with or without brackets
            if ip is not None:
                self.ips.add(ip)
                continue
            name = host_name(value)
            if name is None or ":" in value:  # a name, not a URL or a name with a port
                raise BadInputError(f"{flag} {value!r} is not a host name or an IP address (e.g. box.lan)")
            self.names.add(name)
        self.any_origin = False
        self.origins: set[str] = set()
        for value in cors_origins:
            if value.strip() == "*":
                self.any_origin = True
                continue
            key = origin_key(value)
            if key is None:
                raise BadInputError(
                    f"--cors-origin {value!r} is not a web origin (scheme://host[:port], e.g. http://localhost:3000)"
                )
            self.origins.add(key)

    def notes(self, keyed: bool) -> list[str]:
        """Lines for the log at start: what these settings open."""
        out = []
        if self.any_host:
            out.append(
                "--allowed-host *: any Host name is served, so a web page can reach this server by DNS rebinding"
            )
        if self.any_origin and not keyed:
            out.append("--cors-origin * without TOKENWING_API_KEY: any web page this machine opens can use the server")
        return out

    def host_allowed(self, name: str, local: str | None) -> bool:
        """An IP address cannot be rebound, so any of this machine's (the bound one, the one the connection came in
        on, loopback) is its own; a name must be localhost or allowed."""
        if self.any_host or name in self.names:
            return True
        ip = _ip(name)
        if ip is None:
            return False
        return ip.is_loopback or ip in self.ips or (local is not None and ip == _ip(local))

    def origin_listed(self, key: str) -> bool:
        return self.any_origin or key in self.origins


class Guard:
    """The middleware: refuses what `access` does not allow before `app` sees it, answers allowed origins'
    preflights and adds their CORS headers; refusals are logged once per name (`log`)."""

    def __init__(self, app: ASGIApp, access: Access, log: Callable[[str], None] | None = None) -> None:
        self.app, self.access, self.log = app, access, log
        self._logged: set[str] = set()

    def _refuse_log(self, key: str, line: str) -> None:
        if self.log is not None and key not in self._logged and len(self._logged) < _LOGGED_LIMIT:
            self._logged.add(key)
            self.log(line)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        refusal, cors = self._check(scope, headers)
        if cors is not None:
            send = _with_cors(send, cors)
        if refusal is not None:
            if messages.routed(str(scope.get("path", ""))):  # (Anthropic's clients read their API's error format)
                refusal = messages.as_anthropic(refusal)
            await refusal(scope, receive, send)
            return
        await self.app(scope, receive, send)

    def _check(self, scope: Scope, headers: Headers) -> tuple[Response | None, str | None]:
        """(the refusal or preflight answer, if any; the origin to send CORS headers to, if any)."""
        hosts = headers.getlist("host")
        if len(hosts) > 1:
            return _error(400, "invalid_request_error", "bad_host", "more than one Host header"), None
        server: Any = scope.get("server")
        local = str(server[0]) if server else None
        if hosts:  # an HTTP/1.0 request may have none, and no browser sends such a request
            name = host_name(hosts[0])
            if name is None or not self.access.host_allowed(name, local):
                shown = name or hosts[0][:100]
                self._refuse_log(f"host {shown}", f"refused a request for Host {shown!r} (see --allowed-host)")
                hint = f"; start it with --allowed-host {name} to allow that name" if name else ""
                msg = f"this server does not answer to the host name {shown!r}: only localhost and its own addresses"
                return _error(403, "permission_error", "host_not_allowed", msg + hint), None

        origins = headers.getlist("origin")
        cors: str | None = None
        if origins:
            origin = origins[0]
            key = origin_key(origin)
            listed = len(origins) == 1 and key is not None and self.access.origin_listed(key)
            own = bool(hosts) and key is not None and key == origin_key(f"{scope.get('scheme', 'http')}://{hosts[0]}")
            if not (listed or own):
                shown = origin[:100]
                self._refuse_log(f"origin {shown}", f"refused a request from web origin {shown!r} (see --cors-origin)")
                msg = (
                    f"requests from web pages at {shown!r} are not allowed; "
                    f"start the server with --cors-origin {key or shown} to allow them"
                )
                return _error(403, "permission_error", "origin_not_allowed", msg), None
            if listed:
                cors = origin.strip()
            if scope["method"] == "OPTIONS" and "access-control-request-method" in headers:
                if cors is None:  # no page needs a preflight for its own server: no CORS was allowed
                    msg = f"cross-origin requests from {origin[:100]!r} are not allowed; see --cors-origin"
                    return _error(403, "permission_error", "origin_not_allowed", msg), None
                return _preflight(headers), cors

        if scope["method"] in _BODY_METHODS:
            ctypes = headers.getlist("content-type")
            media = ctypes[0].partition(";")[0].strip().lower() if len(ctypes) == 1 else ""
            if media != "application/json":
                got = ", ".join(ctypes)[:100] or "none"
                msg = f"this endpoint takes JSON: send Content-Type: application/json (got {got})"
                return _error(415, "invalid_request_error", "unsupported_media_type", msg), cors
        return None, cors


def _preflight(headers: Headers) -> Response:
    """The answer to an allowed origin's preflight (the origin itself is added with the other CORS headers)."""
    out = {
        "Access-Control-Allow-Methods": "GET, POST, OPTIONS",
        "Access-Control-Max-Age": str(PREFLIGHT_MAX_AGE),
        "Vary": "Access-Control-Request-Method, Access-Control-Request-Headers",
    }
    # Any header the page asks for (the openai JS client sends its own x-stainless-* headers): the origin is
    # trusted, and the key, if any, is still checked on the request itself.
    asked = headers.get("access-control-request-headers", "").strip().lower()
    if asked and _TOKENS.fullmatch(asked):
        out["Access-Control-Allow-Headers"] = asked
    # Chrome's Private Network Access: a public page calling a local server asks for this too.
    if headers.get("access-control-request-private-network", "").lower() == "true":
        out["Access-Control-Allow-Private-Network"] = "true"
    return Response(status_code=204, headers=out)


def _with_cors(send: Send, origin: str) -> Send:
    """`send` with the allowed origin's CORS headers on the response (refusals included, so the page can read why)."""

    async def wrapped(message: Message) -> None:
        if message["type"] == "http.response.start":
            h = MutableHeaders(scope=message)
            h["Access-Control-Allow-Origin"] = origin
            h.add_vary_header("Origin")
        await send(message)

    return wrapped
