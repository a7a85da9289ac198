"""What every switch's view in the port map shares: colours by port power, the texts of ports
and circuits, flashes of what just changed (`FLASH_S`), and the `SwitchView` base that the OCS
matrix (gui.ocs_matrix) and the chip (gui.chip_view) are drawn on."""
from __future__ import annotations

import math
import time

import pyqtgraph as pg
from PySide6.QtCore import QEvent, QPointF, Qt, QTimer, Signal
from PySide6.QtGui import QColor, QPainter, QPixmap
from PySide6.QtWidgets import QToolTip, QWidget

from photonic_testbed.gui.model import FabricModel, Gpu

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

VIRIDIS = [QColor(int(r), int(g), int(b)) for r, g, b in
            pg.colormap.get("viridis").getLookupTable(nPts=256, alpha=False)]


def power_colour(dbm: float | None) -> QColor:
    if dbm is None or not math.isfinite(dbm):
        return NO_POWER
    lo, hi = POWER_RANGE_DBM
    return VIRIDIS[int(min(1.0, max(0.0, (dbm - lo) / (hi - lo))) * 255)]


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
