"""Autotune: what was measured, what was chosen and why, and an advanced user's overrides of any flag."""

from __future__ import annotations

import html
from collections.abc import Mapping

from PySide6.QtCore import Signal
from PySide6.QtWidgets import (
    QDialog,
    QDialogButtonBox,
    QHeaderView,
    QLabel,
    QProgressBar,
    QPushButton,
    QTableWidget,
    QTableWidgetItem,
    QTextBrowser,
    QVBoxLayout,
    QWidget,
)


class AutotuneDialog(QDialog):
    run_requested = Signal()
    cancel_requested = Signal()
    overrides_saved = Signal(dict)

    def __init__(self, model_name: str, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setWindowTitle(f"Autotune — {model_name}")
        self.resize(760, 560)
        self.report = QTextBrowser()
        self.progress = QProgressBar()
        self.progress.setRange(0, 0)
        self.progress.setVisible(False)
        self.progress_label = QLabel("")
        self.run_button = QPushButton("Measure this machine")
        self.run_button.clicked.connect(self.run_requested)
        self.cancel_button = QPushButton("Cancel")
        self.cancel_button.clicked.connect(self.cancel_requested)
        self.cancel_button.setEnabled(False)
        self.overrides = QTableWidget(0, 3)
        self.overrides.setHorizontalHeaderLabels(("Flag", "Chosen", "Override (empty: use chosen)"))
        self.overrides.horizontalHeader().setSectionResizeMode(QHeaderView.ResizeMode.Stretch)
        buttons = QDialogButtonBox(QDialogButtonBox.StandardButton.Save | QDialogButtonBox.StandardButton.Close)
        buttons.accepted.connect(lambda: self.overrides_saved.emit(self.override_values()))
        buttons.rejected.connect(self.reject)
        layout = QVBoxLayout(self)
        layout.addWidget(self.report, 3)
        layout.addWidget(self.progress_label)
        layout.addWidget(self.progress)
        layout.addWidget(self.run_button)
        layout.addWidget(self.cancel_button)
        layout.addWidget(QLabel("Advanced: override any flag"))
        layout.addWidget(self.overrides, 2)
        layout.addWidget(buttons)

    def set_running(self, running: bool, outcome: str = "") -> None:
        """While measuring: the busy bar and Cancel. After: the bar goes and the line says how it ended (it kept
        the last progress line, "measuring decode speed: 32 tokens", for as long as the dialog stayed open)."""
        self.progress.setVisible(running)
        self.run_button.setEnabled(not running)
        self.cancel_button.setEnabled(running)
        if not running:
            self.progress_label.setText(outcome)

    def show_progress(self, line: str) -> None:
        self.progress_label.setText(line)

    def show_result(
        self,
        machine_lines: list[str],
        settings: Mapping[str, object],
        reasons: Mapping[str, str],
        overrides: Mapping[str, str],
    ) -> None:
        rows = "".join(f"<li>{html.escape(line)}</li>" for line in machine_lines)
        chosen = "".join(
            f"<li><b>{html.escape(k)}</b> = {html.escape(str(v))}<br><small>because "
            f"{html.escape(reasons.get(k, ''))}</small></li>"
            for k, v in settings.items()
        )
        self.report.setHtml(f"<h3>Measured</h3><ul>{rows}</ul><h3>Chosen</h3><ul>{chosen}</ul>")
        keys = list(dict.fromkeys([*settings, *overrides]))
        self.overrides.setRowCount(len(keys))
        for row, key in enumerate(keys):
            for col, text in enumerate((key, str(settings.get(key, "")), overrides.get(key, ""))):
                item = QTableWidgetItem(text)
                if col < 2:
                    item.setFlags(item.flags() & ~item.flags().ItemIsEditable)
                self.overrides.setItem(row, col, item)

    def override_values(self) -> dict[str, str]:
        values: dict[str, str] = {}
        for row in range(self.overrides.rowCount()):
            key_item, value_item = self.overrides.item(row, 0), self.overrides.item(row, 2)
            if key_item is not None and value_item is not None and value_item.text().strip():
                values[key_item.text()] = value_item.text().strip()
        return values
