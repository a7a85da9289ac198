"""Job view: every job the agent runs, as the agent and the job itself publish it: its state
(running, waiting for circuits, failed, restarting, ...), step, throughput, loss, phase,
restart orders and how old its last report is; a job that is not well is marked STUCK or
FAILED with why. Below, the rank map of the chosen job with each GPU's health."""
from __future__ import annotations

import time

from PySide6.QtCore import Qt, QTimer
from PySide6.QtGui import QBrush, QColor
from PySide6.QtWidgets import (
    QHeaderView,
    QLabel,
    QSplitter,
    QTableWidget,
    QTableWidgetItem,
    QVBoxLayout,
    QWidget,
)

from photonic_testbed.gui.alarms import Limits, duration, job_condition
from photonic_testbed.gui.model import FabricModel, Job

# The details (why a job is not well, its restart orders) are free text of any length: they
# are written out under the table, where they wrap, not in a column that would be cut.
COLUMNS = ("job", "state", "step", "steps/s", "loss", "phase", "ranks", "restarts",
           "last report")
RANK_COLUMNS = ("rank", "GPU", "health", "switch", "port")
STATE_COLOUR = {"running": "#2e7d32", "waiting": "#c77c02", "failed": "#c62828",
                "restarting": "#1565c0", "stopped": "#546e7a", "done": "#546e7a",
                "admitted": "#546e7a", None: "#546e7a", "STUCK": "#b71c1c"}
HEALTH_COLOUR = {"ok": "#2e7d32", "degraded": "#c77c02", "failed": "#c62828"}


def _num(v: float | None, fmt: str) -> str:
    return "" if v is None else format(v, fmt)


class JobsView(QWidget):
    def __init__(self, model: FabricModel, limits: Limits | None = None,
                 parent: QWidget | None = None):
        super().__init__(parent)
        self.model = model
        self.limits = limits or Limits()
        self.summary = QLabel("no job on the rack")
        self.table = QTableWidget(0, len(COLUMNS))
        self.table.setHorizontalHeaderLabels(COLUMNS)
        self.table.verticalHeader().setVisible(False)
        self.table.setEditTriggers(QTableWidget.EditTrigger.NoEditTriggers)
        self.table.setSelectionBehavior(QTableWidget.SelectionBehavior.SelectRows)
        self.table.setSelectionMode(QTableWidget.SelectionMode.SingleSelection)
        header = self.table.horizontalHeader()
        header.setSectionResizeMode(QHeaderView.ResizeMode.ResizeToContents)
        header.setStretchLastSection(True)
        header.setMinimumSectionSize(24)
        self.table.setHorizontalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAsNeeded)
        self.details = QLabel()
        self.details.setObjectName("job-details")
        self.details.setWordWrap(True)
        self.details.setTextFormat(Qt.TextFormat.PlainText)
        self.ranks_title = QLabel()
        self.ranks = QTableWidget(0, len(RANK_COLUMNS))
        self.ranks.setHorizontalHeaderLabels(RANK_COLUMNS)
        self.ranks.verticalHeader().setVisible(False)
        self.ranks.setEditTriggers(QTableWidget.EditTrigger.NoEditTriggers)
        self.ranks.horizontalHeader().setSectionResizeMode(QHeaderView.ResizeMode.Stretch)
        lower = QWidget()
        box = QVBoxLayout(lower)
        box.setContentsMargins(0, 0, 0, 0)
        box.addWidget(self.ranks_title)
        box.addWidget(self.ranks)
        split = QSplitter(Qt.Orientation.Vertical)
        upper = QWidget()
        top = QVBoxLayout(upper)
        top.setContentsMargins(0, 0, 0, 0)
        top.addWidget(self.summary)
        top.addWidget(self.table, 1)
        top.addWidget(self.details)
        split.addWidget(upper)
        split.addWidget(lower)
        split.setStretchFactor(1, 3)
        split.setSizes([110, 330])
        layout = QVBoxLayout(self)
        layout.setContentsMargins(2, 2, 2, 2)
        layout.addWidget(split)
        self.conditions: dict[str, tuple[str, str, float] | None] = {}
        model.jobsChanged.connect(self.refresh)
        model.rackChanged.connect(self._rack)
        self.table.itemSelectionChanged.connect(self._show_ranks)
        self.timer = QTimer(self)           # report ages and stuck marks move with the clock
        self.timer.timeout.connect(self.refresh)
        self.timer.start(1000)
        self.refresh()

    def row_of(self, job: str) -> int:
        for r in range(self.table.rowCount()):
            item = self.table.item(r, 0)
            if item is not None and item.text() == job:
                return r
        raise KeyError(job)

    def chosen(self) -> str | None:
        rows = self.table.selectionModel().selectedRows()
        item = self.table.item(rows[0].row(), 0) if rows else None
        if item is not None:
            return item.text()
        return next(iter(sorted(self.model.jobs)), None)

    def state_text(self, job: Job) -> str:
        cond = self.conditions.get(job.name)
        state = job.report.state or "no report"
        if cond is not None and cond[0] == "stuck":
            return f"STUCK ({state})"
        return state

    def refresh(self) -> None:
        now = time.time()
        jobs = sorted(self.model.jobs.values(), key=lambda j: j.name)
        self.conditions = {j.name: job_condition(j, now, self.limits) for j in jobs}
        keep = self.chosen()
        self.table.setRowCount(len(jobs))
        details: list[str] = []
        for r, job in enumerate(jobs):
            rep = job.report
            cond = self.conditions[job.name]
            state = self.state_text(job)
            age = "never" if rep.t is None else f"{duration(now - job.report_seen)} ago"
            detail = cond[1] if cond is not None else rep.detail
            if job.restart_seq:
                detail = (detail + "; " if detail else "") + \
                    f"restart order {job.restart_seq}: {job.restart_cause}"
            if detail:
                details.append(f"{job.name}: {detail}")
            values = (job.name, state, str(rep.step), _num(rep.throughput, ".1f"),
                      _num(rep.loss, ".4g"),
                      "" if job.phase is None else f"{job.phase} / round {job.round}",
                      str(job.world), str(job.restart_seq), age)
            for c, v in enumerate(values):
                item = self.table.item(r, c)
                if item is None:
                    item = QTableWidgetItem()
                    self.table.setItem(r, c, item)
                if item.text() != v:
                    item.setText(v)
                if c == 1:
                    key = "STUCK" if state.startswith("STUCK") else rep.state
                    colour = QColor(STATE_COLOUR.get(key, STATE_COLOUR[None]))
                    if item.background().color() != colour:
                        item.setBackground(QBrush(colour))
                        item.setForeground(QBrush(QColor("white")))
                        item.setTextAlignment(Qt.AlignmentFlag.AlignCenter)
                if c == 0:
                    item.setToolTip(detail)
        text = "\n".join(details)
        if self.details.text() != text:
            self.details.setText(text)
        self.details.setVisible(bool(details))
        stuck = [j for j, c in self.conditions.items() if c is not None and c[0] == "stuck"]
        if not jobs:
            self.summary.setText("no job on the rack")
        else:
            counts: dict[str, int] = {}
            for j in jobs:
                counts[j.report.state or "no report"] = counts.get(j.report.state or
                                                                   "no report", 0) + 1
            self.summary.setText(f"{len(jobs)} job(s): " + ", ".join(
                f"{n} {k}" for k, n in sorted(counts.items()))
                + (f" — STUCK: {', '.join(stuck)}" if stuck else ""))
        if keep in self.model.jobs:
            row = self.row_of(keep)
            if self.table.currentRow() != row and self.table.selectionModel().selectedRows():
                self.table.selectRow(row)
        self._show_ranks()

    def _rack(self, changed=None) -> None:
        self._show_ranks()

    def _show_ranks(self) -> None:
        name = self.chosen()
        job = self.model.jobs.get(name) if name else None
        if job is None:
            self.ranks_title.setText("rank map: no job")
            self.ranks.setRowCount(0)
            return
        self.ranks_title.setText(f"rank map of {job.name} ({job.plan}, {job.world} ranks)")
        self.ranks.setRowCount(len(job.rank_map))
        for r, (rank, gpu_name) in enumerate(sorted(job.rank_map.items())):
            gpu = self.model.rack.get(gpu_name)
            health = gpu.health if gpu else "?"
            values = (str(rank), gpu_name, health, gpu.switch if gpu else "",
                      "" if gpu is None or gpu.port is None else str(gpu.port))
            for c, v in enumerate(values):
                item = self.ranks.item(r, c)
                if item is None:
                    item = QTableWidgetItem()
                    self.ranks.setItem(r, c, item)
                if item.text() != v:
                    item.setText(v)
                if c == 2:
                    colour = QColor(HEALTH_COLOUR.get(health, "#546e7a"))
                    if item.background().color() != colour:
                        item.setBackground(QBrush(colour))
                        item.setForeground(QBrush(QColor("white")))
                        item.setTextAlignment(Qt.AlignmentFlag.AlignCenter)
