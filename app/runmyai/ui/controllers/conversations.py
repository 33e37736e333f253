"""The chats' sidebar and each chat's own state: the list (searched, renamed, deleted with Undo, exported and
imported), the conversation on screen with its sampling settings, its context line and its tools button."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from PySide6.QtCore import QTimer, Signal
from PySide6.QtWidgets import QFileDialog

from runmyai.chat.session import footer, overflow_line
from runmyai.chat.store import ConversationStore, Message
from runmyai.chat.tools import call_detail
from runmyai.chat.transfer import TransferError, export_file, import_file, suggested_name
from runmyai.engine.client import ChatError, ChatSettings
from runmyai.engine.prompt_cache import conversation_key
from runmyai.library.presets import Preset
from runmyai.ui.chat_panel import SamplingValues
from runmyai.ui.controllers.base import Room, Shared
from runmyai.ui.controllers.engine import EngineRoom
from runmyai.ui.controllers.mcp import McpRoom
from runmyai.ui.transcript import ToolMark, failure_line
from runmyai.ui.viewmodels import context_line, search_messages

TOOLS_OFFER = "tools-do-not-fit"  # the notification offering to send a message again without tools
UNDO_MS = 8_000  # how long a deleted chat's Undo is offered (then it is deleted for good)
UNDO_DELETE = "undo-delete:"  # its notification's key, before the chat's id


class ConversationsRoom(Room):
    deleted = Signal(str)  # a chat deleted for good: its prompt-cache key (its contexts on disk go too)

    def __init__(
        self, ctx: Shared, store: ConversationStore, engine: EngineRoom, mcp: McpRoom, busy: Callable[[], bool]
    ) -> None:
        super().__init__(ctx)
        self.store = store
        self.engine = engine
        self.mcp = mcp
        self._busy = busy  # a reply streams: the chat on screen stays as it is
        self.conversation_id: int | None = None
        self._shown_conversation: int | None = None  # the conversation the transcript shows
        self._deleting: dict[int, str] = {}  # chats deleted whose Undo is still offered → their titles
        self._conversation_query = ""
        self.tools_tokens: int | None = None  # the chat's tool definitions' tokens, as the engine counted them
        w, chat = self.window, self.window.chat
        chat.export_conversation_requested.connect(lambda cid, kind: self._choose_export(int(cid), kind))
        chat.import_conversation_requested.connect(self._choose_chat_import)
        w.export_chat_requested.connect(
            lambda kind: self._choose_export(self.conversation_id, kind) if self.conversation_id is not None else None
        )
        w.import_chat_requested.connect(self._choose_chat_import)
        chat.new_conversation_requested.connect(self.new_conversation)
        chat.delete_conversation_requested.connect(self._delete_conversation)
        chat.conversation_selected.connect(lambda cid: self.open_conversation(int(cid)))
        chat.settings_changed.connect(self.save_settings)
        chat.tools_toggled.connect(lambda on: self.set_tools(on=on))
        chat.tool_server_toggled.connect(lambda name, on: self.set_tools(server=name, server_on=on))
        chat.rename_conversation_requested.connect(self._rename_conversation)
        chat.search_changed.connect(self._search_conversations)
        engine.started.connect(self._model_started)
        mcp.tools_changed.connect(self.tools_changed)

    def show_conversations(self) -> None:
        conversations = [c for c in self.store.list() if c.id not in self._deleting]
        if not conversations:
            conversations = [self.store.create()]
        if (
            self.conversation_id is None
            or self.conversation_id in self._deleting
            or self.store.get(self.conversation_id) is None
        ):
            self.conversation_id = conversations[0].id
        self.list_conversations()
        self.open_conversation(self.conversation_id)

    def list_conversations(self) -> None:
        """The sidebar's list: every conversation, or those whose title or messages hold the search's words."""
        items = [(str(c.id), c.title) for c in self.store.list() if c.id not in self._deleting]
        if self._conversation_query:
            items = search_messages(
                items, lambda cid: (m.content for m in self.store.messages(int(cid))), self._conversation_query
            )
        self.window.chat.set_conversations(items, str(self.conversation_id))

    def _search_conversations(self, query: str) -> None:
        self._conversation_query = query
        self.list_conversations()

    def _rename_conversation(self, cid: str, title: str) -> None:
        conv = self.store.get(int(cid))
        if conv is not None and conv.title != title:
            self.store.rename(int(cid), title)
        self.list_conversations()

    def open_conversation(self, conversation_id: int, *, while_streaming: bool = False) -> None:
        """Shows a conversation. `while_streaming`: the turn that streams redraws its own conversation (a
        regenerate drops the old reply first); a user's click is refused meanwhile."""
        if not while_streaming and self._busy():
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
                images=self.store.pictures(m) if m.images else (),
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
        chat, engine = self.window.chat, self.engine
        if switched:
            self.window.notifications.forget("chat")
            self.window.notifications.forget(TOOLS_OFFER)
            chat.set_status(f"Chatting with {engine.model_name}." if engine.model_name and engine.chat_client else "")
        last = next((m for m in reversed(messages) if m.role == "assistant"), None)
        speed = f"last reply {last.tokens_per_s:.1f} tok/s" if last is not None and last.tokens_per_s else ""
        chat.set_footer(speed, context_line(None, None))
        self.show_tools()
        if engine.chat_client is not None:
            self.ctx.spawn(self.count_context())

    async def count_context(self) -> None:
        """The context line and the tools' token count of the conversation on screen, counted by the engine
        (`/v1/chat/count`, the model's own template); nothing where the server cannot count."""
        cid, client = self.conversation_id, self.engine.chat_client
        if cid is None or client is None:
            return
        payload = self.store.chat_payload(cid)
        runner = self.mcp.tools(cid)
        tools = runner.openai_tools() if runner is not None else []
        try:
            count = await client.count(payload or [{"role": "user", "content": ""}], tools or None)
        except ChatError:
            return
        if cid != self.conversation_id:
            return  # another chat is on screen by now
        self.tools_tokens = count.tools_tokens if tools else None
        self.show_tools()
        used = count.prompt_tokens if payload else count.tools_tokens
        speed = self.window.chat.speed_label.text()
        self.window.chat.set_footer(speed, context_line(min(used, count.n_ctx), count.n_ctx))

    def show_tools(self) -> None:
        """The tools button: on or off in this chat, per server, and their definitions' tokens once counted."""
        conv = self.store.get(self.conversation_id) if self.conversation_id is not None else None
        s = conv.settings if conv is not None else ChatSettings()
        off = set(s.tools_off or [])
        servers = [
            (v.name, f"{len(v.tools)} tool{'' if len(v.tools) == 1 else 's'}", v.name not in off)
            for v in self.mcp.mcp.views()
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
            if self.tools_tokens is not None:
                line += f" · {self.tools_tokens:,} tokens"
        self.window.chat.set_tools(line, on, servers)

    def tools_changed(self) -> None:
        """The MCP servers or their tools changed: the button, and the tools' tokens counted again."""
        self.tools_tokens = None
        self.show_tools()
        if self.engine.chat_client is not None:
            self.ctx.spawn(self.count_context())

    def set_tools(self, on: bool | None = None, server: str | None = None, server_on: bool = True) -> None:
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
        self.tools_changed()

    def new_conversation(self) -> None:
        if self._busy():
            return  # (Ctrl+N too: the button is disabled while a reply streams, as switching is)
        preset = self._current_preset()
        conv = self.store.create(model=self.engine.model_name)
        if preset is not None:
            self._apply_chat_defaults(conv.id, preset)
        self.conversation_id = conv.id
        self.show_conversations()

    def _current_preset(self) -> Preset | None:
        in_use = self.engine.in_use()[0]
        return self.engine.lib.local_of(in_use)[1] if in_use is not None else None

    def _model_started(self, preset: Preset | None) -> None:
        """A model started: an empty chat on screen takes its preset's defaults."""
        if preset is not None and self.conversation_id is not None and not self.store.messages(self.conversation_id):
            self._apply_chat_defaults(self.conversation_id, preset)

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
        if self._busy():
            return
        conv = self.store.get(int(cid))
        if conv is None:
            return
        self._deleting[conv.id] = conv.title
        if self.conversation_id == conv.id:
            self.conversation_id = None
        self.show_conversations()
        key = f"{UNDO_DELETE}{conv.id}"
        self.ctx.retry[key] = lambda: self.undo_delete(conv.id)
        notes = self.window.notifications
        notes.info(key, "Chat deleted", f"“{conv.title or 'New chat'}” was deleted.", action="Undo")
        shown = notes.get(key)
        # (an Undo and a second Delete of the same chat show a new notice: this timer is then not its own)
        QTimer.singleShot(UNDO_MS, lambda: self.finish_delete(conv.id) if notes.get(key) in (shown, None) else None)

    def undo_delete(self, conversation_id: int) -> None:
        """The deleted chat's Undo: back in the list, shown."""
        if self._deleting.pop(conversation_id, None) is None:
            return
        self.ctx.retry.pop(f"{UNDO_DELETE}{conversation_id}", None)
        self.window.notifications.forget(f"{UNDO_DELETE}{conversation_id}")
        self.conversation_id = conversation_id
        self.show_conversations()

    def finish_delete(self, conversation_id: int | None = None) -> None:
        """Deletes for good the chats whose Undo time is over (`conversation_id`), or all of them (None)."""
        ids = list(self._deleting) if conversation_id is None else [conversation_id]
        for cid in ids:
            if self._deleting.pop(cid, None) is not None:
                conv = self.store.get(cid)
                self.store.delete(cid)
                if conv is not None:
                    self.deleted.emit(conversation_key(conv.id, conv.created_at))
            self.ctx.retry.pop(f"{UNDO_DELETE}{cid}", None)
            self.window.notifications.forget(f"{UNDO_DELETE}{cid}")

    def save_settings(self) -> None:
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
        dialog.fileSelected.connect(lambda f: self.ctx.spawn(self.export_conversation(conversation_id, Path(f))))
        dialog.open()

    async def export_conversation(self, conversation_id: int, path: Path) -> bool:
        """Writes the conversation (Markdown for .md, else JSON) off the UI thread; a notice says where."""
        try:
            kind = await asyncio.to_thread(export_file, self.store, conversation_id, path)
        except TransferError as e:
            self.ctx.report(str(e), "export", "Exporting a chat")
            return False
        self.window.notifications.succeeded("export")
        self.ctx.confirm("export", "Chat exported", f"Saved as {kind}: {path}")
        return True

    def _choose_chat_import(self) -> None:
        dialog = QFileDialog(self.window, "Import chat", str(Path.home()), "Run My AI chat (*.json)")
        dialog.setFileMode(QFileDialog.FileMode.ExistingFile)
        dialog.fileSelected.connect(lambda f: self.ctx.spawn(self.import_conversation(Path(f))))
        dialog.open()

    async def import_conversation(self, path: Path) -> int | None:
        """A JSON export as a new conversation, opened; a file that is not one gets one line, and adds nothing."""
        try:
            conv = await asyncio.to_thread(import_file, self.store, path)
        except TransferError as e:
            self.ctx.report(str(e), "import-chat", "Importing a chat")
            return None
        self.window.notifications.succeeded("import-chat")
        self.conversation_id = conv.id
        self.show_conversations()
        return conv.id


def _marks(m: Message) -> list[ToolMark]:
    """A saved reply's tool calls as the transcript draws them, each with the line and detail it had live."""
    return [
        ToolMark(r.at, f"{m.id}.{n}.{i}", call.name, result.line, call_detail(call, result))
        for n, r in enumerate(m.tool_rounds)
        for i, (call, result) in enumerate(zip(r.calls, r.outcomes(), strict=True))
    ]
