"""Test-only pauses at named steps, so that a test acts at a known point of the work instead of racing it.

Never set in normal use. A test starts the engine with TOKENWING_TEST_PAUSE=POINT[,POINT…] and
TOKENWING_TEST_PAUSE_DIR=DIR; the first process to reach `pause(POINT)` writes DIR/POINT.reached (holding its
pid) and waits until DIR/POINT.go exists (or the caller's own condition holds); later ones, a restarted engine
too, pass. Signals are handled while it waits, so a SIGINT sent to a paused process acts exactly where that step
is. Without the variable, `pause` is one set lookup.

`TOKENWING_TEST_TOKENS=ID[,ID…]` (tests only) makes every reply those tokens instead of what the model samples
(the last one repeats), so a test can drive the real server with a reply of known form (gpt-oss's harmony
channels, a family's tool calls) from a random-weight model; `ID,…;ID,…` scripts one reply per request, in order
(the last one then repeats), for a conversation of several turns.

The points: repack.read, repack.write, repack.flush (the periodic write-back), verify (after the first expert is
checked), output.fsync, output.rename and output.renamed (fsutil.atomic_output), cli.decided (the command's outcome
is known), serve.pieceN (a reply's N-th text piece was sent; it waits until the client goes), serve.admit (requests
are waiting for the server's slots; they are admitted together once it goes), serve.decode (a decode step is about
to run, its replies open), serve.stopped (the server's loop has closed; the engine thread is joined once it goes),
serve.restore (a slot's restore from the prompt cache on disk, on its own thread, before its read),
render.sentN (the process's N-th chat template render was sent to the renderer child: text/render_worker.py).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

POINTS_ENV = "TOKENWING_TEST_PAUSE"
DIR_ENV = "TOKENWING_TEST_PAUSE_DIR"
REACHED = ".reached"
GO = ".go"
_POLL_S = 0.005

_armed = frozenset(p for p in os.environ.get(POINTS_ENV, "").split(",") if p)
armed = bool(_armed)  # for callers that would otherwise build a point's name for nothing


TOKENS_ENV = "TOKENWING_TEST_TOKENS"
_scripts = [[int(t) for t in reply.split(",") if t.strip()] for reply in os.environ.get(TOKENS_ENV, "").split(";")]
_replies = [0]


def scripted_tokens() -> list[int] | None:
    """Test-only: the next reply's tokens when the environment scripts them (see the module's docstring)."""
    script = _scripts[min(_replies[0], len(_scripts) - 1)]
    _replies[0] += 1
    return script or None


def pause(point: str, until: Callable[[], bool] | None = None) -> None:
    """Test-only: waits at `point` when the environment asks for it (see the module's docstring), until the test
    lets it go or `until()` is true."""
    if arrive(point):
        hold(point, until)


def arrive(point: str) -> bool:
    """The first half of `pause`: tells the test this process is at `point`; True if it is to wait there (for
    code that must mark the step before it lets the test see it, then wait after)."""
    if point not in _armed:
        return False
    reached = os.path.join(os.environ.get(DIR_ENV) or ".", point + REACHED)
    try:
        os.close(os.open(reached + ".claimed", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644))  # the first process
    except FileExistsError:
        return False
    with open(reached + ".tmp", "w") as f:
        f.write(str(os.getpid()))
    os.rename(reached + ".tmp", reached)  # whole or absent: the test reads the pid as soon as it sees the name
    return True


def hold(point: str, until: Callable[[], bool] | None = None) -> None:
    """The second half of `pause`: waits until the test lets `point` go or `until()` is true."""
    go = os.path.join(os.environ.get(DIR_ENV) or ".", point + GO)
    while not os.path.exists(go) and not (until is not None and until()):
        time.sleep(_POLL_S)
