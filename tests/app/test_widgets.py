"""The thin widgets: transcript streaming, graphs, chat panel intents (offscreen Qt)."""

from __future__ import annotations

from PySide6.QtCore import Qt, QUrl
from PySide6.QtGui import QGuiApplication, QTextCursor
from pytestqt.qtbot import QtBot

from runmyai.ui.chat_panel import PICKER_MAX_WIDTH, ChatPanel, SamplingValues
from runmyai.ui.graphs import GraphsPanel
from runmyai.ui.main_window import MainWindow
from runmyai.ui.transcript import MUTED, Transcript, markdown_fragment
from runmyai.ui.viewmodels import PERF_DOCK_MAX, PERF_DOCK_MIN, perf_dock_width
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


THOUGHT = "The user asks for a plan; give one with code."


def click_text(t: Transcript, qtbot: QtBot, text: str) -> None:
    """A real left click on the first occurrence of `text` (a link's words)."""
    found = t.document().find(text)
    assert not found.isNull(), text
    cursor = QTextCursor(t.document())
    cursor.setPosition(found.selectionStart() + 1)
    t.ensureCursorVisible()
    qtbot.mouseClick(t.viewport(), Qt.MouseButton.LeftButton, pos=t.cursorRect(cursor).center())


def color_at(t: Transcript, text: str) -> str:
    found = t.document().find(text)
    assert not found.isNull(), text
    return found.charFormat().foreground().color().name()


def test_reasoning_is_folded_above_the_reply_and_its_link_toggles_it(qtbot: QtBot) -> None:
    t = Transcript()
    qtbot.addWidget(t)
    t.resize(600, 600)
    t.show()
    t.add_message("user", "question")
    t.add_message("assistant", REPLY, "5 tok/s", reasoning=THOUGHT)
    folded = t.toPlainText()
    assert THOUGHT not in folded and t.reasoning_shown(1) is False and t.reasoning_shown(0) is None
    assert folded.index("Thought for 10 words — show") < folded.index("First bold point")  # above the reply

    click_text(t, qtbot, "Thought for")
    shown = t.toPlainText()
    assert t.reasoning_shown(1) is True and "Thought for 10 words — hide" in shown
    assert shown.index("— hide") < shown.index(THOUGHT) < shown.index("First bold point")
    assert color_at(t, THOUGHT) == MUTED and color_at(t, "First") != MUTED  # the reasoning is muted, the reply not

    click_text(t, qtbot, "Thought for")
    assert t.reasoning_shown(1) is False and t.toPlainText() == folded


def test_streamed_reasoning_shows_live_then_folds_when_the_reply_starts(qtbot: QtBot) -> None:
    t = Transcript()
    qtbot.addWidget(t)
    t.add_message("user", "question")
    t.add_message("assistant", "Earlier answer.", reasoning="Earlier thought.")
    t.add_message("user", "again")
    t.begin_reply()
    for i in range(0, len(THOUGHT), 4):
        t.append_reasoning(THOUGHT[i : i + 4])
    assert THOUGHT in t.toPlainText() and t.reasoning_shown(3) is True  # live, as it comes
    assert color_at(t, THOUGHT) == MUTED
    t.append_reply(REPLY[:5])
    assert THOUGHT not in t.toPlainText() and "Thought for 10 words — show" in t.toPlainText()  # folded
    t.toggle_reasoning(1)  # an earlier reply's reasoning opens while this one streams
    for i in range(5, len(REPLY), 3):
        t.append_reply(REPLY[i : i + 3])
    t.toggle_reasoning(3)
    assert t.end_reply("5 tok/s") == REPLY

    whole = Transcript()
    qtbot.addWidget(whole)
    whole.add_message("user", "question")
    whole.add_message("assistant", "Earlier answer.", reasoning="Earlier thought.")
    whole.add_message("user", "again")
    whole.add_message("assistant", REPLY, "5 tok/s", reasoning=THOUGHT)
    whole.toggle_reasoning(1)
    whole.toggle_reasoning(3)
    assert t.toPlainText().split() == whole.toPlainText().split()
    assert "Earlier thought." in t.toPlainText() and THOUGHT in t.toPlainText()


def test_reasoning_that_comes_after_the_text_starts_is_folded_above_it(qtbot: QtBot) -> None:
    """Servers other than the engine may send reasoning between pieces of text: it joins the fold above."""
    t = Transcript()
    qtbot.addWidget(t)
    t.begin_reply()
    t.append_reply(REPLY[:20])
    t.append_reasoning("late ")
    t.append_reply(REPLY[20:40])
    t.append_reasoning("thought")
    t.append_reply(REPLY[40:])
    assert t.end_reply() == REPLY and t.reasoning_shown(0) is False
    whole = Transcript()
    qtbot.addWidget(whole)
    whole.add_message("assistant", REPLY, reasoning="late thought")
    assert t.toPlainText() == whole.toPlainText()


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
    """The per-layer bars stack VRAM, RAM and drive; the VRAM swaps lines show the swaps in and out; the device
    line shows."""
    g = GraphsPanel()
    qtbot.addWidget(g)
    g.set_device("Computing on Vulkan0 (AMD Radeon RX 7800 XT); in VRAM: 12 layers")
    for t in range(3):  # token t: t layers take one expert in, t - 1 of them give one up
        layers = [
            Layer(i, 2, 1, vram_hits=5, vram_swaps_in=int(i < t), vram_swaps_out=int(i < t - 1)) for i in range(4)
        ]
        g.add(Event(t, layers))
    qtbot.waitUntil(lambda: g.summary.text().startswith("3 tokens"), timeout=60_000)  # a guard: redraws every 250 ms
    assert "VRAM swaps 3 in, 1 out" in g.summary.text() and "Vulkan0" in g.device.text()
    heights = {t: list(b.opts["height"]) for t, b in g.tier_bars.items()}
    bottoms = {t: list(b.opts["y0"]) for t, b in g.tier_bars.items()}
    assert heights == {"VRAM": [5 / 8] * 4, "RAM": [2 / 8] * 4, "drive": [1 / 8] * 4}
    assert bottoms["RAM"] == heights["VRAM"] and bottoms["drive"] == [7 / 8] * 4
    _x, y = g.vram_line.getData()
    assert list(y) == [0.0, 1.0, 2.0]
    _x, out = g.vram_out_line.getData()
    assert list(out) == [0.0, 0.0, 1.0]


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


def test_the_layer_chart_fits_the_narrowest_dock_and_the_check_sees_a_chart_wider_than_its_plot(qtbot: QtBot) -> None:
    """At 1280x800 the docked panel is PERF_DOCK_MIN wide: the layer chart's title once made the chart 359 px in a
    310 px plot, its last layer cut off, and the title check alone did not see it."""
    g = GraphsPanel()
    qtbot.addWidget(g)
    g.resize(PERF_DOCK_MIN, 700)
    g.show()
    for t in range(3):
        g.add(Event(t, [Layer(i, 6, 2) for i in range(6)]))
    qtbot.waitUntil(lambda: g.summary.text().startswith("3 tokens"), timeout=60_000)  # a guard: redraws every 250 ms
    assert g.axes_problems() == []
    g.hits_plot.setTitle("Where each layer's experts came from")  # the old title
    qtbot.waitUntil(lambda: g.hits_plot.getPlotItem().size().width() > g.hits_plot.width(), timeout=10_000)
    assert any("is wider than its plot" in p and "chart" in p for p in g.axes_problems())


def test_the_docked_panel_leaves_the_chat_room_at_1280_and_the_picker_stays_narrow_at_1920(qtbot: QtBot) -> None:
    w = MainWindow()
    qtbot.addWidget(w)
    w.show()
    w.resize(1280, 800)
    qtbot.waitUntil(lambda: abs(w.perf_dock.width() - perf_dock_width(1280)) <= 2, timeout=10_000)
    assert w.perf_dock.width() < 400 and w.chat.transcript.width() >= 480  # it was 470 px and 430 px
    w.resize(1920, 1080)
    qtbot.waitUntil(lambda: abs(w.perf_dock.width() - perf_dock_width(1920)) <= 2, timeout=10_000)
    assert w.chat.model_picker.width() <= PICKER_MAX_WIDTH  # it spread over 820 px
    # the Performance button stays at the chat column's right edge
    button = w.chat.perf_button
    right = button.mapTo(w.chat, button.rect().topRight()).x()
    assert right >= w.chat.transcript.mapTo(w.chat, w.chat.transcript.rect().topRight()).x() - 2


def test_perf_dock_width_is_a_share_between_its_bounds() -> None:
    assert perf_dock_width(1000) == PERF_DOCK_MIN
    assert perf_dock_width(1600) == 432
    assert perf_dock_width(4000) == PERF_DOCK_MAX


def test_zero_waits_draw_from_zero_and_a_long_chat_title_is_elided(qtbot: QtBot) -> None:
    """Seen with a model whose experts all fit: the wait and bytes axes ran from -20 to 20; and a long first message
    gave the conversation list a horizontal scroll bar."""
    g = GraphsPanel()
    qtbot.addWidget(g)
    g.resize(400, 800)
    g.show()
    for t in range(4):
        g.add(Event(t, [Layer(i, 8, 0) for i in range(2)], ssd_wait_ms=0.0))
    qtbot.waitUntil(lambda: g.summary.text().startswith("4 tokens"), timeout=60_000)  # a guard: redraws every 250 ms
    for plot in (g.wait_plot, g.bytes_plot):
        (_x0, _x1), (y0, y1) = plot.viewRange()
        assert y0 >= 0 and y1 > 0
    panel = ChatPanel()
    qtbot.addWidget(panel)
    panel.resize(900, 600)
    panel.show()
    panel.set_conversations([("1", "Write a Python function that adds two numbers and explains each step")], "1")
    qtbot.waitUntil(lambda: panel.conversations.count() == 1, timeout=10_000)
    assert not panel.conversations.horizontalScrollBar().isVisible()


def test_a_reset_clears_the_last_models_layers_from_the_axis(qtbot: QtBot) -> None:
    """After a model switch (the panel reset, no token yet) the layer axis showed the previous model's layers."""
    g = GraphsPanel()
    qtbot.addWidget(g)
    g.resize(400, 800)
    g.show()
    g.add(Event(0, [Layer(i, 6, 2) for i in range(6)]))
    qtbot.waitUntil(lambda: g.summary.text().startswith("1 tokens"), timeout=60_000)  # a guard: redraws every 250 ms
    assert {v for v, _ in g.hits_plot.getAxis("bottom")._tickLevels[0]} >= {0, 5}
    g.reset()
    assert g.hits_plot.getAxis("bottom")._tickLevels == [[]]
    (x0, x1), _ = g.hits_plot.viewRange()
    assert x1 - x0 <= 1.0
    g.add(Event(0, [Layer(i, 6, 2) for i in range(3)]))  # the next model's layers get their ticks
    qtbot.waitUntil(lambda: g.summary.text().startswith("1 tokens"), timeout=60_000)
    assert g.axes_problems() == [] and {v for v, _ in g.hits_plot.getAxis("bottom")._tickLevels[0]} >= {0, 2}


def test_what_follows_a_reply_ending_in_a_list_is_no_item_of_it(qtbot: QtBot) -> None:
    """The new-user walk: after a reply ending in a markdown list, its footer and every later message (the title,
    the text, Copy/Edit) were drawn as that list's items. Each block outside a reply's own markdown is in no list,
    whether the reply was streamed or added whole."""
    listed = "Points:\n\n- the first\n- the second"
    for streamed in (False, True):
        t = Transcript()
        qtbot.addWidget(t)
        t.add_message("user", "Tell me")
        if streamed:
            t.begin_reply()
            t.append_reply(listed)
            t.end_reply("5 tok/s")
        else:
            t.add_message("assistant", listed, "5 tok/s")
        t.add_message("user", "Thanks.")
        t.add_message("assistant", "You are welcome.", "6 tok/s")
        block, in_lists = t.document().begin(), []
        while block.isValid():
            if block.textList() is not None:
                in_lists.append(block.text())
            block = block.next()
        assert in_lists == ["the first", "the second"], (streamed, in_lists)
