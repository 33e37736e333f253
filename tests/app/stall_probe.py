"""Diagnostics for LoopWatchdog failures: samples the main thread's stack so a stall can be attributed."""

from __future__ import annotations

import sys
import threading
import time
import traceback
from collections import Counter


class StackSampler:
    def __init__(self, interval_s: float = 0.005) -> None:
        self.interval_s = interval_s
        self.samples: list[tuple[float, str]] = []
        self._main = threading.main_thread().ident
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> StackSampler:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.is_set():
            frame = sys._current_frames().get(self._main or 0)
            if frame is not None:
                stack = traceback.extract_stack(frame)[-8:]
                self.samples.append(
                    (
                        time.perf_counter(),
                        " <- ".join(f"{f.name}@{f.filename.split('/')[-1]}:{f.lineno}" for f in reversed(stack)),
                    )
                )
            time.sleep(self.interval_s)

    def between(self, start: float, end: float) -> list[tuple[str, int]]:
        return Counter(s for t, s in self.samples if start <= t <= end).most_common(5)
