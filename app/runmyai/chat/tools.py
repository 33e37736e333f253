"""Tool calls in a chat turn (Qt-free): what the model asked for, what came of it, and who runs them."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal, Protocol

Outcome = Literal["ok", "error", "denied", "failed"]


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str  # as the model was shown it (the runner maps it to a server's tool)
    arguments: str  # OpenAI's JSON text

    def parsed_arguments(self) -> dict[str, Any] | None:
        """The arguments as an object; None when they are not a JSON object."""
        try:
            value = json.loads(self.arguments or "{}")
        except ValueError:
            return None
        return value if isinstance(value, dict) else None

    def message(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass(frozen=True)
class ToolResult:
    outcome: Outcome  # ok; error (the tool said so); denied (by the user); failed (the server crashed, timed out)
    content: str  # what the model is sent as the `tool` message
    line: str  # one line for the user

    def message(self, call: ToolCall) -> dict[str, Any]:
        return {"role": "tool", "tool_call_id": call.id, "content": self.content}


class ToolRunner(Protocol):
    """The tools a turn offers the model and how a call of one is run (asked about, shown, carried out)."""

    def openai_tools(self) -> list[dict[str, Any]]: ...

    async def run(self, call: ToolCall) -> ToolResult: ...
