"""`ptb gui`: the operator's desktop GUI (`--demo-data` shows synthetic data); and the GUI
that `ptb demo --gui` opens, watched so that the demo says what really became of it."""
from __future__ import annotations

import pathlib
import subprocess
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from photonic_testbed.ptb.cli import CommandFailed, check_output

if TYPE_CHECKING:
    from photonic_testbed.ptb.stack import Stack

GUI_START_S = 60.0          # a cold start imports Qt and checks the display first


def add_parser(sub) -> None:
    from photonic_testbed.gui.app import add_arguments
    p = sub.add_parser("gui", help="open the operator's desktop GUI",
                       description="Open the GUI on a rig's bus, or on synthetic demo data. "
                       "It first checks that Qt can open a window here and, if not, says "
                       "which system libraries are missing and how to install them.")
    add_arguments(p)
    p.set_defaults(func=run)


def run(args) -> int:
    from photonic_testbed.gui.app import SCREENSHOT_SUFFIXES, GuiUnavailable
    from photonic_testbed.gui.app import run as run_gui
    check_output(args.screenshot, "--screenshot", SCREENSHOT_SUFFIXES)
    check_output(args.ready_file, "--ready-file")
    try:
        return run_gui(args)
    except GuiUnavailable as e:
        raise CommandFailed(str(e)) from None


class DemoGui:
    """`ptb gui --rig FILE` as a child of `ptb demo`: started, waited for until its window is
    up (its `--ready-file`) or it died, and reported as it is, not as hoped."""

    def __init__(self, stack: Stack, rig_path: pathlib.Path, say: Callable[[str], None],
                 extra: tuple[str, ...] = (), start_s: float = GUI_START_S):
        self.stack, self.say = stack, say
        self.ready = stack.workdir / "gui.ready"
        self.ready.unlink(missing_ok=True)
        # not lasting: the demo goes on when its GUI closes or does not start
        self.proc: subprocess.Popen = stack.ptb("gui", "gui", "--rig", str(rig_path),
                                                "--ready-file", str(self.ready), *extra,
                                                lasting=False)
        self.up = self._wait(start_s)

    def _wait(self, start_s: float) -> bool:
        deadline = time.monotonic() + start_s
        while time.monotonic() < deadline:
            if self.ready.exists():
                self.say("GUI open (ptb gui --rig rig.toml)")
                return True
            if self.proc.poll() is not None:
                self.say(f"GUI did not start (exit {self.proc.returncode}); the demo goes on "
                         f"without it. It said:\n{self._said()}")
                return False
            time.sleep(0.1)
        self.say(f"GUI not open after {start_s:g} s; the demo goes on (its log: gui.log)")
        return False

    def _said(self) -> str:
        return "\n".join("    " + line for line in self.stack.tail("gui", 12).splitlines())

    def finish(self, keep_open: bool = False) -> None:
        """At the end of the demo: say what became of the GUI; with `keep_open`, wait for
        the operator to close its window (the rig and agent stay up until then)."""
        code = self.proc.poll()
        if code is not None:
            self.say(f"GUI closed during the demo (exit {code})"
                     + ("" if code == 0 else f"; it said:\n{self._said()}"))
            return
        if not keep_open:
            self.say("GUI still open; it closes with the demo (--keep-open keeps it)")
            return
        self.say("GUI kept open on the live rig: close its window (or Ctrl+C) to stop the "
                 "emulator, services and agent")
        try:
            code = self.proc.wait()
        except KeyboardInterrupt:
            self.say("interrupted: stopping everything")
            return
        self.say(f"GUI closed (exit {code})")
