"""The Server page: the local API server's switch (the engine restarted on the user's port and key), its state
in one line, and the recent requests from the engine's log."""

from __future__ import annotations

import asyncio

from runmyai.engine.request_log import LAN_HOST, RequestLog, lan_addresses
from runmyai.ui.controllers.base import Room, Shared
from runmyai.ui.controllers.engine import EngineRoom
from runmyai.ui.viewmodels import AppSettings, ServerSettings, server_url


class ServerRoom(Room):
    def __init__(self, ctx: Shared, engine: EngineRoom) -> None:
        super().__init__(ctx)
        self.engine = engine
        self.request_log = RequestLog()  # the Server page's recent requests, from the engine's log
        self._lan_addresses: list[str] = []  # this computer's addresses on its networks (the LAN switch's URLs)
        self.window.server_page.changed.connect(lambda s: self.ctx.spawn(self.set_server(s)))
        self.window.server_page.set_settings(self.ctx.settings.server)
        engine.server_changed.connect(self.show_state)
        engine.logged.connect(self._engine_log)

    async def set_server(self, server: ServerSettings) -> None:
        """The local server switch: the engine is restarted on the user's port with the user's key (and the
        allowed origins), or back on a private port with a key only the app knows."""
        self.ctx.settings = AppSettings(**{**self.ctx.settings.__dict__, "server": server})
        self.ctx.save_settings()
        if server.lan and not self._lan_addresses:  # (a host name lookup: off the UI's event handling)
            self._lan_addresses = await asyncio.to_thread(lan_addresses)
        self.show_state()
        if self.engine.supervisor is not None:
            await self.engine.restart()
            self.show_state()

    def show_state(self) -> None:
        s, sup = self.ctx.settings.server, self.engine.supervisor
        if not s.enabled:
            text = "Off. The app's own engine listens on a private port, with a key only the app knows."
        elif sup is not None and sup.state == "ready" and sup.fixed_port:
            text = f"On: {self.engine.model_name} answers at {server_url(s.port)} (with the key above)."
            slots = sup.last_health.get("slots")
            if isinstance(slots, int):  # the engine's count (--parallel auto: what memory holds)
                text += f" {slots} request{'s' if slots > 1 else ''} at once; more wait their turn."
            if sup.host == LAN_HOST:
                where = ", ".join(f"http://{a}:{s.port}/v1" for a in self._lan_addresses)
                text += f" Other devices on this network: {where or f'this computer’s address, port {s.port}'}."
        elif sup is None and not self.engine.loading:
            text = "On: it starts with the next model you load."
        else:
            text = f"Starting on port {s.port}…"
        self.window.server_page.set_state(text)

    def _engine_log(self, line: str) -> None:
        if self.request_log.add_line(line) is not None:  # an API request (the app's own chats count too)
            self.window.server_page.set_requests([e.row() for e in self.request_log.entries()])
