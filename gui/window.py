"""The main window: the alarm banner on top, the port map in the middle, the other views in
docks (tabbed, movable, and remembered between runs), per-service connection state in the
status bar. A view whose source service is down is greyed and says since when."""
from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, fields

from PySide6.QtCore import QByteArray, QObject, QSettings, Qt, QTimer
from PySide6.QtGui import QAction, QKeySequence
from PySide6.QtWidgets import (
    QDockWidget,
    QFileDialog,
    QLabel,
    QMainWindow,
    QStatusBar,
    QVBoxLayout,
    QWidget,
)

from photonic_testbed.gui.alarms import AlarmBanner, AlarmBook, Limits
from photonic_testbed.gui.calibration import CalibrationView
from photonic_testbed.gui.commands import CommandResult, CommandRunner, Commands
from photonic_testbed.gui.control import ManualControl
from photonic_testbed.gui.events import EventsView
from photonic_testbed.gui.export import ExportError, events_csv, view_png
from photonic_testbed.gui.jobs import JobsView
from photonic_testbed.gui.model import FabricModel
from photonic_testbed.gui.portmap import PortMapView
from photonic_testbed.gui.rack import RackView
from photonic_testbed.gui.stale import StaleFrame
from photonic_testbed.gui.trends import TrendsView

SERVICE_COLOUR = {"connected": "#43a047", "connecting": "#fb8c00", "down": "#e53935"}
LAYOUT_VERSION = 2          # 2: the Jobs and Trends docks (an older saved layout is not used)
DEMO_TEXT = "DEMO DATA — synthetic, not a rig: nothing shown here is real"
# Which services each view's data comes from (a port map panel: its switch's own service).
DEFAULT_SOURCES: dict[str, list[str]] = {
    "rack": ["agent"], "jobs": ["agent"], "events": ["agent"], "trend:jobs": ["agent"],
    "trend:loss": ["agent"], "trend:links": [], "trend:heaters": []}


@dataclass(frozen=True)
class RigParts:
    """What a rig has, so that the window shows no view it has nothing for."""
    gpus: bool = True           # a rack of GPUs (and an agent): rack, jobs, events, link and
    #                             job trends, swap
    heaters: bool = True        # heaters: their power trend, set heater
    chip: bool = True           # a chip: its calibration

    def trends(self) -> tuple[str, ...]:
        """The trends (gui/trends.py) the rig can have."""
        return (("links", "jobs", "loss") if self.gpus else ()) + \
            (("heaters",) if self.heaters else ())

    def docks(self) -> dict[str, bool]:
        """Whether each dock has something to show on this rig."""
        # Without GPUs no agent runs (`ptb agent` refuses such a rig): no journal either.
        return {"rack": self.gpus, "jobs": self.gpus, "calibration": self.chip,
                "trends": bool(self.trends()), "events": self.gpus, "control": True}


class ServiceStatus(QObject):
    """One coloured label per service in the status bar: connected / connecting / down.
    Owned by the status bar, so it goes with its labels."""

    def __init__(self, model: FabricModel, bar: QStatusBar):
        super().__init__(bar)
        self.model, self.bar = model, bar
        self.labels: dict[str, QLabel] = {}
        model.serviceChanged.connect(self.show_service)
        for name in model.services:
            self.show_service(name)
        self.timer = QTimer(self)       # keeps "down for 12 s" current
        self.timer.timeout.connect(self._refresh)
        self.timer.start(1000)

    def show_service(self, name: str) -> None:
        s = self.model.services[name]
        label = self.labels.get(name)
        if label is None:
            label = QLabel()
            label.setObjectName(f"service-{name}")
            self.labels[name] = label
            self.bar.addPermanentWidget(label)
        colour = SERVICE_COLOUR.get(s.state, "#9e9e9e")
        label.setText(f"<span style='color:{colour}'>●</span> {name}: {s.state}")
        label.setToolTip(f"{name}: {s.state} for {time.time() - s.since:.0f} s"
                         + (f"\n{s.detail}" if s.detail else ""))

    def _refresh(self) -> None:
        for name in self.labels:
            if name in self.model.services:
                self.show_service(name)


class MainWindow(QMainWindow):
    def __init__(self, model: FabricModel, commands: Commands, title: str = "photonic testbed",
                 settings: QSettings | None = None, *, demo: bool = False,
                 sources: Mapping[str, list[str]] | None = None, limits: Limits | None = None,
                 parts: RigParts | None = None):
        super().__init__()
        self.model = model
        self.parts = parts or RigParts()
        self.settings = settings or QSettings("photonic-testbed", "ptb-gui")
        self.setWindowTitle(title)
        self.demo = demo
        self.limits = limits or Limits()
        self.sources = {**DEFAULT_SOURCES, **(sources or {})}
        self.runner = CommandRunner(commands, self)
        self.portmap = PortMapView(model)
        self.alarms = AlarmBanner(model, AlarmBook(self.limits))
        centre = QWidget()
        box = QVBoxLayout(centre)
        box.setContentsMargins(0, 0, 0, 0)
        box.setSpacing(2)
        self.demo_banner: QLabel | None = None
        if demo:
            self.demo_banner = QLabel(DEMO_TEXT)
            self.demo_banner.setObjectName("demo-banner")
            self.demo_banner.setAlignment(Qt.AlignmentFlag.AlignCenter)
            self.demo_banner.setStyleSheet("#demo-banner { background: #8e24aa; color: white; "
                                           "font-weight: bold; font-size: 15pt; padding: 4px; }")
            box.addWidget(self.demo_banner)
        box.addWidget(self.alarms)
        box.addWidget(self.portmap, 1)
        self.setCentralWidget(centre)
        self.rack = RackView(model)
        self.events = EventsView(model)
        self.calibration = CalibrationView()
        self.control = ManualControl(model, self.runner)
        self.jobs = JobsView(model, self.limits)
        self.trends = TrendsView(model, self.limits, kinds=self.parts.trends())
        self.control.show_forms(heater=self.parts.heaters, swap=self.parts.gpus)
        self.frames: dict[str, StaleFrame] = {
            "rack": StaleFrame(self.rack), "events": StaleFrame(self.events),
            "jobs": StaleFrame(self.jobs)}
        self.docks: dict[str, QDockWidget] = {}
        for key, title_, widget, area in (
                ("rack", "Rack", self.frames["rack"], Qt.DockWidgetArea.RightDockWidgetArea),
                ("events", "Events", self.frames["events"],
                 Qt.DockWidgetArea.BottomDockWidgetArea),
                ("calibration", "Calibration", self.calibration,
                 Qt.DockWidgetArea.BottomDockWidgetArea),
                ("control", "Manual control", self.control, Qt.DockWidgetArea.RightDockWidgetArea),
                ("jobs", "Jobs", self.frames["jobs"], Qt.DockWidgetArea.RightDockWidgetArea),
                ("trends", "Trends", self.trends, Qt.DockWidgetArea.BottomDockWidgetArea)):
            dock = QDockWidget(title_, self)
            dock.setObjectName(f"dock-{key}")     # saveState needs stable names
            dock.setWidget(widget)
            self.addDockWidget(area, dock)
            self.docks[key] = dock
        self.splitDockWidget(self.docks["jobs"], self.docks["rack"], Qt.Orientation.Vertical)
        self.splitDockWidget(self.docks["trends"], self.docks["events"],
                             Qt.Orientation.Horizontal)
        # The calibration's three plots side by side need the wider of the two bottom areas.
        self.tabifyDockWidget(self.docks["trends"], self.docks["calibration"])
        self.tabifyDockWidget(self.docks["rack"], self.docks["control"])
        self.docks["trends"].raise_()
        self.docks["rack"].raise_()
        self._default_state = self.saveState(LAYOUT_VERSION)
        self.services = ServiceStatus(model, self.statusBar())
        if demo:
            tag = QLabel("<b style='color:#8e24aa'>DEMO DATA</b>")
            tag.setObjectName("demo-tag")
            self.statusBar().addWidget(tag)
        self.runner.finished.connect(self._answer)
        # Bound methods, not lambdas: Qt drops these connections when the window goes.
        model.rejected.connect(self._rejected)
        model.serviceChanged.connect(self.mark_stale)
        model.switchesChanged.connect(self.mark_stale)
        self.events.export_requested.connect(self.export_events)
        self._actions()
        self.restore_layout()
        self.show_parts()
        self.mark_stale()

    def show_parts(self) -> None:
        """Hide the docks the rig has nothing for (whatever a saved layout says), and their
        entries in the View menu; the others keep the layout's choice."""
        for key, has in self.parts.docks().items():
            dock = self.docks[key]
            dock.toggleViewAction().setEnabled(has)
            if not has:
                dock.hide()

    # --- stale views ----------------------------------------------------------------------
    def stale_frames(self) -> dict[str, StaleFrame]:
        """Every view that can be marked stale, by key: `rack`, `jobs`, `events`,
        `trend:links` / `heaters` / `jobs` / `loss`, and `portmap:SWITCH`."""
        frames = dict(self.frames)
        frames.update({f"trend:{k}": f for k, f in self.trends.frames.items()})
        frames.update({f"portmap:{k}": f for k, f in self.portmap.frames.items()})
        return frames

    def sources_of(self, key: str) -> list[str]:
        if key.startswith("portmap:"):
            return self.sources.get(key, [key.split(":", 1)[1]])
        return self.sources.get(key, [])

    def mark_stale(self, *_args) -> None:
        for key, frame in self.stale_frames().items():
            down = [self.model.services[s] for s in self.sources_of(key)
                    if s in self.model.services and self.model.services[s].state == "down"]
            if down:
                frame.set_stale(min(s.since for s in down),
                                ", ".join(f"{s.name} down" for s in down))
            else:
                frame.set_stale(None)

    # --- exports --------------------------------------------------------------------------
    def export_events(self, path: str | None = None) -> int | None:
        """Write the events shown (filters applied) as CSV; asks where when `path` is None."""
        if path is None:
            path, _ = QFileDialog.getSaveFileName(self, "Export events", "events.csv",
                                                  "CSV (*.csv)")
            if not path:
                return None
        try:
            n = events_csv(self.events.shown_entries(), path)
        except ExportError as e:
            self.statusBar().showMessage(str(e), 10000)
            return None
        self.statusBar().showMessage(f"wrote {n} events to {path}", 10000)
        return n

    def views(self) -> dict[str, QWidget]:
        """What `save_view` can save: the whole window and each view."""
        return {"window": self, "port map": self.portmap, "alarms": self.alarms,
                "jobs": self.jobs, "trends": self.trends, "rack": self.rack,
                "events": self.events, "calibration": self.calibration}

    def save_view(self, name: str, path: str | None = None) -> bool:
        if path is None:
            path, _ = QFileDialog.getSaveFileName(self, f"Save {name} as PNG",
                                                  f"{name.replace(' ', '-')}.png", "PNG (*.png)")
            if not path:
                return False
        try:
            view_png(self.views()[name], path)
        except ExportError as e:
            self.statusBar().showMessage(str(e), 10000)
            return False
        self.statusBar().showMessage(f"saved the {name} as {path}", 10000)
        return True

    def _actions(self) -> None:
        # Each action carries what it is for (its data) to a bound method: a lambda naming the
        # window would keep it alive, with its timers running, after it is closed and dropped.
        has = self.parts.docks()
        view = self.menuBar().addMenu("&View")
        for i, (key, dock) in enumerate(self.docks.items(), start=2):
            act = dock.toggleViewAction()
            act.setShortcut(QKeySequence(f"Ctrl+{i}"))
            view.addAction(act)
            show = QAction(f"Show {dock.windowTitle()}", self)
            show.setShortcut(QKeySequence(f"Alt+{i}"))
            show.setData(key)
            show.setEnabled(has[key])
            show.triggered.connect(self._show_chosen)
            self.addAction(show)
        reset = QAction("Reset layout", self)
        reset.setShortcut(QKeySequence("Ctrl+Shift+R"))
        reset.triggered.connect(self.reset_layout)
        view.addAction(reset)
        f = self.menuBar().addMenu("&File")
        open_cal = QAction("Open calibration…", self)
        open_cal.setShortcut(QKeySequence.StandardKey.Open)
        open_cal.triggered.connect(self.calibration.choose_file)
        f.addAction(open_cal)
        export = QAction("Export events as CSV…", self)
        export.setShortcut(QKeySequence("Ctrl+E"))
        export.triggered.connect(self._export_chosen)
        f.addAction(export)
        pictures = f.addMenu("Save view as PNG")
        for name in self.views():
            act = QAction(name, self)
            act.setData(name)
            act.triggered.connect(self._save_chosen)
            pictures.addAction(act)
        quit_ = QAction("Quit", self)
        quit_.setShortcut(QKeySequence.StandardKey.Quit)
        quit_.triggered.connect(self.close)
        f.addAction(quit_)
        control = self.menuBar().addMenu("&Control")
        for text, key, action, usable in (
                ("Connect…", "Ctrl+K", "connect", True),
                ("Disconnect…", "Ctrl+D", "disconnect", True),
                ("Set heater…", "Ctrl+H", "heater", self.parts.heaters),
                ("Swap GPU…", "Ctrl+Shift+S", "swap", self.parts.gpus)):
            act = QAction(text, self)
            act.setShortcut(QKeySequence(key))
            act.setData(action)
            act.setEnabled(usable)
            act.triggered.connect(self._control_chosen)
            control.addAction(act)

    def _chosen(self) -> str:
        """The data of the action that called the slot running now."""
        action = self.sender()
        return str(action.data()) if isinstance(action, QAction) else ""

    def _show_chosen(self) -> None:
        self._show(self._chosen())

    def _export_chosen(self) -> None:
        self.export_events()

    def _save_chosen(self) -> None:
        self.save_view(self._chosen())

    def _control_chosen(self) -> None:
        ask = {"connect": self.control.ask_connect, "disconnect": self.control.ask_disconnect,
               "heater": self.control.ask_heater, "swap": self.control.ask_swap}
        self._show("control")
        ask[self._chosen()]()

    def _rejected(self, why: str) -> None:
        self.statusBar().showMessage(f"ignored {why}", 5000)

    def _show(self, key: str) -> None:
        self.docks[key].show()
        self.docks[key].raise_()

    def _answer(self, r: CommandResult) -> None:
        verb = "done" if r.ok else "REFUSED"
        self.statusBar().showMessage(f"{r.command.action} {verb}: {r.reason}", 10000)

    def _default_sizes(self) -> None:
        """The docks' first sizes: the trends wider than the events, the right column wide
        enough for the job table (Qt sizes docks only once the window is laid out)."""
        self.resizeDocks([self.docks["trends"], self.docks["events"]],
                         [int(self.width() * 0.55), int(self.width() * 0.45)],
                         Qt.Orientation.Horizontal)
        self.resizeDocks([self.docks["trends"]], [int(self.height() * 0.4)],
                         Qt.Orientation.Vertical)
        self.resizeDocks([self.docks["jobs"]], [int(self.width() * 0.33)],
                         Qt.Orientation.Horizontal)
        self.resizeDocks([self.docks["jobs"]], [int(self.height() * 0.3)],
                         Qt.Orientation.Vertical)

    def _state_key(self) -> str:
        """Where the docks' layout is kept: one per kind of rig ("state" for a rig with
        everything, "state-no-gpus-no-heaters-no-chip" ...), so that the docks a bare rig
        hides are not saved as hidden for the next, fuller one."""
        return "state" + "".join(f"-no-{f.name}" for f in fields(self.parts)
                                 if not getattr(self.parts, f.name))

    def restore_layout(self) -> None:
        geometry = self.settings.value("geometry")
        state = self.settings.value(self._state_key())
        if isinstance(geometry, QByteArray):
            self.restoreGeometry(geometry)
        else:
            self.resize(1600, 1000)
        if not (isinstance(state, QByteArray) and self.restoreState(state, LAYOUT_VERSION)):
            QTimer.singleShot(0, self, self._default_sizes)   # dropped if the window goes

    def save_layout(self) -> None:
        self.settings.setValue("geometry", self.saveGeometry())
        self.settings.setValue(self._state_key(), self.saveState(LAYOUT_VERSION))
        self.settings.sync()

    def reset_layout(self) -> None:
        self.restoreState(self._default_state, LAYOUT_VERSION)
        for dock in self.docks.values():
            dock.show()
        self.show_parts()
        self._default_sizes()

    def closeEvent(self, event) -> None:
        self.save_layout()
        self.runner.backend.close()
        super().closeEvent(event)
