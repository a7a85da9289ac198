"""An OCS as an ingress x egress connection matrix coloured by port power, filling its panel,
its port numbers spaced so that no two touch."""
from __future__ import annotations

from dataclasses import dataclass

from PySide6.QtCore import QPointF, QRectF, Qt
from PySide6.QtGui import QColor, QFont, QFontMetricsF, QPainter, QPen
from PySide6.QtWidgets import QWidget

from photonic_testbed.gui.model import FabricModel, SwitchChange
from photonic_testbed.gui.switch_view import (
    EMPTY,
    FLASH,
    GONE,
    GRID,
    PATH,
    RINGS,
    TEXT,
    SwitchView,
    _blend,
    circuit_text,
    port_text,
    power_colour,
)


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
