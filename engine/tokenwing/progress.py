"""A byte-counting progress bar with rate and ETA on stderr (in place on a terminal, sparse lines otherwise).

With `use_json_lines()` (the CLI's `--progress-json`), every update is one JSON object on its own line instead,
for programs such as the app: {"progress": LABEL, "done": BYTES, "total": BYTES, "bytes_per_s": RATE}.
"""

from __future__ import annotations

import json
import sys
import time
from typing import TextIO

from tokenwing.fsutil import human_bytes

_json_lines = False


def use_json_lines(enabled: bool = True) -> None:
    """Makes every bar created after this call print JSON lines (a first one at 0, one at the end)."""
    global _json_lines
    _json_lines = enabled


class Progress:
    def __init__(self, label: str, total: int, stream: TextIO | None = None, enabled: bool = True) -> None:
        self.label = label
        self.total = max(total, 1)
        self.done = 0
        self.stream = stream or sys.stderr
        self.enabled = enabled
        self.json = _json_lines
        self.tty = self.stream.isatty() and not self.json
        self.start = time.monotonic()
        self._last = self.start
        self._drawn = False
        self._interval = 0.2 if self.tty or self.json else 5.0
        if self.enabled and self.json:
            self._draw(self.start)

    def advance(self, n: int) -> None:
        self.done += n
        now = time.monotonic()
        if self.enabled and now - self._last >= self._interval:
            self._last = now
            self._draw(now)

    def _draw(self, now: float) -> None:
        self._drawn = True
        elapsed = max(now - self.start, 1e-9)
        rate = self.done / elapsed
        if self.json:
            record = {"progress": self.label, "done": self.done, "total": self.total, "bytes_per_s": round(rate)}
            self.stream.write(json.dumps(record) + "\n")
            self.stream.flush()
            return
        frac = min(self.done / self.total, 1.0)
        eta = (self.total - self.done) / rate if rate > 0 else 0.0
        bar = "#" * int(frac * 24)
        line = (
            f"{self.label} [{bar:<24}] {frac * 100:5.1f}% {human_bytes(self.done)}/{human_bytes(self.total)}"
            f" {human_bytes(rate)}/s ETA {_clock(eta)}"
        )
        if self.tty:
            self.stream.write("\r" + line + "\x1b[K")
        else:
            self.stream.write(line + "\n")
        self.stream.flush()

    def finish(self) -> float:
        """Ends the bar; returns the elapsed seconds."""
        now = time.monotonic()
        if self.enabled and self._drawn:  # a job too quick to have shown a bar shows none
            self._draw(now)
            if self.tty:
                self.stream.write("\n")
        return now - self.start


def _clock(seconds: float) -> str:
    s = int(seconds)
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}"
