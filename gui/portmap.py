"""Port map: every switch's live circuits. An OCS is an ingress x egress connection matrix
coloured by port power; a chip is drawn from its topology with each cell's state and the light
paths of its circuits. What just changed flashes for `FLASH_S`."""
from __future__ import annotations

from PySide6.QtCore import QPointF, QRectF, Qt
from PySide6.QtGui import QFont, QLinearGradient, QPainter
from PySide6.QtWidgets import QLabel, QSplitter, QVBoxLayout, QWidget

from photonic_testbed.gui.chip_view import ChipView
from photonic_testbed.gui.model import FabricModel
from photonic_testbed.gui.ocs_matrix import OcsMatrixView
from photonic_testbed.gui.stale import StaleFrame
from photonic_testbed.gui.switch_view import (
    EMPTY,
    FLASH,
    NO_POWER,
    POWER_RANGE_DBM,
    VIRIDIS,
    SwitchView,
    circuit_colour,
    power_colour,
)


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
                grad.setColorAt(i / 255, VIRIDIS[i])
            grad.setColorAt(1.0, VIRIDIS[255])
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


__all__ = ["ChipView", "EMPTY", "FLASH", "NO_POWER", "OcsMatrixView", "POWER_RANGE_DBM",
           "PortMapView", "PowerScale", "SwitchView", "circuit_colour", "power_colour"]
