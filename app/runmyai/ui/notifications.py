"""The notification area: errors and long jobs as cards over the pages' top right corner, each whole sentences
(wrapped, never cut), with Retry, Details and Forget. It draws `viewmodels.Notifications`; the controller decides
what goes in. It floats over the pages (`place`), so a card coming or going moves nothing under the pointer: in
the window's layout, each one pushed the whole page down and back, and clicks landed on the wrong thing."""

from __future__ import annotations

import re

from PySide6.QtCore import QEvent, Qt, Signal
from PySide6.QtWidgets import QFrame, QHBoxLayout, QLabel, QProgressBar, QPushButton, QSizePolicy, QVBoxLayout, QWidget

from runmyai.ui.viewmodels import Notice, Notifications

MAX_SHOWN = 3  # the newest; older ones wait behind them (a flood of failures must not cover the page)
OVERLAY_WIDTH = 520  # px: a card's most; less in a narrow window
OVERLAY_MARGIN = 12  # px from the pages' right edge
OVERLAY_TOP = 52  # px: below the pages' first row (the chat's model picker, Discover's search), which stays usable


class NoticeCard(QFrame):
    def __init__(self, notice: Notice, area: NotificationArea) -> None:
        super().__init__()
        self.notice = notice
        self.setObjectName("notice")
        self.setProperty("kind", notice.kind)
        self.title = QLabel(f"<b>{_escape(notice.title)}</b>")
        self.reason = QLabel(breakable(job_line(notice)))
        for label in (self.title, self.reason):
            label.setWordWrap(True)
            label.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        self.details = QLabel(breakable(notice.details))
        self.details.setWordWrap(True)
        self.details.setObjectName("muted")
        self.details.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        self.details.setVisible(False)
        self.retry = QPushButton(notice.action or "Retry")
        self.retry.setObjectName("primary" if notice.kind == "offer" else "retry")
        self.details_button = QPushButton("Details")
        self.details_button.setObjectName("details")
        self.forget = QPushButton({"error": "Forget", "offer": "Not now"}.get(notice.kind, "Hide"))
        self.forget.setObjectName("forget")
        self.cancel = QPushButton("Cancel")
        self.cancel.setObjectName("cancel")
        self.cancel.setVisible(notice.kind == "job" and notice.cancellable)
        self.cancel.clicked.connect(lambda: area.cancel_requested.emit(notice.key))
        self.retry.setVisible(notice.retry)
        self.details_button.setVisible(bool(notice.details))
        self.retry.clicked.connect(lambda: area.retry_requested.emit(notice.key))
        self.forget.clicked.connect(lambda: area.forget_requested.emit(notice.key))
        self.details_button.clicked.connect(self._toggle_details)
        text = QVBoxLayout()
        text.setSpacing(2)
        text.addWidget(self.title)
        text.addWidget(self.reason)
        self.bar = QProgressBar()
        self.bar.setTextVisible(False)
        self.bar.setFixedHeight(6)
        self.bar.setVisible(notice.kind == "job")
        self._show_progress(notice.progress)
        text.addWidget(self.bar)
        text.addWidget(self.details)
        buttons = QHBoxLayout()
        buttons.setSpacing(6)
        for b in (self.retry, self.details_button, self.cancel, self.forget):
            buttons.addWidget(b, 0, Qt.AlignmentFlag.AlignTop)
        row = QHBoxLayout(self)
        row.setContentsMargins(12, 8, 8, 8)
        row.addLayout(text, 1)
        row.addLayout(buttons)
        self.setSizePolicy(QSizePolicy.Policy.Preferred, QSizePolicy.Policy.Maximum)

    def _show_progress(self, progress: float | None) -> None:
        if progress is None:
            self.bar.setRange(0, 0)  # busy
        else:
            self.bar.setRange(0, 1000)
            self.bar.setValue(int(1000 * max(0.0, min(1.0, progress))))

    def follows(self, notice: Notice) -> bool:
        """Whether this card can show `notice` by changing its text and bar: the same job, its progress moved."""
        old = self.notice
        return (old.key, old.kind, old.title, old.cancellable) == (notice.key, "job", notice.title, notice.cancellable)

    def show_job(self, notice: Notice) -> None:
        """A job's new progress, in place: rebuilding the card at every update (a download's, several a second)
        redrew the area, and a Cancel click could land between two cards."""
        self.notice = notice
        self.reason.setText(breakable(job_line(notice)))
        self._show_progress(notice.progress)

    def _toggle_details(self) -> None:
        self.details.setVisible(not self.details.isVisible())
        self.details_button.setText("Hide details" if self.details.isVisible() else "Details")


class NotificationArea(QWidget):
    retry_requested = Signal(str)
    forget_requested = Signal(str)
    cancel_requested = Signal(str)  # a long job's key

    def __init__(self, model: Notifications, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.model = model
        self._layout = QVBoxLayout(self)
        self._layout.setContentsMargins(0, 0, 0, 0)
        self._layout.setSpacing(6)
        self.cards: list[NoticeCard] = []
        self.more = QLabel("")
        self.more.setObjectName("muted")
        self.more.setAutoFillBackground(True)  # over the page's own text
        self.more.setContentsMargins(8, 2, 8, 2)
        self.refresh()

    def event(self, e: QEvent) -> bool:  # Qt's name
        handled = super().event(e)
        if e.type() == QEvent.Type.LayoutRequest:  # a card grew or shrank (its details, a job's line)
            self.place()
        return handled

    def place(self) -> None:
        """Over the parent's (the pages') top right corner, as tall as the cards need; called when they change and
        when the parent is resized."""
        host = self.parentWidget()
        if host is None:
            return
        width = max(0, min(OVERLAY_WIDTH, host.width() - 2 * OVERLAY_MARGIN))
        height = self.heightForWidth(width)
        if height < 0:
            height = self.sizeHint().height()
        height = max(0, min(height, host.height() - OVERLAY_TOP - OVERLAY_MARGIN))
        self.setGeometry(host.width() - width - OVERLAY_MARGIN, OVERLAY_TOP, width, height)
        self.raise_()

    def refresh(self) -> None:
        """Redraws from the model; a card whose notice did not change keeps its widget (and its open details)."""
        shown = self.model.items()[-MAX_SHOWN:]
        old = {c.notice.key: c for c in self.cards}
        cards: list[NoticeCard] = []
        for notice in shown:
            card = old.pop(notice.key, None)
            if card is not None and card.notice != notice and card.follows(notice):
                card.show_job(notice)
            elif card is None or card.notice != notice:
                if card is not None:
                    card.deleteLater()
                card = NoticeCard(notice, self)
            cards.append(card)
        for card in old.values():
            card.setParent(None)
            card.deleteLater()
        while self._layout.count():
            self._layout.takeAt(0)
        for card in cards:
            self._layout.addWidget(card)
        hidden = len(self.model.items()) - len(shown)
        self.more.setText(f"and {hidden} more (Forget one to see the next)" if hidden else "")
        self._layout.addWidget(self.more)
        self.more.setVisible(bool(hidden))
        self.cards = cards
        self.setVisible(bool(cards))
        self.place()

    def texts(self) -> list[str]:
        """Each card's title and reason as shown (tests, and the self-test's report)."""
        return [f"{c.notice.title}: {c.notice.reason}" for c in self.cards]


def job_line(notice: Notice) -> str:
    """A job's line: what it is doing and how far it is ("Downloading · 45 %"); other notices' reason as is."""
    if notice.kind != "job" or notice.progress is None:
        return notice.reason
    share = f"{100 * max(0.0, min(1.0, notice.progress)):.0f} %"
    return f"{notice.reason} · {share}" if notice.reason else share


ZWSP = "\u200b"
LONG_WORD = 24  # characters: a longer word gets places to wrap (a path, a repository's name, a checksum)


def breakable(text: str) -> str:
    """`text` with zero-width spaces where a long word may wrap: after each / \\ _ - . and every LONG_WORD
    characters without one. A label wraps only at spaces, so a path in an error ("Couldn't import
    /tmp/…/garbage.gguf") was wider than the card at 1280×800 and its end was cut."""

    def split(word: str) -> str:
        if len(word) <= LONG_WORD:
            return word
        out, run = [], 0
        for ch in word:
            out.append(ch)
            run += 1
            if ch in "/\\_-." or run >= LONG_WORD:
                out.append(ZWSP)
                run = 0
        return "".join(out).rstrip(ZWSP)

    return re.sub(r"\S+", lambda m: split(m.group(0)), text)


def _escape(text: str) -> str:
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
