"""Issue 41 (minor): a stop leaves no native object of `tokenwing._core` alive at the interpreter's exit. Each one
alive there makes nanobind print a leak report (17 lines at every SIGTERM of a server that had served a request:
the stop of the engine thread sat after a `finally` that uvicorn's re-raised Interrupted skipped)."""

from __future__ import annotations

import contextlib
import json
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.conftest import ModelFactory
from tests.engine.test_server import KEY, Server
from tests.pauses import Pauses
from tokenwing.testpause import GO


@contextlib.contextmanager
def _sigint_at_its_default() -> Iterator[None]:
    """Children started inside see SIGINT at its default, as a terminal's foreground job does: a shell runs a
    background job (this suite under `nohup … &`) with SIGINT ignored, an ignored signal stays ignored across exec,
    and the engine then never saw the SIGINT these tests send (both SIGINT cases failed so, in a CI run started in
    the background). A handler set here is reset to the default in the child at exec."""
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, before)


def _leak_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if "leaked" in line or "nanobind" in line]


@pytest.mark.parametrize(("sig", "code"), [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_a_signalled_server_stops_with_no_leak_report(
    repacked_factory: ModelFactory, sig: signal.Signals, code: int
) -> None:
    with _sigint_at_its_default():
        s = Server(repacked_factory(type="Q8_0", n_layer=2), "--no-usage-table")
    reply = s.client().chat.completions.create(
        model="x", messages=[{"role": "user", "content": "Hello"}], max_tokens=4, temperature=0
    )
    assert reply.choices[0].message.role == "assistant"  # the engine thread holds a session now
    s.proc.send_signal(sig)
    _, err = s.proc.communicate(timeout=30)
    assert s.proc.returncode == code, err
    assert "interrupted" in err  # it did stop through the signal's path
    assert not _leak_lines(err), err


@pytest.mark.parametrize(("sig", "code"), [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_a_signalled_run_stops_with_no_leak_report(
    repacked_factory: ModelFactory, sig: signal.Signals, code: int
) -> None:
    model = repacked_factory(type="Q8_0", n_layer=2)
    argv = [sys.executable, "-m", "tokenwing", "run", str(model), "--prompt", "Once", "-n", "100000", "--temp", "0"]
    with _sigint_at_its_default():
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout is not None
    assert proc.stdout.read(4)  # a deterministic point: it is generating (the model never stops by itself soon)
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == code, err
    assert not _leak_lines(err.decode()), err.decode()


def test_a_finished_run_exits_with_no_leak_report(repacked_factory: ModelFactory) -> None:
    model = repacked_factory(type="Q8_0", n_layer=2)
    argv = [sys.executable, "-m", "tokenwing", "run", str(model), "--prompt", "Once", "-n", "4"]
    r = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert not _leak_lines(r.stderr), r.stderr


def test_a_request_open_at_sigterm_gets_a_json_503(
    repacked_factory: ModelFactory, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A request still open when the server stops is answered with the JSON 503 'the server is stopping', at
    once, not after uvicorn's grace second cancels its handler (a plain-text 500 and a traceback in the log, seen
    with a long reply at SIGTERM). The engine thread is held at serve.admit with the request waiting, so the
    answer can only come from the shutdown itself."""
    pauses = Pauses(tmp_path / "pauses", "serve.admit")
    pauses.arm(monkeypatch)
    s = Server(repacked_factory(type="Q8_0", n_layer=2), "--no-usage-table")
    got: dict[str, Any] = {}

    def ask(stream: bool) -> None:
        body = {"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 4, "stream": stream}
        r = httpx.post(
            f"{s.url}/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {KEY}"}, timeout=60
        )
        got[f"stream={stream}"] = (r.status_code, r.headers.get("content-type"), r.text)

    threads = [threading.Thread(target=ask, args=(stream,)) for stream in (False, True)]
    for t in threads:
        t.start()
    pauses.wait("serve.admit", lambda: s.proc.poll() is None)
    deadline = time.monotonic() + 60
    while httpx.get(s.url + "/health").json()["queued"] < 2:  # both submitted (the engine, held, admits neither)
        assert time.monotonic() < deadline and s.proc.poll() is None
        time.sleep(0.01)
    s.proc.send_signal(signal.SIGTERM)
    for t in threads:
        t.join(timeout=60)
    (pauses.folder / ("serve.admit" + GO)).touch()  # the engine thread goes on, and ends
    _, err = s.proc.communicate(timeout=30)
    for status, kind, text in got.values():
        assert status == 503 and kind == "application/json", text
        assert json.loads(text)["error"]["message"] == "the server is stopping"
    assert len(got) == 2 and s.proc.returncode == 143, err
    assert "Traceback" not in err and "Exception in ASGI application" not in err, err


def test_a_reply_mid_step_when_the_loop_closes_ends_without_a_traceback(
    repacked_factory: ModelFactory, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The engine thread still in a step when the server's loop has closed (a long reply at SIGTERM or at stdin's
    close: its 503 went out from stop_soon, the loop closed, the step then emitted its token) ends quietly. Its
    emit into the closed loop raised 'Event loop is closed', so did the failure report's, and the thread died
    with two tracebacks in the log (seen in the app's stop with a reply streaming). Held at serve.decode with the
    reply open until the main thread is past the loop (serve.stopped), the step runs exactly then."""
    pauses = Pauses(tmp_path / "pauses", "serve.decode", "serve.stopped")
    pauses.arm(monkeypatch)
    s = Server(repacked_factory(type="Q8_0", n_layer=2), "--no-usage-table")
    got: list[str] = []

    def ask() -> None:
        body = {"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 32, "stream": True}
        with httpx.stream(
            "POST", f"{s.url}/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {KEY}"}, timeout=60
        ) as r:
            got.extend(r.iter_lines())

    t = threading.Thread(target=ask)
    t.start()
    pauses.wait("serve.decode", lambda: s.proc.poll() is None)
    s.proc.send_signal(signal.SIGTERM)
    t.join(timeout=60)
    pauses.wait("serve.stopped", lambda: s.proc.poll() is None)
    (pauses.folder / ("serve.decode" + GO)).touch()  # the step runs now, into the closed loop
    (pauses.folder / ("serve.stopped" + GO)).touch()
    _, err = s.proc.communicate(timeout=60)
    assert any("the server is stopping" in line for line in got), got
    assert s.proc.returncode == 143, err
    assert "Traceback" not in err and "Event loop is closed" not in err, err
