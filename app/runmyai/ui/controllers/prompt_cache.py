"""The engine's prompt cache on disk (issue 44, item 4): Settings' line and Clear, and a deleted conversation's
snapshots deleted with it (engine/prompt_cache.py has the HTTP and the words). Every call is a task on the qasync
loop: the UI thread never waits for the engine (a forget or a clear waits there for its queued writes)."""

from __future__ import annotations

import asyncio
from typing import Any

from runmyai.engine.endpoint import Endpoint
from runmyai.engine.prompt_cache import PendingForgets, PromptCacheError, clear, usage
from runmyai.ui.controllers.base import Room, Shared
from runmyai.ui.controllers.engine import EngineRoom

NO_ENGINE = "Start a model to see what it keeps."
REMOTE = "The server in use is not this app's engine: nothing is kept here."


class PromptCacheRoom(Room):
    def __init__(self, ctx: Shared, engine: EngineRoom) -> None:
        super().__init__(ctx)
        self.engine = engine
        self.pending = PendingForgets(ctx.paths.settings)
        self.task: asyncio.Task[Any] | None = None  # the last call (tests wait for it)
        self.window.settings_page.prompt_cache_clear_requested.connect(lambda: self._run(self.clear()))
        self.window.page_changed.connect(lambda page: self._run(self.show()) if page == "Settings" else None)
        engine.server_changed.connect(self._engine_changed)  # (every engine state: ready, stopped, restarted)

    def _run(self, coro: Any) -> asyncio.Task[Any]:
        self.task = self.ctx.spawn(coro)
        return self.task

    def _endpoint(self) -> Endpoint | None:
        """The local engine, when it is ready (a remote endpoint keeps none of the app's snapshots)."""
        sup = self.engine.supervisor
        ep = sup.endpoint if sup is not None and self.engine.ready.is_set() else None
        return ep if ep is not None and ep.local else None

    def _engine_changed(self) -> None:
        if self._endpoint() is not None:  # a new engine: the deletions it missed, then its line
            self._run(self.flush())
        else:
            self.show_line()

    def forget(self, key: str) -> None:
        """A conversation was deleted: its snapshots go (now, or at the next engine's start)."""
        try:
            self.pending.add(key)
        except OSError as e:
            self.window.log_view.append(f"[prompt cache] a deleted chat's contexts stay on disk: {e}")
            return
        self._run(self.flush())

    async def flush(self) -> None:
        await self.pending.flush(self._endpoint())
        await self.show()

    async def show(self) -> None:
        """Settings' line: what the engine's cache holds (asked; nothing where no local engine runs)."""
        ep = self._endpoint()
        if ep is None:
            self.show_line()
            return
        try:
            use = await usage(ep)
        except PromptCacheError as e:
            self.window.settings_page.set_prompt_cache(str(e), can_clear=False)
            return
        self.window.settings_page.set_prompt_cache(use.line(), can_clear=use.count > 0)

    def show_line(self) -> None:
        remote = self.engine.endpoint is not None and not self.engine.endpoint.local
        self.window.settings_page.set_prompt_cache(REMOTE if remote else NO_ENGINE, can_clear=False)

    async def clear(self) -> None:
        ep = self._endpoint()
        if ep is None:
            self.show_line()
            return
        self.window.settings_page.prompt_cache_clear.setEnabled(False)  # (once: the engine is at it)
        try:
            await clear(ep)
        except PromptCacheError as e:
            self.ctx.report(str(e), "prompt-cache", "Clearing the conversation contexts on disk")
        await self.show()
