"""The thin widgets: transcript streaming, graphs, chat panel intents (offscreen Qt)."""

from __future__ import annotations

from PySide6.QtCore import QUrl
from PySide6.QtGui import QGuiApplication
from pytestqt.qtbot import QtBot

from runmyai.ui.chat_panel import ChatPanel, SamplingValues
from runmyai.ui.graphs import GraphsPanel
from runmyai.ui.transcript import Transcript, markdown_fragment
from tests.app.stats_events import Event, Layer

REPLY = "# Plan\n\nFirst **bold** point.\n\n```python\nprint('hi')\n\nprint('there')\n```\n\nLast line."


def test_streamed_reply_renders_per_block_and_ends_like_a_whole_render(qtbot: QtBot) -> None:
    streamed = Transcript()
    qtbot.addWidget(streamed)
    streamed.begin_reply()
    for i in range(0, len(REPLY), 3):
        streamed.append_reply(REPLY[i : i + 3])
    assert streamed.streaming
    # renders happen when a block completes (heading, paragraph, code block), not per token
    assert streamed.renders <= 4
    assert streamed.end_reply("5 tok/s") == REPLY
    assert not streamed.streaming

    whole = Transcript()
    qtbot.addWidget(whole)
    whole.add_message("assistant", REPLY, "5 tok/s")
    assert streamed.toPlainText().split() == whole.toPlainText().split()
    assert "print('there')" in streamed.toPlainText()
    assert markdown_fragment("**x**").toPlainText() == "x"


def test_copy_links(qtbot: QtBot) -> None:
    t = Transcript()
    qtbot.addWidget(t)
    t.add_message("user", "question")
    t.add_message("assistant", REPLY)
    with qtbot.waitSignal(t.copy_requested) as blocker:
        t.anchorClicked.emit(QUrl("copycode:1:0"))
    assert blocker.args == ["print('hi')\n\nprint('there')\n"]
    assert QGuiApplication.clipboard().text() == "print('hi')\n\nprint('there')\n"
    t.anchorClicked.emit(QUrl("copy:1"))
    assert QGuiApplication.clipboard().text() == REPLY
    t.anchorClicked.emit(QUrl("copycode:7:9"))  # stale link: ignored, no exception
    assert QGuiApplication.clipboard().text() == REPLY


def test_graphs_draw_and_pause(qtbot: QtBot) -> None:
    g = GraphsPanel()
    qtbot.addWidget(g)
    for t in range(5):
        g.add(Event(t, [Layer(i, 6, 2) for i in range(4)], ssd_wait_ms=2.5))
    qtbot.waitUntil(
        lambda: g.summary.text().startswith("5 tokens"), timeout=60_000
    )  # a guard: redraws come every 250 ms
    assert "hit rate 75%" in g.summary.text()
    assert "VRAM swaps 0" in g.summary.text()
    _x, y = g.wait_line.getData()
    assert list(y) == [2.5] * 5
    g.pause_button.click()
    g.add(Event(6, [Layer(i, 6, 2) for i in range(4)]))
    assert g.series.tokens == 5
    g.pause_button.click()
    g.reset_button.click()
    assert g.summary.text() == "no tokens yet"


def test_graphs_show_three_tiers_and_the_device(qtbot: QtBot) -> None:
    """The per-layer bars stack VRAM, RAM and drive; the VRAM swaps line shows the swaps; the device line shows."""
    g = GraphsPanel()
    qtbot.addWidget(g)
    g.set_device("Computing on Vulkan0 (AMD Radeon RX 7800 XT); in VRAM: 12 layers")
    for t in range(3):
        g.add(Event(t, [Layer(i, 2, 1, vram_hits=5) for i in range(4)], vram_swaps=t))
    qtbot.waitUntil(lambda: g.summary.text().startswith("3 tokens"), timeout=60_000)  # a guard: redraws every 250 ms
    assert "VRAM swaps 3" in g.summary.text() and "Vulkan0" in g.device.text()
    heights = {t: list(b.opts["height"]) for t, b in g.tier_bars.items()}
    bottoms = {t: list(b.opts["y0"]) for t, b in g.tier_bars.items()}
    assert heights == {"VRAM": [5 / 8] * 4, "RAM": [2 / 8] * 4, "drive": [1 / 8] * 4}
    assert bottoms["RAM"] == heights["VRAM"] and bottoms["drive"] == [7 / 8] * 4
    _x, y = g.vram_line.getData()
    assert list(y) == [0.0, 1.0, 2.0]


def test_chat_panel_intents(qtbot: QtBot) -> None:
    p = ChatPanel()
    qtbot.addWidget(p)
    p.input.setPlainText("  hello  ")
    with qtbot.waitSignal(p.send_requested) as sent:
        p.send_button.click()
    assert sent.args == ["hello"]
    assert p.input.toPlainText() == ""
    p.set_busy(True)
    assert not p.send_button.isEnabled() and p.stop_button.isEnabled()
    v = SamplingValues(system_prompt="be brief", temperature=0.3, top_k=20, seed=7)
    p.settings.set_values(v)
    assert p.settings.values() == v
    p.set_conversations([("a", "First"), ("b", "Second")], "b")
    with qtbot.waitSignal(p.conversation_selected) as chosen:
        p.conversations.setCurrentRow(0)
    assert chosen.args == ["a"]
