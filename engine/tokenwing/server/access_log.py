"""One log line per API request (the app's Server page lists them): when, method and route, status, tokens and
duration, as `request {json}` on the engine's log (stderr). No key, no message text: what a request log shows.

The tokens come from the response itself, as it goes out: a JSON body's `usage`, or a stream's last chunk (its
`tokenwing.usage`, or the `usage` chunk a client asked for). The line is written once the response has ended (a
client that disconnects mid-stream gets its line too, with the status sent).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

PREFIX = "request "
_QUIET = ("/health", "/metrics", "/v1/tokenwing/stats")  # polled by the app itself: not the user's requests
_BODY_KEEP = 1 << 20  # a JSON body's bytes read for its usage (a reply this long still has it in the tail)
_EVENT_KEEP = 64 << 10  # the last stream event's bytes kept


class AccessLog:
    def __init__(self, app: ASGIApp, log: Callable[[str], None]) -> None:
        self.app, self.log = app, log

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = str(scope.get("path", ""))
        if scope["type"] != "http" or path.startswith(_QUIET) or not path.startswith("/v1/"):
            await self.app(scope, receive, send)
            return
        started, wall = time.perf_counter(), time.time()
        seen = _Response()

        async def watch(message: Message) -> None:
            seen.take(message)
            await send(message)

        try:
            await self.app(scope, receive, watch)
        finally:
            entry: dict[str, Any] = {
                "time": round(wall, 3),
                "method": scope.get("method", ""),
                "path": path,
                "status": seen.status,
                "ms": round((time.perf_counter() - started) * 1000, 1),
            }
            entry.update(seen.usage())
            self.log(PREFIX + json.dumps(entry, separators=(",", ":")))


class _Response:
    def __init__(self) -> None:
        self.status: int | None = None
        self.stream = False
        self.body = b""
        self.last_event = b""  # a stream's last event that carried usage

    def take(self, message: Message) -> None:
        if message["type"] == "http.response.start":
            self.status = int(message["status"])
            for k, v in message.get("headers", []):
                if k.lower() == b"content-type":
                    self.stream = v.split(b";")[0].strip().lower() == b"text/event-stream"
        elif message["type"] == "http.response.body":
            chunk = bytes(message.get("body", b""))
            if not self.stream:
                self.body = (self.body + chunk)[-_BODY_KEEP:]
                return
            for event in chunk.split(b"\n\n"):  # (the server sends whole events per body message)
                if b'"usage"' in event and len(event) <= _EVENT_KEEP:
                    self.last_event = event

    def usage(self) -> dict[str, int]:
        text = self.last_event.strip().removeprefix(b"data:") if self.stream else self.body
        try:
            data = json.loads(text)
        except (ValueError, UnicodeDecodeError):
            return {}
        if not isinstance(data, dict):
            return {}
        usage = data.get("usage")
        if not isinstance(usage, dict) and isinstance(data.get("tokenwing"), dict):
            usage = data["tokenwing"].get("usage")
        if not isinstance(usage, dict):
            return {}
        out = {k: usage[k] for k in ("prompt_tokens", "completion_tokens") if isinstance(usage.get(k), int)}
        return out
