"""The one bring-up (photonic_testbed.ptb.stack): bounded waits that say what they waited for,
a process of the stack that stops named at once, a shown process's lines passed on as they
come, and nothing left running when the stack ends: not at close, not after an exception, not
when the process holding the stack gets Ctrl-C or SIGTERM, children of children included."""
from __future__ import annotations

import os
import pathlib
import signal
import subprocess
import sys
import textwrap

import pytest

from photonic_testbed.ptb.cli import CommandFailed
from photonic_testbed.ptb.stack import Stack
from tests.timeouts import wait_until

ROOT = pathlib.Path(__file__).resolve().parents[1]
WAIT_S = 60.0              # a bound for what takes milliseconds on an idle machine

# A process that starts a child of its own that ignores SIGTERM (as a busy rank or service
# may), writes both pids to `pids`, and sleeps: only its process group's SIGKILL ends the child.
PARENT_OF_A_STUBBORN_CHILD = textwrap.dedent("""
    import os, subprocess, sys, time
    child = subprocess.Popen([sys.executable, "-c",
        "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)"])
    with open(sys.argv[1] + ".tmp", "w") as f:
        f.write(f"{os.getpid()} {child.pid}")
    os.replace(sys.argv[1] + ".tmp", sys.argv[1])
    time.sleep(600)
""")


def _alive(pid: int) -> bool:
    """Running (a zombie waiting for a parent that does not reap it counts as ended)."""
    try:
        stat = pathlib.Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X")


def _until(cond, what: str, timeout: float = WAIT_S):
    return wait_until(cond, what, timeout, 0.05)


def _ended(pids: list[int]) -> bool:
    """Every process in `pids` ended (a SIGKILL is sent at once, and done soon after)."""
    return not any(_alive(p) for p in pids)


def _pids(path: pathlib.Path) -> list[int]:
    text = path.read_text() if path.exists() else ""
    return [int(p) for p in text.split()] if len(text.split()) == 2 else []


def test_close_ends_every_process_and_the_children_they_started(tmp_path):
    pids = tmp_path / "pids"
    with Stack(tmp_path / "stack", stop_s=1.0) as stack:
        stack.start("parent", [sys.executable, "-c", PARENT_OF_A_STUBBORN_CHILD, str(pids)])
        got = stack.wait("the pids written", lambda: _pids(pids), WAIT_S)
        assert all(_alive(p) for p in got)
    _until(lambda: _ended(got), f"the end of {got}")
    assert (tmp_path / "stack" / "parent.log").exists()     # a folder it was given stays


def test_an_exception_inside_the_stack_stops_it_too(tmp_path):
    pids = tmp_path / "pids"
    with pytest.raises(RuntimeError, match="a bug"):
        with Stack(stop_s=1.0) as stack:
            folder = stack.workdir
            stack.start("parent", [sys.executable, "-c", PARENT_OF_A_STUBBORN_CHILD, str(pids)])
            got = stack.wait("the pids written", lambda: _pids(pids), WAIT_S)
            raise RuntimeError("a bug")
    _until(lambda: _ended(got), f"the end of {got}")
    assert not folder.exists()                 # the folder it made itself is removed


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_the_process_holding_a_stack_leaves_nothing_behind_when_stopped(tmp_path, sig):
    """Ctrl-C (SIGINT) or SIGTERM to the process that holds the stack, as to `ptb demo`."""
    pids = tmp_path / "pids"
    holder = textwrap.dedent(f"""
        import signal, sys, time
        signal.signal(signal.SIGINT, signal.default_int_handler)   # even if started ignored
        from photonic_testbed.ptb.stack import Stack
        with Stack({str(tmp_path / 'stack')!r}, stop_s=1.0) as stack:
            stack.start("parent", [sys.executable, "-c", {PARENT_OF_A_STUBBORN_CHILD!r},
                                   {str(pids)!r}])
            print("started", flush=True)
            time.sleep(600)
    """)
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.Popen([sys.executable, "-c", holder], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        got = _until(lambda: _pids(pids), "the stack's processes started")
        assert all(_alive(p) for p in got)
        proc.send_signal(sig)
        out = proc.communicate(timeout=WAIT_S)[0]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode != 0, out
    _until(lambda: _ended(got), f"the end of {got}; the holder said:\n{out}")


def test_a_wait_that_runs_out_says_what_it_waited_for(tmp_path):
    with Stack(tmp_path) as stack:
        stack.start("quiet", [sys.executable, "-c", "print('up, saying nothing more', "
                              "flush=True); import time; time.sleep(600)"])
        _until(lambda: stack.tail("quiet"), "the first line in the log")
        with pytest.raises(CommandFailed) as e:
            stack.wait("the moon to rise", lambda: False, 0.2)
    said = str(e.value)
    assert said.startswith("the moon to rise did not happen within 0.2 s"), said
    assert "quiet.log" in said and "up, saying nothing more" in said, said


def test_a_process_of_the_stack_that_stops_is_named_at_once(tmp_path):
    with Stack(tmp_path) as stack:
        stack.start("emulate", [sys.executable, "-c", "import sys; print('no such rig'); "
                                "sys.exit(3)"])
        stack.start("done", [sys.executable, "-c", "pass"], lasting=False)
        with pytest.raises(CommandFailed) as e:
            stack.wait("something that never comes", lambda: False, WAIT_S)
    assert str(e.value).startswith("emulate stopped (exit 3)"), e.value
    assert "no such rig" in str(e.value)


def test_a_shown_process_has_its_lines_passed_on_and_logged(tmp_path):
    said: list[str] = []
    lines = "".join(f"print('progress {k}/3', flush=True); " for k in range(1, 4))
    with Stack(tmp_path, say=said.append) as stack:
        proc = stack.start("calibrate", [sys.executable, "-c", lines], show=True,
                           lasting=False)
        stack.wait("the shown process's end", lambda: proc.poll() is not None, WAIT_S)
        _until(lambda: len(said) == 3, "its three lines said")
    assert said == [f"  calibrate: progress {k}/3" for k in range(1, 4)]
    assert (tmp_path / "calibrate.log").read_text().splitlines() == [
        f"progress {k}/3" for k in range(1, 4)]


def test_a_name_is_free_again_once_its_process_ended(tmp_path):
    with Stack(tmp_path) as stack:
        first = stack.start("gui", [sys.executable, "-c", "import time; time.sleep(600)"],
                            lasting=False)
        with pytest.raises(ValueError, match="gui is running already"):
            stack.start("gui", [sys.executable, "-c", "pass"])
        assert stack.stop("gui", 5.0) == -signal.SIGTERM and first.poll() is not None
        again = stack.start("gui", [sys.executable, "-c", "pass"], lasting=False)
        assert stack.processes["gui"] is again


def test_a_process_stopped_on_purpose_is_no_failure_of_the_stack(tmp_path):
    with Stack(tmp_path) as stack:
        stack.start("first-job", [sys.executable, "-c", "import time; time.sleep(600)"])
        assert stack.stop("first-job", 5.0) == -signal.SIGTERM
        stack.start("second-job", [sys.executable, "-c", "import time; time.sleep(600)"])
        assert stack.wait("the second job", lambda: "running", 5.0) == "running"
