"""Draws the app icon, resources/icons/runmyai.png (256 px), with Qt offscreen. Rerun only to change the icon:

QT_QPA_PLATFORM=offscreen python resources/icons/make_icon.py
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from PySide6.QtCore import QPointF, QRectF, Qt
from PySide6.QtGui import QBrush, QColor, QFont, QGuiApplication, QImage, QLinearGradient, QPainter, QPen

SIZE = 256
OUT = Path(__file__).resolve().parent / "runmyai.png"


def draw(size: int = SIZE) -> QImage:
    img = QImage(size, size, QImage.Format.Format_ARGB32)
    img.fill(Qt.GlobalColor.transparent)
    p = QPainter(img)
    p.setRenderHint(QPainter.RenderHint.Antialiasing)
    s = size / 256
    # a rounded square with a blue-violet gradient
    grad = QLinearGradient(QPointF(0, 0), QPointF(size, size))
    grad.setColorAt(0, QColor("#3b82f6"))
    grad.setColorAt(1, QColor("#7c3aed"))
    p.setPen(Qt.PenStyle.NoPen)
    p.setBrush(QBrush(grad))
    p.drawRoundedRect(QRectF(8 * s, 8 * s, 240 * s, 240 * s), 48 * s, 48 * s)
    # a chat bubble
    p.setBrush(QColor(255, 255, 255, 235))
    p.drawRoundedRect(QRectF(44 * s, 56 * s, 168 * s, 116 * s), 30 * s, 30 * s)
    tail = [QPointF(84 * s, 166 * s), QPointF(70 * s, 206 * s), QPointF(120 * s, 168 * s)]
    p.drawPolygon(tail)
    # "AI" in the bubble
    font = QFont("DejaVu Sans")
    font.setPixelSize(int(72 * s))
    font.setBold(True)
    p.setFont(font)
    p.setPen(QPen(QColor("#4f46e5")))
    p.drawText(QRectF(44 * s, 56 * s, 168 * s, 116 * s), Qt.AlignmentFlag.AlignCenter, "AI")
    p.end()
    return img


def main() -> int:
    os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")
    app = QGuiApplication.instance() or QGuiApplication(sys.argv[:1])
    ok = draw().save(str(OUT))  # PNG, from the suffix
    del app
    print(OUT if ok else "could not save the icon", file=sys.stdout if ok else sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
