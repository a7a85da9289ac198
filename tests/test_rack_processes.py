"""The emulated rack takes a process down with its GPU: `register_process` on the control
endpoint binds a PID to a GPU; `fail_gpu` SIGKILLs it (as a GPU falling off the bus ends the
process using it); bad registrations are refused with a message."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from photonic_testbed.emulator.control import ControlError, request
from photonic_testbed.emulator.rig import EmulatedRig
from photonic_testbed.hil import rig as rigfile
from photonic_testbed.hil.rig import rig_spec


@pytest.fixture
def opus_rack():
    with EmulatedRig(rig_spec("opus"), switching_s=0.0) as emu:
        bus = rigfile.for_emulator("opus", emu.endpoints)
        emu.start_rack(bus.gpus_endpoints(), None)
        yield emu.endpoints["control"]


def _sleeper():
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])


def test_fail_gpu_kills_the_registered_process_only(opus_rack):
    a, b = _sleeper(), _sleeper()
    try:
        got = request(opus_rack, {"cmd": "register_process", "gpu": "server2", "pid": a.pid})
        assert got == {"gpu": "server2", "pids": [a.pid]}
        request(opus_rack, {"cmd": "register_process", "gpu": "server3", "pid": b.pid})
        out = request(opus_rack, {"cmd": "fail_gpu", "gpu": "server2"})
        assert out["killed"] == [a.pid] and "server2" in out["gpus"]
        assert a.wait(10) == -9
        assert b.poll() is None                        # another GPU's process lives on
        # a process that ended by itself is not killed again (nor a reused pid)
        b.kill()
        b.wait(10)
        assert request(opus_rack, {"cmd": "fail_gpu", "gpu": "server3"})["killed"] == []
    finally:
        for p in (a, b):
            if p.poll() is None:
                p.kill()
                p.wait(10)


def test_bad_registrations_are_refused(opus_rack):
    for msg, error in (({"gpu": "gpu9", "pid": os.getpid()}, "no GPU 'gpu9'"),
                       ({"gpu": "server1", "pid": 1}, "another process"),
                       ({"gpu": "server1", "pid": "12"}, "another process"),
                       ({"gpu": "server1", "pid": 2 ** 22 + 12345}, "no process"),
                       ({"gpu": "server1", "pid": os.getppid()}, "runs this emulator")):
        with pytest.raises(ControlError, match=error):
            request(opus_rack, {"cmd": "register_process", **msg})


@pytest.mark.skipif(os.geteuid() != 0, reason="starting a process as another user needs root")
def test_a_process_of_another_user_is_refused(opus_rack):
    other = subprocess.Popen(["sleep", "60"],
                             user=65534, group=65534, cwd="/")
    try:
        with pytest.raises(ControlError, match="belongs to another user"):
            request(opus_rack, {"cmd": "register_process", "gpu": "server1", "pid": other.pid})
        assert other.poll() is None
    finally:
        other.kill()
        other.wait(10)
