"""The shell's actions through its widgets (issue 29, part 1): the local server switch, the notifications' Retry /
Details / Forget, conversation rename and search, My models' verify / delete / open folder, extra model folders
and per-model presets in Settings, the theme following the system. Offscreen, with the real engine and a local
hub; every wait is on the state the action leads to (no sleeps that race the code)."""

from __future__ import annotations

import json
import socket
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from anthropic import Anthropic
from openai import OpenAI
from PySide6.QtCore import Qt, QUrl
from PySide6.QtGui import QGuiApplication, QImage, QPalette
from PySide6.QtTest import QTest
from PySide6.QtWidgets import QApplication, QFileDialog, QLineEdit, QMessageBox, QPushButton

from runmyai.library.keys import HubKey, LocalKey
from runmyai.ui import icons, theme
from runmyai.ui.controller import AppController
from runmyai.ui.main_window import PAGES, MainWindow
from runmyai.ui.viewmodels import SettingsFile, anthropic_url, server_url
from tests.app.conftest import FILE, REPO
from tests.app.hubserver import HubServer
from tests.app.test_app_scenario import make_controller, until
from tests.qtloop import run_qt


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def get(url: str, headers: dict[str, str]) -> tuple[int, dict[str, str], bytes]:
    request = urllib.request.Request(url, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=30) as r:
            return r.status, {k.lower(): v for k, v in r.headers.items()}, r.read()
    except urllib.error.HTTPError as e:
        return e.code, {k.lower(): v for k, v in e.headers.items()}, e.read()


@pytest.fixture
def installed(
    qapp: QApplication, tiny_hub: tuple[HubServer, bytes], tmp_path: Path
) -> Iterator[tuple[MainWindow, AppController, Path, HubServer]]:
    """A window and controller with the tiny model in the models folder (as a download would leave it)."""
    server, data = tiny_hub
    model = tmp_path / "home" / "models" / "owner" / "tiny-TW" / "local.tw.gguf"
    model.parent.mkdir(parents=True)
    model.write_bytes(data)
    window, c = make_controller(tmp_path, server, data)
    window.resize(1280, 800)
    yield window, c, model, server
    # a test that failed before its shutdown leaves this controller listening to the desktop's scheme: the next
    # test's theme would then be set by two controllers
    c.stop_following_desktop()


# ---------------------------------------------------------------------------------------------- server
def test_the_server_switch_serves_on_the_users_port_with_its_key_and_origins(
    qapp: QApplication, installed: tuple[MainWindow, AppController, Path, HubServer]
) -> None:
    window, c, model, _hub = installed
    page = window.server_page
    port = free_port()

    async def flow() -> None:
        await c.start()
        assert await c.engine.use_model(f"local:{model}") is not None
        private = c.engine.supervisor
        assert private is not None and not private.fixed_port
        key = page.key.text()
        assert key.startswith("rma-") and key == c.ctx.settings.server.api_key  # a key exists before the switch is on
        window.show_page("Server")
        page.port.setValue(port)
        page.cors.setText("http://localhost:3000")
        page.enabled.click()  # on: the engine restarts on the user's port, with the key and the origin
        await until(lambda: c.engine.supervisor is not private and c.engine.supervisor is not None, 60, "restart")
        sup = c.engine.supervisor
        assert sup is not None
        await until(lambda: sup.state == "ready" and page.state.text().startswith("On:"), 60, "server on")
        assert sup.fixed_port and sup.api_key == key
        url = server_url(port)
        assert page.url.text() == url and url in page.example.text() and key in page.example.text()
        page.copy_url.click()
        assert QGuiApplication.clipboard().text() == url
        assert page.anthropic_url.text() == anthropic_url(port)  # Anthropic's clients add /v1/messages themselves
        page.copy_anthropic_url.click()
        assert QGuiApplication.clipboard().text() == anthropic_url(port)
        saved = SettingsFile(c.paths.settings / "app.json").load().server
        assert saved.enabled and saved.port == port and saved.cors_origins == ("http://localhost:3000",)

        status, _, body = get(f"{url}/models", {"Authorization": f"Bearer {key}"})
        assert status == 200 and json.loads(body)["data"], body
        assert get(f"{url}/models", {})[0] == 401  # the key is required
        status, headers, _ = get(f"{url}/models", {"Authorization": f"Bearer {key}", "Origin": "http://localhost:3000"})
        assert status == 200 and headers.get("access-control-allow-origin") == "http://localhost:3000"
        assert get(f"{url}/models", {"Authorization": f"Bearer {key}", "Origin": "http://evil.example"})[0] == 403
        # all three APIs, through their official clients, at the URLs the page shows (issue 48)
        openai = OpenAI(base_url=page.url.text(), api_key=key)
        # greedy: sampled, a random-weight model drew its end-of-text first in one CI run (output_tokens 0)
        said = openai.responses.create(model="m", input="Hi", max_output_tokens=4, temperature=0)
        assert said.status in ("completed", "incomplete") and said.usage is not None and said.usage.output_tokens > 0
        claude = Anthropic(base_url=page.anthropic_url.text(), api_key=key)
        reply = claude.messages.create(
            model="m", max_tokens=4, messages=[{"role": "user", "content": "Hi"}], extra_body={"temperature": 0}
        )
        assert reply.stop_reason in ("end_turn", "max_tokens") and reply.usage.output_tokens > 0
        counted = claude.messages.count_tokens(model="m", messages=[{"role": "user", "content": "Hi"}])
        assert counted.input_tokens == reply.usage.input_tokens > 0

        # a new key: the engine restarts with it, the old one is refused
        page.new_key.click()
        new_key = page.key.text()
        assert new_key.startswith("rma-") and new_key != key
        await until(
            lambda: c.engine.supervisor is not sup and c.engine.supervisor is not None, 60, "restart with the new key"
        )
        await until(lambda: c.engine.supervisor is not None and c.engine.supervisor.state == "ready", 60, "ready")
        assert (
            c.ctx.settings.server.api_key
            == new_key
            == SettingsFile(c.paths.settings / "app.json").load().server.api_key
        )
        assert get(f"{url}/models", {"Authorization": f"Bearer {key}"})[0] == 401
        assert get(f"{url}/models", {"Authorization": f"Bearer {new_key}"})[0] == 200

        # off: back on a private port, nothing answers on the user's port
        on = c.engine.supervisor
        page.enabled.click()
        await until(lambda: c.engine.supervisor is not on and c.engine.supervisor is not None, 60, "restart, off")
        await until(lambda: c.engine.supervisor is not None and c.engine.supervisor.state == "ready", 60, "ready")
        assert (
            c.engine.supervisor is not None
            and not c.engine.supervisor.fixed_port
            and page.state.text().startswith("Off.")
        )
        with pytest.raises(urllib.error.URLError):
            urllib.request.urlopen(f"{url}/models", timeout=10)
        assert await c.chat.chat_once("Still there?") is not None  # the app's own chat goes on
        await c.shutdown()

    try:
        run_qt(qapp, flow)
    finally:
        window.close()


# ---------------------------------------------------------------------------------------------- notifications
def test_a_failed_get_is_retried_from_its_notification_a_permanent_one_is_not_and_forget_clears(
    qapp: QApplication, installed: tuple[MainWindow, AppController, Path, HubServer]
) -> None:
    window, c, model, hub = installed
    model.unlink()  # this test gets it from the hub
    c.models.hub.retries = 0  # the hub client's own retries are tested in test_hub.py: here the first failure shows

    async def flow() -> None:
        await c.start()
        area = window.notice_area
        key = f"get:{REPO}"

        # the hub answers 503 (a passing outage): the failure shows with Retry
        hub.faults.status = 503
        assert await c.jobs.get_model(HubKey(REPO)) is None
        notice = window.notifications.get(key)
        assert notice is not None and notice.kind == "error" and notice.retry
        card = next(card for card in area.cards if card.notice.key == key)
        assert card.isVisible() and card.retry.isVisible()
        card.details_button.click()  # the whole text, on click
        assert card.details.isVisible() and REPO in card.details.text()
        assert card.details_button.text() == "Hide details"

        # the hub is back: Retry gets the model and the failure clears
        hub.faults.status = None
        card.retry.click()
        await until(lambda: any(m.path.name == FILE for m in c.models.local_models), 60, "the retried download")
        await until(lambda: window.notifications.get(key) is None, 30, "cleared")
        assert not any(REPO in t for t in area.texts()) and not area.isVisible()

        # a repository that is not on the hub: permanent, so no Retry; Forget removes it
        missing = HubKey("nobody/not-there")
        hub.faults.status, hub.faults.error_code = 404, "RepoNotFound"
        assert await c.jobs.get_model(missing) is None
        notice = window.notifications.get("get:nobody/not-there")
        assert notice is not None and not notice.retry, notice
        card = next(card for card in area.cards if card.notice.key == "get:nobody/not-there")
        assert not card.retry.isVisible() and "get:nobody/not-there" not in c.ctx.retry
        card.forget.click()
        assert window.notifications.get("get:nobody/not-there") is None and not area.isVisible()
        await c.shutdown()

    try:
        run_qt(qapp, flow)
    finally:
        window.close()


# ---------------------------------------------------------------------------------------------- conversations
def test_conversations_are_renamed_in_place_and_searched_by_title_and_words(
    qapp: QApplication, installed: tuple[MainWindow, AppController, Path, HubServer]
) -> None:
    window, c, _model, _hub = installed
    rust = c.store.create(title="Rust lifetimes")
    c.store.add_message(rust.id, "user", "What does 'static mean for a borrow?")
    cooking = c.store.create(title="Dinner")
    c.store.add_message(cooking.id, "user", "A risotto for four, please")
    chat = window.chat

    async def flow() -> None:
        await c.start()

        def titles() -> list[str]:
            return [chat.conversations.item(i).text() for i in range(chat.conversations.count())]

        assert {"Rust lifetimes", "Dinner"} <= set(titles())
        # search: by title, by a message's words, every word counts, case-insensitive
        chat.search.setText("rust")
        assert titles() == ["Rust lifetimes"]
        chat.search.setText("RISOTTO four")
        assert titles() == ["Dinner"]
        chat.search.setText("risotto borrow")
        assert titles() == []
        chat.search.clear()
        assert {"Rust lifetimes", "Dinner"} <= set(titles())

        # rename: the Rename button opens the title for editing; Enter keeps the new one (stored, listed)
        row = next(i for i in range(chat.conversations.count()) if chat.conversations.item(i).text() == "Dinner")
        chat.conversations.setCurrentRow(row)
        chat.rename_button.click()
        editor = chat.conversations.findChild(QLineEdit)
        assert editor is not None and editor.text() == "Dinner"
        editor.selectAll()
        QTest.keyClicks(editor, "Risotto night")
        QTest.keyClick(editor, Qt.Key.Key_Return)
        await until(lambda: c.store.get(cooking.id).title == "Risotto night", 10, "renamed")  # type: ignore[union-attr]
        assert "Risotto night" in titles() and "Dinner" not in titles()
        chat.search.setText("night")
        assert titles() == ["Risotto night"]
        # an empty title is not taken: the old one stays
        chat.search.clear()
        items = [chat.conversations.item(i) for i in range(chat.conversations.count())]
        item = next(i for i in items if "Risotto" in i.text())
        item.setText("   ")
        assert c.store.get(cooking.id).title == "Risotto night"  # type: ignore[union-attr]
        await c.shutdown()

    try:
        run_qt(qapp, flow)
    finally:
        window.close()


# ---------------------------------------------------------------------------------------------- my models
def test_my_models_verify_delete_after_confirming_and_open_folder(
    qapp: QApplication, monkeypatch: pytest.MonkeyPatch, installed: tuple[MainWindow, AppController, Path, HubServer]
) -> None:
    window, c, model, _hub = installed
    opened: list[QUrl] = []

    def open_url(url: QUrl) -> bool:
        opened.append(url)
        return True

    monkeypatch.setattr("runmyai.ui.controllers.library.QDesktopServices.openUrl", open_url)
    page = window.models_page

    async def flow() -> None:
        await c.start()
        window.show_page("My models")
        assert page.table.rowCount() == 1
        repo = page.table.item(0, 1)
        assert repo is not None and repo.text() == "owner/tiny-TW"  # the repo name kept
        # the only model is selected already (with none selected every button was greyed out)
        selected = page.current()
        assert selected is not None and selected.path == model
        assert page.verify_button.isEnabled() and page.delete_button.isEnabled()

        page.folder_button.click()
        assert [u.toLocalFile() for u in opened] == [str(model.parent)]

        # re-verify: a job in the notification area, then "intact"
        page.verify_button.click()
        key = f"verify:{model}"
        await until(lambda: (n := window.notifications.get(key)) is not None and n.kind == "info", 60, "verified")
        # a flipped byte in the experts: verification fails, and says so
        data = bytearray(model.read_bytes())
        data[len(data) * 3 // 4] ^= 0xFF
        model.write_bytes(bytes(data))
        window.notifications.forget(key)
        page.verify_button.click()
        await until(lambda: (n := window.notifications.get(key)) is not None and n.kind == "error", 60, "failed")
        assert "verification" in window.notifications.get(key).reason  # type: ignore[union-attr]

        # delete asks first: Cancel keeps the file, Delete removes it and its row
        page.delete_button.click()
        box = next(b for b in window.findChildren(QMessageBox) if b.isVisible())
        assert model.name in box.text()
        box.button(QMessageBox.StandardButton.Cancel).click()
        assert model.exists()
        page.delete_button.click()
        box = next(b for b in window.findChildren(QMessageBox) if b.isVisible())
        delete = next(b for b in box.buttons() if b.text() == "Delete")
        delete.click()
        await until(lambda: page.table.rowCount() == 0, 30, "deleted")
        assert not model.exists() and not model.parent.exists()  # the emptied owner/repo folder goes too
        assert page.empty.isVisible()
        await c.shutdown()

    try:
        run_qt(qapp, flow)
    finally:
        window.close()


# ---------------------------------------------------------------------------------------------- settings
def test_extra_model_folders_and_per_model_presets_in_settings(
    qapp: QApplication, tmp_path: Path, installed: tuple[MainWindow, AppController, Path, HubServer]
) -> None:
    window, c, model, _hub = installed
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    extra = elsewhere / "other.tw.gguf"
    model.rename(extra)  # the only model lives outside the app's folder
    sp = window.settings_page
    chat_settings = window.chat.settings

    async def flow() -> None:
        await c.start()
        assert not c.models.local_models
        window.show_page("Settings")
        # Add folder… asks with a folder dialog; choosing one scans it
        add = next(b for b in sp.findChildren(QPushButton) if b.text() == "Add folder…")
        add.click()
        dialog = next(d for d in window.findChildren(QFileDialog) if d.isVisible())
        dialog.selectFile(str(elsewhere))
        dialog.accept()
        await until(lambda: any(m.path == extra for m in c.models.local_models), 30, "the extra folder scanned")
        assert [sp.folders.item(i).text() for i in range(sp.folders.count())] == [str(elsewhere)]
        assert SettingsFile(c.paths.settings / "app.json").load().model_dirs == (str(elsewhere),)
        assert window.models_page.table.rowCount() == 1

        # presets are per model: none loaded, none to save
        assert sp.preset_model.text() == "no model loaded"
        assert await c.engine.use_model(str(LocalKey(extra))) is not None
        assert sp.preset_model.text() == c.engine.model_name
        window.show_page("Chat")
        chat_settings.temperature.setValue(1.25)
        chat_settings.top_k.setValue(7)
        window.show_page("Settings")
        sp.preset_name.setText("wild")
        next(b for b in sp.findChildren(QPushButton) if b.text() == "Save").click()
        assert [sp.presets.itemText(i) for i in range(sp.presets.count())] == ["wild"]
        saved = SettingsFile(c.paths.settings / "app.json").load().presets
        assert saved[c.engine.model_name or ""]["wild"]["temperature"] == 1.25
        chat_settings.temperature.setValue(0.1)
        chat_settings.top_k.setValue(40)
        next(b for b in sp.findChildren(QPushButton) if b.text() == "Apply to this chat").click()
        assert window.current_page() == "Chat"
        assert (chat_settings.temperature.value(), chat_settings.top_k.value()) == (1.25, 7)
        conv = c.store.get(c.talks.conversation_id or 0)
        assert conv is not None and conv.settings.temperature == 1.25  # the conversation keeps them
        window.show_page("Settings")
        next(b for b in sp.findChildren(QPushButton) if b.text() == "Delete" and b.parent() is not None).click()
        assert sp.presets.count() == 0
        assert not SettingsFile(c.paths.settings / "app.json").load().presets.get(c.engine.model_name or "")

        # Remove the folder: its model leaves the library
        sp.folders.setCurrentRow(0)
        next(b for b in sp.findChildren(QPushButton) if b.text() == "Remove").click()
        await until(lambda: not any(m.path == extra for m in c.models.local_models), 30, "the folder dropped")
        assert c.ctx.settings.model_dirs == ()
        await c.shutdown()

    try:
        run_qt(qapp, flow)
    finally:
        window.close()


def icon_colour(window: MainWindow, row: int, selected: bool) -> str:
    """The darkest-or-lightest opaque pixel's colour of a rail icon (its strokes), as #rrggbb."""
    from PySide6.QtGui import QIcon

    mode = QIcon.Mode.Selected if selected else QIcon.Mode.Normal
    image: QImage = window.rail.item(row).icon().pixmap(icons.SIZE, icons.SIZE, mode).toImage()
    best = max(
        (image.pixelColor(x, y) for x in range(image.width()) for y in range(image.height())),
        key=lambda col: col.alpha(),
    )
    return best.name()


def test_the_theme_follows_the_system_and_the_rail_icons_follow_the_theme(
    qapp: QApplication, monkeypatch: pytest.MonkeyPatch, installed: tuple[MainWindow, AppController, Path, HubServer]
) -> None:
    """The offscreen platform has no desktop scheme (QStyleHints.setColorScheme changes nothing there), so the
    desktop is played by theme.system_scheme and the style hints' own change signal."""
    window, c, _model, _hub = installed
    hints = QGuiApplication.styleHints()
    combo = window.settings_page.theme
    desktop = [Qt.ColorScheme.Light]
    monkeypatch.setattr(theme, "system_scheme", lambda: desktop[0])

    def switch(scheme: Qt.ColorScheme) -> None:
        desktop[0] = scheme
        hints.colorSchemeChanged.emit(scheme)

    def window_colour() -> str:
        return QApplication.palette().color(QPalette.ColorRole.Window).name()

    async def flow() -> None:
        await c.start()
        try:
            combo.setCurrentIndex(combo.findData("light"))
            assert window_colour() == theme.LIGHT.window and icon_colour(window, 1, False) == theme.LIGHT.text
            combo.setCurrentIndex(combo.findData("dark"))
            assert window_colour() == theme.DARK.window and icon_colour(window, 1, False) == theme.DARK.text
            assert icon_colour(window, 1, True) == theme.DARK.accent_text
            assert SettingsFile(c.paths.settings / "app.json").load().theme == "dark"

            # "Follow the system": the desktop's scheme now, and when it changes
            combo.setCurrentIndex(combo.findData("system"))
            assert window_colour() == theme.LIGHT.window
            switch(Qt.ColorScheme.Dark)
            assert window_colour() == theme.DARK.window and icon_colour(window, 1, False) == theme.DARK.text
            assert window.graphs.hits_plot.backgroundBrush().color().name() == theme.DARK.plot_bg
            switch(Qt.ColorScheme.Light)
            assert window_colour() == theme.LIGHT.window
            # a fixed choice ignores the system
            combo.setCurrentIndex(combo.findData("dark"))
            switch(Qt.ColorScheme.Light)
            assert window_colour() == theme.DARK.window
            assert [window.rail.item(i).text() for i in range(window.rail.count())] == list(PAGES)
        finally:
            await c.shutdown()

    try:
        run_qt(qapp, flow)
    finally:
        window.close()


# ---------------------------------------------------------------------------------------------- Discover's cards
def test_discover_cards_fill_the_width_and_a_click_shows_the_details(qapp: QApplication) -> None:
    from runmyai.ui.library_panel import CardGrid
    from runmyai.ui.render import LibraryEntry

    window = MainWindow()
    window.show()
    entries = [
        LibraryEntry(f"preset:m{i}", f"Model {i}", "on the hub", f"<p>details of model {i}</p>", line="Runs well")
        for i in range(13)
    ]
    window.library.set_entries(entries)
    window.show_page("Discover")
    grid: CardGrid = window.library.models
    columns = {}
    try:
        for width, height in ((1280, 800), (1600, 1000), (1920, 1080)):
            window.resize(width, height)
            for _ in range(5):
                QApplication.processEvents()
            first_row = [r for r in range(grid.count()) if grid.visualItemRect(grid.item(r)).top() == 0]
            columns[width] = len(first_row)
            assert len(first_row) == grid.room() // CardGrid.MIN_WIDTH, (width, grid.room())
            assert not grid.card_problems()
        assert columns[1280] >= 2 and columns[1920] > columns[1280]  # more room, more columns
        # a real click on the fourth card selects it and shows its overview
        rect = grid.visualItemRect(grid.item(3))
        QTest.mouseClick(grid.viewport(), Qt.MouseButton.LeftButton, pos=rect.center())
        assert window.library.current_key() == "preset:m3" and window.library.headline.text() == "Model 3"
        assert "details of model 3" in window.library.details.toPlainText()
    finally:
        window.close()
