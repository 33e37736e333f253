"""A download's bytes over HTTP: one GET after another from the partial file's end (HTTP Range), each chunk
written through the I/O thread, retried with backoff on a dropped connection, a stall, a 5xx or a confused Range
answer (part of `downloads.DownloadManager`)."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import importlib
import os
import random
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import IO, TypeVar

import httpx

from runmyai.library.download_files import DownloadFiles, DownloadItem
from runmyai.library.hub import (
    HubError,
    checked_size,
    error_from_status,
    header_error_code,
    parse_content_range,
    retry_after,
)
from runmyai.units import human_bytes

WRITE_BATCH = 1 << 20  # bytes buffered before a write in the I/O thread

T = TypeVar("T")


class _Retry(Exception):
    """A failure worth another try (dropped connection, stall, 5xx, a confused Range answer)."""

    def __init__(self, reason: str, delay_s: float | None = None) -> None:
        super().__init__(reason)
        self.delay_s = delay_s


def make_client(timeout: httpx.Timeout) -> httpx.AsyncClient:
    for module in ("anyio._backends._asyncio", "anyio.streams.tls", "httpcore._async.http11", "h11"):
        with contextlib.suppress(ImportError):
            importlib.import_module(module)
    return httpx.AsyncClient(follow_redirects=True, timeout=timeout, max_redirects=10)


class DownloadTransfer(DownloadFiles):
    """The HTTP side of a `DownloadManager`: `_transfer` fills a download's partial file."""

    @staticmethod
    def _truncate(part: Path) -> None:
        with open(part, "wb"):
            pass

    async def _with_retries(self, item: DownloadItem, call: Callable[[], Awaitable[T]]) -> T:
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

    async def _backoff(self, item: DownloadItem, reason: str, failures: int, delay_s: float | None) -> None:
        delay = delay_s if delay_s is not None else self.retry_backoff_s * 2 ** (failures - 1)
        delay = min(delay, 60.0) * random.uniform(0.8, 1.2)
        reason = reason.rstrip(".")
        self._set(
            item, "downloading", f"{reason}; retrying in {delay:.0f} s (try {failures + 1} of {self.max_retries + 1})."
        )
        await asyncio.sleep(delay)

    async def _transfer(self, item: DownloadItem, part: Path) -> None:
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

    async def _attempt(self, item: DownloadItem, part: Path, url: str, have: int) -> bool:
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

    def _check_total(self, item: DownloadItem, total: int | None) -> None:
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

    async def _receive(self, item: DownloadItem, part: Path, response: httpx.Response, have: int, skip: int) -> None:
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
