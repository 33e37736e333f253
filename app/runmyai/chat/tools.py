"""Tool calls in a chat turn (Qt-free): what the model asked for, what came of it, and who runs them."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal, Protocol

Outcome = Literal["ok", "error", "denied", "failed", "stopped"]
OUTCOMES: frozenset[str] = frozenset({"ok", "error", "denied", "failed", "stopped"})


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
    # ok; error (the tool said so); denied (by the user); failed (the server crashed, timed out); stopped (by Stop)
    outcome: Outcome
    content: str  # what the model is sent as the `tool` message
    line: str  # one line for the user

    def message(self, call: ToolCall) -> dict[str, Any]:
        return {"role": "tool", "tool_call_id": call.id, "content": self.content}


SHOWN_RESULT = 4000  # characters of a result the transcript shows when a call is unfolded


def call_detail(call: ToolCall, result: ToolResult | None = None) -> str:
    """What an unfolded call shows in the transcript: its arguments, and its result once there is one."""
    if result is None:
        return f"Arguments: {call.arguments}"
    shown = result.content if len(result.content) <= SHOWN_RESULT else result.content[:SHOWN_RESULT] + "…"
    return f"Arguments: {call.arguments}\nResult: {shown}"


STOPPED = ToolResult("stopped", "Error: the user stopped this call before it finished.", "stopped")


@dataclass(frozen=True)
class ToolRound:
    """One model turn of a reply that called tools: its text, its calls and what came of each (saved with the
    reply, so a reloaded conversation shows them and the next request sends them back). `at`: the length the
    reply's saved text had when the calls came, where the transcript draws them; the reply's text after `at`
    (past the paragraph break the session puts there) is the later turns'."""

    at: int
    content: str
    calls: tuple[ToolCall, ...]
    # in the calls' order; fewer than the calls where Stop (or a crash of the app) came first
    results: tuple[ToolResult, ...] = ()

    def outcomes(self) -> tuple[ToolResult, ...]:
        """One result per call: a call that never finished counts as stopped (the model must hear of every
        call it made: OpenAI's API refuses a call without its `tool` message)."""
        return self.results + (STOPPED,) * (len(self.calls) - len(self.results))

    def messages(self) -> list[dict[str, Any]]:
        """The turn as OpenAI messages: the assistant's calls, then one `tool` message per call."""
        head = {"role": "assistant", "content": self.content, "tool_calls": [c.message() for c in self.calls]}
        return [head, *(r.message(c) for c, r in zip(self.calls, self.outcomes(), strict=True))]

    def to_json(self) -> dict[str, Any]:
        return {
            "at": self.at,
            "content": self.content,
            "calls": [{"id": c.id, "name": c.name, "arguments": c.arguments} for c in self.calls],
            "results": [{"outcome": r.outcome, "content": r.content, "line": r.line} for r in self.results],
        }

    @staticmethod
    def from_json(value: Any) -> ToolRound | None:
        """A saved round; None where it is not one (a damaged file must not stop the conversation opening)."""
        if not isinstance(value, dict):
            return None
        at, content, calls, results = (value.get(k) for k in ("at", "content", "calls", "results"))
        if not (isinstance(at, int) and isinstance(content, str) and isinstance(calls, list)):
            return None
        if not isinstance(results, list) or len(results) > len(calls):
            return None
        out_calls = []
        for c in calls:
            if not isinstance(c, dict) or not all(isinstance(c.get(k), str) for k in ("id", "name", "arguments")):
                return None
            out_calls.append(ToolCall(c["id"], c["name"], c["arguments"]))
        out_results = []
        for r in results:
            if not isinstance(r, dict) or r.get("outcome") not in OUTCOMES:
                return None
            if not (isinstance(r.get("content"), str) and isinstance(r.get("line"), str)):
                return None
            out_results.append(ToolResult(r["outcome"], r["content"], r["line"]))
        return ToolRound(at, content, tuple(out_calls), tuple(out_results))


class ToolRunner(Protocol):
    """The tools a turn offers the model and how a call of one is run (asked about, shown, carried out)."""

    def openai_tools(self) -> list[dict[str, Any]]: ...

    async def run(self, call: ToolCall) -> ToolResult: ...
