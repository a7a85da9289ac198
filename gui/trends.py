"""Trends: received power per GPU link, heater power against the board's budget, and each
job's throughput (and loss, when the job reports one), over a time window the operator
chooses. Drawn from the model's series (gui/series.py) once a second, not per sample, so a
busy bus costs the GUI nothing more."""
from __future__ import annotations

import math
import time

import numpy as np
import pyqtgraph as pg
from PySide6.QtCore import QTimer
from PySide6.QtGui import QCursor
from PySide6.QtWidgets import (QComboBox, QGridLayout, QHBoxLayout, QLabel, QToolTip,
                               QVBoxLayout, QWidget)

from photonic_testbed.gui.alarms import Limits
from photonic_testbed.gui.model import FabricModel
from photonic_testbed.gui.stale import StaleFrame

WINDOWS = (("last 1 min", 60.0), ("last 5 min", 300.0), ("last 15 min", 900.0),
           ("last 1 h", 3600.0))
MAX_LINKS = 24              # a big rack's links: the weakest are drawn
LEGEND_MAX = 9              # more lines than this: no legend (it would hide them); hover
UNITS = {"links": "dBm", "heaters": "mW", "jobs": "steps/s", "loss": ""}
# Calm colours first: red stays for the threshold and for alarms.
COLOURS = ("#4fc3f7", "#ffb74d", "#81c784", "#ba68c8", "#fff176", "#f06292", "#4db6ac",
           "#a1887f", "#90a4ae", "#aed581", "#7986cb", "#ffd54f")


def nice_top(v: float) -> float:
    """The smallest of 1, 2, 2.5, 5 x 10^k at or above `v` (1 for nothing)."""
    if not v > 0:
        return 1.0
    k = 10 ** math.floor(math.log10(v))
    return next(m * k for m in (1, 2, 2.5, 5, 10) if v <= m * k * (1 + 1e-12))


def line_colour(i: int, n: int):
    return COLOURS[i] if i < len(COLOURS) else pg.intColor(i, hues=max(n, 6))
BACKGROUND = "#16181d"
THRESHOLD = "#ef5350"
BUDGET = "#ffb74d"
FLOOR_DBM = -50.0           # darker readings (a dark receiver reads -99) are drawn here


def _plot(title: str, left: str, legend_at: tuple[int, int] = (6, 4)) -> pg.PlotWidget:
    w = pg.PlotWidget(axisItems={"bottom": pg.DateAxisItem(orientation="bottom")})
    w.setBackground(BACKGROUND)
    w.setMinimumSize(260, 120)
    item = w.getPlotItem()
    item.setTitle(title, size="9pt")
    item.setLabel("left", left)        # no SI prefixes: "mW", never "kmW"
    item.showGrid(x=True, y=True, alpha=0.25)
    item.setClipToView(True)
    item.setDownsampling(auto=True, mode="peak")
    legend = item.addLegend(offset=legend_at, labelTextSize="8pt", verSpacing=-6)
    legend.setColumnCount(3)
    legend.setBrush(pg.mkBrush(22, 24, 29, 190))
    return w


class TrendsView(QWidget):
    """Plots: `links` (dBm), `heaters` (mW), `jobs` (steps/s), `loss`; each in a StaleFrame
    (`frames`) so that the window can grey one whose source is down."""

    def __init__(self, model: FabricModel, limits: Limits | None = None,
                 parent: QWidget | None = None, period_ms: int = 1000):
        super().__init__(parent)
        self.model = model
        self.limits = limits or Limits()
        self.window_s = WINDOWS[1][1]
        self.choice = QComboBox()
        for text, seconds in WINDOWS:
            self.choice.addItem(text, seconds)
        self.choice.setCurrentIndex(1)
        self.choice.currentIndexChanged.connect(self._window_changed)
        self.note = QLabel()
        top = QHBoxLayout()
        top.addWidget(QLabel("time window:"))
        top.addWidget(self.choice)
        top.addWidget(self.note, 1)
        # Good links read near 0 dBm: their legend goes to the bottom, out of their way.
        self.links = _plot("received power per GPU link", "dBm", legend_at=(6, -4))
        self.links.setYRange(FLOOR_DBM, 0.0, padding=0.02)
        self.heaters = _plot("heater power", "mW", legend_at=(6, -4))
        self.jobs = _plot("job throughput (reported by the job)", "steps / s")
        self.loss = _plot("job loss (reported by the job)", "loss")
        self.threshold = pg.InfiniteLine(pos=self.limits.link_dbm, angle=0, movable=False,
                                         pen=pg.mkPen(THRESHOLD, width=1.5,
                                                      style=pg.QtCore.Qt.PenStyle.DashLine),
                                         label=f"threshold {self.limits.link_dbm:g} dBm",
                                         labelOpts={"position": 0.02, "color": THRESHOLD,
                                                    "anchors": [(0, 0), (0, 0)]})
        self.links.addItem(self.threshold)
        self.budget_lines: dict[str, pg.InfiniteLine] = {}
        self.budget_note = pg.TextItem(color=BUDGET, anchor=(0, 0))
        # On the plot's frame, not in its data: it stays in view whatever the time.
        self.budget_note.setParentItem(self.heaters.getPlotItem().vb)
        self.budget_note.setPos(6, 4)
        for p in (self.heaters, self.jobs, self.loss):
            p.setXLink(self.links)
        self.frames = {"links": StaleFrame(self.links), "heaters": StaleFrame(self.heaters),
                       "jobs": StaleFrame(self.jobs), "loss": StaleFrame(self.loss)}
        grid = QGridLayout()
        grid.setSpacing(2)
        grid.addWidget(self.frames["links"], 0, 0)
        grid.addWidget(self.frames["heaters"], 0, 1)
        grid.addWidget(self.frames["jobs"], 1, 0)
        grid.addWidget(self.frames["loss"], 1, 1)
        layout = QVBoxLayout(self)
        layout.setContentsMargins(2, 2, 2, 2)
        layout.addLayout(top)
        layout.addLayout(grid, 1)
        self.frames["loss"].hide()              # shown once a job reports a loss
        self.curves: dict[str, pg.PlotDataItem] = {}
        self._owner: dict[str, pg.PlotWidget] = {}
        self._top: dict[str, float] = {}            # series -> largest value drawn
        self._ranges: dict[tuple, tuple[float, float]] = {}
        self.plots = {"links": self.links, "heaters": self.heaters, "jobs": self.jobs,
                      "loss": self.loss}
        for kind, w in self.plots.items():
            w.scene().sigMouseMoved.connect(lambda pos, k=kind: self._hover(k, pos))
        self._drawn: dict[str, int] = {}        # series -> ring version drawn
        model.budgetChanged.connect(self._budget)
        self.timer = QTimer(self)
        self.timer.timeout.connect(self.refresh)
        self.timer.start(period_ms)
        for device in model.budgets:
            self._budget(device)
        self._budget_text()
        self.refresh()

    def _window_changed(self) -> None:
        self.window_s = float(self.choice.currentData())
        self._drawn.clear()                 # every curve is cut to the new window
        self._ranges.clear()
        self.refresh()

    def set_window(self, seconds: float) -> None:
        for i in range(self.choice.count()):
            if self.choice.itemData(i) == seconds:
                self.choice.setCurrentIndex(i)
                return
        raise ValueError(f"no time window of {seconds:g} s; "
                         f"{', '.join(t for t, _ in WINDOWS)}")

    # --- budget ---------------------------------------------------------------------------
    def _budget(self, device: str) -> None:
        mw, _ = self.model.budgets.get(device, (None, ""))
        line = self.budget_lines.get(device)
        if mw is None:
            if line is not None:
                self.heaters.removeItem(self.budget_lines.pop(device))
        else:
            if line is None:
                line = self.budget_lines[device] = pg.InfiniteLine(
                    angle=0, movable=False, pen=pg.mkPen(BUDGET, width=1.5,
                                                         style=pg.QtCore.Qt.PenStyle.DashLine),
                    label=f"{device} budget {mw:g} mW",
                    labelOpts={"position": 0.02, "color": BUDGET, "anchors": [(0, 0), (0, 0)]})
                self.heaters.addItem(line)
            line.setValue(mw)
            line.label.setFormat(f"{device} budget {mw:g} mW")
        self._budget_text()

    def _budget_text(self) -> None:
        unknown = [f"{d}: {why or 'not published'}" for d, (mw, why) in
                   sorted(self.model.budgets.items()) if mw is None]
        known = [f"{d} {mw:g} mW" for d, (mw, _) in sorted(self.model.budgets.items())
                 if mw is not None]
        title = "heater power"
        if known:
            title += " against the board's budget (" + ", ".join(known) + ")"
        if unknown:
            title += " (board budget unknown)"
        self.heaters.getPlotItem().setTitle(title, size="9pt")
        self.budget_note.setText("budget unknown — " + "; ".join(unknown) if unknown else "")

    # --- drawing --------------------------------------------------------------------------
    def _series(self) -> dict[str, list[str]]:
        store = self.model.trends
        rx = store.names("rx")
        holders = {g.name for g in self.model.rack.values() if g.rank is not None}
        if holders:
            # A free spare's receiver is dark by design: only the links of the jobs.
            rx = [n for n in rx if n.split("/", 1)[1] in holders]
        if len(rx) > MAX_LINKS:
            rx = sorted(rx, key=lambda n: store.last(n)[1])[:MAX_LINKS]
        return {"links": sorted(rx), "heaters": store.names("heater"),
                "jobs": store.names("throughput"), "loss": store.names("loss")}

    def showEvent(self, event) -> None:
        super().showEvent(event)
        self.refresh()

    def refresh(self) -> None:
        if not self.isVisible():
            return          # drawn when shown (showEvent)
        now = time.time()
        t0 = now - self.window_s
        store = self.model.trends
        plots = self.plots
        chosen = self._series()
        wanted = {n for names in chosen.values() for n in names}
        for name in [n for n in self.curves if n not in wanted]:
            self._owner.pop(name).removeItem(self.curves.pop(name))
            self._drawn.pop(name, None)
            self._top.pop(name, None)
        for kind, names in chosen.items():
            for i, name in enumerate(names):
                ring = store.series[name]
                curve = self.curves.get(name)
                if curve is None:
                    label = name.split("/", 1)[1]
                    pen = pg.mkPen(line_colour(i, len(names)), width=2)
                    curve = plots[kind].plot([], [], pen=pen, name=label)
                    self.curves[name] = curve
                    self._owner[name] = plots[kind]
                if self._drawn.get(name) != ring.version:
                    t, v = ring.since(t0)
                    # A line needs two points: the first samples get a dot too.
                    curve.setData(t, np.maximum(v, FLOOR_DBM) if kind == "links" else v,
                                  symbol="o" if len(t) < 3 else None, symbolSize=6,
                                  symbolPen=None, symbolBrush=curve.opts["pen"].color())
                    self._drawn[name] = ring.version
                    self._top[name] = float(v.max()) if len(v) else 0.0
        self.frames["loss"].setVisible(bool(chosen["loss"]))
        for kind, names in chosen.items():
            legend = plots[kind].getPlotItem().legend
            if legend is not None:
                legend.setVisible(0 < len(names) <= LEGEND_MAX)
        # The ranges move in steps, not with every second: the axes, most of what a repaint
        # costs, are drawn again only when a range changes. The time axis pages by a tenth
        # of the window, and starts where the data does when there is less than a window.
        page = self.window_s / 10
        end = math.ceil(now / page) * page
        firsts = [f for names in chosen.values() for n in names
                  if (f := store.series[n].first()) is not None]
        start = end - self.window_s
        if firsts:
            start = min(max(start, min(firsts) - page / 2), end - page)
        self._range("x", self.links, start, end)
        # Heaters from zero, against the budget; throughput from zero.
        budgets = [mw for mw, _ in self.model.budgets.values() if mw is not None]
        heat = [self._top[n] for n in chosen["heaters"]] + budgets
        if max(heat, default=0.0) > 0:
            self._range("y", self.heaters, 0.0, nice_top(max(heat) * 1.1))
        rates = [self._top[n] for n in chosen["jobs"]]
        self._range("y", self.jobs, 0.0, nice_top(max(rates, default=0.0) * 1.1))
        n_rx = len(store.names("rx"))
        notes = []
        if n_rx > MAX_LINKS:
            notes.append(f"links: the {MAX_LINKS} weakest of {n_rx} drawn")
        if chosen["links"]:
            notes.append(f"links below {FLOOR_DBM:g} dBm (dark) drawn at {FLOOR_DBM:g}")
        if not chosen["links"]:
            notes.append("no link readings yet")
        if not chosen["jobs"]:
            notes.append("no job report yet")
        self.note.setText("; ".join(notes))

    def _range(self, axis: str, plot: pg.PlotWidget, lo: float, hi: float) -> None:
        key = (axis, id(plot))
        if self._ranges.get(key) != (lo, hi):
            self._ranges[key] = (lo, hi)
            (plot.setXRange if axis == "x" else plot.setYRange)(lo, hi, padding=0)

    def nearest(self, kind: str, x: float, y: float) -> str:
        """The line of plot `kind` nearest to (x, y) in its own units, in words."""
        best = None
        for name, curve in self.curves.items():
            if self._owner[name] is not self.plots[kind]:
                continue
            t, v = curve.getData()
            if t is None or not len(t):
                continue
            i = int(np.clip(np.searchsorted(t, x), 0, len(t) - 1))
            d = abs(float(v[i]) - y)
            if best is None or d < best[0]:
                best = (d, name, float(t[i]), float(v[i]))
        if best is None:
            return ""
        _, name, t, v = best
        what = {"rx": "receiver of", "heater": "heaters of", "throughput": "job",
                "loss": "job"}[name.split("/", 1)[0]]
        return (f"{what} {name.split('/', 1)[1]}: {v:.4g} {UNITS[kind]} at "
                f"{time.strftime('%H:%M:%S', time.localtime(t))}")

    def _hover(self, kind: str, scene_pos) -> None:
        vb = self.plots[kind].getPlotItem().vb
        if not vb.sceneBoundingRect().contains(scene_pos):
            return
        pt = vb.mapSceneToView(scene_pos)
        text = self.nearest(kind, pt.x(), pt.y())
        if text:
            QToolTip.showText(QCursor.pos(), text, self.plots[kind])

    def curve_data(self, name: str) -> tuple[np.ndarray, np.ndarray]:
        """What is drawn for series `name` now (times, values)."""
        t, v = self.curves[name].getData()
        return (np.asarray(t if t is not None else []), np.asarray(v if v is not None else []))
