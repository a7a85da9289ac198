"""The GUI as a program (`ptb gui`): how it ends and what it prints. Ctrl+C in the terminal and
SIGTERM close the window as Quit does; a run leaves no window of its own alive behind it (what
PySide would otherwise delete in no order at the interpreter's exit, where a live opus rig's
GUI crashed once in 11 closes); an offscreen run prints nothing of Qt's size-hints notice and
everything else Qt says."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

os.environ["QT_QPA_PLATFORM"] = "offscreen"

from PySide6.QtCore import qWarning  # noqa: E402
from PySide6.QtWidgets import QApplication  # noqa: E402

from photonic_testbed.gui.app import NO_SIZE_HINTS, main, quiet_size_hints  # noqa: E402
from photonic_testbed.gui.window import MainWindow  # noqa: E402

START_S = 60.0              # a cold start imports Qt, pyqtgraph and numpy
CLOSE_S = 30.0


def _gui(tmp_path, *args: str) -> subprocess.Popen:
    """`ptb gui --demo-data` in a process of its own, with SIGINT at its default (a test
    started in the background by a shell passes SIGINT ignored down to its children)."""
    env = {**os.environ, "QT_QPA_PLATFORM": "offscreen"}
    return subprocess.Popen(
        [sys.executable, "-m", "photonic_testbed.ptb", "gui", "--demo-data",
         "--settings", str(tmp_path / "gui.ini"), *args],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))


def _up(proc: subprocess.Popen, ready) -> None:
    deadline = time.monotonic() + START_S
    while not ready.exists():
        if proc.poll() is not None:
            raise AssertionError(f"the GUI exited ({proc.returncode}) before its window was "
                                 f"up:\n{proc.communicate()[1]}")
        if time.monotonic() > deadline:
            proc.kill()
            raise AssertionError(f"the GUI's window not up within {START_S:g} s")
        time.sleep(0.05)


def _ended(proc: subprocess.Popen, why: str) -> tuple[int, str]:
    try:
        _, err = proc.communicate(timeout=CLOSE_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        _, err = proc.communicate()
        raise AssertionError(f"the GUI still open {CLOSE_S:g} s after {why}; it said:\n"
                             f"{err}") from None
    return proc.returncode, err


def test_ctrl_c_and_sigterm_close_the_window_as_quit_does(tmp_path):
    for sig, name in ((signal.SIGINT, "Ctrl+C (SIGINT)"), (signal.SIGTERM, "SIGTERM")):
        ready = tmp_path / f"ready-{sig}"
        (tmp_path / "gui.ini").unlink(missing_ok=True)
        proc = _gui(tmp_path, "--ready-file", str(ready))
        _up(proc, ready)
        proc.send_signal(sig)
        code, err = _ended(proc, name)
        assert code == 0, (name, code, err)
        assert "Traceback" not in err and "KeyboardInterrupt" not in err, err
        assert (tmp_path / "gui.ini").exists(), f"{name}: the layout was not saved"


def test_an_offscreen_run_prints_no_size_hints_notice(tmp_path):
    shot = tmp_path / "x.png"
    proc = _gui(tmp_path, "--quit-after", "1", "--screenshot", str(shot))
    code, err = _ended(proc, "--quit-after 1")
    assert code == 0 and shot.exists(), err
    assert "propagateSizeHints" not in err, err


def test_only_the_size_hints_notice_is_dropped(qapp, qtlog):
    with quiet_size_hints():
        qWarning(NO_SIZE_HINTS)
        qWarning("a window could not be made")          # any other message goes through
    qWarning(NO_SIZE_HINTS)                             # and the handler is put back after
    said = [r.message for r in qtlog.records]
    assert said == ["a window could not be made", NO_SIZE_HINTS]


def test_a_run_leaves_no_window_of_its_own_behind(qapp, tmp_path):
    before = {id(w) for w in QApplication.topLevelWidgets()}
    assert main(["--demo-data", "--quit-after", "0.5", "--settings",
                 str(tmp_path / "gui.ini")]) == 0
    left = [type(w).__name__ for w in QApplication.topLevelWidgets()
            if id(w) not in before and isinstance(w, MainWindow)]
    assert left == []


def test_a_rig_without_a_rack_leaves_the_cockpit_layout_alone(qapp, tmp_path):
    """The docks an OCS-only rig hides are not saved as hidden for the next, fuller rig: the
    layout is kept per kind of rig."""
    from PySide6.QtCore import QSettings

    from photonic_testbed.gui.app import tear_down
    from photonic_testbed.gui.commands import NoCommands
    from photonic_testbed.gui.model import FabricModel
    from photonic_testbed.gui.window import RigParts

    def opened(parts: RigParts) -> MainWindow:
        settings = QSettings(str(tmp_path / "gui.ini"), QSettings.Format.IniFormat)
        win = MainWindow(FabricModel(), NoCommands(), settings=settings, parts=parts)
        win.show()
        return win
    bare = opened(RigParts(gpus=False, heaters=False, chip=False))
    assert [k for k, d in bare.docks.items() if not d.isHidden()] == ["control"]
    bare.close()                                        # its layout saved
    tear_down(bare)
    full = opened(RigParts())
    try:
        assert [k for k, d in full.docks.items() if d.isHidden()] == []
    finally:
        full.close()
        tear_down(full)
