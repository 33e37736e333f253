"""The shell (issue 29, parts 1 and 6; defects 1 and 5): every page at 1280×800, 1600×1000 and 1920×1080 in light
and dark with nothing clipped and the charts holding every layer; errors whole in the notification area and
cleared by a later success; a regenerated reply replacing the old one on screen; the downloads table that never
resizes the window nor squeezes its buttons. Offscreen, with the real engine on a generated model."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from PySide6.QtWidgets import QApplication, QLabel, QPushButton, QWidget
from pytestqt.qtbot import QtBot

from runmyai.ui import layout_check
from runmyai.ui.app import SCREENSHOT_PAGES, SCREENSHOT_SIZES
from runmyai.ui.controller import AppController
from runmyai.ui.library_panel import DownloadsTable
from runmyai.ui.main_window import MainWindow
from runmyai.ui.viewmodels import PERF_DOCK_MIN, Notifications, plain_reason, search_conversations
from tests.app.hubserver import HubServer
from tests.app.test_app_scenario import make_controller, until
from tests.conftest import ModelFactory
from tests.qtloop import run_qt


def shown_texts(root: QWidget) -> list[str]:
    """Every text a user can see in the window: visible labels and buttons, the transcript."""
    texts = []
    for w in root.findChildren(QWidget):
        if not w.isVisible():
            continue
        if isinstance(w, QLabel):
            texts.append(layout_check._plain(w))
        elif isinstance(w, QPushButton):
            texts.append(w.text())
    return texts


# ---------------------------------------------------------------------------------------------- view-models
def test_notifications_say_the_reason_whole_and_clear_on_success() -> None:
    changes: list[int] = []
    n = Notifications(lambda: changes.append(1))
    error = "Importing garbage.gguf failed: Couldn't import garbage.gguf: tokenwing: error: not a GGUF file: no"
    notice = n.fail("import", "Importing garbage.gguf", error)
    # the title says what failed; the reason says why, whole, without the engine's prefixes; the rest on click
    assert notice.reason == "Couldn't import garbage.gguf: not a GGUF file: no." and notice.details == error
    assert not notice.retry  # a file that is not a GGUF stays one: no Retry
    n.fail("get:x/y", "Getting x/y", "Could not reach the hub at http://h for x/y after 4 tries: timed out")
    assert n.get("get:x/y") is not None and n.get("get:x/y").retry  # type: ignore[union-attr]
    n.succeeded("import")
    assert [i.key for i in n.items()] == ["get:x/y"] and len(changes) == 3
    n.job("get:x/y", "Getting x/y", "shard 1 of 3", 0.25)  # tried again: the failure gives way to progress
    assert n.items()[0].kind == "job"


def test_plain_reason_keeps_a_whole_sentence() -> None:
    reason, details = plain_reason("The engine crashed (SIGKILL).")
    assert (reason, details) == ("The engine crashed (SIGKILL).", "")
    assert search_conversations([("1", "Rust lifetimes"), ("2", "Cooking")], "rust") == [("1", "Rust lifetimes")]


# ---------------------------------------------------------------------------------------------- the window
@pytest.fixture
def chatting(
    qapp: QApplication, tiny_hub: tuple[HubServer, bytes], tmp_path: Path
) -> tuple[MainWindow, AppController, Path]:
    server, data = tiny_hub
    model = tmp_path / "home" / "models" / "local.tw.gguf"
    model.parent.mkdir(parents=True)
    model.write_bytes(data)
    window, c = make_controller(tmp_path, server, data)
    return window, c, model


def test_every_page_at_three_sizes_in_both_themes_is_unclipped_and_a_regenerate_replaces_the_reply(
    qapp: QApplication, chatting: tuple[MainWindow, AppController, Path]
) -> None:
    window, c, model = chatting
    seen: list[str] = []

    async def scenario() -> None:
        await c.start()
        assert await c.engine.use_model(f"local:{model}") is not None
        cid = c.talks.conversation_id or 0
        conversation = c.store.get(cid)
        assert conversation is not None
        settings = conversation.settings
        c.store.set_settings(cid, settings.__class__(temperature=0.0, max_tokens=60))
        c.talks.open_conversation(cid)
        first = await c.chat.chat_once("Tell me a story")
        assert first.strip()
        transcript = window.chat.transcript
        head = " ".join(first.split())[:30]
        assert " ".join(transcript.toPlainText().split()).count(head) == 1

        # defect 5: regenerate (greedy: the same reply again) shows one reply, not the old one above the new one
        window.chat.regenerate_button.click()
        await until(lambda: c.chat.reply_task is not None and c.chat.reply_task.done(), 120, "regenerate")
        shown = " ".join(transcript.toPlainText().split())
        assert shown.count(head) == 1, shown
        assert shown.count("You") == 1 and [m.role for m in c.store.messages(cid)] == ["user", "assistant"]
        assert "tok/s" in window.chat.speed_label.text() and "Context" in window.chat.context_label.text()
        await until(lambda: window.graphs.series.tokens > 0, 30, "stats")

        # part 6: every page, every size, both themes: no text cut, the charts hold every layer
        for theme in ("light", "dark"):
            window.settings_page.theme.setCurrentIndex(window.settings_page.theme.findData(theme))
            assert QApplication.palette().window().color().lightness() < 100 if theme == "dark" else True
            for width, height in SCREENSHOT_SIZES:
                window.resize(width, height)
                for page in SCREENSHOT_PAGES:
                    window.show_page(page)
                    window.graphs._dirty = True
                    await until(lambda: not window.graphs._dirty, 10, "redraw")
                    await asyncio.sleep(0.05)  # the layouts settle
                    assert (window.width(), window.height()) == (width, height)
                    problems = layout_check.clipped(window) + layout_check.chart_problems(window)
                    assert not problems, f"{page} at {width}x{height}, {theme}: {problems}"
                    seen.append(f"{page}-{width}-{theme}")
                    if page == "Chat":
                        assert window.perf_dock.isVisible() and window.graphs.series.layer_ids

        # the panel floated on its own window, at its narrowest and at a usual size, in the dark theme: nothing
        # cut either, the charts holding every layer (it was only checked docked)
        window.show_page("Chat")
        window.perf_dock.setFloating(True)
        for width, height in ((PERF_DOCK_MIN, 560), (640, 900)):
            window.perf_dock.resize(width, height)
            window.graphs._dirty = True
            await until(lambda: not window.graphs._dirty, 10, "redraw")
            await asyncio.sleep(0.05)
            assert window.perf_dock.isFloating() and window.perf_dock.isVisible()
            problems = layout_check.clipped(window.perf_dock) + layout_check.chart_problems(window.perf_dock)
            if height < 640:  # a panel this short scrolls its charts by design: a chart cut at its bottom is fine
                problems = [p for p in problems if p not in window.graphs.cut_charts()]
            assert not problems, f"floating at {width}x{height}: {problems}"
        window.perf_dock.setFloating(False)

        # the check sees a cut: a button squeezed below its text, a chart that shows part of the layers
        window.chat.send_button.setFixedWidth(20)
        await until(lambda: window.chat.send_button.width() == 20, 10, "layout")
        assert any("Send" in p for p in layout_check.clipped(window))
        window.chat.send_button.setMinimumWidth(0)
        window.chat.send_button.setMaximumWidth(16777215)
        layers = window.graphs.series.layer_ids
        window.graphs.hits_plot.setXRange(layers[0], layers[-1] - 1, padding=0)
        assert any("layers" in p for p in layout_check.chart_problems(window))
        await c.shutdown()

    try:
        run_qt(qapp, scenario)
    finally:
        window.close()
    assert len(seen) == 2 * len(SCREENSHOT_SIZES) * len(SCREENSHOT_PAGES)


def test_a_failed_import_is_said_whole_and_a_later_success_clears_it(
    qapp: QApplication, tiny_hub: tuple[HubServer, bytes], tmp_path: Path, model_factory: ModelFactory
) -> None:
    """Defect 1: the reason of a failed import was in a one-line label cut mid-sentence (and only whole in the
    log), and it stayed there after a later import worked."""
    server, data = tiny_hub
    window, c = make_controller(tmp_path, server, data)
    window.resize(1280, 800)
    garbage = tmp_path / "garbage.gguf"
    garbage.write_bytes(b"this is not a model, just some bytes " * 40)
    good = model_factory(type="Q8_0", seed=5)

    async def flow() -> None:
        await c.start()
        assert await c.jobs.import_files([garbage]) is None
        await until(lambda: any("garbage" in t for t in shown_texts(window)), 10, "the failure shown")
        notice = window.notifications.get("import")
        # in plain words (issue 50: the engine's "magic b'this'" and its exit code are for the details)
        assert notice is not None and "is damaged or not a GGUF model" in notice.reason
        assert any(notice.reason in t for t in shown_texts(window)), shown_texts(window)  # on screen
        assert not layout_check.clipped(window)  # and whole: nothing visible is cut
        card = window.notice_area.cards[0]
        assert not card.retry.isVisible()  # not a GGUF: trying again cannot help
        card.details_button.click()
        assert card.details.isVisible() and "garbage.gguf" in card.details.text().replace("\u200b", "")

        imported = await c.jobs.import_files([good])
        assert imported is not None
        assert not any("garbage" in t for t in shown_texts(window)), shown_texts(window)  # cleared by the success
        await c.shutdown()

    try:
        run_qt(qapp, flow)
    finally:
        window.close()


def test_the_downloads_table_never_resizes_the_window_nor_squeezes_its_buttons(qtbot: QtBot) -> None:
    """Defect 5: rows updating mid-download resized the whole window, and the buttons showed "Pause/esum/ance"."""
    window = MainWindow()
    qtbot.addWidget(window)
    window.resize(1280, 800)
    window.show()
    window.show_page("Discover")
    table: DownloadsTable = window.library.downloads
    assert not table.isVisible()  # no downloads: no empty table taking the page's room
    table.update_item("d0", "a/b/c.gguf", "queued", 0, None, 0.0, None, "")
    qtbot.waitUntil(lambda: table.isVisible())
    size = window.size()
    long = "Could not reach the hub at https://huggingface.co for a/b after 4 tries: the connection was reset"
    for i in range(40):
        for row in range(3):
            state = ("downloading", "paused", "failed")[(i + row) % 3]
            table.update_item(
                f"d{row}",
                f"owner/Some-Very-Long-Model-Name-GGUF/Q4_K_M/part-0000{row}-of-00009.gguf",
                state,
                i * 10**9,
                40 * 10**9,
                1.5e8 * (i + 1),
                3600.0 * i,
                long if state == "failed" else "",
            )
        QApplication.processEvents()
        assert window.size() == size
    problems = [p for p in layout_check.clipped(table) if "Button" in p]
    assert not problems, problems
    table.remove_item("d1")
    assert table.item_ids() == ["d0", "d2"]
    table.remove_item("d0")
    table.remove_item("d2")
    assert not table.isVisible()  # the last one gone, the table goes too
