"""MCP: the configured servers (mcp.json) connected, the MCP dialog, a chat turn's tools with their approval
box, and each tool call's line in the transcript."""

from __future__ import annotations

import asyncio

from PySide6.QtCore import Signal

from runmyai.chat.store import ConversationStore
from runmyai.chat.tools import ToolCall, ToolResult, call_detail
from runmyai.engine.client import ChatSettings
from runmyai.mcp.approval import ApprovalPolicy, Decision
from runmyai.mcp.config import ConfigError, ConfigFile, set_disabled
from runmyai.mcp.runner import McpToolRunner, ToolEvents
from runmyai.mcp.servers import CallFailed, McpManager, ToolInfo
from runmyai.ui.controllers.base import Room, Shared
from runmyai.ui.mcp_dialog import ApprovalBox, McpDialog, parse_arguments


class McpRoom(Room):
    tools_changed = Signal()  # the servers or their tools changed: the chat's tools button and count again

    def __init__(self, ctx: Shared, store: ConversationStore) -> None:
        super().__init__(ctx)
        self.store = store
        # MCP servers: mcp.json and the "always allow" choices in the app's home, the connections on this loop
        self.mcp_config = ConfigFile(ctx.paths.home / "mcp.json")
        self.mcp = McpManager(ctx.paths.logs, on_change=self._mcp_changed)
        self.mcp_policy = ApprovalPolicy(ctx.paths.home / "mcp-approvals.json")
        self.mcp_dialog: McpDialog | None = None
        self.approval: ApprovalBox | None = None  # the tool-call question on screen, if any
        self.tool_keys: dict[str, str] = {}  # a running turn's call id → its line in the transcript
        self.window.mcp_requested.connect(self.open_mcp)

    async def start_mcp(self) -> None:
        """Connects the configured servers (each on its own task: a slow one holds up nothing)."""
        try:
            servers = self.mcp_config.servers()
        except ConfigError as e:
            self.ctx.report(f"MCP: {e}")
            return
        await self.mcp.apply(servers)

    def _mcp_changed(self) -> None:
        self.tools_changed.emit()
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
            d.insert_prompt_requested.connect(
                lambda s, n, a: self.ctx.spawn(self.insert_prompt(s, n, parse_arguments(a)))
            )
            d.attach_resource_requested.connect(lambda s, u: self.ctx.spawn(self.attach_resource(s, u)))
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
        self.ctx.spawn(self.mcp.apply(servers))

    def _enable_mcp(self, name: str, enabled: bool) -> None:
        try:
            text = set_disabled(self.mcp_config.text(), name, not enabled)
        except (ValueError, KeyError) as e:
            self.ctx.report(f"MCP: could not change {name}: {e}")
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
            self.ctx.report(str(e))
            return
        self.window.chat.input.insertPlainText(text)

    async def attach_resource(self, server: str, uri: str) -> None:
        conn = self.mcp.connection(server)
        try:
            if conn is None:
                raise CallFailed(f"The MCP server '{server}' is gone.")
            text = await conn.resource_text(uri)
        except CallFailed as e:
            self.ctx.report(str(e))
            return
        self.window.chat.input.appendPlainText(f"\n[{uri}]\n```\n{text}\n```\n")

    def tools(self, conversation_id: int | None = None) -> McpToolRunner | None:
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
        key = self.tool_keys.get(call.id)
        if key is not None:
            self.window.chat.transcript.update_tool_call(key, "running…" if decision != "deny" else "denied")
        self.window.chat.set_status(f"Running {tool.name}…" if decision != "deny" else "Thinking…")
        return decision


class _TranscriptEvents(ToolEvents):
    """A turn's tool calls in the transcript, each one collapsed line (unfold: its arguments and result)."""

    def __init__(self, room: McpRoom) -> None:
        self.room = room

    def started(self, call: ToolCall, tool: ToolInfo | None) -> None:
        key = f"{len(self.room.tool_keys)}-{call.id}"
        self.room.tool_keys[call.id] = key
        where = f" ({tool.server})" if tool is not None else ""
        asks = tool is not None and self.room.mcp_policy.needs_asking(tool.server, tool.name)
        self.room.window.chat.transcript.add_tool_call(
            key, f"{call.name}{where}", "waiting for approval…" if asks else "running…", call_detail(call)
        )

    def finished(self, call: ToolCall, result: ToolResult) -> None:
        key = self.room.tool_keys.pop(call.id, None)
        if key is None:
            return
        self.room.window.chat.transcript.update_tool_call(key, result.line, call_detail(call, result))
        self.room.window.chat.set_status("Thinking…")
        if result.outcome == "failed":
            self.room.window.log_view.append(f"[mcp] {result.line}")
