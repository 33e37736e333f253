"""A turn's tool calls against the MCP servers: mapped to their server's tool, asked about (unless always
allowed), shown, run with the server's timeout; every outcome, a refusal or a crash too, becomes a `tool` message
so the model hears of it and the chat goes on."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from runmyai.chat.tools import ToolCall, ToolResult
from runmyai.mcp.approval import ApprovalPolicy, Decision
from runmyai.mcp.servers import CallFailed, McpManager, ToolInfo

# asked when a call needs the user's word: (call, the tool it maps to) -> their decision
Approver = Callable[[ToolCall, ToolInfo], Awaitable[Decision]]


class ToolEvents:
    """What the transcript is told (a no-op by default)."""

    def started(self, call: ToolCall, tool: ToolInfo | None) -> None:
        pass

    def finished(self, call: ToolCall, result: ToolResult) -> None:
        pass


class McpToolRunner:
    def __init__(
        self,
        manager: McpManager,
        policy: ApprovalPolicy,
        approve: Approver,
        events: ToolEvents | None = None,
        skip: frozenset[str] = frozenset(),
    ) -> None:
        """`skip`: the servers left out in this chat (their tools are neither offered nor run)."""
        self.manager = manager
        self.policy = policy
        self.approve = approve
        self.events = events or ToolEvents()
        self.skip = skip

    def openai_tools(self) -> list[dict[str, Any]]:
        return self.manager.openai_tools(self.skip)

    def servers(self) -> list[str]:
        """The servers whose tools are offered, in their order (the "do not fit" line names them)."""
        names = [t.server for t in self.manager.exposed().values() if t.server not in self.skip]
        return list(dict.fromkeys(names))

    async def run(self, call: ToolCall) -> ToolResult:
        tool = self.manager.exposed().get(call.name)
        if tool is not None and tool.server in self.skip:
            tool = None  # a server off in this chat: as if it were gone
        self.events.started(call, tool)
        result = await self._run(call, tool)
        self.events.finished(call, result)
        return result

    async def _run(self, call: ToolCall, tool: ToolInfo | None) -> ToolResult:
        if tool is None:
            line = f"There is no tool named {call.name} (its MCP server is gone or disabled)."
            return ToolResult("failed", f"Error: {line}", line)
        args = call.parsed_arguments()
        if args is None:
            line = f"The arguments of {call.name} are not a JSON object; the call was not run."
            return ToolResult("failed", f"Error: {line}", line)
        if self.policy.needs_asking(tool.server, tool.name):
            decision = await self.approve(call, tool)
            if not self.policy.record(tool.server, tool.name, decision):
                line = f"You denied the call of {tool.name}."
                return ToolResult("denied", "Error: the user denied this tool call.", line)
        conn = self.manager.connection(tool.server)
        if conn is None:
            line = f"The MCP server '{tool.server}' is gone."
            return ToolResult("failed", f"Error: {line}", line)
        try:
            text, is_error = await conn.call_tool(tool.name, args)
        except CallFailed as e:
            return ToolResult("failed", f"Error: {e}", str(e))
        if is_error:
            first = (text.strip().splitlines() or ["(no message)"])[0][:200]
            return ToolResult("error", text or "Error", f"{tool.name} reported an error: {first}")
        n = len(text)
        return ToolResult("ok", text, f"{tool.name} returned {n} character{'' if n == 1 else 's'}")
