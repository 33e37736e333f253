"""The engine's prompt cache on disk as the app uses it (issue 44, item 4; docs/api.md, docs/prompt-cache.md):
each conversation's requests carry its key (`prompt_cache_key`), so that switching back to it, or reopening the
app, reads its context from the disk instead of computing it again; the footer says when that happened; deleting
the conversation deletes its snapshots; Settings shows the cache's size and clears it. Qt-free: the HTTP calls
are coroutines (the controllers run them on the qasync loop, never blocking the UI thread).

A conversation deleted while no local engine runs (or at the app's close, when the loop is gone) is remembered in
`settings/prompt-cache-forget.json` and forgotten by the next engine that starts.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from runmyai.engine.endpoint import Endpoint, http_client
from runmyai.jsonfile import read_json, write_json_atomic
from runmyai.units import human_bytes

ROUTE = "tokenwing/prompt-cache"  # under the API root (`/v1`)
TIMEOUT_S = 30.0  # a forget or clear waits for the engine's queued snapshot writes: seconds at most
PENDING_FILE = "prompt-cache-forget.json"


class PromptCacheError(Exception):
    """The engine could not be asked (not running, gone, or a server without these routes); str() is a sentence."""


def conversation_key(conversation_id: int, created_at: float) -> str:
    """A conversation's `prompt_cache_key`: its id and creation time, so that two stores (two homes on one engine
    cache) never share a key, and the same conversation always has the same one."""
    return f"runmyai-{conversation_id}-{round(created_at * 1e6)}"


def restore_line(restored_tokens: int | None, restore_s: float | None) -> str:
    """The footer's words for a reply whose prompt's start was read from the disk ("" where none was)."""
    if not restored_tokens or restore_s is None:
        return ""
    took = f"{restore_s:.1f}" if restore_s >= 0.1 else f"{restore_s:.2f}" if restore_s >= 0.01 else "<\u00a00.01"
    return f"context restored from disk ({took}\u00a0s)"  # (no-break spaces: a wrapped line keeps "(0.2 s)" whole)


@dataclass(frozen=True)
class CacheUse:
    """`GET /v1/tokenwing/prompt-cache`."""

    enabled: bool
    folder: str | None
    size: int
    used: int
    count: int

    def line(self) -> str:
        """Settings' sentence about it."""
        if not self.enabled:
            return "Off for the model in use (a GPU tier keeps its context on the device)."
        n = f"{self.count} conversation context{'' if self.count == 1 else 's'}"
        return f"{human_bytes(self.used)} of {human_bytes(self.size)} used · {n}"


async def _call(endpoint: Endpoint, method: str, path: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
    async with await http_client(endpoint, httpx.Timeout(TIMEOUT_S)) as client:
        try:
            r = await client.request(method, endpoint.url(path), json=body, headers=endpoint.headers())
        except httpx.TransportError as e:
            raise PromptCacheError(f"The engine could not be reached: {type(e).__name__}.") from None
    if r.status_code != 200:
        raise PromptCacheError(f"The engine answered HTTP {r.status_code} about its prompt cache.")
    try:
        data = r.json()
    except ValueError:
        raise PromptCacheError("The engine's answer about its prompt cache is not JSON.") from None
    if not isinstance(data, dict):
        raise PromptCacheError("The engine's answer about its prompt cache is not an object.")
    return data


async def usage(endpoint: Endpoint) -> CacheUse:
    d = await _call(endpoint, "GET", ROUTE)
    try:
        return CacheUse(bool(d["enabled"]), d.get("folder"), int(d["size"]), int(d["used"]), int(d["count"]))
    except (KeyError, TypeError, ValueError):
        raise PromptCacheError("The engine's answer about its prompt cache is not in the expected format.") from None


async def forget(endpoint: Endpoint, key: str) -> int:
    """Deletes a conversation's snapshots; returns how many went."""
    return int((await _call(endpoint, "POST", f"{ROUTE}/forget", {"prompt_cache_key": key})).get("deleted", 0))


async def clear(endpoint: Endpoint) -> int:
    """Deletes every snapshot; returns how many went."""
    return int((await _call(endpoint, "POST", f"{ROUTE}/clear", {})).get("deleted", 0))


class PendingForgets:
    """The keys of deleted conversations whose snapshots no engine has deleted yet (a JSON list, written
    atomically): added before asking the engine, removed once it answered."""

    def __init__(self, settings_dir: Path) -> None:
        self.path = settings_dir / PENDING_FILE

    def keys(self) -> list[str]:
        data = read_json(self.path)
        keys = data.get("keys") if data is not None else None
        return [k for k in keys if isinstance(k, str)] if isinstance(keys, list) else []

    def add(self, key: str) -> None:
        keys = self.keys()
        if key not in keys:
            write_json_atomic(self.path, {"keys": [*keys, key]})

    def done(self, key: str) -> None:
        keys = self.keys()
        if key in keys:
            write_json_atomic(self.path, {"keys": [k for k in keys if k != key]})

    async def flush(self, endpoint: Endpoint | None) -> int:
        """Asks the engine to forget every key still pending; returns how many it did (the rest stay pending)."""
        done = 0
        if endpoint is None or not endpoint.local:
            return done
        for key in self.keys():
            try:
                await forget(endpoint, key)
            except PromptCacheError:
                return done
            self.done(key)
            done += 1
        return done
