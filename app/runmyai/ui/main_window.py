"""The main window: library on the left, chat in the middle, live graphs on the right."""

from __future__ import annotations

from PySide6.QtCore import Qt, Signal
from PySide6.QtGui import QAction, QCloseEvent, QKeySequence
from PySide6.QtWidgets import QLabel, QMainWindow, QPushButton, QSplitter, QStatusBar, QWidget

from runmyai import __version__
from runmyai.ui.chat_panel import ChatPanel
from runmyai.ui.graphs import GraphsPanel
from runmyai.ui.library_panel import LibraryPanel
from runmyai.ui.log_view import LogView


class MainWindow(QMainWindow):
    closing = Signal()
    connect_endpoint_requested = Signal()
    stop_engine_requested = Signal()
    restart_engine_requested = Signal()
    mcp_requested = Signal()

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setWindowTitle(f"Run My AI {__version__}")
        self.resize(1400, 850)
        self.library = LibraryPanel()
        self.chat = ChatPanel()
        self.graphs = GraphsPanel()
        self.log_view = LogView(self)
        splitter = QSplitter(Qt.Orientation.Horizontal)
        splitter.addWidget(self.library)
        splitter.addWidget(self.chat)
        splitter.addWidget(self.graphs)
        splitter.setStretchFactor(1, 1)
        splitter.setSizes([380, 640, 380])
        self.setCentralWidget(splitter)

        self.engine_label = QLabel("Engine: stopped")
        self.fault_label = QLabel("")
        self.fault_label.setStyleSheet("color: #b52b27")
        self.log_button = QPushButton("Show log")
        self.log_button.clicked.connect(self.show_log)
        status = QStatusBar()
        status.addWidget(self.engine_label)
        status.addWidget(self.fault_label, 1)
        status.addPermanentWidget(self.log_button)
        status.addPermanentWidget(QLabel(f"v{__version__}"))
        self.setStatusBar(status)
        self._menus()

    def _menus(self) -> None:
        file_menu = self.menuBar().addMenu("&File")
        imp = QAction("&Import GGUF…", self)
        imp.triggered.connect(self.library.import_requested)
        file_menu.addAction(imp)
        remote = QAction("&Connect to an OpenAI-compatible endpoint…", self)
        remote.triggered.connect(self.connect_endpoint_requested)
        file_menu.addAction(remote)
        quit_action = QAction("&Quit", self)
        quit_action.setShortcut(QKeySequence.StandardKey.Quit)
        quit_action.triggered.connect(self.close)
        file_menu.addAction(quit_action)
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

    def set_engine_state(self, text: str, fault: str | None = None) -> None:
        self.engine_label.setText(f"Engine: {text}")
        self.fault_label.setText(fault or "")

    def show_log(self) -> None:
        self.log_view.show()
        self.log_view.raise_()

    def closeEvent(self, event: QCloseEvent) -> None:  # Qt's name
        self.closing.emit()
        super().closeEvent(event)
