"""Issue 41 (minor): a stop leaves no native object of `tokenwing._core` alive at the interpreter's exit. Each one
alive there makes nanobind print a leak report (17 lines at every SIGTERM of a server that had served a request:
the stop of the engine thread sat after a `finally` that uvicorn's re-raised Interrupted skipped)."""

from __future__ import annotations

import contextlib
import signal
import subprocess
import sys
from collections.abc import Iterator

import pytest

from tests.conftest import ModelFactory
from tests.engine.test_server import Server


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
