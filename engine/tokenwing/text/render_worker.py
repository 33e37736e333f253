"""Chat templates rendered in a child process with a budget: memory, time and output (issue 41).

A template comes with a model file from a public hub, and the sandbox's guards on `*`, `**` and `+` left many
ways to grow a value (`~` doubling a string: 4 GB in 10.6 s; `range(10)|slice(100000000)`: 6.6 GB; repeated
`replace`, `ljust`, `center`, `'{:>999999999}'.format`, a dict doubled through `dict(**...)`), in the server's
own memory, where no guard could stop it and SIGTERM waited for it. Pattern-matching operators cannot close
that list, so the render runs where the budget is the environment's: a child process whose address space is
capped (RLIMIT_AS: a growth beyond it is a MemoryError there), which is killed when it takes longer than
TIME_LIMIT_S (an endless loop of small steps), and whose output is capped as before (chat.MAX_OUTPUT). Whatever
the template does, the engine loses at most the child, which the next render starts again.

One child per engine process, started on the first render, serves every template (compiled once each, kept for
the last few); renders are serialised through it. The frozen engine has no `-m`: the child is `tokenwing
__render_worker`, as compute/probe.py's is.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import pickle
import selectors
import struct
import subprocess
import sys
import threading
import time
from typing import Any

from tokenwing.errors import BadInputError
from tokenwing.testpause import pause

ARG = "__render_worker"
MEMORY_LIMIT = 1 << 30  # the child's address space: Python with Jinja takes ~60 MB; a prompt at most 4 MiB
# A render of the longest prompt (4 MiB) by a publisher's template takes well under a second. Tests shorten it
# (TOKENWING_TEST_RENDER_SECONDS) to see an endless template stopped without waiting the whole budget.
TIME_LIMIT_S = float(os.environ.get("TOKENWING_TEST_RENDER_SECONDS") or 10.0)
KEEP_TEMPLATES = 8
IN_PROCESS_ENV = "TOKENWING_RENDER_IN_PROCESS"  # set in the child itself: it renders where it is


class TemplateBudgetError(BadInputError):
    """A render went over its budget (memory or time): the template, not the request, is at fault."""


def _command() -> list[str]:
    if getattr(sys, "frozen", False):
        return [sys.executable, ARG]
    return [sys.executable, "-m", "tokenwing", ARG]


def write_message(fd: int, payload: bytes) -> None:
    data = struct.pack("<Q", len(payload)) + payload
    view = memoryview(data)
    while view:
        n = os.write(fd, view)
        view = view[n:]


def read_exact(fd: int, n: int, deadline: float | None) -> bytes | None:
    """n bytes from fd; None at its end or past `deadline` (time.monotonic)."""
    out = bytearray()
    with selectors.DefaultSelector() as sel:
        sel.register(fd, selectors.EVENT_READ)
        while len(out) < n:
            if deadline is not None:
                left = deadline - time.monotonic()
                if left <= 0 or not sel.select(left):
                    return None
            chunk = os.read(fd, n - len(out))
            if not chunk:
                return None
            out += chunk
    return bytes(out)


class _Renderer:
    """The parent's side: one child, started when needed, a lock around each render."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._proc: subprocess.Popen[bytes] | None = None
        self._closed = False
        self._sent = 0

    def _child(self) -> subprocess.Popen[bytes]:
        if self._proc is not None and self._proc.poll() is None:
            return self._proc
        env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}  # (a sanitizer's reserve breaks the cap)
        env[IN_PROCESS_ENV] = "1"
        try:
            self._proc = subprocess.Popen(
                _command(), stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, start_new_session=True
            )
        except OSError as e:
            raise BadInputError(f"cannot start the chat template's renderer: {e.strerror or e}") from None
        return self._proc

    def render(self, request: dict[str, Any]) -> str:
        payload = pickle.dumps(request, protocol=pickle.HIGHEST_PROTOCOL)
        with self._lock:
            if self._closed:
                raise BadInputError("the engine is stopping")
            proc = self._child()
            assert proc.stdin is not None and proc.stdout is not None
            deadline = time.monotonic() + TIME_LIMIT_S
            try:
                write_message(proc.stdin.fileno(), payload)
                if not request.get("compile"):
                    self._sent += 1
                    pause(f"render.sent{self._sent}")  # (tests: this process's N-th render in progress)
                head = read_exact(proc.stdout.fileno(), 8, deadline)
                body = read_exact(proc.stdout.fileno(), struct.unpack("<Q", head)[0], deadline) if head else None
            except OSError:
                body = None
            if body is None:
                timed_out = time.monotonic() >= deadline
                self._kill()
                if self._closed:
                    raise BadInputError("the engine is stopping")
                if timed_out:
                    raise TemplateBudgetError(
                        f"the chat template took longer than its {TIME_LIMIT_S:.0f} s budget and was stopped"
                    )
                raise TemplateBudgetError("the chat template's renderer ended during the render (over its budget)")
            reply = json.loads(body)
            if reply.get("budget"):
                self._kill()  # (the child ends after a MemoryError: the next render must not find it on its way out)
        if "prompt" in reply:
            return str(reply["prompt"])
        kind = TemplateBudgetError if reply.get("budget") else BadInputError
        raise kind(str(reply["error"]))

    def _kill(self) -> None:
        proc, self._proc = self._proc, None
        if proc is None:
            return
        with contextlib.suppress(OSError):
            proc.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=5)
        for f in (proc.stdin, proc.stdout):
            with contextlib.suppress(OSError):
                if f is not None:
                    f.close()

    def close(self) -> None:
        """Stops the child now, a render in progress too (its caller gets a BadInputError): for a stopping
        engine, which must not wait on a template."""
        self._closed = True
        self._kill()


_renderer = _Renderer()
atexit.register(_renderer._kill)


def render(request: dict[str, Any]) -> str:
    return _renderer.render(request)


def compile_template(template: dict[str, Any]) -> None:
    """The template (ChatTemplate._identity) compiled in the child, within the render's budget, and kept there
    for its renders; BadInputError (TemplateBudgetError: over the budget) where it cannot be."""
    _renderer.render({**template, "compile": True})


def stop() -> None:
    """Ends the child and any render in it; later renders are refused (the engine is stopping)."""
    _renderer.close()
