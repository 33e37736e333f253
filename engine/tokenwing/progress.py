"""A byte-counting progress bar with rate and ETA on stderr (in place on a terminal, sparse lines otherwise)."""

from __future__ import annotations

import sys
import time
from typing import TextIO

from tokenwing.fsutil import human_bytes


class Progress:
    def __init__(self, label: str, total: int, stream: TextIO | None = None, enabled: bool = True) -> None:
        self.label = label
        self.total = max(total, 1)
        self.done = 0
        self.stream = stream or sys.stderr
        self.enabled = enabled
        self.tty = self.stream.isatty()
        self.start = time.monotonic()
        self._last = self.start
        self._drawn = False
        self._interval = 0.2 if self.tty else 5.0

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
