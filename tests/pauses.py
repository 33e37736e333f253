"""The test side of tokenwing/testpause.py: start an engine that stops at a named step, act there, let it go."""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable
from pathlib import Path

from tokenwing.testpause import DIR_ENV, GO, POINTS_ENV, REACHED

TIMEOUT_S = 300.0  # only a broken engine waits this long: reaching a step is awaited, never raced
# Every step of a repack, in order: reading the source, writing the output, the data's write-back, verifying,
# the output's fsync, just before its rename and just after it.
REPACK_STEPS = [
    "repack.read",
    "repack.write",
    "repack.flush",
    "verify",
    "output.fsync",
    "output.rename",
    "output.renamed",
]


class Pauses:
    """Points armed for the engines started with `env()` (or with `arm()`, for those that copy os.environ)."""

    def __init__(self, folder: Path, *points: str) -> None:
        self.folder = folder
        self.points = points
        folder.mkdir(parents=True, exist_ok=True)

    def env(self, base: dict[str, str] | None = None) -> dict[str, str]:
        return {**(os.environ if base is None else base), POINTS_ENV: ",".join(self.points), DIR_ENV: str(self.folder)}

    def arm(self, monkeypatch: object) -> None:
        """Sets the variables in this process's environment, for code that starts engines with a copy of it."""
        for key, value in self.env({}).items():
            monkeypatch.setenv(key, value)  # type: ignore[attr-defined]

    def reached(self, point: str) -> int | None:
        """The pid of the process waiting at `point`, or None if none got there yet."""
        try:
            return int((self.folder / (point + REACHED)).read_text())
        except FileNotFoundError:
            return None

    def wait(self, point: str, alive: Callable[[], bool] = lambda: True) -> int:
        """Waits until a process waits at `point`; fails if `alive()` turns false first (it ended before)."""
        deadline = time.monotonic() + TIMEOUT_S
        while (pid := self.reached(point)) is None:
            assert alive(), f"the engine ended before it reached {point}"
            assert time.monotonic() < deadline, f"the engine never reached {point}"
            time.sleep(0.005)
        return pid

    async def wait_async(self, point: str, alive: Callable[[], bool] = lambda: True) -> int:
        deadline = time.monotonic() + TIMEOUT_S
        while (pid := self.reached(point)) is None:
            assert alive(), f"the engine ended before it reached {point}"
            assert time.monotonic() < deadline, f"the engine never reached {point}"
            await asyncio.sleep(0.005)
        return pid

    def release(self, point: str) -> None:
        (self.folder / (point + GO)).touch()
