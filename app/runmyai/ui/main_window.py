"""The shell: a navigation rail (Chat, Discover, My models, Server, Settings) beside the pages, the notification
area above them, and the live performance view as a dock that can sit beside the chat or float on its own."""

from __future__ import annotations

from PySide6.QtCore import QSize, Qt, Signal
from PySide6.QtGui import QAction, QCloseEvent, QKeySequence, QResizeEvent, QShortcut
from PySide6.QtWidgets import (
    QDialog,
    QDialogButtonBox,
    QDockWidget,
    QFormLayout,
    QHBoxLayout,
    QLabel,
    QLineEdit,
    QListWidget,
    QListWidgetItem,
    QMainWindow,
    QStackedWidget,
    QVBoxLayout,
    QWidget,
)

from runmyai import __version__
from runmyai.ui import icons
from runmyai.ui.chat_panel import ChatPanel
from runmyai.ui.graphs import GraphsPanel
from runmyai.ui.library_panel import LibraryPanel
from runmyai.ui.log_view import LogView
from runmyai.ui.notifications import NotificationArea
from runmyai.ui.pages import ModelsPage, ServerPage, SettingsPage
from runmyai.ui.viewmodels import PERF_DOCK_MIN, Notifications, perf_dock_width

PAGES = ("Chat", "Discover", "My models", "Server", "Settings")


class PerfDock(QDockWidget):
    """The performance panel's dock; `closed` is its X (the user's choice, unlike a hide by a page switch)."""

    closed = Signal()

    def closeEvent(self, event: QCloseEvent) -> None:  # Qt's name
        super().closeEvent(event)
        self.closed.emit()


class _PagesHost(QWidget):
    """The pages, with the notification area floating over them: it follows this widget's size."""

    def __init__(self, notices: NotificationArea) -> None:
        super().__init__()
        self._notices = notices

    def resizeEvent(self, event: QResizeEvent) -> None:  # Qt's name
        super().resizeEvent(event)
        self._notices.place()


class MainWindow(QMainWindow):
    closing = Signal()
    connect_endpoint_requested = Signal()
    back_to_local_requested = Signal()
    stop_engine_requested = Signal()
    eject_requested = Signal()
    restart_engine_requested = Signal()
    mcp_requested = Signal()
    page_changed = Signal(str)
    export_chat_requested = Signal(str)  # "md" or "json": the current conversation, to a file the user picks
    import_chat_requested = Signal()

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setWindowTitle("Run My AI")
        self.resize(1400, 850)
        self.setMinimumSize(1000, 640)
        self.notifications = Notifications()
        self.notice_area = NotificationArea(self.notifications)
        self.notifications.on_change = self.notice_area.refresh
        self.chat = ChatPanel()
        self.library = LibraryPanel()
        self.models_page = ModelsPage()
        self.server_page = ServerPage()
        self.settings_page = SettingsPage()
        self.graphs = GraphsPanel()
        self.log_view = LogView(self)

        self.rail = QListWidget()
        self.rail.setObjectName("rail")
        self.rail.setFixedWidth(176)
        self.rail.setIconSize(QSize(icons.SIZE, icons.SIZE))
        for name in PAGES:
            item = QListWidgetItem(name)
            item.setData(Qt.ItemDataRole.UserRole, name)
            self.rail.addItem(item)
        self.pages = QStackedWidget()
        for page in (self.chat, self.library, self.models_page, self.server_page, self.settings_page):
            self.pages.addWidget(page)
        self.rail.currentRowChanged.connect(self._on_rail)
        self.set_icon_colours("#5f6673", "#ffffff")
        self._perf_wanted = True  # the performance panel shows with the chat (until the user hides it)
        brand = QLabel("Run My AI")
        brand.setObjectName("brand")
        self.engine_label = QLabel("Engine: stopped")
        self.engine_label.setObjectName("muted")
        self.engine_label.setWordWrap(True)
        version = QLabel(f"v{__version__}")
        version.setObjectName("muted")
        side = QWidget()
        side.setObjectName("side")
        side.setAttribute(Qt.WidgetAttribute.WA_StyledBackground)  # (a plain QWidget draws no style sheet background)
        side.setFixedWidth(176)
        side_layout = QVBoxLayout(side)
        side_layout.setContentsMargins(0, 0, 0, 10)
        side_layout.setSpacing(0)
        side_layout.addWidget(brand)
        side_layout.addWidget(self.rail, 1)
        for label in (self.engine_label, version):
            label.setContentsMargins(16, 2, 10, 2)
            side_layout.addWidget(label)
        main = _PagesHost(self.notice_area)
        main_layout = QVBoxLayout(main)
        main_layout.setContentsMargins(0, 0, 0, 0)
        main_layout.setSpacing(0)
        main_layout.addWidget(self.pages, 1)
        self.notice_area.setParent(main)  # over the pages, outside their layout (notifications.py says why)
        self.notice_area.place()
        central = QWidget()
        row = QHBoxLayout(central)
        row.setContentsMargins(0, 0, 0, 0)
        row.setSpacing(0)
        row.addWidget(side)
        row.addWidget(main, 1)
        self.setCentralWidget(central)

        self.perf_dock = PerfDock("Performance", self)
        self.perf_dock.setObjectName("performance")
        self.perf_dock.setWidget(self.graphs)
        self.perf_dock.setFeatures(
            QDockWidget.DockWidgetFeature.DockWidgetClosable
            | QDockWidget.DockWidgetFeature.DockWidgetFloatable
            | QDockWidget.DockWidgetFeature.DockWidgetMovable
        )
        self.perf_dock.setAllowedAreas(Qt.DockWidgetArea.RightDockWidgetArea | Qt.DockWidgetArea.LeftDockWidgetArea)
        self.graphs.setMinimumWidth(PERF_DOCK_MIN)
        self.addDockWidget(Qt.DockWidgetArea.RightDockWidgetArea, self.perf_dock)
        self.perf_dock.visibilityChanged.connect(self._sync_perf_button)
        self.perf_dock.closed.connect(lambda: self.set_performance_visible(False))
        self.chat.performance_toggled.connect(self.set_performance_visible)
        self.rail.setCurrentRow(0)
        self._menus()
        self._shortcuts()

    # -- navigation ----------------------------------------------------------------------------------
    def show_page(self, name: str) -> None:
        self.rail.setCurrentRow(PAGES.index(name))
        if name == "Chat" and not self.perf_dock.isFloating():
            # (also when the rail was already there: a model chosen in My models lands on the chat with its panel)
            self.perf_dock.setVisible(self._perf_wanted)

    def set_icon_colours(self, colour: str, selected: str) -> None:
        """The rail's icons in the theme's colours (the selected item's in the accent's text colour)."""
        for row, name in enumerate(PAGES):
            self.rail.item(row).setIcon(icons.icon(name, colour, selected))
        self.chat.set_icon_colour(colour)

    def current_page(self) -> str:
        return PAGES[self.pages.currentIndex()]

    def _on_rail(self, row: int) -> None:
        if 0 <= row < len(PAGES):
            self.pages.setCurrentIndex(row)
            # the performance panel belongs to the chat: docked, it gives the other pages its room (floating, it
            # stays where the user put it)
            if not self.perf_dock.isFloating():
                self.perf_dock.setVisible(PAGES[row] == "Chat" and self._perf_wanted)
            self.page_changed.emit(PAGES[row])

    def set_performance_visible(self, visible: bool) -> None:
        self._perf_wanted = visible
        self.perf_dock.setVisible(visible)

    def _sync_perf_button(self, visible: bool) -> None:
        """The Performance button follows the dock. Whether the panel is wanted is the user's to say (the button,
        the View menu, the dock's X): the dock's own visibility changes (the window hidden, a page switch) said it
        too, and the panel stayed away after a model was switched to from My models (the walk-through)."""
        self.chat.perf_button.blockSignals(True)
        self.chat.perf_button.setChecked(visible)
        self.chat.perf_button.blockSignals(False)

    def _menus(self) -> None:
        file_menu = self.menuBar().addMenu("&File")
        imp = QAction("&Import GGUF…", self)
        imp.triggered.connect(self.library.import_requested)
        file_menu.addAction(imp)
        for title, kind in (("&Export chat as Markdown…", "md"), ("Export chat as &JSON…", "json")):
            export = QAction(title, self)
            export.triggered.connect(lambda _=False, k=kind: self.export_chat_requested.emit(k))
            file_menu.addAction(export)
        import_chat = QAction("Import c&hat…", self)
        import_chat.triggered.connect(self.import_chat_requested)
        file_menu.addAction(import_chat)
        file_menu.addSeparator()
        remote = QAction("&Connect to an OpenAI-compatible endpoint…", self)
        remote.triggered.connect(self.connect_endpoint_requested)
        file_menu.addAction(remote)
        # the way back from File → Connect (the walk-through found none but My models → Chat): enabled while connected
        self.back_to_local = QAction("&Back to local model", self)
        self.back_to_local.triggered.connect(self.back_to_local_requested)
        self.back_to_local.setEnabled(False)
        file_menu.addAction(self.back_to_local)
        settings = QAction("&Settings", self)
        settings.setShortcut(QKeySequence("Ctrl+,"))
        settings.triggered.connect(lambda: self.show_page("Settings"))
        file_menu.addAction(settings)
        quit_action = QAction("&Quit", self)
        quit_action.setShortcut(QKeySequence.StandardKey.Quit)
        quit_action.triggered.connect(self.close)
        file_menu.addAction(quit_action)
        view_menu = self.menuBar().addMenu("&View")
        perf = self.perf_dock.toggleViewAction()
        perf.triggered.connect(lambda checked: setattr(self, "_perf_wanted", bool(checked)))
        perf.setText("&Performance panel")
        perf.setShortcut(QKeySequence("Ctrl+Shift+P"))
        view_menu.addAction(perf)
        for i, name in enumerate(PAGES):
            go = QAction(name, self)
            go.setShortcut(QKeySequence(f"Ctrl+{i + 1}"))
            go.triggered.connect(lambda _=False, n=name: self.show_page(n))
            view_menu.addAction(go)
        engine_menu = self.menuBar().addMenu("&Engine")
        for title, slot in (
            ("&Eject model", self.eject_requested.emit),
            ("&Stop", self.stop_engine_requested.emit),
            ("&Restart", self.restart_engine_requested.emit),
            ("Show &log", self.show_log),
        ):
            action = QAction(title, self)
            action.triggered.connect(slot)
            engine_menu.addAction(action)
        tools_menu = self.menuBar().addMenu("&Tools")
        mcp = QAction("&MCP servers…", self)
        mcp.triggered.connect(self.mcp_requested.emit)
        tools_menu.addAction(mcp)
        self.settings_page.mcp_requested.connect(self.mcp_requested.emit)
        self.settings_page.connect_endpoint_requested.connect(self.connect_endpoint_requested.emit)
        self.settings_page.show_log_requested.connect(self.show_log)
        self.models_page.import_requested.connect(self.library.import_requested)

    def _shortcuts(self) -> None:
        """LM Studio's where it has them (docs/app.md lists them all; Settings shows them)."""

        def new_chat() -> None:
            self.show_page("Chat")
            self.chat.new_conversation_requested.emit()
            self.chat.input.setFocus()

        def focus(widget: QWidget) -> None:
            self.show_page("Chat")
            widget.setFocus()

        QShortcut(QKeySequence("Ctrl+N"), self, new_chat)
        QShortcut(QKeySequence("Ctrl+L"), self, lambda: focus(self.chat.input))

        def pick_model() -> None:
            focus(self.chat.model_picker)
            self.chat.model_picker.showPopup()

        QShortcut(QKeySequence("Ctrl+Shift+L"), self, pick_model)
        QShortcut(QKeySequence("Ctrl+F"), self, lambda: focus(self.chat.search))

    def resizeEvent(self, event: QResizeEvent) -> None:  # Qt's name
        """The docked performance panel keeps its share of the window (viewmodels.perf_dock_width), so the chat
        keeps room at 1280x800; a width the user dragged holds until the window's width changes."""
        super().resizeEvent(event)
        if event.oldSize().width() != event.size().width() and not self.perf_dock.isFloating():
            self.resizeDocks([self.perf_dock], [perf_dock_width(event.size().width())], Qt.Orientation.Horizontal)

    # -- state from the controller -------------------------------------------------------------------
    def set_engine_state(self, text: str, fault: str | None = None) -> None:
        """The engine's state beside the rail; a fault as a notification (whole, with Details), cleared when the
        engine is ready again without one."""
        self.engine_label.setText(f"Engine: {text}")
        if fault:
            if fault.startswith("Restarted after a fault"):
                self.notifications.info("engine", "The engine restarted", fault)
            else:
                self.notifications.fail("engine", "The engine stopped", fault, retry=True)
        elif text == "ready":
            self.notifications.succeeded("engine")

    def set_connected(self, remote: str | None) -> None:
        """Connected to a remote endpoint (its address) or not (None): File → Back to local follows it."""
        self.back_to_local.setEnabled(remote is not None)
        self.back_to_local.setToolTip(f"Stop using {remote} and load a model on this computer again" if remote else "")

    def show_log(self) -> None:
        self.log_view.show()
        self.log_view.raise_()

    def closeEvent(self, event: QCloseEvent) -> None:  # Qt's name
        self.closing.emit()
        super().closeEvent(event)


URL_FIELD_CHARS = 44  # "https://my-gpu-box.example.com:8443/v1" and a margin: the address is read whole


class ConnectDialog(QDialog):
    """File → Connect: the address and key of an OpenAI-compatible server. Connect asks the server for its models
    first (the controller, off the UI's event handling) while this dialog says so and Cancel stops the check; a
    refusal is one line here, and nothing local has stopped. The dialog closes only once connected."""

    connect_requested = Signal(str, str)  # base URL, key ("" for none)
    cancel_requested = Signal()

    def __init__(self, parent: QWidget | None, url: str, key: str, note: str) -> None:
        super().__init__(parent)
        self.setWindowTitle("Connect to an OpenAI-compatible endpoint")
        self.url = QLineEdit(url)
        self.url.setPlaceholderText("http://host:port/v1")
        # the walk-through's field cut the address; this holds a usual one whole (layout_check.line_edit_problem)
        self.url.setMinimumWidth(self.url.fontMetrics().horizontalAdvance("x" * URL_FIELD_CHARS) + 16)
        self.url.setProperty("whole", True)
        self.key = QLineEdit(key)
        self.key.setEchoMode(QLineEdit.EchoMode.Password)
        self.note = QLabel(note)  # what connecting does to the local model (and the API server)
        self.note.setObjectName("muted")
        self.note.setWordWrap(True)
        self.state = QLabel("")  # "Checking …" or why the server was refused, in one sentence
        self.state.setWordWrap(True)
        self.state.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        self.state.setVisible(False)
        self.buttons = QDialogButtonBox(QDialogButtonBox.StandardButton.Cancel)
        self.connect_button = self.buttons.addButton("Connect", QDialogButtonBox.ButtonRole.AcceptRole)
        self.connect_button.setDefault(True)
        self.buttons.accepted.connect(self._on_connect)
        self.buttons.rejected.connect(self._on_cancel)
        form = QFormLayout(self)
        form.addRow("Base URL", self.url)
        form.addRow("API key (optional)", self.key)
        form.addRow(self.note)
        form.addRow(self.state)
        form.addRow(self.buttons)
        self.checking = False

    def _on_connect(self) -> None:
        if not self.checking:
            self.connect_requested.emit(self.url.text().strip(), self.key.text().strip())

    def _on_cancel(self) -> None:
        if self.checking:
            self.cancel_requested.emit()
        self.reject()

    def set_checking(self, address: str | None) -> None:
        """The check of `address` runs (its fields wait), or it ended (None)."""
        self.checking = address is not None
        for w in (self.url, self.key, self.connect_button):
            w.setEnabled(not self.checking)
        if address is not None:
            self.show_state(f"Checking {address}…", error=False)

    def show_state(self, text: str, *, error: bool = True) -> None:
        self.state.setObjectName("error" if error else "muted")
        self.state.setStyleSheet("color: #d0453a;" if error else "")
        self.state.setText(text)
        self.state.setVisible(bool(text))
        # a dialog does not grow by itself for a wrapped label's new lines: on a real desktop the refusal and the
        # note above it were cut in half and the fields squeezed (seen under Xvfb on xcb)
        layout = self.layout()
        if layout is not None:
            layout.activate()
        self.adjustSize()
