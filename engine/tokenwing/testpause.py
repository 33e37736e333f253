"""Test-only pauses at named steps, so that a test acts at a known point of the work instead of racing it.

Never set in normal use. A test starts the engine with TOKENWING_TEST_PAUSE=POINT[,POINT…] and
TOKENWING_TEST_PAUSE_DIR=DIR; the first time the process reaches `pause(POINT)` it writes DIR/POINT.reached
(holding its pid) and waits until DIR/POINT.go exists. Signals are handled while it waits, so a SIGINT sent to
a paused process acts exactly where that step is. Without the variable, `pause` is one set lookup.

The points: repack.read, repack.write, repack.flush (the periodic write-back), verify (after the first expert
is checked), output.fsync, output.rename and output.renamed (fsutil.atomic_output), cli.decided (the command's outcome
is known).
"""

from __future__ import annotations

import os
import time

POINTS_ENV = "TOKENWING_TEST_PAUSE"
DIR_ENV = "TOKENWING_TEST_PAUSE_DIR"
REACHED = ".reached"
GO = ".go"
_POLL_S = 0.005

_armed = frozenset(p for p in os.environ.get(POINTS_ENV, "").split(",") if p)
_passed: set[str] = set()


def pause(point: str) -> None:
    """Test-only: waits at `point` when the environment asks for it (see the module's docstring)."""
    if point not in _armed or point in _passed:
        return
    _passed.add(point)
    folder = os.environ.get(DIR_ENV) or "."
    reached = os.path.join(folder, point + REACHED)
    with open(reached + ".tmp", "w") as f:
        f.write(str(os.getpid()))
    os.replace(reached + ".tmp", reached)  # whole or absent: the test reads the pid as soon as it sees the name
    go = os.path.join(folder, point + GO)
    while not os.path.exists(go):
        time.sleep(_POLL_S)
