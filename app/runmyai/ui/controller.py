"""The main window's shell: it makes the rooms (one controller per page or job, in `runmyai.ui.controllers`),
wires their signals to each other, and runs the app's start and shutdown. Every slow step is a task on the qasync
loop, never a block."""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from PySide6.QtCore import QObject

from runmyai.chat.store import ConversationStore
from runmyai.engine.info import ask_engine
from runmyai.library.hub import HubClient
from runmyai.library.keys import LocalKey
from runmyai.library.local import LocalLibrary
from runmyai.library.presets import check_flags, load_catalog
from runmyai.machine import probe_machine_async
from runmyai.paths import AppPaths, bundled_dir
from runmyai.ui.controllers.autotune import AUTOTUNE_OFFER, AutotuneRoom
from runmyai.ui.controllers.base import Shared
from runmyai.ui.controllers.chat import ChatRoom
from runmyai.ui.controllers.conversations import UNDO_DELETE, ConversationsRoom
from runmyai.ui.controllers.engine import EngineRoom
from runmyai.ui.controllers.library import LibraryRoom
from runmyai.ui.controllers.mcp import McpRoom
from runmyai.ui.controllers.prompt_cache import PromptCacheRoom
from runmyai.ui.controllers.server import ServerRoom
from runmyai.ui.controllers.settings import SettingsRoom
from runmyai.ui.main_window import MainWindow

__all__ = ["AUTOTUNE_OFFER", "AppController"]


class AppController(QObject):
    """The rooms: `prefs` (Settings), `models` (Discover and My models) with `jobs` (downloads and long jobs),
    `engine` (the engine or endpoint in use), `tune` (autotune), `server` (the Server page), `mcp_room` (MCP),
    `talks` (the conversations) and `chat` (a chat's turns); `ctx` is what they share."""

    def __init__(
        self,
        window: MainWindow,
        paths: AppPaths,
        *,
        hub_endpoint: str | None = None,
        offline: bool = False,
        presets_dir: Path | None = None,
        resources_dir: Path | None = None,
    ) -> None:
        super().__init__(window)
        self.window = window
        self.paths = paths.ensure()
        catalog = load_catalog(presets_dir or bundled_dir("presets"))
        library = LocalLibrary(paths.models, resources_dir or bundled_dir("resources"), presets=catalog.presets)
        hub = HubClient(endpoint=hub_endpoint, offline=offline or os.environ.get("HF_HUB_OFFLINE") == "1")
        self.ctx = ctx = Shared(window, self.paths)
        ctx.errors[:0] = catalog.errors
        self.store = ConversationStore(paths.conversations_db)
        # the rooms, each told only what it asks of the others; the later ones' answers are read when asked
        self.models = LibraryRoom(ctx, catalog, library, hub, in_use=lambda: self.engine.in_use())
        self.jobs = self.models.jobs
        self.engine = EngineRoom(ctx, self.models, end_reply=lambda: self.chat.end_reply())
        self.tune = AutotuneRoom(ctx, self.models)
        self.server = ServerRoom(ctx, self.engine)
        self.mcp_room = McpRoom(ctx, self.store)
        self.talks = ConversationsRoom(ctx, self.store, self.engine, self.mcp_room, busy=lambda: self.chat.busy())
        self.chat = ChatRoom(ctx, self.store, self.engine, self.mcp_room, self.talks)
        self.prefs = SettingsRoom(ctx, lambda: self.engine.model_name, self.models.use_folders)
        self.prompt_cache = PromptCacheRoom(ctx, self.engine)  # (the engine's conversation contexts on disk)
        library.extra_dirs = [Path(d) for d in ctx.settings.model_dirs]
        library.exit_kind = lambda code: ctx.engine_info.exit_kind(code)
        self.prefs.apply_theme()
        self._connect()

    def _connect(self) -> None:
        """What one room's change means for the others."""
        engine = self.engine
        engine.models_changed.connect(self.models.show_models)
        engine.presets_changed.connect(self.prefs.show_presets)
        self.talks.deleted.connect(self.prompt_cache.forget)
        self.prefs.context_changed.connect(self._context_changed)
        self.prefs.preset_applied.connect(self.talks.save_settings)
        notes = self.window.notice_area
        notes.retry_requested.connect(self.retry_notice)
        notes.forget_requested.connect(self._forget_notice)
        notes.cancel_requested.connect(self.jobs.cancel_notice)
        self.prefs.show_presets()

    def _context_changed(self) -> None:
        self.models.list_entries()
        if self.engine.supervisor is not None:
            self.ctx.spawn(self.engine.restart())

    def retry_notice(self, key: str) -> None:
        again = self.ctx.retry.get(key)
        self.window.notifications.forget(key)
        if again is not None:
            again()

    def _forget_notice(self, key: str) -> None:
        self.window.notifications.forget(key)
        self.ctx.retry.pop(key, None)
        if key.startswith(UNDO_DELETE):  # Hide on a deleted chat's notice: no undo wanted, deleted now
            self.talks.finish_delete(int(key.removeprefix(UNDO_DELETE)))
        if key == AUTOTUNE_OFFER:  # "Not now": the offer does not come back at every start
            self.ctx.settings = replace(self.ctx.settings, autotune_declined=True)
            self.ctx.save_settings()

    def stop_following_desktop(self) -> None:
        """No more theme changes from the desktop (see SettingsRoom.stop_following_desktop)."""
        self.prefs.stop_following_desktop()

    # ------------------------------------------------------------------------------------------ start / stop
    async def start(self) -> None:
        ctx, models = self.ctx, self.models
        for line in models.catalog.errors:
            self.window.log_view.append(f"[presets] {line}")
        self.talks.show_conversations()
        await self.jobs.start()
        ctx.machine = await probe_machine_async(self.paths.models, autotune_dir=self.paths.settings)
        ctx.engine_info = await ask_engine(self.paths.settings)
        if not ctx.engine_info.known:
            ctx.report(f"Could not ask the engine what it runs: {ctx.engine_info.error}.")
        for line in models.catalog.bind_engine(ctx.engine_info):  # (expert bytes and flags as the engine says)
            self.window.log_view.append(f"[presets] {line}")
        for preset in models.catalog.presets:  # its flags against the engine's own (names, kinds, defaults)
            for line in check_flags(preset, ctx.engine_info):
                self.window.log_view.append(f"[presets] {line}")
        self.window.graphs.set_has_gpu(bool(ctx.machine.gpus))
        await models.refresh_library()
        self.server.show_state()
        self.jobs.list_started()
        ctx.spawn(self.mcp_room.start_mcp())
        await self.jobs.run_job("Preparing the built-in model", self._ensure_demo)
        self.tune.offer_autotune()
        if self.jobs.acquirer.unfinished():
            ctx.spawn(self.jobs.resume_jobs())

    async def _ensure_demo(self, progress: Callable[[float, str], None]) -> None:
        demo = await self.models.library.ensure_bundled_demo(progress)
        if demo is not None:
            await self.models.refresh_library(select=str(LocalKey(demo.path)))

    async def shutdown(self) -> None:
        self.stop_following_desktop()
        self.talks.finish_delete()  # the chats deleted in the last seconds: their Undo ends with the app
        self.chat.stop_reply()
        await self.chat.draft_counter.aclose()
        self.jobs.cancel_job()
        await self.engine.stop_engine()
        await self.mcp_room.mcp.close()
        await self.jobs.downloads.close()
        for task in list(self.ctx.tasks):
            task.cancel()
        with contextlib.suppress(Exception):
            await asyncio.gather(*self.ctx.tasks, return_exceptions=True)
        self.store.close()
