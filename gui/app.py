"""Start the GUI: `ptb gui --rig FILE` (on a rig's bus) or
`python -m photonic_testbed.gui --demo-data` (synthetic data)."""
from __future__ import annotations

import argparse
import logging
import sys

from photonic_testbed.gui.limits import Limits

log = logging.getLogger(__name__)


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
        except RigFileError as e:
            raise GuiUnavailable(str(e)) from None
    from PySide6.QtCore import QSettings, QTimer
    from PySide6.QtWidgets import QApplication

    app = QApplication.instance() or QApplication(sys.argv[:1])
    settings = QSettings(args.settings, QSettings.Format.IniFormat) if args.settings else None
    if rig is not None:
        from photonic_testbed.hil.bus.security import KeyFileError
        try:
            window, fabric = rig_window(rig, settings, limits=limits,
                                        rx_period_s=args.rx_period)
        except KeyFileError as e:
            raise GuiUnavailable(f"{args.rig}: the bus's CURVE keys: {e}") from None
    else:
        window, fabric = demo_window(args.seed, settings, limits=limits)
    fabric.start()
    window.show()
    if args.ready_file:
        def ready():
            with open(args.ready_file, "w", encoding="utf-8") as f:
                f.write(f"{app.platformName()}\n")
        QTimer.singleShot(0, ready)       # the event loop runs: the window is up
    if args.quit_after is not None:
        def finish():
            if args.screenshot:
                window.grab().save(args.screenshot)
            window.close()
        QTimer.singleShot(int(args.quit_after * 1000), finish)
    code = app.exec()
    if rig is not None:
        fabric.close()
    else:
        fabric.stop()
    return code


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
