"""Start the GUI: `ptb gui --rig FILE` (on a rig's bus) or
`python -m photonic_testbed.gui --demo-data` (synthetic data)."""
from __future__ import annotations

import argparse
import contextlib
import logging
import signal
import socket
import sys
from collections.abc import Iterator
from typing import Any

from photonic_testbed.gui.limits import Limits

log = logging.getLogger(__name__)

# What a platform without a window manager (offscreen, minimal, vnc) says each time a window is
# shown: it cannot pass the window's size hints on. Harmless, and on offscreen runs the only
# line Qt prints, so it is dropped; every other message goes through.
NO_SIZE_HINTS = "This plugin does not support propagateSizeHints()"


# what a screenshot may be saved as (Qt picks the format by the file's suffix)
SCREENSHOT_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp")


class GuiUnavailable(Exception):
    """The GUI cannot start as asked; the message says why."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--rig", metavar="FILE", help="rig file: connect to its bus")
    src.add_argument("--demo-data", action="store_true",
                     help="show synthetic data (labelled DEMO DATA), no rig and no bus")
    p.add_argument("--seed", type=int, default=1, help="seed of the demo data")
    p.add_argument("--settings", metavar="INI",
                   help="keep the window layout in this file (default: the user's Qt settings)")
    p.add_argument("--quit-after", type=float, metavar="S",
                   help="close by itself after S seconds (for checks)")
    p.add_argument("--screenshot", metavar="PNG", help="save the window before closing")
    p.add_argument("--ready-file", metavar="FILE",
                   help="write FILE once the window is shown (how `ptb demo` knows the GUI "
                   "is up)")
    p.add_argument("--link-threshold-dbm", type=float, default=Limits.link_dbm, metavar="DBM",
                   help="alarm on a GPU link whose receiver reads less (default %(default)g, "
                   "the agent's verification threshold)")
    p.add_argument("--stuck-after", type=float, default=Limits.stuck_s, metavar="S",
                   help="a job failed or restarting this long is stuck (default %(default)g)")
    p.add_argument("--report-timeout", type=float, default=Limits.report_old_s, metavar="S",
                   help="a running job silent this long is stuck (default %(default)g)")
    p.add_argument("--rx-period", type=float, default=1.0, metavar="S",
                   help="read the GPUs' receivers every S seconds for the trends; 0: never "
                   "(default %(default)g)")
    p.add_argument("--group", metavar="NAME",
                   help="on a rig of agent groups ([groups], one per pod), the group whose "
                   "switches, GPUs and agent replicas the cockpit shows (default: the first)")
    p.add_argument("--skip-display-check", action="store_true",
                   help="start Qt without first checking that it can (see docs/gui.md)")


def limits_from(args: argparse.Namespace) -> Limits:
    for name in ("stuck_after", "report_timeout"):
        if getattr(args, name) <= 0:
            raise GuiUnavailable(f"--{name.replace('_', '-')} must be > 0 seconds")
    return Limits(report_old_s=args.report_timeout, stuck_s=args.stuck_after,
                  link_dbm=args.link_threshold_dbm)


def run(args: argparse.Namespace) -> int:
    limits = limits_from(args)
    if args.rx_period < 0:
        raise GuiUnavailable("--rx-period must be >= 0 seconds")
    if args.quit_after is not None and not 0 < args.quit_after <= 86400:
        raise GuiUnavailable(f"--quit-after must be in (0, 86400] seconds, not "
                             f"{args.quit_after:g}")
    if args.screenshot and args.quit_after is None:
        raise GuiUnavailable("--screenshot is taken when --quit-after closes the window: "
                             "give --quit-after too")
    if args.screenshot and not args.screenshot.lower().endswith(SCREENSHOT_SUFFIXES):
        raise GuiUnavailable(f"--screenshot {args.screenshot}: the name must end in "
                             f"{' or '.join(SCREENSHOT_SUFFIXES)}")
    if not args.skip_display_check:
        from photonic_testbed.gui.startup import qt_start_problem
        problem = qt_start_problem()
        if problem is not None:
            raise GuiUnavailable(problem)
    rig = None
    if args.rig:
        from photonic_testbed.hil.rig import RigFileError, load
        try:
            rig = load(args.rig)
            if rig.groups or args.group:
                rig = rig.group_view(args.group or next(iter(rig.groups), ""))
        except RigFileError as e:
            raise GuiUnavailable(str(e)) from None
    from PySide6.QtCore import QSettings, QTimer
    from PySide6.QtWidgets import QApplication

    with quiet_size_hints():
        app = QApplication.instance() or QApplication(sys.argv[:1])
        settings = QSettings(args.settings, QSettings.Format.IniFormat) if args.settings \
            else None
        if rig is not None:
            from photonic_testbed.hil.bus.security import KeyFileError
            try:
                window, fabric = rig_window(rig, settings, limits=limits,
                                            rx_period_s=args.rx_period)
            except KeyFileError as e:
                raise GuiUnavailable(f"{args.rig}: the bus's CURVE keys: {e}") from None
        else:
            window, fabric = demo_window(args.seed, settings, limits=limits)
        with closed_by_signals(window):
            fabric.start()
            window.show()
            if args.ready_file:
                def ready():
                    with open(args.ready_file, "w", encoding="utf-8") as f:
                        f.write(f"{QApplication.platformName()}\n")
                QTimer.singleShot(0, window, ready)     # the event loop runs: the window is up
            saved = [True]
            if args.quit_after is not None:
                def finish():
                    if args.screenshot and not window.grab().save(args.screenshot):
                        log.error("the screenshot could not be written to %s", args.screenshot)
                        saved[0] = False
                    window.close()
                QTimer.singleShot(int(args.quit_after * 1000), window, finish)
            code = app.exec()
            if code == 0 and not saved[0]:
                code = 1
        if rig is not None:
            fabric.close()
        else:
            fabric.stop()
        tear_down(window)
    return code


def tear_down(window: Any) -> None:
    """Delete the window, and the model under it, now: once the bus's threads have stopped
    (nothing posts to the model any more) and while Qt runs. Left to the interpreter's exit,
    PySide deletes what is left in no particular order, Qt's objects and pyqtgraph's among
    them, after Qt's own teardown has begun."""
    import shiboken6
    model = window.model
    shiboken6.delete(window)
    shiboken6.delete(model)


@contextlib.contextmanager
def closed_by_signals(window: Any) -> Iterator[None]:
    """Ctrl+C in the terminal (SIGINT) and SIGTERM close the window as Quit does (its layout
    saved, the bus closed). Python runs its signal handlers between bytecodes only, and Qt's
    event loop is C++: a socket written by the C signal handler wakes the loop, so a handler
    runs at once. Without this Ctrl+C raised KeyboardInterrupt in whatever slot ran next (a
    traceback, a model update cut in half) and the window stayed open."""
    from PySide6.QtCore import QSocketNotifier, QTimer

    wake_r, wake_w = socket.socketpair()
    for sock in (wake_r, wake_w):
        sock.setblocking(False)

    def close(signum: int, frame: Any) -> None:
        QTimer.singleShot(0, window, window.close)

    def woken() -> None:
        with contextlib.suppress(OSError):
            wake_r.recv(64)
    notifier = QSocketNotifier(wake_r.fileno(), QSocketNotifier.Type.Read)
    notifier.activated.connect(woken)
    previous_fd = signal.set_wakeup_fd(wake_w.fileno(), warn_on_full_buffer=False)
    previous = {s: signal.signal(s, close) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        signal.set_wakeup_fd(previous_fd)
        notifier.setEnabled(False)
        wake_r.close()
        wake_w.close()


@contextlib.contextmanager
def quiet_size_hints() -> Iterator[None]:
    """Drop `NO_SIZE_HINTS` on platforms without a window manager; every other message goes
    where it went before (the previous handler, else standard error as Qt writes it)."""
    from PySide6.QtCore import QtMsgType, qFormatLogMessage, qInstallMessageHandler
    from PySide6.QtGui import QGuiApplication

    from photonic_testbed.gui.startup import NO_WINDOW

    def handler(mode: QtMsgType, context: Any, message: str) -> None:
        if message == NO_SIZE_HINTS and QGuiApplication.platformName() in NO_WINDOW:
            return
        if previous is not None:
            previous(mode, context, message)
        else:
            sys.stderr.write(qFormatLogMessage(mode, context, message) + "\n")
    previous = qInstallMessageHandler(handler)
    try:
        yield
    finally:
        qInstallMessageHandler(previous)


def rig_window(rig, settings=None, limits: Limits | None = None, **bus_options):
    """The main window on `rig`'s bus (the adapter not started yet)."""
    from photonic_testbed.gui.bus import HEATER_KINDS, BusFabric, link_sources
    from photonic_testbed.gui.calibration import CalibrationFileError, load_calibration
    from photonic_testbed.gui.model import FabricModel
    from photonic_testbed.gui.window import MainWindow, RigParts

    model = FabricModel()
    fabric = BusFabric(model, rig, **bus_options)
    heaters = sorted(n for n, d in rig.devices.items() if d.kind in HEATER_KINDS)
    sources = {"trend:links": link_sources(rig), "trend:heaters": heaters}
    parts = RigParts(gpus=bool(rig.gpus), heaters=bool(heaters), chip=rig.chip is not None)
    window = MainWindow(model, fabric, settings=settings, sources=sources, limits=limits,
                        title=f"photonic testbed — rig {rig.name} ({rig.path})", parts=parts)
    if rig.chip is not None and rig.chip.calibration:
        try:
            window.calibration.set_data(load_calibration(rig.chip.calibration),
                                        rig.chip.calibration)
        except CalibrationFileError as e:
            log.warning("the rig's calibration cannot be shown: %s", e)
            window.calibration.source.setText(f"rig calibration not shown: {e}")
    return window, fabric


def demo_window(seed: int = 1, settings=None, limits: Limits | None = None):
    """The main window fed by demo data (not started), labelled as such in its title and
    across the window itself."""
    from photonic_testbed.gui.demo import DemoCommands, DemoFabric, demo_calibration
    from photonic_testbed.gui.model import FabricModel
    from photonic_testbed.gui.window import MainWindow

    model = FabricModel()
    fabric = DemoFabric(model, seed=seed)
    window = MainWindow(model, DemoCommands(fabric), settings=settings, demo=True,
                        limits=limits, sources=fabric.sources,
                        title="photonic testbed GUI — DEMO DATA (synthetic, not a rig)")
    window.calibration.set_data(demo_calibration(fabric.topology, seed), "demo calibration")
    return window, fabric


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m photonic_testbed.gui",
                                description="The operator's desktop GUI.")
    add_arguments(p)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    try:
        return run(args)
    except GuiUnavailable as e:
        print(f"gui: {e}", file=sys.stderr)
        return 1
