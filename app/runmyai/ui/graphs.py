"""Live graphs of the engine's per-token stats: a thin pyqtgraph view over monitor.StatsSeries."""

from __future__ import annotations

import pyqtgraph as pg
from PySide6.QtCore import QPointF, Qt, QTimer
from PySide6.QtWidgets import QHBoxLayout, QLabel, QPushButton, QSizePolicy, QVBoxLayout, QWidget

from runmyai.monitor import StatsSeries, TokenEvent

EXPLANATION = (
    "Only part of the model's experts fit in the memory given to it; each token, the experts its router picks "
    "come from the GPU's memory (VRAM), from RAM, or are read from the drive. Bars: those three shares per layer "
    "for the last token, the line the mean share found in memory; below: the time spent waiting for the drive, "
    "the bytes it read, and the experts moved into and out of VRAM, per token."
)
TIER_COLOURS = {"VRAM": "#8e44ad", "RAM": "#4a90d9", "drive": "#e08e0b"}
REDRAW_MS = 250  # events are batched: a redraw costs ~9 ms, so one per token at 20 tokens/s would cost 18 % of a core


class GraphsPanel(QWidget):
    """Per-layer expert-cache hit rate, SSD wait and bytes read per token, VRAM swaps, prediction recall."""

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.series = StatsSeries()
        self._dirty = False
        self._layer_span: tuple[int, int] | None = None
        pg.setConfigOptions(antialias=False, background="w", foreground="k")

        self.hits_plot = pg.PlotWidget(title="Where each layer's experts came from: VRAM · RAM · drive")
        self.hits_plot.setYRange(0, 1.0, padding=0.02)
        self.hits_plot.setLabel("bottom", "layer")
        # stacked: VRAM at the bottom, RAM above it, the drive on top (each bar sums to 1)
        self.tier_bars = {t: pg.BarGraphItem(x=[], height=[], width=0.8, brush=c) for t, c in TIER_COLOURS.items()}
        self.hits_bars = self.tier_bars["RAM"]
        self.hits_mean = pg.PlotDataItem(pen=pg.mkPen("#d9534f", width=2), name="mean")  # symbols cost 3x the paint
        for bars in self.tier_bars.values():
            self.hits_plot.addItem(bars)
        self.hits_plot.addItem(self.hits_mean)

        self.wait_plot = pg.PlotWidget(title="SSD wait per token (ms)")
        self.wait_line = self.wait_plot.plot(pen=pg.mkPen("#e08e0b", width=1.5))
        self.bytes_plot = pg.PlotWidget(title="Bytes read per token (MiB)")
        self.bytes_line = self.bytes_plot.plot(pen=pg.mkPen("#5cb85c", width=1.5))
        self.vram_plot = pg.PlotWidget(title="VRAM expert swaps per token: in · out")
        self.vram_plot.addLegend(offset=(-4, 4))  # (before the lines: a legend lists the lines added after it)
        self.vram_line = self.vram_plot.plot(pen=pg.mkPen("#8e44ad", width=1.5), name="in")
        # out is dashed: a cache that is still filling takes experts in while none go out, so the two lines part
        self.vram_out_line = self.vram_plot.plot(
            pen=pg.mkPen("#7f8c8d", width=1.5, style=Qt.PenStyle.DashLine), name="out"
        )
        self.vram_plot.setYRange(0, 1, padding=0)  # (zero is drawn as zero: no GPU, or nothing to swap)
        # Fixed x ranges (tokens ago, layers) let the axes keep their cached pictures between redraws; no grid:
        # its alpha-blended lines were 3/4 of the paint time (bench/graphs_bench.py).
        for plot in (self.wait_plot, self.bytes_plot, self.vram_plot):
            plot.setLabel("bottom", "tokens ago")
            plot.setXRange(-self.series.window, 0, padding=0)
        for plot in (self.hits_plot, self.wait_plot, self.bytes_plot, self.vram_plot):
            plot.getAxis("left").setWidth(44)  # a tick label growing a digit must not re-lay out the panel
            plot.setMouseEnabled(x=False, y=False)
            plot.hideButtons()
            plot.setMenuEnabled(False)

        self.explain = QLabel(EXPLANATION)  # what a newcomer is looking at, in one line
        self.explain.setWordWrap(True)
        self.device = QLabel("")  # the engine's line: where it computes (the GPU and its share, or the CPU and why)
        self.device.setWordWrap(True)
        self.device.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        self.summary = QLabel("no tokens yet")
        self.summary.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        self.hover = QLabel("")
        for label in (self.summary, self.hover):  # text changes must not re-lay out the plots
            label.setSizePolicy(QSizePolicy.Policy.Ignored, QSizePolicy.Policy.Fixed)
            label.setFixedHeight(label.fontMetrics().height() + 4)
        self.pause_button = QPushButton("Pause")
        self.pause_button.setCheckable(True)
        self.pause_button.toggled.connect(self.set_paused)
        self.reset_button = QPushButton("Reset")
        self.reset_button.clicked.connect(self.reset)

        buttons = QHBoxLayout()
        buttons.addWidget(self.pause_button)
        buttons.addWidget(self.reset_button)
        buttons.addStretch(1)
        layout = QVBoxLayout(self)
        layout.addLayout(buttons)
        layout.addWidget(self.explain)
        layout.addWidget(self.device)
        layout.addWidget(self.summary)
        for plot in (self.hits_plot, self.wait_plot, self.bytes_plot, self.vram_plot):
            layout.addWidget(plot, 1)
        layout.addWidget(self.hover)

        for plot in (self.hits_plot, self.wait_plot, self.bytes_plot, self.vram_plot):
            plot.scene().sigMouseMoved.connect(lambda pos, p=plot: self._on_hover(p, pos))

        self._timer = QTimer(self)
        self._timer.setInterval(REDRAW_MS)
        self._timer.timeout.connect(self._redraw_if_dirty)
        self._timer.start()

    def add(self, event: TokenEvent) -> None:
        if self.series.add(event):
            self._dirty = True

    def set_device(self, text: str) -> None:
        """The engine's device line (runmyai.monitor.device_note picks it out of the engine's log)."""
        self.device.setText(text)

    def set_paused(self, paused: bool) -> None:
        self.series.paused = paused
        self.pause_button.setText("Resume" if paused else "Pause")

    def reset(self) -> None:
        self.series.reset()
        self._dirty = True
        self._redraw_if_dirty()

    def _redraw_if_dirty(self) -> None:
        if not self._dirty:
            return
        self._dirty = False
        s = self.series
        bottom = [0.0] * len(s.layer_ids)
        for tier, share in (("VRAM", s.last_vram), ("RAM", s.last_ram), ("drive", s.last_drive)):
            self.tier_bars[tier].setOpts(x=s.layer_ids, y0=bottom, height=share, width=0.8)
            bottom = [b + h for b, h in zip(bottom, share, strict=True)]
        self.hits_mean.setData(s.layer_ids, s.mean_hit_rate())
        if s.layer_ids and self._layer_span != (s.layer_ids[0], s.layer_ids[-1]):
            self._layer_span = (s.layer_ids[0], s.layer_ids[-1])
            self.hits_plot.setXRange(s.layer_ids[0] - 0.5, s.layer_ids[-1] + 0.5, padding=0)
        x = [t - s.tokens for t in s.token_index]
        self.wait_line.setData(x, list(s.ssd_wait_ms))
        self.bytes_line.setData(x, [b / 2**20 for b in s.bytes_read])
        self.vram_line.setData(x, list(s.vram_swaps))
        self.vram_out_line.setData(x, list(s.vram_swaps_out))
        if s.vram_swaps:
            self.vram_plot.setYRange(0, max(1.0, max(s.vram_swaps), max(s.vram_swaps_out)), padding=0.05)
        self.summary.setText(self._summary_text())

    def _summary_text(self) -> str:
        s = self.series
        if s.tokens == 0:
            return "no tokens yet"
        overall = s.overall_hit_rate()
        parts = [f"{s.tokens} tokens"]
        if overall is not None:
            parts.append(f"hit rate {overall:.0%}")
            if sum(s.total_vram):
                parts.append(f"from VRAM {sum(s.total_vram) / sum(s.total_lookups):.0%}")
        if s.bytes_read:
            parts.append(f"{sum(s.bytes_read) / 2**20:.1f} MiB read, SSD wait {sum(s.ssd_wait_ms):.0f} ms")
        if s.tokens_per_s and s.tokens_per_s[-1]:
            parts.append(f"{s.tokens_per_s[-1]:.1f} tok/s")
        parts.append(f"VRAM swaps {int(sum(s.vram_swaps))} in, {int(sum(s.vram_swaps_out))} out")
        if s.recall:
            parts.append("prediction recall " + " / ".join(f"{r:.0%}" for r in s.recall))
        return " · ".join(parts)

    def _on_hover(self, plot: pg.PlotWidget, pos: QPointF) -> None:
        vb = plot.getPlotItem().vb
        if not plot.sceneBoundingRect().contains(pos):
            return
        point = vb.mapSceneToView(pos)
        x = round(point.x())
        s = self.series
        if plot is self.hits_plot:
            if x in s.layer_ids:
                i = s.layer_ids.index(x)
                self.hover.setText(
                    f"layer {x}, last token: VRAM {s.last_vram[i]:.0%}, RAM {s.last_ram[i]:.0%}, drive "
                    f"{s.last_drive[i]:.0%}; mean in memory {s.mean_hit_rate()[i]:.0%} (VRAM "
                    f"{s.mean_vram_share()[i]:.0%}); VRAM swaps {s.total_swaps_in[i]} in, {s.total_swaps_out[i]} out"
                )
            return
        values = {self.wait_plot: s.ssd_wait_ms, self.bytes_plot: s.bytes_read, self.vram_plot: s.vram_swaps}[plot]
        token = s.tokens + x  # the x axis counts tokens ago
        if token in s.token_index:
            at = list(s.token_index).index(token)
            v = values[at]
            if plot is self.bytes_plot:
                text = f"{v / 2**20:.2f} MiB"
            elif plot is self.vram_plot:
                text = f"{v:g} in, {s.vram_swaps_out[at]:g} out"
            else:
                text = f"{v:g}"
            self.hover.setText(f"token {token}: {text}")
