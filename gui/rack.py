"""Rack view: every GPU and spare with its health, its rank in the running job and its port."""
from __future__ import annotations

from PySide6.QtCore import Qt
from PySide6.QtGui import QBrush, QColor
from PySide6.QtWidgets import (
    QHeaderView,
    QLabel,
    QTableWidget,
    QTableWidgetItem,
    QVBoxLayout,
    QWidget,
)

from photonic_testbed.gui.model import FabricModel, Gpu

COLUMNS = ("GPU", "status", "rank", "switch", "port")
STATUS_COLOUR = {"ok": QColor("#2e7d32"), "degraded": QColor("#c77c02"),
                 "failed": QColor("#c62828"), "spare": QColor("#455a64"),
                 "in use (spare)": QColor("#1565c0")}


def status(gpu: Gpu) -> str:
    """What the operator reads: a failed GPU is failed whatever its role, then the role."""
    if gpu.health == "failed":
        return "failed"
    if gpu.role == "spare":
        return "spare"
    if gpu.role == "in_use_spare":
        return "in use (spare)" if gpu.health == "ok" else f"{gpu.health}, in use (spare)"
    return gpu.health


def status_colour(text: str) -> QColor:
    return STATUS_COLOUR.get(text, STATUS_COLOUR["degraded"])


class RackView(QWidget):
    def __init__(self, model: FabricModel, parent: QWidget | None = None):
        super().__init__(parent)
        self.model = model
        self.summary = QLabel()
        self.table = QTableWidget(0, len(COLUMNS))
        self.table.setHorizontalHeaderLabels(COLUMNS)
        self.table.verticalHeader().setVisible(False)
        self.table.setEditTriggers(QTableWidget.EditTrigger.NoEditTriggers)
        self.table.setSelectionBehavior(QTableWidget.SelectionBehavior.SelectRows)
        self.table.horizontalHeader().setSectionResizeMode(QHeaderView.ResizeMode.Stretch)
        layout = QVBoxLayout(self)
        layout.addWidget(self.summary)
        layout.addWidget(self.table)
        model.rackChanged.connect(self.refresh)
        self.refresh()

    def row_of(self, name: str) -> int:
        for r in range(self.table.rowCount()):
            item = self.table.item(r, 0)
            if item is not None and item.text() == name:
                return r
        raise KeyError(name)

    def refresh(self, changed=None) -> None:
        gpus = sorted(self.model.rack.values(),
                      key=lambda g: (g.rank is None, g.rank if g.rank is not None else 0, g.name))
        self.table.setRowCount(len(gpus))
        for r, g in enumerate(gpus):
            text = status(g)
            values = (g.name, text, "" if g.rank is None else str(g.rank), g.switch,
                      "" if g.port is None else str(g.port))
            for c, v in enumerate(values):
                item = self.table.item(r, c)
                if item is None:
                    item = QTableWidgetItem()
                    self.table.setItem(r, c, item)
                item.setText(v)
                if c == 1:
                    item.setBackground(QBrush(status_colour(text)))
                    item.setForeground(QBrush(QColor("white")))
                    item.setTextAlignment(Qt.AlignmentFlag.AlignCenter)
        counts: dict[str, int] = {}
        for g in gpus:
            counts[status(g)] = counts.get(status(g), 0) + 1
        self.summary.setText(f"{len(gpus)} GPUs: " + ", ".join(f"{n} {k}" for k, n in
                                                             sorted(counts.items())))
