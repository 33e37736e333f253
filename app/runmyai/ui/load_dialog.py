"""The load dialog (LM Studio's): a model's context length and GPU offload, chosen before it loads and kept for
it. Thin: the controller asks the engine what fits (engine/load_options.py) and loads; this draws and emits."""

from __future__ import annotations

from PySide6.QtCore import Signal
from PySide6.QtWidgets import (
    QComboBox,
    QDialog,
    QDialogButtonBox,
    QFormLayout,
    QLabel,
    QLineEdit,
    QSpinBox,
    QVBoxLayout,
    QWidget,
)

from runmyai.engine.load_options import MIN_CONTEXT, LoadFacts, LoadOptions

MAX_CONTEXT_BOX = 1 << 21  # the box's ceiling while the model's own is not known yet


class LoadDialog(QDialog):
    load_requested = Signal(object)  # LoadOptions

    def __init__(self, name: str, saved: LoadOptions, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setWindowTitle(f"Load {name}")
        self.saved = saved
        self.facts: LoadFacts | None = None
        self.context = QSpinBox()
        self.context.setRange(MIN_CONTEXT, MAX_CONTEXT_BOX)
        self.context.setSingleStep(1024)
        self.context.setSuffix(" tokens")
        self.context.setGroupSeparatorShown(True)
        self.context_note = QLabel("Reading what fits here…")
        self.context_note.setObjectName("muted")
        self.context_note.setWordWrap(True)
        self.device = QComboBox()
        for label, value in (("Automatic (a GPU if there is one)", "auto"), ("CPU only", "cpu"),
                             ("Vulkan GPU", "vulkan"), ("CUDA GPU", "cuda")):  # fmt: skip
            self.device.addItem(label, value)
        self.vram_budget = QLineEdit(saved.vram_budget or "")
        self.vram_budget.setPlaceholderText("the free VRAM less a headroom (or 8G, 80%)")
        self.vram_layers = QSpinBox()
        self.vram_layers.setRange(-1, 4096)
        self.vram_layers.setSpecialValueText("as many as fit")
        self.vram_layers.setValue(saved.vram_layers if saved.vram_layers is not None else -1)
        self.gpu_note = QLabel("")
        self.gpu_note.setObjectName("muted")
        self.gpu_note.setWordWrap(True)
        self.error = QLabel("")
        self.error.setStyleSheet("color: #d0342c;")
        self.error.setWordWrap(True)
        self.error.hide()
        form = QFormLayout()
        form.addRow("Context length", self.context)
        form.addRow("", self.context_note)
        form.addRow("GPU offload", self.device)
        form.addRow("VRAM budget", self.vram_budget)
        form.addRow("Layers in VRAM", self.vram_layers)
        form.addRow("", self.gpu_note)
        self.buttons = QDialogButtonBox(QDialogButtonBox.StandardButton.Cancel)
        self.load_button = self.buttons.addButton("Load", QDialogButtonBox.ButtonRole.AcceptRole)
        self.load_button.setObjectName("primary")
        self.load_button.setEnabled(False)  # until the engine said what fits
        self.buttons.accepted.connect(self._on_load)
        self.buttons.rejected.connect(self.reject)
        note = QLabel("Kept for this model: it loads with these settings from the picker too.")
        note.setObjectName("muted")
        note.setWordWrap(True)
        layout = QVBoxLayout(self)
        layout.addLayout(form)
        layout.addWidget(note)
        layout.addWidget(self.error)
        layout.addWidget(self.buttons)
        self.setMinimumWidth(self.fontMetrics().horizontalAdvance("x") * 70)
        self._set_gpu_enabled(False)

    def set_facts(self, facts: LoadFacts) -> None:
        """What the engine said: the context's default and ceiling, and whether GPU offload is there."""
        self.facts = facts
        ceiling = facts.max_context or MAX_CONTEXT_BOX
        self.context.setMaximum(max(MIN_CONTEXT, ceiling))
        default = facts.default_context or min(ceiling, 4096)
        self.context.setValue(self.saved.context if self.saved.context is not None else default)
        self.context_note.setText(facts.context_note() + (f" Default: {default:,}." if facts.default_context else ""))
        self.gpu_note.setText(facts.gpu_note())
        self._set_gpu_enabled(facts.offload)
        if facts.offload:
            index = self.device.findData(self.saved.device or "auto")
            self.device.setCurrentIndex(max(0, index))
        else:
            self.device.setCurrentIndex(self.device.findData("cpu"))
        self.load_button.setEnabled(True)
        self.adjustSize()  # the notes' wrapped lines: the dialog grows to hold them

    def set_failed(self, line: str) -> None:
        """The engine could not say what fits: the choice can still be made by hand."""
        self.context_note.setText(line)
        self.context.setValue(self.saved.context or 4096)
        self.load_button.setEnabled(True)
        self.adjustSize()

    def show_error(self, line: str) -> None:
        self.error.setText(line)
        self.error.setVisible(bool(line))

    def _set_gpu_enabled(self, on: bool) -> None:
        for w in (self.device, self.vram_budget, self.vram_layers):
            w.setEnabled(on)

    def options(self) -> LoadOptions:
        gpu = self.facts is not None and self.facts.offload
        layers = self.vram_layers.value()
        return LoadOptions(
            context=self.context.value(),
            device=str(self.device.currentData()) if gpu else None,
            vram_budget=self.vram_budget.text().strip() or None if gpu else None,
            vram_layers=layers if gpu and layers >= 0 else None,
        )

    def _on_load(self) -> None:
        self.load_requested.emit(self.options())
