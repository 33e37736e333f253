"""Runs a coroutine on a qasync loop (asyncio on Qt's event loop, as the app runs) and closes the loop safely.

Why closing needs care (two fresh-clone CI runs died of it: `Fatal Python error: Segmentation fault` in pytest-qt's
`processEvents` at the start of tests/installer, minutes after the last app test): qasync keeps every asyncio
timer as a Qt timer of one QObject (`loop._timer`), and `loop.close()` only marks it stopped — a timer cancelled
on the asyncio side (`asyncio.wait_for`'s timeout, whenever the coroutine finished first) stays registered with Qt
until it fires. The closed loop sits in reference cycles, so it is freed by whichever thread's allocation starts
the next garbage collection; when that is one of the test servers' threads, the QObject is destroyed off its
thread, Qt cannot unregister its timers ("QObject::~QObject: Timers cannot be stopped from another thread"), and
the timer, firing 240 s later in the main thread, calls into freed memory. `close_loop` destroys the timer object
on the main thread, which unregisters its timers, and collects the loop's cycles here.
"""

from __future__ import annotations

import asyncio
import gc
from collections.abc import Awaitable, Callable
from typing import TypeVar

import qasync
import shiboken6
from PySide6.QtWidgets import QApplication

T = TypeVar("T")


def close_loop(loop: qasync.QEventLoop) -> None:
    """Closes a qasync loop that is not running, leaving no Qt timer of it behind."""
    loop.close()  # joins qasync's executor threads (QThreads): one left running aborts Python at exit
    if shiboken6.isValid(loop._timer):
        shiboken6.delete(loop._timer)  # here, on its own thread: Qt unregisters its timers
    gc.collect()  # the loop's cycles are freed on this thread too, not by whichever thread collects next


def run_qt(qapp: QApplication, make: Callable[[], Awaitable[T]], timeout: float = 240) -> T:
    loop = qasync.QEventLoop(qapp)
    asyncio.set_event_loop(loop)
    try:
        result: T = loop.run_until_complete(asyncio.wait_for(make(), timeout))
        return result
    finally:
        loop.run_until_complete(loop.shutdown_asyncgens())  # as asyncio.run does: close what streams left open
        asyncio.set_event_loop(None)
        close_loop(loop)
