"""What every room shares: the window, the app's paths and settings, its tasks and its one way of reporting."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any

from PySide6.QtCore import QObject, QTimer

from runmyai.engine.autotune import AutotuneRunner
from runmyai.engine.info import EngineInfo, unknown
from runmyai.machine import MachineInfo
from runmyai.paths import AppPaths
from runmyai.ui.main_window import MainWindow
from runmyai.ui.viewmodels import SettingsFile, new_api_key

INFO_SHOWN_MS = 20_000  # how long a confirmation stays up unless hidden


class Shared:
    """The rooms' common ground: the window, the app's settings, the facts about this machine and its engine
    that every estimate reads, and the task, failure and notification plumbing."""

    def __init__(self, window: MainWindow, paths: AppPaths) -> None:
        self.window = window
        self.paths = paths
        self.errors: list[str] = []  # one line each, also shown to the user
        self.tasks: set[asyncio.Task[Any]] = set()
        self.retry: dict[str, Callable[[], Any]] = {}  # a notification's key → what its Retry does
        self.engine_info: EngineInfo = unknown("not asked yet")
        self.machine: MachineInfo | None = None
        self.autotune = AutotuneRunner(paths)
        self.settings_file = SettingsFile(paths.settings / "app.json")
        self.settings = self.settings_file.load()
        if not self.settings.server.api_key:  # the server never runs without a key: one is made at first start
            self.settings = self.settings.with_server(api_key=new_api_key())
            self.save_settings()

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> asyncio.Task[Any]:
        """Runs a coroutine on the loop; its failure becomes a status line, never an unhandled exception."""
        task = asyncio.ensure_future(coro)
        self.tasks.add(task)
        task.add_done_callback(self._task_done)
        return task

    def _task_done(self, task: asyncio.Task[Any]) -> None:
        self.tasks.discard(task)
        if task.cancelled():
            return
        e = task.exception()
        if e is not None:
            self.report(f"{type(e).__name__}: {e}" if not str(e) else str(e))

    def report(
        self, line: str, key: str = "app", title: str = "Something went wrong", details: str | None = None
    ) -> None:
        """A failure, whole, in the notification area (Details: `details`, else the full text; Retry where `key`
        has one and trying again can change it), and in the log."""
        self.errors.append(line + (f" ({details})" if details else ""))
        self.window.log_view.append(f"[app] {line}" + (f" {details}" if details else ""))
        self.window.notifications.fail(key, title, line, retry=key in self.retry, details=details)

    def confirm(self, key: str, title: str, text: str) -> None:
        """A confirmation ("… is intact", "Measured"): a notice that leaves by itself after INFO_SHOWN_MS unless
        something replaced it. Kept until Hide, it stayed above every page for the rest of the session (the
        walk-through's "is intact" outlived the model it was about)."""
        notes = self.window.notifications
        notes.info(key, title, text)
        shown = notes.get(key)
        QTimer.singleShot(INFO_SHOWN_MS, lambda: None if notes.get(key) != shown else notes.forget(key))

    def save_settings(self) -> None:
        try:
            self.settings_file.save(self.settings)
        except OSError as e:
            self.report(f"Couldn't save the settings: {e.strerror or e}.", "settings", "Settings")


class Room(QObject):
    """One page's or job's controller: a child of the window (its signals live as long as the window), with the
    shared ground."""

    def __init__(self, ctx: Shared) -> None:
        super().__init__(ctx.window)
        self.ctx = ctx
        self.window = ctx.window
