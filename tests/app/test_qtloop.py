"""The qasync loops the tests run on are closed without leaving a Qt timer behind (tests/qtloop.py says how a
closed loop, freed by another thread, crashed two CI runs minutes later). In a child process, because without the
fix the failure is a segmentation fault of the whole process."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

CHILD = r"""
import asyncio, gc, threading, time
import qasync
from PySide6.QtWidgets import QApplication
from tests.qtloop import close_loop

app = QApplication([])
loop = qasync.QEventLoop(app)
asyncio.set_event_loop(loop)
loop.run_until_complete(asyncio.wait_for(asyncio.sleep(0), 0.2))  # its cancelled 0.2 s timeout stays with Qt
asyncio.set_event_loop(None)
close_loop(loop)
held = [loop]
del loop
gc.disable()


def drop() -> None:  # the last reference goes, and the garbage is collected, on another thread (as in CI)
    held.clear()
    gc.collect()


t = threading.Thread(target=drop)
t.start()
t.join()
end = time.monotonic() + 1.0  # the timer was due 0.2 s after it was set, before this
while time.monotonic() < end:
    app.processEvents()
    time.sleep(0.02)
print("events processed after the timer was due")
"""


def test_a_closed_loop_freed_on_another_thread_leaves_no_timer() -> None:
    env = {**os.environ, "QT_QPA_PLATFORM": "offscreen", "PYTHONPATH": str(ROOT)}
    r = subprocess.run([sys.executable, "-c", CHILD], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "events processed after the timer was due" in r.stdout
    assert "Timers cannot be stopped from another thread" not in r.stderr
