"""Start the GUI: `ptb gui --rig FILE` (on a rig's bus) or
`python -m photonic_testbed.gui --demo-data` (synthetic data)."""
from __future__ import annotations

import argparse
import logging
import sys

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


def run(args: argparse.Namespace) -> int:
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
            window, fabric = rig_window(rig, settings)
        except KeyFileError as e:
            raise GuiUnavailable(f"{args.rig}: the bus's CURVE keys: {e}") from None
    else:
        window, fabric = demo_window(args.seed, settings)
    fabric.start()
    window.show()
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


def rig_window(rig, settings=None, **bus_options):
    """The main window on `rig`'s bus (the adapter not started yet)."""
    from photonic_testbed.gui.bus import BusFabric
    from photonic_testbed.gui.calibration import CalibrationFileError, load_calibration
    from photonic_testbed.gui.model import FabricModel
    from photonic_testbed.gui.window import MainWindow

    model = FabricModel()
    fabric = BusFabric(model, rig, **bus_options)
    window = MainWindow(model, fabric, settings=settings,
                        title=f"photonic testbed — rig {rig.name} ({rig.path})")
    if rig.chip is not None and rig.chip.calibration:
        try:
            window.calibration.set_data(load_calibration(rig.chip.calibration),
                                        rig.chip.calibration)
        except CalibrationFileError as e:
            log.warning("the rig's calibration cannot be shown: %s", e)
            window.calibration.source.setText(f"rig calibration not shown: {e}")
    return window, fabric


def demo_window(seed: int = 1, settings=None):
    """The main window fed by demo data (not started), labelled as such in its title."""
    from photonic_testbed.gui.demo import DemoCommands, DemoFabric, demo_calibration
    from photonic_testbed.gui.model import FabricModel
    from photonic_testbed.gui.window import MainWindow

    model = FabricModel()
    fabric = DemoFabric(model, seed=seed)
    window = MainWindow(model, DemoCommands(fabric), settings=settings,
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
