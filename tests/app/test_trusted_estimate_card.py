"""The card's words follow its numbers (issue 50, item 4): Discover's card of a model measured here shows its measured
range and where it came from, another model its estimated range, neither cut at the smallest window."""

from __future__ import annotations

import dataclasses

from PySide6.QtWidgets import QApplication
from pytestqt.qtbot import QtBot

from runmyai.ui import render
from runmyai.ui.library_panel import BASIS_ROLE, LINE_ROLE, LibraryPanel
from tests.app.test_trusted_estimate import CATALOG, ENGINE, MACHINE, demo_local, run


def test_the_cards_say_a_measured_and_an_estimated_range(qtbot: QtBot) -> None:
    local, preset = demo_local()
    chats = tuple(run(v, at=i, source="chat") for i, v in enumerate((40.0, 55.0, 48.0)))
    view = render.View(dataclasses.replace(MACHINE, speeds=chats), ENGINE)
    q30 = CATALOG.get("qwen3-30b-a3b")
    assert q30 is not None
    measured = render.local_entry(local, preset, view)  # type: ignore[arg-type]
    estimated = render.preset_entry(q30, view)
    panel = LibraryPanel()
    qtbot.addWidget(panel)
    panel.resize(1280 - 80, 800)  # the window's smallest size, less the navigation rail
    panel.show()
    panel.set_entries([measured, estimated], measured.key)
    QApplication.processEvents()
    card, other = panel.models.item(0), panel.models.item(1)
    assert card.data(LINE_ROLE) == "Runs well here · ~40–55 tok/s" and card.data(BASIS_ROLE) == "measured: 3 chats"
    assert "not a measurement" not in measured.details_html.split("<li>")[1]  # its first reason: measured
    assert str(other.data(LINE_ROLE)).startswith("Runs ") and "–" in str(other.data(LINE_ROLE))
    assert other.data(BASIS_ROLE) == "estimated, calibrated by 3 runs"
    assert "~0.0" not in str(other.data(LINE_ROLE))
    assert panel.models.card_problems() == []  # neither line is cut
    assert "measured: 3 chats" in panel.badge_line.text()  # the selected card's headline says it whole
    # the widest lines the formats make fit the narrowest card (a tiny model's "~3.7k–11.1k tok/s" did not)
    for line in ("Runs well here · ~9.9k–99k tok/s", "Runs slowly here · ~8.8–9.9 tok/s"):
        card.setData(LINE_ROLE, line)
        assert panel.models.delegate.elided(card, panel.models.MIN_WIDTH) == ("", ""), line
    # and layout_check would say so where a card cut them (the words, on a 250-px card)
    wordy = dataclasses.replace(estimated, basis="estimated from the model's shape, calibrated by autotune and 3 chats")
    panel.set_entries([measured, wordy])
    QApplication.processEvents()
    assert any("cuts its estimate" in p for p in panel.models.card_problems())
