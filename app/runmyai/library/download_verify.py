"""A finished download checked (its size, its sha256 in a thread) and moved atomically into place; a copy already
there is recognised by its sha256 (part of `downloads.DownloadManager`)."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import shutil
import threading
from pathlib import Path

from runmyai.library.download_files import DownloadFiles, DownloadItem
from runmyai.library.hub import (
    HubError,
)
from runmyai.units import human_bytes

HASH_CHUNK = 4 << 20


def _sha256_file(path: Path, abort: threading.Event) -> str | None:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(HASH_CHUNK):
            if abort.is_set():
                return None
            digest.update(chunk)
    return digest.hexdigest()


def _fsync_file(path: Path) -> None:
    with open(path, "rb+") as f:
        os.fsync(f.fileno())


class DownloadVerify(DownloadFiles):
    """The checking and installing side of a `DownloadManager`."""

    async def _already_installed(self, item: DownloadItem, dest: Path) -> bool:
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

    async def _verify_and_install(self, item: DownloadItem, part: Path, dest: Path, *, offline: bool) -> None:
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
