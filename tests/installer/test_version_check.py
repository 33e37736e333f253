"""The app refuses an engine of another version with a clear message (AppController.use_model).

An engine of another version cannot be built from this checkout, so `other_version_engine.py` stands in for it:
it speaks the start-up protocol (handshake line, /health) with a version of our choosing.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import psutil
import pytest
from PySide6.QtWidgets import QApplication

from runmyai import __version__
from runmyai.engine import supervisor as supervisor_module
from runmyai.paths import AppPaths
from runmyai.ui.controller import AppController
from runmyai.ui.main_window import MainWindow
from tests.conftest import ModelFactory
from tests.qtloop import run_qt

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

STAND_IN = Path(__file__).with_name("other_version_engine.py")


def make_controller(tmp_path: Path) -> AppController:
    for name in ("presets", "resources"):
        (tmp_path / name).mkdir(exist_ok=True)
    return AppController(
        MainWindow(),
        AppPaths(tmp_path / "home"),
        offline=True,
        presets_dir=tmp_path / "presets",
        resources_dir=tmp_path / "resources",
    )


def test_one_version_for_app_and_engine(repacked_factory: ModelFactory) -> None:
    """The version the build stamps (read from version.py as installer/build-linux.sh reads it) is what the app
    reports and what the real engine reports: on its command line, and in the handshake the app checks."""
    text = (Path(__file__).resolve().parents[2] / "engine" / "tokenwing" / "version.py").read_text()
    found = re.search(r'__version__ = "(.+?)"', text)
    assert found is not None
    stamped = found[1]
    assert __version__ == stamped
    r = subprocess.run([sys.executable, "-m", "tokenwing", "--version"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stdout.strip() == f"tokenwing {stamped}"
    serve = [sys.executable, "-m", "tokenwing", "serve", str(repacked_factory()), "--port", "0", "--watch-stdin"]
    engine = subprocess.Popen(serve, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert engine.stdout is not None
        handshake = json.loads(engine.stdout.readline())
    finally:
        engine.communicate(timeout=60)  # stdin closed: the engine stops
    assert handshake["version"] == stamped


def _with_stand_in(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, version: str) -> tuple[AppController, Path]:
    """An app controller whose engine is the stand-in reporting `version`, and a model file for it."""
    monkeypatch.setattr(supervisor_module, "engine_command", lambda: [sys.executable, str(STAND_IN)])
    monkeypatch.setenv("OTHER_ENGINE_VERSION", version)
    model = tmp_path / "any.tw.gguf"
    model.write_bytes(b"the stand-in never reads it")
    return make_controller(tmp_path), model


@pytest.mark.parametrize("other", ["0.0.0-other", "9.9.9"])
def test_engine_of_another_version_is_refused(
    qapp: QApplication, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, other: str
) -> None:
    c, model = _with_stand_in(tmp_path, monkeypatch, other)

    async def scenario() -> tuple[object, supervisor_module.EngineSupervisor | None]:
        try:
            return await c.engine.use_model(f"local:{model}"), c.engine.supervisor
        finally:
            await c.shutdown()

    endpoint, sup = run_qt(qapp, scenario, timeout=60)
    assert endpoint is None
    assert c.engine.endpoint is None and not c.engine.ready.is_set()
    want = f"This engine is version {other}, but Run My AI {__version__} needs the same version; reinstall Run My AI."
    assert c.ctx.errors[-1] == want
    assert any(want in t for t in c.window.notice_area.texts())  # the user sees it, whole
    assert sup is not None and sup.handshake is not None and sup.handshake["version"] == other  # it did start
    assert sup.state == "stopped" and sup.pid is None  # and was stopped, not left running
    pid = sup.handshake["pid"]
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE


def test_engine_of_the_same_version_is_used(
    qapp: QApplication, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The control: the same stand-in reporting our version is accepted (so the refusal above is about the version)."""
    c, model = _with_stand_in(tmp_path, monkeypatch, __version__)

    async def scenario() -> object:
        try:
            return await c.engine.use_model(f"local:{model}")
        finally:
            await c.shutdown()

    endpoint = run_qt(qapp, scenario, timeout=60)
    assert endpoint is not None
    assert not any("needs the same version" in e for e in c.ctx.errors)
