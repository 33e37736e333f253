"""The library's long jobs and downloads: getting a hub model (download, repack), importing files, resuming what
an earlier run left, the downloads table, and the one job slot with its progress, Cancel and Retry."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Awaitable, Callable, Coroutine
from pathlib import Path
from typing import Any

from PySide6.QtWidgets import QFileDialog

from runmyai.engine.autotune import AutotuneError
from runmyai.library.acquire import PERMANENT_HUB_KINDS, AcquireError, Acquirer, Job, JobStatus
from runmyai.library.downloads import DownloadManager, DownloadStatus
from runmyai.library.hub import HubClient, HubError
from runmyai.library.keys import HubKey, LocalKey
from runmyai.library.local import ImportCancelled, LibraryError, LocalLibrary, LocalModel
from runmyai.library.presets import Catalog
from runmyai.ui import render
from runmyai.ui.controllers.base import Room, Shared
from runmyai.ui.notifications import job_line
from runmyai.ui.viewmodels import Notice

Refresh = Callable[..., Coroutine[Any, Any, None]]  # the library scanned again (select: a key to show)


class JobsRoom(Room):
    def __init__(self, ctx: Shared, hub: HubClient, library: LocalLibrary, catalog: Catalog, refresh: Refresh) -> None:
        super().__init__(ctx)
        self.library = library
        self.catalog = catalog
        self._refresh = refresh
        paths = ctx.paths
        self.downloads = DownloadManager(hub, paths.downloads, paths.models, on_change=self._on_download)
        self.acquirer = Acquirer(
            hub,
            self.downloads,
            library,
            paths.jobs,
            engine=lambda: self.ctx.engine_info,
            machine=lambda: self.ctx.machine,
            on_job=self._on_job,
        )
        self._job: asyncio.Task[Any] | None = None  # the library's one long job (import, get, first-start repack)
        self._job_key: str | None = None  # its notification's key
        self._job_lock = asyncio.Lock()
        table = self.window.library.downloads
        table.pause_requested.connect(self._pause_row)
        table.resume_requested.connect(self._resume_row)
        table.cancel_requested.connect(self._cancel_row)
        table.forget_requested.connect(self._forget_row)
        self.window.library.import_requested.connect(self._choose_import)

    async def start(self) -> None:
        """The downloads an earlier run left, listed; the jobs it left, listed (one that failed for good is not
        run again)."""
        await self.downloads.start()
        for status in self.downloads.items():
            self._on_download(status)

    def list_started(self) -> None:
        for job in self.acquirer.started():  # a job that failed for good is listed, not run again
            self._on_job(self.acquirer.status(job))

    def cancel_notice(self, key: str) -> None:
        """A long job's Cancel, on its notification: the job that notification shows, if it still runs."""
        if key == self._job_key:
            self.cancel_job()
        elif key.startswith("download:"):  # a published file's: paused, as a job's Cancel leaves it resumable
            id_ = key.removeprefix("download:")
            if any(d.id == id_ for d in self.downloads.items()):
                self.downloads.pause(id_)

    async def get_model(self, key: HubKey) -> LocalModel | None:
        """One quant of a hub repository into the library (`runmyai get` does the same, without the window)."""
        result: list[LocalModel] = []

        async def work(progress: Callable[[float, str], None]) -> None:
            result.append(await self.acquirer.get(key, lambda p: progress(p.fraction, p.message)))

        await self.run_job(
            f"Getting {key.repo}" + (f" ({key.quant})" if key.quant else ""),
            work,
            f"get:{key.repo}",
            lambda: self.ctx.spawn(self.get_model(key)),
        )
        self._list_jobs()  # stopped or failed: its row, to resume or forget
        await self._refresh(select=str(LocalKey(result[0].path)) if result else None)
        return result[0] if result else None

    def _list_jobs(self) -> None:
        """The downloads table's rows of the jobs not running (paused or failed): a running job shows in its
        notification and on its Discover card only."""
        for job in self.acquirer.started():
            if not self.acquirer.is_running(job.id):
                self._on_job(self.acquirer.status(job))

    async def resume_jobs(self, jobs: list[Job] | None = None) -> None:
        """Downloads and repacks an earlier run left unfinished continue where they stopped (or `jobs`, asked for
        again from their row)."""
        for job in jobs if jobs is not None else self.acquirer.unfinished():

            async def work(progress: Callable[[float, str], None], job: Job = job) -> None:
                await self.acquirer.run(job, lambda p: progress(p.fraction, p.message))

            again = functools.partial(self._resume_row, f"job:{job.id}")
            await self.run_job(f"Resuming {job.repo} ({job.quant})", work, f"get:{job.repo}", again)
        self._list_jobs()
        await self._refresh()

    def _on_download(self, s: DownloadStatus) -> None:
        """A published model file's download, as a job's: while it runs, its notification (progress, and Cancel,
        which pauses it: it stays resumable) and the card of the preset it belongs to; stopped, its row in the
        downloads table (Resume, Forget); failed, also its notification with Retry unless the failure is
        permanent. A job's shards have no row and no notification of their own: their job's show their progress
        (the walk-through saw one download in three places: a notification, a task row and this table; and a
        preset's file download in the table alone, nowhere near the notification area)."""
        table, notes = self.window.library.downloads, self.window.notifications
        if s.dest is not None and s.dest.is_relative_to(self.ctx.paths.jobs):
            table.remove_item(s.id)
            return
        key, card = f"download:{s.id}", self._download_card(s)
        title = f"Downloading {s.path}"
        if s.state in ("queued", "downloading", "verifying"):
            table.remove_item(s.id)
            fraction = s.done_bytes / s.total_bytes if s.total_bytes else None
            notes.job(key, title, s.message, fraction, cancellable=True)
            if card is not None and (notice := notes.get(key)) is not None:
                self.window.library.set_progress(card, job_line(notice))
            return
        if card is not None:
            self.window.library.set_progress(card, None)
        if s.state == "done":  # finished: its row leaves (the model is in the library, or its job goes on)
            table.remove_item(s.id)
            notes.succeeded(key)
            self.ctx.retry.pop(key, None)
            self.downloads.forget(s.id)
            if s.dest is not None and s.dest.name.endswith(".tw.gguf"):
                self.ctx.spawn(self._refresh())
            return
        if s.state == "failed":
            if (shown := notes.get(key)) is None or shown.kind != "error":  # once, not at every change
                if s.error_kind not in PERMANENT_HUB_KINDS:
                    self.ctx.retry[key] = functools.partial(self.downloads.resume, s.id)
                else:
                    self.ctx.retry.pop(key, None)
                self.ctx.report(f"{title} failed: {s.message}", key, f"{title} failed")
        else:  # paused or cancelled: its row says so
            notes.forget(key)
        table.update_item(
            s.id, f"{s.repo}/{s.path}", s.state, s.done_bytes, s.total_bytes, s.speed_bps, s.eta_s, s.message
        )

    def _download_card(self, s: DownloadStatus) -> str | None:
        """The Discover card a published file's download shows on: its preset's."""
        preset = next((p for p in self.catalog.presets if p.repo == s.repo and p.file == s.path), None)
        return render.card_repo(preset) if preset is not None else None

    def _on_job(self, s: JobStatus) -> None:
        """A model job's row ("job:ID"): running, paused (Resume), failed for good (why; Resume tries again) —
        each with Forget; gone once done or forgotten."""
        table, row = self.window.library.downloads, f"job:{s.id}"
        if s.state in ("done", "forgotten", "running"):  # running: its notification and Discover card show it
            table.remove_item(row)
            return
        state = "downloading" if s.state == "running" else s.state
        done = round(s.fraction * s.size)
        table.update_item(row, f"{s.repo} ({s.quant})", state, done, s.size, 0.0, None, s.message)

    def _pause_row(self, row: str) -> None:
        if not row.startswith("job:"):
            self.downloads.pause(row)
        elif self._job is not None and self.acquirer.is_running(row.removeprefix("job:")):
            self.cancel_job()  # the library's job slot runs it: stopped there, it stays resumable

    def _resume_row(self, row: str) -> None:
        if not row.startswith("job:"):
            self.downloads.resume(row)
        elif (job := self.acquirer.find(row.removeprefix("job:"))) is not None and not self.acquirer.is_running(job.id):
            self.ctx.spawn(self.resume_jobs([job]))

    def _cancel_row(self, row: str) -> None:
        if row.startswith("job:"):
            self._forget_row(row)  # a cancelled job keeps nothing: forgotten with all it fetched
        else:
            self.downloads.cancel(row)

    def _forget_row(self, row: str) -> None:
        if row.startswith("job:"):
            self.ctx.spawn(self.acquirer.forget(row.removeprefix("job:")))
        else:
            self.downloads.forget(row)
            self.window.library.downloads.remove_item(row)

    def _choose_import(self) -> None:
        dialog = QFileDialog(self.window, "Import GGUF", str(Path.home()), "GGUF models (*.gguf)")
        dialog.setFileMode(QFileDialog.FileMode.ExistingFiles)
        dialog.filesSelected.connect(lambda files: self.ctx.spawn(self.import_files([Path(f) for f in files])))
        dialog.open()  # not exec(): the loop keeps running

    async def import_files(self, files: list[Path]) -> LocalModel | None:
        result: list[LocalModel] = []

        async def job(progress: Callable[[float, str], None]) -> None:
            result.append(await self.library.import_gguf(files, progress))

        label = f"Importing {files[0].name}"
        await self.run_job(label, job, "import", lambda: self.ctx.spawn(self.import_files(files)))
        await self._refresh(select=str(LocalKey(result[0].path)) if result else None)
        return result[0] if result else None

    async def run_job(
        self,
        label: str,
        work: Callable[[Callable[[float | None, str], None]], Awaitable[object]],
        key: str = "job",
        again: Callable[[], Any] | None = None,
    ) -> bool:
        """One long library job with progress and Cancel, one at a time; False if it failed or was cancelled.
        It shows in the notification area under `key` while it runs; a failure stays there, whole, with Retry
        (`again`) unless it is permanent; a success clears an earlier failure of the same key."""
        panel = self.window.library
        notes = self.window.notifications
        repo = key.removeprefix("get:") if key.startswith("get:") else None  # the Discover card it belongs to

        def progress(fraction: float | None, message: str) -> None:
            notes.job(key, label, message, fraction, cancellable=True)
            if repo is not None:
                panel.set_progress(repo, job_line(Notice(key, label, message, kind="job", progress=fraction)))

        async with self._job_lock:
            notes.job(key, label, cancellable=True)
            if repo is not None:
                panel.set_progress(repo, "Starting…")
            self._job, self._job_key = asyncio.current_task(), key
            try:
                await work(progress)
                notes.succeeded(key)
                self.ctx.retry.pop(key, None)
                return True
            except (asyncio.CancelledError, ImportCancelled):
                notes.forget(key)
                self.ctx.errors.append(f"{label}: stopped.")
                self.window.log_view.append(f"[app] {label}: stopped.")
                return False
            except (LibraryError, AcquireError, HubError, AutotuneError) as e:
                # a failure the library marks permanent (a repository that is not there, a model the engine
                # refuses) gets no Retry, whatever its words: the notification said "Retry" for a missing repo
                permanent = (
                    (isinstance(e, AcquireError) and e.permanent)
                    or (isinstance(e, HubError) and e.kind in PERMANENT_HUB_KINDS)
                    or (isinstance(e, LibraryError) and e.permanent)
                )
                if again is not None and not permanent:
                    self.ctx.retry[key] = again
                else:
                    self.ctx.retry.pop(key, None)
                # the engine's own words (a failed import's "magic b'hell'", its exit code) only under Details
                detail = e.detail if isinstance(e, LibraryError) else None
                self.ctx.report(f"{label} failed: {e}", key, f"{label} failed", details=detail)
                return False
            finally:
                self._job = self._job_key = None
                if repo is not None:
                    panel.set_progress(repo, None)

    def cancel_job(self) -> None:
        if self._job is not None and not self._job.done():
            self._job.cancel()
