"""Wires the Qt-free services to the widgets: every slow step is a task on the qasync loop, never a block."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import replace
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from PySide6.QtCore import QObject, QTimer, QUrl
from PySide6.QtGui import QDesktopServices
from PySide6.QtWidgets import (
    QApplication,
    QFileDialog,
    QMessageBox,
)

from runmyai import __version__
from runmyai.chat.draft_count import DraftCounter
from runmyai.chat.session import ChatSession, Refused, ReplyCutOff, Sink, footer, overflow_line
from runmyai.chat.store import ConversationStore, Message
from runmyai.chat.tools import ToolCall, ToolResult, call_detail
from runmyai.chat.transfer import TransferError, export_file, import_file, suggested_name
from runmyai.engine.autotune import (
    DECODE_PROBE_TOKENS,
    SMALL_MODEL_PROBE_TOKENS,
    AutotuneError,
    AutotuneRunner,
)
from runmyai.engine.client import PROBE_TIMEOUT_S, ChatClient, ChatError, ChatSettings, probe
from runmyai.engine.endpoint import Endpoint
from runmyai.engine.faults import EngineError, Fault
from runmyai.engine.info import EngineInfo, ask_engine, unknown
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
from runmyai.engine.request_log import LAN_HOST, RequestLog, lan_addresses
from runmyai.engine.stats import StatsClient
from runmyai.engine.supervisor import EngineState, EngineSupervisor
from runmyai.jsonfile import read_json, write_json_atomic
from runmyai.library.acquire import PERMANENT_HUB_KINDS, AcquireError, Acquirer, Job, JobStatus, RepoQuants
from runmyai.library.downloads import DownloadManager, DownloadStatus
from runmyai.library.estimate import DEFAULT_CALIBRATION, installed_estimate
from runmyai.library.hub import HubClient, HubError, HubModel
from runmyai.library.keys import HubKey, LocalKey, PresetKey, parse_key
from runmyai.library.launch import launch_flags, model_context
from runmyai.library.local import ImportCancelled, LibraryError, LocalLibrary, LocalModel
from runmyai.library.presets import Catalog, Preset, check_flags, load_catalog
from runmyai.machine import MachineInfo, probe_machine_async
from runmyai.mcp.approval import ApprovalPolicy, Decision
from runmyai.mcp.config import ConfigError, ConfigFile, set_disabled
from runmyai.mcp.runner import McpToolRunner, ToolEvents
from runmyai.mcp.servers import CallFailed, McpManager, ToolInfo
from runmyai.monitor import device_note, plain_device
from runmyai.paths import AppPaths, bundled_dir
from runmyai.speeds import chat_measurement, load_per_core, record_speed
from runmyai.ui import render, theme
from runmyai.ui.autotune_dialog import AutotuneDialog
from runmyai.ui.chat_panel import SamplingValues
from runmyai.ui.load_dialog import LoadDialog
from runmyai.ui.main_window import ConnectDialog, MainWindow
from runmyai.ui.mcp_dialog import ApprovalBox, McpDialog, parse_arguments
from runmyai.ui.notifications import job_line
from runmyai.ui.render import LibraryEntry, View
from runmyai.ui.transcript import ToolMark, failure_line
from runmyai.ui.viewmodels import (
    AppSettings,
    ModelRow,
    Notice,
    ServerSettings,
    SettingsFile,
    ago,
    context_flags,
    context_line,
    new_api_key,
    repo_of,
    search_messages,
    server_url,
)
from runmyai.units import human_bytes

REMOTE_KEY = "remote:"  # the model picker's entry for the connected endpoint's model
AUTOTUNE_OFFER = "autotune-offer"  # the notification offering to measure this machine
TOOLS_OFFER = "tools-do-not-fit"  # the notification offering to send a message again without tools
INFO_SHOWN_MS = 20_000  # how long a confirmation stays up unless hidden
UNDO_MS = 8_000  # how long a deleted chat's Undo is offered (then it is deleted for good)
UNDO_DELETE = "undo-delete:"  # its notification's key, before the chat's id

STATE_WORDS: dict[EngineState, str] = {
    "stopped": "stopped",
    "starting": "starting…",
    "loading": "loading the model…",
    "ready": "ready",
    "crashed": "crashed",
    "restarting": "restarting…",
    "failed": "failed",
}


class AppController(QObject):
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
        self.catalog: Catalog = load_catalog(presets_dir or bundled_dir("presets"))
        self.library = LocalLibrary(
            paths.models, resources_dir or bundled_dir("resources"), presets=self.catalog.presets
        )
        self.hub = HubClient(endpoint=hub_endpoint, offline=offline or os.environ.get("HF_HUB_OFFLINE") == "1")
        self.downloads = DownloadManager(self.hub, paths.downloads, paths.models, on_change=self._on_download)
        self.engine_info: EngineInfo = unknown("not asked yet")
        self.acquirer = Acquirer(
            self.hub,
            self.downloads,
            self.library,
            paths.jobs,
            engine=lambda: self.engine_info,
            machine=lambda: self.machine,
            on_job=self._on_job,
        )
        self.store = ConversationStore(paths.conversations_db)
        self.autotune = AutotuneRunner(paths)
        self.session = ChatSession(self.store, lambda: self.chat_client, lambda: self.model_name)
        # the token count under the input while typing: debounced, counted by the engine on the event loop
        self.draft_counter = DraftCounter(lambda: self.chat_client, self._draft_prompt, self._show_draft_count)
        self.load_dialog: LoadDialog | None = None  # the last load dialog opened, and its tasks (tests await them)
        self.load_facts_task: asyncio.Task[Any] | None = None
        self.load_task: asyncio.Task[Any] | None = None
        self.request_log = RequestLog()  # the Server page's recent requests, from the engine's log
        self._lan_addresses: list[str] = []  # this computer's addresses on its networks (the LAN switch's URLs)
        self.machine: MachineInfo | None = None
        self.local_models: list[LocalModel] = []
        self.hub_results: list[HubModel] = []
        self._loading = 0  # use_model calls in progress
        self.hub_query = ""  # Discover's search: its hub results first, the models here filtered by it
        self.hub_quants: dict[str, RepoQuants] = {}
        self._quants_loading: set[str] = set()
        self.supervisor: EngineSupervisor | None = None
        self.endpoint: Endpoint | None = None  # the engine in use (local or remote)
        self._local_key: str | None = None  # the local model in use before File → Connect (Back to local loads it)
        self._endpoint_asked: tuple[str, str] = ("http://127.0.0.1:8080/v1", "")  # the Connect dialog's last entry
        self.connect_dialog: ConnectDialog | None = None
        self.probe_timeout_s = PROBE_TIMEOUT_S  # File → Connect's check of a server
        self.chat_client: ChatClient | None = None
        self.model_name: str | None = None
        self.conversation_id: int | None = None
        self._tasks: set[asyncio.Task[Any]] = set()
        self._reply_task: asyncio.Task[Any] | None = None
        self._job: asyncio.Task[Any] | None = None  # the library's one long job (import, get, first-start repack)
        self._job_key: str | None = None  # its notification's key
        self._job_lock = asyncio.Lock()
        self._stats_task: asyncio.Task[None] | None = None
        self._footer_model: Path | None = None  # the model whose reply the chat footer's figures are of
        self.speed_task: asyncio.Task[None] | None = None  # saving the last reply's measured speed
        self._engine_task: asyncio.Task[Any] | None = None
        self.ready = asyncio.Event()  # set when a model can be chatted with
        self.errors: list[str] = list(self.catalog.errors)  # one line each, also shown to the user
        # MCP servers: mcp.json and the "always allow" choices in the app's home, the connections on this loop
        self.mcp_config = ConfigFile(paths.home / "mcp.json")
        self.mcp = McpManager(paths.logs, on_change=self._mcp_changed)
        self.mcp_policy = ApprovalPolicy(paths.home / "mcp-approvals.json")
        self.mcp_dialog: McpDialog | None = None
        self.autotune_dialog: AutotuneDialog | None = None  # the Autotune… dialog last opened, and its runs
        self.autotune_runs: list[asyncio.Task[Any]] = []
        self.approval: ApprovalBox | None = None  # the tool-call question on screen, if any
        self._tool_keys: dict[str, str] = {}  # a running turn's call id → its line in the transcript
        self._tools_tokens: int | None = None  # the chat's tool definitions' tokens, as the engine counted them
        self._shown_conversation: int | None = None  # the conversation the transcript shows
        self.settings_file = SettingsFile(paths.settings / "app.json")
        self.settings = self.settings_file.load()
        if not self.settings.server.api_key:  # the server never runs without a key: one is made at first start
            self.settings = self.settings.with_server(api_key=new_api_key())
            self._save_app_settings()
        self.library.extra_dirs = [Path(d) for d in self.settings.model_dirs]
        self.library.exit_kind = lambda code: self.engine_info.exit_kind(code)
        self._retry: dict[str, Callable[[], Any]] = {}  # a notification's key → what its Retry does
        self._deleting: dict[int, str] = {}  # chats deleted whose Undo is still offered → their titles
        self._conversation_query = ""
        self._cards_asked: set[str] = set()  # entries whose model card was asked for
        self._last_used_file = paths.settings / "last-used.json"
        self._apply_theme()
        self._connect()

    # ------------------------------------------------------------------------------------------ wiring
    def _connect(self) -> None:
        w = self.window
        lib, chat = w.library, w.chat
        lib.use_requested.connect(lambda key: self.spawn(self.use_model(key)))
        lib.download_requested.connect(self._download)
        lib.selected.connect(self._selected)
        lib.model_card_requested.connect(self._card_wanted)
        lib.import_requested.connect(self._choose_import)
        lib.autotune_requested.connect(self._open_autotune)
        lib.search_requested.connect(lambda q: self.spawn(self.search(q)))
        lib.downloads.pause_requested.connect(self._pause_row)
        lib.downloads.resume_requested.connect(self._resume_row)
        lib.downloads.cancel_requested.connect(self._cancel_row)
        lib.downloads.forget_requested.connect(self._forget_row)
        chat.send_requested.connect(self._send)
        chat.stop_requested.connect(self.stop_reply)
        chat.regenerate_requested.connect(self._regenerate)
        chat.edit_last_requested.connect(self._edit_last)
        chat.transcript.edit_requested.connect(self._edit_message)
        chat.export_conversation_requested.connect(lambda cid, kind: self._choose_export(int(cid), kind))
        chat.import_conversation_requested.connect(self._choose_chat_import)
        w.export_chat_requested.connect(
            lambda kind: self._choose_export(self.conversation_id, kind) if self.conversation_id is not None else None
        )
        w.import_chat_requested.connect(self._choose_chat_import)
        chat.transcript.branch_requested.connect(self._switch_branch)
        chat.new_conversation_requested.connect(self.new_conversation)
        chat.delete_conversation_requested.connect(self._delete_conversation)
        chat.conversation_selected.connect(lambda cid: self.open_conversation(int(cid)))
        chat.settings_changed.connect(self._save_settings)
        chat.tools_toggled.connect(lambda on: self._set_tools(on=on))
        chat.tool_server_toggled.connect(lambda name, on: self._set_tools(server=name, server_on=on))
        w.connect_endpoint_requested.connect(self._ask_endpoint)
        w.back_to_local_requested.connect(lambda: self.spawn(self.back_to_local()))
        w.stop_engine_requested.connect(lambda: self.spawn(self.stop_engine()))
        w.eject_requested.connect(lambda: self.spawn(self.eject()))
        chat.eject_requested.connect(lambda: self.spawn(self.eject()))
        chat.draft_changed.connect(self.draft_counter.changed)
        chat.load_options_requested.connect(self.open_load_options)
        w.models_page.load_options_requested.connect(self.open_load_options)
        w.models_page.eject_requested.connect(lambda: self.spawn(self.eject()))
        w.restart_engine_requested.connect(lambda: self.spawn(self._restart_engine()))
        w.mcp_requested.connect(self.open_mcp)
        chat.rename_conversation_requested.connect(self._rename_conversation)
        chat.search_changed.connect(self._search_conversations)
        chat.model_chosen.connect(self._pick_model)
        w.notice_area.retry_requested.connect(self._retry_notice)
        w.notice_area.forget_requested.connect(self._forget_notice)
        w.notice_area.cancel_requested.connect(self._cancel_notice)
        models = w.models_page
        models.use_requested.connect(self._chat_with)
        models.verify_requested.connect(lambda path: self.spawn(self.verify_model(Path(path))))
        models.open_folder_requested.connect(self._open_folder)
        models.delete_requested.connect(self._ask_delete)
        w.server_page.changed.connect(lambda s: self.spawn(self.set_server(s)))
        sp = w.settings_page
        sp.theme_changed.connect(self._set_theme)
        sp.context_changed.connect(self._set_context)
        sp.folders_changed.connect(lambda folders: self.spawn(self._set_folders(folders)))
        sp.add_folder_requested.connect(self._choose_folder)
        sp.preset_save_requested.connect(self._save_preset)
        sp.preset_apply_requested.connect(self._apply_preset)
        sp.preset_delete_requested.connect(self._delete_preset)
        w.server_page.set_settings(self.settings.server)
        sp.set_settings(self.settings, str(self.paths.models))
        self._show_presets()
        hints = QApplication.styleHints()
        self._follows_desktop = hints is not None
        if hints is not None:  # "follow the system": the desktop switching to dark switches the app
            hints.colorSchemeChanged.connect(self._system_scheme_changed)

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> asyncio.Task[Any]:
        """Runs a coroutine on the loop; its failure becomes a status line, never an unhandled exception."""
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._task_done)
        return task

    def _task_done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
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
        self.window.notifications.fail(key, title, line, retry=key in self._retry, details=details)

    def _retry_notice(self, key: str) -> None:
        again = self._retry.get(key)
        self.window.notifications.forget(key)
        if again is not None:
            again()

    def _cancel_notice(self, key: str) -> None:
        """A long job's Cancel, on its notification: the job that notification shows, if it still runs."""
        if key == self._job_key:
            self._cancel_job()
        elif key.startswith("download:"):  # a published file's: paused, as a job's Cancel leaves it resumable
            id_ = key.removeprefix("download:")
            if any(d.id == id_ for d in self.downloads.items()):
                self.downloads.pause(id_)

    def _forget_notice(self, key: str) -> None:
        self.window.notifications.forget(key)
        self._retry.pop(key, None)
        if key.startswith(UNDO_DELETE):  # Hide on a deleted chat's notice: no undo wanted, deleted now
            self._finish_delete(int(key.removeprefix(UNDO_DELETE)))
        if key == AUTOTUNE_OFFER:  # "Not now": the offer does not come back at every start
            self.settings = replace(self.settings, autotune_declined=True)
            self._save_app_settings()

    # ------------------------------------------------------------------------------------------ settings
    def _save_app_settings(self) -> None:
        try:
            self.settings_file.save(self.settings)
        except OSError as e:
            self.report(f"Couldn't save the settings: {e.strerror or e}.", "settings", "Settings")

    def _apply_theme(self) -> None:
        app = QApplication.instance()
        if isinstance(app, QApplication):
            c = theme.apply(app, self.settings.theme)
            self.window.graphs.set_colours(c.plot_bg, c.plot_fg)
            self.window.set_icon_colours(c.text, c.accent_text)

    def stop_following_desktop(self) -> None:
        """No more theme changes from the desktop (at shutdown: the application outlives this controller, and in
        the tests many controllers share one application). Once is enough; again does nothing."""
        hints = QApplication.styleHints()
        if self._follows_desktop and hints is not None:
            self._follows_desktop = False
            hints.colorSchemeChanged.disconnect(self._system_scheme_changed)

    def _system_scheme_changed(self, _scheme: object) -> None:
        if self.settings.theme == "system":  # a chosen light or dark stays as chosen
            self._apply_theme()

    def _set_theme(self, value: str) -> None:
        self.settings = AppSettings(**{**self.settings.__dict__, "theme": self.window.settings_page.theme_value()})
        self._save_app_settings()
        self._apply_theme()

    def _set_context(self, n: int) -> None:
        """The context length for the next start of a model (the running one keeps its own until restarted)."""
        if n == self.settings.context_length:
            return
        self.settings = AppSettings(**{**self.settings.__dict__, "context_length": n})
        self._save_app_settings()
        self._list_entries()
        if self.supervisor is not None:
            self.spawn(self._restart_engine())

    async def _set_folders(self, folders: list[str]) -> None:
        self.settings = AppSettings(**{**self.settings.__dict__, "model_dirs": tuple(folders)})
        self._save_app_settings()
        self.library.extra_dirs = [Path(f) for f in folders]
        self.window.settings_page.set_settings(self.settings, str(self.paths.models))
        await self.refresh_library()

    def _choose_folder(self) -> None:
        dialog = QFileDialog(self.window, "A folder with models", str(Path.home()))
        dialog.setFileMode(QFileDialog.FileMode.Directory)
        dialog.fileSelected.connect(
            lambda folder: (
                self.spawn(self._set_folders([*self.settings.model_dirs, folder]))
                if folder and folder not in self.settings.model_dirs
                else None
            )
        )
        dialog.open()

    def _preset_model(self) -> str | None:
        return self.model_name

    def _show_presets(self) -> None:
        model = self._preset_model()
        names = sorted(self.settings.presets.get(model or "", {}))
        self.window.settings_page.set_presets(model, names)

    def _save_preset(self, name: str) -> None:
        """The current chat's system prompt and sampling settings, saved under a name for the current model."""
        model = self._preset_model()
        if model is None:
            self.report("Load a model first: presets are saved per model.", "presets", "Chat presets")
            return
        values = self.window.chat.settings.values().__dict__
        presets = {k: dict(v) for k, v in self.settings.presets.items()}
        presets.setdefault(model, {})[name] = dict(values)
        self.settings = AppSettings(**{**self.settings.__dict__, "presets": presets})
        self._save_app_settings()
        self._show_presets()

    def _apply_preset(self, name: str) -> None:
        values = self.settings.presets.get(self._preset_model() or "", {}).get(name)
        if values is None:
            return
        fields = SamplingValues.__dataclass_fields__
        self.window.chat.settings.set_values(SamplingValues(**{k: v for k, v in values.items() if k in fields}))
        self._save_settings()
        self.window.show_page("Chat")

    def _delete_preset(self, name: str) -> None:
        model = self._preset_model() or ""
        presets = {k: dict(v) for k, v in self.settings.presets.items()}
        presets.get(model, {}).pop(name, None)
        self.settings = AppSettings(**{**self.settings.__dict__, "presets": presets})
        self._save_app_settings()
        self._show_presets()

    async def set_server(self, server: ServerSettings) -> None:
        """The local server switch: the engine is restarted on the user's port with the user's key (and the
        allowed origins), or back on a private port with a key only the app knows."""
        self.settings = AppSettings(**{**self.settings.__dict__, "server": server})
        self._save_app_settings()
        if server.lan and not self._lan_addresses:  # (a host name lookup: off the UI's event handling)
            self._lan_addresses = await asyncio.to_thread(lan_addresses)
        self._show_server_state()
        if self.supervisor is not None:
            await self._restart_engine()
            self._show_server_state()

    def _show_server_state(self) -> None:
        s, sup = self.settings.server, self.supervisor
        if not s.enabled:
            text = "Off. The app's own engine listens on a private port, with a key only the app knows."
        elif sup is not None and sup.state == "ready" and sup.fixed_port:
            text = f"On: {self.model_name} answers at {server_url(s.port)} (with the key above)."
            slots = sup.last_health.get("slots")
            if isinstance(slots, int):  # the engine's count (--parallel auto: what memory holds)
                text += f" {slots} request{'s' if slots > 1 else ''} at once; more wait their turn."
            if sup.host == LAN_HOST:
                where = ", ".join(f"http://{a}:{s.port}/v1" for a in self._lan_addresses)
                text += f" Other devices on this network: {where or f'this computer’s address, port {s.port}'}."
        elif sup is None and not self._loading:
            text = "On: it starts with the next model you load."
        else:
            text = f"Starting on port {s.port}…"
        self.window.server_page.set_state(text)

    # ------------------------------------------------------------------------------------------ start / stop
    async def start(self) -> None:
        for line in self.catalog.errors:
            self.window.log_view.append(f"[presets] {line}")
        self._show_conversations()
        await self.downloads.start()
        for status in self.downloads.items():
            self._on_download(status)
        self.machine = await probe_machine_async(self.paths.models, autotune_dir=self.paths.settings)
        self.engine_info = await ask_engine(self.paths.settings)
        if not self.engine_info.known:
            self.report(f"Could not ask the engine what it runs: {self.engine_info.error}.")
        for line in self.catalog.bind_engine(self.engine_info):  # (expert bytes and flags as the engine says)
            self.window.log_view.append(f"[presets] {line}")
        for preset in self.catalog.presets:  # its flags against the engine's own (names, kinds, defaults)
            for line in check_flags(preset, self.engine_info):
                self.window.log_view.append(f"[presets] {line}")
        self.window.graphs.set_has_gpu(bool(self.machine.gpus))
        await self.refresh_library()
        self._show_server_state()
        for job in self.acquirer.started():  # a job that failed for good is listed, not run again
            self._on_job(self.acquirer.status(job))
        self.spawn(self.start_mcp())
        await self.run_job("Preparing the built-in model", self._ensure_demo)
        self.offer_autotune()
        if self.acquirer.unfinished():
            self.spawn(self._resume_jobs())

    async def _ensure_demo(self, progress: Callable[[float, str], None]) -> None:
        demo = await self.library.ensure_bundled_demo(progress)
        if demo is not None:
            await self.refresh_library(select=str(LocalKey(demo.path)))

    async def shutdown(self) -> None:
        self.stop_following_desktop()
        self._finish_delete()  # the chats deleted in the last seconds: their Undo ends with the app
        self.stop_reply()
        await self.draft_counter.aclose()
        self._cancel_job()
        await self.stop_engine()
        await self.mcp.close()
        await self.downloads.close()
        for task in list(self._tasks):
            task.cancel()
        with contextlib.suppress(Exception):
            await asyncio.gather(*self._tasks, return_exceptions=True)
        self.store.close()

    # ------------------------------------------------------------------------------------------ library
    async def refresh_library(self, select: str | None = None) -> None:
        self.local_models = await self.library.scan()
        self._list_entries(select)
        self._show_models()

    def _show_models(self) -> None:
        """The model picker and the My models page, from the library and the one estimate."""
        entries = {e.key: e for e in self._entries(searched=False)}
        in_use = self.supervisor.model if self.supervisor is not None else None
        usable = [
            (str(LocalKey(m.path)), m.name)
            for m in self.local_models
            if entries.get(str(LocalKey(m.path))) and entries[str(LocalKey(m.path))].can_use
        ]
        current = str(LocalKey(in_use)) if in_use is not None else None
        if self.endpoint is not None and not self.endpoint.local:  # connected: the remote model, never a local one
            usable.insert(0, (REMOTE_KEY, f"{self.model_name} · {urlsplit(self.endpoint.base_url).netloc}"))
            current = REMOTE_KEY
        self.window.chat.set_models(usable, current)
        self.window.chat.eject_button.setEnabled(self.supervisor is not None)
        used = self._read_last_used()
        rows = []
        for m in self.local_models:
            key = str(LocalKey(m.path))
            e = entries.get(key)
            rows.append(
                ModelRow(
                    key=key,
                    name=m.name,
                    repo=repo_of(m.path, self.paths.models),
                    size=human_bytes(m.size_bytes),
                    arch=m.arch or "?",
                    estimate=(e.line if e is not None and e.line else (m.error or "—")),
                    last_used=ago(used.get(str(m.path))),
                    path=m.path,
                    bundled=m.bundled,
                    in_use=m.path == in_use,
                )
            )
        self.window.models_page.set_rows(rows)

    def _read_last_used(self) -> dict[str, float]:
        data = read_json(self._last_used_file) or {}
        return {k: float(v) for k, v in data.items() if isinstance(v, (int, float))}

    def _mark_used(self, path: Path) -> None:
        import time as _time

        used = self._read_last_used()
        used[str(path)] = _time.time()
        with contextlib.suppress(OSError):
            write_json_atomic(self._last_used_file, used)

    def _pick_model(self, key: str) -> None:
        """The chat's model picker: a local model loads (leaving a remote endpoint); the endpoint's own entry is
        what is in use already."""
        if key != REMOTE_KEY:
            self.spawn(self.use_model(key))

    def _open_folder(self, path_text: str) -> None:
        """My models' Open folder: the file manager, or where there is none (it failed silently), one line that
        says so, with the folder's path and a button that copies it."""
        folder = Path(path_text).parent
        key = "open-folder"
        if QDesktopServices.openUrl(QUrl.fromLocalFile(str(folder))):
            self.window.notifications.forget(key)
            return

        def copy() -> None:
            clipboard = QApplication.clipboard()
            if clipboard is not None:
                clipboard.setText(str(folder))
            self.confirm(key, "Path copied", f"{folder} is on the clipboard.")

        self._retry[key] = copy
        self.window.log_view.append(f"[app] no file manager opened {folder}")
        self.window.notifications.info(
            key, "No file manager opened the folder", f"The model is in {folder}", action="Copy path"
        )

    def _chat_with(self, key: str) -> None:
        self.window.show_page("Chat")
        self.spawn(self.use_model(key))

    async def verify_model(self, path: Path) -> bool:
        """Re-verify from My models: every expert's checksum, as a long job with progress and Cancel."""

        async def work(progress: Callable[[float, str], None]) -> None:
            progress(0.0, "checking every expert's checksum")
            await self.library.verify(path)

        name = self.name_of(path)
        ok = await self.run_job(f"Verifying {name}", work, key=f"verify:{path}")
        if ok:
            self.confirm(f"verify:{path}", f"{name} is intact", "Every expert checked out.")
        return ok

    def name_of(self, path: Path) -> str:
        """A model's name as the picker and My models say it (the walk-through's notices said its file's)."""
        return next((m.name for m in self.local_models if m.path == path), path.name)

    def _ask_delete(self, path_text: str) -> None:
        path = Path(path_text)
        box = QMessageBox(
            QMessageBox.Icon.Warning,
            "Delete the model?",
            f"Delete {self.name_of(path)} ({human_bytes(path.stat().st_size) if path.exists() else '?'}) from this "
            f"computer?\n\n{path}",
            QMessageBox.StandardButton.Cancel,
            self.window,
        )
        delete = box.addButton("Delete", QMessageBox.ButtonRole.DestructiveRole)
        box.buttonClicked.connect(lambda b: self.spawn(self.delete_model(path)) if b is delete else None)
        box.open()  # not exec(): the loop keeps running

    async def delete_model(self, path: Path) -> bool:
        if self.supervisor is not None and self.supervisor.model == path:
            self.report(f"{self.name_of(path)} is in use: load another model first.", "delete", "Deleting a model")
            return False
        try:
            await asyncio.to_thread(self.library.delete, path)
        except LibraryError as e:
            self.report(str(e), "delete", "Deleting a model")
            return False
        self.window.notifications.succeeded("delete")
        self.window.notifications.forget(f"verify:{path}")  # about a file that is gone
        self._forget_footer_of(path)
        await self.refresh_library()
        return True

    def _view(self) -> View:
        return View(self.machine, self.engine_info, lambda m, p: launch_flags(m.path, m, p, self.autotune))

    def _entries(self, *, searched: bool = True) -> list[LibraryEntry]:
        """Discover's entries: with `searched`, as its search shows them (the hub's results first, the rest
        filtered); without, every model here and curated (the picker and My models list every installed one)."""
        view = self._view()
        entries = [
            render.local_entry(m, self.catalog.get(m.preset_id) if m.preset_id else None, view)
            for m in self.local_models
        ]
        installed = {m.preset_id for m in self.local_models if m.preset_id}
        entries += [render.preset_entry(p, view) for p in self.catalog.presets if p.id not in installed]
        have = {m.path for m in self.local_models}
        hub = [
            render.hub_entry(
                h, q := self.hub_quants.get(h.repo), render.installed_quants(q, self.library.models_dir, have)
            )
            for h in self.hub_results
        ]
        return render.discover_entries(entries, hub, self.hub_query if searched else "")

    def _list_entries(self, select: str | None = None) -> list[LibraryEntry]:
        """Discover's cards, and the search's line counted from what is listed now (a model downloaded from the
        results joins them: the line said '0 here' beside its card)."""
        entries = self._entries()
        self.window.library.set_entries(entries, select)
        if self.hub_query:
            here = len(entries) - len(self.hub_results)
            self.window.library.set_search_line(render.search_line(self.hub_query, len(self.hub_results), here))
        return entries

    async def search(self, query: str) -> None:
        self.hub_query = query
        lib = self.window.library
        if not query:
            self.hub_results = []
            lib.set_search_line("")
        else:
            lib.set_search_line(render.search_line(query, None, 0))
            self._retry["search"] = lambda: self.spawn(self.search(query))
            try:
                found = await self.hub.search(query, "repacked")
                found += [m for m in await self.hub.search(query, "gguf") if m.repo not in {f.repo for f in found}]
            except HubError as e:
                lib.set_search_line("")
                self.report(str(e), "search", f"Searching the hub for “{query}”")
                return
            self.window.notifications.succeeded("search")
            self.hub_results = found[:20]
        entries = self._list_entries()
        if query and entries:
            lib.select(entries[0].key)  # the best match shown, its quants read
        if self.hub_results:
            self.spawn(self.load_quants(self.hub_results[0].repo))

    async def load_quants(self, repo: str) -> RepoQuants | None:
        """A hub repository's quants with their estimates (header bytes and the engine's plan; cached)."""
        if repo in self.hub_quants:
            return self.hub_quants[repo]
        if repo in self._quants_loading:
            return None
        self._quants_loading.add(repo)
        try:
            quants = await self.acquirer.quants(repo)
        except HubError as e:
            self._retry[f"quants:{repo}"] = lambda: self.spawn(self.load_quants(repo))
            self.report(str(e), f"quants:{repo}", f"Reading the quants of {repo}")
            return None
        finally:
            self._quants_loading.discard(repo)
        self.hub_quants[repo] = quants
        self._list_entries()
        return quants

    def _selected(self, text: str) -> None:
        key = parse_key(text)
        if isinstance(key, HubKey) and any(h.repo == key.repo for h in self.hub_results):
            self.spawn(self.load_quants(key.repo))

    def _card_wanted(self, key: str) -> None:
        entry = next((e for e in self._entries() if e.key == key), None)
        if entry is not None and entry.card_repo is not None and key not in self._cards_asked:
            self._cards_asked.add(key)
            self.spawn(self.load_model_card(key, entry.card_repo))

    async def load_model_card(self, key: str, repo: str) -> None:
        """The repository's README as the model card (the hub client retries with backoff)."""
        try:
            text = await self.hub.readme(repo)
        except HubError as e:
            self._cards_asked.discard(key)  # asked again the next time it is picked
            self.window.library.set_model_card(key, f"*The model card could not be read:* {e}")
            return
        self.window.library.set_model_card(key, text if text else f"*{repo} has no README.*")

    def _download(self, text: str) -> None:
        key = parse_key(text)
        if isinstance(key, PresetKey):
            p = self.catalog.get(key.id)
            if p is None:
                return
            if p.published and p.repo is not None:
                try:
                    self.downloads.enqueue(p.repo, p.file, sha256=p.sha256, size=p.size_bytes or None)
                except HubError as e:
                    self.report(str(e))
                return
            if p.gguf is None:
                return
            key = HubKey(p.gguf.repo, p.gguf.default)
        if isinstance(key, HubKey):
            self.spawn(self.get_model(key))

    async def get_model(self, key: HubKey) -> LocalModel | None:
        """One quant of a hub repository into the library (`runmyai get` does the same, without the window)."""
        result: list[LocalModel] = []

        async def work(progress: Callable[[float, str], None]) -> None:
            result.append(await self.acquirer.get(key, lambda p: progress(p.fraction, p.message)))

        await self.run_job(
            f"Getting {key.repo}" + (f" ({key.quant})" if key.quant else ""),
            work,
            f"get:{key.repo}",
            lambda: self.spawn(self.get_model(key)),
        )
        self._list_jobs()  # stopped or failed: its row, to resume or forget
        await self.refresh_library(select=str(LocalKey(result[0].path)) if result else None)
        return result[0] if result else None

    def _list_jobs(self) -> None:
        """The downloads table's rows of the jobs not running (paused or failed): a running job shows in its
        notification and on its Discover card only."""
        for job in self.acquirer.started():
            if not self.acquirer.is_running(job.id):
                self._on_job(self.acquirer.status(job))

    async def _resume_jobs(self, jobs: list[Job] | None = None) -> None:
        """Downloads and repacks an earlier run left unfinished continue where they stopped (or `jobs`, asked for
        again from their row)."""
        for job in jobs if jobs is not None else self.acquirer.unfinished():

            async def work(progress: Callable[[float, str], None], job: Job = job) -> None:
                await self.acquirer.run(job, lambda p: progress(p.fraction, p.message))

            again = functools.partial(self._resume_row, f"job:{job.id}")
            await self.run_job(f"Resuming {job.repo} ({job.quant})", work, f"get:{job.repo}", again)
        self._list_jobs()
        await self.refresh_library()

    def _on_download(self, s: DownloadStatus) -> None:
        """A published model file's download, as a job's: while it runs, its notification (progress, and Cancel,
        which pauses it: it stays resumable) and the card of the preset it belongs to; stopped, its row in the
        downloads table (Resume, Forget); failed, also its notification with Retry unless the failure is
        permanent. A job's shards have no row and no notification of their own: their job's show their progress
        (the walk-through saw one download in three places: a notification, a task row and this table; and a
        preset's file download in the table alone, nowhere near the notification area)."""
        table, notes = self.window.library.downloads, self.window.notifications
        if s.dest is not None and s.dest.is_relative_to(self.paths.jobs):
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
            self._retry.pop(key, None)
            self.downloads.forget(s.id)
            if s.dest is not None and s.dest.name.endswith(".tw.gguf"):
                self.spawn(self.refresh_library())
            return
        if s.state == "failed":
            if (shown := notes.get(key)) is None or shown.kind != "error":  # once, not at every change
                if s.error_kind not in PERMANENT_HUB_KINDS:
                    self._retry[key] = functools.partial(self.downloads.resume, s.id)
                else:
                    self._retry.pop(key, None)
                self.report(f"{title} failed: {s.message}", key, f"{title} failed")
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
            self._cancel_job()  # the library's job slot runs it: stopped there, it stays resumable

    def _resume_row(self, row: str) -> None:
        if not row.startswith("job:"):
            self.downloads.resume(row)
        elif (job := self.acquirer.find(row.removeprefix("job:"))) is not None and not self.acquirer.is_running(job.id):
            self.spawn(self._resume_jobs([job]))

    def _cancel_row(self, row: str) -> None:
        if row.startswith("job:"):
            self._forget_row(row)  # a cancelled job keeps nothing: forgotten with all it fetched
        else:
            self.downloads.cancel(row)

    def _forget_row(self, row: str) -> None:
        if row.startswith("job:"):
            self.spawn(self.acquirer.forget(row.removeprefix("job:")))
        else:
            self.downloads.forget(row)
            self.window.library.downloads.remove_item(row)

    def _choose_import(self) -> None:
        dialog = QFileDialog(self.window, "Import GGUF", str(Path.home()), "GGUF models (*.gguf)")
        dialog.setFileMode(QFileDialog.FileMode.ExistingFiles)
        dialog.filesSelected.connect(lambda files: self.spawn(self.import_files([Path(f) for f in files])))
        dialog.open()  # not exec(): the loop keeps running

    async def import_files(self, files: list[Path]) -> LocalModel | None:
        result: list[LocalModel] = []

        async def job(progress: Callable[[float, str], None]) -> None:
            result.append(await self.library.import_gguf(files, progress))

        await self.run_job(f"Importing {files[0].name}", job, "import", lambda: self.spawn(self.import_files(files)))
        await self.refresh_library(select=str(LocalKey(result[0].path)) if result else None)
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
                self._retry.pop(key, None)
                return True
            except (asyncio.CancelledError, ImportCancelled):
                notes.forget(key)
                self.errors.append(f"{label}: stopped.")
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
                    self._retry[key] = again
                else:
                    self._retry.pop(key, None)
                # the engine's own words (a failed import's "magic b'hell'", its exit code) only under Details
                detail = e.detail if isinstance(e, LibraryError) else None
                self.report(f"{label} failed: {e}", key, f"{label} failed", details=detail)
                return False
            finally:
                self._job = self._job_key = None
                if repo is not None:
                    panel.set_progress(repo, None)

    def _cancel_job(self) -> None:
        if self._job is not None and not self._job.done():
            self._job.cancel()

    # ------------------------------------------------------------------------------------------ engine
    def model_path(self, text: str) -> Path | None:
        key = parse_key(text)
        if isinstance(key, LocalKey):
            return key.path
        if isinstance(key, PresetKey):
            match = next((m for m in self.local_models if m.preset_id == key.id), None)
            return match.path if match else None
        return None

    async def use_model(self, key: str) -> Endpoint | None:
        self._loading += 1  # (the server page says the engine is starting, not that it waits for a model)
        try:
            return await self._use_model(key)
        finally:
            self._loading -= 1
            self._show_server_state()

    async def _use_model(self, key: str) -> Endpoint | None:
        path = self.model_path(key)
        if path is None:
            self.report("Download or import this model first.", "engine", "Loading a model")
            return None
        await self.stop_engine()
        local = next((m for m in self.local_models if m.path == path), None)
        preset = self.catalog.get(local.preset_id) if local and local.preset_id else None
        flags = launch_flags(path, local, preset, self.autotune)
        if not has_own_context(self.autotune, path):  # a context chosen for this model (its load dialog) wins
            flags += context_flags(self.settings.context_length)
        flags.append("--request-log")  # one log line per API request: the Server page's list
        server = self.settings.server
        if server.enabled:
            flags += [f for origin in server.cors_origins for f in ("--cors-origin", origin)]
        self.model_name = local.name if local else path.name
        sup = EngineSupervisor(
            path,
            flags,
            on_state=self._on_engine_state,
            on_log=self._on_engine_log,
            log_dir=self.paths.logs,
            exit_codes=self.engine_info.exit_codes,
            port=server.port if server.enabled else 0,
            api_key=server.api_key if server.enabled else None,
            # the local network: every address, and only ever with the user's key (the switch requires one)
            host=LAN_HOST if server.enabled and server.lan and server.api_key else "127.0.0.1",
        )
        self.supervisor = sup
        self._retry["engine"] = lambda: self.spawn(self.use_model(key))
        self._engine_task = asyncio.current_task()
        try:
            endpoint = await sup.start()
        except EngineError as e:
            if self.supervisor is not sup:  # the app stopped it on purpose (another model, the server switch):
                return None  # no failure to report (the walk-through showed 'could not start: … stopped before')
            self.report(str(e), "engine", f"{self.model_name} could not start")
            self._show_models()
            return None
        finally:
            self._engine_task = None
        engine_version = (sup.handshake or {}).get("version")
        if engine_version != __version__:
            await sup.stop()
            self.report(
                f"This engine is version {engine_version}, but Run My AI {__version__} needs the same version; "
                "reinstall Run My AI."
            )
            return None
        if preset is not None and self.conversation_id is not None and not self.store.messages(self.conversation_id):
            self._apply_chat_defaults(self.conversation_id, preset)
        with contextlib.suppress(OSError):
            self._last_model_file().write_text(str(path), encoding="utf-8")
        self._mark_used(path)
        self.window.notifications.succeeded("engine")
        self._attach(endpoint)
        self._show_models()
        self._show_presets()
        self._show_server_state()
        return endpoint

    async def use_default_model(self) -> Endpoint | None:
        """At start: the model used last, else the built-in one, so the window opens ready to chat."""
        last = self._read_last_model()
        usable = [m for m in self.local_models if m.error is None]
        choice = next((m for m in usable if str(m.path) == last), None) or next((m for m in usable if m.bundled), None)
        if choice is None:
            return None
        return await self.use_model(str(LocalKey(choice.path)))

    def _last_model_file(self) -> Path:
        return self.paths.settings / "last-model.txt"

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
        self._stats_task = self.spawn(self._follow_stats(StatsClient(source)))
        self.window.graphs.reset()
        self.ready.set()
        self.window.chat.set_status(f"Chatting with {self.model_name or endpoint.base_url}.")

    def _current_endpoint(self) -> Endpoint | None:
        if self.supervisor is not None:
            return self.supervisor.endpoint
        return self.endpoint

    async def _follow_stats(self, client: StatsClient) -> None:
        async for event in client.events():
            self.window.graphs.add(event)

    def _on_engine_log(self, line: str) -> None:
        self.window.log_view.append(line)
        entry = self.request_log.add_line(line)
        if entry is not None:  # an API request: the Server page's list (the app's own chats count too)
            self.window.server_page.set_requests([e.row() for e in self.request_log.entries()])
            return
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
        self._show_server_state()  # every state: a restart said 'it starts with the next model you load' until ready
        if state != "ready":
            self.ready.clear()
        elif self.chat_client is not None:
            self.ready.set()

    async def stop_engine(self) -> None:
        # a reply in flight ends as stopped, as Stop ends it: switching models mid-reply said 'The reply failed:
        # The connection to the engine broke off' (walk-through)
        reply = self._reply_task
        if reply is not None and not reply.done() and reply is not asyncio.current_task():
            reply.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await reply
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

    def open_load_options(self, key: str) -> LoadDialog | None:
        """The load dialog: the engine is asked what fits here (`tokenwing info MODEL --json`, on the loop) while
        it opens; Load keeps the choice for the model and loads it."""
        path = self.model_path(key)
        if path is None:
            return None
        local = next((m for m in self.local_models if m.path == path), None)
        preset = self.catalog.get(local.preset_id) if local and local.preset_id else None
        max_context = model_context(local, preset)
        dialog = LoadDialog(self.name_of(path), saved_options(self.autotune, path), self.window)

        async def ask() -> None:
            try:
                dialog.set_facts(await ask_facts(path, max_context))
            except LoadError as e:
                dialog.set_failed(str(e))

        asking = self.spawn(ask())
        self.load_facts_task = asking

        def load(options: LoadOptions) -> None:
            try:
                chosen = check_options(options, dialog.facts or LoadFacts(None, max_context))
                save_options(self.autotune, path, chosen)
            except ValueError as e:
                dialog.show_error(str(e))
                return
            except OSError as e:
                dialog.show_error(f"Couldn't keep the settings: {e.strerror or e}.")
                return
            dialog.accept()
            self._list_entries()  # a context or budget changes the estimate
            self.window.show_page("Chat")
            self.load_task = self.spawn(self.use_model(key))

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
        self._show_models()
        self._show_presets()
        self._show_server_state()
        return True

    async def _restart_engine(self) -> None:
        sup = self.supervisor
        if sup is not None:
            await self.use_model(str(LocalKey(sup.model)))

    def _ask_endpoint(self) -> ConnectDialog:
        s = self.settings.server
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

        dialog.connect_requested.connect(lambda url, key: checking.append(self.spawn(check(url, key))))
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
            self.errors.append(why)
            self.window.log_view.append(f"[app] connecting to {base_url!r}: {why}")
            if not quiet:
                self._retry["endpoint"] = lambda: self.spawn(self.use_endpoint(base_url, api_key))
                self.report(why, "endpoint", f"Connecting to {base_url}")
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
        self._show_models()
        self._show_server_state()
        return None

    async def back_to_local(self) -> Endpoint | None:
        """File → Back to local model: the model that ran before File → Connect (else the one used last, else the
        built-in one) loads again."""
        if self.endpoint is None or self.endpoint.local:
            return None
        key = self._local_key
        if key is not None and self.model_path(key) is not None:
            return await self.use_model(key)
        await self.stop_engine()
        return await self.use_default_model()

    # ------------------------------------------------------------------------------------------ autotune
    def _open_autotune(self, key: str) -> None:
        path = self.model_path(key)
        if path is None:
            return
        dialog = AutotuneDialog(self.name_of(path), self.window)
        running: list[asyncio.Task[Any]] = []

        def show() -> None:
            saved = self.autotune.saved(path)
            overrides = {k: str(v) for k, v in self.autotune.overrides(path).items()}
            if saved is not None:
                dialog.show_result(saved.machine_lines(), saved.settings, saved.reasons, overrides)

        async def run() -> None:
            dialog.set_running(True)
            outcome = "Stopped."

            def measured() -> None:  # the engine's last process has exited: the bar and "measuring…" end now
                nonlocal outcome
                outcome = "Measured. The speed estimates now use it."
                dialog.set_running(False, outcome)
                show()

            try:
                await self.run_autotune(path, dialog.show_progress, measured=measured)
            except AutotuneError as e:
                outcome = str(e)
            finally:
                dialog.set_running(False, outcome)

        def save(values: dict[str, str]) -> None:
            self.autotune.set_overrides(path, values)
            self._list_entries()  # a budget or context override changes the estimate

        self.autotune_dialog, self.autotune_runs = dialog, running  # (tests wait for a run at its end)
        dialog.run_requested.connect(lambda: running.append(self.spawn(run())))
        dialog.cancel_requested.connect(lambda: [t.cancel() for t in running])
        dialog.overrides_saved.connect(save)
        dialog.rejected.connect(lambda: [t.cancel() for t in running])
        show()
        dialog.open()

    async def run_autotune(
        self,
        path: Path,
        progress: Callable[[str], None] | None = None,
        *,
        decode_tokens: int = DECODE_PROBE_TOKENS,
        measured: Callable[[], None] | None = None,
    ) -> None:
        """Autotune for a model, then every estimate again: the machine probe now holds what autotune measured
        (the drive's read speed, the decode speed that calibrates the estimate, the GPU's copy speed). Discover's
        cards, My models' rows (they kept the old estimate) and `runmyai list` (it reads the saved result).
        `measured`: called as the measurement ends (its last engine process exited, its result saved), before
        the estimates are worked out again."""
        await self.autotune.run(path, progress, exit_codes=self.engine_info.exit_codes, decode_tokens=decode_tokens)
        if measured is not None:
            measured()
        await self._estimate_again()

    async def _estimate_again(self) -> None:
        """Every estimate again, from the machine probe that now holds what was measured."""
        self.machine = await probe_machine_async(self.paths.models, autotune_dir=self.paths.settings)
        self._list_entries()
        self._show_models()

    def offer_autotune(self) -> bool:
        """At start, while nothing was measured here: one click measures this machine with the built-in model.
        The estimate otherwise rests on defaults fitted on an idle machine of another class (docs/results.md):
        on this busy 2-core one the walk-through saw the built-in model estimated at ~335 tok/s and measured
        0.8-11.5. The app does not measure unasked: autotune loads the CPU and the drive (with the built-in model
        1.2 s of `tokenwing autotune`, then a 32-token decode, on this 2-core machine)."""
        m = self.machine
        model = next((x for x in self.local_models if x.bundled and x.error is None), None)
        measured = m is not None and (m.decode_probe is not None or bool(m.speeds))  # (a chat's speed counts too)
        if m is None or measured or self.settings.autotune_declined or model is None:
            return False
        path = model.path
        self._retry[AUTOTUNE_OFFER] = lambda: self.spawn(self.measure_machine(path))
        self.window.notifications.offer(
            AUTOTUNE_OFFER,
            "Measure this machine?",
            "The speed estimates use defaults from another machine. A short measurement with the built-in model "
            "(seconds; in the background, you can keep chatting) makes them this machine's.",
            "Measure now",
        )
        return True

    def _measure_again(self, path: Path) -> None:
        self.spawn(self.measure_machine(path))

    async def measure_machine(self, path: Path) -> bool:
        """The offer's "Measure now": autotune as a long job (progress and Cancel in its notification), then
        every estimate again. False if it failed or was cancelled."""

        async def work(progress: Callable[[float | None, str], None]) -> None:
            progress(None, "Timing the drive and a short reply of the built-in model")
            await self.autotune.run(
                path,
                lambda line: progress(None, line),
                exit_codes=self.engine_info.exit_codes,
                decode_tokens=SMALL_MODEL_PROBE_TOKENS,
            )

        before = self._estimate_line(path)
        # the job (its notification's bar) ends as the measurement's last engine process exits; the estimates are
        # worked out again after it, not under a bar that has nothing left to measure
        ok = await self.run_job("Measuring this machine", work, "autotune", lambda: self._measure_again(path))
        if ok:
            await self._estimate_again()
            after = self._estimate_line(path)
            parts = before.split(" · ")  # "Runs well here · ~167–502 tok/s · estimated from its shape"
            was = f" (the defaults said {parts[1]})" if len(parts) > 1 else ""
            now = f"{after[0].lower()}{after[1:]}" if after else "has its estimate"
            self.confirm(
                "autotune",
                "Measured",
                f"The speed estimates now use what this machine measured: {self.name_of(path)} {now}{was}.",
            )
        return ok

    def confirm(self, key: str, title: str, text: str) -> None:
        """A confirmation ("… is intact", "Measured"): a notice that leaves by itself after INFO_SHOWN_MS unless
        something replaced it. Kept until Hide, it stayed above every page for the rest of the session (the
        walk-through's "is intact" outlived the model it was about)."""
        notes = self.window.notifications
        notes.info(key, title, text)
        shown = notes.get(key)
        QTimer.singleShot(INFO_SHOWN_MS, lambda: None if notes.get(key) != shown else notes.forget(key))

    def _estimate_line(self, path: Path) -> str:
        """A model's estimate in one line, as its card says it ("Runs well here · ~18.4 tok/s")."""
        entry = next((e for e in self._entries(searched=False) if e.key == str(LocalKey(path))), None)
        return entry.line if entry is not None else ""

    # ------------------------------------------------------------------------------------------ chat
    def _show_conversations(self) -> None:
        conversations = [c for c in self.store.list() if c.id not in self._deleting]
        if not conversations:
            conversations = [self.store.create()]
        if (
            self.conversation_id is None
            or self.conversation_id in self._deleting
            or self.store.get(self.conversation_id) is None
        ):
            self.conversation_id = conversations[0].id
        self._list_conversations()
        self.open_conversation(self.conversation_id)

    def _list_conversations(self) -> None:
        """The sidebar's list: every conversation, or those whose title or messages hold the search's words."""
        items = [(str(c.id), c.title) for c in self.store.list() if c.id not in self._deleting]
        if self._conversation_query:
            items = search_messages(
                items, lambda cid: (m.content for m in self.store.messages(int(cid))), self._conversation_query
            )
        self.window.chat.set_conversations(items, str(self.conversation_id))

    def _search_conversations(self, query: str) -> None:
        self._conversation_query = query
        self._list_conversations()

    def _rename_conversation(self, cid: str, title: str) -> None:
        conv = self.store.get(int(cid))
        if conv is not None and conv.title != title:
            self.store.rename(int(cid), title)
        self._list_conversations()

    def open_conversation(self, conversation_id: int, *, while_streaming: bool = False) -> None:
        """Shows a conversation. `while_streaming`: the turn that streams redraws its own conversation (a
        regenerate drops the old reply first); a user's click is refused meanwhile."""
        if not while_streaming and self._reply_task is not None and not self._reply_task.done():
            return  # switching is disabled while a reply streams (the list is re-selected below)
        conv = self.store.get(conversation_id)
        if conv is None:
            return
        switched = conversation_id != self._shown_conversation
        self.conversation_id = self._shown_conversation = conversation_id
        t = self.window.chat.transcript
        t.clear_messages()
        branches = self.store.branch_positions(conversation_id)  # "< n/of >" where a turn has other versions
        note = conv.settings.overflow  # the last reply's context notice, kept with the chat
        messages = self.store.messages(conversation_id)
        for m in messages:
            t.add_message(
                m.role,
                m.content,
                footer(m) if m.role == "assistant" else "",
                m.reasoning,
                _marks(m),
                message_id=m.id,
                branch=branches.get(m.id),
                failure=failure_line("it was cut off by an error.") if m.finish_reason == "error" else "",
                notice=overflow_line(note) if note is not None and note.get("message_id") == m.id else "",
            )
        s = conv.settings
        self.window.chat.settings.set_values(
            SamplingValues(
                system_prompt=conv.system_prompt,
                temperature=s.temperature if s.temperature is not None else 0.7,
                top_p=s.top_p if s.top_p is not None else 1.0,
                top_k=s.top_k or 0,
                min_p=s.min_p or 0.0,
                max_tokens=s.max_tokens or 0,
                seed=s.seed if s.seed is not None else -1,
                repeat_penalty=s.repeat_penalty or 1.0,
                context_overflow=s.context_overflow or "rolling",
            )
        )
        if not while_streaming:
            self._show_chat_state(messages, switched)

    def _show_chat_state(self, messages: list[Message], switched: bool) -> None:
        """The footer, status and tools of the conversation on screen: its own, never the one shown before (a new
        chat showed the last one's error, speed and "512/512")."""
        chat = self.window.chat
        if switched:
            self.window.notifications.forget("chat")
            self.window.notifications.forget(TOOLS_OFFER)
            chat.set_status(f"Chatting with {self.model_name}." if self.model_name and self.chat_client else "")
        last = next((m for m in reversed(messages) if m.role == "assistant"), None)
        speed = f"last reply {last.tokens_per_s:.1f} tok/s" if last is not None and last.tokens_per_s else ""
        chat.set_footer(speed, context_line(None, None))
        self._show_tools()
        if self.chat_client is not None:
            self.spawn(self.count_context())

    async def count_context(self) -> None:
        """The context line and the tools' token count of the conversation on screen, counted by the engine
        (`/v1/chat/count`, the model's own template); nothing where the server cannot count."""
        cid, client = self.conversation_id, self.chat_client
        if cid is None or client is None:
            return
        payload = self.store.chat_payload(cid)
        runner = self._tools(cid)
        tools = runner.openai_tools() if runner is not None else []
        try:
            count = await client.count(payload or [{"role": "user", "content": ""}], tools or None)
        except ChatError:
            return
        if cid != self.conversation_id:
            return  # another chat is on screen by now
        self._tools_tokens = count.tools_tokens if tools else None
        self._show_tools()
        used = count.prompt_tokens if payload else count.tools_tokens
        speed = self.window.chat.speed_label.text()
        self.window.chat.set_footer(speed, context_line(min(used, count.n_ctx), count.n_ctx))

    def _show_tools(self) -> None:
        """The tools button: on or off in this chat, per server, and their definitions' tokens once counted."""
        conv = self.store.get(self.conversation_id) if self.conversation_id is not None else None
        s = conv.settings if conv is not None else ChatSettings()
        off = set(s.tools_off or [])
        servers = [
            (v.name, f"{len(v.tools)} tool{'' if len(v.tools) == 1 else 's'}", v.name not in off)
            for v in self.mcp.views()
            if v.state == "ready" and v.tools
        ]
        on = s.tools is not False
        used = [name for name, _, server_on in servers if server_on]
        if not servers:
            line = ""
        elif not on or not used:
            line = "Tools off"
        else:
            line = f"Tools: {', '.join(used)}"
            if self._tools_tokens is not None:
                line += f" · {self._tools_tokens:,} tokens"
        self.window.chat.set_tools(line, on, servers)

    def _set_tools(self, on: bool | None = None, server: str | None = None, server_on: bool = True) -> None:
        """The chat's tools on or off, or one server's (kept in the conversation's settings)."""
        cid = self.conversation_id
        conv = self.store.get(cid) if cid is not None else None
        if cid is None or conv is None:
            return
        s = conv.settings
        if on is not None:
            s = replace(s, tools=on)
        if server is not None:
            off = [n for n in (s.tools_off or []) if n != server] + ([] if server_on else [server])
            s = replace(s, tools_off=off or None)
        self.store.set_settings(cid, s)
        self._tools_tokens = None
        self._show_tools()
        if self.chat_client is not None:
            self.spawn(self.count_context())

    def new_conversation(self) -> None:
        preset = self._current_preset()
        conv = self.store.create(model=self.model_name)
        if preset is not None:
            self._apply_chat_defaults(conv.id, preset)
        self.conversation_id = conv.id
        self._show_conversations()

    def _current_preset(self) -> Preset | None:
        if self.supervisor is None:
            return None
        local = next((m for m in self.local_models if m.path == self.supervisor.model), None)
        return self.catalog.get(local.preset_id) if local and local.preset_id else None

    def _apply_chat_defaults(self, conversation_id: int, p: Preset) -> None:
        c = p.chat
        self.store.set_system_prompt(conversation_id, c.system_prompt)
        self.store.set_settings(
            conversation_id,
            # max tokens: a share of the context, whatever it is (512 was the demo model's whole context)
            ChatSettings(temperature=c.temperature, top_p=c.top_p, top_k=c.top_k, min_p=c.min_p, max_tokens=None),
        )
        if conversation_id == self.conversation_id:
            self.open_conversation(conversation_id)

    def _delete_conversation(self, cid: str) -> None:
        """Delete, with Undo: the chat leaves the list at once and is deleted from the store only when its
        notification goes (after UNDO_MS, on Hide, or at shutdown); Undo brings it back as it was. It was deleted
        at one click, with neither a question nor a way back (the walk-through)."""
        if self._reply_task is not None and not self._reply_task.done():
            return
        conv = self.store.get(int(cid))
        if conv is None:
            return
        self._deleting[conv.id] = conv.title
        if self.conversation_id == conv.id:
            self.conversation_id = None
        self._show_conversations()
        key = f"{UNDO_DELETE}{conv.id}"
        self._retry[key] = lambda: self.undo_delete(conv.id)
        notes = self.window.notifications
        notes.info(key, "Chat deleted", f"“{conv.title or 'New chat'}” was deleted.", action="Undo")
        shown = notes.get(key)
        # (an Undo and a second Delete of the same chat show a new notice: this timer is then not its own)
        QTimer.singleShot(UNDO_MS, lambda: self._finish_delete(conv.id) if notes.get(key) in (shown, None) else None)

    def undo_delete(self, conversation_id: int) -> None:
        """The deleted chat's Undo: back in the list, shown."""
        if self._deleting.pop(conversation_id, None) is None:
            return
        self._retry.pop(f"{UNDO_DELETE}{conversation_id}", None)
        self.window.notifications.forget(f"{UNDO_DELETE}{conversation_id}")
        self.conversation_id = conversation_id
        self._show_conversations()

    def _finish_delete(self, conversation_id: int | None = None) -> None:
        """Deletes for good the chats whose Undo time is over (`conversation_id`), or all of them (None)."""
        ids = list(self._deleting) if conversation_id is None else [conversation_id]
        for cid in ids:
            if self._deleting.pop(cid, None) is not None:
                self.store.delete(cid)
            self._retry.pop(f"{UNDO_DELETE}{cid}", None)
            self.window.notifications.forget(f"{UNDO_DELETE}{cid}")

    def _save_settings(self) -> None:
        if self.conversation_id is None:
            return
        v = self.window.chat.settings.values()
        conv = self.store.get(self.conversation_id)
        if conv is None:
            return
        self.store.set_system_prompt(self.conversation_id, v.system_prompt)
        self.store.set_settings(
            self.conversation_id,
            replace(  # (the chat's tools and context notice stay)
                conv.settings,
                temperature=v.temperature,
                top_p=v.top_p,
                top_k=v.top_k,
                min_p=v.min_p,
                max_tokens=v.max_tokens or None,
                seed=None if v.seed < 0 else v.seed,
                repeat_penalty=v.repeat_penalty,
                context_overflow=v.context_overflow if v.context_overflow != "rolling" else None,
            ),
        )

    def _send(self, text: str) -> None:
        cid = self.conversation_id
        if cid is None:
            return
        editing = self.session.editing(cid)
        if editing is not None and editing.role == "assistant":  # a reply's new version, the user's own words
            try:
                self.session.save_edit(cid, text)
            except ChatError as e:
                self.report(str(e), "chat", "Editing a reply")
            self.open_conversation(cid)
            self.window.chat.set_status("Saved as a new version of the reply (< > shows the old one).")
            return

        def show(message: Message) -> None:
            # the message as saved, with its id (its Edit link); an edit: the new branch, up to the edited message
            t = self.window.chat.transcript
            if editing is not None:
                self.open_conversation(cid, while_streaming=True)
            else:
                t.add_message("user", message.content, message_id=message.id)
            t.begin_reply()

        tools = self._tools(cid)
        self._reply_task = self.spawn(
            self._stream(
                lambda text_to, reasoning_to: self.session.send(cid, text, text_to, reasoning_to, tools, saved=show),
                begin=False,
                tools_on=tools is not None,
            )
        )

    def _send_without_tools(self, cid: int, text: str) -> None:
        """The "tools do not fit" offer's button: tools off in that chat, and the same message sent again."""
        if cid != self.conversation_id or (self._reply_task is not None and not self._reply_task.done()):
            return
        self._set_tools(on=False)
        if self.window.chat.input.toPlainText().strip() == text.strip():
            self.window.chat.input.clear()
        self._send(text)

    def _edit_message(self, message_id: int | None = None) -> None:
        """Edit any message (the transcript's Edit; Edit last: the last question): its text in the input box;
        sending makes a new version of it, a branch, and the old one stays behind "< >"."""
        cid = self.conversation_id
        if cid is None or (self._reply_task is not None and not self._reply_task.done()):
            return
        text = self.session.begin_edit(cid, message_id)
        if text is None:
            return
        editing = self.session.editing(cid)
        self.window.chat.input.setPlainText(text)
        self.window.chat.input.setFocus()
        if editing is not None and editing.role == "assistant":
            self.window.chat.set_status("Editing a reply: Send saves your version beside the model's.")
        else:
            self.window.chat.set_status("Editing a message: sending starts a new branch from it; the old one stays.")

    def _switch_branch(self, message_id: int, step: int) -> None:
        """A message's "<" or ">": that version of the turn, with its own continuation."""
        cid = self.conversation_id
        if cid is None or (self._reply_task is not None and not self._reply_task.done()):
            return
        self.session.cancel_edit(cid)
        self.store.switch_branch(message_id, step)
        self.open_conversation(cid)

    def _regenerate(self) -> None:
        cid = self.conversation_id
        if cid is None:
            return

        def redraw() -> None:
            # the dropped reply leaves the transcript: this task is the streaming one, so the redraw is its own
            # (issue 29, defect 5: the redraw came before the drop, and open_conversation refused it while a
            # reply streamed, so the old reply stayed on screen above the new one)
            self.open_conversation(cid, while_streaming=True)
            self.window.chat.transcript.begin_reply()

        tools = self._tools(cid)

        async def again(text_to: Sink, reasoning_to: Sink) -> Any:
            return await self.session.regenerate(cid, text_to, reasoning_to, tools, dropped=redraw)

        self._reply_task = self.spawn(self._stream(again, begin=False, tools_on=tools is not None))

    def _edit_last(self) -> None:
        self._edit_message(None)

    async def _stream(
        self, turn: Callable[[Sink, Sink], Awaitable[Any]], begin: bool = True, tools_on: bool = False
    ) -> None:
        chat = self.window.chat
        transcript = chat.transcript
        cid = self.conversation_id
        chat.set_busy(True)
        # an earlier turn's failure is not this one's: its banner stayed up during a regenerate that worked
        self.window.notifications.forget("chat")
        self.window.notifications.forget(TOOLS_OFFER)
        if begin:
            transcript.begin_reply()
        chat.set_status("Thinking…")
        try:
            reply = await turn(transcript.append_reply, transcript.append_reasoning)
            mid = reply.message.id  # (the reply's own line; the footer has speed, context)
            notice = overflow_line(reply.overflow) if reply.overflow else ""  # what the model no longer sees
            transcript.end_reply(footer(reply.message), message_id=mid, branch=self._branch_of(mid), notice=notice)
            chat.set_status(f"Chatting with {self.model_name}." if self.model_name else "")
            self._show_footer()
            self._record_chat_speed(reply.message)
            self.window.notifications.succeeded("chat")
        except asyncio.CancelledError:
            for key in self._tool_keys.values():  # a call (or its question) the stop cut short
                transcript.update_tool_call(key, "stopped")
            transcript.end_reply("stopped")
            chat.set_status("Stopped.")
        except Refused as e:
            # nothing of the turn was kept: it leaves the transcript too, and the message goes back to the input
            if cid is not None and cid == self.conversation_id:
                self.open_conversation(cid, while_streaming=True)
                if not chat.input.toPlainText().strip():
                    chat.input.setPlainText(e.text)
            chat.set_status(str(e))
            self.window.log_view.append(f"[chat] {e}")
            # the offer only where the tools are what does not fit (a message too long for any context is not)
            tools_too_big = e.code == "tools_do_not_fit" or (e.code == "context_length_exceeded" and "tool" in str(e))
            if tools_on and cid is not None and tools_too_big:
                self._retry[TOOLS_OFFER] = functools.partial(self._send_without_tools, cid, e.text)
                self.window.notifications.offer(TOOLS_OFFER, "The tools do not fit", str(e), "Chat without tools")
            else:
                self.window.notifications.fail("chat", "The message was not sent", str(e), retry=False)
        except ChatError as e:
            # what arrived before a fault stays, marked cut off as it is in the store; a reply that failed is
            # marked failed, with the reason (it was an empty "Assistant" turn)
            transcript.end_reply(footer(e.message) if isinstance(e, ReplyCutOff) else "", failure=failure_line(str(e)))
            chat.set_status(str(e))
            self.window.log_view.append(f"[chat] {e}")
            self.window.notifications.fail("chat", "The reply failed", str(e), retry=False)
        finally:
            self._tool_keys.clear()
            chat.set_busy(False)
            if self.conversation_id is not None:
                self._show_conversations_keep_transcript()

    def _choose_export(self, conversation_id: int, kind: str) -> None:
        """A conversation's Export as Markdown or JSON: a save dialog (not exec(): the loop keeps running)."""
        conv = self.store.get(conversation_id)
        if conv is None:
            return
        name = suggested_name(conv.title, kind)
        filters = "Markdown (*.md)" if kind == "md" else "JSON (*.json)"
        dialog = QFileDialog(self.window, "Export chat", str(Path.home() / name), filters)
        dialog.setAcceptMode(QFileDialog.AcceptMode.AcceptSave)
        dialog.setDefaultSuffix(kind)
        dialog.fileSelected.connect(lambda f: self.spawn(self.export_conversation(conversation_id, Path(f))))
        dialog.open()

    async def export_conversation(self, conversation_id: int, path: Path) -> bool:
        """Writes the conversation (Markdown for .md, else JSON) off the UI thread; a notice says where."""
        try:
            kind = await asyncio.to_thread(export_file, self.store, conversation_id, path)
        except TransferError as e:
            self.report(str(e), "export", "Exporting a chat")
            return False
        self.window.notifications.succeeded("export")
        self.confirm("export", "Chat exported", f"Saved as {kind}: {path}")
        return True

    def _choose_chat_import(self) -> None:
        dialog = QFileDialog(self.window, "Import chat", str(Path.home()), "Run My AI chat (*.json)")
        dialog.setFileMode(QFileDialog.FileMode.ExistingFile)
        dialog.fileSelected.connect(lambda f: self.spawn(self.import_conversation(Path(f))))
        dialog.open()

    async def import_conversation(self, path: Path) -> int | None:
        """A JSON export as a new conversation, opened; a file that is not one gets one line, and adds nothing."""
        try:
            conv = await asyncio.to_thread(import_file, self.store, path)
        except TransferError as e:
            self.report(str(e), "import-chat", "Importing a chat")
            return None
        self.window.notifications.succeeded("import-chat")
        self.conversation_id = conv.id
        self._show_conversations()
        return conv.id

    def _draft_prompt(self) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
        """What the next request would carry before the draft: the current chat's messages and its tools."""
        cid = self.conversation_id
        if cid is None or self.store.get(cid) is None:
            return [], None
        runner = self._tools(cid)
        return self.store.chat_payload(cid), (runner.openai_tools() or None) if runner is not None else None

    def _show_draft_count(self, line: str) -> None:
        self.window.chat.token_label.setText(line)

    def _branch_of(self, message_id: int) -> tuple[int, int] | None:
        n, of = self.store.branch_position(message_id)
        return (n, of) if of > 1 else None

    def _show_conversations_keep_transcript(self) -> None:
        self._list_conversations()

    def _show_footer(self) -> None:
        """The chat footer: the last reply's speed and how much of the context the conversation now holds."""
        stats = self.chat_client.last_stats if self.chat_client is not None else None
        if stats is None:
            return
        # "last reply": the whole reply as the app received it (the performance panel's is the engine's, live)
        speed = f"last reply {stats.tokens_per_s:.1f} tok/s" if stats.tokens_per_s else ""
        used = (stats.prompt_tokens or 0) + stats.tokens if stats.prompt_tokens is not None else None
        self.window.chat.set_footer(speed, context_line(used, stats.n_ctx))
        self._footer_model = self.supervisor.model if self.supervisor is not None else None

    def _forget_footer_of(self, path: Path) -> None:
        """The footer's speed and context figures go with the model they are of (they stayed after it was deleted)."""
        if self._footer_model == path:
            self.window.chat.set_footer("", context_line(None, None))
            self._footer_model = None

    def _record_chat_speed(self, message: Message) -> None:
        """A finished reply's speed joins this machine's measurements (runmyai.speeds), which calibrate every
        estimate and give the model's card its measured range; then the cards are worked out again. With it, what
        the class defaults predict for this model as launched, which the calibration compares it with."""
        sup, machine = self.supervisor, self.machine
        local = next((m for m in self.local_models if sup is not None and m.path == sup.model), None)
        if local is None or machine is None:
            return  # (a remote endpoint's speed is not this machine's)
        preset = self.catalog.get(local.preset_id) if local.preset_id else None
        flags = launch_flags(local.path, local, preset, self.autotune)
        est = installed_estimate(local, preset, machine, self.engine_info, flags, calibration=DEFAULT_CALIBRATION)
        if est is None:
            return
        m = chat_measurement(
            local.path, message.tokens_per_s, message.tokens, est.compute_seconds, est.io_seconds, load=load_per_core()
        )
        if m is None:
            return

        async def record() -> None:
            try:
                speeds = await asyncio.to_thread(record_speed, self.paths.settings, m)
            except OSError as e:
                self.window.log_view.append(f"[app] the measured speed could not be saved: {e}")
                return
            if self.machine is not None:
                self.machine = replace(self.machine, speeds=speeds)
                self._list_entries()
                self._show_models()

        self.speed_task = self.spawn(record())  # (tests wait for it)

    def stop_reply(self) -> None:
        if self._reply_task is not None and not self._reply_task.done():
            self._reply_task.cancel()

    async def chat_once(self, text: str, timeout_s: float = 120) -> str:
        """Sends a message in the current conversation and waits for the reply (self-test and tests)."""
        self._send(text)
        task = self._reply_task
        assert task is not None
        await asyncio.wait_for(asyncio.shield(task), timeout_s)
        cid = self.conversation_id
        messages = self.store.messages(cid) if cid is not None else []
        return messages[-1].content if messages and messages[-1].role == "assistant" else ""

    # ------------------------------------------------------------------------------------------ MCP
    async def start_mcp(self) -> None:
        """Connects the configured servers (each on its own task: a slow one holds up nothing)."""
        try:
            servers = self.mcp_config.servers()
        except ConfigError as e:
            self.report(f"MCP: {e}")
            return
        await self.mcp.apply(servers)

    def _mcp_changed(self) -> None:
        self._tools_tokens = None
        self._show_tools()
        if self.chat_client is not None:
            self.spawn(self.count_context())
        if self.mcp_dialog is not None:
            self.mcp_dialog.show_servers(self.mcp.views())
        for v in self.mcp.views():
            if v.state == "error":
                self.window.log_view.append(f"[mcp] {v.name}: {v.line}")

    def open_mcp(self) -> None:
        if self.mcp_dialog is None:
            d = McpDialog(self.window)
            d.save_requested.connect(self._save_mcp)
            d.enabled_changed.connect(self._enable_mcp)
            d.insert_prompt_requested.connect(lambda s, n, a: self.spawn(self.insert_prompt(s, n, parse_arguments(a))))
            d.attach_resource_requested.connect(lambda s, u: self.spawn(self.attach_resource(s, u)))
            self.mcp_dialog = d
        self.mcp_dialog.set_text(self.mcp_config.text())
        self.mcp_dialog.show_servers(self.mcp.views())
        self.mcp_dialog.show()
        self.mcp_dialog.raise_()

    def _save_mcp(self, text: str) -> None:
        try:
            servers = self.mcp_config.save(text)
        except (ConfigError, OSError) as e:
            if self.mcp_dialog is not None:
                self.mcp_dialog.set_error(str(e))
            return
        if self.mcp_dialog is not None:
            self.mcp_dialog.set_error("")
        self.spawn(self.mcp.apply(servers))

    def _enable_mcp(self, name: str, enabled: bool) -> None:
        try:
            text = set_disabled(self.mcp_config.text(), name, not enabled)
        except (ValueError, KeyError) as e:
            self.report(f"MCP: could not change {name}: {e}")
            return
        if self.mcp_dialog is not None:
            self.mcp_dialog.set_text(text)
        self._save_mcp(text)

    async def insert_prompt(self, server: str, name: str, arguments: dict[str, str]) -> None:
        conn = self.mcp.connection(server)
        try:
            if conn is None:
                raise CallFailed(f"The MCP server '{server}' is gone.")
            text = await conn.prompt_text(name, arguments)
        except CallFailed as e:
            self.report(str(e))
            return
        self.window.chat.input.insertPlainText(text)

    async def attach_resource(self, server: str, uri: str) -> None:
        conn = self.mcp.connection(server)
        try:
            if conn is None:
                raise CallFailed(f"The MCP server '{server}' is gone.")
            text = await conn.resource_text(uri)
        except CallFailed as e:
            self.report(str(e))
            return
        self.window.chat.input.appendPlainText(f"\n[{uri}]\n```\n{text}\n```\n")

    def _tools(self, conversation_id: int | None = None) -> McpToolRunner | None:
        """The runner of a turn's tool calls in that chat; None when tools are off there, or no server it uses
        offers any (the request then has none)."""
        conv = self.store.get(conversation_id) if conversation_id is not None else None
        s = conv.settings if conv is not None else ChatSettings()
        if s.tools is False:
            return None
        skip = frozenset(s.tools_off or [])
        if not any(t.server not in skip for t in self.mcp.exposed().values()):
            return None
        return McpToolRunner(self.mcp, self.mcp_policy, self._approve, _TranscriptEvents(self), skip=skip)

    async def _approve(self, call: ToolCall, tool: ToolInfo) -> Decision:
        """Asks in a box that does not block the loop; Stop (cancelling the turn) closes it."""
        box = ApprovalBox(call, tool, self.window)
        answer: asyncio.Future[Decision] = asyncio.get_running_loop().create_future()

        def clicked(button: object) -> None:
            decision: Decision = "once" if button is box.once else "always" if button is box.always else "deny"
            if not answer.done():
                answer.set_result(decision)

        box.buttonClicked.connect(clicked)
        box.finished.connect(lambda _: None if answer.done() else answer.set_result("deny"))
        self.approval = box
        self.window.chat.set_status(f"Waiting for your approval of {tool.name}…")
        box.open()
        try:
            decision = await answer
        finally:
            self.approval = None
            box.blockSignals(True)
            box.close()
            box.deleteLater()
        key = self._tool_keys.get(call.id)
        if key is not None:
            self.window.chat.transcript.update_tool_call(key, "running…" if decision != "deny" else "denied")
        self.window.chat.set_status(f"Running {tool.name}…" if decision != "deny" else "Thinking…")
        return decision


class _TranscriptEvents(ToolEvents):
    """A turn's tool calls in the transcript, each one collapsed line (unfold: its arguments and result)."""

    def __init__(self, controller: AppController) -> None:
        self.c = controller

    def started(self, call: ToolCall, tool: ToolInfo | None) -> None:
        key = f"{len(self.c._tool_keys)}-{call.id}"
        self.c._tool_keys[call.id] = key
        where = f" ({tool.server})" if tool is not None else ""
        asks = tool is not None and self.c.mcp_policy.needs_asking(tool.server, tool.name)
        self.c.window.chat.transcript.add_tool_call(
            key, f"{call.name}{where}", "waiting for approval…" if asks else "running…", call_detail(call)
        )

    def finished(self, call: ToolCall, result: ToolResult) -> None:
        key = self.c._tool_keys.pop(call.id, None)
        if key is None:
            return
        self.c.window.chat.transcript.update_tool_call(key, result.line, call_detail(call, result))
        self.c.window.chat.set_status("Thinking…")
        if result.outcome == "failed":
            self.c.window.log_view.append(f"[mcp] {result.line}")


def _marks(m: Message) -> list[ToolMark]:
    """A saved reply's tool calls as the transcript draws them, each with the line and detail it had live."""
    return [
        ToolMark(r.at, f"{m.id}.{n}.{i}", call.name, result.line, call_detail(call, result))
        for n, r in enumerate(m.tool_rounds)
        for i, (call, result) in enumerate(zip(r.calls, r.outcomes(), strict=True))
    ]
