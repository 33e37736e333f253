"""The MCP servers' window and the tool-call approval box: thin widgets over runmyai.mcp (the controller wires
them; nothing here blocks)."""

from __future__ import annotations

import json

from PySide6.QtCore import Qt, Signal
from PySide6.QtWidgets import (
    QDialog,
    QHBoxLayout,
    QLabel,
    QLineEdit,
    QListWidget,
    QListWidgetItem,
    QMessageBox,
    QPlainTextEdit,
    QPushButton,
    QVBoxLayout,
    QWidget,
)

from runmyai.chat.tools import ToolCall
from runmyai.mcp.servers import ServerView, ToolInfo

ROLE = Qt.ItemDataRole.UserRole


class McpDialog(QDialog):
    save_requested = Signal(str)  # the configuration's new text
    enabled_changed = Signal(str, bool)  # server, enabled
    insert_prompt_requested = Signal(str, str, str)  # server, prompt, "key=value; …"
    attach_resource_requested = Signal(str, str)  # server, uri

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setWindowTitle("MCP servers")
        self.resize(900, 640)
        self.editor = QPlainTextEdit()
        self.editor.setPlaceholderText('{"mcpServers": {"name": {"command": "…", "args": []}}}')
        self.save_button = QPushButton("Save and connect")
        self.save_button.clicked.connect(lambda: self.save_requested.emit(self.editor.toPlainText()))
        self.error = QLabel("")
        self.error.setStyleSheet("color: #b52b27")
        self.error.setWordWrap(True)
        self.servers = QListWidget()
        self.servers.itemChanged.connect(self._on_check)
        self.servers.currentItemChanged.connect(lambda *_: self._show_details())
        self.details = QListWidget()
        self.arguments = QLineEdit()
        self.arguments.setPlaceholderText("prompt arguments: key=value; key=value")
        self.insert_button = QPushButton("Insert prompt")
        self.insert_button.clicked.connect(self._insert)
        self.attach_button = QPushButton("Attach resource")
        self.attach_button.clicked.connect(self._attach)
        self._views: dict[str, ServerView] = {}

        left = QVBoxLayout()
        left.addWidget(QLabel("mcp.json (the mcpServers format of Claude Desktop and LM Studio)"))
        left.addWidget(self.editor, 1)
        left.addWidget(self.error)
        left.addWidget(self.save_button)
        right = QVBoxLayout()
        right.addWidget(QLabel("Servers (tick to enable)"))
        right.addWidget(self.servers, 1)
        right.addWidget(QLabel("Tools, prompts and resources"))
        right.addWidget(self.details, 2)
        right.addWidget(self.arguments)
        buttons = QHBoxLayout()
        buttons.addWidget(self.insert_button)
        buttons.addWidget(self.attach_button)
        right.addLayout(buttons)
        layout = QHBoxLayout(self)
        layout.addLayout(left, 1)
        layout.addLayout(right, 1)

    def set_text(self, text: str) -> None:
        self.editor.setPlainText(text)

    def set_error(self, line: str) -> None:
        self.error.setText(line)

    def show_servers(self, views: list[ServerView]) -> None:
        current = self.servers.currentItem()
        keep = current.data(ROLE) if current is not None else None
        self._views = {v.name: v for v in views}
        self.servers.blockSignals(True)
        self.servers.clear()
        for v in views:
            item = QListWidgetItem(f"{v.name} ({v.transport}) — {v.line}")
            item.setData(ROLE, v.name)
            item.setFlags(item.flags() | Qt.ItemFlag.ItemIsUserCheckable)
            item.setCheckState(Qt.CheckState.Unchecked if v.state == "disabled" else Qt.CheckState.Checked)
            self.servers.addItem(item)
            if v.name == keep or (keep is None and self.servers.count() == 1):
                self.servers.setCurrentItem(item)
        self.servers.blockSignals(False)
        self._show_details()

    def server_line(self, name: str) -> str:
        for i in range(self.servers.count()):
            item = self.servers.item(i)
            if item.data(ROLE) == name:
                return item.text()
        return ""

    def _on_check(self, item: QListWidgetItem) -> None:
        self.enabled_changed.emit(str(item.data(ROLE)), item.checkState() == Qt.CheckState.Checked)

    def _show_details(self) -> None:
        self.details.clear()
        item = self.servers.currentItem()
        view = self._views.get(str(item.data(ROLE))) if item is not None else None
        if view is None:
            return
        for t in view.tools:
            self._detail(f"tool: {t.name} — {t.description}", ("tool", t.name))
        for p in view.prompts:
            args = ", ".join(n + ("" if req else "?") for n, req in p.arguments)
            self._detail(f"prompt: {p.name}({args}) — {p.description}", ("prompt", p.name))
        for r in view.resources:
            self._detail(f"resource: {r.uri} — {r.name} {r.mime_type}".rstrip(), ("resource", r.uri))

    def _detail(self, text: str, data: tuple[str, str]) -> None:
        item = QListWidgetItem(text)
        item.setData(ROLE, data)
        self.details.addItem(item)

    def select_detail(self, kind: str, name: str) -> bool:
        for i in range(self.details.count()):
            if tuple(self.details.item(i).data(ROLE)) == (kind, name):
                self.details.setCurrentRow(i)
                return True
        return False

    def _selected(self, kind: str) -> tuple[str, str] | None:
        server, item = self.servers.currentItem(), self.details.currentItem()
        if server is None or item is None or item.data(ROLE)[0] != kind:
            return None
        return str(server.data(ROLE)), str(item.data(ROLE)[1])

    def _insert(self) -> None:
        chosen = self._selected("prompt")
        if chosen is not None:
            self.insert_prompt_requested.emit(chosen[0], chosen[1], self.arguments.text())
        else:
            self.set_error("Select a prompt first.")

    def _attach(self) -> None:
        chosen = self._selected("resource")
        if chosen is not None:
            self.attach_resource_requested.emit(*chosen)
        else:
            self.set_error("Select a resource first.")


def parse_arguments(text: str) -> dict[str, str]:
    """'key=value; key=value' into a prompt's arguments (a value may hold '=')."""
    out = {}
    for part in text.split(";"):
        key, sep, value = part.partition("=")
        if sep and key.strip():
            out[key.strip()] = value.strip()
    return out


class ApprovalBox(QMessageBox):
    """Asks whether a tool call may run: allow once, always for this tool, or deny (closing it denies)."""

    def __init__(self, call: ToolCall, tool: ToolInfo, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setWindowTitle("Allow a tool call?")
        self.setIcon(QMessageBox.Icon.Question)
        self.setText(f"The model wants to call {tool.name} on the MCP server '{tool.server}'.")
        try:
            shown = json.dumps(json.loads(call.arguments or "{}"), indent=2, ensure_ascii=False)
        except ValueError:
            shown = call.arguments
        self.setInformativeText(f"Arguments:\n{shown[:2000]}")
        self.once = self.addButton("Allow once", QMessageBox.ButtonRole.AcceptRole)
        self.always = self.addButton(f"Always allow {tool.name}", QMessageBox.ButtonRole.YesRole)
        self.deny = self.addButton("Deny", QMessageBox.ButtonRole.RejectRole)
        self.setDefaultButton(self.deny)
        self.setEscapeButton(self.deny)
        self.setWindowModality(Qt.WindowModality.NonModal)
