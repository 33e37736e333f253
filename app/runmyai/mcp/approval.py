"""Whether a tool call may run: every call is asked about unless the user chose "always" for that tool. The
"always" choices are kept in the app's home, per server and tool, so they survive a restart; "once" and "deny"
are never kept."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Literal

Decision = Literal["once", "always", "deny"]


class ApprovalPolicy:
    def __init__(self, path: Path | None = None) -> None:
        self._path = path
        self._always: set[tuple[str, str]] = set()
        if path is not None:
            try:
                data = json.loads(path.read_text(encoding="utf-8"))
                self._always = {(s, t) for s, t in data.get("always", []) if isinstance(s, str) and isinstance(t, str)}
            except (OSError, ValueError, TypeError, AttributeError):
                pass  # none yet, or unreadable: every call is asked about, the safe side

    def needs_asking(self, server: str, tool: str) -> bool:
        return (server, tool) not in self._always

    def record(self, server: str, tool: str, decision: Decision) -> bool:
        """Notes the user's answer; True when the call may run."""
        if decision == "always":
            self._always.add((server, tool))
            self._save()
        return decision != "deny"

    def forget(self, server: str, tool: str | None = None) -> None:
        self._always = {(s, t) for s, t in self._always if not (s == server and tool in (None, t))}
        self._save()

    def always_allowed(self) -> list[tuple[str, str]]:
        return sorted(self._always)

    def _save(self) -> None:
        if self._path is None:
            return
        self._path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self._path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"always": sorted(self._always)}, indent=2), encoding="utf-8")
        tmp.replace(self._path)
