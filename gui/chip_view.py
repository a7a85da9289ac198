"""A chip drawn from its topology: each cell's state and the light paths of its circuits."""
from __future__ import annotations

import math

from PySide6.QtCore import QLineF, QPointF, QRectF, Qt
from PySide6.QtGui import QFont, QPainter, QPen
from PySide6.QtWidgets import QWidget

from photonic_testbed.gui.model import FabricModel, SwitchChange
from photonic_testbed.gui.paths import LightPath, trace
from photonic_testbed.gui.switch_view import (
    _ROUTES,
    BACKGROUND,
    CELL_FILL,
    EMPTY,
    FLASH,
    GRID,
    LINK,
    PATH,
    STRAY,
    TEXT,
    SwitchView,
    _blend,
    circuit_colour,
    port_text,
    power_colour,
)


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
