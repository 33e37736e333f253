"""Measures stalls of the Qt event loop: the longest gap between ticks of a fast timer."""

from __future__ import annotations

import time

from PySide6.QtCore import QObject, QTimer


class LoopWatchdog(QObject):
    def __init__(self, interval_ms: int = 5) -> None:
        super().__init__()
        self.interval_s = interval_ms / 1000
        self.worst_s = 0.0
        self.ticks = 0
        self._last: float | None = None
        self.stalls: list[tuple[float, float]] = []  # (start, end) of gaps over 20 ms, for diagnostics
        self.stall_cpu_ms: list[float] = []  # the UI thread's own CPU time in each of those gaps
        self._last_cpu = 0.0
        self._timer = QTimer(self)
        self._timer.setInterval(interval_ms)
        self._timer.timeout.connect(self._tick)

    def start(self) -> LoopWatchdog:
        self._last = time.perf_counter()
        self._last_cpu = time.thread_time()
        self._timer.start()
        return self

    def stop(self) -> None:
        self._timer.stop()

    def _tick(self) -> None:
        now = time.perf_counter()
        cpu = time.thread_time()
        if self._last is not None:
            gap = now - self._last - self.interval_s
            self.worst_s = max(self.worst_s, gap)
            if gap > 0.02:
                self.stalls.append((self._last, now))
                self.stall_cpu_ms.append((cpu - self._last_cpu) * 1000)
        self._last = now
        self._last_cpu = cpu
        self.ticks += 1

    @property
    def worst_ms(self) -> float:
        return self.worst_s * 1000
