"""The chip reports the circuits it was asked for, also after its service is killed -9 and
restarted by `ptb serve`'s supervisor (it reported every path its heaters make: 16 circuits for
an 8-circuit ring, the 8 inputs left out going to the outputs left over); what was asked is kept
in the chip's memory file, believed only while the heaters still make it."""
from __future__ import annotations

import json
import os
import pathlib
import signal
import subprocess
import sys
import time

import pytest

from photonic_testbed.drivers.heater_dac import HeaterDAC
from photonic_testbed.drivers.mesh import Mesh
from photonic_testbed.emulator.rig import EmulatedRig
from photonic_testbed.hil import rig as rigfile
from photonic_testbed.hil.bus.client import ServiceClient, ServiceUnavailable
from photonic_testbed.hil.rig import rig_spec

ROOT = pathlib.Path(__file__).resolve().parents[1]
RING = {i: 16 + i % 8 + 1 for i in range(1, 9)}      # 1 -> 18, ..., 7 -> 24, 8 -> 17
WAIT_S = 60.0


@pytest.fixture
def lumion():
    with EmulatedRig(rig_spec("lumion"), seed=3, ideal_chip=True) as emu:
        yield emu


def _wire(circuits: dict[int, int]) -> list[list[int]]:
    return [[i, o] for i, o in sorted(circuits.items())]


def _service_pid(serve: subprocess.Popen) -> int:
    """The one device service `ptb serve --device chip` runs: its child that is not
    multiprocessing's resource tracker."""
    children = pathlib.Path(f"/proc/{serve.pid}/task/{serve.pid}/children").read_text().split()
    found = [int(c) for c in children
             if b"resource_tracker" not in pathlib.Path(f"/proc/{c}/cmdline").read_bytes()]
    assert len(found) == 1, f"children of ptb serve: {children}"
    return found[0]


def _wait_for(what: str, probe):
    deadline = time.monotonic() + WAIT_S
    while True:
        got = probe()
        if got is not None:
            return got
        if time.monotonic() > deadline:
            raise AssertionError(f"waited {WAIT_S:g} s for {what}")
        time.sleep(0.1)


def test_the_chip_service_killed_and_restarted_reports_the_ring_it_holds(lumion, tmp_path):
    rig = tmp_path / "rig.toml"
    rigfile.write(rig, rigfile.for_emulator(lumion.spec, lumion.endpoints))
    served = tmp_path / "served.json"
    # the chip's memory in this test's folder (XDG_RUNTIME_DIR), not the user's
    env = dict(os.environ, XDG_RUNTIME_DIR=str(tmp_path))
    serve = subprocess.Popen([sys.executable, "-m", "photonic_testbed.ptb", "serve", "--rig",
                              str(rig), "--device", "chip", "--endpoints", str(served)],
                             cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                             stderr=subprocess.PIPE, text=True)
    try:
        _wait_for("ptb serve's endpoints file",
                  lambda: served if served.exists() or serve.poll() is not None else None)
        assert serve.poll() is None, serve.stderr.read() if serve.stderr else ""
        request = json.loads(served.read_text())["chip"][0]
        with ServiceClient(request, timeout=10) as chip:
            chip.call("apply_circuits", circuits=_wire(RING))
            assert chip.call("read_circuits")["circuits"] == _wire(RING)
            first = chip.call("ping")["incarnation"]
            os.kill(_service_pid(serve), signal.SIGKILL)

            def restarted():
                try:
                    ping = chip.call("ping")
                except ServiceUnavailable:
                    return None
                return ping if ping["incarnation"] != first else None
            _wait_for("the chip service restarted by ptb serve", restarted)
            assert chip.call("read_circuits")["circuits"] == _wire(RING)
            # and the state it published from the start (what subscribers and the agent see)
            assert chip.call("snapshot")["state"]["circuits"] == _wire(RING)
    finally:
        serve.send_signal(signal.SIGTERM)
        try:
            serve.wait(30)
        except subprocess.TimeoutExpired:
            serve.kill()
            serve.wait(10)


def test_a_memory_is_believed_only_while_the_heaters_make_it(lumion, tmp_path):
    memory = tmp_path / "chip.json"
    dac = HeaterDAC(lumion.endpoints["dac"])
    dac.open()
    try:
        Mesh("benes16", dac, own_dac=False, memory=memory).apply(RING)
        everything = Mesh("benes16", dac, own_dac=False).circuits()
        assert len(everything) == 16 and RING.items() <= everything.items()
        assert Mesh("benes16", dac, own_dac=False, memory=memory).circuits() == RING
        assert Mesh("benes16", dac, own_dac=False,
                    memory=tmp_path / "none.json").circuits() == everything
        # the heaters set since (by hand, the board power-cycled): the memory is not believed
        dac.set_voltages({ch: 0.0 for ch in range(56)})
        zero = Mesh("benes16", dac, own_dac=False).circuits()
        assert Mesh("benes16", dac, own_dac=False, memory=memory).circuits() == zero
        # a damaged memory, or one of another chip, is said and not used
        for text in ("{not json", '{"chip": "benes8", "circuits": [[1, 9]]}',
                     '{"chip": "benes16", "circuits": [[1, 17], [2, 17]]}'):
            memory.write_text(text + "\n")
            assert Mesh("benes16", dac, own_dac=False, memory=memory).circuits() == zero
    finally:
        dac.close()
