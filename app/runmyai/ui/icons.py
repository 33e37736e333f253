"""The navigation rail's icons, drawn here with QPainter as line art in the theme's colours (no icon pack: each is a
few strokes on a 24-unit grid, like the outline icons LM Studio and Jan use). Drawn per theme and per state
(the selected item's icon in the accent's text colour), at twice the size for high-DPI screens."""

from __future__ import annotations

import math
from collections.abc import Callable

from PySide6.QtCore import QPointF, QRectF, Qt
from PySide6.QtGui import QColor, QIcon, QPainter, QPainterPath, QPen, QPixmap

GRID = 24.0  # every icon is drawn in a 24 × 24 box, then scaled
SIZE = 20  # the rail's icon size in pixels (the pixmaps hold twice that)


def _chat(p: QPainter) -> None:
    """A speech bubble with a tail, and two lines of text in it."""
    path = QPainterPath()
    path.addRoundedRect(QRectF(3, 4, 18, 13), 3.5, 3.5)
    p.drawPath(path)
    tail = QPainterPath(QPointF(8, 17))
    tail.lineTo(QPointF(6.5, 21))
    tail.lineTo(QPointF(12, 17))
    p.drawPath(tail)
    p.drawLine(QPointF(7.5, 9), QPointF(16.5, 9))
    p.drawLine(QPointF(7.5, 12.5), QPointF(13.5, 12.5))


def _discover(p: QPainter) -> None:
    """A compass: a circle with a needle."""
    p.drawEllipse(QPointF(12, 12), 9, 9)
    needle = QPainterPath(QPointF(15.5, 8.5))
    needle.lineTo(QPointF(13.2, 13.2))
    needle.lineTo(QPointF(8.5, 15.5))
    needle.lineTo(QPointF(10.8, 10.8))
    needle.closeSubpath()
    p.drawPath(needle)


def _models(p: QPainter) -> None:
    """A stack of three layers (models on the drive)."""
    top = QPainterPath(QPointF(12, 3.5))
    for x, y in ((21, 8), (12, 12.5), (3, 8)):
        top.lineTo(QPointF(x, y))
    top.closeSubpath()
    p.drawPath(top)
    for dy in (4.5, 9):
        side = QPainterPath(QPointF(3, 8 + dy))
        side.lineTo(QPointF(12, 12.5 + dy))
        side.lineTo(QPointF(21, 8 + dy))
        p.drawPath(side)


def _server(p: QPainter) -> None:
    """Two rack units with their lights."""
    for y in (4.0, 13.0):
        p.drawRoundedRect(QRectF(3.5, y, 17, 7), 2, 2)
        p.drawLine(QPointF(12, y + 3.5), QPointF(17, y + 3.5))
        p.drawPoint(QPointF(7, y + 3.5))


def _settings(p: QPainter) -> None:
    """A gear: eight teeth around a ring, a hole in the middle."""
    teeth = 8
    path = QPainterPath()
    for i in range(teeth * 4):
        angle = 2 * math.pi * (i - 0.5) / (teeth * 4)
        r = 9.5 if i % 4 in (0, 1) else 7.0
        point = QPointF(12 + r * math.cos(angle), 12 + r * math.sin(angle))
        if i == 0:
            path.moveTo(point)
        else:
            path.lineTo(point)
    path.closeSubpath()
    p.drawPath(path)
    p.drawEllipse(QPointF(12, 12), 3, 3)


def _eject(p: QPainter) -> None:
    """Eject: a triangle over a bar (unload the model)."""
    tri = QPainterPath(QPointF(12, 4.5))
    tri.lineTo(QPointF(20, 13.5))
    tri.lineTo(QPointF(4, 13.5))
    tri.closeSubpath()
    p.drawPath(tri)
    p.drawRoundedRect(QRectF(4, 17, 16, 2.5), 1, 1)


def _sliders(p: QPainter) -> None:
    """Three sliders (a model's load options)."""
    for y, x in ((6.0, 15.0), (12.0, 8.0), (18.0, 13.0)):
        p.drawLine(QPointF(3.5, y), QPointF(20.5, y))
        p.drawEllipse(QPointF(x, y), 2.2, 2.2)


DRAWINGS: dict[str, Callable[[QPainter], None]] = {
    "Eject": _eject,
    "Load options": _sliders,
    "Chat": _chat,
    "Discover": _discover,
    "My models": _models,
    "Server": _server,
    "Settings": _settings,
}


def pixmap(name: str, colour: str, size: int = SIZE, ratio: float = 2.0) -> QPixmap:
    """One icon in one colour: 1.8-unit strokes with round ends on a transparent square."""
    pix = QPixmap(round(size * ratio), round(size * ratio))
    pix.setDevicePixelRatio(ratio)
    pix.fill(Qt.GlobalColor.transparent)
    p = QPainter(pix)
    p.setRenderHint(QPainter.RenderHint.Antialiasing)
    p.scale(size / GRID, size / GRID)
    pen = QPen(QColor(colour), 1.8)
    pen.setCapStyle(Qt.PenCapStyle.RoundCap)
    pen.setJoinStyle(Qt.PenJoinStyle.RoundJoin)
    p.setPen(pen)
    p.setBrush(Qt.BrushStyle.NoBrush)
    DRAWINGS[name](p)
    p.end()
    return pix


def icon(name: str, colour: str, selected_colour: str) -> QIcon:
    """The rail's icon for a page: `colour` normally, `selected_colour` on the selected (accent) item."""
    i = QIcon()
    normal = pixmap(name, colour)
    selected = pixmap(name, selected_colour)
    for state in (QIcon.State.Off, QIcon.State.On):
        i.addPixmap(normal, QIcon.Mode.Normal, state)
        i.addPixmap(normal, QIcon.Mode.Active, state)
        i.addPixmap(selected, QIcon.Mode.Selected, state)
    return i
