"""A download's files and state (the base of `downloads.DownloadManager`, see its module docstring): its status and
what is known of it, `<id>.part` and `<id>.json` in the state dir (restored as paused by the next manager), the I/O
thread every file operation goes through, and the status events."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import json
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, TypeVar

import httpx

from runmyai.jsonfile import write_json_atomic
from runmyai.library.hub import (
    HubClient,
    HubError,
    _check_path,
    _check_repo,
    checked_size,
    normalize_sha256,
)

log = logging.getLogger(__name__)

DownloadState = Literal["queued", "downloading", "paused", "verifying", "done", "failed", "cancelled"]
TERMINAL: frozenset[str] = frozenset({"done", "failed", "cancelled"})
STATE_VERSION = 1
EMIT_INTERVAL_S = 0.1  # on_change at most ~10/s per download (state changes always go out at once)
SPEED_WINDOW_S = 5.0

T = TypeVar("T")


@dataclass
class DownloadStatus:
    id: str
    repo: str
    path: str
    state: DownloadState
    done_bytes: int
    total_bytes: int | None
    speed_bps: float
    eta_s: float | None
    message: str
    dest: Path | None
    error_kind: str | None = None  # for "failed": the HubError kind (corrupt, network, no_space, …)


@dataclass
class DownloadItem:
    status: DownloadStatus
    revision: str
    sha256: str | None
    size: int | None
    task: asyncio.Task[None] | None = None
    stop_reason: Literal["pause", "cancel", "close"] | None = None
    terminal: asyncio.Event = dataclasses.field(default_factory=asyncio.Event)
    samples: deque[tuple[float, int]] = dataclasses.field(default_factory=deque)
    last_emit: float = 0.0
    abort_hash: threading.Event = dataclasses.field(default_factory=threading.Event)


def download_id(repo: str, path: str, revision: str) -> str:
    return hashlib.sha256(f"{repo}\n{revision}\n{path}".encode()).hexdigest()[:16]


class DownloadFiles:
    """The state a `DownloadManager` keeps and the file and status steps its parts share (downloads.py builds it)."""

    hub: HubClient
    state_dir: Path
    models_dir: Path
    on_change: Callable[[DownloadStatus], None] | None
    max_retries: int
    retry_backoff_s: float
    _items: dict[str, DownloadItem]
    _client: httpx.AsyncClient | None
    _io_pool: ThreadPoolExecutor | None

    def dest_for(self, repo: str, path: str) -> Path:
        """Where a finished file goes by default: `models_dir/<owner>/<name>/<path in repo>`."""
        _check_repo(repo)
        _check_path(path)
        return self.models_dir.joinpath(*repo.split("/"), *path.split("/"))

    # --- files and state ---------------------------------------------------------------------------------

    def _part(self, id_: str) -> Path:
        return self.state_dir / f"{id_}.part"

    def _json(self, id_: str) -> Path:
        return self.state_dir / f"{id_}.json"

    def _part_size(self, id_: str) -> int:
        try:
            return self._part(id_).stat().st_size
        except OSError:
            return 0

    def _remove_files(self, id_: str) -> None:
        for path in (self._part(id_), self._json(id_)):
            with contextlib.suppress(FileNotFoundError):
                path.unlink()

    def _state_dict(self, item: DownloadItem) -> dict[str, Any]:
        st = item.status
        return {
            "version": STATE_VERSION,
            "id": st.id,
            "repo": st.repo,
            "path": st.path,
            "revision": item.revision,
            "sha256": item.sha256,
            "size": item.size,
            "dest": str(st.dest) if st.dest is not None else None,
        }

    def _save_state_sync(self, item: DownloadItem) -> None:
        """Saves the state from the loop without waiting on the drive (the write fsyncs): through the I/O thread,
        which also keeps it in order with the download's own writes; directly before `start()`."""
        path, data = self._json(item.status.id), self._state_dict(item)

        def write() -> None:
            try:
                write_json_atomic(path, data)
            except OSError as exc:
                log.warning("could not save download state for %s: %s", path.stem, exc)

        if self._io_pool is not None:
            self._io_pool.submit(write)
        else:
            write()

    async def _save_state(self, item: DownloadItem) -> None:
        await self._io(write_json_atomic, self._json(item.status.id), self._state_dict(item))

    def _restore(self) -> None:
        for path in sorted(self.state_dir.glob("*.json")):
            try:
                data = json.loads(path.read_text(encoding="utf-8"))
                if not isinstance(data, dict) or data.get("version") != STATE_VERSION:
                    raise ValueError("unknown format")
                repo, rel, revision = data["repo"], data["path"], data["revision"]
                if not all(isinstance(v, str) for v in (repo, rel, revision)):
                    raise ValueError("bad names")
                saved_dest = data.get("dest")
                if saved_dest is not None and (not isinstance(saved_dest, str) or not Path(saved_dest).is_absolute()):
                    raise ValueError("bad destination")
                dest = Path(saved_dest) if saved_dest else self.dest_for(repo, rel)
                id_ = download_id(repo, rel, revision)
                if data.get("id") != id_ or path.stem != id_:
                    raise ValueError("id mismatch")
                sha = normalize_sha256(data.get("sha256"))
                size = checked_size(data.get("size"), rel)
            except (OSError, ValueError, KeyError, TypeError, HubError) as exc:
                log.warning("ignoring unreadable download state %s: %s", path, exc)
                continue
            done = self._part_size(id_)
            status = DownloadStatus(
                id_, repo, rel, "paused", done, size, 0.0, None, "Paused (resume to continue)", dest
            )
            self._items[id_] = DownloadItem(status, revision, sha, size)

    # --- scheduling and status -----------------------------------------------------------------------------

    async def _io(self, fn: Callable[..., T], *args: Any) -> T:
        pool = self._io_pool
        if pool is None:
            return await asyncio.to_thread(fn, *args)
        return await asyncio.get_running_loop().run_in_executor(pool, fn, *args)

    def _set(self, item: DownloadItem, state: DownloadState, message: str) -> None:
        st = item.status
        st.state = state
        st.message = message
        if state != "failed":
            st.error_kind = None
        if state != "downloading":
            st.speed_bps, st.eta_s = 0.0, None
        if state in TERMINAL:
            item.terminal.set()
        else:
            item.terminal.clear()
        self._emit(item, force=True)

    def _emit(self, item: DownloadItem, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - item.last_emit < EMIT_INTERVAL_S:
            return
        item.last_emit = now
        if self.on_change is not None:
            try:
                self.on_change(dataclasses.replace(item.status))
            except Exception:
                log.exception("download on_change callback failed")

    def _progress(self, item: DownloadItem, done: int) -> None:
        st = item.status
        st.done_bytes = done
        now = time.monotonic()
        samples = item.samples
        samples.append((now, done))
        while len(samples) > 2 and now - samples[0][0] > SPEED_WINDOW_S:
            samples.popleft()
        t0, b0 = samples[0]
        if now - t0 >= 0.2:
            st.speed_bps = max(0.0, (done - b0) / (now - t0))
            remaining = (st.total_bytes - done) if st.total_bytes is not None else None
            st.eta_s = remaining / st.speed_bps if remaining is not None and st.speed_bps > 0 else None
        self._emit(item)
