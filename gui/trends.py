"""Trends: received power per GPU link, heater power against the board's budget, and each
job's throughput (and loss, when the job reports one), over a time window the operator
chooses. Drawn from the model's series (gui/series.py) once a second, not per sample, so a
busy bus costs the GUI nothing more."""
from __future__ import annotations

import html
import math
import time
from collections.abc import Iterable

import numpy as np
import pyqtgraph as pg
from PySide6.QtCore import Qt, QTimer
from PySide6.QtGui import QColor, QCursor
from PySide6.QtWidgets import (
    QComboBox,
    QGridLayout,
    QHBoxLayout,
    QLabel,
    QToolTip,
    QVBoxLayout,
    QWidget,
)

from photonic_testbed.gui.alarms import Limits
from photonic_testbed.gui.model import FabricModel
from photonic_testbed.gui.stale import StaleFrame

WINDOWS = (("last 1 min", 60.0), ("last 5 min", 300.0), ("last 15 min", 900.0),
           ("last 1 h", 3600.0))
MAX_LINKS = 24              # a big rack's links: the weakest are drawn
LEGEND_MAX = 9              # more lines than this: no legend (it would be a wall); hover
UNITS = {"links": "dBm", "heaters": "mW", "jobs": "steps/s", "loss": ""}
# Calm colours first: red stays for the threshold and for alarms.
COLOURS = ("#4fc3f7", "#ffb74d", "#81c784", "#ba68c8", "#fff176", "#f06292", "#4db6ac",
           "#a1887f", "#90a4ae", "#aed581", "#7986cb", "#ffd54f")
BACKGROUND = "#16181d"
FOREGROUND = "#c8ccd4"
THRESHOLD = "#ef5350"
BUDGET = "#ffb74d"
FLOOR_DBM = -50.0           # darker readings (a dark receiver reads -99) are drawn here
TITLES = {"links": "received power per GPU link", "heaters": "heater power",
          "jobs": "job throughput (reported by the job)", "loss": "job loss (reported by the job)"}


def nice_top(v: float) -> float:
    """The smallest of 1, 2, 2.5, 5 x 10^k at or above `v` (1 for nothing)."""
    if not v > 0:
        return 1.0
    k = 10 ** math.floor(math.log10(v))
    return next(m * k for m in (1, 2, 2.5, 5, 10) if v <= m * k * (1 + 1e-12))


def line_colour(i: int, n: int) -> QColor:
    return QColor(COLOURS[i]) if i < len(COLOURS) else pg.intColor(i, hues=max(n, 6))


class TrendPlot(QWidget):
    """One trend: its title above the plot and its legend below it, both as wrapped text
    outside the plotted area, so neither is cut nor hides a line."""

    def __init__(self, title: str, left: str, parent: QWidget | None = None):
        super().__init__(parent)
        self.setObjectName("trend")
        self.setStyleSheet(f"#trend {{ background: {BACKGROUND}; }} "
                           f"#trend QLabel {{ color: {FOREGROUND}; }}")
        self.setAttribute(Qt.WidgetAttribute.WA_StyledBackground)
        self.title = QLabel(title)
        self.title.setWordWrap(True)
        self.title.setAlignment(Qt.AlignmentFlag.AlignHCenter)
        self.plot = pg.PlotWidget(axisItems={"bottom": pg.DateAxisItem(orientation="bottom")})
        self.plot.setBackground(BACKGROUND)
        self.plot.setMinimumSize(240, 90)
        item = self.plot.getPlotItem()
        item.setLabel("left", left)        # no SI prefixes: "mW", never "kmW"
        item.showGrid(x=True, y=True, alpha=0.25)
        item.setClipToView(True)
        item.setDownsampling(auto=True, mode="peak")
        self.legend = QLabel()
        self.legend.setObjectName("legend")
        self.legend.setWordWrap(True)
        self.legend.setTextFormat(Qt.TextFormat.RichText)
        self.legend.hide()
        self.note = QLabel()              # what the plot cannot say (a budget unknown, ...)
        self.note.setWordWrap(True)
        self.note.setStyleSheet(f"color: {BUDGET};")
        self.note.hide()
        box = QVBoxLayout(self)
        box.setContentsMargins(4, 2, 4, 2)
        box.setSpacing(1)
        for w in (self.title, self.plot, self.legend, self.note):
            box.addWidget(w, 1 if w is self.plot else 0)

    def set_legend(self, entries: list[tuple[str, QColor]], why_none: str = "") -> None:
        """A coloured mark and a name per line; `why_none` in its place when there is none."""
        if not entries:
            self.legend.setText(why_none)
            self.legend.setVisible(bool(why_none))
            return
        self.legend.setText("&nbsp;&nbsp; ".join(
            f"<span style='color:{c.name()}'>&#9632;</span>&nbsp;{html.escape(name)}"
            for name, c in entries))
        self.legend.show()

    def set_note(self, text: str) -> None:
        self.note.setText(text)
        self.note.setVisible(bool(text))


class TrendsView(QWidget):
    """Plots: `links` (dBm), `heaters` (mW), `jobs` (steps/s), `loss`; each in a StaleFrame
    (`frames`) so that the window can grey one whose source is down. Only the plots of
    `kinds` are shown (a rig without heaters has no heater plot), loss once a job reports
    one; those shown share the view's area."""

    def __init__(self, model: FabricModel, limits: Limits | None = None,
                 parent: QWidget | None = None, period_ms: int = 1000,
                 kinds: Iterable[str] = ("links", "heaters", "jobs", "loss")):
        super().__init__(parent)
        self.model = model
        self.limits = limits or Limits()
        self.kinds = tuple(k for k in TITLES if k in set(kinds))
        self.window_s = WINDOWS[1][1]
        self.choice = QComboBox()
        for text, seconds in WINDOWS:
            self.choice.addItem(text, seconds)
        self.choice.setCurrentIndex(1)
        self.choice.currentIndexChanged.connect(self._window_changed)
        self.note = QLabel()
        self.note.setWordWrap(True)
        top = QHBoxLayout()
        top.addWidget(QLabel("time window:"))
        top.addWidget(self.choice)
        top.addWidget(self.note, 1)
        self.cards = {k: TrendPlot(TITLES[k], left) for k, left in
                      (("links", "dBm"), ("heaters", "mW"), ("jobs", "steps / s"),
                       ("loss", "loss"))}
        self.plots = {k: card.plot for k, card in self.cards.items()}
        self.links, self.heaters = self.plots["links"], self.plots["heaters"]
        self.jobs, self.loss = self.plots["jobs"], self.plots["loss"]
        self.links.setYRange(FLOOR_DBM, 0.0, padding=0.02)
        self.threshold = pg.InfiniteLine(pos=self.limits.link_dbm, angle=0, movable=False,
                                         pen=pg.mkPen(THRESHOLD, width=1.5,
                                                      style=pg.QtCore.Qt.PenStyle.DashLine),
                                         label=f"threshold {self.limits.link_dbm:g} dBm",
                                         labelOpts={"position": 0.02, "color": THRESHOLD,
                                                    "anchors": [(0, 0), (0, 0)]})
        self.links.addItem(self.threshold)
        self.budget_lines: dict[str, pg.InfiniteLine] = {}
        # Under the heater plot, not over its data.
        self.budget_note = self.cards["heaters"].note
        self.frames = {k: StaleFrame(card) for k, card in self.cards.items()}
        self.grid = QGridLayout()
        self.grid.setSpacing(2)
        self.nothing = QLabel("nothing to plot: this rig has no GPU links, heaters or jobs")
        self.nothing.setAlignment(Qt.AlignmentFlag.AlignCenter)
        layout = QVBoxLayout(self)
        layout.setContentsMargins(2, 2, 2, 2)
        layout.addLayout(top)
        layout.addLayout(self.grid, 1)
        self._shown: tuple[str, ...] = ()
        self.curves: dict[str, pg.PlotDataItem] = {}
        self._owner: dict[str, pg.PlotWidget] = {}
        self._top: dict[str, float] = {}            # series -> largest value drawn
        self._ranges: dict[tuple, tuple[float, float]] = {}
        for kind, w in self.plots.items():
            w.scene().sigMouseMoved.connect(lambda pos, k=kind: self._hover(k, pos))
        self._drawn: dict[str, int] = {}        # series -> ring version drawn
        self._arrange(tuple(k for k in self.kinds if k != "loss"))
        model.budgetChanged.connect(self._budget)
        self.timer = QTimer(self)
        self.timer.timeout.connect(self.refresh)
        self.timer.start(period_ms)
        for device in model.budgets:
            self._budget(device)
        self._budget_text()
        self.refresh()

    def shown(self) -> tuple[str, ...]:
        """The kinds of plot shown now."""
        return self._shown

    def _arrange(self, kinds: tuple[str, ...]) -> None:
        """Lay the plots of `kinds` out two by two (one alone takes the whole width; the last
        of an odd number the whole of its row); the others are hidden."""
        if kinds == self._shown:
            return
        self._shown = kinds
        for frame in self.frames.values():
            self.grid.removeWidget(frame)
            frame.hide()
        self.grid.removeWidget(self.nothing)
        self.nothing.setVisible(not kinds)
        if not kinds:
            self.grid.addWidget(self.nothing, 0, 0)
        columns = 1 if len(kinds) == 1 else 2
        for i, kind in enumerate(kinds):
            row, col = divmod(i, columns)
            span = columns if i == len(kinds) - 1 and col == 0 else 1
            self.grid.addWidget(self.frames[kind], row, col, 1, span)
            self.frames[kind].show()

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
        title = TITLES["heaters"]
        if known:
            title += " against the board's budget (" + ", ".join(known) + ")"
        if unknown:
            title += " (board budget unknown)"
        self.cards["heaters"].title.setText(title)
        self.cards["heaters"].set_note("budget unknown — " + "; ".join(unknown) if unknown
                                       else "")

    # --- drawing --------------------------------------------------------------------------
    def _series(self) -> dict[str, list[str]]:
        store = self.model.trends
        rx = store.names("rx")
        holders = {g.name for g in self.model.rack.values() if g.rank is not None}
        if holders:
            # A free spare's receiver is dark by design: only the links of the jobs.
            rx = [n for n in rx if n.split("/", 1)[1] in holders]
        if len(rx) > MAX_LINKS:
            # the weakest links (a series with no sample, which `add` never leaves, goes last)
            rx = sorted(rx, key=lambda n: (store.last(n) or (0.0, math.inf))[1])[:MAX_LINKS]
        got = {"links": sorted(rx), "heaters": store.names("heater"),
               "jobs": store.names("throughput"), "loss": store.names("loss")}
        return {k: names for k, names in got.items() if k in self.kinds}

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
                    pen = pg.mkPen(line_colour(i, len(names)), width=2)
                    curve = plots[kind].plot([], [], pen=pen)
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
        self._arrange(tuple(k for k in self.kinds if k != "loss" or chosen["loss"]))
        for kind, names in chosen.items():
            if len(names) > LEGEND_MAX:
                self.cards[kind].set_legend([], f"{len(names)} lines: hover a line for its "
                                                "name")
            else:
                self.cards[kind].set_legend([(n.split("/", 1)[1],
                                              self.curves[n].opts["pen"].color())
                                             for n in names])
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
        # Each plot is given the time range (pyqtgraph's linked axes align plots by their
        # pixels: a plot across the whole width would show another range than one beside it).
        for kind in self._shown:
            self._range("x", plots[kind], start, end)
        # Heaters from zero, against the budget; throughput from zero.
        budgets = [mw for mw, _ in self.model.budgets.values() if mw is not None]
        heat = [self._top[n] for n in chosen.get("heaters", ())] + budgets
        if max(heat, default=0.0) > 0:
            self._range("y", self.heaters, 0.0, nice_top(max(heat) * 1.1))
        rates = [self._top[n] for n in chosen.get("jobs", ())]
        self._range("y", self.jobs, 0.0, nice_top(max(rates, default=0.0) * 1.1))
        n_rx = len(store.names("rx"))
        notes = []
        if "links" in chosen:
            if n_rx > MAX_LINKS:
                notes.append(f"links: the {MAX_LINKS} weakest of {n_rx} drawn")
            notes.append(f"links below {FLOOR_DBM:g} dBm (dark) drawn at {FLOOR_DBM:g}"
                         if chosen["links"] else "no link readings yet")
        if "jobs" in chosen and not chosen["jobs"]:
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
