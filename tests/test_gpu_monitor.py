"""The real host's GPU monitor (`ptb gpus`): DDM from `ethtool -m`, the rig file's NVML and
transceiver keys, and the monitor on the bus (fake NVML, recorded ethtool outputs, 127.0.0.1)
seen as the agent sees it."""
from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import pathlib
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from photonic_testbed.hil import rig as rigfile
from photonic_testbed.hil.bus.client import BadRequest, RemoteError, ServiceClient
from photonic_testbed.hil.bus.mirror import StateSubscriber
from photonic_testbed.hil.bus.server import Server
from photonic_testbed.hil.gpus.ddm import (
    DARK_DBM,
    DdmError,
    DdmReader,
    parse_ethtool_module,
    run_ethtool,
)
from photonic_testbed.hil.gpus.health import GpuHealth, GpuHealthUnavailable, NvmlHealth
from photonic_testbed.hil.gpus.monitor import GpuMonitor, GpuMonitorError, map_nvml
from photonic_testbed.hil.rig import GpuConfig, RigFileError
from tests.test_gpu_health import fake_nvml

ROOT = pathlib.Path(__file__).resolve().parent.parent
SAMPLES = pathlib.Path(__file__).resolve().parent / "ethtool"
UUID = "GPU-5f1c2a9e-0b7d-4c33-9e41-7a2d6b0c8f15"


def sample(name: str) -> str:
    return (SAMPLES / name).read_text()


def _until(cond, timeout=10.0, what="condition", poll=None):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if poll is not None:
            poll()
        got = cond()
        if got:
            return got
        time.sleep(0.01)
    raise AssertionError(f"{what} not reached within {timeout} s")


# ---- DDM: ethtool -m output ---------------------------------------------------------------------

def test_sff8472_sfp_one_receiver():
    rx = parse_ethtool_module(sample("sfp_sff8472.txt"), "ens1f0")
    assert rx.kind == "average" and len(rx.lanes_mw) == 1
    assert rx.dbm() == pytest.approx(-3.40, abs=0.005)       # the printed dBm, not the threshold
    dark = parse_ethtool_module(sample("sfp_sff8472_dark.txt"), "ens1f0")
    assert dark.lanes_mw == (0.0,) and dark.dbm() == DARK_DBM


def test_sff8636_qsfp28_lanes_and_their_sum():
    rx = parse_ethtool_module(sample("qsfp28_sff8636.txt"), "ens2")   # "power(Channel n)"
    assert len(rx.lanes_mw) == 4
    assert rx.dbm(2) == pytest.approx(-6.20, abs=0.005)
    total = sum(10 ** (d / 10) for d in (-6.00, -6.20, -6.08, -5.85))
    assert rx.dbm() == pytest.approx(10 * math.log10(total), abs=0.01)
    with pytest.raises(DdmError, match=r"4 receiver lane\(s\), 1..4; no lane 5"):
        rx.dbm(5)


def test_cmis_lanes_some_dark():
    rx = parse_ethtool_module(sample("qsfpdd_cmis.txt"), "ens3")      # "power (Channel n)"
    assert [round(rx.dbm(k), 2) for k in (1, 2, 3, 4)] == [-1.0, -2.0, DARK_DBM, DARK_DBM]


def test_oma_and_modules_without_diagnostics():
    assert parse_ethtool_module(sample("qsfp_oma.txt")).kind == "oma"
    with pytest.raises(DdmError, match="no optical diagnostics"):
        parse_ethtool_module(sample("sfp_no_diagnostics.txt"), "ens4")
    with pytest.raises(DdmError, match="printed nothing"):
        parse_ethtool_module("", "ens4")
    with pytest.raises(DdmError, match="no received-power line.*begins 'Settings for ens4:'"):
        parse_ethtool_module("Settings for ens4:\n\tSpeed: 100000Mb/s\n", "ens4")


@pytest.mark.parametrize("value, message", [
    ("n/a", "cannot read a power"),
    ("12.5 mW / 57.00 dBm", "not a plausible reading"),
    ("-1.0000 mW", "not a plausible reading"),
])
def test_unreadable_power_lines_are_errors(value, message):
    text = f"\tReceiver signal average optical power     : {value}\n"
    with pytest.raises(DdmError, match=message):
        parse_ethtool_module(text, "ens5")


def test_mixed_or_repeated_lanes_are_errors():
    line = "\tRcvr signal avg optical power (Channel 1) : 0.5000 mW / -3.01 dBm\n"
    with pytest.raises(DdmError, match="lane 1 twice"):
        parse_ethtool_module(line * 2)
    with pytest.raises(DdmError, match="both per-lane and whole-module"):
        parse_ethtool_module(line + sample("sfp_sff8472.txt"))
    huge = "\tRcvr signal avg optical power (Channel " + "9" * 5000 + ") : 0.5 mW\n"
    with pytest.raises(DdmError, match="no received-power line"):
        parse_ethtool_module(huge)
    # channels numbered from 0 (some ethtool builds): lane 1 is the first printed
    zero = (line.replace("Channel 1", "Channel 0")
            + line.replace("0.5000 mW / -3.01", "0.2500 mW / -6.02"))
    assert [round(parse_ethtool_module(zero).dbm(k), 2) for k in (1, 2)] == [-3.01, -6.02]


@settings(max_examples=200, deadline=None)
@given(st.text(max_size=400))
def test_garbage_gives_a_reading_or_a_ddm_error_never_a_crash(text):
    try:
        rx = parse_ethtool_module(text, "x")
    except DdmError:
        return
    assert all(mw >= 0 and math.isfinite(mw) for mw in rx.lanes_mw)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.text(alphabet=" \t:/()-.0123456789mWdBinfChanel", max_size=30), max_size=6))
def test_near_miss_power_lines_never_crash(values):
    text = "".join(f"\tRcvr signal avg optical power (Channel {i + 1}) : {v}\n"
                   for i, v in enumerate(values))
    try:
        parse_ethtool_module(text, "x")
    except DdmError:
        pass


def _script(tmp_path, name: str, body: str) -> str:
    path = tmp_path / name
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(0o755)
    return str(path)


def test_running_ethtool_missing_failing_slow_or_working(tmp_path):
    with pytest.raises(DdmError, match="not found .*install ethtool"):
        run_ethtool("ens1f0", ethtool=str(tmp_path / "no-ethtool"))
    failing = _script(tmp_path, "ethtool-fails",
                      'echo "netlink error: Operation not supported" >&2; exit 75\n')
    with pytest.raises(DdmError, match=r"failed \(exit 75\): netlink error: Operation not "):
        run_ethtool("ens1f0", ethtool=failing)
    slow = _script(tmp_path, "ethtool-hangs", "exec sleep 30\n")
    with pytest.raises(DdmError, match="did not finish within 0.2 s"):
        run_ethtool("ens1f0", ethtool=slow, timeout_s=0.2)
    garbage = _script(tmp_path, "ethtool-garbage", "head -c 300 /dev/urandom\n")
    reader = DdmReader(ethtool=garbage)
    try:
        assert isinstance(reader.read_many(["ens1f0"])["ens1f0"], DdmError)
    finally:
        reader.close()
    works = _script(tmp_path, "ethtool", f'[ "$1" = "-m" ] && cat "{SAMPLES}/$2.txt"\n')
    reader = DdmReader(ethtool=works)
    try:
        got = reader.read_many(["qsfpdd_cmis", "sfp_sff8472", "nothing"])
    finally:
        reader.close()
    assert got["qsfpdd_cmis"].dbm(1) == pytest.approx(-1.0)
    assert got["sfp_sff8472"].dbm() == pytest.approx(-3.40, abs=0.005)
    assert isinstance(got["nothing"], DdmError) and "exit 1" in str(got["nothing"])


# ---- the rig file: which NVML GPU and which transceiver each rig GPU is ------------------------

RIG = textwrap.dedent(f"""\
    [rig]
    name = "host-a"

    [bus]
    curve = false
    gpus_request = "tcp://127.0.0.1:0"
    gpus_publish = "tcp://127.0.0.1:0"

    [devices.ocs]
    kind = "switch"
    driver = "photonic_testbed.drivers.ocs:OpticalCircuitSwitch"
    address = "TCPIP::127.0.0.1::5025::SOCKET"
    request = "tcp://127.0.0.1:0"
    publish = "tcp://127.0.0.1:0"

    [[gpus]]
    name = "gpu0"
    switch = "ocs"
    port = 1
    host = "node0"
    nvml = 0
    iface = "ens1f0"

    [[gpus]]
    name = "gpu1"
    switch = "ocs"
    port = 2
    host = "node0"
    nvml = "{UUID}"
    iface = "ens2"
    lane = 2

    [[gpus]]
    name = "spare0"
    switch = "ocs"
    port = 3
    spare = true
    host = "node0"
    nvml = 2
    iface = "ens3"
    lane = 3
    """)


def test_rig_file_names_nvml_gpus_and_transceivers():
    rig = rigfile.parse(RIG)
    assert [(g.nvml, g.iface, g.lane) for g in rig.gpus] == [
        (0, "ens1f0", None), (UUID, "ens2", 2), (2, "ens3", 3)]
    assert rigfile.parse(rigfile.dumps(rig)) == rig
    # the same index on another host is another GPU
    other = RIG.replace('host = "node0"\nnvml = 2', 'host = "node1"\nnvml = 0')
    assert rigfile.parse(other).gpus[2].nvml == 0


@pytest.mark.parametrize("edit, message", [
    (("nvml = 0", "nvml = -1"), r"<rig>:21: gpus.nvml: expected an NVML index >= 0"),
    (("nvml = 0", "nvml = true"), r"gpus.nvml: expected the GPU's NVML index .* got True"),
    (("nvml = 0", 'nvml = "gpu0"'), r"gpus.nvml: expected an NVML index \(0, 1, \.\.\.\) or a "
                                    r"GPU UUID .*nvidia-smi -L.* got 'gpu0'"),
    (("nvml = 2", "nvml = 0"), r"gpus.nvml: expected an NVML GPU no other rig GPU of host node0 "
                               r"is mapped to \(gpu0 has it\), got 0"),
    (("nvml = 2", f'nvml = "GPU-{UUID[4:].upper()}"'), r"\(gpu1 has it\)"),
    (('iface = "ens3"', 'iface = "../eth0"'), r"gpus.iface: expected a Linux interface name"),
    (('iface = "ens3"', 'iface = "an-interface-name-too-long"'), r"gpus.iface: expected a Linux"),
    (('iface = "ens3"\nlane = 3', 'lane = 3'), r"gpus.lane: expected an `iface` too"),
    (("lane = 3", "lane = 0"), r"gpus.lane: expected a lane number >= 1, got 0"),
    (('iface = "ens3"\nlane = 3', 'iface = "ens2"\nlane = 2'),
     r"gpus.iface: expected a transceiver lane of its own \(gpu1 reads ens2 lane 2\)"),
    (('iface = "ens3"\nlane = 3', 'iface = "ens1f0"'),
     r"gpus.iface: expected a transceiver lane of its own \(gpu0 reads ens1f0\)"),
    (("lane = 3", "lanes = 3"), r"gpus.lanes: expected one of the keys"),
])
def test_bad_gpu_mappings_are_refused_clearly(edit, message):
    assert edit[0] in RIG
    with pytest.raises(RigFileError, match=message):
        rigfile.parse(RIG.replace(edit[0], edit[1], 1))


def test_nvml_mapping_against_the_gpus_this_host_has():
    rig = rigfile.parse(RIG)
    uuids = ["GPU-0", UUID.lower(), "GPU-2"]
    assert map_nvml(rig.gpus, uuids) == {"GPU-0": "gpu0", UUID.lower(): "gpu1",
                                         "GPU-2": "spare0"}
    with pytest.raises(GpuMonitorError, match=r"spare0: nvml = 2, but NVML sees 2 GPU\(s\) "
                                              r"here, indices 0..1"):
        map_nvml(rig.gpus, uuids[:2])
    with pytest.raises(GpuMonitorError, match=r"gpu1: nvml = 'GPU-5f1c.*' is not a GPU of this "
                                              r"host; NVML sees 0: GPU-0, 1: GPU-1, 2: GPU-2"):
        map_nvml(rig.gpus, ["GPU-0", "GPU-1", "GPU-2"])
    with pytest.raises(GpuMonitorError, match="rig GPUs gpu1 and spare0 are both NVML GPU"):
        map_nvml(rig.gpus, ["GPU-0", "GPU-1", UUID])


# ---- the monitor on the bus ---------------------------------------------------------------------

class Host:
    """A fake NVML host: GPUs 0..2 (GPU 1's UUID is the rig's), counters the test changes."""

    def __init__(self):
        self.temps = [45, 50, 55]
        self.replays = [0, 0, 0]
        self.lost: set[int] = set()
        self.nvml, self.xids = fake_nvml(temps=self.temps, ecc=[0, 0, 0])
        nvml = self.nvml
        uuids = {0: "GPU-0", 1: UUID, 2: "GPU-2"}

        def temperature(h, sensor):
            if h in self.lost:
                raise nvml.NVMLError_GpuIsLost()
            return self.temps[h]
        nvml.nvmlDeviceGetUUID = lambda h: uuids[h].encode()
        nvml.nvmlDeviceGetTemperature = temperature
        nvml.nvmlDeviceGetPcieReplayCounter = lambda h: self.replays[h]


TRANSCEIVERS = {"ens1f0": "sfp_sff8472.txt", "ens2": "qsfp28_sff8636.txt",
                "ens3": "qsfpdd_cmis.txt"}


def recorded_ethtool(broken: set[str]):
    def run(iface: str) -> str:
        if iface in broken:
            raise DdmError(f"`ethtool -m {iface}` did not finish within 1 s")
        return sample(TRANSCEIVERS[iface])
    return run


@contextlib.contextmanager
def running_monitor(run_ethtool):
    """A monitor of RIG on a fake NVML host, its loop on a thread: (monitor, host, endpoints)."""
    host = Host()
    health = NvmlHealth(host.nvml)
    mon = GpuMonitor(rigfile.parse(RIG), nvml=health, ddm=DdmReader(run_ethtool),
                     switch_ports={"ocs": 8}, poll_s=0.02, tick_s=0.005)
    endpoints = mon.start()
    stop = threading.Event()
    thread = threading.Thread(target=mon.run, args=(stop,), daemon=True)
    thread.start()
    try:
        yield mon, host, endpoints
    finally:
        stop.set()
        thread.join(timeout=5)
        mon.close()
        health.close()


@pytest.fixture
def monitor():
    broken: set[str] = set()
    with running_monitor(recorded_ethtool(broken)) as (mon, host, endpoints):
        yield mon, host, broken, endpoints


def test_a_failed_gpu_reaches_a_subscriber_as_the_agent_sees_it(monitor):
    mon, host, _, (request, publish) = monitor
    deltas = []
    sub = StateSubscriber({"gpus": (request, publish)}, telemetry=False,
                          on_state=lambda dev, state, ops: deltas.append(ops))
    try:
        assert sub.wait_synced(10.0)
        state = sub.state("gpus")
        assert set(state) == {"gpus"} and set(state["gpus"]) == {"gpu0", "gpu1", "spare0"}
        for name, h in state["gpus"].items():
            assert set(h) == set(GpuHealth("x", "ok").to_dict())     # the emulator's fields
            assert h["gpu"] == name and h["state"] == "ok"
        # GPU 1 counts NVLink errors since boot (6), but they do not grow: not degraded
        assert state["gpus"]["gpu1"]["nvlink_errors"] == 0

        host.xids.append((0, 79))                        # Xid 79: fallen off the bus
        _until(lambda: sub.state("gpus")["gpus"]["gpu0"]["state"] == "failed",
               what="gpu0 failed", poll=lambda: sub.poll(0.01))
        h = GpuHealth(**{**sub.state("gpus")["gpus"]["gpu0"],
                         "reasons": tuple(sub.state("gpus")["gpus"]["gpu0"]["reasons"])})
        assert h.reasons == ("fatal Xid 79",) and h.xids == [79]
        assert [op for ops in deltas if ops for op in ops][-1].path == ["gpus", "gpu0"]

        # a fatal Xid stays: later polls keep gpu0 failed; other GPUs change on their own
        host.temps[2] = 91
        _until(lambda: sub.state("gpus")["gpus"]["spare0"]["state"] == "degraded",
               what="spare0 degraded", poll=lambda: sub.poll(0.01))
        assert sub.state("gpus")["gpus"]["spare0"]["reasons"] == ["temperature 91 C"]
        assert sub.state("gpus")["gpus"]["gpu0"]["state"] == "failed"

        with ServiceClient(request, timeout=5.0) as client:
            assert client.call("clear_gpu", gpu="gpu0") == {"gpu": "gpu0", "cleared_xids": [79]}
            with pytest.raises(RemoteError, match="GpuMonitorError: clear_gpu takes a GPU"):
                client.call("clear_gpu", gpu="gpu9")
        _until(lambda: sub.state("gpus")["gpus"]["gpu0"]["state"] == "ok",
               what="gpu0 cleared", poll=lambda: sub.poll(0.01))

        host.replays[1] = 4                              # PCIe replays growing: degraded
        host.lost.add(2)                                 # GPU 2 is lost
        _until(lambda: (sub.state("gpus")["gpus"]["gpu1"]["state"],
                        sub.state("gpus")["gpus"]["spare0"]["state"]) == ("degraded", "failed"),
               what="gpu1 degraded, spare0 lost", poll=lambda: sub.poll(0.01))
        assert sub.state("gpus")["gpus"]["gpu1"]["reasons"] == ["4 PCIe replays"]
        assert "lost" in sub.state("gpus")["gpus"]["spare0"]["reasons"][0]
    finally:
        sub.close()


def test_a_slow_transceiver_read_does_not_hold_up_a_failure():
    """rx_power runs ethtool on a worker: while a slow module is being read, an Xid still
    reaches the subscribers, and the power arrives when the read is done."""
    released = threading.Event()

    def slow(iface):
        released.wait(10)                       # held until the failure has been seen
        return sample(TRANSCEIVERS[iface])
    with running_monitor(slow) as (mon, host, (request, publish)):
        sub = StateSubscriber({"gpus": (request, publish)}, telemetry=False)
        try:
            assert sub.wait_synced(10.0)
            with ServiceClient(request, timeout=10.0) as client:
                rid = client.send("rx_power", {"switch": "ocs", "ports": [9]}, wait=5.0)
                host.xids.append((0, 79))
                _until(lambda: sub.state("gpus")["gpus"]["gpu0"]["state"] == "failed",
                       what="gpu0 failed while ethtool runs", poll=lambda: sub.poll(0.01))
                assert client.call("ping")["device"] == "gpus"  # other requests answered too
                released.set()
                got = client.receive(rid, time.monotonic() + 10.0)
            assert got["dbm"] == {"9": pytest.approx(-3.4, abs=0.01)}
        finally:
            released.set()
            sub.close()


def test_rx_power_from_the_transceivers(monitor):
    mon, host, broken, (request, _) = monitor
    with ServiceClient(request, timeout=5.0) as client:
        got = client.call("rx_power", switch="ocs", ports=[9, 10, 11])
        assert got == {"dbm": {9: -3.4, 10: -6.2, 11: DARK_DBM}}   # spare0's lane 3 dark
        described = client.call("describe")["gpus"]
        assert described["gpu1"] == {"nvml": UUID, "switch": "ocs", "port": 2, "iface": "ens2",
                                     "lane": 2}
        got = client.call("rx_power", switch="ocs", ports=[9, 12])
        assert got["dbm"] == {9: -3.4, 12: DARK_DBM}
        assert "no transceiver of this monitor on output 12" in got["errors"][12]
        broken.add("ens1f0")
        got = client.call("rx_power", switch="ocs", ports=[9, 10])
        assert got["dbm"] == {9: DARK_DBM, 10: -6.2}
        assert got["errors"] == {9: "gpu0: `ethtool -m ens1f0` did not finish within 1 s"}
        with pytest.raises(RemoteError, match=r"rx_power takes a switch of \['ocs'\]"):
            client.call("rx_power", switch="chip", ports=[9])
        with pytest.raises(RemoteError, match=r"ports \[3\] are not outputs 9..16 of switch ocs"):
            client.call("rx_power", switch="ocs", ports=[3, 9])
        with pytest.raises(BadRequest, match=r"Expected `int`, got `str` \(at ports\[0\]\)"):
            client.call("rx_power", switch="ocs", ports=["9"])


def test_held_xids_and_growing_counters_over_time():
    """Non-fatal Xids show for xid_hold_s; PCIe replays count over the last window_s (a fake
    clock, no sockets: `_check` is what each poll runs)."""
    host = Host()
    health = NvmlHealth(host.nvml)
    now = [1000.0]
    mon = GpuMonitor(rigfile.parse(RIG), nvml=health, switch_ports={"ocs": 8}, xid_hold_s=60,
                     window_s=30, clock=lambda: now[0])
    try:
        def states():
            mon._check()
            return {n: (t.last.state, t.last.reasons) for n, t in mon._tracks.items()}
        host.xids.append((0, 13))
        health.wait_xid(0)
        assert states()["gpu0"] == ("degraded", ("Xid 13",))
        now[0] += 59
        assert states()["gpu0"] == ("degraded", ("Xid 13",))
        now[0] += 2
        assert states()["gpu0"] == ("ok", ())
        host.replays[1] = 100                   # 100 replays since the last poll
        assert states()["gpu1"] == ("degraded", ("100 PCIe replays",))
        now[0] += 20
        host.replays[1] = 103
        assert states()["gpu1"] == ("degraded", ("103 PCIe replays",))
        now[0] += 20                            # the first 100 left the window
        assert states()["gpu1"] == ("degraded", ("3 PCIe replays",))
        now[0] += 31
        assert states()["gpu1"] == ("ok", ())
        host.replays[1] = 0                     # driver reloaded: counters start again
        assert states()["gpu1"] == ("ok", ())
    finally:
        mon.close()
        health.close()


def test_a_monitor_refuses_rigs_that_do_not_fit_this_host():
    rig = rigfile.parse(RIG)
    host = Host()
    health = NvmlHealth(host.nvml)
    try:
        with pytest.raises(GpuMonitorError, match=r"no \[\[gpus\]\] of rig host-a has host = "
                                                  r"'node7'; hosts: node0"):
            GpuMonitor(rig, nvml=health, host="node7")
        bare = rigfile.parse("\n".join(ln for ln in RIG.splitlines()
                                       if not ln.startswith(("nvml", "iface", "lane"))))
        with pytest.raises(GpuMonitorError, match="says which NVML GPU it is"):
            GpuMonitor(bare, nvml=health)
        with pytest.raises(GpuMonitorError, match="nothing to monitor"):
            GpuMonitor(bare, nvml=None)
        two_hosts = rigfile.parse(RIG.replace('host = "node0"\nnvml = 2',
                                              'host = "node1"\nnvml = 2'))
        with pytest.raises(GpuMonitorError, match=r"sit on hosts node0, node1: say which one "
                                                  r"this is \(--host NAME\)"):
            GpuMonitor(two_hosts, nvml=health)
        mon = GpuMonitor(two_hosts, nvml=health, host="node1", switch_ports={"ocs": 8})
        assert mon.names == {"GPU-2": "spare0"} and list(mon.transceivers) == [("ocs", 3)]
        mon.close()
    finally:
        health.close()


# ---- ptb gpus ------------------------------------------------------------------------------------

def test_ptb_gpus_without_nvml_says_so(tmp_path, capsys):
    try:
        NvmlHealth().close()
    except GpuHealthUnavailable:
        pass
    else:
        pytest.skip("this machine has NVML: `ptb gpus` would run")
    from photonic_testbed.ptb.cli import main
    path = tmp_path / "rig.toml"
    path.write_text(RIG)
    assert main(["gpus", "--rig", str(path)]) == 1
    err = capsys.readouterr().err
    assert "ptb gpus: no GPU health here:" in err and "--no-nvml" in err


@pytest.fixture
def switch_service():
    """A stand-in for the switch's service: its snapshot says how many ports it has."""
    server = Server("ocs", {"ports": 8, "circuits": []})
    request, publish = server.bind()
    stop = threading.Event()

    def loop():
        while not stop.is_set():
            server.poll(0.01)
    thread = threading.Thread(target=loop, daemon=True)
    thread.start()
    yield request, publish
    stop.set()
    thread.join(timeout=5)
    server.close()


def test_ptb_gpus_no_nvml_serves_ddm_through_ethtool(tmp_path, switch_service):
    ethtool = _script(tmp_path, "ethtool", 'case "$2" in\n'
                      f'  ens1f0) cat "{SAMPLES}/sfp_sff8472.txt" ;;\n'
                      f'  ens2) cat "{SAMPLES}/qsfp28_sff8636.txt" ;;\n'
                      '  *) echo "Cannot get module EEPROM information: No such device" >&2;'
                      ' exit 1 ;;\nesac\n')
    request = f"tcp://127.0.0.1:{rigfile.free_port()}"
    text = (RIG.replace('gpus_request = "tcp://127.0.0.1:0"', f'gpus_request = "{request}"')
            .replace('gpus_publish = "tcp://127.0.0.1:0"',
                     f'gpus_publish = "tcp://127.0.0.1:{rigfile.free_port()}"')
            .replace('\nrequest = "tcp://127.0.0.1:0"', f'\nrequest = "{switch_service[0]}"')
            .replace('\npublish = "tcp://127.0.0.1:0"', f'\npublish = "{switch_service[1]}"'))
    path = tmp_path / "rig.toml"
    path.write_text(text)
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.Popen([sys.executable, "-m", "photonic_testbed.ptb", "gpus", "--rig",
                             str(path), "--no-nvml", "--ethtool", ethtool], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        with ServiceClient(request, timeout=20.0) as client:
            got = client.call("rx_power", switch="ocs", ports=[9, 10, 11])
            assert client.call("snapshot")["state"] == {"gpus": {}}
    finally:
        proc.send_signal(signal.SIGTERM)
        out = proc.communicate(timeout=20)[0]
    assert got["dbm"] == {9: -3.4, 10: -6.2, 11: DARK_DBM}, out
    assert "No such device" in got["errors"][11]
    assert proc.returncode == 0, out
    assert "0 GPU(s), 3 transceiver(s)" in out and "stopped" in out


# ---- the agent, unchanged, on this monitor -------------------------------------------------------

def _ep():
    return f"tcp://127.0.0.1:{rigfile.free_port()}"


def _agent_rig(text: str) -> str:
    """RIG with free loopback endpoints, an in-memory switch and the spare hearing on lane 1."""
    return (text.replace('driver = "photonic_testbed.drivers.ocs:OpticalCircuitSwitch"',
                         'driver = "tests.bus_doubles:MemorySwitch"\noptions = { ports = 8 }')
            .replace('gpus_request = "tcp://127.0.0.1:0"',
                     f'gpus_request = "{_ep()}"\nagent_request = "{_ep()}"')
            .replace('gpus_publish = "tcp://127.0.0.1:0"',
                     f'gpus_publish = "{_ep()}"\nagent_publish = "{_ep()}"')
            .replace('\nrequest = "tcp://127.0.0.1:0"', f'\nrequest = "{_ep()}"')
            .replace('\npublish = "tcp://127.0.0.1:0"', f'\npublish = "{_ep()}"')
            .replace('lane = 3', 'lane = 1'))


def _swap_on_monitors(tmp_path, rig, hosts: dict):
    """`AgentProcess` (as `ptb agent` runs it) against a switch service and one monitor per
    entry of `hosts` ({host name or None: fake NVML Host}): Xid 79 on gpu0 -> the agent swaps
    the spare in, verifies the circuits with rx_power read from the transceivers' DDM, and
    orders the job's restart. Returns the agent's state after the swap."""
    from photonic_testbed.common.jobplan import dp_ring
    from photonic_testbed.hil.agent.bus import AgentProcess
    from photonic_testbed.hil.devices.service import DeviceService
    from photonic_testbed.hil.job.fabric_client import Fabric

    stop = threading.Event()
    threads, monitors, healths = [], [], []

    def spawn(fn):
        t = threading.Thread(target=fn, args=(stop,), daemon=True)
        t.start()
        threads.append(t)

    service = DeviceService(rig.service_specs(["ocs"])[0])
    for name, host in hosts.items():
        healths.append(NvmlHealth(host.nvml))
        monitors.append(GpuMonitor(rig, nvml=healths[-1], host=name, poll_s=0.05,
                                   ddm=DdmReader(recorded_ethtool(set()))))
    agent = AgentProcess(rig, str(tmp_path / "journal.db"))
    fabric = None
    try:
        service.bind()
        spawn(service.serve)
        for mon in monitors:
            mon.start()
            spawn(mon.run)
        agent.start()
        spawn(agent.run)
        fabric = Fabric(*rig.agent_endpoints(), timeout=10)
        rank_map = fabric.admit(dp_ring(2))
        assert sorted(rank_map.values()) == ["gpu0", "gpu1"]
        assert fabric.phase("dp")["granted"]

        next(iter(hosts.values())).xids.append((0, 79))       # gpu0 is NVML GPU 0
        order = fabric.wait_restart(timeout=20)
        assert order is not None, "no restart order"
        new_map, cause = order
        assert sorted(new_map.values()) == ["gpu1", "spare0"] and "gpu0" in cause
        with ServiceClient(rig.agent_endpoints()[0], timeout=5) as c:
            state = c.call("snapshot")["state"]
        rack = {g["name"]: g for g in state["rack"]}
        assert rack["gpu0"]["health"] == "failed" and rack["spare0"]["role"] == "in_use_spare"
        assert not state["alarms"]                    # the circuits verified by light
        return state
    finally:
        if fabric is not None:
            fabric.close()
        stop.set()
        for t in threads:
            t.join(timeout=5)
        agent.close()
        for mon in monitors:
            mon.close()
        for h in healths:
            h.close()
        service.close()


def test_the_agent_swaps_a_spare_in_on_this_monitors_health_and_light(tmp_path):
    rig = rigfile.parse(_agent_rig(RIG))
    _swap_on_monitors(tmp_path, rig, {None: Host()})


MONITORS = '[monitors.node0]\nrequest = "{}"\npublish = "{}"\n\n' \
           '[monitors."node1.lab"]\nrequest = "{}"\npublish = "{}"\n'


def test_one_monitor_per_host_and_the_agent_reads_each(tmp_path):
    """The spare sits on another host: its health and its light come from that host's monitor
    (device gpus-node1.lab), gpu0's and gpu1's from node0's; the agent hears both."""
    text = _agent_rig(RIG).replace('host = "node0"\nnvml = 2', 'host = "node1.lab"\nnvml = 0')
    rig = rigfile.parse(text + "\n" + MONITORS.format(_ep(), _ep(), _ep(), _ep()))
    assert rig.gpu_monitors().keys() == {"gpus-node0", "gpus-node1.lab"}
    assert rig.monitor_of("spare0") == "gpus-node1.lab"
    assert rigfile.parse(rigfile.dumps(rig)) == rig
    with pytest.raises(GpuMonitorError, match=r"node0, node1.lab: say which one this is"):
        GpuMonitor(rig, nvml=None)                  # refused before it opens a DDM reader
    with pytest.raises(GpuMonitorError, match=r"\[monitors\]: node0, node1.lab\): say which "
                                              r"one this is \(--host NAME\), not 'node7'"):
        GpuMonitor(dataclasses.replace(rig, gpus=rig.gpus + (GpuConfig("x", "ocs", 7,
                                                                       host="node7"),)),
                   nvml=None, host="node7")
    state = _swap_on_monitors(tmp_path, rig, {"node0": Host(), "node1.lab": Host()})
    verified = [e for e in state["events"] if e["kind"] == "verified"][-1]
    assert set(verified["details"]["dbm"]) == {"ocs:10", "ocs:11"}    # gpu1 and the spare


@pytest.mark.parametrize("edit, message", [
    (('[monitors."node1.lab"]', '[monitors.node2]\nrequest = "tcp://127.0.0.1:5"\n'
      'publish = "tcp://127.0.0.1:6"\n\n[monitors."node1.lab"]'),
     r"monitors.node2: expected a host some \[\[gpus\]\] sits on \(host = 'node2'\)"),
    (('publish = "tcp://127.0.0.1:1"', 'publish = "udp://x"'),
     r"monitors.node0.publish: expected an endpoint tcp://HOST:PORT"),
    (('host = "node1.lab"', 'host = "node3"'),
     r"gpus.host: expected one of the hosts of \[monitors\] \(node0, node1.lab\).* got 'node3'"),
    (('publish = "tcp://127.0.0.1:1"', 'publish = "tcp://10.0.0.1:1"'),
     r"bus.curve: expected true: endpoints off loopback need CURVE"),
    (('publish = "tcp://127.0.0.1:3"', 'publish = "tcp://127.0.0.1:1"'),
     r'monitors."?node1.lab"?.publish: expected an endpoint of its own '
     r"\(monitors.node0.publish has it\)"),
    (('gpus_request = "tcp://127.0.0.1:0"', 'gpus_request = "tcp://127.0.0.1:2"'),
     r"monitors.node0.request: expected an endpoint of its own \(bus.gpus_request has it\)"),
])
def test_bad_monitor_tables_are_refused_clearly(edit, message):
    text = RIG.replace('host = "node0"\nnvml = 2', 'host = "node1.lab"\nnvml = 0') + "\n" + \
        MONITORS.format("tcp://127.0.0.1:2", "tcp://127.0.0.1:1", "tcp://127.0.0.1:4",
                        "tcp://127.0.0.1:3")
    assert edit[0] in text
    with pytest.raises(RigFileError, match=message):
        rigfile.parse(text.replace(edit[0], edit[1], 1))
