"""App tests run Qt offscreen (no display needed)."""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Iterator
from typing import Any

import pytest

from tests.app.hubserver import HubServer
from tests.conftest import ModelFactory

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

REPO, FILE = "runmyai/tiny-TW", "tiny-qwen3moe.tw.gguf"


@pytest.fixture(autouse=True)
def _controllers_stop_following_the_desktop(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Every controller a test makes stops listening to the desktop's colour scheme when the test ends. The signal
    is the application's, which all the tests share: a controller whose test failed before its shutdown (or that
    never shut down) went on setting the theme, and a later test's "a fixed choice ignores the system" saw light
    where it had chosen dark (CI, after test_shell failed mid-flow)."""
    from runmyai.ui.controller import AppController

    made: list[AppController] = []
    init = AppController.__init__

    def recording(self: AppController, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        made.append(self)

    monkeypatch.setattr(AppController, "__init__", recording)
    yield
    for c in made:
        c.stop_following_desktop()
        # ... and its engine goes with it: one left serving (a test failed before its shutdown) was a child of the
        # test process that the supervisor tests' "no engine is left" then counted (CI, after test_shell failed)
        pid = c.engine.supervisor.pid if c.engine.supervisor is not None else None
        if pid is not None:
            with contextlib.suppress(OSError):
                os.killpg(pid, signal.SIGKILL)


@pytest.fixture
def tiny_hub(repacked_factory: ModelFactory) -> Iterator[tuple[HubServer, bytes]]:
    data = repacked_factory(type="Q8_0").read_bytes()
    with HubServer() as server:
        server.add_file(REPO, FILE, data, tags=["tokenwing"])
        server.faults.throttle_bps = max(1, len(data) // 2)  # a two-second download: the UI must stay live
        server.faults.drop_after = len(data) // 3  # and the connection drops once: the download resumes
        yield server, data
