"""`ptb gui`: the operator's desktop GUI (`--demo-data` shows synthetic data)."""
from __future__ import annotations

from photonic_testbed.ptb.cli import CommandFailed


def add_parser(sub) -> None:
    from photonic_testbed.gui.app import add_arguments
    p = sub.add_parser("gui", help="open the operator's desktop GUI",
                       description="Open the GUI on a rig's bus, or on synthetic demo data.")
    add_arguments(p)
    p.set_defaults(func=run)


def run(args) -> int:
    from photonic_testbed.gui.app import GuiUnavailable, run as run_gui
    try:
        return run_gui(args)
    except GuiUnavailable as e:
        raise CommandFailed(str(e)) from None
