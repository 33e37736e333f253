"""Features issue 29's audit found untested: the VRAM chart's visibility, the charts' legends, the Discover
badge's colour per estimate verdict (offscreen Qt)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from PySide6.QtCore import Qt
from PySide6.QtTest import QTest
from PySide6.QtWidgets import QApplication
from pytestqt.qtbot import QtBot

import runmyai.ui.controllers.engine as engine_room
from runmyai.engine.faults import EngineError
from runmyai.library.estimate import Estimate
from runmyai.library.keys import LocalKey
from runmyai.paths import AppPaths
from runmyai.ui.controller import AppController
from runmyai.ui.graphs import GraphsPanel
from runmyai.ui.main_window import MainWindow
from runmyai.ui.viewmodels import badge
from tests.qtloop import run_qt


def test_the_vram_chart_is_hidden_without_a_gpu_and_shown_with_one(qtbot: QtBot) -> None:
    g = GraphsPanel()
    qtbot.addWidget(g)
    g.show()
    qtbot.waitExposed(g)
    assert not g.vram_plot.isVisible() and not g.vram_legend.isVisible()  # a new panel assumes no GPU
    g.set_has_gpu(True)
    assert g.vram_plot.isVisible() and g.vram_legend.isVisible()
    assert "VRAM" in g.hits_legend.text()
    g.set_has_gpu(False)
    assert not g.vram_plot.isVisible() and not g.vram_legend.isVisible()
    assert "VRAM" not in g.hits_legend.text()


def test_the_charts_legends_name_their_series(qtbot: QtBot) -> None:
    g = GraphsPanel()
    qtbot.addWidget(g)
    g.set_has_gpu(True)
    for name in ("VRAM", "RAM", "drive", "in memory, mean"):
        assert name in g.hits_legend.text()
    assert " in " in f" {g.vram_legend.text()} " and "out" in g.vram_legend.text()


def _estimate(verdict: str, tokens_per_s: float) -> Estimate:
    return Estimate(tokens_per_s=tokens_per_s, verdict=verdict, reasons=(), hit_rate=0.9, cache_bytes=1)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("verdict", "colour", "words"),
    [
        ("runs_well", "green", "Runs well here · ~12 tok/s · estimated from its shape"),
        ("runs_slowly", "yellow", "Runs slowly here · ~12 tok/s · estimated from its shape"),
        ("no_disk_space", "red", "Not enough disk space"),
        ("unsupported", "red", "Not supported by this engine"),
    ],
)
def test_the_discover_badge_colour_follows_the_estimate(verdict: str, colour: str, words: str) -> None:
    b = badge(_estimate(verdict, 12.5))
    assert (b.colour, b.line) == (colour, words)


def test_the_badge_is_grey_without_an_estimate_and_red_for_a_broken_file() -> None:
    assert badge(None).colour == "grey"
    assert badge(_estimate("runs_well", 9.0), error="bad header").colour == "red"
    assert badge(_estimate("runs_well", 9.0), supported=False).colour == "red"


def test_the_settings_context_length_reaches_the_engines_launch_flags(
    qapp: QApplication, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The seam is the supervisor the controller hands its flags to: a recorder that refuses to start, so no
    engine runs."""
    launched: list[list[str]] = []

    class Recorder:
        def __init__(self, path: Path, flags: list[str], **kw: Any) -> None:
            launched.append(list(flags))
            self.model = path

        async def start(self) -> None:
            raise EngineError("not started in this test")

        async def stop(self) -> None:
            return None

    async def flows() -> None:
        window = MainWindow()
        c = AppController(window, AppPaths(tmp_path / "home"))
        try:
            await c.start()
            monkeypatch.setattr(engine_room, "EngineSupervisor", Recorder)
            c.prefs.set_context(8192)
            assert c.models.local_models, "the built-in model"
            await c.engine.use_model(str(LocalKey(c.models.local_models[0].path)))
            c.engine.supervisor = None
            await c.shutdown()
        finally:
            window.close()

    run_qt(qapp, flows)
    assert launched, "the controller made no supervisor"
    flags = launched[-1]
    last = len(flags) - 1 - flags[::-1].index("--ctx")  # the last --ctx counts (the preset's own comes first)
    assert flags[last + 1] == "8192"


def test_my_models_last_used_column_shows_a_model_once_used(qapp: QApplication, tmp_path: Path) -> None:
    """The use itself needs a running engine; this checks the half after it: the use recorded (what use_model
    does once the engine answers) shows in the table's last column, across a restart of the app."""
    home = tmp_path / "home"

    async def last_used(mark: bool) -> str:
        window = MainWindow()
        c = AppController(window, AppPaths(home))
        try:
            await c.start()
            path = c.models.local_models[0].path
            if mark:
                c.models.mark_used(path)
                c.models.show_models()
            table = window.models_page.table
            cells = [[table.item(r, col) for col in range(table.columnCount())] for r in range(table.rowCount())]
            [row] = [cs for cs in cells if cs[0] is not None and cs[0].toolTip() == str(path)]
            last = row[-1]
            assert last is not None
            text = last.text()
            await c.shutdown()
        finally:
            window.close()
        return text

    assert run_qt(qapp, lambda: last_used(False)) == "never"
    # (not "just now": a loaded machine may take a minute between the use and the reading)
    assert run_qt(qapp, lambda: last_used(True)).endswith(("just now", "ago"))
    assert run_qt(qapp, lambda: last_used(False)).endswith(("just now", "ago"))  # read back from the app's file


def test_keyboard_shortcuts_switch_pages_start_a_chat_and_focus(qtbot: QtBot) -> None:
    w = MainWindow()
    qtbot.addWidget(w)
    w.show()
    w.activateWindow()
    qtbot.waitExposed(w)
    qtbot.waitActive(w)  # shortcuts go to the active window only
    ctrl = Qt.KeyboardModifier.ControlModifier
    win = w.windowHandle()  # through the window system, as a real key press comes: its shortcut map runs first
    QTest.keyClick(win, Qt.Key.Key_3, ctrl)
    assert w.current_page() == "My models"
    QTest.keyClick(win, Qt.Key.Key_Comma, ctrl)
    assert w.current_page() == "Settings"
    with qtbot.waitSignal(w.chat.new_conversation_requested, timeout=1000):  # emitted inside the key press
        QTest.keyClick(win, Qt.Key.Key_N, ctrl)
    assert w.current_page() == "Chat"
    QTest.keyClick(win, Qt.Key.Key_2, ctrl)
    assert w.current_page() == "Discover"
    QTest.keyClick(win, Qt.Key.Key_F, ctrl)
    assert w.current_page() == "Chat" and w.chat.search.hasFocus()
    QTest.keyClick(win, Qt.Key.Key_L, ctrl)
    assert w.chat.input.hasFocus()
    with qtbot.waitSignal(w.chat.regenerate_requested, timeout=1000):
        QTest.keyClick(win, Qt.Key.Key_R, ctrl)
