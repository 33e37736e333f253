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


_UNITS = (("bytes", 1), ("KB", 10**3), ("MB", 10**6), ("GB", 10**9), ("TB", 10**12))


class SizeSum:
    """Byte counts one sentence adds up ("needs 10.3 GB (10.0 GB for the model + 0.3 GB kept free); 5.0 GB free
    — 5.3 GB short"): all in one unit (the largest's, as `human_bytes` would pick it, but at most GB, so that a
    margin of 0.3 GB still shows beside a model of 1,090 GB), each rounded once to a tenth, every sum or difference
    worked out from the rounded values. Each `human_bytes` rounded on its own, in its own unit, gives numbers a
    reader cannot add up (10.06 + 0.27 → "10.1 GB" + "268.4 MB" = "10.3 GB").

    `q(n)` is a count in tenths of the unit (bytes: whole bytes), `text(q)` says it; `finer()` is one unit down,
    for a difference that rounds to nothing."""

    def __init__(self, *sizes: float, unit: int | None = None) -> None:
        if unit is None:
            biggest = max((abs(s) for s in sizes), default=0)
            unit = next((i for i, (_, scale) in enumerate(_UNITS) if biggest < 1000 * scale), len(_UNITS) - 1)
            unit = min(unit, 3)
        self._unit = unit
        self.name, self._scale = _UNITS[unit]

    def q(self, n: float) -> int:
        return round(n) if self._unit == 0 else round(n * 10 / self._scale)

    def text(self, q: int) -> str:
        return f"{q} bytes" if self._unit == 0 else f"{q / 10:.1f} {self.name}"

    def finer(self) -> SizeSum | None:
        return SizeSum(unit=self._unit - 1) if self._unit > 0 else None
