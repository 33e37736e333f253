"""Features issue 29's audit found untested: the VRAM chart's visibility, the charts' legends, the Discover
badge's colour per estimate verdict (offscreen Qt)."""

from __future__ import annotations

import pytest
from pytestqt.qtbot import QtBot

from runmyai.library.estimate import Estimate
from runmyai.ui.graphs import GraphsPanel
from runmyai.ui.viewmodels import badge


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
        ("runs_well", "green", "Runs well here · ~12.5 tok/s"),
        ("runs_slowly", "yellow", "Runs slowly here · ~12.5 tok/s"),
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
