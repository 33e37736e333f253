"""The chat: conversations, transcript, input, sampling settings. Thin: it emits intents, a controller acts."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from PySide6.QtCore import QMimeData, QModelIndex, QPersistentModelIndex, QPoint, Qt, Signal
from PySide6.QtGui import QDragEnterEvent, QDragMoveEvent, QDropEvent, QIcon, QKeySequence, QShortcut
from PySide6.QtWidgets import (
    QAbstractItemView,
    QComboBox,
    QDoubleSpinBox,
    QFileDialog,
    QFormLayout,
    QGroupBox,
    QHBoxLayout,
    QLabel,
    QLineEdit,
    QListWidget,
    QListWidgetItem,
    QMenu,
    QPlainTextEdit,
    QPushButton,
    QSizePolicy,
    QSpinBox,
    QSplitter,
    QStyledItemDelegate,
    QStyleOptionViewItem,
    QToolButton,
    QVBoxLayout,
    QWidget,
)

from runmyai.chat.images import Attachments, ImageError, Picture
from runmyai.ui import icons
from runmyai.ui.image_input import (
    PictureStrip,
    file_filter,
    mime_has_pictures,
    picture_from_file,
    pictures_from_mime,
)
from runmyai.ui.transcript import Transcript


@dataclass
class SamplingValues:
    system_prompt: str = ""
    temperature: float = 0.7
    top_p: float = 0.95
    top_k: int = 40
    min_p: float = 0.05
    max_tokens: int = 0  # 0: a quarter of the context (the model's n_ctx), never all of it
    seed: int = -1  # -1: random
    repeat_penalty: float = 1.0
    context_overflow: str = "rolling"  # when the chat outgrows the context: rolling, trim-middle, stop


# the overflow policies as the settings box names them (LM Studio's three)
OVERFLOW_CHOICES = (
    ("rolling", "Rolling window (drop the oldest)"),
    ("trim-middle", "Trim the middle (keep the first question)"),
    ("stop", "Stop (refuse once it is full)"),
)


PICKER_MAX_WIDTH = 560
NO_MODEL = "No model loaded: choose one"


class _Input(QPlainTextEdit):
    submitted = Signal()

    def __init__(self) -> None:
        super().__init__()
        # the panel's: takes a paste's or a drop's pictures (True: taken); None or False: the box's own text paste
        self.take_pictures: Callable[[QMimeData], bool] | None = None

    def canInsertFromMimeData(self, source: QMimeData) -> bool:  # Qt's name
        return (self.take_pictures is not None and mime_has_pictures(source)) or super().canInsertFromMimeData(source)

    def insertFromMimeData(self, source: QMimeData) -> None:  # Qt's name: Ctrl+V and drops on the box
        if self.take_pictures is not None and mime_has_pictures(source) and self.take_pictures(source):
            return
        super().insertFromMimeData(source)

    def keyPressEvent(self, event):  # type: ignore[no-untyped-def]  # Qt's override signature
        enter = event.key() in (Qt.Key.Key_Return, Qt.Key.Key_Enter)
        if enter and not (event.modifiers() & Qt.KeyboardModifier.ShiftModifier):
            self.submitted.emit()  # Enter sends, Shift+Enter is a new line
            return
        super().keyPressEvent(event)


class SettingsBox(QGroupBox):
    changed = Signal()

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__("Conversation settings", parent)
        self.setObjectName("conversationSettings")
        self.setCheckable(True)
        self.setChecked(False)  # folded: most people never open it
        self.system_prompt = QPlainTextEdit()
        self.system_prompt.setPlaceholderText("System prompt")
        self.system_prompt.setMaximumHeight(70)
        self.temperature = self._double(0, 2, 0.05)
        self.top_p = self._double(0, 1, 0.01)
        self.min_p = self._double(0, 1, 0.01)
        self.repeat_penalty = self._double(0.5, 2, 0.01)
        self.top_k = self._int(0, 1000)
        self.max_tokens = self._int(0, 1_048_576)
        self.max_tokens.setSpecialValueText("auto: ¼ of the context")
        self.max_tokens.setToolTip("The reply's length at most; auto leaves ¾ of the context to the conversation")
        self.overflow = QComboBox()
        for value, label in OVERFLOW_CHOICES:
            self.overflow.addItem(label, value)
        self.overflow.setToolTip(
            "When the conversation no longer fits the model's context: the system prompt, the tools and your last "
            "message are always kept"
        )
        self.overflow.currentIndexChanged.connect(self.changed)
        self.seed = self._int(-1, 2**31 - 1)
        self.seed.setSpecialValueText("random")
        form = QFormLayout()
        form.addRow("System prompt", self.system_prompt)
        for label, box in (
            ("Temperature", self.temperature),
            ("Top-p", self.top_p),
            ("Top-k", self.top_k),
            ("Min-p", self.min_p),
            ("Max tokens", self.max_tokens),
            ("Seed", self.seed),
            ("Repeat penalty", self.repeat_penalty),
            ("When the context is full", self.overflow),
        ):
            form.addRow(label, box)
        inner = QWidget()
        inner.setLayout(form)
        layout = QVBoxLayout(self)
        layout.addWidget(inner)
        self.toggled.connect(self._fold)
        self._inner = inner
        self._fold(False)
        self.system_prompt.textChanged.connect(self.changed)

    def _fold(self, open_: bool) -> None:
        """Folded: only the title row shows (no empty frame under it)."""
        self._inner.setVisible(open_)
        self.setFlat(not open_)
        self.setProperty("folded", not open_)  # the theme draws no frame then (an empty bar under the title)
        self.style().unpolish(self)
        self.style().polish(self)
        self.setMaximumHeight(16777215 if open_ else self.fontMetrics().height() + 12)

    def _double(self, lo: float, hi: float, step: float) -> QDoubleSpinBox:
        box = QDoubleSpinBox()
        box.setRange(lo, hi)
        box.setSingleStep(step)
        box.setDecimals(2)
        box.valueChanged.connect(self.changed)
        return box

    def _int(self, lo: int, hi: int) -> QSpinBox:
        box = QSpinBox()
        box.setRange(lo, hi)
        box.valueChanged.connect(self.changed)
        return box

    def values(self) -> SamplingValues:
        return SamplingValues(
            system_prompt=self.system_prompt.toPlainText(),
            temperature=self.temperature.value(),
            top_p=self.top_p.value(),
            top_k=self.top_k.value(),
            min_p=self.min_p.value(),
            max_tokens=self.max_tokens.value(),
            seed=self.seed.value(),
            repeat_penalty=self.repeat_penalty.value(),
            context_overflow=str(self.overflow.currentData() or "rolling"),
        )

    def set_values(self, v: SamplingValues) -> None:
        widgets = (self.system_prompt, self.temperature, self.top_p, self.top_k, self.min_p, self.max_tokens)
        for w in (*widgets, self.seed, self.repeat_penalty, self.overflow):
            w.blockSignals(True)
        self.system_prompt.setPlainText(v.system_prompt)
        self.temperature.setValue(v.temperature)
        self.top_p.setValue(v.top_p)
        self.top_k.setValue(v.top_k)
        self.min_p.setValue(v.min_p)
        self.max_tokens.setValue(v.max_tokens)
        self.seed.setValue(v.seed)
        self.repeat_penalty.setValue(v.repeat_penalty)
        self.overflow.setCurrentIndex(max(0, self.overflow.findData(v.context_overflow)))
        for w in (*widgets, self.seed, self.repeat_penalty, self.overflow):
            w.blockSignals(False)


class ElidedLabel(QLabel):
    """One line that never re-lays out its window and never shows a cut word: a text too long for it ends in "…"
    and is whole in its tooltip (and in text()). For passing state ("Thinking…"); errors go to the notification
    area, whole."""

    def __init__(self, text: str = "", parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self._full = ""
        self.setSizePolicy(QSizePolicy.Policy.Ignored, QSizePolicy.Policy.Fixed)
        self.setFixedHeight(self.fontMetrics().height() + 4)
        self.setText(text)

    def setText(self, text: str) -> None:  # Qt's name
        self._full = text
        self.setToolTip(text if text else "")
        self._elide()

    def text(self) -> str:  # the whole text, as set
        return self._full

    def shown_text(self) -> str:
        return super().text()

    def resizeEvent(self, event):  # type: ignore[no-untyped-def]  # Qt's override signature
        super().resizeEvent(event)
        self._elide()

    def _elide(self) -> None:
        width = max(0, self.contentsRect().width())
        super().setText(self.fontMetrics().elidedText(self._full, Qt.TextElideMode.ElideRight, width))


class TitleEditor(QStyledItemDelegate):
    """The rename editor over a conversation's whole row, at least as tall as a line edit wants: placed in the
    row's text rectangle (the style sheet's 8 px padding taken off), with its own padding it was a few pixels
    tall and its text unreadable (the walk-through)."""

    def updateEditorGeometry(  # Qt's name
        self, editor: QWidget, option: QStyleOptionViewItem, index: QModelIndex | QPersistentModelIndex
    ) -> None:
        rect = option.rect
        need = editor.sizeHint().height()
        top = rect.top() if rect.height() >= need else rect.center().y() - need // 2
        editor.setGeometry(rect.left(), top, rect.width(), max(need, rect.height()))


class ChatPanel(QWidget):
    send_requested = Signal(str)
    stop_requested = Signal()
    regenerate_requested = Signal()
    edit_last_requested = Signal()
    new_conversation_requested = Signal()
    delete_conversation_requested = Signal(str)
    rename_conversation_requested = Signal(str, str)  # id, new title
    export_conversation_requested = Signal(str, str)  # id, "md" or "json"
    import_conversation_requested = Signal()
    conversation_selected = Signal(str)
    search_changed = Signal(str)
    model_chosen = Signal(str)  # a library key
    eject_requested = Signal()
    load_options_requested = Signal(str)  # a library key: its load dialog
    draft_changed = Signal(str)  # the input box's text, at every edit
    settings_changed = Signal()
    performance_toggled = Signal(bool)
    tools_toggled = Signal(bool)  # tools on or off in this chat
    tool_server_toggled = Signal(str, bool)  # one MCP server's tools on or off in this chat

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.search = QLineEdit()
        self.search.setPlaceholderText("Search chats")
        self.search.setClearButtonEnabled(True)
        self.search.textChanged.connect(lambda text: self.search_changed.emit(text.strip()))
        self.conversations = QListWidget()
        self.conversations.setObjectName("conversations")
        # a long title is cut with an ellipsis (whole in its tooltip): it grew a horizontal scroll bar
        self.conversations.setTextElideMode(Qt.TextElideMode.ElideRight)
        self.conversations.setHorizontalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAlwaysOff)
        self.conversations.currentItemChanged.connect(self._on_select)
        self.conversations.itemChanged.connect(self._on_renamed)
        self.conversations.setItemDelegate(TitleEditor(self.conversations))
        self.conversations.setContextMenuPolicy(Qt.ContextMenuPolicy.CustomContextMenu)
        self.conversations.customContextMenuRequested.connect(self._conversation_menu)
        self.conversations.setEditTriggers(
            QAbstractItemView.EditTrigger.DoubleClicked | QAbstractItemView.EditTrigger.EditKeyPressed
        )
        self.new_button = QPushButton("New chat")
        self.new_button.setObjectName("primary")
        self.new_button.clicked.connect(self.new_conversation_requested)
        self.rename_button = QPushButton("Rename")
        self.rename_button.clicked.connect(self.rename_current)
        delete_button = QPushButton("Delete")
        delete_button.clicked.connect(self._on_delete)
        left = QWidget()
        left.setObjectName("sidebar")
        left_layout = QVBoxLayout(left)
        left_layout.setContentsMargins(12, 12, 6, 12)
        left_layout.addWidget(self.new_button)
        left_layout.addWidget(self.search)
        left_layout.addWidget(self.conversations, 1)
        row = QHBoxLayout()
        row.addWidget(self.rename_button)
        row.addWidget(delete_button)
        left_layout.addLayout(row)

        self.model_picker = QComboBox()
        self.model_picker.setMinimumContentsLength(28)
        self.model_picker.setSizeAdjustPolicy(QComboBox.SizeAdjustPolicy.AdjustToMinimumContentsLengthWithIcon)
        self.model_picker.setToolTip("The model to chat with (Ctrl+Shift+L)")
        self.model_picker.activated.connect(self._on_model)
        self.perf_button = QPushButton("Performance")
        self.perf_button.setCheckable(True)
        self.perf_button.setToolTip("Show or hide the live performance panel (Ctrl+Shift+P)")
        self.perf_button.toggled.connect(self.performance_toggled)
        top = QHBoxLayout()
        top.addWidget(QLabel("Model"))
        top.addWidget(self.model_picker, 1)
        # LM Studio's eject beside the model (the model stops, its memory is freed; the picker loads one again) and
        # its load options: icon buttons, so that the picker keeps its room at 1280x800 beside the docked panel
        self.eject_button = QToolButton()
        self.eject_button.setObjectName("eject")
        self.eject_button.setText("Eject")
        self.eject_button.setToolTip("Eject: unload the model (stop the engine and free its memory)")
        self.eject_button.clicked.connect(self.eject_requested)
        self.eject_button.setEnabled(False)
        top.addWidget(self.eject_button)
        self.load_options_button = QToolButton()
        self.load_options_button.setText("Load options…")
        self.load_options_button.setToolTip("Load options: the model's context length and GPU offload, then load it")
        self.load_options_button.clicked.connect(self._on_load_options)
        top.addWidget(self.load_options_button)
        for tool in (self.eject_button, self.load_options_button):
            tool.setToolButtonStyle(Qt.ToolButtonStyle.ToolButtonIconOnly)
            tool.setAutoRaise(True)
        self.set_icon_colour("#5f6673")
        top.addStretch(0)
        top.addWidget(self.perf_button)
        # at 1920x1080 the picker spread over 820 px for a 25-character name; 560 px holds the longest names (a
        # hub repository and its quant) and leaves the Performance button at the right edge
        self.model_picker.setMaximumWidth(PICKER_MAX_WIDTH)

        self.transcript = Transcript()
        self.settings = SettingsBox()
        self.settings.changed.connect(self.settings_changed)
        self.input = _Input()
        self.input.setPlaceholderText("Message (Enter to send, Shift+Enter for a new line)")
        self.input.setMaximumHeight(110)
        self.input.submitted.connect(self._on_send)
        self.input.textChanged.connect(lambda: self.draft_changed.emit(self.input.toPlainText()))
        # pictures for the next message (issue 45): attached, pasted or dropped; offered only where the model in
        # use reads them (the engine says so: set_images_allowed)
        self.attachments = Attachments()
        self.images_allowed = False
        self.picture_strip = PictureStrip()
        self.picture_strip.removed.connect(self._remove_picture)
        self.attach_button = QPushButton("Attach image…")
        self.attach_button.setToolTip("Add a picture to the message (or paste one, or drop it on the chat)")
        self.attach_button.clicked.connect(self._choose_pictures)
        self.attach_button.setVisible(False)
        self.setAcceptDrops(True)
        # the draft's tokens and the context's room, while typing (the controller counts, debounced)
        self.token_label = QLabel("")
        self.token_label.setObjectName("footer")
        self.token_label.setToolTip("What this message adds to the prompt, by the model's own tokenizer")
        self.token_label.setFixedHeight(self.token_label.fontMetrics().height() + 2)  # (no jump as it comes and goes)
        self.send_button = QPushButton("Send")
        self.send_button.setObjectName("primary")
        self.send_button.clicked.connect(self._on_send)
        self.stop_button = QPushButton("Stop")
        self.stop_button.clicked.connect(self.stop_requested)
        self.regenerate_button = QPushButton("Regenerate")
        self.regenerate_button.clicked.connect(self.regenerate_requested)
        self.edit_button = QPushButton("Edit last")
        self.edit_button.clicked.connect(self.edit_last_requested)
        # two wrapped lines, never "…": the walk-through's one elided line read "Chatting with TokenWing demo (22 …"
        # at 1280x800. Its height is fixed (a longer status must not re-lay out the chat); layout_check finds one
        # that needs more.
        self.status = QLabel("")
        self.status.setObjectName("footer")
        self.status.setWordWrap(True)
        self.status.setSizePolicy(QSizePolicy.Policy.Ignored, QSizePolicy.Policy.Fixed)
        self.status.setFixedHeight(self.status.fontMetrics().lineSpacing() * 2 + 2)
        self.status.setAlignment(Qt.AlignmentFlag.AlignLeft | Qt.AlignmentFlag.AlignVCenter)
        self.context_label = QLabel("Context: —")
        self.context_label.setObjectName("footer")
        self.speed_label = QLabel("")
        self.speed_label.setObjectName("footer")
        # the chat's tools: on or off, per server, and what they cost of the context (counted by the engine)
        self.tools_button = QToolButton()
        self.tools_button.setObjectName("tools")
        self.tools_button.setPopupMode(QToolButton.ToolButtonPopupMode.InstantPopup)
        self.tools_button.setToolButtonStyle(Qt.ToolButtonStyle.ToolButtonTextOnly)
        # the menu's arrow is in the text ("▾"): Qt's own indicator sat over the text's last characters
        self.tools_button.setStyleSheet("QToolButton::menu-indicator { image: none; width: 0px; }")
        self.tools_menu = QMenu(self.tools_button)
        self.tools_button.setMenu(self.tools_menu)
        self.tools_button.setVisible(False)  # no MCP server configured: nothing to say
        buttons = QHBoxLayout()
        buttons.addWidget(self.attach_button)
        buttons.addWidget(self.tools_button)
        buttons.addStretch(1)
        for b in (self.edit_button, self.regenerate_button, self.stop_button, self.send_button):
            buttons.addWidget(b)
        footer = QHBoxLayout()
        footer.addWidget(self.status, 1)
        footer.addWidget(self.speed_label)
        footer.addSpacing(12)
        footer.addWidget(self.context_label)
        right = QWidget()
        right_layout = QVBoxLayout(right)
        right_layout.setContentsMargins(6, 12, 12, 8)
        right_layout.addLayout(top)
        right_layout.addWidget(self.transcript, 1)
        right_layout.addWidget(self.settings)
        right_layout.addWidget(self.picture_strip)
        right_layout.addWidget(self.input)
        # the draft's token count on its own line under the input, right-aligned (LM Studio's place for it): in the
        # buttons' row it had 129 px at 1280x800 beside the tools button
        count_row = QHBoxLayout()
        count_row.setContentsMargins(0, 0, 0, 0)
        count_row.addStretch(1)
        count_row.addWidget(self.token_label)
        right_layout.addLayout(count_row)
        right_layout.addLayout(buttons)
        right_layout.addLayout(footer)

        splitter = QSplitter()
        splitter.addWidget(left)
        splitter.addWidget(right)
        splitter.setStretchFactor(1, 1)
        splitter.setCollapsible(1, False)
        splitter.setSizes([230, 700])
        self.splitter = splitter
        layout = QVBoxLayout(self)
        layout.setContentsMargins(0, 0, 0, 0)
        layout.addWidget(splitter)

        QShortcut(QKeySequence("Esc"), self, self.stop_requested.emit)
        QShortcut(QKeySequence("Ctrl+R"), self, self.regenerate_requested.emit)
        QShortcut(QKeySequence("Ctrl+E"), self, self.edit_last_requested.emit)
        QShortcut(QKeySequence("F2"), self, self.rename_current)
        self.set_busy(False)

    # -- intents -------------------------------------------------------------------------------------
    def _on_send(self) -> None:
        text = self.input.toPlainText().strip()
        if (text or len(self.attachments)) and self.send_button.isEnabled():
            self.input.clear()
            self.send_requested.emit(text)  # (the controller takes the pictures: take_pictures)

    # -- pictures ------------------------------------------------------------------------------------
    def set_images_allowed(self, allowed: bool) -> None:
        """Pictures offered (the attach button, paste, drop) only for a model that reads them; the ones waiting
        go when the model changes to one that does not."""
        self.images_allowed = allowed
        self.attach_button.setVisible(allowed)
        self.input.take_pictures = self._take_mime if allowed else None
        if not allowed and len(self.attachments):
            self.attachments.take()
            self.picture_strip.show_pictures([])

    def add_pictures(self, pictures: list[Picture], refused: Sequence[str] = ()) -> bool:
        """Pictures into the next message; what is not taken is said on the status line. True if any was."""
        problems = list(refused)
        added = False
        for p in pictures:
            try:
                added = self.attachments.add(p) or added
            except ImageError as e:
                problems.append(str(e))
                break
        self.picture_strip.show_pictures(self.attachments.pictures)
        if problems:
            self.set_status(" ".join(dict.fromkeys(problems)))
        return added

    def attach_files(self, paths: list[Path]) -> None:
        pictures: list[Picture] = []
        problems: list[str] = []
        for path in paths:
            try:
                pictures.append(picture_from_file(path))
            except ImageError as e:
                problems.append(str(e))
        self.add_pictures(pictures, problems)

    def take_pictures(self) -> list[Picture]:
        """The pictures for the message being sent; the composer is empty of them."""
        out = self.attachments.take()
        self.picture_strip.show_pictures([])
        return out

    def _choose_pictures(self) -> None:
        names, _ = QFileDialog.getOpenFileNames(self, "Attach images", "", file_filter())
        self.attach_files([Path(n) for n in names])

    def _remove_picture(self, index: int) -> None:
        self.attachments.remove(index)
        self.picture_strip.show_pictures(self.attachments.pictures)

    def _take_mime(self, mime: QMimeData) -> bool:
        pictures, problems = pictures_from_mime(mime)
        if not pictures and not problems:
            return False
        self.add_pictures(pictures, problems)
        return True

    def _drag(self, event: QDropEvent) -> None:
        if self.images_allowed and mime_has_pictures(event.mimeData()):
            event.acceptProposedAction()
        else:
            event.ignore()

    def dragEnterEvent(self, event: QDragEnterEvent) -> None:  # Qt's name: a drop anywhere on the chat
        self._drag(event)

    def dragMoveEvent(self, event: QDragMoveEvent) -> None:  # Qt's name
        self._drag(event)

    def dropEvent(self, event: QDropEvent) -> None:  # Qt's name
        if self.images_allowed and self._take_mime(event.mimeData()):
            event.acceptProposedAction()
        else:
            event.ignore()

    def _on_select(self, item: QListWidgetItem | None, _previous: QListWidgetItem | None = None) -> None:
        if item is not None:
            self.conversation_selected.emit(str(item.data(Qt.ItemDataRole.UserRole)))

    def _on_delete(self) -> None:
        item = self.conversations.currentItem()
        if item is not None:
            self.delete_conversation_requested.emit(str(item.data(Qt.ItemDataRole.UserRole)))

    def conversation_menu(self, item: QListWidgetItem) -> QMenu:
        """A conversation's right-click menu: rename, export (Markdown, JSON), import, delete."""
        cid = str(item.data(Qt.ItemDataRole.UserRole))
        menu = QMenu(self)
        menu.addAction("Rename", lambda: self.conversations.editItem(item))
        menu.addAction("Export as Markdown…", lambda: self.export_conversation_requested.emit(cid, "md"))
        menu.addAction("Export as JSON…", lambda: self.export_conversation_requested.emit(cid, "json"))
        menu.addAction("Import chat…", self.import_conversation_requested.emit)
        menu.addSeparator()
        menu.addAction("Delete", lambda: self.delete_conversation_requested.emit(cid))
        return menu

    def _conversation_menu(self, pos: QPoint) -> None:
        item = self.conversations.itemAt(pos)
        if item is not None:
            self.conversation_menu(item).popup(self.conversations.viewport().mapToGlobal(pos))

    def rename_current(self) -> None:
        """Edits the current conversation's title in place (Enter keeps it, Esc drops it)."""
        item = self.conversations.currentItem()
        if item is not None:
            self.conversations.editItem(item)

    def _on_renamed(self, item: QListWidgetItem) -> None:
        title = item.text().strip()
        if title:
            self.rename_conversation_requested.emit(str(item.data(Qt.ItemDataRole.UserRole)), title)

    def set_icon_colour(self, colour: str) -> None:
        """The top bar's icon buttons in the theme's text colour."""
        self.eject_button.setIcon(QIcon(icons.pixmap("Eject", colour)))
        self.load_options_button.setIcon(QIcon(icons.pixmap("Load options", colour)))

    def _on_load_options(self) -> None:
        key = self.model_picker.currentData()
        if key is None and self.model_picker.count() > 1:
            key = self.model_picker.itemData(1)  # "No model loaded": the first model under it
        if key and not str(key).startswith("remote:"):
            self.load_options_requested.emit(str(key))

    def _on_model(self, index: int) -> None:
        key = self.model_picker.itemData(index)
        if key:
            self.model_chosen.emit(str(key))

    # -- state from the controller -------------------------------------------------------------------
    def set_conversations(self, items: list[tuple[str, str]], current: str | None) -> None:
        self.conversations.blockSignals(True)
        self.conversations.clear()
        for conv_id, title in items:
            item = QListWidgetItem(title or "New chat")
            item.setData(Qt.ItemDataRole.UserRole, conv_id)
            item.setFlags(item.flags() | Qt.ItemFlag.ItemIsEditable)
            item.setToolTip(title or "New chat")
            self.conversations.addItem(item)
            if conv_id == current:
                self.conversations.setCurrentItem(item)
        self.conversations.blockSignals(False)

    def set_models(self, models: list[tuple[str, str]], current: str | None) -> None:
        """The picker's choices: (library key, name) of each model that can be chatted with."""
        self.model_picker.blockSignals(True)
        self.model_picker.clear()
        for key, name in models:
            self.model_picker.addItem(name, key)
        if not models:
            self.model_picker.addItem("No model yet: find one in Discover", None)
        elif current is None:  # none loaded (ejected, or not started yet): said so, not the first model's name
            self.model_picker.insertItem(0, NO_MODEL, None)
        index = self.model_picker.findData(current) if current else -1
        self.model_picker.setCurrentIndex(max(0, index))
        self.model_picker.blockSignals(False)

    def set_tools(self, line: str, on: bool, servers: list[tuple[str, str, bool]]) -> None:
        """The tools button: `line` its text ("Tools on · 2 servers · 1,234 tokens"); its menu: tools on or off in
        this chat, and each server (name, what it offers, on) on or off. Hidden when there is no server."""
        self.tools_button.setVisible(bool(servers))
        self.tools_button.setText(f"{line} ▾" if line else "")
        self.tools_button.setToolTip(
            "The MCP servers' tools offered to the model in this chat; their definitions take part of the context"
        )
        menu = self.tools_menu
        menu.clear()
        use = menu.addAction("Use tools in this chat")
        use.setCheckable(True)
        use.setChecked(on)
        use.toggled.connect(self.tools_toggled)
        menu.addSeparator()
        for name, offers, server_on in servers:
            action = menu.addAction(f"{name} ({offers})")
            action.setCheckable(True)
            action.setChecked(server_on)
            action.setEnabled(on)
            action.toggled.connect(lambda checked, n=name: self.tool_server_toggled.emit(n, checked))

    def set_footer(self, speed: str, context: str) -> None:
        self.speed_label.setText(speed)
        self.context_label.setText(context)

    def set_busy(self, busy: bool) -> None:
        self.send_button.setEnabled(not busy)
        self.stop_button.setEnabled(busy)
        self.regenerate_button.setEnabled(not busy)
        self.edit_button.setEnabled(not busy)
        self.model_picker.setEnabled(not busy)
        # a new chat waits for the reply as switching does (the walk: New chat mid-reply left the old transcript on
        # screen under the new chat's name, and the next message showed beneath the other chat's turns)
        self.new_button.setEnabled(not busy)

    def set_status(self, text: str) -> None:
        self.status.setText(text)
