"""Light and dark themes as Qt palettes (every widget, the text browsers' documents and pyqtgraph's plots follow
the palette), on the Fusion style so that they look the same on every desktop; "system" follows the desktop's
colour scheme and changes with it."""

from __future__ import annotations

from dataclasses import dataclass

import pyqtgraph as pg
from PySide6.QtCore import Qt
from PySide6.QtGui import QColor, QGuiApplication, QPalette
from PySide6.QtWidgets import QApplication

from runmyai.ui.viewmodels import Theme


@dataclass(frozen=True)
class Colours:
    window: str
    base: str  # text fields, lists, the transcript
    alt: str  # cards, the navigation rail
    text: str
    muted: str
    border: str
    accent: str
    accent_text: str
    plot_bg: str
    plot_fg: str


LIGHT = Colours(
    window="#f4f5f7",
    base="#ffffff",
    alt="#eceef2",
    text="#1d2129",
    muted="#5f6673",
    border="#d5d9e0",
    accent="#3d6fd8",
    accent_text="#ffffff",
    plot_bg="#ffffff",
    plot_fg="#3a3f48",
)
DARK = Colours(
    window="#1e2025",
    base="#26282e",
    alt="#2d3037",
    text="#e6e8ec",
    muted="#9aa1ad",
    border="#3a3e47",
    accent="#5b8cf0",
    accent_text="#ffffff",
    plot_bg="#26282e",
    plot_fg="#c9ced6",
)


def system_scheme() -> Qt.ColorScheme:
    """The desktop's colour scheme as Qt reads it (Unknown where the platform does not say: light is used)."""
    hints = QGuiApplication.styleHints()
    return hints.colorScheme() if hints is not None else Qt.ColorScheme.Unknown


def system_is_dark() -> bool:
    return system_scheme() == Qt.ColorScheme.Dark


def resolve(theme: Theme) -> Colours:
    if theme == "dark" or (theme == "system" and system_is_dark()):
        return DARK
    return LIGHT


def palette(c: Colours) -> QPalette:
    p = QPalette()
    roles = {
        QPalette.ColorRole.Window: c.window,
        QPalette.ColorRole.WindowText: c.text,
        QPalette.ColorRole.Base: c.base,
        QPalette.ColorRole.AlternateBase: c.alt,
        QPalette.ColorRole.Text: c.text,
        QPalette.ColorRole.Button: c.alt,
        QPalette.ColorRole.ButtonText: c.text,
        QPalette.ColorRole.BrightText: "#ff5555",
        QPalette.ColorRole.Highlight: c.accent,
        QPalette.ColorRole.HighlightedText: c.accent_text,
        QPalette.ColorRole.ToolTipBase: c.base,
        QPalette.ColorRole.ToolTipText: c.text,
        QPalette.ColorRole.PlaceholderText: c.muted,
        QPalette.ColorRole.Link: c.accent,
        QPalette.ColorRole.LinkVisited: c.accent,
        QPalette.ColorRole.Mid: c.border,
        QPalette.ColorRole.Midlight: c.alt,
        QPalette.ColorRole.Dark: c.border,
        QPalette.ColorRole.Light: c.base,
        QPalette.ColorRole.Shadow: "#000000",
    }
    for role, colour in roles.items():
        p.setColor(role, QColor(colour))
    for role in (QPalette.ColorRole.Text, QPalette.ColorRole.WindowText, QPalette.ColorRole.ButtonText):
        p.setColor(QPalette.ColorGroup.Disabled, role, QColor(c.muted))
    return p


def stylesheet(c: Colours) -> str:
    """Only what a palette cannot say: the rail, cards, rounded fields, the primary button."""
    return f"""
    QWidget#side {{ background: {c.alt}; border-right: 1px solid {c.border}; }}
    QListWidget#rail {{ background: {c.alt}; border: none; border-radius: 0; padding-top: 8px; outline: none; }}
    QGroupBox#conversationSettings[folded="true"] {{ border: none; }}
    QListWidget#rail::item {{ padding: 10px 14px; margin: 2px 8px; border-radius: 8px; color: {c.text}; }}
    QListWidget#rail::item:selected {{ background: {c.accent}; color: {c.accent_text}; }}
    QListWidget#rail::item:hover:!selected {{ background: {c.border}; }}
    QLabel#brand {{ font-size: 15px; font-weight: 600; padding: 14px 16px 6px 16px; }}
    QLabel#pageTitle {{ font-size: 20px; font-weight: 600; }}
    QLabel#muted, QLabel#footer {{ color: {c.muted}; }}
    QFrame#card, QFrame#notice {{ background: {c.base}; border: 1px solid {c.border}; border-radius: 10px; }}
    QFrame#notice[kind="error"] {{ border-left: 4px solid #d0453a; }}
    QFrame#notice[kind="job"] {{ border-left: 4px solid {c.accent}; }}
    QFrame#notice[kind="info"] {{ border-left: 4px solid #2e9e5b; }}
    QListWidget, QTableWidget, QTextBrowser, QPlainTextEdit, QLineEdit {{ border: 1px solid {c.border};
        border-radius: 8px; background: {c.base}; }}
    QListWidget#cards::item, QListWidget#conversations::item {{ padding: 8px; border-radius: 6px; }}
    QListWidget#cards::item:selected, QListWidget#conversations::item:selected {{ background: {c.accent};
        color: {c.accent_text}; }}
    QLineEdit {{ padding: 5px 8px; }}
    QPushButton {{ padding: 5px 12px; border: 1px solid {c.border}; border-radius: 6px; background: {c.alt}; }}
    QPushButton:hover {{ border-color: {c.accent}; }}
    QPushButton:disabled {{ color: {c.muted}; }}
    QPushButton#primary {{ background: {c.accent}; color: {c.accent_text}; border-color: {c.accent}; }}
    QPushButton#primary:disabled {{ background: {c.border}; color: {c.muted}; border-color: {c.border}; }}
    QComboBox {{ padding: 4px 8px; }}
    QDockWidget::title {{ padding: 6px; background: {c.alt}; }}
    QHeaderView::section {{ background: {c.alt}; border: none; border-bottom: 1px solid {c.border}; padding: 4px; }}
    """


def apply(app: QApplication, theme: Theme) -> Colours:
    """Sets the palette, the style sheet and pyqtgraph's defaults; returns the colours (the graphs redraw in
    them)."""
    c = resolve(theme)
    app.setStyle("Fusion")
    app.setPalette(palette(c))
    app.setStyleSheet(stylesheet(c))
    pg.setConfigOptions(background=c.plot_bg, foreground=c.plot_fg)
    return c
