"""Port map: every switch's live circuits. An OCS is an ingress x egress connection matrix
coloured by port power; a chip is drawn from its topology with each cell's state and the light
paths of its circuits. What just changed flashes for `FLASH_S`."""
from __future__ import annotations

import math
import time
from dataclasses import dataclass

import pyqtgraph as pg
from PySide6.QtCore import QEvent, QLineF, QPointF, QRectF, Qt, QTimer, Signal
from PySide6.QtGui import QColor, QFont, QFontMetricsF, QLinearGradient, QPainter, QPen, QPixmap
from PySide6.QtWidgets import QLabel, QSplitter, QToolTip, QVBoxLayout, QWidget

from photonic_testbed.gui.model import FabricModel, Gpu, SwitchChange
from photonic_testbed.gui.paths import LightPath, trace
from photonic_testbed.gui.stale import StaleFrame

FLASH_S = 0.8
RINGS = 8                          # newest OCS changes that also get a ring
POWER_RANGE_DBM = (-40.0, 0.0)
BACKGROUND = QColor("#16181d")
GRID = QColor("#2a2e37")
EMPTY = QColor("#20232a")
TEXT = QColor("#c8ccd4")
FLASH = QColor("#ffd400")          # what just connected / switched
GONE = QColor("#ff4d4d")           # what just disconnected
PATH = QColor("#ff9f1c")           # ports in use
STRAY = QColor("#ff2a2a")          # light that does not reach the circuit's output (dashed)
LINK = QColor("#4a5160")
CELL_FILL = {"bar": QColor("#2b3a55"), "cross": QColor("#3d2b55"), "partial": QColor("#55462b")}
NO_POWER = QColor("#7f8ea3")
_ROUTES = {"bar": ((0, 2), (1, 3)), "cross": ((0, 3), (1, 2)),
           "partial": ((0, 2), (1, 3), (0, 3), (1, 2))}

_COLOURS = [QColor(int(r), int(g), int(b)) for r, g, b in
            pg.colormap.get("viridis").getLookupTable(nPts=256, alpha=False)]


def power_colour(dbm: float | None) -> QColor:
    if dbm is None or not math.isfinite(dbm):
        return NO_POWER
    lo, hi = POWER_RANGE_DBM
    return _COLOURS[int(min(1.0, max(0.0, (dbm - lo) / (hi - lo))) * 255)]


def _dbm(v: float | None) -> str:
    return "no reading" if v is None or not math.isfinite(v) else f"{v:.1f} dBm"


def describe_gpu(g: Gpu | None) -> str:
    if g is None:
        return "no GPU"
    held = f"rank {g.rank} of job {g.job}" if g.rank is not None and g.job else \
        f"rank {g.rank}" if g.rank is not None else "no rank"
    return f"{g.name} ({g.health}, {g.role.replace('_', ' ')}, {held})"


def port_text(model: FabricModel, switch: str, port: int) -> str:
    """A port of a switch in words: which GPU is on it, its circuit, the powers read there."""
    state = model.switches.get(switch)
    if state is None:
        return f"{switch} port {port}"
    n = state.ports
    gpu = model.gpu_at(switch, port)
    lines = []
    if port <= n:
        lines.append(f"{switch} input {port}: transmitter of {describe_gpu(gpu)}")
        out = state.circuits.get(port)
        if out is None:
            lines.append("no circuit")
        else:
            lines.append(circuit_text(model, switch, port, out))
    else:
        lines.append(f"{switch} output {port}: receiver of {describe_gpu(gpu)}")
        src = next((a for a, b in state.circuits.items() if b == port), None)
        lines.append("no circuit" if src is None else circuit_text(model, switch, src, port))
    return "\n".join(lines)


def circuit_text(model: FabricModel, switch: str, a: int, b: int) -> str:
    """Circuit a -> b of `switch`: the GPUs at its ends, the powers, the job that owns it."""
    state = model.switches[switch]
    src, dst = model.gpu_at(switch, a), model.gpu_at(switch, b)
    lines = [f"circuit {a} → {b}" + (f": {src.name if src else '?'} → {dst.name if dst else '?'}"
                                     if src or dst else "")]
    powers = []
    if a in state.power_dbm:
        powers.append(f"in {a}: {_dbm(state.power_dbm[a])}")
    if b in state.power_dbm:
        powers.append(f"out {b}: {_dbm(state.power_dbm[b])}")
    if dst is not None:
        rx = model.rx_dbm(dst.name)
        if rx is not None:
            powers.append(f"{dst.name}'s receiver: {_dbm(rx[1])}")
    lines.append("power " + ", ".join(powers) if powers else "no power reading")
    jobs = sorted({g.job for g in (src, dst) if g is not None and g.job})
    if jobs:
        ranks = " → ".join(f"rank {g.rank}" if g and g.rank is not None else "?"
                           for g in (src, dst))
        lines.append(f"job {', '.join(jobs)} ({ranks})")
    else:
        lines.append("held by no job")
    return "\n".join(lines)


def circuit_colour(inp: int, ports: int) -> QColor:
    """Each circuit's light in its own hue, so crossing paths can be told apart."""
    # Hues 30..330: reds are kept for light that goes astray.
    return QColor.fromHsv(30 + int(300 * ((inp - 1) % ports) / ports), 210, 255)


def _blend(base: QColor, top: QColor, alpha: float) -> QColor:
    a = max(0.0, min(1.0, alpha))
    return QColor(round(base.red() + (top.red() - base.red()) * a),
                  round(base.green() + (top.green() - base.green()) * a),
                  round(base.blue() + (top.blue() - base.blue()) * a))


class _Flashes:
    """Keys that changed recently, and how much of their flash is left (1 -> 0)."""

    def __init__(self, widget: QWidget):
        self._started: dict[object, tuple[float, QColor]] = {}
        self._timer = QTimer(widget)
        self._timer.setInterval(33)
        self._timer.timeout.connect(self._tick)
        self._widget = widget

    def start(self, key, colour: QColor = FLASH) -> None:
        self._started[key] = (time.monotonic(), colour)
        if not self._timer.isActive():
            self._timer.start()

    def level(self, key) -> tuple[float, QColor] | None:
        got = self._started.get(key)
        if got is None:
            return None
        left = 1.0 - (time.monotonic() - got[0]) / FLASH_S
        return (left, got[1]) if left > 0 else None

    def items(self):
        now = time.monotonic()
        for key, (t, colour) in list(self._started.items()):
            left = 1.0 - (now - t) / FLASH_S
            if left > 0:
                yield key, left, colour

    def _tick(self) -> None:
        now = time.monotonic()
        for key in [k for k, (t, _) in self._started.items() if now - t >= FLASH_S]:
            del self._started[key]
        if not self._started:
            self._timer.stop()
        self._widget.update()


class SwitchView(QWidget):
    """Common base: repaints on the model's changes and reports which update it showed."""

    painted = Signal(str, int)      # switch name, model seq shown by this repaint

    def __init__(self, model: FabricModel, name: str, parent: QWidget | None = None):
        super().__init__(parent)
        self.model, self.name = model, name
        self.applied_seq = model.seq
        self.flashes = _Flashes(self)
        self.setMinimumSize(240, 200)
        self.setAttribute(Qt.WidgetAttribute.WA_OpaquePaintEvent)
        self._layer: QPixmap | None = None
        self._layer_key: tuple = ()
        self._names: tuple = self.gpu_names()
        model.rackChanged.connect(self._rack_changed)

    def _rack_changed(self, changed=None) -> None:
        names = self.gpu_names()
        if names != self._names:
            self._names = names
        self.update()           # tooltips and receiver marks follow the rack

    def paintEvent(self, event) -> None:
        p = QPainter(self)
        try:
            p.drawPixmap(0, 0, self._static_layer())
            self.draw(p)
        finally:
            p.end()
        self.painted.emit(self.name, self.applied_seq)

    def _static_layer(self) -> QPixmap:
        """What does not change between updates (grid, labels, unlit links), drawn once."""
        key = (self.width(), self.height(), self.devicePixelRatioF(), self.static_key())
        if self._layer is None or key != self._layer_key:
            ratio = self.devicePixelRatioF()
            layer = QPixmap(round(self.width() * ratio), round(self.height() * ratio))
            layer.setDevicePixelRatio(ratio)
            layer.fill(BACKGROUND)
            p = QPainter(layer)
            try:
                self.draw_static(p)
            finally:
                p.end()
            self._layer, self._layer_key = layer, key
        return self._layer

    def static_key(self) -> tuple:
        return ()

    def draw_static(self, p: QPainter) -> None:
        """Draw the parts that change only with `static_key()` or the widget's size."""

    def tooltip_at(self, pos: QPointF) -> str:
        """What the operator reads when hovering at `pos` (widget pixels); "" for nothing."""
        return ""

    def event(self, e) -> bool:
        if e.type() == QEvent.Type.ToolTip:
            text = self.tooltip_at(QPointF(e.pos()))
            if text:
                QToolTip.showText(e.globalPos(), text, self)
            else:
                QToolTip.hideText()
                e.ignore()
            return True
        return super().event(e)

    def gpu_names(self) -> tuple:
        """(port, GPU name) of the GPUs on this switch: part of the static key (labels)."""
        return tuple(sorted((g.port, g.name) for g in self.model.rack.values()
                            if g.switch == self.name and g.port is not None))

    def draw(self, p: QPainter) -> None:
        raise NotImplementedError


@dataclass(frozen=True)
class AxisLabel:
    """A port label beside the OCS matrix: where it is drawn and what it says."""
    rect: QRectF
    text: str
    gpu: bool                       # names a GPU (drawn in the path colour)
    align: Qt.AlignmentFlag


@dataclass(frozen=True)
class MatrixLayout:
    """Where the OCS matrix and its labels go in a panel of a given size."""
    x0: float                       # the matrix's top left corner
    y0: float
    sx: float                       # a cell's width and height (the matrix fills the panel)
    sy: float
    labels: tuple[AxisLabel, ...]


LABEL_PT = 7.5
LABEL_GAP = 4.0                     # pixels kept free between two labels
STRIP = 8.0                         # the power strips beside the matrix, and their gap
STEPS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)


class OcsMatrixView(SwitchView):
    """Rows are ingress ports 1..N, columns egress ports N+1..2N; a circuit is a filled cell
    coloured by the power arriving at its egress port (the port's monitor). The matrix fills
    its panel (cells need not be square) and its ports are labelled as often as the labels
    fit without touching (every port, else every 2nd, 4th, 8th ...)."""

    def __init__(self, model: FabricModel, name: str, parent: QWidget | None = None):
        super().__init__(model, name, parent)
        self._laid: tuple[tuple, MatrixLayout] | None = None
        model.switchChanged.connect(self._changed)

    def _changed(self, name: str, change: SwitchChange, seq: int) -> None:
        if name != self.name:
            return
        for a, b in change.added.items():
            self.flashes.start((a, b), FLASH)
        for a, b in change.removed.items():
            self.flashes.start((a, b), GONE)
        self.applied_seq = seq
        self.update()

    def label_font(self) -> QFont:
        font = QFont(self.font())
        font.setPointSizeF(LABEL_PT)
        return font

    def layout_now(self) -> MatrixLayout:
        """The matrix and its labels at the widget's size (kept until it or the rack changes)."""
        n = self.model.switches[self.name].ports
        key = (self.width(), self.height(), n, self._names, self.logicalDpiY())
        if self._laid is None or self._laid[0] != key:
            self._laid = (key, self._lay_out(n))
        return self._laid[1]

    def _lay_out(self, n: int) -> MatrixLayout:
        fm = QFontMetricsF(self.label_font())
        line = fm.height()
        named = dict(self._names)
        row_text = {p: f"{g}  {p}" for p, g in named.items()}
        plain_w = fm.horizontalAdvance(str(n))
        named_w = max([fm.horizontalAdvance(t) for t in row_text.values()] + [plain_w])
        width, height = float(self.width()), float(self.height())

        def left_of(label_w: float) -> float:
            return label_w + 6 + STRIP + 2
        # GPU names go above their columns when every one fits its column, and beside the
        # rows that are labelled (every GPU's row when rows are a line high); the tooltips
        # name them all.
        sx_named = (width - left_of(named_w) - 8) / n
        col_names = bool(named) and all(fm.horizontalAdvance(g) + LABEL_GAP <= sx_named
                                        for g in named.values())
        top = 4 + (line if col_names else 0) + line + 2 + STRIP + 2
        sy = max(1.0, (height - top - 8) / n)
        row_step = next((k for k in STEPS if k * sy >= line + 1), n)
        rows = set(range(1, n + 1, row_step)) | (set(named) if row_step == 1 else set())
        label_w = max([fm.horizontalAdvance(row_text.get(p, str(p))) for p in rows] + [plain_w])
        left = left_of(label_w)
        sx = max(1.0, (width - left - 8) / n)
        col_names = col_names and all(fm.horizontalAdvance(g) + LABEL_GAP <= sx
                                      for g in named.values())
        num_w = fm.horizontalAdvance(str(2 * n))
        col_step = next((k for k in STEPS if k * sx >= num_w + LABEL_GAP), n)
        right = Qt.AlignmentFlag.AlignRight | Qt.AlignmentFlag.AlignVCenter
        centre = Qt.AlignmentFlag.AlignCenter
        labels: list[AxisLabel] = []
        label_right = left - STRIP - 2 - 4
        for port in sorted(rows):
            gpu = port in named
            text = row_text[port] if gpu else str(port)
            w = fm.horizontalAdvance(text)
            mid = top + (port - 0.5) * sy
            labels.append(AxisLabel(QRectF(label_right - w, mid - line / 2, w, line), text,
                                    gpu, right))
        numbers_y = 4 + (line if col_names else 0)
        for port in range(1, n + 1, col_step):
            text = str(n + port)
            w = fm.horizontalAdvance(text)
            mid = left + (port - 0.5) * sx
            labels.append(AxisLabel(QRectF(mid - w / 2, numbers_y, w, line), text, False,
                                    centre))
            if col_names and port in named:
                w = fm.horizontalAdvance(named[port])
                labels.append(AxisLabel(QRectF(mid - w / 2, 4, w, line), named[port], True,
                                        centre))
        return MatrixLayout(left, top, sx, sy, tuple(labels))

    def _geometry(self) -> tuple[float, float, float, float]:
        lay = self.layout_now()
        return lay.x0, lay.y0, lay.sx, lay.sy

    def matrix_rect(self) -> QRectF:
        """Where the matrix is drawn, in widget pixels."""
        n = self.model.switches[self.name].ports
        x0, y0, sx, sy = self._geometry()
        return QRectF(x0, y0, n * sx, n * sy)

    def cell_at(self, pos: QPointF) -> tuple[int, int] | None:
        """(input, output) of the matrix cell under `pos`, or None outside the matrix."""
        state = self.model.switches.get(self.name)
        if state is None:
            return None
        n = state.ports
        x0, y0, sx, sy = self._geometry()
        col, row = int((pos.x() - x0) // sx), int((pos.y() - y0) // sy)
        if 0 <= col < n and 0 <= row < n:
            return row + 1, n + col + 1
        return None

    def tooltip_at(self, pos: QPointF) -> str:
        state = self.model.switches.get(self.name)
        if state is None:
            return ""
        n = state.ports
        x0, y0, sx, sy = self._geometry()
        cell = self.cell_at(pos)
        if cell is not None:
            a, b = cell
            if state.circuits.get(a) == b:
                return circuit_text(self.model, self.name, a, b)
            return (f"no circuit {a} → {b}\n{port_text(self.model, self.name, a)}\n"
                    f"{port_text(self.model, self.name, b)}")
        # The power strips and labels beside the matrix: the port's own text.
        if pos.x() < x0 and y0 <= pos.y() < y0 + n * sy:
            return port_text(self.model, self.name, int((pos.y() - y0) // sy) + 1)
        if pos.y() < y0 and x0 <= pos.x() < x0 + n * sx:
            return port_text(self.model, self.name, n + int((pos.x() - x0) // sx) + 1)
        return ""

    def cell_rect(self, inp: int, out: int) -> QRectF:
        """Where the cell of circuit inp -> out is drawn, in widget pixels."""
        n = self.model.switches[self.name].ports
        x0, y0, sx, sy = self._geometry()
        return QRectF(x0 + (out - n - 1) * sx, y0 + (inp - 1) * sy, sx, sy)

    def static_key(self) -> tuple:
        state = self.model.switches.get(self.name)
        return (state.ports, self._names) if state else ()

    def draw_static(self, p: QPainter) -> None:
        state = self.model.switches.get(self.name)
        if state is None:
            return
        n = state.ports
        lay = self.layout_now()
        x0, y0, sx, sy = lay.x0, lay.y0, lay.sx, lay.sy
        p.fillRect(QRectF(x0, y0, n * sx, n * sy), EMPTY)
        p.setPen(QPen(GRID, 1))
        # Every cell's edge where cells are large, else every 8th (the lines would fill it).
        for i in range(0, n + 1, 1 if sx >= 8 else 8):
            p.drawLine(QPointF(x0 + i * sx, y0), QPointF(x0 + i * sx, y0 + n * sy))
        for i in range(0, n + 1, 1 if sy >= 8 else 8):
            p.drawLine(QPointF(x0, y0 + i * sy), QPointF(x0 + n * sx, y0 + i * sy))
        p.setFont(self.label_font())
        for label in lay.labels:
            p.setPen(PATH if label.gpu else TEXT)
            p.drawText(label.rect, label.align, label.text)

    def draw(self, p: QPainter) -> None:
        state = self.model.switches.get(self.name)
        if state is None:
            return
        n = state.ports
        x0, y0, sx, sy = self._geometry()
        # Port power strips: ingress on the left, egress on top.
        power = state.power_dbm
        for port in range(1, n + 1):
            dbm = power.get(port)
            if dbm is not None:
                p.fillRect(QRectF(x0 - STRIP, y0 + (port - 1) * sy, STRIP - 2, sy),
                           power_colour(dbm))
            dbm = power.get(n + port)
            if dbm is not None:
                p.fillRect(QRectF(x0 + (port - 1) * sx, y0 - STRIP, sx, STRIP - 2),
                           power_colour(dbm))
        # small cells are filled whole to stay visible
        ix = 1.0 if sx >= 6 else 0.0
        iy = 1.0 if sy >= 6 else 0.0
        for a, b in state.circuits.items():
            colour = power_colour(power.get(b, power.get(a)))
            p.fillRect(QRectF(x0 + (b - n - 1) * sx + ix, y0 + (a - 1) * sy + iy,
                              sx - 2 * ix, sy - 2 * iy), colour)
        flashing = sorted(self.flashes.items(), key=lambda f: -f[1])
        for (a, b), left, colour in flashing:
            base = power_colour(power.get(b)) if state.circuits.get(a) == b else EMPTY
            p.fillRect(self.cell_rect(a, b).adjusted(ix, iy, -ix, -iy),
                       _blend(base, colour, left))
        # A ring a few cells wide so a change in a 64 x 64 matrix catches the eye; only around
        # the newest changes (rings are costly to draw, and a storm of them shows nothing).
        p.setRenderHint(QPainter.RenderHint.Antialiasing)
        p.setBrush(Qt.BrushStyle.NoBrush)
        radius = 2.5 * min(sx, sy)
        for (a, b), left, colour in flashing[:RINGS]:
            ring = QColor(colour)
            ring.setAlphaF(left)
            p.setPen(QPen(ring, 2))
            p.drawEllipse(self.cell_rect(a, b).center(), radius, radius)


class ChipView(SwitchView):
    """The chip as its topology draws it: cells with their state, and the light paths."""

    def __init__(self, model: FabricModel, name: str, parent: QWidget | None = None):
        super().__init__(model, name, parent)
        self._paths: dict[int, LightPath] | None = None
        model.switchChanged.connect(self._switch_changed)
        model.cellsChanged.connect(self._cells_changed)
        model.topologyChanged.connect(self._topology_changed)
        model.samplesAdded.connect(self._samples)

    def _samples(self, names: set) -> None:
        # A new reading of a receiver on this chip recolours its mark.
        if any(f"rx/{n}" in names for _, n in self._names):
            self.update()

    def _switch_changed(self, name: str, change: SwitchChange, seq: int) -> None:
        if name == self.name:
            self._paths = None
            for a in change.added:
                self.flashes.start(("port", a), FLASH)
            self.applied_seq = seq
            self.update()

    def _cells_changed(self, name: str, changed: set, seq: int) -> None:
        if name == self.name:
            self._paths = None
            for cid in changed:
                self.flashes.start(("cell", cid), FLASH)
            self.applied_seq = seq
            self.update()

    def _topology_changed(self, name: str) -> None:
        if name == self.name:
            self._paths = None
            self.update()

    # --- geometry ----------------------------------------------------------------------
    def _frame(self):
        topo = self.model.topologies[self.name]
        xs = [c.x for c in topo.cells] or [0.0]
        ys = [c.y for c in topo.cells] or [0.0]
        x_lo, x_hi, y_lo, y_hi = min(xs), max(xs), min(ys), max(ys)
        m = self._label_width()
        sx = max(1.0, self.width() - 2 * m) / (x_hi - x_lo + 2.6)
        sy = self.height() / (y_hi - y_lo + 1.6)
        return (topo, (lambda x: m + (x - x_lo + 1.3) * sx), (lambda y: (y - y_lo + 0.8) * sy),
                sx, sy)

    def _label_width(self) -> float:
        """Pixels beside the cells for the port labels (number, GPU, receiver mark)."""
        longest = max((len(n) for _, n in self._names), default=0)
        return 40.0 + (7.0 * longest + 18 if longest else 0.0)

    def _anchor(self, frame, end: tuple) -> QPointF:
        topo, fx, fy, sx, sy = frame
        if end[0] == "cell":
            c = topo.cell(end[1])
            arm = end[2]
            dx = -0.25 if arm in (0, 1) else 0.25
            dy = -0.22 if arm in (0, 2) else 0.22
            return QPointF(fx(c.x + dx), fy(c.y + dy))
        # A port sits one column outside the cell arm it is linked to.
        for _, other in topo.touching.get(end, ()):
            if other[0] == "cell":
                c = topo.cell(other[1])
                arm = other[2]
                dx = -1.1 if arm in (0, 1) else 1.1
                dy = -0.22 if arm in (0, 2) else 0.22
                return QPointF(fx(c.x + dx), fy(c.y + dy))
        return QPointF(fx(-1.0), fy(0.0))

    def link_midpoint(self, index: int) -> QPointF:
        """Middle of link `index` in widget pixels (where its highlight can be seen)."""
        frame = self._frame()
        a, b = frame[0].links[index]
        pa, pb = self._anchor(frame, a), self._anchor(frame, b)
        return (pa + pb) / 2

    def cell_center(self, cid: str) -> QPointF:
        topo, fx, fy, _, _ = self._frame()
        c = topo.cell(cid)
        return QPointF(fx(c.x), fy(c.y))

    def paths(self) -> dict[int, LightPath]:
        """Light paths of the switch's circuits (input port -> path), cached until a change."""
        if self._paths is None:
            topo = self.model.topologies.get(self.name)
            state = self.model.switches.get(self.name)
            cells = self.model.cells.get(self.name, {})
            self._paths = ({a: trace(topo, cells, a) for a in state.circuits}
                           if topo is not None and state is not None else {})
        return self._paths

    def static_key(self) -> tuple:
        return (id(self.model.topologies.get(self.name)), self._names)

    def _geometry_cache(self):
        """Pixel positions of every link end and cell arm, kept until a resize or new topology."""
        key = (self.width(), self.height(), id(self.model.topologies[self.name]), self._names)
        if getattr(self, "_geo_key", None) != key:
            frame = self._frame()
            topo = frame[0]
            links = [(self._anchor(frame, a), self._anchor(frame, b)) for a, b in topo.links]
            arms = {(cid, arm): self._anchor(frame, ("cell", cid, arm))
                    for cid in (c.id for c in topo.cells) for arm in range(4)}
            ports = {end: self._anchor(frame, end) for end in topo.touching if end[0] == "port"}
            self._geo, self._geo_key = (frame, links, arms, ports), key
        return self._geo

    def _label_box(self, topo, end, pt: QPointF) -> QRectF:
        w = self._label_width() - 4
        if end[1] <= topo.ports:            # inputs on the left, outputs on the right
            return QRectF(pt.x() - w - 4, pt.y() - 8, w, 16)
        return QRectF(pt.x() + 4, pt.y() - 8, w, 16)

    def _port_label(self, p: QPainter, topo, end, pt: QPointF) -> None:
        port = end[1]
        inward = port <= topo.ports
        gpu = dict(self._names).get(port if inward else port - topo.ports)
        box = self._label_box(topo, end, pt)
        if inward:
            text = f"{gpu}  {port}" if gpu else str(port)
        else:
            text = f"{port}  {gpu}" if gpu else str(port)
            if gpu:
                box = box.adjusted(14, 0, 0, 0)     # room for the receiver's power mark
        p.drawText(box, (Qt.AlignmentFlag.AlignRight if inward else Qt.AlignmentFlag.AlignLeft)
                   | Qt.AlignmentFlag.AlignVCenter, text)

    def receiver_mark(self, port: int) -> QRectF | None:
        """Where the power mark of the GPU receiver on output `port` is drawn, if any."""
        topo = self.model.topologies.get(self.name)
        if topo is None or port <= topo.ports or \
                (port - topo.ports) not in dict(self._names):
            return None
        pt = self._geometry_cache()[3].get(("port", port))
        return None if pt is None else QRectF(pt.x() + 5, pt.y() - 5, 10, 10)

    def tooltip_at(self, pos: QPointF) -> str:
        if self.name not in self.model.topologies:
            return ""
        frame, _, _, ports = self._geometry_cache()
        topo, fx, fy, sx, sy = frame
        for end, pt in ports.items():
            if self._label_box(topo, end, pt).adjusted(-4, -2, 4, 2).contains(pos) or \
                    math.dist((pt.x(), pt.y()), (pos.x(), pos.y())) < 10:
                return port_text(self.model, self.name, end[1])
        for c in topo.cells:
            cid = c.id
            if abs(fx(c.x) - pos.x()) <= 0.25 * sx and abs(fy(c.y) - pos.y()) <= 0.3 * sy:
                st = self.model.cells.get(self.name, {}).get(cid, {})
                through = sorted(f"{a} → {self.model.switches[self.name].circuits.get(a, '?')}"
                                 for a, path in self.paths().items()
                                 if any(x[0] == cid for x in path.passes))
                theta = st.get("theta")
                return (f"cell {cid}: {st.get('state', 'unknown')}"
                        + (f" (θ {theta:.2f} rad)" if isinstance(theta, (int, float)) else "")
                        + f", heater channel(s) {', '.join(map(str, c.channels)) or '-'}\n"
                        + ("circuits through it: " + ", ".join(through) if through
                           else "no circuit through it"))
        return ""

    def _font(self, p: QPainter, sy: float) -> None:
        font = QFont(p.font())
        font.setPointSizeF(max(6.0, min(9.0, sy * 0.18)))
        p.setFont(font)

    def draw_static(self, p: QPainter) -> None:
        if self.name not in self.model.topologies:
            return
        frame, links, _, ports = self._geometry_cache()
        topo, _, _, sx, sy = frame
        p.setRenderHint(QPainter.RenderHint.Antialiasing)
        p.setPen(QPen(LINK, max(1.0, min(sx, sy) * 0.06)))
        for pa, pb in links:
            p.drawLine(pa, pb)
        self._font(p, sy)
        p.setPen(TEXT)
        for end, pt in ports.items():
            self._port_label(p, topo, end, pt)

    def draw(self, p: QPainter) -> None:
        if self.name not in self.model.topologies:
            p.setPen(TEXT)
            p.drawText(self.rect(), Qt.AlignmentFlag.AlignCenter,
                       f"{self.name}: waiting for its topology")
            return
        frame, links, arms, ports = self._geometry_cache()
        topo, fx, fy, sx, sy = frame
        p.setRenderHint(QPainter.RenderHint.Antialiasing)
        state = self.model.switches.get(self.name)
        circuits = state.circuits if state else {}
        cells = self.model.cells.get(self.name, {})
        width = max(1.0, min(sx, sy) * 0.06)
        # Cells: a box coloured by state (flashing when it just changed), its routing drawn in.
        bw, bh = 0.5 * sx, 0.6 * sy
        p.setPen(QPen(GRID, 1))
        solid: list[QLineF] = []
        dashed: list[QLineF] = []
        for c in topo.cells:
            cid = c.id
            st = cells.get(cid, {}).get("state", "")     # "": no state known, an empty box
            fill = CELL_FILL.get(st, EMPTY)
            flash = self.flashes.level(("cell", cid))
            if flash is not None:
                fill = _blend(fill, flash[1], flash[0])
            p.setBrush(fill)
            p.drawRoundedRect(QRectF(fx(c.x) - bw / 2, fy(c.y) - bh / 2, bw, bh), 3, 3)
            for i, o in _ROUTES.get(st, ()):
                (dashed if st == "partial" else solid).append(
                    QLineF(arms[(cid, i)], arms[(cid, o)]))
        p.setPen(QPen(TEXT, width))
        p.drawLines(solid)
        p.setPen(QPen(TEXT, width, Qt.PenStyle.DashLine))
        p.drawLines(dashed)
        # Light: one batch of segments per circuit (its links and its ways through cells), over
        # the cells; unlit links are in the static layer.
        for a, path in self.paths().items():
            ok = path.ends == {circuits[a]}
            segments = [QLineF(*links[i]) for i in path.links]
            segments += [QLineF(arms[(cid, i)], arms[(cid, o)]) for cid, i, o in path.passes]
            p.setPen(QPen(circuit_colour(a, topo.ports) if ok else STRAY, width * 2.2,
                          Qt.PenStyle.SolidLine if ok else Qt.PenStyle.DashLine,
                          Qt.PenCapStyle.RoundCap))
            for line in segments:
                p.drawLine(line)
        # Ports a circuit uses are drawn again over the static label, in colour.
        self._font(p, sy)
        used = set(circuits) | set(circuits.values())
        for end, pt in ports.items():
            flash = self.flashes.level(end)
            if end[1] not in used and flash is None:
                continue
            colour = PATH if end[1] in used else TEXT
            if flash is not None:
                colour = _blend(colour, flash[1], flash[0])
            p.fillRect(self._label_box(topo, end, pt), BACKGROUND)
            p.setPen(colour)
            self._port_label(p, topo, end, pt)
        # Each GPU receiver's power, on the scale of the legend (grey: no reading).
        p.setPen(QPen(GRID, 1))
        for port, gpu in self._names:
            mark = self.receiver_mark(topo.ports + port)
            if mark is not None:
                rx = self.model.rx_dbm(gpu)
                p.setBrush(power_colour(rx[1] if rx else None))
                p.drawRect(mark)
        p.setPen(TEXT)
        p.drawText(QRectF(4, 2, self.width() - 8, 16), Qt.AlignmentFlag.AlignLeft,
                   f"{topo.name} ({topo.kind}, {topo.ports} x {topo.ports}): "
                   f"{len(circuits)} circuits")


class PowerScale(QWidget):
    """The colour scale of port and receiver powers: viridis over POWER_RANGE_DBM, grey for
    no reading."""

    def __init__(self, parent: QWidget | None = None):
        super().__init__(parent)
        self.setMinimumSize(300, 30)
        self.setMaximumHeight(30)
        self.setToolTip("power at a port (OCS monitors) or at a GPU's receiver, in dBm")

    def paintEvent(self, event) -> None:
        p = QPainter(self)
        try:
            lo, hi = POWER_RANGE_DBM
            font = QFont(p.font())
            font.setPointSizeF(8)
            p.setFont(font)
            x0, x1, y = 64.0, self.width() - 110.0, 2.0
            p.setPen(self.palette().windowText().color())
            p.drawText(QRectF(0, y, x0 - 6, 14), Qt.AlignmentFlag.AlignRight |
                       Qt.AlignmentFlag.AlignVCenter, "power")
            grad = QLinearGradient(x0, 0, x1, 0)
            for i in range(0, 256, 16):
                grad.setColorAt(i / 255, _COLOURS[i])
            grad.setColorAt(1.0, _COLOURS[255])
            p.fillRect(QRectF(x0, y, x1 - x0, 12), grad)
            for v in range(int(lo), int(hi) + 1, 10):
                x = x0 + (v - lo) / (hi - lo) * (x1 - x0)
                p.drawLine(QPointF(x, y + 12), QPointF(x, y + 15))
                p.drawText(QRectF(x - 20, y + 14, 40, 12), Qt.AlignmentFlag.AlignCenter, f"{v}")
            p.drawText(QRectF(x1 + 14, y + 13, 30, 13), Qt.AlignmentFlag.AlignLeft, "dBm")
            p.fillRect(QRectF(x1 + 50, y, 12, 12), NO_POWER)
            p.drawText(QRectF(x1 + 66, y, 44, 14), Qt.AlignmentFlag.AlignLeft |
                       Qt.AlignmentFlag.AlignVCenter, "none")
        finally:
            p.end()


class PortMapView(QWidget):
    """One panel per switch, side by side, created as switches appear on the bus; each panel
    can be marked stale (`frames[name]`) when its switch's service is down."""

    def __init__(self, model: FabricModel, parent: QWidget | None = None):
        super().__init__(parent)
        self.model = model
        self.views: dict[str, SwitchView] = {}
        self.frames: dict[str, StaleFrame] = {}
        self.titles: dict[str, QLabel] = {}
        self._splitter = QSplitter(Qt.Orientation.Horizontal)
        self._empty = QLabel("no switch on the bus yet")
        self._empty.setAlignment(Qt.AlignmentFlag.AlignCenter)
        self.scale = PowerScale()
        layout = QVBoxLayout(self)
        layout.setContentsMargins(0, 0, 0, 0)
        layout.addWidget(self._empty)
        layout.addWidget(self._splitter, 1)
        layout.addWidget(self.scale)
        model.switchesChanged.connect(self._rebuild)
        self._rebuild()

    def _rebuild(self) -> None:
        for name in [n for n in self.views if n not in self.model.switches]:
            self.views.pop(name)
            self.titles.pop(name)
            self.frames.pop(name).deleteLater()
        for name, state in self.model.switches.items():
            if name in self.views:
                continue
            panel = QWidget()
            box = QVBoxLayout(panel)
            box.setContentsMargins(2, 2, 2, 2)
            kind = "OCS" if state.kind == "ocs" else "chip"
            title = QLabel(f"<b>{name}</b> ({kind}, {state.ports} x {state.ports}) — "
                           + ("colour: power at the egress port" if state.kind == "ocs" else
                              "one hue per circuit; squares: GPU receivers' power")
                           + "; hover for details")
            title.setObjectName(f"title-{name}")
            title.setWordWrap(True)         # a narrow panel: two lines, never a cut one
            self.titles[name] = title
            view: SwitchView = (OcsMatrixView if state.kind == "ocs" else ChipView)(
                self.model, name)
            box.addWidget(title)
            box.addWidget(view, 1)
            frame = StaleFrame(panel)
            self._splitter.addWidget(frame)
            self.views[name] = view
            self.frames[name] = frame
        self._empty.setVisible(not self.views)
        for view in self.views.values():
            view.update()
