"""The shell's and the library's defects from issue 50's walk-through (item 6), each as the user met it: the rename
editor a few pixels tall, a notification shifting the page under the pointer, Open folder failing silently, the
performance panel's "layer (x0.001)", jargon and third chart cut at 1280x800, import errors in the engine's words
with Retry for a corrupt file, an imported model named after its file, a chat deleted with no way back, the status
line cut with "…". Offscreen, with the real engine where one is involved; no sleeps that race the code."""

from __future__ import annotations

from pathlib import Path

import pytest
from PySide6.QtCore import QPoint, Qt
from PySide6.QtTest import QTest
from PySide6.QtWidgets import QApplication, QLineEdit
from pytestqt.qtbot import QtBot

import tokenwing.testmodel.writer as writer
from runmyai.library.local import LocalLibrary, header_name, import_failure
from runmyai.monitor import plain_device
from runmyai.ui import layout_check
from runmyai.ui.controllers.conversations import UNDO_DELETE
from runmyai.ui.main_window import MainWindow
from tests.app.hubserver import HubServer
from tests.app.test_app_scenario import make_controller, until
from tests.conftest import ModelFactory
from tests.qtloop import run_qt
from tokenwing.format.gguf_io import KV
from tokenwing.testmodel import preset_shape

ENGINE_CPU_LINE = (
    "Computing on the CPU: no GPU found (vulkan: no Vulkan driver with a GPU; a CPU-only driver shows only when "
    "GGML_VK_VISIBLE_DEVICES names it)"
)


@pytest.fixture
def window(qtbot: QtBot) -> MainWindow:
    w = MainWindow()
    qtbot.addWidget(w)
    w.resize(1280, 800)
    w.show()
    qtbot.waitExposed(w)
    return w


def test_the_rename_editor_is_as_tall_as_its_text(qtbot: QtBot, window: MainWindow) -> None:
    chat = window.chat
    chat.set_conversations([("1", "A chat about rust lifetimes"), ("2", "Cooking")], "1")
    chat.rename_current()
    editor = next(e for e in chat.conversations.findChildren(QLineEdit) if e.isVisible())
    qtbot.waitUntil(lambda: editor.height() > 0)
    assert editor.height() >= editor.sizeHint().height(), (editor.height(), editor.sizeHint().height())
    assert layout_check.line_edit_problem(editor) is None
    assert not layout_check.clipped(chat)
    # the check sees a squeezed one (the walk-through's: a few pixels tall)
    editor.setFixedHeight(8)
    assert layout_check.line_edit_problem(editor) is not None


def test_a_notification_coming_or_going_moves_nothing_under_the_pointer(qtbot: QtBot, window: MainWindow) -> None:
    def page_at() -> QPoint:
        return window.pages.mapTo(window, QPoint(0, 0))

    before, size = page_at(), window.pages.size()
    window.notifications.fail("import", "Importing garbage.gguf failed", "garbage.gguf is damaged or not a GGUF model.")
    area = window.notice_area

    def whole() -> bool:  # every card shown, and inside the area (it grows to hold them)
        return bool(area.cards) and all(c.isVisible() and area.rect().contains(c.geometry()) for c in area.cards)

    qtbot.waitUntil(whole)
    assert page_at() == before and window.pages.size() == size
    card = area.cards[0]
    assert card.reason.isVisible()
    assert not layout_check.clipped(window), layout_check.clipped(window)
    # over the pages, inside them
    host = area.parentWidget()
    assert host is not None and host.rect().contains(area.geometry())
    window.notifications.info("x", "Another", "One more line that wraps " * 6)
    qtbot.waitUntil(lambda: len(area.cards) == 2 and whole())
    assert page_at() == before and window.pages.size() == size
    assert host.rect().contains(window.notice_area.geometry())
    window.notifications.forget("import")
    window.notifications.forget("x")
    qtbot.waitUntil(lambda: not window.notice_area.isVisible())
    assert page_at() == before and window.pages.size() == size


def test_the_performance_panel_speaks_plainly_and_shows_its_charts_whole_at_1280x800(
    qtbot: QtBot, window: MainWindow
) -> None:
    g = window.graphs
    g.set_device(plain_device(ENGINE_CPU_LINE), ENGINE_CPU_LINE)
    g.reset()  # no token yet: the layer axis is -0.5..0.5
    axis = g.hits_plot.getAxis("bottom")
    assert "x0.001" not in axis.labelString() and "layer" in axis.labelString(), axis.labelString()
    shown = g.device.text()
    assert "GGML" not in shown and "--" not in shown and "vulkan" not in shown.lower(), shown
    assert g.device.toolTip() == ENGINE_CPU_LINE  # the engine's own words, one hover away
    qtbot.waitUntil(lambda: g.plots_scroll.viewport().height() > 0)
    assert not g.cut_charts(), g.cut_charts()
    assert not layout_check.chart_problems(window) and not layout_check.clipped(g)
    # the check sees a chart the panel shows only part of: the walk-through's heights (210 and 150 px)
    g.hits_plot.setMinimumHeight(210)
    for plot in (g.wait_plot, g.bytes_plot):
        plot.setMinimumHeight(150)
    qtbot.waitUntil(lambda: bool(g.cut_charts()))
    assert any("Bytes read" in p for p in layout_check.chart_problems(window))


def test_device_lines_in_plain_words() -> None:
    assert plain_device(ENGINE_CPU_LINE) == "Computing on the CPU: no GPU was found."
    assert plain_device("Computing on the CPU (--device cpu)") == "Computing on the CPU, as set for this model."
    gpu = (
        "Computing on CUDA0 (NVIDIA H200), VRAM budget 130 GiB of 139 GiB free (9 GiB kept) (auto: CUDA first); "
        "in VRAM: 48 layers' attention"
    )
    assert plain_device(gpu) == (
        "Computing on the GPU NVIDIA H200, with up to 130 GiB of its memory for the model (there: 48 layers' "
        "attention)."
    )
    assert plain_device("The GPU failed (x): computing on the CPU from here on").startswith("The GPU failed")
    for line in (ENGINE_CPU_LINE, "Computing on the CPU: --device vulkan: this engine was built without vulkan"):
        assert "--" not in plain_device(line) and "GGML" not in plain_device(line)


def test_the_status_line_is_never_cut(window: MainWindow, qtbot: QtBot) -> None:
    status = window.chat.status
    text = "Chatting with TokenWing demo (22 M)."
    window.chat.set_footer("11.3 tok/s", "Context 99 / 512 tokens (19%)")  # as after a reply (the walk-through's)
    window.chat.set_status(text)
    labels = (window.chat.speed_label, window.chat.context_label)
    qtbot.waitUntil(lambda: all(label.width() >= label.sizeHint().width() for label in labels))  # laid out
    shown = getattr(status, "shown_text", status.text)()  # (an elided label shows less than its text)
    assert shown == text and "…" not in shown
    assert layout_check.label_problem(status) is None


def test_import_failures_in_plain_words() -> None:
    for kind in ("bad_input", "corrupt_model", "unsupported"):
        sentence, permanent = import_failure("m.gguf", "m.gguf: not a GGUF file (magic b'hell')", kind)
        assert permanent and "magic" not in sentence and "exit" not in sentence and "m.gguf" in sentence
    sentence, permanent = import_failure("m.gguf", "no space left", "no_disk_space")
    assert not permanent and "disk space" in sentence
    assert not import_failure("m.gguf", "killed", None)[1]  # a crash: Retry can help
    assert import_failure("m.gguf", "m.gguf: not a GGUF file (magic b'hell')", None)[1]  # words, unnamed codes


def test_header_names() -> None:
    assert header_name({"name": "Qwen3 30B A3B Instruct"}, "m.tw.gguf") == "Qwen3 30B A3B Instruct"
    assert header_name({"name": "m", "basename": "Qwen3", "size_label": "30B-A3B"}, "m.tw.gguf") == "Qwen3 30B-A3B"
    assert header_name({"basename": "Qwen3"}, "m.tw.gguf") == "Qwen3"
    assert header_name({"name": " "}, "m.tw.gguf") is None


def test_an_import_is_named_by_its_header_and_a_corrupt_one_is_refused_plainly(
    qapp: QApplication,
    tiny_hub: tuple[HubServer, bytes],
    tmp_path: Path,
    model_factory: ModelFactory,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    server, data = tiny_hub
    window, c = make_controller(tmp_path, server, data)
    window.resize(1280, 800)
    bad = tmp_path / "m.gguf"
    bad.write_bytes(b"hello, this is not a model " * 64)
    # a converter's header: general.name repeats the file's stem, general.basename and size_label name the model
    real_metadata = writer.model_metadata

    def named(shape: object, type_name: str, name: str) -> dict[str, KV]:
        kv = real_metadata(shape, type_name, name)  # type: ignore[arg-type]
        kv["general.basename"] = KV.string("Tiny-MoE")
        kv["general.size_label"] = KV.string("8x1M")
        return kv

    monkeypatch.setattr(writer, "model_metadata", named)
    good_dir = tmp_path / "src"
    good_dir.mkdir()
    good = Path(writer.write_test_model(str(good_dir / "m.gguf"), preset_shape("tiny", None), "Q8_0", seed=3)[0])

    async def flow() -> None:
        await c.start()
        assert await c.jobs.import_files([bad]) is None
        notice = window.notifications.get("import")
        assert notice is not None
        assert "magic" not in notice.reason and "exit code" not in notice.reason and "hell" not in notice.reason
        assert "m.gguf" in notice.reason and not notice.retry, notice
        assert "magic" in notice.details  # the engine's words: under Details
        await until(lambda: any(c.isVisible() and c.notice.key == "import" for c in window.notice_area.cards))
        card = next(c for c in window.notice_area.cards if c.notice.key == "import")
        assert not card.retry.isVisible() and not layout_check.clipped(window)

        imported = await c.jobs.import_files([good])
        assert imported is not None and imported.name == "Tiny-MoE 8x1M", imported
        picker = window.chat.model_picker
        assert picker.findText("Tiny-MoE 8x1M") >= 0
        await c.shutdown()

    try:
        run_qt(qapp, flow)
    finally:
        window.close()


def test_open_folder_without_a_file_manager_says_so_and_copies_the_path(
    qapp: QApplication, tiny_hub: tuple[HubServer, bytes], tmp_path: Path
) -> None:
    """The offscreen platform has no file manager (QDesktopServices.openUrl fails), as the walk-through's desktop."""
    server, data = tiny_hub
    window, c = make_controller(tmp_path, server, data)
    model = tmp_path / "home" / "models" / "local.tw.gguf"
    model.parent.mkdir(parents=True, exist_ok=True)
    model.write_bytes(data)

    async def flow() -> None:
        await c.start()
        window.show_page("My models")
        window.models_page.open_folder_requested.emit(str(model))
        notice = window.notifications.get("open-folder")
        assert notice is not None and notice.action == "Copy path" and str(model.parent) in notice.reason
        await until(lambda: any(c.isVisible() and c.notice.key == "open-folder" for c in window.notice_area.cards))
        card = next(c for c in window.notice_area.cards if c.notice.key == "open-folder")
        assert card.retry.text() == "Copy path" and card.retry.isVisible()
        card.retry.click()
        clipboard = QApplication.clipboard()
        assert clipboard is not None and clipboard.text() == str(model.parent)
        await c.shutdown()

    try:
        run_qt(qapp, flow)
    finally:
        window.close()


def test_a_deleted_chat_can_be_undone_and_is_deleted_only_when_its_undo_goes(
    qapp: QApplication, tiny_hub: tuple[HubServer, bytes], tmp_path: Path
) -> None:
    server, data = tiny_hub
    window, c = make_controller(tmp_path, server, data)

    def listed() -> list[str]:
        lst = window.chat.conversations
        return [lst.item(i).text() for i in range(lst.count())]

    async def flow() -> None:
        await c.start()
        keep = c.store.create()
        c.store.rename(keep.id, "Keep me")
        gone = c.store.create()
        c.store.rename(gone.id, "Delete me")
        c.talks.show_conversations()
        assert "Delete me" in listed()

        window.chat.delete_conversation_requested.emit(str(gone.id))
        assert "Delete me" not in listed() and c.store.get(gone.id) is not None  # hidden, not yet deleted
        key = f"{UNDO_DELETE}{gone.id}"
        notice = window.notifications.get(key)
        assert notice is not None and notice.action == "Undo" and "Delete me" in notice.reason
        await until(
            lambda: any(card.notice.key == key and card.isVisible() for card in window.notice_area.cards), 10, "shown"
        )
        card = next(card for card in window.notice_area.cards if card.notice.key == key)
        card.retry.click()  # Undo
        assert "Delete me" in listed() and c.talks.conversation_id == gone.id
        assert window.notifications.get(key) is None

        window.chat.delete_conversation_requested.emit(str(gone.id))
        assert "Delete me" not in listed()
        await until(
            lambda: any(card.notice.key == key and card.isVisible() for card in window.notice_area.cards),
            10,
            "shown again",
        )
        card = next(card for card in window.notice_area.cards if card.notice.key == key)
        card.forget.click()  # Hide: no undo wanted, deleted now
        assert c.store.get(gone.id) is None and c.store.get(keep.id) is not None

        # one left in its undo time when the app closes: deleted then
        window.chat.delete_conversation_requested.emit(str(keep.id))
        assert c.store.get(keep.id) is not None
        await c.shutdown()

    try:
        run_qt(qapp, flow)
    finally:
        window.close()
    from runmyai.chat.store import ConversationStore

    store = ConversationStore(c.paths.conversations_db)
    try:
        assert all(conv.title != "Keep me" for conv in store.list())
    finally:
        store.close()


def test_an_import_by_the_library_keeps_general_name(tmp_path: Path, model_factory: ModelFactory) -> None:
    """(LocalLibrary alone:) a header's own name, not the file's, when it differs from the file's stem."""
    import asyncio

    lib = LocalLibrary(tmp_path / "models")
    src = model_factory(type="Q8_0", seed=9)  # its general.name is its file's stem: m<n>-qwen3moe-Q8_0
    renamed = tmp_path / "renamed.gguf"
    renamed.write_bytes(src.read_bytes())
    model = asyncio.run(lib.import_gguf([renamed]))
    assert model.name == src.name.removesuffix(".gguf"), model.name


def test_the_performance_panel_stays_after_switching_models_by_double_click(
    qapp: QApplication, tiny_hub: tuple[HubServer, bytes], tmp_path: Path
) -> None:
    server, data = tiny_hub
    window, c = make_controller(tmp_path, server, data)
    window.resize(1280, 800)
    models = tmp_path / "home" / "models"
    models.mkdir(parents=True, exist_ok=True)
    first, second = models / "first.tw.gguf", models / "second.tw.gguf"
    first.write_bytes(data)
    second.write_bytes(data)

    async def flow() -> None:
        await c.start()
        assert await c.engine.use_model(f"local:{first}") is not None
        assert window.current_page() == "Chat" and window.perf_dock.isVisible()

        async def switch_by_double_click(to: Path) -> None:
            window.show_page("My models")
            table = window.models_page.table
            items = [item for r in range(table.rowCount()) if (item := table.item(r, 0)) is not None]
            where = table.visualItemRect(next(i for i in items if i.toolTip() == str(to))).center()
            QTest.mouseClick(table.viewport(), Qt.MouseButton.LeftButton, Qt.KeyboardModifier.NoModifier, where)
            QTest.mouseDClick(table.viewport(), Qt.MouseButton.LeftButton, Qt.KeyboardModifier.NoModifier, where)
            await until(
                lambda: c.engine.supervisor is not None and c.engine.supervisor.model == to and c.engine.ready.is_set(),
                120,
            )
            await until(lambda: not c.engine.loading, 30, "loaded")
            assert window.current_page() == "Chat"

        # the dock hidden by something other than the user (the window system: minimised, another workspace) on
        # the chat page: the old code took it for the user's choice, and the panel stayed away from then on
        window.perf_dock.hide()
        await switch_by_double_click(second)
        assert window.perf_dock.isVisible() and window.graphs.isVisible() and window.chat.perf_button.isChecked()
        # the user's own X on the panel holds
        window.perf_dock.close()
        await switch_by_double_click(first)
        assert not window.perf_dock.isVisible() and not window.chat.perf_button.isChecked()
        window.chat.perf_button.click()
        assert window.perf_dock.isVisible()
        await c.shutdown()

    try:
        run_qt(qapp, flow)
    finally:
        window.close()
