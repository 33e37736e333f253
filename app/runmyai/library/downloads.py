"""Qt-free, async download manager: a queue with progress, pause/resume across restarts, retries, verification.

huggingface_hub ≥ 1.18 deletes partial files and never resumes across calls, so the transfer is ours: httpx
against the URL `hf_hub_url` gives (following the hub's redirect to its CDN), with HTTP Range resume. For each
download the state dir holds `<id>.part` (the bytes so far) and `<id>.json` (what it is); both survive a restart
and the next `DownloadManager` restores them as paused. A finished file is hashed (sha256) in a thread and only
then moved atomically to `models_dir/<owner>/<name>/<path in repo>`.

Nothing here blocks the event loop: network I/O is async, file writes and renames go through one I/O thread
(which also keeps their order when a task is cancelled mid-write), hashing runs in its own thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import errno
import hashlib
import importlib
import json
import logging
import os
import random
import shutil
import threading
import time
from collections import deque
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, Literal, TypeVar

import httpx

from runmyai.jsonfile import write_json_atomic
from runmyai.library.hub import (
    HubClient,
    HubError,
    _check_path,
    _check_repo,
    checked_size,
    error_from_status,
    header_error_code,
    normalize_sha256,
    parse_content_range,
    retry_after,
)
from runmyai.units import human_bytes

log = logging.getLogger(__name__)

DownloadState = Literal["queued", "downloading", "paused", "verifying", "done", "failed", "cancelled"]
TERMINAL: frozenset[str] = frozenset({"done", "failed", "cancelled"})
STATE_VERSION = 1
EMIT_INTERVAL_S = 0.1  # on_change at most ~10/s per download (state changes always go out at once)
WRITE_BATCH = 1 << 20  # bytes buffered before a write in the I/O thread
HASH_CHUNK = 4 << 20
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


class _Retry(Exception):
    """A failure worth another try (dropped connection, stall, 5xx, a confused Range answer)."""

    def __init__(self, reason: str, delay_s: float | None = None) -> None:
        super().__init__(reason)
        self.delay_s = delay_s


@dataclass
class _Item:
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


def _disk_free(path: Path) -> int:
    return shutil.disk_usage(path).free


def _sha256_file(path: Path, abort: threading.Event) -> str | None:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(HASH_CHUNK):
            if abort.is_set():
                return None
            digest.update(chunk)
    return digest.hexdigest()


def _make_client(timeout: httpx.Timeout) -> httpx.AsyncClient:
    for module in ("anyio._backends._asyncio", "anyio.streams.tls", "httpcore._async.http11", "h11"):
        with contextlib.suppress(ImportError):
            importlib.import_module(module)
    return httpx.AsyncClient(follow_redirects=True, timeout=timeout, max_redirects=10)


def _fsync_file(path: Path) -> None:
    with open(path, "rb+") as f:
        os.fsync(f.fileno())


class DownloadManager:
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
        self._items: dict[str, _Item] = {}
        self._started = False
        self._client: httpx.AsyncClient | None = None
        self._io_pool: ThreadPoolExecutor | None = None
        self.state_dir.mkdir(parents=True, exist_ok=True)
        self.models_dir.mkdir(parents=True, exist_ok=True)
        self._restore()

    # --- public API --------------------------------------------------------------------------------------

    def dest_for(self, repo: str, path: str) -> Path:
        """Where a finished file goes by default: `models_dir/<owner>/<name>/<path in repo>`."""
        _check_repo(repo)
        _check_path(path)
        return self.models_dir.joinpath(*repo.split("/"), *path.split("/"))

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
            item = _Item(status, revision, expected_sha, expected_size)
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
            self._client = await asyncio.to_thread(_make_client, timeout)
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

    def _stop(self, item: _Item, reason: Literal["pause", "cancel", "close"]) -> None:
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

    def _state_dict(self, item: _Item) -> dict[str, Any]:
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

    def _save_state_sync(self, item: _Item) -> None:
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

    async def _save_state(self, item: _Item) -> None:
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
            self._items[id_] = _Item(status, revision, sha, size)

    # --- scheduling and status -----------------------------------------------------------------------------

    async def _io(self, fn: Callable[..., T], *args: Any) -> T:
        pool = self._io_pool
        if pool is None:
            return await asyncio.to_thread(fn, *args)
        return await asyncio.get_running_loop().run_in_executor(pool, fn, *args)

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

    def _set(self, item: _Item, state: DownloadState, message: str) -> None:
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

    def _emit(self, item: _Item, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - item.last_emit < EMIT_INTERVAL_S:
            return
        item.last_emit = now
        if self.on_change is not None:
            try:
                self.on_change(dataclasses.replace(item.status))
            except Exception:
                log.exception("download on_change callback failed")

    def _progress(self, item: _Item, done: int) -> None:
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

    # --- one download ------------------------------------------------------------------------------------

    async def _run(self, item: _Item) -> None:
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

    async def _download(self, item: _Item) -> None:
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

    async def _already_installed(self, item: _Item, dest: Path) -> bool:
        try:
            size = dest.stat().st_size
        except OSError:
            return False
        if item.size is None or item.sha256 is None or size != item.size:
            return False
        self._set(item, "verifying", "Checking the copy already in your models folder…")
        digest = await asyncio.to_thread(_sha256_file, dest, item.abort_hash)
        if digest != item.sha256:
            return False
        await self._io(self._remove_files, item.status.id)
        item.status.done_bytes = size
        self._set(item, "done", "Already in your models folder (verified).")
        return True

    def _check_space(self, item: _Item, have: int) -> None:
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

    @staticmethod
    def _truncate(part: Path) -> None:
        with open(part, "wb"):
            pass

    async def _with_retries(self, item: _Item, call: Callable[[], Awaitable[T]]) -> T:
        failures = 0
        while True:
            try:
                return await call()
            except HubError as exc:
                if not exc.retryable:
                    raise
                failures += 1
                if failures > self.max_retries:
                    raise
                await self._backoff(item, str(exc), failures, exc.retry_after_s)

    async def _backoff(self, item: _Item, reason: str, failures: int, delay_s: float | None) -> None:
        delay = delay_s if delay_s is not None else self.retry_backoff_s * 2 ** (failures - 1)
        delay = min(delay, 60.0) * random.uniform(0.8, 1.2)
        reason = reason.rstrip(".")
        self._set(
            item, "downloading", f"{reason}; retrying in {delay:.0f} s (try {failures + 1} of {self.max_retries + 1})."
        )
        await asyncio.sleep(delay)

    async def _transfer(self, item: _Item, part: Path) -> None:
        st = item.status
        url = self.hub.url(st.repo, st.path, item.revision)
        failures = 0
        while True:
            before = self._part_size(st.id)
            if item.size is not None and before >= item.size:
                return
            try:
                if await self._attempt(item, part, url, before):
                    return
                raise _Retry("The connection closed before the whole file arrived")
            except (_Retry, httpx.TransportError) as exc:
                after = self._part_size(st.id)
                failures = 1 if after > before else failures + 1
                reason = _describe(exc)
                if failures > self.max_retries:
                    raise HubError(
                        f"Download of {st.path} failed after {self.max_retries + 1} tries ({reason.rstrip('.')}); "
                        f"the {human_bytes(after)} downloaded so far are kept, resume to continue.",
                        "network",
                        retryable=True,
                    ) from None
                await self._backoff(item, reason, failures, exc.delay_s if isinstance(exc, _Retry) else None)

    async def _attempt(self, item: _Item, part: Path, url: str, have: int) -> bool:
        """One GET from `have` onwards; True when the file is complete."""
        st = item.status
        client = self._client
        assert client is not None
        headers = await self.hub.download_headers()
        if have > 0:
            headers["Range"] = f"bytes={have}-"
        item.samples.clear()
        self._set(item, "downloading", "Downloading…" if have == 0 else f"Resuming at {human_bytes(have)}…")
        async with client.stream("GET", url, headers=headers) as response:
            status = response.status_code
            if status == 416 and have > 0:
                if item.size is not None and have == item.size:
                    return True
                await self._io(self._truncate, part)
                raise _Retry("The server could not resume the download, starting over")
            if status >= 400:
                error = error_from_status(status, what=st.path, error_code=header_error_code(response.headers))
                if error.retryable:
                    raise _Retry(str(error), retry_after(response.headers.get("Retry-After")))
                raise error
            if status == 206:
                content_range = parse_content_range(response.headers.get("Content-Range"))
                if content_range is None or content_range[0] != have:
                    await self._io(self._truncate, part)
                    raise _Retry("The server sent an unexpected part of the file, starting over")
                self._check_total(item, content_range[2])
                skip = 0
            elif status == 200:
                length = response.headers.get("Content-Length")
                self._check_total(item, checked_size(length, st.path) if length is not None else None)
                skip = have  # the server ignored Range: skip what is already on disk
                if have:
                    msg = f"The server can't resume; skipping the {human_bytes(have)} already downloaded…"
                    self._set(item, "downloading", msg)
            else:
                raise HubError(f"The hub answered HTTP {status} for {st.path}.", "server")
            await self._receive(item, part, response, have, skip)
        done = self._part_size(st.id)
        return (item.size is not None and done >= item.size) or (item.size is None and not response.is_error)

    def _check_total(self, item: _Item, total: int | None) -> None:
        if total is None:
            return
        total = checked_size(total, item.status.path)
        if item.size is None:
            item.size = item.status.total_bytes = total
        elif total != item.size:
            raise HubError(
                f"{item.status.path} changed on the hub during the download (its size differs); start it again.",
                "changed",
            )

    async def _receive(self, item: _Item, part: Path, response: httpx.Response, have: int, skip: int) -> None:
        st = item.status
        f: IO[bytes] = await self._io(open, part, "ab")
        buf = bytearray()
        written = have
        keep_buffer = True
        try:
            async for chunk in response.aiter_bytes():
                if skip:
                    cut = min(skip, len(chunk))
                    skip -= cut
                    chunk = chunk[cut:]
                    if not chunk:
                        continue
                buf += chunk
                if item.size is not None and written + len(buf) > item.size:
                    raise HubError(
                        f"The server sent more data than {st.path} should have; the download is corrupt.",
                        "corrupt",
                    )
                if len(buf) >= WRITE_BATCH:
                    data, buf = buf, bytearray()  # hand the buffer over, no copy
                    await self._write(f, data, st.path)
                    written += len(data)
                self._progress(item, written + len(buf))
            if skip:
                raise _Retry("The connection closed before the whole file arrived")
        except HubError:
            keep_buffer = False
            raise
        finally:
            # keep every byte received (also on a dropped connection or a pause); the I/O thread runs in order,
            # so a write still in flight when the task was cancelled lands before this one
            if buf and keep_buffer:
                await self._write(f, buf, st.path)
            await self._io(f.close)

    async def _write(self, f: IO[bytes], data: bytes | bytearray, name: str) -> None:
        try:
            await self._io(f.write, data)
        except OSError as exc:
            if exc.errno == errno.ENOSPC:  # another program took the space after the check: keep what arrived
                done = human_bytes(self._part_size_of(f))
                raise HubError(
                    f"The disk is full: {name} could not be written ({self.state_dir}); the {done} downloaded so far "
                    "are kept: free some space and resume.",
                    "no_space",
                ) from None
            raise HubError(f"Could not write {name} to disk ({exc.strerror or exc}).", "no_space") from None

    @staticmethod
    def _part_size_of(f: IO[bytes]) -> int:
        try:
            return os.fstat(f.fileno()).st_size
        except OSError:
            return 0

    async def _verify_and_install(self, item: _Item, part: Path, dest: Path, *, offline: bool) -> None:
        st = item.status
        size = self._part_size(st.id)
        st.done_bytes = size
        if item.size is not None and size != item.size:
            raise HubError(
                f"{st.path} arrived with the wrong size ({human_bytes(size)} instead of {human_bytes(item.size)}); "
                "the partial download was removed, try again.",
                "corrupt",
            )
        if item.sha256 is not None:
            self._set(item, "verifying", "Checking the file (sha256)…")
            digest = await asyncio.to_thread(_sha256_file, part, item.abort_hash)
            if digest is None:
                raise asyncio.CancelledError  # paused or cancelled while hashing
            if digest != item.sha256:
                raise HubError(
                    f"{st.path} is corrupt (its sha256 does not match the hub's); "
                    "the partial download was removed, try again.",
                    "corrupt",
                )
        await self._install(part, dest)
        await self._io(self._remove_files, st.id)
        checked = "verified" if item.sha256 is not None else "size checked; the hub publishes no sha256 for this file"
        note = " (offline: finished from the bytes already on disk)" if offline else ""
        self._set(item, "done", f"Downloaded and {checked}{note}.")

    async def _install(self, part: Path, dest: Path) -> None:
        """fsync, then an atomic rename into the models folder (a copy to a temp name first across devices)."""
        await self._io(_fsync_file, part)
        await self._io(lambda: dest.parent.mkdir(parents=True, exist_ok=True))
        try:
            same_device = part.stat().st_dev == dest.parent.stat().st_dev
        except OSError:
            same_device = False
        if same_device:
            try:
                await self._io(os.replace, part, dest)
            except OSError as exc:
                raise HubError(f"Could not move {dest.name} into the models folder ({exc.strerror or exc}).") from None
            return
        incoming = dest.with_name(f".{dest.name}.incoming")

        def copy() -> None:
            shutil.copyfile(part, incoming)
            _fsync_file(incoming)
            os.replace(incoming, dest)

        try:
            await self._io(copy)
        except OSError as exc:
            with contextlib.suppress(OSError):
                incoming.unlink()
            raise HubError(f"Could not move {dest.name} into the models folder ({exc.strerror or exc}).") from None


def _describe(exc: BaseException) -> str:
    if isinstance(exc, _Retry):
        return str(exc)
    if isinstance(exc, httpx.TimeoutException):
        return "No data arrived for a while (stalled)"
    if isinstance(exc, httpx.ConnectError):
        return "Could not connect to the server"
    if isinstance(exc, httpx.TransportError):
        return "The connection dropped"
    return type(exc).__name__
