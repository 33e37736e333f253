"""Sizes in the app's words: one formatter for every sentence and widget of the app (decimal units, as drives,
downloads and the hub state sizes). The engine, a separate program, keeps its own (`tokenwing.fsutil`, binary
units, as memory budgets are stated); the app never imports the engine, so each side of that boundary has one."""

from __future__ import annotations


def human_bytes(n: float | None) -> str:
    """`1.2 GB`, `340 bytes`; None (a size the hub did not state) is `?`."""
    if n is None:
        return "?"
    for unit in ("bytes", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "bytes" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"  # pragma: no cover
