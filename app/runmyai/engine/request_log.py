"""The Server page's request log (Qt-free): the engine writes one `request {json}` line per API request to its log
(tokenwing/server/access_log.py), the supervisor hands every log line to the app, and this keeps the recent ones.

Also the addresses other devices reach the server at when it serves the local network.
"""

from __future__ import annotations

import datetime
import json
import socket
from collections import deque
from dataclasses import dataclass

PREFIX = "request "
KEEP = 200  # requests listed (the engine's log file keeps every one)
# the app's own bookkeeping, not a client's request: the composer's token count, and the Settings line's look at the
# prompt cache on disk (asked at each engine start: it pushed a chat out of the page's newest rows)
UNLISTED = frozenset({"/v1/chat/count", "/v1/tokenwing/prompt-cache"})


@dataclass(frozen=True)
class RequestEntry:
    time: float  # when it came (epoch seconds)
    method: str
    path: str
    status: int | None  # None: the engine ended before answering
    ms: float
    prompt_tokens: int | None = None
    completion_tokens: int | None = None

    def row(self) -> tuple[str, str, str, str, str]:
        """(time, route, status, tokens, duration) as the table shows them."""
        when = datetime.datetime.fromtimestamp(self.time).strftime("%H:%M:%S")
        route = f"{self.method} {self.path}"
        status = str(self.status) if self.status is not None else "—"
        if self.prompt_tokens is None and self.completion_tokens is None:
            tokens = "—"
        else:
            tokens = f"{self.prompt_tokens or 0:,} in · {self.completion_tokens or 0:,} out"
        took = f"{self.ms:,.0f} ms" if self.ms < 10_000 else f"{self.ms / 1000:,.1f} s"
        return when, route, status, tokens, took


def parse_line(line: str) -> RequestEntry | None:
    """A request line of the engine's log (as the supervisor passes it on: possibly after "tokenwing: "); None for
    any other line, or one that does not read as a request."""
    text = line.strip().removeprefix("tokenwing: ")
    if not text.startswith(PREFIX):
        return None
    try:
        data = json.loads(text[len(PREFIX) :])
    except ValueError:
        return None
    if not isinstance(data, dict) or not isinstance(data.get("path"), str):
        return None

    def num(key: str) -> float | None:
        v = data.get(key)
        return float(v) if isinstance(v, int | float) and not isinstance(v, bool) else None

    def count(key: str) -> int | None:
        v = data.get(key)
        return v if isinstance(v, int) and not isinstance(v, bool) and v >= 0 else None

    return RequestEntry(
        time=num("time") or 0.0,
        method=str(data.get("method") or ""),
        path=data["path"],
        status=count("status"),
        ms=num("ms") or 0.0,
        prompt_tokens=count("prompt_tokens"),
        completion_tokens=count("completion_tokens"),
    )


class RequestLog:
    """The recent requests, newest first."""

    def __init__(self, keep: int = KEEP) -> None:
        self._entries: deque[RequestEntry] = deque(maxlen=keep)

    def add_line(self, line: str) -> RequestEntry | None:
        """The line's request, listed; None for another line. A token count is read but not listed: the chat asks
        one at every pause in typing, and they would push the requests the user looks for out of the list."""
        entry = parse_line(line)
        if entry is not None and entry.path not in UNLISTED:
            self._entries.appendleft(entry)
        return entry

    def entries(self) -> list[RequestEntry]:
        return list(self._entries)

    def clear(self) -> None:
        self._entries.clear()


LAN_HOST = "0.0.0.0"  # every IPv4 address of this machine: its network's other devices reach it


def lan_addresses() -> list[str]:
    """This machine's IPv4 addresses other than loopback, as its host name resolves them (no packet is sent)."""
    try:
        infos = socket.getaddrinfo(socket.gethostname(), None, socket.AF_INET)
    except OSError:
        return []
    return sorted({str(i[4][0]) for i in infos if not str(i[4][0]).startswith("127.")})
