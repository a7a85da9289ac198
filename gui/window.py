"""The main window: port map in the middle, the other views in docks (tabbed, movable, and
remembered between runs), per-service connection state in the status bar."""
from __future__ import annotations

import time

from PySide6.QtCore import QByteArray, QObject, QSettings, Qt, QTimer
from PySide6.QtGui import QAction, QKeySequence
from PySide6.QtWidgets import QDockWidget, QLabel, QMainWindow, QStatusBar

from photonic_testbed.gui.calibration import CalibrationView
from photonic_testbed.gui.commands import CommandResult, CommandRunner, Commands
from photonic_testbed.gui.control import ManualControl
from photonic_testbed.gui.events import EventsView
from photonic_testbed.gui.model import FabricModel
from photonic_testbed.gui.portmap import PortMapView
from photonic_testbed.gui.rack import RackView

SERVICE_COLOUR = {"connected": "#43a047", "connecting": "#fb8c00", "down": "#e53935"}
LAYOUT_VERSION = 1


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
                 settings: QSettings | None = None):
        super().__init__()
        self.model = model
        self.settings = settings or QSettings("photonic-testbed", "ptb-gui")
        self.setWindowTitle(title)
        self.runner = CommandRunner(commands, self)
        self.portmap = PortMapView(model)
        self.setCentralWidget(self.portmap)
        self.rack = RackView(model)
        self.events = EventsView(model)
        self.calibration = CalibrationView()
        self.control = ManualControl(model, self.runner)
        self.docks: dict[str, QDockWidget] = {}
        for key, title_, widget, area in (
                ("rack", "Rack", self.rack, Qt.DockWidgetArea.RightDockWidgetArea),
                ("events", "Events", self.events, Qt.DockWidgetArea.BottomDockWidgetArea),
                ("calibration", "Calibration", self.calibration,
                 Qt.DockWidgetArea.BottomDockWidgetArea),
                ("control", "Manual control", self.control, Qt.DockWidgetArea.RightDockWidgetArea)):
            dock = QDockWidget(title_, self)
            dock.setObjectName(f"dock-{key}")     # saveState needs stable names
            dock.setWidget(widget)
            self.addDockWidget(area, dock)
            self.docks[key] = dock
        self.tabifyDockWidget(self.docks["events"], self.docks["calibration"])
        self.tabifyDockWidget(self.docks["rack"], self.docks["control"])
        self.docks["events"].raise_()
        self.docks["rack"].raise_()
        self._default_state = self.saveState(LAYOUT_VERSION)
        self.services = ServiceStatus(model, self.statusBar())
        self.runner.finished.connect(self._answer)
        # Bound methods, not lambdas: Qt drops these connections when the window goes.
        model.gap.connect(self._gap)
        model.rejected.connect(self._rejected)
        self._actions()
        self.restore_layout()

    def _actions(self) -> None:
        view = self.menuBar().addMenu("&View")
        for i, (key, dock) in enumerate(self.docks.items(), start=2):
            act = dock.toggleViewAction()
            act.setShortcut(QKeySequence(f"Ctrl+{i}"))
            view.addAction(act)
            show = QAction(f"Show {dock.windowTitle()}", self)
            show.setShortcut(QKeySequence(f"Alt+{i}"))
            show.triggered.connect(lambda _=False, d=dock: (d.show(), d.raise_()))
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
        quit_ = QAction("Quit", self)
        quit_.setShortcut(QKeySequence.StandardKey.Quit)
        quit_.triggered.connect(self.close)
        f.addAction(quit_)
        control = self.menuBar().addMenu("&Control")
        for text, key, slot in (("Connect…", "Ctrl+K", self.control.ask_connect),
                                ("Disconnect…", "Ctrl+D", self.control.ask_disconnect),
                                ("Set heater…", "Ctrl+H", self.control.ask_heater),
                                ("Swap GPU…", "Ctrl+Shift+S", self.control.ask_swap)):
            act = QAction(text, self)
            act.setShortcut(QKeySequence(key))
            act.triggered.connect(lambda _=False, s=slot: (self._show("control"), s()))
            control.addAction(act)

    def _gap(self, want: int, got: int) -> None:
        self.statusBar().showMessage(
            f"bus: missed updates {want}..{got - 1}; waiting for a fresh snapshot", 5000)

    def _rejected(self, why: str) -> None:
        self.statusBar().showMessage(f"ignored {why}", 5000)

    def _show(self, key: str) -> None:
        self.docks[key].show()
        self.docks[key].raise_()

    def _answer(self, r: CommandResult) -> None:
        verb = "done" if r.ok else "REFUSED"
        self.statusBar().showMessage(f"{r.command.action} {verb}: {r.reason}", 10000)

    def restore_layout(self) -> None:
        geometry = self.settings.value("geometry")
        state = self.settings.value("state")
        if isinstance(geometry, QByteArray):
            self.restoreGeometry(geometry)
        else:
            self.resize(1500, 950)
        if isinstance(state, QByteArray):
            self.restoreState(state, LAYOUT_VERSION)

    def save_layout(self) -> None:
        self.settings.setValue("geometry", self.saveGeometry())
        self.settings.setValue("state", self.saveState(LAYOUT_VERSION))
        self.settings.sync()

    def reset_layout(self) -> None:
        self.restoreState(self._default_state, LAYOUT_VERSION)
        for dock in self.docks.values():
            dock.show()

    def closeEvent(self, event) -> None:
        self.save_layout()
        self.runner.backend.close()
        super().closeEvent(event)
