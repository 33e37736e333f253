"""The model library: presets and local models, the "will it run here?" estimate, hub search, downloads."""

from __future__ import annotations

from PySide6.QtCore import QModelIndex, QPersistentModelIndex, QRect, QRectF, QSize, Qt, Signal, SignalInstance
from PySide6.QtGui import QColor, QFont, QFontMetrics, QPainter, QPalette, QPen, QResizeEvent
from PySide6.QtWidgets import (
    QAbstractItemView,
    QComboBox,
    QHBoxLayout,
    QHeaderView,
    QLabel,
    QLineEdit,
    QListWidget,
    QListWidgetItem,
    QProgressBar,
    QPushButton,
    QSplitter,
    QStyle,
    QStyledItemDelegate,
    QStyleOptionViewItem,
    QTableWidget,
    QTableWidgetItem,
    QTabWidget,
    QTextBrowser,
    QVBoxLayout,
    QWidget,
)

from runmyai.ui.markdown_view import set_markdown
from runmyai.ui.render import LibraryEntry
from runmyai.ui.viewmodels import BADGE_RGB
from runmyai.units import human_bytes

TITLE_ROLE = Qt.ItemDataRole.UserRole + 1  # a card's model name
LINE_ROLE = Qt.ItemDataRole.UserRole + 2  # the estimate in one line
COLOUR_ROLE = Qt.ItemDataRole.UserRole + 3  # the badge's colour name
SOURCE_ROLE = Qt.ItemDataRole.UserRole + 4  # "built-in", "on the hub", "installed", …
BASIS_ROLE = Qt.ItemDataRole.UserRole + 5  # where the estimate's numbers come from: "measured: 3 chats"


class CardDelegate(QStyledItemDelegate):
    """Draws one entry as a card: the model's name, its "will it run here?" badge (a dot in its colour and the
    estimate in one line), where it comes from. Each line is elided to the card's width; the whole text is in the
    item's tooltip (the card grid is laid out so that the card is never narrower than MIN_WIDTH)."""

    PAD = 12
    MARGIN = 5  # the gap around a card, inside its grid cell

    def __init__(self, grid: CardGrid) -> None:
        super().__init__(grid)
        self.grid = grid

    def sizeHint(self, _option: QStyleOptionViewItem, _index: QModelIndex | QPersistentModelIndex) -> QSize:
        return self.grid.gridSize()

    def paint(self, p: QPainter, option: QStyleOptionViewItem, index: QModelIndex | QPersistentModelIndex) -> None:
        pal: QPalette = option.palette
        rect: QRect = option.rect.adjusted(self.MARGIN, self.MARGIN, -self.MARGIN, -self.MARGIN)
        state = option.state
        selected = bool(state & QStyle.StateFlag.State_Selected)
        hover = bool(state & QStyle.StateFlag.State_MouseOver)
        accent = pal.color(QPalette.ColorRole.Highlight)
        p.save()
        p.setRenderHint(QPainter.RenderHint.Antialiasing)
        p.setPen(QPen(accent if selected or hover else pal.color(QPalette.ColorRole.Mid), 2 if selected else 1))
        p.setBrush(pal.color(QPalette.ColorRole.Base))
        p.drawRoundedRect(QRectF(rect).adjusted(0.5, 0.5, -0.5, -0.5), 10, 10)
        inner = rect.adjusted(self.PAD, self.PAD, -self.PAD, -self.PAD)
        base_font = QFont(option.font)
        title_font = self.grid.title_font()
        x, y, width = inner.x(), inner.y(), inner.width()
        p.setFont(title_font)
        p.setPen(pal.color(QPalette.ColorRole.Text))
        tfm = p.fontMetrics()
        p.drawText(x, y + tfm.ascent(), tfm.elidedText(str(index.data(TITLE_ROLE)), Qt.TextElideMode.ElideRight, width))
        y += tfm.height() + 6
        p.setFont(base_font)
        fm = p.fontMetrics()
        dot = fm.height() * 0.55
        colour = QColor(BADGE_RGB.get(str(index.data(COLOUR_ROLE)), BADGE_RGB["grey"]))
        p.setPen(Qt.PenStyle.NoPen)
        p.setBrush(colour)
        p.drawEllipse(QRectF(x, y + (fm.height() - dot) / 2, dot, dot))
        p.setPen(pal.color(QPalette.ColorRole.Text))
        text_x = x + round(dot + 6)
        line = fm.elidedText(str(index.data(LINE_ROLE)), Qt.TextElideMode.ElideRight, width - (text_x - x))
        p.drawText(text_x, y + fm.ascent(), line)
        y += fm.height() + 4
        p.setPen(pal.color(QPalette.ColorRole.PlaceholderText))
        basis = str(index.data(BASIS_ROLE) or "")
        if basis:  # under the speed, in its column: "measured: 3 chats", "estimated from the model's shape"
            p.drawText(text_x, y + fm.ascent(), fm.elidedText(basis, Qt.TextElideMode.ElideRight, width - (text_x - x)))
        y += fm.height() + 4
        p.drawText(x, y + fm.ascent(), fm.elidedText(str(index.data(SOURCE_ROLE)), Qt.TextElideMode.ElideRight, width))
        p.restore()

    def elided(self, item: QListWidgetItem, card_width: int) -> tuple[str, str]:
        """The estimate's line and its basis where a card `card_width` wide cuts them ("" where it does not): the
        numbers and where they came from are the card's point, so layout_check reports them cut."""
        fm = self.grid.fontMetrics()
        room = card_width - 2 * (self.MARGIN + self.PAD) - round(fm.height() * 0.55 + 6)
        texts = (str(item.data(LINE_ROLE) or ""), str(item.data(BASIS_ROLE) or ""))
        return tuple(t if fm.horizontalAdvance(t) > room else "" for t in texts)  # type: ignore[return-value]

    def card_height(self) -> int:
        """Padding, the title, the badge line, its basis and the source line (CardGrid sizes its cells with it)."""
        fm, tfm = self.grid.fontMetrics(), self.grid.title_metrics()
        return 2 * self.PAD + 2 * self.MARGIN + tfm.height() + 6 + 2 * (fm.height() + 4) + fm.height()


class CardGrid(QListWidget):
    """Discover's models as a grid of cards, as many columns as the width holds at MIN_WIDTH each (two at the
    smallest window, four or more on a wide one); the cards share the width, so none is ever cut."""

    MIN_WIDTH = 250

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setObjectName("cards")
        self.setViewMode(QListWidget.ViewMode.IconMode)
        self.setMovement(QListWidget.Movement.Static)
        self.setResizeMode(QListWidget.ResizeMode.Adjust)
        self.setFlow(QListWidget.Flow.LeftToRight)
        self.setWrapping(True)
        self.setUniformItemSizes(True)
        self.setSpacing(0)
        self.setMouseTracking(True)  # the hovered card's border
        self.setSelectionMode(QAbstractItemView.SelectionMode.SingleSelection)
        self.setHorizontalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAlwaysOff)
        self.setVerticalScrollMode(QAbstractItemView.ScrollMode.ScrollPerPixel)
        self.delegate = CardDelegate(self)
        self.setItemDelegate(self.delegate)
        self.setMinimumWidth(self.MIN_WIDTH + 2 * self.frameWidth() + 16)
        self._relayout()

    def title_font(self) -> QFont:
        font = QFont(self.font())
        font.setBold(True)
        font.setPointSizeF(font.pointSizeF() * 1.1)
        return font

    def title_metrics(self) -> QFontMetrics:
        return QFontMetrics(self.title_font())

    def room(self) -> int:
        """The width the view lays its cells out in. QListView wraps a row at the viewport's largest width less a
        vertical scroll bar's, whether or not one shows (cells sized to the viewport itself left a row one column
        short at 1920×1080: 3 × 319 px did not fit in 960 − 15)."""
        bar = self.style().pixelMetric(QStyle.PixelMetric.PM_ScrollBarExtent, None, self.verticalScrollBar())
        return max(0, self.maximumViewportSize().width() - bar - 1)

    def columns(self) -> int:
        return max(1, self.room() // self.MIN_WIDTH)

    def _relayout(self) -> None:
        room = self.room()
        width = max(self.MIN_WIDTH, room // self.columns()) if room else 300
        size = QSize(width, self.delegate.card_height())
        if size != self.gridSize():
            self.setGridSize(size)

    def resizeEvent(self, event: QResizeEvent) -> None:  # Qt's name
        super().resizeEvent(event)
        self._relayout()

    def card_problems(self) -> list[str]:
        """What layout_check reports: a card narrower than it was designed for, one reaching past the view's right
        edge (cut), rows that wrap before the columns the width holds (a gap down the right side)."""
        problems = []
        right = self.viewport().width()
        top = self.visualItemRect(self.item(0)).top() if self.count() else 0
        first_row = sum(1 for r in range(self.count()) if self.visualItemRect(self.item(r)).top() == top)
        if 0 < first_row < min(self.count(), self.columns()):
            problems.append(f"the cards wrap after {first_row} columns where {self.columns()} fit")
        for row in range(self.count()):
            r = self.visualItemRect(self.item(row))
            if r.width() < self.MIN_WIDTH - 1:
                problems.append(f"card '{self.item(row).data(TITLE_ROLE)}' is {r.width()} px wide (< {self.MIN_WIDTH})")
            elif r.right() > right + 1 and r.left() < right:
                problems.append(f"card '{self.item(row).data(TITLE_ROLE)}' is cut at the right ({r.right()} > {right})")
            cut = [t for t in self.delegate.elided(self.item(row), r.width()) if t]
            if cut:
                problems.append(f"card '{self.item(row).data(TITLE_ROLE)}' cuts its estimate: {' / '.join(cut)}")
        return problems


def human_eta(seconds: float | None) -> str:
    if seconds is None:
        return ""
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 5400:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


class DownloadsTable(QTableWidget):
    """Downloads and model jobs, one row each; a finished one leaves (the controller removes it), a failed or
    cancelled one stays until Forget."""

    pause_requested = Signal(str)
    resume_requested = Signal(str)
    cancel_requested = Signal(str)
    forget_requested = Signal(str)

    COLUMNS = ("File", "Progress", "Speed", "ETA", "State", "")
    rows_changed = Signal(int)  # the number of rows, after one came or went

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(0, len(self.COLUMNS), parent)
        self.setHorizontalHeaderLabels(self.COLUMNS)
        header = self.horizontalHeader()
        header.setSectionResizeMode(0, QHeaderView.ResizeMode.Stretch)
        # Every other column has a fixed width worked out once from its widest content (the buttons, "1.23 GB /
        # 45.67 GB", "123.4 MB/s"), so a row's changing text never re-lays out the table, nor the window: a
        # column sized to its contents grew with each update and took the window with it ("Pause/esum/ance").
        sample = self._buttons("")
        fm = self.fontMetrics()
        widths = {
            1: fm.horizontalAdvance("999.9 GB / 999.9 GB") + 24,
            2: fm.horizontalAdvance("999.9 MB/s") + 16,
            3: fm.horizontalAdvance("99 min") + 16,
            4: fm.horizontalAdvance("downloading…") + 24,
            5: sample.sizeHint().width() + 8,
        }
        sample.deleteLater()
        for col, width in widths.items():
            header.setSectionResizeMode(col, QHeaderView.ResizeMode.Fixed)
            self.setColumnWidth(col, width)
        header.setMinimumSectionSize(40)
        self.setSizeAdjustPolicy(QTableWidget.SizeAdjustPolicy.AdjustIgnored)
        self.setHorizontalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAsNeeded)
        self.setWordWrap(False)
        self.verticalHeader().setVisible(False)
        self.verticalHeader().setDefaultSectionSize(sample.sizeHint().height() + 6)
        self._rows: dict[str, int] = {}

    def update_item(
        self,
        item_id: str,
        name: str,
        state: str,
        done: int,
        total: int | None,
        speed_bps: float,
        eta_s: float | None,
        message: str,
    ) -> None:
        row = self._rows.get(item_id)
        if row is None:
            row = self.rowCount()
            self.insertRow(row)
            self._rows[item_id] = row
            self.setItem(row, 0, QTableWidgetItem(name))
            bar = QProgressBar()
            bar.setRange(0, 1000)
            self.setCellWidget(row, 1, bar)
            for col in (2, 3, 4):
                self.setItem(row, col, QTableWidgetItem(""))
            self.setCellWidget(row, 5, self._buttons(item_id))
            self.rows_changed.emit(self.rowCount())
        progress = self.cellWidget(row, 1)
        assert isinstance(progress, QProgressBar)
        progress.setValue(int(1000 * done / total) if total else 0)
        progress.setFormat(f"{human_bytes(done)} / {human_bytes(total)}")
        self._set(row, 2, f"{human_bytes(speed_bps)}/s" if state == "downloading" else "")
        self._set(row, 3, human_eta(eta_s) if state == "downloading" else "")
        self._set(row, 4, message or state)
        state_item = self.item(row, 4)
        if state_item is not None:
            state_item.setToolTip(message or state)  # a long reason is whole in its tooltip and the notification
        self._set_buttons(row, state)

    def remove_item(self, item_id: str) -> None:
        row = self._rows.pop(item_id, None)
        if row is None:
            return
        self.removeRow(row)
        self._rows = {key: r - 1 if r > row else r for key, r in self._rows.items()}
        self.rows_changed.emit(self.rowCount())

    def item_ids(self) -> list[str]:
        return sorted(self._rows, key=self._rows.__getitem__)

    def _set(self, row: int, col: int, text: str) -> None:
        item = self.item(row, col)
        if item is not None and item.text() != text:
            item.setText(text)

    def _buttons(self, item_id: str) -> QWidget:
        box = QWidget()
        layout = QHBoxLayout(box)
        layout.setContentsMargins(2, 1, 2, 1)
        layout.setSpacing(3)
        for label, signal in (
            ("Pause", self.pause_requested),
            ("Resume", self.resume_requested),
            ("Cancel", self.cancel_requested),
            ("Forget", self.forget_requested),
        ):
            button = QPushButton(label)
            button.setObjectName(label.lower())
            button.clicked.connect(lambda _=False, s=signal: s.emit(item_id))
            layout.addWidget(button)
        return box

    def _set_buttons(self, row: int, state: str) -> None:
        box = self.cellWidget(row, 5)
        active = state in ("queued", "downloading")
        for name, enabled in (
            ("pause", active),
            ("resume", state in ("paused", "failed")),
            ("cancel", state not in ("done", "cancelled", "failed")),
            ("forget", state in ("done", "cancelled", "failed")),
        ):
            button = box.findChild(QPushButton, name)
            if button is not None:
                button.setEnabled(enabled)


class LibraryPanel(QWidget):
    """The Discover page: curated models and hub search as cards, each with its "will it run here?" badge; the
    chosen one's overview (facts, estimate, quant table), its model card (the repository's README), the quant
    picker and Download; the downloads below."""

    download_requested = Signal(str)  # the entry's key, or the key of the quant chosen in the combo box
    selected = Signal(str)
    use_requested = Signal(str)
    import_requested = Signal()
    autotune_requested = Signal(str)
    search_requested = Signal(str)
    model_card_requested = Signal(str)  # an entry's key: its card tab is open and its README not read yet

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.search = QLineEdit()
        self.search.setPlaceholderText("Search the hub for models (Enter)…")
        self.search.setClearButtonEnabled(True)
        self.search.returnPressed.connect(lambda: self.search_requested.emit(self.search.text().strip()))
        # cleared (its x button too): every model again, not the last search's results
        self.search.textChanged.connect(lambda text: None if text.strip() else self.search_requested.emit(""))
        self.models = CardGrid()
        self.models.currentItemChanged.connect(self._on_current)
        self.details = QTextBrowser()
        self.details.setOpenExternalLinks(False)
        self.model_card = QTextBrowser()
        self.model_card.setOpenExternalLinks(True)
        self.model_card.setPlaceholderText("The repository's README shows here.")
        self.tabs = QTabWidget()
        self.tabs.addTab(self.details, "Overview")
        self.tabs.addTab(self.model_card, "Model card")
        self.tabs.currentChanged.connect(lambda _i: self._want_card())  # read when looked at, not for every card
        self.headline = QLabel("")
        self.headline.setObjectName("pageTitle")
        self.headline.setWordWrap(True)
        self.badge_line = QLabel("")
        self.badge_line.setWordWrap(True)
        self.quant = QComboBox()  # a GGUF repository's quants: the preselected one first
        self.quant.setToolTip("Which quant to download (size, and whether it runs well here)")
        self.quant.setSizeAdjustPolicy(QComboBox.SizeAdjustPolicy.AdjustToMinimumContentsLengthWithIcon)
        self.quant.setMinimumContentsLength(20)
        self.use_button = QPushButton("Chat with this model")
        self.download_button = QPushButton("Download")
        self.download_button.setObjectName("primary")
        self.autotune_button = QPushButton("Autotune…")
        self.import_button = QPushButton("Import GGUF…")
        self.use_button.clicked.connect(lambda: self._emit_current(self.use_requested))
        self.download_button.clicked.connect(self._download)
        self.autotune_button.clicked.connect(lambda: self._emit_current(self.autotune_requested))
        self.import_button.clicked.connect(self.import_requested)
        self.downloads = DownloadsTable()
        self.downloads_title = QLabel("<b>Downloads</b>")
        self._entries: dict[str, LibraryEntry] = {}
        self._cards: dict[str, str] = {}  # entry key -> the model card's markdown, once read
        self._progress: dict[str, str] = {}  # hub repository -> its running job's line, on its card

        left = QWidget()
        left_layout = QVBoxLayout(left)
        left_layout.setContentsMargins(0, 0, 0, 0)
        title = QLabel("Discover")
        title.setObjectName("pageTitle")
        left_layout.addWidget(title)
        left_layout.addWidget(self.search)
        self.search_status = QLabel("")  # what the search found, or that it found nothing
        self.search_status.setObjectName("muted")
        self.search_status.setWordWrap(True)
        self.search_status.setVisible(False)
        left_layout.addWidget(self.search_status)
        left_layout.addWidget(self.models, 1)
        left_layout.addWidget(self.import_button)

        quant_row = QHBoxLayout()  # the quant on its own row: beside the buttons it squeezed the cards' grid
        self.quant_label = QLabel("Quant")
        quant_row.addWidget(self.quant_label)
        quant_row.addWidget(self.quant, 1)
        buttons = QHBoxLayout()
        for b in (self.download_button, self.use_button, self.autotune_button):
            buttons.addWidget(b)
        buttons.addStretch(1)
        right = QWidget()
        right_layout = QVBoxLayout(right)
        right_layout.setContentsMargins(0, 0, 0, 0)
        right_layout.addWidget(self.headline)
        right_layout.addWidget(self.badge_line)
        right_layout.addLayout(quant_row)
        right_layout.addLayout(buttons)
        right_layout.addWidget(self.tabs, 1)

        top = QSplitter(Qt.Orientation.Horizontal)
        top.addWidget(left)
        top.addWidget(right)
        top.setStretchFactor(0, 3)  # a wider window gives the cards more columns, and the overview some room
        top.setStretchFactor(1, 2)
        top.setChildrenCollapsible(False)
        top.setSizes([600, 460])
        bottom = self.downloads_box = QWidget()
        bottom_layout = QVBoxLayout(bottom)
        bottom_layout.setContentsMargins(0, 0, 0, 0)
        bottom_layout.addWidget(self.downloads_title)
        bottom_layout.addWidget(self.downloads)
        splitter = QSplitter(Qt.Orientation.Vertical)
        splitter.addWidget(top)
        splitter.addWidget(bottom)
        splitter.setStretchFactor(0, 1)
        splitter.setSizes([600, 160])
        layout = QVBoxLayout(self)
        layout.setContentsMargins(20, 16, 20, 12)
        layout.addWidget(splitter)
        # the downloads show while there are any: an empty table took a fifth of the page for nothing
        self.downloads.rows_changed.connect(lambda n: bottom.setVisible(n > 0))
        bottom.setVisible(False)
        self._update_buttons(None)

    def set_entries(self, entries: list[LibraryEntry], current: str | None = None) -> None:
        keep = current or self.current_key()
        self._entries = {e.key: e for e in entries}
        self.models.blockSignals(True)
        self.models.clear()
        for e in entries:
            item = QListWidgetItem(e.title)
            item.setData(Qt.ItemDataRole.UserRole, e.key)
            item.setData(TITLE_ROLE, e.title)
            # the card shows the estimate's basis on a line of its own (the whole line did not fit a 250-px card)
            item.setData(LINE_ROLE, (e.line.removesuffix(f" · {e.basis}") if e.basis else e.line) or e.badge)
            item.setData(BASIS_ROLE, e.basis)
            item.setData(COLOUR_ROLE, e.colour)
            item.setData(SOURCE_ROLE, self._progress.get(e.card_repo or "", e.badge))
            item.setToolTip(f"{e.title}: {e.line or e.badge} · {e.badge}")
            self.models.addItem(item)
            if e.key == keep:
                self.models.setCurrentItem(item)
        self.models.blockSignals(False)
        self._show(keep)

    def set_search_line(self, text: str) -> None:
        self.search_status.setText(text)
        self.search_status.setVisible(bool(text))

    def current_key(self) -> str | None:
        item = self.models.currentItem()
        return None if item is None else str(item.data(Qt.ItemDataRole.UserRole))

    def select(self, key: str) -> None:
        for row in range(self.models.count()):
            if self.models.item(row).data(Qt.ItemDataRole.UserRole) == key:
                self.models.setCurrentRow(row)
                return

    def set_progress(self, repo: str, line: str | None) -> None:
        """A running job's line ("Downloading · 45 %") on the cards of the repository it gets, in place of where
        the card's model comes from; None puts that back. With the job's notification, the one home of its
        progress: the page's own task row and the downloads table said the same thing again."""
        if line is None:
            self._progress.pop(repo, None)
        else:
            self._progress[repo] = line
        for row in range(self.models.count()):
            item = self.models.item(row)
            entry = self._entries.get(str(item.data(Qt.ItemDataRole.UserRole)))
            if entry is not None and entry.card_repo == repo:
                item.setData(SOURCE_ROLE, line if line is not None else entry.badge)
        self._update_buttons(self._entries.get(self.current_key() or ""))

    def card_line(self, key: str) -> str:
        """The last line of a card as drawn (where its model comes from, or its job's progress)."""
        for row in range(self.models.count()):
            item = self.models.item(row)
            if item.data(Qt.ItemDataRole.UserRole) == key:
                return str(item.data(SOURCE_ROLE))
        return ""

    def _on_current(self, item: QListWidgetItem | None, _previous: QListWidgetItem | None = None) -> None:
        self._show(None if item is None else str(item.data(Qt.ItemDataRole.UserRole)))

    def _show(self, key: str | None) -> None:
        entry = self._entries.get(key or "")
        self.details.setHtml(entry.details_html if entry else "<p>Pick a model.</p>")
        self.headline.setText(entry.title if entry else "Pick a model")
        self.badge_line.setText(
            f"<span style='color:{BADGE_RGB.get(entry.colour, BADGE_RGB['grey'])}'>●</span> {entry.line or entry.badge}"
            if entry
            else ""
        )
        card = self._cards.get(key or "")
        if card is not None:
            set_markdown(self.model_card, card)
        else:
            self.model_card.setPlainText("" if entry is None or entry.card_repo is None else "Reading the model card…")
        self.tabs.setTabEnabled(1, bool(entry and entry.card_repo))
        self._want_card()
        self.quant.clear()
        if entry is not None and entry.choices:
            for choice_key, label in entry.choices:
                self.quant.addItem(label, choice_key)
            index = self.quant.findData(entry.choice) if entry.choice else 0
            self.quant.setCurrentIndex(max(0, index))
        self.quant.setVisible(bool(entry and entry.choices))
        self.quant_label.setVisible(self.quant.isVisibleTo(self))
        self._update_buttons(entry)
        if key:
            self.selected.emit(key)

    def _want_card(self) -> None:
        key = self.current_key()
        entry = self._entries.get(key or "")
        if key and entry is not None and entry.card_repo and self.tabs.currentIndex() == 1 and key not in self._cards:
            self.model_card_requested.emit(key)

    def set_model_card(self, key: str, markdown: str) -> None:
        """The repository's README (or why there is none) for an entry; shown now if it is the current one."""
        self._cards[key] = markdown
        if self.current_key() == key:
            set_markdown(self.model_card, markdown)

    def _download(self) -> None:
        key = self.current_key()
        if key is None:
            return
        entry = self._entries.get(key)
        chosen = self.quant.currentData() if entry is not None and entry.choices else None
        self.download_requested.emit(str(chosen) if chosen else key)

    def _update_buttons(self, entry: LibraryEntry | None) -> None:
        self.use_button.setEnabled(bool(entry and entry.can_use))
        self.autotune_button.setEnabled(bool(entry and entry.can_use))
        # not while a job gets this repository: its progress is on the card and in its notification
        busy = entry is not None and entry.card_repo is not None and entry.card_repo in self._progress
        self.download_button.setEnabled(bool(entry and entry.can_download) and not busy)
        self.download_button.setToolTip("Downloading: see its notification above" if busy else "")

    def _emit_current(self, signal: SignalInstance) -> None:
        key = self.current_key()
        if key is not None:
            signal.emit(key)
