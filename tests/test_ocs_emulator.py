"""Our OCS, power meter and laser drivers against the emulated instruments over real loopback
sockets; a plain pyvisa session as a lab script would use; the control endpoint; ptb emulate."""
from __future__ import annotations

import json
import os
import pathlib
import signal
import socket
import stat
import subprocess
import sys
import time

import pytest
import pyvisa

from photonic_testbed.drivers.laser import Laser
from photonic_testbed.drivers.ocs import OpticalCircuitSwitch
from photonic_testbed.drivers.power_meter import PowerMeter
from photonic_testbed.drivers.scpi import DataOutOfRange, IllegalParameterValue, UndefinedHeader
from photonic_testbed.emulator.bench_optics import LASER_INGRESS
from photonic_testbed.emulator.control import ControlError, request
from photonic_testbed.emulator.rig import EmulatedRig
from photonic_testbed.hil.rig import rig_spec
from tests.timeouts import DEVICE_S

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture
def rig():
    with EmulatedRig(rig_spec("opus"), seed=5, switching_s=0.0) as r:
        yield r


def ctl(rig, **msg):
    return request(rig.endpoints["control"], msg)


def moves(rig) -> int:
    return ctl(rig, cmd="truth")["ocs"]["moves"]


@pytest.fixture
def ocs(rig):
    with OpticalCircuitSwitch(rig.endpoints["ocs"], timeout_s=10.0) as d:
        yield d


def perm(seed: int, n: int = 32) -> dict[int, int]:
    import random
    outs = list(range(n + 1, 2 * n + 1))
    random.Random(seed).shuffle(outs)
    return dict(zip(range(1, n + 1), outs, strict=True))


def test_apply_reads_back_and_moves_only_the_difference(rig, ocs):
    assert ocs.ports == 32 and "N-OST-32x32" in ocs.identity
    first = perm(1)
    report = ocs.apply(first)
    assert report.added == first and report.removed == {}
    assert ocs.circuits() == first
    assert moves(rig) == 32
    second = dict(first)
    second[1], second[2] = first[2], first[1]
    report = ocs.apply(second)
    assert report.added == {1: first[2], 2: first[1]}
    assert moves(rig) == 32 + 4              # two broken, two made; the other 30 untouched
    assert ocs.connected_port(1) == first[2] and ocs.connected_port(first[1]) == 2
    truth = ctl(rig, cmd="truth")["ocs"]
    assert {int(k): v for k, v in truth["commanded"].items()} == second


def test_conflicting_add_is_refused_and_changes_nothing(rig, ocs):
    ocs.connect(1, 33)
    with pytest.raises(IllegalParameterValue) as err:
        ocs.connect_many({2: 34, 3: 33})
    assert "33" in str(err.value)
    assert ocs.circuits() == {1: 33}
    ocs.disconnect(1)
    assert ocs.circuits() == {}
    ocs.connect_many({1: 33, 2: 34})
    ocs.disconnect_many({1: 33})
    assert ocs.circuits() == {2: 34}
    ocs.disconnect_all()
    assert ocs.circuits() == {}


@pytest.mark.parametrize("when", ["after", "before"])
def test_drop_in_the_middle_of_a_bulk_reconfiguration(rig, ocs, when):
    first, second = perm(2), perm(3)
    ocs.apply(first)
    start = moves(rig)
    ctl(rig, cmd="drop", device="ocs", when=when, header="CONN:ONLY")
    ocs.apply(second)
    assert ocs.reconnects == 1
    truth = ctl(rig, cmd="truth")["ocs"]
    assert {int(k): v for k, v in truth["commanded"].items()} == second
    diff = sum(1 for i in first if first[i] != second[i])
    assert truth["moves"] - start == 2 * diff          # each changed circuit broken and made once
    assert ocs.circuits() == second


def test_reboot_loses_circuits_and_reconcile_restores_them(rig, ocs):
    want = perm(4)
    ocs.apply(want)
    ctl(rig, cmd="reboot", device="ocs")
    assert ocs.circuits() == {}                        # reconnected, and the switch forgot
    assert ocs.reconnects == 1
    before = moves(rig)
    report = ocs.reconcile(want)
    assert report.added == want
    assert moves(rig) - before == 32
    assert ocs.circuits() == want


def test_light_follows_the_circuit_with_port_loss(rig, ocs):
    with Laser(rig.endpoints["laser"], timeout_s=DEVICE_S) as laser, \
            PowerMeter(rig.endpoints["powermeter"], timeout_s=DEVICE_S) as pm:
        laser.set_power_mw(1.0)
        laser.on()
        pm.set_averaging_time(1, 0)
        pm.set_averaging_time(2, 0)
        ocs.apply({LASER_INGRESS: 33})
        power = ocs.port_power([LASER_INGRESS, 33, 34])
        assert power[LASER_INGRESS] == pytest.approx(0.0, abs=0.01)
        assert -1.6 < power[33] < -0.9                  # ~1-1.5 dB insertion loss
        assert power[34] == -60.0                       # the monitor's floor: no light
        on = pm.read(1)
        assert on.dbm == pytest.approx(power[33], abs=0.02)
        assert -75 < pm.read(2).dbm < -65               # the meter's noise floor
        ocs.apply({LASER_INGRESS: 34})
        assert pm.read(1).dbm < -65 and pm.read(2).dbm > -2
        laser.off()
        assert pm.read(2).dbm < -65
        pm.set_unit(2, "W")
        assert pm.read(2).mw < 1e-6


def test_power_meter_noise_and_averaging_time(rig):
    with Laser(rig.endpoints["laser"], timeout_s=DEVICE_S) as laser, \
            PowerMeter(rig.endpoints["powermeter"], timeout_s=DEVICE_S) as pm, \
            OpticalCircuitSwitch(rig.endpoints["ocs"], timeout_s=DEVICE_S) as ocs:
        laser.set_power_dbm(0)
        laser.on()
        ocs.apply({LASER_INGRESS: 33})
        pm.set_averaging_time(1, 0)
        mws = [pm.read(1).mw for _ in range(200)]
        mean = sum(mws) / len(mws)
        sd = (sum((x - mean) ** 2 for x in mws) / (len(mws) - 1)) ** 0.5
        assert 3e-4 < sd / mean < 3e-3                    # ~0.1 % relative noise
        pm.set_averaging_time(1, 0.15)
        t = time.monotonic()
        pm.read(1)
        assert time.monotonic() - t >= 0.15               # the averaging time is spent
        with pytest.raises(DataOutOfRange):
            pm.set_wavelength_nm(1, 900)


def test_switching_time_keeps_paths_dark_until_opc(rig):
    ctl(rig, cmd="switching_time", seconds=1.0)   # a wide window: no race on a busy machine
    phys = rig.optics.physics
    rig.optics.laser.state.on = True
    rm = pyvisa.ResourceManager("@py")
    s = rm.open_resource(rig.endpoints["ocs"], read_termination="\r\n", write_termination="\n",
                         timeout=3000)
    try:
        s.write(":OXC:SWIT:CONN:ADD (@1),(@40)")
        assert s.query(":OXC:SWIT:CONN:PORT? 1") == "40"
        assert phys.transfer({1: 1.0})[40] == 0.0         # still moving: no light yet
        assert s.query("*OPC?") == "1"                     # answers after the move
        assert phys.transfer({1: 1.0})[40] > 0.5
    finally:
        s.close()


def test_stuck_port_ignores_moves(rig, ocs):
    ocs.apply({1: 40})
    assert ctl(rig, cmd="stick", port=40) == [40]
    ocs.apply({1: 41})
    truth = ctl(rig, cmd="truth")["ocs"]
    assert truth["commanded"] == {"1": 41}                 # the controller believes it moved
    assert truth["actual"] == {"1": 40}                    # the light did not
    rig.optics.laser.state.on = True
    assert ocs.port_power([40, 41]) == {40: pytest.approx(-1.2, abs=0.4), 41: -60.0}
    ctl(rig, cmd="stick", port=40, stuck=False)


def test_plain_pyvisa_sessions_drive_each_instrument(rig):
    rm = pyvisa.ResourceManager("@py")
    kw = dict(read_termination="\r\n", write_termination="\r\n", timeout=10000)
    ocs = rm.open_resource(rig.endpoints["ocs"], **kw)
    pm = rm.open_resource(rig.endpoints["powermeter"], **kw)
    laser = rm.open_resource(rig.endpoints["laser"], **kw)
    try:
        assert ocs.query("*IDN?").startswith("Polatis")
        assert ocs.query(":oxc:swit:size?") == "32,32"
        ocs.write(":oxc:switch:connect:add (@1,2,3),(@33,34,35)")
        assert ocs.query(":OXC:SWITCH:CONNECT:STATE?") == "(@1,2,3),(@33,34,35)"
        ocs.write(":OXC:SWIT:CONN:SUB (@2),(@34)")
        ocs.write(":oxc:swit:conn:add (@4),(@33)")
        assert ocs.query(":SYST:ERR?").startswith("-224,")
        assert ocs.query(":syst:err?") == '0,"No error"'
        ocs.write(":OXC:SWIT:CONN:ONLY (@5),(@40);(@6),(@41)")
        assert ocs.query(":OXC:SWIT:CONN:STAT?") == "(@5,6),(@40,41)"
        assert ocs.query(":OXC:SWIT:CONN:PORT? 41") == "6"
        ocs.write(":OXC:SWIT:DISC:ALL")
        assert ocs.query(":OXC:SWIT:CONN:STAT?") == "(@),(@)"
        assert ocs.query("*OPC?") == "1"

        laser.write("sour0:wav 1560nm")
        assert float(laser.query("sour0:wav?")) == pytest.approx(1.56e-6)
        laser.write("sour0:pow 2mW")
        laser.write("sour0:pow:unit 1")
        assert float(laser.query("sour0:pow?")) == pytest.approx(2e-3)
        laser.write("sour0:pow:unit 0")
        laser.write("sour0:pow 3")                         # a bare number is in dBm now
        assert float(laser.query("sour0:pow?")) == pytest.approx(3.0)
        laser.write("sour0:pow:stat 1")
        assert laser.query("sour0:pow:stat?") == "+1"
        assert laser.query(":syst:err?") == '+0,"No error"'

        ocs.write(":OXC:SWIT:CONN:ADD (@1),(@33)")
        pm.write(":SENS1:CHAN1:POW:WAV 1310nm")
        assert float(pm.query(":SENS1:CHAN1:POW:WAV?")) == pytest.approx(1.31e-6)
        pm.write(":SENS1:POW:ATIM 0")
        pm.write(":SENS1:POW:UNIT W")
        watts = float(pm.query(":READ1:CHAN1:POW?"))
        assert 1e-3 < watts < 2e-3                        # 3 dBm less ~1.2 dB of path loss
        pm.write(":SENS1:POW:UNIT DBM")
        assert float(pm.query(":FETC1:CHAN1:POW?")) == pytest.approx(
            10 * __import__("math").log10(watts * 1e3), abs=1e-6)
        pm.write(":READ9:CHAN1:POW?")
        assert pm.query(":SYST:ERR?").startswith("-114,")
    finally:
        for s in (ocs, pm, laser):
            s.close()


def test_two_clients_are_served_concurrently_with_their_own_error_queues(rig):
    rm = pyvisa.ResourceManager("@py")
    kw = dict(read_termination="\r\n", write_termination="\n", timeout=10000)
    a = rm.open_resource(rig.endpoints["ocs"], **kw)
    b = rm.open_resource(rig.endpoints["ocs"], **kw)
    try:
        a.write(":BOGUS")
        assert b.query(":SYST:ERR?") == '0,"No error"'
        assert a.query(":SYST:ERR?").startswith("-113,")
        a.write(":OXC:SWIT:CONN:ADD (@7),(@50)")
        assert a.query("*OPC?") == "1"         # a's session has done it (sessions run apart)
        assert b.query(":OXC:SWIT:CONN:PORT? 7") == "50"
    finally:
        a.close()
        b.close()


def test_idle_drop_and_typed_errors_through_driver(rig, ocs):
    assert ctl(rig, cmd="drop", device="ocs")["dropped"] == 1
    assert ocs.circuits() == {}                             # reopened by itself
    assert ocs.reconnects == 1
    with pytest.raises(UndefinedHeader):
        ocs.command(":OXC:SWIT:FROB 1")


def test_control_endpoint_refuses_bad_requests(rig):
    with pytest.raises(ControlError, match="unknown cmd"):
        ctl(rig, cmd="explode")
    with pytest.raises(ControlError, match="device"):
        ctl(rig, cmd="reboot", device="toaster")
    # the bench's OCS checks these as the rail OCSes do (emulator/instrument_faults.py)
    for port in (999, True, None, "3"):
        with pytest.raises(ControlError, match="port must be an integer in 1..64, not"):
            ctl(rig, cmd="stick", port=port)
    with pytest.raises(ControlError, match="device must name an OCS: one of 'ocs'; not 'laser'"):
        ctl(rig, cmd="stick", device="laser", port=3)      # (the laser once had port 3 stuck)
    assert ctl(rig, cmd="switching_time", device="ocs", seconds=0.0) == {"seconds": 0.0,
                                                                         "switches": 1}
    with pytest.raises(ControlError, match="stuck is true or false"):
        ctl(rig, cmd="stick", port=3, stuck="yes")
    for seconds in (-1, True, None, "0.1", 11):
        with pytest.raises(ControlError, match="seconds must be a number in 0..10, not"):
            ctl(rig, cmd="switching_time", seconds=seconds)
    with pytest.raises(ControlError, match="header"):
        ctl(rig, cmd="drop", device="ocs", when="after")
    with pytest.raises(ControlError, match="is not a regular expression"):
        ctl(rig, cmd="drop", device="ocs", when="after", header="(")
    with pytest.raises(ControlError, match="when must be 'before' or 'after'"):
        ctl(rig, cmd="drop", device="ocs", when="later", header="OXC")
    assert ctl(rig, cmd="stick", port=3, stuck=False) == []
    assert ctl(rig, cmd="ping") == "pong"
    import zmq
    sock = zmq.Context.instance().socket(zmq.REQ)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, 3000)
    sock.connect(rig.endpoints["control"])
    sock.send(b"\xff not json")
    assert json.loads(sock.recv())["ok"] is False
    sock.close()
    truth = ctl(rig, cmd="truth")
    assert truth["laser"]["feeds_ingress"] == LASER_INGRESS
    assert truth["powermeter"]["1"]["egress"] == 33


def test_reboot_of_laser_and_meter_resets_their_settings(rig):
    with Laser(rig.endpoints["laser"], timeout_s=DEVICE_S) as laser:
        laser.set_power_mw(5)
        laser.on()
        ctl(rig, cmd="reboot", device="laser")
        assert not laser.is_on()                            # reconnected; power-on defaults
        assert laser.power_mw() == pytest.approx(1.0)


def _free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def test_ptb_emulate_opus_prints_and_writes_endpoints_then_frees_ports(tmp_path):
    ep = tmp_path / "endpoints.json"
    proc = subprocess.Popen([sys.executable, "-m", "photonic_testbed.ptb", "emulate", "--rig",
                             "opus", "--endpoints", str(ep), "--switching-ms", "0"],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": ROOT})
    try:
        for _ in range(200):
            if ep.exists() or proc.poll() is not None:
                break
            time.sleep(0.05)
        assert ep.exists(), proc.stderr.read() if proc.poll() is not None else "no endpoints"
        endpoints = json.loads(ep.read_text())
        assert set(endpoints) >= {"ocs", "powermeter", "laser", "control"}
        rm = pyvisa.ResourceManager("@py")
        for key in ("ocs", "powermeter", "laser"):
            assert endpoints[key].startswith("TCPIP::127.0.0.1::")
            s = rm.open_resource(endpoints[key], read_termination="\r\n",
                                 write_termination="\n", timeout=10000)
            assert s.query("*IDN?")
            s.close()
        assert request(endpoints["control"], {"cmd": "ping"}) == "pong"
        # the control endpoint: a socket in a folder only this user can enter
        assert endpoints["control"].startswith("ipc://")
        folder = pathlib.Path(endpoints["control"][len("ipc://"):]).parent
        assert stat.S_IMODE(folder.stat().st_mode) == 0o700
    finally:
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=10)
    assert proc.returncode == 0, err
    assert not folder.exists()                            # removed on exit
    for key in ("ocs", "powermeter", "laser"):
        assert endpoints[key] in out
        assert _free(int(endpoints[key].split("::")[2]))


def test_fixed_port_base(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        base = s.getsockname()[1]
    if not all(_free(base + k) for k in range(4)):
        pytest.skip("no four free consecutive ports here")
    try:
        r = EmulatedRig(rig_spec("opus"), port_base=base)
        r.start()
    except OSError:
        pytest.skip("a port of the range was taken meanwhile")
    try:
        assert r.endpoints["ocs"] == f"TCPIP::127.0.0.1::{base}::SOCKET"
        assert r.endpoints["laser"] == f"TCPIP::127.0.0.1::{base + 2}::SOCKET"
        assert r.endpoints["control"].startswith("ipc://")      # never on TCP
    finally:
        r.close()
    assert _free(base)


def test_bench_ocs_runs_small(tmp_path):
    import argparse

    from photonic_testbed.ptb.bench import ocs as bench_ocs
    result = bench_ocs.run(argparse.Namespace(reconfigurations=5, seed=1))
    assert result["reconfigurations"] == 5
    assert result["ours"]["bytes"] < result["per_circuit"]["bytes"]
    assert result["ours_moves_per_reconfig"] <= 64


def test_driver_rides_through_an_instrument_restart_on_the_same_port():
    import threading

    from photonic_testbed.emulator.ocs import OCSInstrument, OCSPhysics
    from photonic_testbed.emulator.scpi_server import SCPIServer

    phys = OCSPhysics(4, switching_s=0.0)
    server = SCPIServer(OCSInstrument(phys), name="ocs")
    server.start()
    port = server.port
    with OpticalCircuitSwitch(server.resource, reconnect_s=5.0, timeout_s=DEVICE_S) as drv:
        drv.apply({1: 5})
        server.close()                                  # the instrument goes away...
        again = SCPIServer(OCSInstrument(phys), port=port, name="ocs")
        timer = threading.Timer(0.3, again.start)       # ...and comes back a moment later
        timer.start()
        try:
            assert drv.circuits() == {1: 5}             # reopened by itself
            assert drv.reconnects == 1
        finally:
            timer.join()
            again.close()


class _PortByPort:
    """The emulated switch's light paths worked out one circuit at a time, as the physics
    says (a stuck port keeps its old path; a new path needs both its ends dark; every port
    of a path made or broken goes dark for the move): what `OCSPhysics` must agree with."""

    def __init__(self, n: int):
        self.n, self.commanded, self.actual, self.dark = n, {}, {}, set()
        self.stuck: set[int] = set()

    def move(self, remove: dict[int, int], add: dict[int, int]) -> None:
        self.dark = set()
        for i, e in remove.items():
            del self.commanded[i]
            if i in self.stuck or e in self.stuck:
                continue
            if self.actual.get(i) == e:
                del self.actual[i]
            self.dark |= {i, e}
        for i, e in add.items():
            self.commanded[i] = e
            if i in self.stuck or e in self.stuck or i in self.actual \
                    or e in self.actual.values():
                continue
            self.actual[i] = e
            self.dark |= {i, e}

    def replace(self, pairs: dict[int, int]) -> None:
        self.move({i: e for i, e in self.commanded.items() if pairs.get(i) != e},
                  {i: e for i, e in pairs.items() if self.commanded.get(i) != e})


def test_light_paths_after_random_moves_agree_with_a_port_by_port_model():
    import random

    from photonic_testbed.emulator.ocs import OCSPhysics
    rng = random.Random(11)
    for trial in range(300):
        n = rng.choice([2, 3, 4, 8])
        phys, model = OCSPhysics(n, seed=trial, switching_s=5.0), _PortByPort(n)
        for step in range(25):
            op = rng.random()
            if op < 0.15:                   # a port sticks, or one comes free
                port = rng.randint(1, 2 * n)
                phys.stuck.add(port)
                model.stuck.add(port)
            elif op < 0.25 and model.stuck:
                port = rng.choice(sorted(model.stuck))
                phys.stuck.discard(port)
                model.stuck.discard(port)
            elif op < 0.3:                  # a power cycle forgets every circuit
                phys.reboot()
                model.commanded.clear()
                model.actual.clear()
                model.dark = set()
                continue
            else:
                outs = list(range(n + 1, 2 * n + 1))
                rng.shuffle(outs)
                ins = rng.sample(range(1, n + 1), rng.randint(0, n))
                pairs = dict(zip(ins, outs, strict=False))   # as many as the ingress ports drawn
                before = phys._dark_until.copy()
                phys.replace(pairs)
                model.replace(pairs)
                changed = {p for p, t in phys._dark_until.items() if before.get(p) != t}
                assert changed == model.dark, (trial, step)
            assert phys.commanded == model.commanded, (trial, step)
            assert phys.actual == model.actual, (trial, step)
        lit = {1 + k: 1.0 for k in range(n)}
        assert set(phys.transfer(lit)) == set(range(n + 1, 2 * n + 1))


def test_port_lists_are_read_as_whole_numbers_however_written():
    from photonic_testbed.emulator.ocs import parse_pairs, port_list
    from photonic_testbed.emulator.scpi import SCPIError
    assert port_list("1,2,3") == [1, 2, 3]
    assert port_list(" 3 , 01,2:4") == [3, 1, 2, 3, 4]
    assert port_list("") == []
    assert port_list("-2") == [-2]
    big = "1" * 23                      # past 64 bits: an int, as the user wrote it
    assert port_list(big) == [int(big)] and type(port_list(big)[0]) is int
    with pytest.raises(SCPIError, match=f"ingress port {big} is not in 1..32"):
        parse_pairs(f"(@{big}),(@33)", 32)
    for bad, code in (("1,,2", -104), ("1,x", -104), ("4:2", -222)):
        with pytest.raises(SCPIError) as e:
            port_list(bad)
        assert e.value.code == code, bad
