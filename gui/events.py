"""Events view: the agent's journal as a live timeline, filterable by kind and text, with the
latency of each reconfiguration and each entry's details in words (the whole of them in the
tooltip); exported as CSV."""
from __future__ import annotations

import json
import time
from typing import cast

from PySide6.QtCore import (
    QAbstractTableModel,
    QModelIndex,
    QPersistentModelIndex,
    QSortFilterProxyModel,
    Qt,
    Signal,
)
from PySide6.QtGui import QColor
from PySide6.QtWidgets import (
    QCheckBox,
    QGridLayout,
    QHBoxLayout,
    QHeaderView,
    QLineEdit,
    QPushButton,
    QTableView,
    QVBoxLayout,
    QWidget,
)

from photonic_testbed.gui.model import MAX_ENTRIES, FabricModel
from photonic_testbed.hil.agent.entries import builtins
from photonic_testbed.hil.agent.entries import words as readable  # (details in words)
from photonic_testbed.hil.agent.journal import KINDS, Entry

_TOP = QModelIndex()            # the table's rows hang from the invisible top
COLUMNS = ("seq", "time", "kind", "cause", "latency (ms)", "details")
KIND_COLUMNS = 7
KIND_COLOUR = {"failure": QColor("#ef5350"), "alarm": QColor("#ef5350"),
               "verify_failed": QColor("#ef5350"), "detected": QColor("#ffb74d"),
               "decision": QColor("#64b5f6"), "applied": QColor("#81c784"),
               "verified": QColor("#81c784"), "phase": QColor("#ba68c8")}


class EntryTable(QAbstractTableModel):
    def __init__(self, model: FabricModel):
        super().__init__()
        self.fabric = model
        self.rows: list[Entry] = list(model.entries)
        model.entriesAdded.connect(self.add)
        model.entriesReset.connect(self.reset)

    def rowCount(self, parent: QModelIndex | QPersistentModelIndex = _TOP) -> int:
        return 0 if parent.isValid() else len(self.rows)

    def columnCount(self, parent: QModelIndex | QPersistentModelIndex = _TOP) -> int:
        return len(COLUMNS)

    def headerData(self, section, orientation, role=Qt.ItemDataRole.DisplayRole):
        if orientation == Qt.Orientation.Horizontal and role == Qt.ItemDataRole.DisplayRole:
            return COLUMNS[section]
        return None

    def data(self, index, role=Qt.ItemDataRole.DisplayRole):
        e = self.rows[index.row()]
        col = index.column()
        if role == Qt.ItemDataRole.DisplayRole:
            if col == 0:
                return e.seq
            if col == 1:
                return time.strftime("%H:%M:%S", time.localtime(e.ts)) + f"{e.ts % 1:.3f}"[1:]
            if col == 2:
                return e.kind
            if col == 3:
                return e.cause
            if col == 4:
                return "" if e.latency_s is None else f"{e.latency_s * 1e3:.1f}"
            return readable(e.details)
        if role == Qt.ItemDataRole.ToolTipRole and col in (3, 5):
            lines = [f"{e.kind} #{e.seq}: {e.cause}"]
            lines += [line for line in readable(e.details, "\n").split("\n") if line]
            return "\n".join(lines)
        if role == Qt.ItemDataRole.ForegroundRole and col == 2:
            return KIND_COLOUR.get(e.kind)
        if role == Qt.ItemDataRole.TextAlignmentRole and col in (0, 4):
            return int(Qt.AlignmentFlag.AlignRight | Qt.AlignmentFlag.AlignVCenter)
        return None

    def add(self, entries: list[Entry]) -> None:
        if not entries:
            return
        overflow = len(self.rows) + len(entries) - MAX_ENTRIES
        if overflow > 0:
            drop = min(overflow, len(self.rows))
            self.beginRemoveRows(QModelIndex(), 0, drop - 1)
            del self.rows[:drop]
            self.endRemoveRows()
            entries = entries[-MAX_ENTRIES:]
        self.beginInsertRows(QModelIndex(), len(self.rows), len(self.rows) + len(entries) - 1)
        self.rows.extend(entries)
        self.endInsertRows()

    def reset(self) -> None:
        self.beginResetModel()
        self.rows = list(self.fabric.entries)
        self.endResetModel()


class KindFilter(QSortFilterProxyModel):
    def __init__(self):
        super().__init__()
        self.kinds: set[str] | None = None     # None: every kind
        self.text = ""

    def set_kinds(self, kinds: set[str] | None) -> None:
        self._refilter(lambda: setattr(self, "kinds", kinds))

    def set_text(self, text: str) -> None:
        self._refilter(lambda: setattr(self, "text", text.lower()))

    def _refilter(self, change) -> None:
        # Qt >= 6.10 wants begin/endFilterChange around the change; older ones invalidate.
        if hasattr(self, "beginFilterChange"):
            self.beginFilterChange()
            change()
            self.endFilterChange(QSortFilterProxyModel.Direction.Rows)
        else:
            change()
            self.invalidateFilter()

    def filterAcceptsRow(self, row: int, parent) -> bool:
        e = cast(EntryTable, self.sourceModel()).rows[row]
        if self.kinds is not None and e.kind not in self.kinds:
            return False
        if self.text:
            hay = (f"{e.kind} {e.cause} {readable(e.details)} "
                   f"{json.dumps(builtins(e.details), default=str)}").lower()
            return self.text in hay
        return True


class EventsView(QWidget):
    export_requested = Signal()         # the window asks where, then writes the CSV

    def __init__(self, model: FabricModel, parent: QWidget | None = None):
        super().__init__(parent)
        self.table_model = EntryTable(model)
        self.proxy = KindFilter()
        self.proxy.setSourceModel(self.table_model)
        self.view = QTableView()
        self.view.setModel(self.proxy)
        self.view.verticalHeader().setVisible(False)
        self.view.setAlternatingRowColors(True)
        self.view.setWordWrap(False)       # one line per entry; the tooltip has it all
        self.view.setTextElideMode(Qt.TextElideMode.ElideRight)
        header = self.view.horizontalHeader()
        header.setSectionResizeMode(QHeaderView.ResizeMode.ResizeToContents)
        header.setStretchLastSection(True)
        # Sequence numbers grow: room for seven digits from the start, not "3…".
        header.setSectionResizeMode(0, QHeaderView.ResizeMode.Fixed)
        header.resizeSection(0, self.view.fontMetrics().horizontalAdvance("9999999") + 12)
        self.search = QLineEdit()
        self.search.setPlaceholderText("filter text (cause, details)")
        self.search.textChanged.connect(self.proxy.set_text)
        self.export_button = QPushButton("Export CSV…")
        self.export_button.setToolTip("write the events shown (filters applied) as CSV")
        self.export_button.clicked.connect(self.export_requested)
        search_row = QHBoxLayout()
        search_row.addWidget(self.search, 1)
        search_row.addWidget(self.export_button)
        self.kind_boxes: dict[str, QCheckBox] = {}
        kinds = QGridLayout()           # two rows: the dock stays narrow enough to share
        kinds.setHorizontalSpacing(8)
        kinds.setVerticalSpacing(0)
        for i, k in enumerate(KINDS):
            box = QCheckBox(k)
            box.setChecked(True)
            box.toggled.connect(self._kinds_changed)
            self.kind_boxes[k] = box
            kinds.addWidget(box, i // KIND_COLUMNS, i % KIND_COLUMNS)
        kinds.setColumnStretch(KIND_COLUMNS, 1)
        layout = QVBoxLayout(self)
        layout.addLayout(kinds)
        layout.addLayout(search_row)
        layout.addWidget(self.view)
        self._at_bottom = True
        self.table_model.rowsAboutToBeInserted.connect(self._remember_bottom)
        self.table_model.rowsInserted.connect(self._scroll)

    def set_kinds(self, kinds: set[str] | None) -> None:
        for k, box in self.kind_boxes.items():
            box.blockSignals(True)
            box.setChecked(kinds is None or k in kinds)
            box.blockSignals(False)
        self._kinds_changed()

    def _kinds_changed(self) -> None:
        chosen = {k for k, b in self.kind_boxes.items() if b.isChecked()}
        # Kinds the journal may add later stay visible unless the operator filters.
        self.proxy.set_kinds(None if len(chosen) == len(self.kind_boxes) else chosen)

    def _remember_bottom(self) -> None:
        # Follow new events only while the operator has not scrolled back to read.
        bar = self.view.verticalScrollBar()
        self._at_bottom = bar.value() >= bar.maximum() - 1

    def _scroll(self) -> None:
        if self._at_bottom:
            self.view.scrollToBottom()

    def shown_entries(self) -> list[Entry]:
        """The entries the table shows now (filters applied), oldest first."""
        rows = self.table_model.rows
        return [rows[self.proxy.mapToSource(self.proxy.index(r, 0)).row()]
                for r in range(self.proxy.rowCount())]

    def visible_kinds(self) -> list[str]:
        return [self.proxy.index(r, 2).data() for r in range(self.proxy.rowCount())]
