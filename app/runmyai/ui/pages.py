"""The shell's pages besides Chat and Discover: My models, Server, Settings. Thin: each emits intents and draws
what the controller gives it (viewmodels.ModelRow, AppSettings)."""

from __future__ import annotations

from dataclasses import replace

from PySide6.QtCore import Qt, Signal, SignalInstance
from PySide6.QtGui import QGuiApplication
from PySide6.QtWidgets import (
    QAbstractItemView,
    QCheckBox,
    QComboBox,
    QFormLayout,
    QFrame,
    QGroupBox,
    QHBoxLayout,
    QHeaderView,
    QLabel,
    QLineEdit,
    QListWidget,
    QPushButton,
    QScrollArea,
    QSizePolicy,
    QSpinBox,
    QTableWidget,
    QTableWidgetItem,
    QVBoxLayout,
    QWidget,
)

from runmyai.ui.viewmodels import (
    SHORTCUTS,
    AppSettings,
    ModelRow,
    ServerSettings,
    Theme,
    anthropic_url,
    chosen_row,
    new_api_key,
    server_url,
)


def page_title(text: str, subtitle: str = "") -> QWidget:
    box = QWidget()
    layout = QVBoxLayout(box)
    layout.setContentsMargins(0, 0, 0, 6)
    title = QLabel(text)
    title.setObjectName("pageTitle")
    layout.addWidget(title)
    if subtitle:
        sub = QLabel(subtitle)
        sub.setObjectName("muted")
        sub.setWordWrap(True)
        layout.addWidget(sub)
    return box


def page_layout(widget: QWidget) -> QVBoxLayout:
    layout = QVBoxLayout(widget)
    layout.setContentsMargins(20, 16, 20, 16)
    return layout


# A form's column at most this wide (fields stretched over a 1920-pixel window were hard to read, a port number in
# a field 1,200 pixels wide); the rest of the page stays empty beside it, as in LM Studio's settings.
FORM_WIDTH = 880


def fixed(*widgets: QWidget) -> None:
    """Fields that keep the width their content needs (a port, a choice of three): a form does not stretch them."""
    for w in widgets:
        w.setSizePolicy(QSizePolicy.Policy.Fixed, w.sizePolicy().verticalPolicy())


# ------------------------------------------------------------------------------------------ My models
class ModelsPage(QWidget):
    """The installed models: size, architecture, estimate, last used, where from; chat, re-verify, open the
    folder, delete."""

    use_requested = Signal(str)  # a library key
    verify_requested = Signal(str)  # a model path
    open_folder_requested = Signal(str)
    delete_requested = Signal(str)
    import_requested = Signal()
    load_options_requested = Signal(str)  # a library key: its load dialog (context length, GPU offload)
    eject_requested = Signal()

    COLUMNS = ("Model", "From", "Size", "Architecture", "Here", "Last used")

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.table = QTableWidget(0, len(self.COLUMNS))
        self.table.setHorizontalHeaderLabels(self.COLUMNS)
        self.table.verticalHeader().setVisible(False)
        self.table.setSelectionBehavior(QAbstractItemView.SelectionBehavior.SelectRows)
        self.table.setSelectionMode(QAbstractItemView.SelectionMode.SingleSelection)
        self.table.setEditTriggers(QAbstractItemView.EditTrigger.NoEditTriggers)
        self.table.setShowGrid(False)
        self.table.verticalHeader().setDefaultSectionSize(self.fontMetrics().height() + 16)  # rows to click, not lines
        header = self.table.horizontalHeader()
        header.setDefaultAlignment(Qt.AlignmentFlag.AlignLeft | Qt.AlignmentFlag.AlignVCenter)
        header.setSectionResizeMode(0, QHeaderView.ResizeMode.Stretch)
        for col in range(1, len(self.COLUMNS)):
            header.setSectionResizeMode(col, QHeaderView.ResizeMode.ResizeToContents)
        self.table.itemSelectionChanged.connect(self._update_buttons)
        self.table.itemDoubleClicked.connect(lambda _item: self._emit(self.use_requested, key=True))
        self.use_button = QPushButton("Chat with it")
        self.use_button.setObjectName("primary")
        self.verify_button = QPushButton("Re-verify")
        self.folder_button = QPushButton("Open folder")
        self.delete_button = QPushButton("Delete…")
        self.import_button = QPushButton("Import GGUF…")
        self.load_button = QPushButton("Load options…")
        self.load_button.setToolTip("Choose its context length and GPU offload, then load it")
        self.load_button.clicked.connect(lambda: self._emit(self.load_options_requested, key=True))
        self.eject_button = QPushButton("Eject")
        self.eject_button.setToolTip("Unload the model in use: stop the engine and free its memory")
        self.eject_button.clicked.connect(self.eject_requested)
        self.use_button.clicked.connect(lambda: self._emit(self.use_requested, key=True))
        self.verify_button.clicked.connect(lambda: self._emit(self.verify_requested))
        self.folder_button.clicked.connect(lambda: self._emit(self.open_folder_requested))
        self.delete_button.clicked.connect(lambda: self._emit(self.delete_requested))
        self.import_button.clicked.connect(self.import_requested)
        self.empty = QLabel("No models yet: find one in Discover, or import a GGUF file.")
        self.empty.setObjectName("muted")
        self._rows: list[ModelRow] = []

        layout = page_layout(self)
        layout.addWidget(page_title("My models", "The models on this machine, and how each would run here."))
        layout.addWidget(self.table, 1)
        layout.addWidget(self.empty)
        buttons = QHBoxLayout()
        for b in (self.use_button, self.load_button, self.eject_button, self.verify_button, self.folder_button,
                  self.delete_button):  # fmt: skip
            buttons.addWidget(b)
        buttons.addStretch(1)
        buttons.addWidget(self.import_button)
        layout.addLayout(buttons)
        self._update_buttons()

    def set_rows(self, rows: list[ModelRow]) -> None:
        keep = self.current()
        self._rows = rows
        self.table.setRowCount(len(rows))
        for r, row in enumerate(rows):
            name = f"{row.name}{'  (in use)' if row.in_use else ''}{'  · built-in' if row.bundled else ''}"
            for c, text in enumerate((name, row.repo or "—", row.size, row.arch, row.estimate, row.last_used)):
                item = QTableWidgetItem(text)
                item.setToolTip(str(row.path) if c == 0 else text)
                self.table.setItem(r, c, item)
        chosen = chosen_row(rows, keep.path if keep is not None else None)
        if chosen is not None:
            self.table.selectRow(chosen)
        self.empty.setVisible(not rows)
        self._update_buttons()

    def current(self) -> ModelRow | None:
        rows = self.table.selectionModel().selectedRows() if self.table.selectionModel() else []
        if not rows or rows[0].row() >= len(self._rows):
            return None
        return self._rows[rows[0].row()]

    def _emit(self, signal: SignalInstance, key: bool = False) -> None:
        row = self.current()
        if row is not None:
            signal.emit(row.key if key else str(row.path))

    def _update_buttons(self) -> None:
        row = self.current()
        for b in (self.use_button, self.load_button, self.verify_button, self.folder_button):
            b.setEnabled(row is not None)
        self.eject_button.setEnabled(any(r.in_use for r in self._rows))
        self.delete_button.setEnabled(row is not None and not row.bundled and not row.in_use)
        # a greyed-out Delete says why (a new user saw it grey beside the model in use, with no reason)
        why = None if row is None else "It is in use: chat with another model first." if row.in_use else None
        why = "The built-in model stays with the app." if row is not None and row.bundled else why
        self.delete_button.setToolTip(why or "Delete this model from this computer (asked first)")


# ------------------------------------------------------------------------------------------ Server
REQUEST_COLUMNS = ("Time", "Route", "Status", "Tokens", "Duration")
LAN_WARNING = (
    "Other devices on this network can reach the server: anyone there with the key can use the model and this "
    "computer's memory and power. Turn it on only on a network you trust; a firewall may have to allow the port."
)


class ServerPage(QWidget):
    """The local server (OpenAI's and Anthropic's APIs): on/off, its port, its API key (always one), the base URLs
    to copy for each kind of client."""

    changed = Signal(object)  # ServerSettings

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.enabled = QCheckBox("Let programs on this computer use the model (OpenAI and Anthropic APIs)")
        self.port = QSpinBox()
        self.port.setRange(1024, 65535)
        self.key = QLineEdit()
        self.key.setReadOnly(True)
        self.new_key = QPushButton("New key")
        self.copy_key = QPushButton("Copy")
        self.url = QLineEdit()
        self.url.setReadOnly(True)
        self.copy_url = QPushButton("Copy")
        # Anthropic's clients add /v1/messages to their base URL themselves: the same server, without /v1
        self.anthropic_url = QLineEdit()
        self.anthropic_url.setReadOnly(True)
        self.copy_anthropic_url = QPushButton("Copy")
        self.cors = QLineEdit()
        self.cors.setPlaceholderText("none (browsers' pages cannot call it); e.g. http://localhost:3000")
        # LM Studio's "serve on local network": every address of this computer, never without the key
        self.lan = QCheckBox("Serve on the local network (other devices, with the key)")
        self.lan_warning = QLabel(f"<span style='color:#d08000'>⚠</span> {LAN_WARNING}")
        self.lan_warning.setWordWrap(True)
        self.lan_warning.hide()
        self.requests = QTableWidget(0, len(REQUEST_COLUMNS))
        self.requests.setObjectName("requests")
        self.requests.setHorizontalHeaderLabels(REQUEST_COLUMNS)
        self.requests.verticalHeader().setVisible(False)
        self.requests.setEditTriggers(QAbstractItemView.EditTrigger.NoEditTriggers)
        self.requests.setSelectionMode(QAbstractItemView.SelectionMode.NoSelection)
        self.requests.setShowGrid(False)
        self.requests.setMinimumHeight(self.fontMetrics().height() * 8)
        req_header = self.requests.horizontalHeader()
        req_header.setDefaultAlignment(Qt.AlignmentFlag.AlignLeft | Qt.AlignmentFlag.AlignVCenter)
        for col in range(len(REQUEST_COLUMNS)):
            req_header.setSectionResizeMode(
                col, QHeaderView.ResizeMode.Stretch if col == 1 else QHeaderView.ResizeMode.ResizeToContents
            )
        self.requests_empty = QLabel("No requests yet: they are listed here as programs call the server.")
        self.requests_empty.setObjectName("muted")
        self.state = QLabel("Off.")
        self.state.setWordWrap(True)
        self.example = QLabel("")
        self.example.setObjectName("muted")
        self.example.setWordWrap(True)
        self.example.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        self._settings = ServerSettings()

        key_row = QHBoxLayout()
        key_row.addWidget(self.key, 1)
        key_row.addWidget(self.copy_key)
        key_row.addWidget(self.new_key)
        url_row = QHBoxLayout()
        url_row.addWidget(self.url, 1)
        url_row.addWidget(self.copy_url)
        anthropic_row = QHBoxLayout()
        anthropic_row.addWidget(self.anthropic_url, 1)
        anthropic_row.addWidget(self.copy_anthropic_url)
        form = QFormLayout()
        form.addRow("Port", self.port)
        form.addRow("API key", key_row)
        form.addRow("OpenAI base URL", url_row)
        form.addRow("Anthropic base URL", anthropic_row)
        form.addRow("Allowed web origins", self.cors)
        form.addRow("", self.lan)
        fixed(self.port)
        column = QWidget()
        column.setMaximumWidth(FORM_WIDTH)
        outer = QHBoxLayout(self)
        outer.setContentsMargins(0, 0, 0, 0)
        outer.addWidget(column, 1)
        outer.addStretch(0)
        layout = page_layout(column)
        layout.addWidget(
            page_title(
                "Local server",
                "Other programs (editors, scripts, agents, chat front-ends) can use the model loaded here, as they "
                "would OpenAI's API (chat completions, Responses) or Anthropic's (Messages). Only this computer can "
                "reach it (this network too, with the switch below), and only "
                "with the key.",
            )
        )
        layout.addWidget(self.enabled)
        layout.addLayout(form)
        layout.addWidget(self.lan_warning)
        layout.addWidget(self.state)
        layout.addWidget(self.example)
        requests_title = QLabel("<b>Recent requests</b>")
        layout.addSpacing(8)
        layout.addWidget(requests_title)
        layout.addWidget(self.requests, 1)
        layout.addWidget(self.requests_empty)

        self.enabled.toggled.connect(lambda _on: self._emit())
        self.lan.toggled.connect(lambda _on: self._emit())
        self.port.editingFinished.connect(self._emit)
        self.cors.editingFinished.connect(self._emit)
        self.new_key.clicked.connect(lambda: self._emit(new_key=True))
        self.copy_key.clicked.connect(lambda: QGuiApplication.clipboard().setText(self.key.text()))
        self.copy_url.clicked.connect(lambda: QGuiApplication.clipboard().setText(self.url.text()))
        self.copy_anthropic_url.clicked.connect(lambda: QGuiApplication.clipboard().setText(self.anthropic_url.text()))

    def set_settings(self, s: ServerSettings) -> None:
        self._settings = s
        for w in (self.enabled, self.port, self.cors, self.lan):
            w.blockSignals(True)
        self.lan.setChecked(s.lan)
        self.lan_warning.setVisible(s.lan)
        self.enabled.setChecked(s.enabled)
        self.port.setValue(s.port)
        self.cors.setText(", ".join(s.cors_origins))
        for w in (self.enabled, self.port, self.cors, self.lan):
            w.blockSignals(False)
        self.key.setText(s.api_key)
        self.url.setText(server_url(s.port))
        self.anthropic_url.setText(anthropic_url(s.port))
        self.example.setText(
            f'curl {server_url(s.port)}/chat/completions -H "Authorization: Bearer {s.api_key}" '
            '-H "Content-Type: application/json" -d \'{"messages": [{"role": "user", "content": "Hello"}]}\''
        )

    def set_state(self, text: str) -> None:
        self.state.setText(text)

    def set_requests(self, rows: list[tuple[str, str, str, str, str]]) -> None:
        """The recent requests, newest first: time, route, status, tokens, duration."""
        self.requests.setRowCount(len(rows))
        for r, row in enumerate(rows):
            for c, text in enumerate(row):
                self.requests.setItem(r, c, QTableWidgetItem(text))
        self.requests_empty.setVisible(not rows)

    def request_rows(self) -> list[tuple[str, ...]]:
        return [
            tuple(
                (item.text() if (item := self.requests.item(r, c)) else "") for c in range(self.requests.columnCount())
            )
            for r in range(self.requests.rowCount())
        ]

    def _emit(self, new_key: bool = False) -> None:
        origins = tuple(o.strip() for o in self.cors.text().replace(" ", ",").split(",") if o.strip())
        s = replace(
            self._settings,
            enabled=self.enabled.isChecked(),
            port=self.port.value(),
            cors_origins=origins,
            lan=self.lan.isChecked(),
            api_key=new_api_key() if new_key or not self._settings.api_key else self._settings.api_key,
        )
        if s != self._settings:
            self.set_settings(s)
            self.changed.emit(s)


# ------------------------------------------------------------------------------------------ Settings
PROMPT_CACHE_HINT = (
    "The engine keeps each conversation's context on disk, so that going back to a chat, or reopening the app, "
    "continues at once instead of reading the whole conversation again."
)


class SettingsPage(QWidget):
    theme_changed = Signal(str)
    folders_changed = Signal(list)  # list[str]
    add_folder_requested = Signal()
    context_changed = Signal(int)
    preset_apply_requested = Signal(str)
    preset_save_requested = Signal(str)
    preset_delete_requested = Signal(str)
    mcp_requested = Signal()
    connect_endpoint_requested = Signal()
    show_log_requested = Signal()
    prompt_cache_clear_requested = Signal()

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.theme = QComboBox()
        for label, value in (("Follow the system", "system"), ("Light", "light"), ("Dark", "dark")):
            self.theme.addItem(label, value)
        self.theme.currentIndexChanged.connect(lambda _i: self.theme_changed.emit(self.theme.currentData()))
        self.models_folder = QLabel("")
        self.models_folder.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        self.models_folder.setWordWrap(True)
        self.folders = QListWidget()
        self.folders.setMaximumHeight(90)
        add = QPushButton("Add folder…")
        remove = QPushButton("Remove")
        add.clicked.connect(self.add_folder_requested)
        remove.clicked.connect(self._remove_folder)
        self.context = QSpinBox()
        self.context.setRange(0, 1_048_576)
        self.context.setSingleStep(1024)
        self.context.setSpecialValueText("the model's own (capped by memory)")
        self.context.editingFinished.connect(lambda: self.context_changed.emit(self.context.value()))
        self.preset_model = QLabel("")
        self.preset_model.setWordWrap(True)
        self.presets = QComboBox()
        self.presets.setPlaceholderText("none saved for this model yet")
        self.preset_name = QLineEdit()
        self.preset_name.setPlaceholderText("a name for the current chat's settings")
        apply_button = QPushButton("Apply to this chat")
        save_button = QPushButton("Save")
        delete_button = QPushButton("Delete")
        apply_button.clicked.connect(lambda: self._preset(self.preset_apply_requested))
        delete_button.clicked.connect(lambda: self._preset(self.preset_delete_requested))
        save_button.clicked.connect(self._save_preset)
        mcp = QPushButton("MCP servers…")
        mcp.clicked.connect(self.mcp_requested)
        endpoint = QPushButton("Connect to another OpenAI-compatible server…")
        endpoint.clicked.connect(self.connect_endpoint_requested)
        log = QPushButton("Engine log")
        log.clicked.connect(self.show_log_requested)
        # the engine's prompt cache on disk (issue 44): what it holds, and Clear (the controller asks the engine)
        self.prompt_cache = QLabel("")
        self.prompt_cache.setWordWrap(True)
        self.prompt_cache_clear = QPushButton("Clear")
        self.prompt_cache_clear.setToolTip("Delete every conversation context kept on disk")
        self.prompt_cache_clear.clicked.connect(self.prompt_cache_clear_requested)
        self.set_prompt_cache("Start a model to see what it keeps.", can_clear=False)

        fixed(self.theme, self.context)
        appearance = QFormLayout()
        appearance.addRow("Theme", self.theme)
        folder_buttons = QHBoxLayout()
        folder_buttons.addWidget(add)
        folder_buttons.addWidget(remove)
        folder_buttons.addStretch(1)
        models = QFormLayout()
        models.addRow("Downloads go to", self.models_folder)
        models.addRow("Also look in", self.folders)
        models.addRow("", folder_buttons)
        models.addRow("Context length", self.context)
        preset_row = QHBoxLayout()
        preset_row.addWidget(self.presets, 1)
        preset_row.addWidget(apply_button)
        preset_row.addWidget(delete_button)
        save_row = QHBoxLayout()
        save_row.addWidget(self.preset_name, 1)
        save_row.addWidget(save_button)
        presets = QFormLayout()
        presets.addRow("For", self.preset_model)
        presets.addRow("Saved", preset_row)
        presets.addRow("Save as", save_row)
        tools = QHBoxLayout()
        for b in (mcp, endpoint, log):
            tools.addWidget(b)
        tools.addStretch(1)
        cache_row = QHBoxLayout()
        cache_row.addWidget(self.prompt_cache, 1)
        cache_row.addWidget(self.prompt_cache_clear)
        cache_hint = QLabel(PROMPT_CACHE_HINT)
        cache_hint.setObjectName("muted")
        cache_hint.setWordWrap(True)
        cache = QFormLayout()
        cache.addRow(cache_hint)
        cache.addRow("On disk", cache_row)
        keys = QFormLayout()
        for key, what in SHORTCUTS:
            keys.addRow(QLabel(f"<b>{key}</b>"), QLabel(what))

        inner = QWidget()
        inner.setMaximumWidth(FORM_WIDTH)
        layout = page_layout(inner)
        layout.addWidget(page_title("Settings"))
        for title, body in (
            ("Appearance", appearance),
            ("Models", models),
            ("Chat presets", presets),
            ("Tools and connections", tools),
            ("Conversation contexts on disk", cache),
            ("Keyboard shortcuts", keys),
        ):
            group = QGroupBox(title)
            group.setLayout(body)
            layout.addWidget(group)
        layout.addStretch(1)
        scroll = QScrollArea()
        scroll.setWidgetResizable(True)
        scroll.setFrameShape(QFrame.Shape.NoFrame)
        scroll.setWidget(inner)
        scroll.setAlignment(Qt.AlignmentFlag.AlignLeft | Qt.AlignmentFlag.AlignTop)
        outer = QVBoxLayout(self)
        outer.setContentsMargins(0, 0, 0, 0)
        outer.addWidget(scroll)

    def set_settings(self, s: AppSettings, models_folder: str) -> None:
        self.theme.blockSignals(True)
        self.theme.setCurrentIndex(max(0, self.theme.findData(s.theme)))
        self.theme.blockSignals(False)
        self.models_folder.setText(models_folder)
        self.folders.clear()
        self.folders.addItems(list(s.model_dirs))
        self.context.setValue(s.context_length)

    def set_prompt_cache(self, line: str, can_clear: bool) -> None:
        """The prompt cache's line (engine/prompt_cache.py `CacheUse.line`) and whether Clear has anything to do."""
        self.prompt_cache.setText(line)
        self.prompt_cache_clear.setEnabled(can_clear)

    def set_presets(self, model: str | None, names: list[str]) -> None:
        self.preset_model.setText(model or "no model loaded")
        self.presets.clear()
        self.presets.addItems(names)
        # (with a placeholder a combo box selects nothing by itself: Apply and Delete then did nothing)
        self.presets.setCurrentIndex(0 if names else -1)

    def theme_value(self) -> Theme:
        value = self.theme.currentData()
        return value if value in ("system", "light", "dark") else "system"

    def _remove_folder(self) -> None:
        row = self.folders.currentRow()
        if row >= 0:
            self.folders.takeItem(row)
            self.folders_changed.emit([self.folders.item(i).text() for i in range(self.folders.count())])

    def _preset(self, signal: SignalInstance) -> None:
        name = self.presets.currentText()
        if name:
            signal.emit(name)

    def _save_preset(self) -> None:
        name = self.preset_name.text().strip()
        if name:
            self.preset_save_requested.emit(name)
            self.preset_name.clear()
