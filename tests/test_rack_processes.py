"""The emulated rack takes a process down with its GPU: a process registers itself on a GPU with
`register_process` on the control endpoint; `fail_gpu` SIGKILLs it (as a GPU falling off the
bus ends the process using it). Nothing else can be aimed at: a thread, the emulator itself, its
ancestors, another user's process, or a process that did not register itself are refused, and
the endpoint is reached only through a folder of its user's."""
from __future__ import annotations

import os
import pathlib
import shutil
import stat
import subprocess
import sys

import pytest

from photonic_testbed.emulator.control import ControlError, request
from photonic_testbed.emulator.rig import EmulatedRig
from photonic_testbed.hil import rig as rigfile
from photonic_testbed.hil.rig import rig_spec

ROOT = pathlib.Path(__file__).resolve().parents[1]

# A process that registers itself on a GPU, says so, and waits to be killed.
SELF_REGISTERING = """
import os, sys, time
from photonic_testbed.hil.lab.control_client import request
got = request(sys.argv[1], {"cmd": "register_process", "gpu": sys.argv[2], "pid": os.getpid()},
              timeout_s=30)
print(got["gpu"], flush=True)
time.sleep(120)
"""


@pytest.fixture
def opus():
    with EmulatedRig(rig_spec("opus"), switching_s=0.0) as emu:
        bus = rigfile.for_emulator("opus", emu.endpoints)
        emu.start_rack(bus.gpus_endpoints(), None)
        yield emu


def _registered(endpoint: str, gpu: str) -> subprocess.Popen:
    """A process that registered itself on `gpu` (its answer read, bounded by its own
    request's timeout: a refusal ends it with an error instead)."""
    proc = subprocess.Popen([sys.executable, "-c", SELF_REGISTERING, endpoint, gpu], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    line = proc.stdout.readline() if proc.stdout else ""
    if line.strip() != gpu:
        proc.kill()
        raise AssertionError(f"the process did not register itself on {gpu}: "
                             f"{proc.communicate(timeout=10)[1]}")
    return proc


def _sleeper(**kwargs) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], **kwargs)


def _end(*procs: subprocess.Popen) -> None:
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.wait(10)


def test_fail_gpu_kills_the_process_that_registered_itself(opus):
    endpoint = opus.endpoints["control"]
    a, b = _registered(endpoint, "server2"), _registered(endpoint, "server3")
    try:
        out = request(endpoint, {"cmd": "fail_gpu", "gpu": "server2"})
        assert out["killed"] == [a.pid] and "server2" in out["gpus"]
        assert a.wait(10) == -9
        assert b.poll() is None                        # another GPU's process lives on
        # a process that ended by itself is not killed again (nor a reused pid)
        b.kill()
        b.wait(10)
        assert request(endpoint, {"cmd": "fail_gpu", "gpu": "server3"})["killed"] == []
    finally:
        _end(a, b)


def test_bad_registrations_are_refused(opus):
    endpoint = opus.endpoints["control"]
    for msg, error in (({"gpu": "gpu9", "pid": os.getpid()}, "no GPU 'gpu9'"),
                       ({"gpu": "server1", "pid": 1}, "another process"),
                       ({"gpu": "server1", "pid": "12"}, "another process"),
                       ({"gpu": "server1", "pid": 2 ** 22 + 12345}, "no process"),
                       ({"gpu": "server1", "pid": os.getppid()}, "runs this emulator")):
        with pytest.raises(ControlError, match=error):
            request(endpoint, {"cmd": "register_process", **msg})


def test_a_thread_the_emulator_or_a_process_that_did_not_register_itself_is_never_killed(opus):
    """The emulator runs in this test's process: its control thread's id and its own pid, sent
    from here, and a process this test started, named by this test."""
    endpoint = opus.endpoints["control"]
    thread = opus.control.thread_id
    assert thread is not None and thread != os.getpid()
    other = _sleeper()
    try:
        for gpu, pid, error in (("server1", thread, f"{thread} is a thread of process "
                                                    f"{os.getpid()}, not a process"),
                                ("server2", os.getpid(), "is this emulator"),
                                ("server3", other.pid, f"process {os.getpid()} asked to register "
                                                       f"process {other.pid}: a process "
                                                       "registers itself only")):
            with pytest.raises(ControlError, match=error):
                request(endpoint, {"cmd": "register_process", "gpu": gpu, "pid": pid})
        for gpu in ("server1", "server2", "server3"):
            assert request(endpoint, {"cmd": "fail_gpu", "gpu": gpu})["killed"] == []
        assert other.poll() is None
    finally:
        _end(other)


def test_the_endpoint_is_a_socket_in_a_folder_only_its_user_can_enter(opus):
    endpoint = opus.endpoints["control"]
    folder = opus.control.folder
    assert folder is not None and endpoint == f"ipc://{folder}/control"
    st = folder.stat()
    assert stat.S_IMODE(st.st_mode) == 0o700 and st.st_uid == os.getuid()
    assert stat.S_ISSOCK((folder / "control").stat().st_mode)
    opus.close()
    assert not folder.exists()                          # removed with the emulator


ROOT_ONLY = pytest.mark.skipif(os.geteuid() != 0,
                               reason="starting a process as another user needs root")


@ROOT_ONLY
def test_a_process_of_another_user_is_refused(opus):
    other = subprocess.Popen(["sleep", "120"], user=65534, group=65534, cwd="/")
    try:
        with pytest.raises(ControlError, match="belongs to another user"):
            request(opus.endpoints["control"],
                    {"cmd": "register_process", "gpu": "server1", "pid": other.pid})
        assert request(opus.endpoints["control"],
                       {"cmd": "fail_gpu", "gpu": "server1"})["killed"] == []
        assert other.poll() is None
    finally:
        _end(other)


@ROOT_ONLY
def test_another_user_cannot_reach_the_endpoint(opus):
    path = str(opus.control.folder / "control")
    code = ("import socket, sys\n"
            "s = socket.socket(socket.AF_UNIX)\n"
            "try:\n"
            "    s.connect(sys.argv[1])\n"
            "except PermissionError:\n"
            "    print('refused')\n"
            "else:\n"
            "    print('connected')\n")
    # a Python that user may run (this test's may sit in a folder of root's)
    python = shutil.which("python3", path=os.defpath)
    if python is None:
        pytest.skip(f"no python3 on {os.defpath} for another user to run")
    out = subprocess.run([python, "-c", code, path], user=65534, group=65534, cwd="/",
                         capture_output=True, text=True, timeout=30)
    assert out.stdout.strip() == "refused", out.stderr
