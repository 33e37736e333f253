"""Finds what a user could not read on screen: a label's or a button's text wider (or, wrapped, taller) than the
room it was given, and a live chart whose axes do not hold every layer. The screenshot tests and
`runmyai --self-test --screenshots DIR` run it on every page, at every size, in both themes."""

from __future__ import annotations

import re
from collections.abc import Iterator

from PySide6.QtCore import QRect
from PySide6.QtGui import QTextDocument
from PySide6.QtWidgets import (
    QAbstractButton,
    QAbstractScrollArea,
    QAbstractSpinBox,
    QCheckBox,
    QComboBox,
    QLabel,
    QLineEdit,
    QPushButton,
    QRadioButton,
    QWidget,
)

from runmyai.ui.chat_panel import ElidedLabel
from runmyai.ui.graphs import GraphsPanel
from runmyai.ui.library_panel import CardGrid

ZWSP = "\u200b"  # where a long word (a path) may wrap: notifications.breakable
SLACK_PX = 1  # rounding between a font's advance and the pixels it is given


def _visible_widgets(root: QWidget) -> Iterator[QWidget]:
    for w in root.findChildren(QWidget):
        if w.isVisibleTo(root) and w.isVisible() and w.width() > 0 and not _scrolled_out(w):
            yield w


def _scrolled_out(w: QWidget) -> bool:
    """Inside a scroll area's viewport and outside what it shows: scrolled to, not clipped."""
    p = w.parentWidget()
    while p is not None:
        if isinstance(p, QAbstractScrollArea) and p.viewport().isAncestorOf(w):
            viewport = p.viewport()
            top_left = w.mapTo(viewport, w.rect().topLeft())
            return not viewport.rect().intersects(QRect(top_left, w.size()))
        p = p.parentWidget()
    return False


def _plain(label: QLabel, keep_breaks: bool = False) -> str:
    """The label's text as read (its markup gone; without `keep_breaks`, without the zero-width spaces that
    notifications.breakable puts where a long word may wrap)."""
    text = label.text()
    if label.textFormat().name != "PlainText" and ("<" in text and ">" in text):
        doc = QTextDocument()
        doc.setHtml(text)
        text = doc.toPlainText()
    return text if keep_breaks else text.replace(ZWSP, "")


def label_problem(label: QLabel) -> str | None:
    text = _plain(label)
    if not text.strip() or isinstance(label, ElidedLabel):  # an elided label shows "…" and its tooltip, by design
        return None
    room = label.contentsRect().width() - 2 * label.margin() - (label.indent() if label.indent() > 0 else 0)
    fm = label.fontMetrics()
    if label.wordWrap():
        need = label.heightForWidth(label.width())
        if need > label.height() + SLACK_PX:
            return f"wrapped text needs {need} px of height, has {label.height()}"
        words = re.split(rf"[\s{ZWSP}]+", _plain(label, keep_breaks=True))  # a zero-width space may wrap too
        longest = max((fm.horizontalAdvance(word) for word in words), default=0)
        if longest > room + SLACK_PX:
            return f"a word needs {longest} px, has {room}"
        return None
    need = max(fm.horizontalAdvance(line) for line in text.split("\n"))
    if label.textFormat().name != "PlainText" and "<" in label.text():
        need = label.sizeHint().width() - 2 * label.margin()
    if need > room + SLACK_PX:
        return f"needs {need} px, has {room}"
    lines = text.count("\n") + 1
    if fm.height() * lines > label.contentsRect().height() + SLACK_PX:
        return f"needs {fm.height() * lines} px of height, has {label.contentsRect().height()}"
    return None


def button_problem(button: QAbstractButton) -> str | None:
    """A push button, check box or radio button narrower than its size hint (its text, icon, the style's and the
    style sheet's padding): layouts never give one less unless the room runs out, and then its text is cut."""
    if not button.text() or not isinstance(button, (QPushButton, QCheckBox, QRadioButton)):
        return None
    need = button.sizeHint().width()
    if need > button.width() + SLACK_PX:
        return f"needs {need} px, has {button.width()}"
    return None


def line_edit_problem(edit: QLineEdit) -> str | None:
    """A text field lower than its text needs (the rename editor was a few pixels tall), or one whose text is
    wider than the field (the Connect dialog cut the address). A spin box's or combo box's own field is theirs
    to size; a password is never read; text the user typed past the end scrolls, as any field's does, so only a
    field whose text the app put there is held to its width (`setProperty("whole", True)`)."""
    if isinstance(edit.parentWidget(), (QAbstractSpinBox, QComboBox)):
        return None
    need_h = edit.sizeHint().height()
    if need_h > edit.height() + SLACK_PX:
        return f"needs {need_h} px of height, has {edit.height()}"
    if edit.property("whole") and edit.text() and edit.echoMode() == QLineEdit.EchoMode.Normal:
        fm = edit.fontMetrics()
        chrome = edit.sizeHint().width() - 17 * fm.horizontalAdvance("x")  # Qt's hint: 17 x's and the frame
        need = fm.horizontalAdvance(edit.text()) + chrome
        if need > edit.width() + SLACK_PX:
            return f"its text needs {need} px, has {edit.width()}"
    return None


def outside_parent(w: QWidget) -> str | None:
    """A widget that reaches out of its parent is cut by it (a row of buttons in a table cell narrower than the
    row: each button keeps its width, the cell cuts the last ones — "Pause/esum/ance")."""
    parent = w.parentWidget()
    if parent is None or isinstance(parent, QAbstractScrollArea) or w.isWindow():
        return None
    g = w.geometry()
    inside = parent.rect()
    if g.right() > inside.right() + SLACK_PX or g.bottom() > inside.bottom() + SLACK_PX or g.left() < -SLACK_PX:
        return f"reaches out of its parent ({g.x()}+{g.width()} > {inside.width()})"
    return None


def clipped(root: QWidget) -> list[str]:
    """Every visible label and button of `root` whose text does not fit, as 'Class 'text': why'."""
    problems = []
    for w in _visible_widgets(root):
        problem = None
        text = ""
        if isinstance(w, QLabel):
            problem = label_problem(w)
            text = _plain(w)
        elif isinstance(w, QAbstractButton):
            problem = button_problem(w)
            text = w.text()
        elif isinstance(w, QLineEdit):
            problem = line_edit_problem(w)
            text = w.text() or w.placeholderText() or w.objectName() or "(a text field)"
        if problem is None and isinstance(w, (QLabel, QAbstractButton, QLineEdit)) and text.strip():
            problem = outside_parent(w)
        if problem is not None:
            short = " ".join(text.split())
            problems.append(f"{type(w).__name__} '{short[:60]}': {problem}")
        if isinstance(w, CardGrid):  # cards are painted, not widgets: the grid knows their rectangles
            problems += w.card_problems()
    return problems


def chart_problems(root: QWidget) -> list[str]:
    """Each visible performance panel's axes (GraphsPanel.axes_problems), and a chart that its panel's scroll
    area shows only part of: at 1280x800 the third chart was cut off at the window's bottom."""
    problems = []
    for g in root.findChildren(GraphsPanel):
        if g.isVisible():
            problems += g.axes_problems() + g.cut_charts()
    return problems
