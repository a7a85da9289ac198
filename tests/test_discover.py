"""`ptb discover`: what it asks (`id?`, `*IDN?` and nothing else), how it names what answers,
how it reports what does not, and the rig file it writes: on the emulated lumion and opus rigs
it finds every device, and `ptb serve` runs that rig file."""
from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import select
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest
import serial

from photonic_testbed.emulator.rig import EmulatedRig
from photonic_testbed.hil import rig as rigfile
from photonic_testbed.hil.bus.client import ServiceClient
from photonic_testbed.hil.lab.discover import (
    DAC_ID,
    DiscoveryError,
    Probe,
    discover,
    host_resource,
    probe_scpi,
    probe_serial,
    skeleton,
)
from photonic_testbed.ptb.replay import _wait_for_power_up

ROOT = pathlib.Path(__file__).resolve().parents[1]
START_S = 60


# ---- naming what answers -------------------------------------------------------------------------

def _found(kind, address, driver=""):
    return Probe("tcp", address, "found", "x", kind, driver)


def test_board_ids_and_hosts():
    assert DAC_ID.match("Q8iv-0001") and DAC_ID.match("Q8b-****")
    assert not DAC_ID.match("E90:00") and not DAC_ID.match("OK")
    assert host_resource("10.0.0.9") == "TCPIP::10.0.0.9::5025::SOCKET"
    assert host_resource("ocs.lab:6000") == "TCPIP::ocs.lab::6000::SOCKET"
    assert host_resource("[::1]:7000") == "TCPIP::::1::7000::SOCKET"
    with pytest.raises(DiscoveryError, match="not a host"):
        host_resource("tcp://x")
    with pytest.raises(DiscoveryError, match="not in 1..65535"):
        host_resource("x:99999")


def test_the_skeleton_names_devices_by_kind_and_offers_the_chip():
    probes = [Probe("serial", "/dev/ttyACM0", "found", "Q8iv-0001", "heater_dac"),
              _found("switch", "TCPIP::a::5025::SOCKET", "photonic_testbed.drivers.ocs:"
                     "OpticalCircuitSwitch"),
              _found("switch", "TCPIP::b::5025::SOCKET", "photonic_testbed.drivers.ocs:"
                     "OpticalCircuitSwitch"),
              dataclasses.replace(_found("power_meter", "TCPIP::c::5025::SOCKET"),
                                  options={"ports": 8}),
              Probe("tcp", "TCPIP::d::5025::SOCKET", "silent")]
    rig = skeleton(probes, "bench-a", base_port=6000)
    assert [(d.name, d.kind) for d in rig.devices.values()] == [
        ("heaters", "heater_dac"), ("ocs", "switch"), ("ocs2", "switch"),
        ("powermeter", "power_meter")]
    assert rig.devices["ocs2"].request == "tcp://127.0.0.1:6004" and not rig.bus.curve
    assert rig.devices["powermeter"].options == {"ports": 8}
    assert rig.agent_endpoints() == ("tcp://127.0.0.1:6008", "tcp://127.0.0.1:6009")
    again = rigfile.parse(rigfile.dumps(rig))
    assert again.devices == rig.devices and again.chip is None
    with_chip = skeleton(probes, "bench-a", chip="benes16")
    assert with_chip.devices["chip"].kind == "chip" and with_chip.chip.topology == "benes16"
    # every endpoint written out: no base port that none of them follows
    text = rigfile.dumps(with_chip)
    assert "base_port" not in text and rigfile.parse(text).endpoints() == with_chip.endpoints()
    assert rigfile.parse(text).agent_endpoints() == with_chip.agent_endpoints()
    with pytest.raises(DiscoveryError, match="no device answered"):
        skeleton(probes[-1:], "x")


# ---- what it asks, and what it says of what does not answer --------------------------------------

class FakeSerial:
    """A serial device on a pty that writes down every byte it gets; `answer` replies to
    `id?\\n` (None: silent)."""

    def __init__(self, answer: bytes | None):
        self.master, self.slave = os.openpty()
        self.path = os.ttyname(self.slave)
        self.answer = answer
        self.received = bytearray()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self):
        while not self._stop.is_set():
            if not select.select([self.master], [], [], 0.05)[0]:
                continue
            self.received += os.read(self.master, 1024)
            if self.received.endswith(b"id?\n") and self.answer is not None:
                os.write(self.master, b"E90:00\n" + self.answer)

    def close(self):
        self._stop.set()
        self._thread.join(2)
        os.close(self.master)
        os.close(self.slave)


class FakeSocket:
    """A TCP listener that writes down what it gets and answers (or not) with `answer`."""

    def __init__(self, answer: bytes | None):
        self.server = socket.create_server(("127.0.0.1", 0))
        self.port = self.server.getsockname()[1]
        self.received = bytearray()
        self.answer = answer
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self):
        try:
            conn, _ = self.server.accept()
        except OSError:
            return
        with conn:
            conn.settimeout(5)
            try:
                while not self.received.endswith(b"\n"):
                    data = conn.recv(1024)
                    if not data:
                        return
                    self.received += data
                if self.answer is not None:
                    conn.sendall(self.answer)
                conn.recv(1024)            # until the prober hangs up
            except OSError:
                pass

    @property
    def resource(self):
        return f"TCPIP::127.0.0.1::{self.port}::SOCKET"

    def close(self):
        self.server.close()


def test_a_board_is_asked_id_and_nothing_else():
    board = FakeSerial(b"Q8iv-0042\n")
    try:
        probe = probe_serial(board.path, 5.0)
        assert (probe.status, probe.kind, probe.answer) == ("found", "heater_dac", "Q8iv-0042")
        assert bytes(board.received) == b"id?\n"
    finally:
        board.close()


def test_silent_busy_and_strange_serial_ports_are_reported():
    quiet = FakeSerial(None)
    chatty = FakeSerial(b"HELLO WORLD\n")
    try:
        probe = probe_serial(quiet.path, 0.3)
        assert probe.status == "silent" and probe.detail == "no answer to id? within 0.3 s"
        assert bytes(quiet.received) == b"id?\n"
        probe = probe_serial(chatty.path, 1.0)
        assert probe.status == "unknown" and probe.answer == "HELLO WORLD"
        assert "not a device this stack drives" in probe.line()
        with serial.Serial(quiet.path, exclusive=True):        # another program holds it
            probe = probe_serial(quiet.path, 0.3)
        assert probe.status == "in use" and "another program holds it" in probe.detail
        assert probe_serial("/nonexistent/tty", 0.3).status == "error"
    finally:
        quiet.close()
        chatty.close()


def test_an_instrument_is_asked_idn_and_nothing_else():
    polatis = FakeSocket(b"Polatis,N-OST-48x48-HU1,001,6.5\r\n")
    keysight = FakeSocket(b"Keysight Technologies,N7745A,MY1,1.0\r\n")
    silent = FakeSocket(None)
    other = FakeSocket(b"ACME,Widget,1,2\r\n")
    refused = socket.create_server(("127.0.0.1", 0))
    refused_port = refused.getsockname()[1]
    refused.close()
    try:
        probes = discover(resources=[polatis.resource, keysight.resource, silent.resource,
                                     other.resource,
                                     f"TCPIP::127.0.0.1::{refused_port}::SOCKET"],
                          timeout_s=0.5)
        assert [(p.status, p.kind) for p in probes] == [
            ("found", "switch"), ("found", "power_meter"), ("silent", ""), ("unknown", ""),
            ("error", "")]
        assert probes[0].driver == "photonic_testbed.drivers.ocs:OpticalCircuitSwitch"
        assert probes[1].options == {"ports": 8}        # an N7745A: 8 ports, by its model
        assert "(8 ports, by its model)" in probes[1].line()
        assert "no answer to *IDN? within 0.5 s" in probes[2].detail
        assert "connection refused" in probes[4].detail
        for fake in (polatis, keysight, silent, other):
            assert bytes(fake.received) == b"*IDN?\n"
        assert probes[3].answer == "ACME,Widget,1,2"
        assert probe_scpi(f"TCPIP::127.0.0.1::{refused_port}::SOCKET", "tcp", 0.5).status \
            == "error"
    finally:
        for fake in (polatis, keysight, silent, other):
            fake.close()


# ---- on the emulated rigs, and the rig file it writes runs ptb serve -----------------------------

def _ptb(cwd, *args) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.Popen([sys.executable, "-m", "photonic_testbed.ptb", *args], cwd=cwd,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)


def _serve_and_ping(rig_path: pathlib.Path, tmp_path: pathlib.Path) -> dict:
    served = tmp_path / "served.json"
    proc = _ptb(tmp_path, "serve", "--rig", str(rig_path), "--one-process", "--endpoints",
                str(served))
    described = {}
    try:
        deadline = time.monotonic() + START_S
        while not served.exists():
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[0]
            time.sleep(0.05)
        for device, (request, _) in json.loads(served.read_text()).items():
            with ServiceClient(request, timeout=10) as client:
                assert client.call("ping")
                described[device] = client.call("describe")["device"]
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
        out = proc.communicate(timeout=30)[0]
    assert proc.returncode == 0 and "Traceback" not in out, out
    return described


def test_discover_finds_every_device_of_the_lumion_rig_and_its_rig_file_serves(tmp_path):
    workdir = tmp_path / "rig"
    workdir.mkdir()
    with EmulatedRig(rigfile.rig_spec("lumion"), seed=0, workdir=workdir) as rig:
        _wait_for_power_up(rig.dac)
        rig.write_endpoints(tmp_path / "endpoints.json")
        asked_before = rig.dac.bytes_in
        proc = _ptb(tmp_path, "discover", "--endpoints", "endpoints.json", "--chip", "benes16",
                    "--name", "lumion-bench")
        out = proc.communicate(timeout=120)[0]
        assert proc.returncode == 0, out
        assert rig.dac.bytes_in - asked_before == len(b"id?\n")   # it asked id? and no more
        for key in ("dac", "ocs", "powermeter", "laser"):
            assert f" {rig.endpoints[key]} " in out, out
        written = rigfile.load(tmp_path / "rig.toml")
        assert {n: d.kind for n, d in written.devices.items()} == {
            "chip": "chip", "ocs": "switch", "powermeter": "power_meter", "laser": "laser"}
        assert written.devices["chip"].address == rig.endpoints["dac"]
        assert written.chip.topology == "benes16" and written.name == "lumion-bench"
        described = _serve_and_ping(tmp_path / "rig.toml", tmp_path)
    assert described["chip"]["topology"]["name"] == "benes16"
    assert described["ocs"]["ports"] == 16


def test_discover_finds_every_device_of_the_opus_rig_from_hosts_and_its_rig_file_serves(
        tmp_path):
    with EmulatedRig(rigfile.rig_spec("opus"), seed=0) as rig:
        hosts = [rig.endpoints[k].split("::")[1] + ":" + rig.endpoints[k].split("::")[2]
                 for k in ("ocs", "powermeter", "laser")]
        proc = _ptb(tmp_path, "discover", "--no-scan", "--timeout-s", "2", *hosts,
                    "127.0.0.1:1")
        out = proc.communicate(timeout=120)[0]
        assert proc.returncode == 0, out
        assert "error    -            TCPIP::127.0.0.1::1::SOCKET" in out, out
        assert "1 address(es) gave no device" in out
        written = rigfile.load(tmp_path / "rig.toml")
        assert {n: (d.kind, d.address) for n, d in written.devices.items()} == {
            "ocs": ("switch", rig.endpoints["ocs"]),
            "powermeter": ("power_meter", rig.endpoints["powermeter"]),
            "laser": ("laser", rig.endpoints["laser"])}
        proc = _ptb(tmp_path, "discover", "--no-scan", *hosts)
        out = proc.communicate(timeout=120)[0]
        assert proc.returncode == 1 and "rig.toml exists: give --force" in out, out
        described = _serve_and_ping(tmp_path / "rig.toml", tmp_path)
    assert described["ocs"]["ports"] == 32 and described["laser"]["kind"] == "laser"


class ChattySocket:
    """An instrument that talks without end and never ends a line (or answers binary)."""

    def __init__(self, chunk: bytes, forever: bool):
        self.server = socket.create_server(("127.0.0.1", 0))
        self.port = self.server.getsockname()[1]
        self._stop = threading.Event()
        threading.Thread(target=self._serve, args=(chunk, forever), daemon=True).start()

    def _serve(self, chunk, forever):
        try:
            conn, _ = self.server.accept()
        except OSError:
            return
        with conn:
            try:
                conn.recv(64)
                conn.sendall(chunk)
                while forever and not self._stop.wait(0.01):
                    conn.sendall(chunk)
                self._stop.wait(10)
            except OSError:
                pass

    def close(self):
        self._stop.set()
        self.server.close()


def test_an_instrument_that_talks_without_a_line_end_or_in_binary_is_unknown():
    """One deadline for the whole *IDN? (pyvisa's per-read timeout restarts with every
    chunk: a device streaming without a line end held a probe 17 s at --timeout-s 1)."""
    chatty, binary = ChattySocket(b"A" * 100, True), ChattySocket(b"\xff\xfe\x00junk\n", False)
    try:
        talk = probe_scpi(f"TCPIP::127.0.0.1::{chatty.port}::SOCKET", "tcp", 0.5)
        assert talk.status == "unknown" and "no line within 0.5 s" in talk.detail
        junk = probe_scpi(f"TCPIP::127.0.0.1::{binary.port}::SOCKET", "tcp", 2.0)
        assert junk.status == "unknown" and "not text" in junk.detail, junk
    finally:
        chatty.close()
        binary.close()
