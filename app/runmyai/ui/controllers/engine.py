"""The engine in use: a local model's engine started, watched and stopped (with its load options and Eject), or
a remote OpenAI-compatible endpoint connected instead (File → Connect, and back)."""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from PySide6.QtCore import Signal

from runmyai import __version__
from runmyai.chat.images import takes_images
from runmyai.engine.client import PROBE_TIMEOUT_S, ChatClient, ChatError, probe
from runmyai.engine.endpoint import Endpoint
from runmyai.engine.faults import EngineError, Fault
from runmyai.engine.load_options import (
    LoadError,
    LoadFacts,
    LoadOptions,
    ask_facts,
    check_options,
    has_own_context,
    save_options,
    saved_options,
)
from runmyai.engine.request_log import LAN_HOST
from runmyai.engine.stats import StatsClient
from runmyai.engine.supervisor import EngineState, EngineSupervisor
from runmyai.library.keys import LocalKey
from runmyai.library.launch import launch_flags, model_context
from runmyai.monitor import device_note, plain_device
from runmyai.ui.controllers.base import Room, Shared
from runmyai.ui.controllers.library import REMOTE_KEY, LibraryRoom
from runmyai.ui.load_dialog import LoadDialog
from runmyai.ui.main_window import ConnectDialog
from runmyai.ui.viewmodels import context_flags

STATE_WORDS: dict[EngineState, str] = {
    "stopped": "stopped",
    "starting": "starting…",
    "loading": "loading the model…",
    "ready": "ready",
    "crashed": "crashed",
    "restarting": "restarting…",
    "failed": "failed",
}


class EngineRoom(Room):
    # what is in use changed: the model lists and presets (models), the Server page (server) are drawn again
    models_changed = Signal()
    presets_changed = Signal()
    server_changed = Signal()
    started = Signal(object)  # a local model started: its preset (or None), for a new chat's defaults
    logged = Signal(str)  # a line of the engine's log

    def __init__(self, ctx: Shared, library: LibraryRoom, end_reply: Callable[[], Awaitable[None]]) -> None:
        super().__init__(ctx)
        self.lib = library
        self._end_reply = end_reply  # a reply in flight ends as stopped, before the engine it streams from
        self.supervisor: EngineSupervisor | None = None
        self.endpoint: Endpoint | None = None  # the engine in use (local or remote)
        self.chat_client: ChatClient | None = None
        self.model_name: str | None = None
        self.ready = asyncio.Event()  # set when a model can be chatted with
        self.loading = 0  # use_model calls in progress
        self._local_key: str | None = None  # the local model in use before File → Connect (Back to local loads it)
        self._endpoint_asked: tuple[str, str] = ("http://127.0.0.1:8080/v1", "")  # the Connect dialog's last entry
        self.connect_dialog: ConnectDialog | None = None
        self.probe_timeout_s = PROBE_TIMEOUT_S  # File → Connect's check of a server
        self._stats_task: asyncio.Task[None] | None = None
        self.images_task: asyncio.Task[None] | None = None  # asking the server whether its model reads pictures
        self._engine_task: asyncio.Task[Any] | None = None
        self.load_dialog: LoadDialog | None = None  # the last load dialog opened, and its tasks (tests await them)
        self.load_facts_task: asyncio.Task[Any] | None = None
        self.load_task: asyncio.Task[Any] | None = None
        w = self.window
        w.library.use_requested.connect(lambda key: self.ctx.spawn(self.use_model(key)))
        w.connect_endpoint_requested.connect(self.ask_endpoint)
        w.back_to_local_requested.connect(lambda: self.ctx.spawn(self.back_to_local()))
        w.stop_engine_requested.connect(lambda: self.ctx.spawn(self.stop_engine()))
        w.eject_requested.connect(lambda: self.ctx.spawn(self.eject()))
        w.chat.eject_requested.connect(lambda: self.ctx.spawn(self.eject()))
        w.chat.load_options_requested.connect(self.open_load_options)
        w.models_page.load_options_requested.connect(self.open_load_options)
        w.models_page.eject_requested.connect(lambda: self.ctx.spawn(self.eject()))
        w.restart_engine_requested.connect(lambda: self.ctx.spawn(self.restart()))
        w.chat.model_chosen.connect(self._pick_model)
        w.models_page.use_requested.connect(self._chat_with)

    def in_use(self) -> tuple[Path | None, str | None]:
        """The local model in use (None when none runs), and the remote endpoint's line in the model picker."""
        remote = None
        if self.endpoint is not None and not self.endpoint.local:
            remote = f"{self.model_name} · {urlsplit(self.endpoint.base_url).netloc}"
        return (self.supervisor.model if self.supervisor is not None else None), remote

    def _pick_model(self, key: str) -> None:
        """The chat's model picker: a local model loads (leaving a remote endpoint); the endpoint's own entry is
        what is in use already."""
        if key != REMOTE_KEY:
            self.ctx.spawn(self.use_model(key))

    def _chat_with(self, key: str) -> None:
        self.window.show_page("Chat")
        self.ctx.spawn(self.use_model(key))

    async def use_model(self, key: str) -> Endpoint | None:
        self.loading += 1  # (the server page says the engine is starting, not that it waits for a model)
        try:
            return await self._use_model(key)
        finally:
            self.loading -= 1
            self.server_changed.emit()

    async def _use_model(self, key: str) -> Endpoint | None:
        path = self.lib.model_path(key)
        if path is None:
            self.ctx.report("Download or import this model first.", "engine", "Loading a model")
            return None
        await self.stop_engine()
        local, preset = self.lib.local_of(path)
        flags = launch_flags(path, local, preset, self.ctx.autotune, self.ctx.engine_info)  # (--mmproj with them)
        settings = self.ctx.settings
        if not has_own_context(self.ctx.autotune, path):  # a context chosen for this model (its load dialog) wins
            flags += context_flags(settings.context_length)
        flags.append("--request-log")  # one log line per API request: the Server page's list
        server = settings.server
        if server.enabled:
            flags += [f for origin in server.cors_origins for f in ("--cors-origin", origin)]
        self.model_name = local.name if local else path.name
        sup = EngineSupervisor(
            path,
            flags,
            on_state=self._on_engine_state,
            on_log=self._on_engine_log,
            log_dir=self.ctx.paths.logs,
            exit_codes=self.ctx.engine_info.exit_codes,
            port=server.port if server.enabled else 0,
            api_key=server.api_key if server.enabled else None,
            # the local network: every address, and only ever with the user's key (the switch requires one)
            host=LAN_HOST if server.enabled and server.lan and server.api_key else "127.0.0.1",
        )
        self.supervisor = sup
        self.ctx.retry["engine"] = lambda: self.ctx.spawn(self.use_model(key))
        self._engine_task = asyncio.current_task()
        try:
            endpoint = await sup.start()
        except EngineError as e:
            if self.supervisor is not sup:  # the app stopped it on purpose (another model, the server switch):
                return None  # no failure to report (the walk-through showed 'could not start: … stopped before')
            self.ctx.report(str(e), "engine", f"{self.model_name} could not start")
            self.models_changed.emit()
            return None
        finally:
            self._engine_task = None
        engine_version = (sup.handshake or {}).get("version")
        if engine_version != __version__:
            await sup.stop()
            self.ctx.report(
                f"This engine is version {engine_version}, but Run My AI {__version__} needs the same version; "
                "reinstall Run My AI."
            )
            return None
        self.started.emit(preset)
        with contextlib.suppress(OSError):
            self._last_model_file().write_text(str(path), encoding="utf-8")
        self.lib.mark_used(path)
        self.window.notifications.succeeded("engine")
        self._attach(endpoint)
        self.models_changed.emit()
        self.presets_changed.emit()
        self.server_changed.emit()
        return endpoint

    async def use_default_model(self) -> Endpoint | None:
        """At start: the model used last, else the built-in one, so the window opens ready to chat."""
        last = self._read_last_model()
        usable = [m for m in self.lib.local_models if m.error is None]
        choice = next((m for m in usable if str(m.path) == last), None) or next((m for m in usable if m.bundled), None)
        if choice is None:
            return None
        return await self.use_model(str(LocalKey(choice.path)))

    def _last_model_file(self) -> Path:
        return self.ctx.paths.settings / "last-model.txt"

    def _read_last_model(self) -> str | None:
        try:
            return self._last_model_file().read_text(encoding="utf-8").strip() or None
        except OSError:
            return None

    def _attach(self, endpoint: Endpoint) -> None:
        self.endpoint = endpoint
        source = self._current_endpoint
        self.chat_client = ChatClient(source)
        if self._stats_task is not None:
            self._stats_task.cancel()
        self._stats_task = self.ctx.spawn(self._follow_stats(StatsClient(source)))
        self.window.graphs.reset()
        self.window.chat.set_images_allowed(False)  # (until the server says the model reads pictures)
        self.images_task = self.ctx.spawn(self._ask_images(self.chat_client))
        self.ready.set()
        self.window.chat.set_status(f"Chatting with {self.model_name or endpoint.base_url}.")

    async def _ask_images(self, client: ChatClient) -> None:
        """Pictures are offered in the chat only where the server says its model reads them (`/v1/models`'
        `modalities`: the engine started with the model's mmproj, or an endpoint that says so)."""
        try:
            entries = await client.model_entries()
        except ChatError:
            entries = []
        if client is self.chat_client:
            self.window.chat.set_images_allowed(any(takes_images(e) for e in entries))

    def _current_endpoint(self) -> Endpoint | None:
        if self.supervisor is not None:
            return self.supervisor.endpoint
        return self.endpoint

    async def _follow_stats(self, client: StatsClient) -> None:
        async for event in client.events():
            self.window.graphs.add(event)

    def _on_engine_log(self, line: str) -> None:
        self.window.log_view.append(line)
        self.logged.emit(line)
        note = device_note(line)
        if note is not None:  # where it computes (a GPU and its share, or the CPU and why) beside the graphs
            self.window.graphs.set_device(plain_device(note), note)
            on_gpu = note.startswith("Computing on ") and not note.startswith("Computing on the CPU")
            if on_gpu != self.window.graphs.has_gpu:
                self.window.graphs.set_has_gpu(on_gpu)

    def _on_engine_state(self, state: EngineState, fault: Fault | None) -> None:
        sentence = fault.sentence if fault else None
        last = self.supervisor.last_fault if self.supervisor is not None else None
        if state == "ready" and last is not None:
            sentence = f"Restarted after a fault: {last.sentence}"  # the user should know it happened
        self.window.set_engine_state(STATE_WORDS.get(state, state), sentence)
        self.server_changed.emit()  # every state: a restart said 'it starts with the next model you load' until ready
        if state != "ready":
            self.ready.clear()
        elif self.chat_client is not None:
            self.ready.set()

    async def stop_engine(self) -> None:
        # a reply in flight ends as stopped, as Stop ends it: switching models mid-reply said 'The reply failed:
        # The connection to the engine broke off' (walk-through)
        await self._end_reply()
        self.ready.clear()
        if self._stats_task is not None:
            self._stats_task.cancel()
            self._stats_task = None
        if self.chat_client is not None:
            await self.chat_client.aclose()
            self.chat_client = None
        sup, self.supervisor = self.supervisor, None
        if sup is not None:
            await sup.stop()
        self.endpoint = None
        self.window.set_connected(None)
        self.window.chat.set_images_allowed(False)

    def open_load_options(self, key: str) -> LoadDialog | None:
        """The load dialog: the engine is asked what fits here (`tokenwing info MODEL --json`, on the loop) while
        it opens; Load keeps the choice for the model and loads it."""
        path = self.lib.model_path(key)
        if path is None:
            return None
        local, preset = self.lib.local_of(path)
        max_context = model_context(local, preset)
        autotune = self.ctx.autotune
        dialog = LoadDialog(self.lib.name_of(path), saved_options(autotune, path), self.window)

        async def ask() -> None:
            try:
                dialog.set_facts(await ask_facts(path, max_context))
            except LoadError as e:
                dialog.set_failed(str(e))

        asking = self.ctx.spawn(ask())
        self.load_facts_task = asking

        def load(options: LoadOptions) -> None:
            try:
                chosen = check_options(options, dialog.facts or LoadFacts(None, max_context))
                save_options(autotune, path, chosen)
            except ValueError as e:
                dialog.show_error(str(e))
                return
            except OSError as e:
                dialog.show_error(f"Couldn't keep the settings: {e.strerror or e}.")
                return
            dialog.accept()
            self.lib.list_entries()  # a context or budget changes the estimate
            self.window.show_page("Chat")
            self.load_task = self.ctx.spawn(self.use_model(key))

        dialog.load_requested.connect(load)
        dialog.rejected.connect(asking.cancel)
        self.load_dialog = dialog
        dialog.open()
        return dialog

    async def eject(self) -> bool:
        """Eject (LM Studio's word): the local model stops and the engine process with all the RAM and VRAM it
        held is gone; the app stays usable (the chat says no model is loaded; the picker or My models loads one).
        False when no local model was loaded."""
        if self.supervisor is None:
            return False
        name = self.model_name
        await self.stop_engine()
        self.model_name = None
        self.window.set_engine_state("stopped (no model loaded)")
        self.window.chat.set_footer("", "Context: —")
        self.window.chat.set_status(f"{name or 'The model'} was ejected: no model is loaded. Choose one above.")
        self.models_changed.emit()
        self.presets_changed.emit()
        self.server_changed.emit()
        return True

    async def restart(self) -> None:
        sup = self.supervisor
        if sup is not None:
            await self.use_model(str(LocalKey(sup.model)))

    def ask_endpoint(self) -> ConnectDialog:
        s = self.ctx.settings.server
        note = "Connecting stops the model running here"
        note += f" and the API server on port {s.port}" if s.enabled else ""
        note += " until File → Back to local model. The address is checked first: a wrong one stops nothing."
        url, key = self._endpoint_asked
        dialog = ConnectDialog(self.window, url, key or os.environ.get("RUNMYAI_ENDPOINT_KEY", ""), note)
        checking: list[asyncio.Task[Any]] = []

        async def check(url: str, key: str) -> None:
            self._endpoint_asked = (url, key)
            dialog.set_checking(url or "the address")
            try:
                why = await self.use_endpoint(url, key or None, quiet=True)
            finally:
                dialog.set_checking(None)
            if why is None:
                dialog.accept()
            else:
                dialog.show_state(why)

        dialog.connect_requested.connect(lambda url, key: checking.append(self.ctx.spawn(check(url, key))))
        dialog.cancel_requested.connect(lambda: [t.cancel() for t in checking if not t.done()])
        self.connect_dialog = dialog
        dialog.open()
        return dialog

    async def use_endpoint(self, base_url: str, api_key: str | None, *, quiet: bool = False) -> str | None:
        """Chats with an OpenAI-compatible server instead of a local model. The server is asked for its models
        first (probe: a short timeout; cancel the awaiting task to stop it) and a bad one is refused while the
        local model still runs: the walk-through's bad address stopped the engine and the user's API server, and
        the chat still said it was with the local model. None once connected, else why not in one sentence (also
        a notification, unless `quiet`: the Connect dialog shows it itself)."""
        try:
            endpoint = Endpoint.remote(base_url, api_key)
            models = await probe(endpoint, self.probe_timeout_s)
        except (ValueError, ChatError) as e:
            why = f"That is not an endpoint address: {e}." if isinstance(e, ValueError) else str(e)
            self.ctx.errors.append(why)
            self.window.log_view.append(f"[app] connecting to {base_url!r}: {why}")
            if not quiet:
                self.ctx.retry["endpoint"] = lambda: self.ctx.spawn(self.use_endpoint(base_url, api_key))
                self.ctx.report(why, "endpoint", f"Connecting to {base_url}")
            return why
        self.window.notifications.succeeded("endpoint")
        if self.supervisor is not None:  # what File → Back to local model loads again
            self._local_key = str(LocalKey(self.supervisor.model))
        await self.stop_engine()
        endpoint = Endpoint.remote(base_url, api_key, models[0] if models else None)
        host = urlsplit(endpoint.base_url).netloc
        self.model_name = endpoint.model or host
        self.window.set_engine_state(f"not in use (chatting with {host})")
        self.window.graphs.set_device("")  # the local engine's device line is not the server's
        self._attach(endpoint)
        self.window.set_connected(endpoint.base_url)
        self.models_changed.emit()
        self.server_changed.emit()
        return None

    async def back_to_local(self) -> Endpoint | None:
        """File → Back to local model: the model that ran before File → Connect (else the one used last, else the
        built-in one) loads again."""
        if self.endpoint is None or self.endpoint.local:
            return None
        key = self._local_key
        if key is not None and self.lib.model_path(key) is not None:
            return await self.use_model(key)
        await self.stop_engine()
        return await self.use_default_model()
