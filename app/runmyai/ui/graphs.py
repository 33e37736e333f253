"""Live graphs of the engine's per-token stats: a thin pyqtgraph view over monitor.StatsSeries."""

from __future__ import annotations

import math

import pyqtgraph as pg
from PySide6.QtCore import QPoint, QPointF, Qt, QTimer
from PySide6.QtWidgets import QHBoxLayout, QLabel, QPushButton, QScrollArea, QSizePolicy, QVBoxLayout, QWidget

from runmyai.monitor import StatsSeries, TokenEvent
from runmyai.ui.viewmodels import EXPLAIN_STREAMING, performance_explanation

PLOT_MIN_WIDTH = 240
# below this a plot's axis labels crowd its bars (the panel scrolls instead); at 150 (and the layer chart's 210)
# the third chart ran 9 px off the bottom of a 1280x800 window
PLOT_MIN_HEIGHT = 130
TIER_COLOURS = {"VRAM": "#8e44ad", "RAM": "#4a90d9", "drive": "#e08e0b"}
REDRAW_MS = 250  # events are batched: a redraw costs ~9 ms, so one per token at 20 tokens/s would cost 18 % of a core


def _swatch(colour: str, glyph: str) -> str:
    return f"<span style='color:{colour}'>{glyph}</span>"


class GraphsPanel(QWidget):
    """Per-layer expert-cache hit rate, SSD wait and bytes read per token, VRAM swaps, prediction recall."""

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.series = StatsSeries()
        self._dirty = False
        self._layer_span: tuple[int, int] | None = None
        pg.setConfigOptions(antialias=False, background="w", foreground="k")

        self.hits_plot = pg.PlotWidget(title="Where the experts came from")
        self.hits_plot.setYRange(0, 1.0, padding=0.02)
        self.hits_plot.setLabel("bottom", "layer")
        self.hits_plot.getAxis("left").setTicks([[(0, "0"), (0.5, "50%"), (1.0, "100%")]])
        self.hits_plot.getAxis("bottom").setStyle(hideOverlappingLabels=False)  # the first and last layer's labels
        # stacked: VRAM at the bottom, RAM above it, the drive on top (each bar sums to 1)
        self.tier_bars = {
            t: pg.BarGraphItem(x=[], height=[], width=0.8, brush=c, pen=pg.mkPen(None), name=t)
            for t, c in TIER_COLOURS.items()
        }
        self.hits_bars = self.tier_bars["RAM"]
        # symbols cost 3x the paint
        self.hits_mean = pg.PlotDataItem(pen=pg.mkPen("#d9534f", width=2), name="in memory (mean)")
        for bars in self.tier_bars.values():
            self.hits_plot.addItem(bars)
        self.hits_plot.addItem(self.hits_mean)
        self.has_gpu = True  # until told otherwise: set_has_gpu hides what only a GPU has

        self.wait_plot = pg.PlotWidget(title="Drive wait per token (ms)")
        self.wait_line = self.wait_plot.plot(pen=pg.mkPen("#e08e0b", width=1.5))
        self.bytes_plot = pg.PlotWidget(title="Bytes read per token (MiB)")
        self.bytes_line = self.bytes_plot.plot(pen=pg.mkPen("#5cb85c", width=1.5))
        self.vram_plot = pg.PlotWidget(title="VRAM expert swaps per token")
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
            # no "(x0.001)" after an axis's name: pyqtgraph scales a short range (the layer axis's -0.5..0.5
            # before the first token) by an SI factor and says so in the label; the ticks here are plain numbers
            for name in ("left", "bottom"):
                plot.getAxis(name).enableAutoSIPrefix(False)
            plot.getAxis("left").setWidth(44)  # a tick label growing a digit must not re-lay out the panel
            plot.getPlotItem().setContentsMargins(0, 0, 14, 0)  # room for the last tick label's right half
            plot.setMouseEnabled(x=False, y=False)
            plot.hideButtons()
            plot.setMenuEnabled(False)

        # legends as labels above their plots: inside a plot they covered its bars
        self.hits_legend = QLabel("")
        self.vram_legend = QLabel(f"{_swatch('#8e44ad', '━')} in &nbsp; {_swatch('#7f8c8d', '┅')} out")
        self.explain = QLabel(EXPLAIN_STREAMING)  # what a newcomer is looking at, in one line
        self.explain.setWordWrap(True)
        self.device = QLabel("")  # the engine's line: where it computes (the GPU and its share, or the CPU and why)
        self.device.setWordWrap(True)
        self.device.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        self.summary = QLabel("no tokens yet")
        self.summary.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        self.hover = QLabel("")
        for label in (self.summary, self.hover):  # text changes must not re-lay out the plots: room for 3 lines
            label.setWordWrap(True)
            label.setSizePolicy(QSizePolicy.Policy.Ignored, QSizePolicy.Policy.Fixed)
            label.setFixedHeight(label.fontMetrics().lineSpacing() * 3 + 4)
            label.setAlignment(Qt.AlignmentFlag.AlignTop | Qt.AlignmentFlag.AlignLeft)
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
        plots = QWidget()
        plots_layout = QVBoxLayout(plots)
        plots_layout.setContentsMargins(0, 0, 0, 0)
        for plot in (self.hits_plot, self.wait_plot, self.bytes_plot, self.vram_plot):
            plot.setMinimumHeight(PLOT_MIN_HEIGHT)
            # a plot's own minimum width (its title's) was wider than a 346 px dock: the scroll area cut the
            # layer chart's right side off (its last layer and the title's end)
            plot.setMinimumWidth(PLOT_MIN_WIDTH)
            # waits, bytes and swaps are never negative: a run of zeros (every expert in memory) drew its axis
            # from -20 to 20 ms
            plot.getPlotItem().getViewBox().setLimits(yMin=0)
            if plot is self.hits_plot:
                plots_layout.addWidget(self.hits_legend)
            if plot is self.vram_plot:
                plots_layout.addWidget(self.vram_legend)
            plots_layout.addWidget(plot, 1)
        self.hits_plot.setMinimumHeight(int(PLOT_MIN_HEIGHT * 1.4))
        scroll = QScrollArea()  # a short window scrolls the plots; it never squeezes them past reading
        self.plots_scroll = scroll
        scroll.setWidgetResizable(True)
        scroll.setFrameShape(QScrollArea.Shape.NoFrame)
        scroll.setWidget(plots)
        layout.addWidget(scroll, 1)
        layout.addWidget(self.hover)
        self.explain.setObjectName("muted")
        self.device.setVisible(False)
        self.set_has_gpu(False)

        for plot in (self.hits_plot, self.wait_plot, self.bytes_plot, self.vram_plot):
            plot.scene().sigMouseMoved.connect(lambda pos, p=plot: self._on_hover(p, pos))

        self._timer = QTimer(self)
        self._timer.setInterval(REDRAW_MS)
        self._timer.timeout.connect(self._redraw_if_dirty)
        self._timer.start()

    def add(self, event: TokenEvent) -> None:
        if self.series.add(event):
            self._dirty = True

    def set_device(self, text: str, details: str = "") -> None:
        """Where the engine computes, in plain words (runmyai.monitor.device_note), the engine's own line as its
        tooltip (`details`)."""
        self.device.setText(text)
        self.device.setToolTip(details)
        self.device.setVisible(bool(text))

    def set_has_gpu(self, has_gpu: bool) -> None:
        """The VRAM chart and the VRAM tier's legend entry only where a GPU computes (the machine probe or the
        engine's device line says so): on a CPU they would be a flat zero."""
        self.has_gpu = has_gpu
        self.vram_plot.setVisible(has_gpu)
        self.vram_legend.setVisible(has_gpu)
        tiers = [t for t in TIER_COLOURS if has_gpu or t != "VRAM"]
        self.hits_legend.setText(
            " &nbsp; ".join(_swatch(TIER_COLOURS[t], "■") + f" {t}" for t in tiers)
            + f" &nbsp; {_swatch('#d9534f', '━')} in memory, mean"
        )
        self._layer_span = None
        self._dirty = True

    def set_colours(self, background: str, foreground: str) -> None:
        """The theme's plot colours (pyqtgraph reads its defaults only when a plot is made)."""
        for plot in (self.hits_plot, self.wait_plot, self.bytes_plot, self.vram_plot):
            plot.setBackground(background)
            item = plot.getPlotItem()
            for name in ("left", "bottom"):
                axis = item.getAxis(name)
                axis.setPen(foreground)
                axis.setTextPen(foreground)
            item.titleLabel.setText(item.titleLabel.text, color=foreground)

    def axes_problems(self) -> list[str]:
        """What a reader could not see (the screenshot tests check it): a layer outside the per-layer plot's x axis,
        shares outside its y axis, a line above its plot's y axis, a plot title wider than its plot."""
        problems = []
        s = self.series
        plots = [self.hits_plot, self.wait_plot, self.bytes_plot] + ([self.vram_plot] if self.has_gpu else [])
        if s.layer_ids:
            (x0, x1), (y0, y1) = self.hits_plot.viewRange()
            lo, hi = s.layer_ids[0], s.layer_ids[-1]
            if x0 > lo - 0.4 or x1 < hi + 0.4:
                problems.append(f"layers {lo}..{hi} but the axis shows {x0:.1f}..{x1:.1f}")
            if y0 > 0 or y1 < 1:
                problems.append(f"shares 0..1 but the axis shows {y0:.2f}..{y1:.2f}")
            ticks = self.hits_plot.getAxis("bottom")._tickLevels
            shown = {v for level in (ticks or []) for v, _ in level}
            if ticks is not None and (lo not in shown or hi not in shown):
                problems.append(f"the first or last layer ({lo}, {hi}) has no tick")
        for plot, values in (
            (self.wait_plot, list(s.ssd_wait_ms)),
            (self.bytes_plot, [b / 2**20 for b in s.bytes_read]),
        ):
            (_x0, _x1), (y0, y1) = plot.viewRange()
            if values and (max(values) > y1 + 1e-9 or min(values) < y0 - 1e-9):
                problems.append(f"{plot.getPlotItem().titleLabel.text}: values outside its y axis")
        for plot in plots:
            title = plot.getPlotItem().titleLabel
            need = title.item.boundingRect().width()
            if plot.isVisible() and need > plot.width():
                problems.append(f"the title '{title.text}' is wider than its plot ({need:.0f} > {plot.width()})")
            # the title with its margins sets the chart's least width: past the widget's, the chart's right side
            # (its last layers) is cut off though the title alone fits (seen in a 346 px dock at 1280x800)
            drawn = plot.getPlotItem().size().width()
            if plot.isVisible() and drawn > plot.width() + 0.5:
                problems.append(f"the chart '{title.text}' is wider than its plot ({drawn:.0f} > {plot.width()})")
        return problems

    def cut_charts(self) -> list[str]:
        """A chart the scroll area shows only part of, a third of it or more (the screenshot tests check it): at
        1280x800 the third chart ran off the window's bottom."""
        viewport = self.plots_scroll.viewport()
        problems = []
        for plot in (self.hits_plot, self.wait_plot, self.bytes_plot, self.vram_plot):
            if not plot.isVisible():
                continue
            top = plot.mapTo(viewport, QPoint(0, 0)).y()
            unseen = top + plot.height() - viewport.height()
            # a third of it or more in view reads as a chart cut off (the walk-through's showed 141 of 150 px);
            # its top edge alone, as a panel that scrolls for more (four charts where a GPU computes, 1280x800)
            if unseen > 1 and viewport.height() - top >= plot.height() / 3:
                title = plot.getPlotItem().titleLabel.text
                problems.append(f"the chart '{title}' is cut off: {unseen} of its {plot.height()} px below the panel")
        return problems

    def _layer_ticks(self, lo: int, hi: int) -> None:
        """Ticks at every k-th layer, k so that the labels fit the plot's width, always the first and last."""
        axis = self.hits_plot.getAxis("bottom")
        label = self.hits_plot.fontMetrics().horizontalAdvance(str(hi)) + 12
        width = max(1, self.hits_plot.width() - 60)
        n = hi - lo + 1
        k = max(1, math.ceil(n * label / width))
        k = next(step for step in (1, 2, 5, 10, 20, 25, 50, 100, 1000) if step >= k)
        values = list(range(lo, hi + 1, k))
        if values[-1] != hi:
            if hi - values[-1] < k / 2 and len(values) > 1:
                values[-1] = hi  # the last layer's label, not one crowding it
            else:
                values.append(hi)
        axis.setTicks([[(v, str(v)) for v in values]])

    def resizeEvent(self, event):  # type: ignore[no-untyped-def]  # Qt's override signature
        super().resizeEvent(event)
        self._layer_span = None  # the ticks depend on the width
        self._dirty = True

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
        if not s.layer_ids:
            # no token yet (a model just loaded): no layer ticks, not the last model's layers nor pyqtgraph's
            # 0-1.0 default (the walk-through saw layers 0 and 1 of the previous model over the built-in one)
            self.hits_plot.getAxis("bottom").setTicks([[]])
            self.hits_plot.setXRange(-0.5, 0.5, padding=0)
            self._layer_span = None
        elif self._layer_span != (s.layer_ids[0], s.layer_ids[-1]):
            self._layer_span = (s.layer_ids[0], s.layer_ids[-1])
            self.hits_plot.setXRange(s.layer_ids[0] - 0.5, s.layer_ids[-1] + 0.5, padding=0)
            self._layer_ticks(s.layer_ids[0], s.layer_ids[-1])
        x = [t - s.tokens for t in s.token_index]
        self.wait_line.setData(x, list(s.ssd_wait_ms))
        self.bytes_line.setData(x, [b / 2**20 for b in s.bytes_read])
        self.vram_line.setData(x, list(s.vram_swaps))
        self.vram_out_line.setData(x, list(s.vram_swaps_out))
        if s.vram_swaps:
            self.vram_plot.setYRange(0, max(1.0, max(s.vram_swaps), max(s.vram_swaps_out)), padding=0.05)
        self.summary.setText(self._summary_text())
        self.explain.setText(performance_explanation(s.bytes_read))

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
            # the engine's decode speed, live: labelled so it does not read as the chat footer's "last reply" (the
            # whole reply as the app received it), which it disagreed with (257.8 against 276.8)
            parts.append(f"engine now {s.tokens_per_s[-1]:.1f} tok/s")
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
