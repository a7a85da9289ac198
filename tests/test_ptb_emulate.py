"""`ptb emulate` as a user runs it: a subprocess, its endpoints file, pyserial, Ctrl-C."""
from __future__ import annotations

import json
import os
import pathlib
import re
import signal
import subprocess
import sys
import time

import serial

ROOT = pathlib.Path(__file__).parent.parent
START_TIMEOUT_S = 30
STOP_TIMEOUT_S = 20


def read_reply(port: serial.Serial, want: bytes, limit: int = 20) -> bytes:
    """Lines from the board until one starts with `want` (the power-up notice may come first)."""
    for _ in range(limit):
        line = port.readline()
        assert line.endswith(b"\n"), f"no complete line from the board (got {line!r})"
        if line.startswith(want):
            return line
    raise AssertionError(f"no line starting {want!r} in {limit} lines")


def test_emulate_serves_the_dac_on_a_pty_and_frees_it_on_sigint(tmp_path):
    endpoints = tmp_path / "endpoints.json"
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.Popen(
        [sys.executable, "-m", "photonic_testbed.ptb", "emulate", "--rig", "lumion", "--endpoints",
         str(endpoints)], cwd=tmp_path, env=env, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while not endpoints.exists():
            assert proc.poll() is None, f"ptb emulate exited early:\n{proc.stderr.read()}"
            assert time.monotonic() < deadline, "no endpoints file within the time limit"
            time.sleep(0.05)
        link = json.loads(endpoints.read_text())["dac"]
        pty = os.path.realpath(link)
        assert re.fullmatch(r"/dev/pts/\d+", pty), pty
        made = os.stat(pty).st_ctime_ns          # which pty of that number: this one
        with serial.Serial(link, 115200, timeout=5) as port:
            port.reset_input_buffer()
            port.write(b"id?\n")
            assert read_reply(port, b"Q8iv-") == b"Q8iv-0001\n"
            port.write(b"nchan?\n")
            assert read_reply(port, b"5") == b"56\n"
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=STOP_TIMEOUT_S)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, err
    assert f"  dac: {pty} (link: {link})\n" in out
    assert "stopped; every port and pty freed" in out
    assert not os.path.lexists(link)
    # The kernel removes /dev/pts/N when the last descriptor of the pair closes; the number is
    # free for reuse from then on (tests beside this one open ptys): a pty there now is another
    try:
        again = os.stat(pty).st_ctime_ns
    except FileNotFoundError:
        again = None
    assert again != made, f"{pty} still exists after ptb emulate exited"
