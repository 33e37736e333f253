"""The prompt cache on disk as the app sees it (issue 44, item 4; docs/api.md "The prompt cache on disk"): what it
holds (`GET /v1/tokenwing/prompt-cache`), forgetting one conversation's snapshots by the `prompt_cache_key` its
requests carried (`POST …/forget`), clearing it (`POST …/clear`), and the reply's restore in a stream's last chunk.

Each waits for the writes already queued (a reply that just ended is still being written: deleted first, its file
would come back; counted first, it would be missing), beside the event loop; the engine thread is never held.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import Awaitable, Callable
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from tokenwing.runtime.snapshot import SUFFIX
from tokenwing.server import prompt_cache_keys
from tokenwing.server.prompt_disk_cache import DiskPromptCache
from tokenwing.server.protocol import RequestError, prompt_cache_key
from tokenwing.server.worker import EngineWorker

# a reply's statistics that say its prompt's start was read from the disk (worker.py `_end`)
RESTORE_FIELDS = ("prompt_restored_tokens", "prompt_restore_ms", "prompt_restore_bytes")


def restored(stats: dict[str, Any]) -> dict[str, Any]:
    """The restore's fields of a reply's statistics, with the prompt's tokens it gave (`prompt_cached_tokens`),
    for a stream's last chunk; none where nothing was restored."""
    if "prompt_restored_tokens" not in stats:
        return {}
    return {k: stats[k] for k in (*RESTORE_FIELDS, "prompt_cached_tokens") if k in stats}


def usage(cache: DiskPromptCache | None) -> dict[str, Any]:
    """The folder's snapshots (every model's: what the drive holds) against the cache's size, once the writes
    queued have ended (a reply that just ended counts)."""
    if cache is None:
        return {"enabled": False, "folder": None, "size": 0, "used": 0, "count": 0}
    cache.settle()
    used = count = 0
    with contextlib.suppress(OSError), os.scandir(cache.folder) as it:
        for e in it:
            if e.name.endswith(SUFFIX) and e.is_file():
                with contextlib.suppress(OSError):
                    used += e.stat().st_size
                    count += 1
    return {"enabled": True, "folder": cache.folder, "size": cache.size, "used": used, "count": count}


def delete(cache: DiskPromptCache, names: set[str] | None) -> dict[str, int]:
    """Deletes these snapshots (None: every one in the folder), once the writes queued have ended."""
    cache.settle()
    if names is None:
        with contextlib.suppress(OSError):
            names = {n for n in os.listdir(cache.folder) if n.endswith(SUFFIX)}
        prompt_cache_keys.forget_all(cache.folder)
    deleted = nbytes = 0
    for name in names or ():
        if os.path.basename(name) != name or not name.endswith(SUFFIX):
            continue  # (a key's list names files of this folder only)
        path = os.path.join(cache.folder, name)
        with cache.lock:
            cache.entries.pop(name, None)
        with contextlib.suppress(OSError):
            size = os.stat(path).st_size
            os.unlink(path)
            deleted, nbytes = deleted + 1, nbytes + size
    return {"deleted": deleted, "bytes": nbytes}


def routes(
    worker: EngineWorker,
    guarded: Callable[[Callable[[Request], Awaitable[Response]]], Callable[[Request], Awaitable[Response]]],
    read_json: Callable[[Request], Awaitable[Any]],
) -> list[Route]:
    async def show(request: Request) -> Response:
        return JSONResponse(await asyncio.to_thread(usage, worker.disk))

    async def forget(request: Request) -> Response:
        body = await read_json(request)
        if not isinstance(body, dict):
            raise RequestError("the request body must be a JSON object")
        key = prompt_cache_key(body)
        if key is None:
            raise RequestError("'prompt_cache_key' is required: the key whose snapshots to delete", "prompt_cache_key")
        cache = worker.disk
        if cache is None:
            return JSONResponse({"deleted": 0, "bytes": 0})
        names = await asyncio.to_thread(prompt_cache_keys.forget, cache.folder, key)
        return JSONResponse(await asyncio.to_thread(delete, cache, names))

    async def clear(request: Request) -> Response:
        body = await read_json(request)
        if not isinstance(body, dict):
            raise RequestError("the request body must be a JSON object")
        cache = worker.disk
        if cache is None:
            return JSONResponse({"deleted": 0, "bytes": 0})
        return JSONResponse(await asyncio.to_thread(delete, cache, None))

    return [
        Route("/v1/tokenwing/prompt-cache", guarded(show)),
        Route("/v1/tokenwing/prompt-cache/forget", guarded(forget), methods=["POST"]),
        Route("/v1/tokenwing/prompt-cache/clear", guarded(clear), methods=["POST"]),
    ]
