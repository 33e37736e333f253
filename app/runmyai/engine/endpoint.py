"""Where chat requests go: the local engine the app started, or any OpenAI-compatible server."""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import Callable
from dataclasses import dataclass, field
from urllib.parse import urlsplit, urlunsplit

import httpx


@dataclass(frozen=True)
class Endpoint:
    """An OpenAI-compatible API. `base_url` is the API root that `/chat/completions` hangs off, as in the
    official clients: `http://127.0.0.1:PORT/v1` for the local engine, `https://host/v1` for a remote one."""

    base_url: str
    api_key: str | None = field(repr=False)  # never printed: reprs end up in logs
    model: str | None = None
    local: bool = True

    @classmethod
    def remote(cls, base_url: str, api_key: str | None = None, model: str | None = None) -> Endpoint:
        """A user-entered server: `http://localhost:11434` and `http://localhost:11434/v1/` both mean
        `http://localhost:11434/v1` (a URL with no path gets `/v1`). ValueError for anything not http(s)."""
        text = base_url.strip()
        parts = urlsplit(text)
        if parts.scheme not in ("http", "https") or not parts.netloc:
            raise ValueError(f"{base_url!r} is not an http:// or https:// address")
        path = parts.path.rstrip("/") or "/v1"
        url = urlunsplit((parts.scheme, parts.netloc, path, parts.query, ""))
        return cls(url, (api_key or "").strip() or None, (model or "").strip() or None, local=False)

    def url(self, path: str) -> str:
        return self.base_url.rstrip("/") + "/" + path.lstrip("/")

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}


# A fixed endpoint, or a function that gives the current one (the supervisor's `endpoint` changes on restart;
# None while the engine is not ready).
EndpointSource = Endpoint | Callable[[], Endpoint | None]


def resolve(source: EndpointSource) -> Endpoint | None:
    return source if isinstance(source, Endpoint) else source()


def client_kind(endpoint: Endpoint | None) -> tuple[bool, bool]:
    """(use the environment's proxy settings, use TLS) for an endpoint. Loopback addresses never go through a
    proxy (a proxy from the environment cannot reach the user's own machine); None means the local engine."""
    if endpoint is None:
        return False, False
    parts = urlsplit(endpoint.base_url)
    host = (parts.hostname or "").lower()
    loopback = endpoint.local or host in ("localhost", "::1") or host.startswith("127.")
    return not loopback, parts.scheme == "https"


async def http_client(endpoint: Endpoint | None, timeout: httpx.Timeout) -> httpx.AsyncClient:
    """An AsyncClient for this endpoint without blocking the event loop: a default client loads the CA bundle on
    the calling thread (30-60 ms), so for https the TLS context is built on a worker thread, and plain http gets
    none. See client_kind for proxies."""
    trust_env, tls = client_kind(endpoint)
    verify: ssl.SSLContext | bool = await asyncio.to_thread(httpx.create_ssl_context) if tls else False
    return httpx.AsyncClient(timeout=timeout, trust_env=trust_env, verify=verify)
