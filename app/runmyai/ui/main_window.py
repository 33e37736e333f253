"""The shell: a navigation rail (Chat, Discover, My models, Server, Settings) beside the pages, the notification
area above them, and the live performance view as a dock that can sit beside the chat or float on its own."""

from __future__ import annotations

from PySide6.QtCore import QSize, Qt, Signal
from PySide6.QtGui import QAction, QCloseEvent, QKeySequence, QResizeEvent, QShortcut
from PySide6.QtWidgets import (
    QDockWidget,
    QHBoxLayout,
    QLabel,
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


class MainWindow(QMainWindow):
    closing = Signal()
    connect_endpoint_requested = Signal()
    stop_engine_requested = Signal()
    restart_engine_requested = Signal()
    mcp_requested = Signal()
    page_changed = Signal(str)

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
        main = QWidget()
        main_layout = QVBoxLayout(main)
        main_layout.setContentsMargins(0, 0, 0, 0)
        main_layout.setSpacing(0)
        main_layout.addWidget(self.notice_area)
        main_layout.addWidget(self.pages, 1)
        central = QWidget()
        row = QHBoxLayout(central)
        row.setContentsMargins(0, 0, 0, 0)
        row.setSpacing(0)
        row.addWidget(side)
        row.addWidget(main, 1)
        self.setCentralWidget(central)

        self.perf_dock = QDockWidget("Performance", self)
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
        self.chat.performance_toggled.connect(self.set_performance_visible)
        self.rail.setCurrentRow(0)
        self._menus()
        self._shortcuts()

    # -- navigation ----------------------------------------------------------------------------------
    def show_page(self, name: str) -> None:
        self.rail.setCurrentRow(PAGES.index(name))

    def set_icon_colours(self, colour: str, selected: str) -> None:
        """The rail's icons in the theme's colours (the selected item's in the accent's text colour)."""
        for row, name in enumerate(PAGES):
            self.rail.item(row).setIcon(icons.icon(name, colour, selected))

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
        if self.pages.currentIndex() == 0 or self.perf_dock.isFloating():  # the user's own choice (its X, the menu)
            self._perf_wanted = visible
        self.chat.perf_button.blockSignals(True)
        self.chat.perf_button.setChecked(visible)
        self.chat.perf_button.blockSignals(False)

    def _menus(self) -> None:
        file_menu = self.menuBar().addMenu("&File")
        imp = QAction("&Import GGUF…", self)
        imp.triggered.connect(self.library.import_requested)
        file_menu.addAction(imp)
        remote = QAction("&Connect to an OpenAI-compatible endpoint…", self)
        remote.triggered.connect(self.connect_endpoint_requested)
        file_menu.addAction(remote)
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

    def show_log(self) -> None:
        self.log_view.show()
        self.log_view.raise_()

    def closeEvent(self, event: QCloseEvent) -> None:  # Qt's name
        self.closing.emit()
        super().closeEvent(event)
