"""Qt-free, async download manager: a queue with progress, pause/resume across restarts, retries, verification.

huggingface_hub ≥ 1.18 deletes partial files and never resumes across calls, so the transfer is ours: httpx
against the URL `hf_hub_url` gives (following the hub's redirect to its CDN), with HTTP Range resume. For each
download the state dir holds `<id>.part` (the bytes so far) and `<id>.json` (what it is); both survive a restart
and the next `DownloadManager` restores them as paused. A finished file is hashed (sha256) in a thread and only
then moved atomically to `models_dir/<owner>/<name>/<path in repo>`.

Nothing here blocks the event loop: network I/O is async, file writes and renames go through one I/O thread
(which also keeps their order when a task is cancelled mid-write), hashing runs in its own thread.

This module is the queue (the public API, scheduling, one download's steps); its parts: download_files.py (a
download's status, files, saved state and events), download_http.py (the transfer: Range requests, retries),
download_verify.py (size and sha256 checks, the atomic move into place).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import shutil
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Literal

import httpx

from runmyai.library.download_files import (
    EMIT_INTERVAL_S,
    TERMINAL,
    DownloadItem,
    DownloadStatus,
    download_id,
)
from runmyai.library.download_http import DownloadTransfer, make_client
from runmyai.library.download_verify import DownloadVerify
from runmyai.library.hub import (
    HubClient,
    HubError,
    _check_path,
    _check_repo,
    checked_size,
    normalize_sha256,
)
from runmyai.units import human_bytes

__all__ = ["EMIT_INTERVAL_S", "TERMINAL", "DownloadManager", "DownloadStatus", "download_id"]

log = logging.getLogger(__name__)


def _disk_free(path: Path) -> int:
    return shutil.disk_usage(path).free


class DownloadManager(DownloadTransfer, DownloadVerify):
    """Downloads hub files into `models_dir`, one queue, `max_parallel` at a time; see the module docstring."""

    def __init__(
        self,
        hub: HubClient,
        state_dir: Path,
        models_dir: Path,
        on_change: Callable[[DownloadStatus], None] | None = None,
        *,
        max_parallel: int = 1,
        stall_timeout_s: float = 30.0,
        max_retries: int = 8,
        retry_backoff_s: float = 1.0,
        disk_free: Callable[[Path], int] = _disk_free,
    ) -> None:
        self.hub = hub
        self.state_dir = Path(state_dir)
        self.models_dir = Path(models_dir)
        self.on_change = on_change
        self.max_parallel = max(1, max_parallel)
        self.stall_timeout_s = stall_timeout_s
        self.max_retries = max_retries
        self.retry_backoff_s = retry_backoff_s
        self._disk_free = disk_free
        self._items: dict[str, DownloadItem] = {}
        self._started = False
        self._client: httpx.AsyncClient | None = None
        self._io_pool: ThreadPoolExecutor | None = None
        self.state_dir.mkdir(parents=True, exist_ok=True)
        self.models_dir.mkdir(parents=True, exist_ok=True)
        self._restore()

    # --- public API --------------------------------------------------------------------------------------

    def enqueue(
        self,
        repo: str,
        path: str,
        revision: str = "main",
        sha256: str | None = None,
        size: int | None = None,
        *,
        dest: Path | None = None,
    ) -> str:
        """Queues a file (raises `HubError` for an invalid name); the same file twice gives the same id.

        `dest`: an absolute path for the finished file instead of `dest_for` (a model's shards go to its job
        folder, not the models folder). Enqueuing a paused or failed download resumes it from its partial file."""
        if dest is not None and not dest.is_absolute():
            raise HubError(f"“{dest}” is not an absolute path for {path}.", "other")
        dest = dest if dest is not None else self.dest_for(repo, path)
        _check_repo(repo)
        _check_path(path)
        expected_sha = normalize_sha256(sha256) if sha256 is not None else None
        if sha256 is not None and expected_sha is None:
            raise HubError(f"“{sha256}” is not a sha256 checksum.", "malformed")
        expected_size = checked_size(size, path)
        id_ = download_id(repo, path, revision)
        item = self._items.get(id_)
        if item is not None and item.status.state not in TERMINAL:
            item.status.dest = dest
            item.sha256 = expected_sha or item.sha256
            item.size = expected_size if expected_size is not None else item.size
            item.status.total_bytes = item.size
            self._save_state_sync(item)
            if item.status.state == "paused":
                self.resume(id_)  # asking again for a paused (e.g. restored) download continues it
            return id_
        if item is None:
            status = DownloadStatus(id_, repo, path, "queued", 0, expected_size, 0.0, None, "Waiting…", dest)
            item = DownloadItem(status, revision, expected_sha, expected_size)
            self._items[id_] = item
        else:
            item.sha256, item.size = expected_sha, expected_size
            item.status.total_bytes = expected_size
            item.status.dest = dest
            item.status.done_bytes = self._part_size(id_)
        self._set(item, "queued", "Waiting…")
        self._save_state_sync(item)
        self._schedule()
        return id_

    def pause(self, id: str) -> None:
        item = self._items[id]
        state = item.status.state
        if state == "queued":
            self._set(item, "paused", "Paused")
            self._save_state_sync(item)
        elif state in ("downloading", "verifying") and item.task is not None:
            self._set(item, "paused", "Pausing…")
            self._stop(item, "pause")

    def resume(self, id: str) -> None:
        item = self._items[id]
        if item.status.state in ("paused", "failed"):
            item.status.done_bytes = self._part_size(id)
            self._set(item, "queued", "Waiting…")
            self._schedule()

    def cancel(self, id: str) -> None:
        """Stops a download and removes its partial file; a finished download is left alone."""
        item = self._items[id]
        if item.status.state in ("done", "cancelled"):
            return
        if item.task is not None:
            item.status.message = "Cancelling…"
            self._emit(item, force=True)
            self._stop(item, "cancel")  # the task removes the partial file, then reports "cancelled"
        else:
            self._remove_files(id)
            item.status.done_bytes = 0
            self._set(item, "cancelled", "Cancelled")

    def forget(self, id: str) -> None:
        """Drops a finished, failed or cancelled download from `items()` (a failed one's partial is removed); also
        from its own `on_change` (a terminal state is a download's last step: its task only ends after it)."""
        item = self._items.get(id)
        if item is None or item.status.state not in TERMINAL:
            return
        if item.status.state == "failed":
            self._remove_files(id)
        del self._items[id]

    def items(self) -> list[DownloadStatus]:
        return [dataclasses.replace(item.status) for item in self._items.values()]

    async def start(self) -> None:
        """Begins processing the queue in background tasks."""
        if self._client is None:
            timeout = httpx.Timeout(self.stall_timeout_s, connect=min(self.stall_timeout_s, 15.0))
            # built in a thread: the TLS context and httpcore's lazily imported async backend take tens of ms
            self._client = await asyncio.to_thread(make_client, timeout)
        if self._io_pool is None:
            pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="runmyai-download-io")
            await asyncio.to_thread(lambda: pool.submit(int).result())  # its thread starts off the loop
            self._io_pool = pool
        self._started = True
        self._schedule()

    async def close(self) -> None:
        """Stops all work, leaving partial files resumable (restored as paused by the next manager)."""
        self._started = False
        tasks = []
        for item in self._items.values():
            if item.task is not None:
                tasks.append(item.task)
                self._stop(item, "close")
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
        if self._client is not None:
            await self._client.aclose()
            self._client = None
        if self._io_pool is not None:
            pool, self._io_pool = self._io_pool, None
            await asyncio.to_thread(pool.shutdown, wait=True)

    def _stop(self, item: DownloadItem, reason: Literal["pause", "cancel", "close"]) -> None:
        """Asks a running task to stop, once; a later cancel still wins (the task reads `stop_reason` last)."""
        first = item.stop_reason is None
        if first or reason == "cancel":
            item.stop_reason = reason
        item.abort_hash.set()
        if first and item.task is not None:
            item.task.cancel()

    async def wait(self, id: str) -> DownloadStatus:
        """Until the download is done, failed or cancelled."""
        item = self._items[id]
        while item.status.state not in TERMINAL:
            await item.terminal.wait()
        return dataclasses.replace(item.status)

    def _schedule(self) -> None:
        if not self._started:
            return
        running = sum(1 for item in self._items.values() if item.task is not None)
        for item in list(self._items.values()):
            if running >= self.max_parallel:
                break
            if item.status.state == "queued" and item.task is None:
                item.stop_reason = None
                item.abort_hash = threading.Event()
                item.task = asyncio.get_running_loop().create_task(self._run(item), name=f"download-{item.status.id}")
                running += 1

    # --- one download ------------------------------------------------------------------------------------

    async def _run(self, item: DownloadItem) -> None:
        id_ = item.status.id
        try:
            await self._download(item)
        except asyncio.CancelledError:
            outside = item.stop_reason is None  # e.g. the loop shutting down
            if item.stop_reason != "cancel":
                item.status.done_bytes = self._part_size(id_)
                with contextlib.suppress(OSError):
                    await self._save_state(item)
            if item.stop_reason == "cancel":  # read again: cancel() may have come in meanwhile
                await self._io(self._remove_files, id_)
                item.status.done_bytes = 0
                if item.status.state != "queued":
                    self._set(item, "cancelled", "Cancelled; the partial download was removed.")
            elif item.status.state != "queued":
                self._set(item, "paused", "Paused" if item.stop_reason == "pause" else "Paused (resume to continue)")
            if outside:
                raise
        except HubError as exc:
            if exc.kind in ("corrupt", "changed"):  # those bytes are useless
                await self._io(self._remove_files, id_)
                item.status.done_bytes = 0
            else:
                item.status.done_bytes = self._part_size(id_)
            item.status.error_kind = exc.kind
            self._set(item, "failed", str(exc))
        except Exception as exc:
            log.exception("download %s failed", id_)
            item.status.done_bytes = self._part_size(id_)
            item.status.error_kind = "other"
            self._set(item, "failed", f"Download of {item.status.path} failed unexpectedly ({type(exc).__name__}).")
        finally:
            item.task = None
            if self._started:
                self._schedule()

    async def _download(self, item: DownloadItem) -> None:
        st = item.status
        id_ = st.id
        dest = st.dest
        assert dest is not None
        part = self._part(id_)
        self._set(item, "downloading", "Starting…")
        await self._save_state(item)

        have = self._part_size(id_)
        st.done_bytes = have
        if self.hub.offline:
            if await self._already_installed(item, dest):
                return
            if item.size is not None and have == item.size:
                await self._verify_and_install(item, part, dest, offline=True)
                return
            kept = f" {human_bytes(have)} already downloaded are kept." if have else ""
            raise HubError(
                f"Offline mode is on (HF_HUB_OFFLINE or the app's setting), so {st.path} can't be downloaded now;"
                f"{kept} Resume it when you are online.",
                "offline",
            )

        if item.size is None or item.sha256 is None:
            info = await self._with_retries(  # retried here, with each wait on the download's row
                item, lambda: self.hub.file_info(st.repo, st.path, item.revision, retries=0)
            )
            if item.sha256 is not None and info.sha256 is not None and info.sha256 != item.sha256:
                raise HubError(
                    f"{st.path} on the hub no longer matches the expected checksum (it was changed upstream).",
                    "changed",
                )
            if item.size is not None and info.size is not None and info.size != item.size:
                raise HubError(f"{st.path} on the hub has a different size than expected.", "changed")
            item.sha256 = item.sha256 or info.sha256
            item.size = item.size if item.size is not None else info.size
            st.total_bytes = item.size
            await self._save_state(item)
        if await self._already_installed(item, dest):
            return
        self._set(item, "downloading", "Starting…")

        if item.size is not None and have > item.size:
            await self._io(self._truncate, part)
            have = st.done_bytes = 0
        self._check_space(item, have)
        await self._transfer(item, part)
        await self._verify_and_install(item, part, dest, offline=False)

    def _check_space(self, item: DownloadItem, have: int) -> None:
        total = item.size
        if total is None:
            return
        need = total - have
        checks = [(self.state_dir, need)]
        try:
            if self.state_dir.stat().st_dev != self.models_dir.stat().st_dev:
                checks.append((self.models_dir, total))  # the move becomes a copy
        except OSError:
            pass
        for folder, needed in checks:
            try:
                free = self._disk_free(folder)
            except OSError:
                continue
            if needed > free:
                raise HubError(
                    f"Not enough free space for {item.status.path}: it needs {human_bytes(needed)} in {folder}, "
                    f"but only {human_bytes(free)} is free.",
                    "no_space",
                )
