"""The session file (hil.lab.session): its format, exchanges, comparisons and addresses; and the
recorder and replayer on plain loopback sockets and ptys (no emulator)."""
from __future__ import annotations

import json
import os
import socket
import threading
import time

import pytest
import serial

from photonic_testbed.hil.lab.recorder import Recorder, RecorderError
from photonic_testbed.hil.lab.replayer import ReplayError, ScriptedDevices, replay
from photonic_testbed.hil.lab.session import (
    Comparison,
    Session,
    SessionError,
    Wire,
    device_wires,
    parse_address,
)

HEADER = {"format": "ptb-session", "version": 1, "started": "2026-11-24T09:00:00.000Z",
          "devices": {"ocs": {"wire": "tcp", "address": "TCPIP::127.0.0.1::5025::SOCKET"},
                      "dac": {"wire": "serial", "address": "/dev/ttyACM0", "baud": 115200}}}


def _text(*events, end=True) -> str:
    lines = [json.dumps(HEADER)] + [json.dumps(e) for e in events]
    if end:
        lines.append(json.dumps({"t": 9.0, "event": "end"}))
    return "\n".join(lines) + "\n"


def _data(t, device, source, data, conn=1):
    return {"t": t, "device": device, "conn": conn, "from": source, "data": data}


def test_exchanges_group_what_was_sent_with_what_came_back():
    s = Session.parse(_text(
        {"t": 0.0, "device": "dac", "conn": 1, "event": "open"},
        _data(0.001, "dac", "device", "E90:00\n"),                  # before anything was asked
        _data(0.1, "dac", "client", "id"), _data(0.1, "dac", "client", "?\n"),
        _data(0.2, "dac", "device", "Q8iv-"), _data(0.3, "dac", "device", "0001\n"),
        {"t": 0.4, "device": "ocs", "conn": 1, "event": "open"},
        _data(0.5, "ocs", "client", ":OXC:SWIT:CONN:ADD (@1),(@33)\n"),   # no answer
        _data(0.6, "ocs", "client", "*OPC?\n"),
        _data(0.7, "ocs", "device", "1\r\n"),
        _data(0.8, "ocs", "client", "\xff\n"),
        {"t": 0.9, "device": "ocs", "conn": 1, "event": "close", "by": "client"}))
    xs = s.exchanges()
    assert [(x.index, x.device, x.sent, x.answer) for x in xs] == [
        (1, "dac", b"", b"E90:00\n"),
        (2, "dac", b"id?\n", b"Q8iv-0001\n"),
        (3, "ocs", b":OXC:SWIT:CONN:ADD (@1),(@33)\n*OPC?\n", b"1\r\n"),
        (4, "ocs", b"\xff\n", b"")]
    assert xs[1].line == 4 and xs[1].latency_s == pytest.approx(0.2)
    assert "exchange 2 (dac, connection 1; session line 4" in xs[1].name()
    assert s.complete and s.wire("ocs") == Wire("tcp", host="127.0.0.1", port=5025)
    kinds = [what for what, _ in s.script()]
    assert kinds == ["open", "exchange", "exchange", "open", "exchange", "exchange", "close"]


@pytest.mark.parametrize("bad, message", [
    ('{"format": "other"}', "not a ptb-session file"),
    ('{"format": "ptb-session", "version": 2, "devices": {}}', "version 2"),
    ('{"format": "ptb-session", "version": 1, "devices": {"x": {"wire": "usb"}}}',
     "device 'x'"),
    (_text(_data(0.1, "laser", "client", "x")), ":2: device 'laser' is not one"),
    (_text(_data(0.1, "dac", "host", "x")), ":2: expected \"from\""),
    (_text(_data(0.1, "dac", "client", "")), "non-empty string"),
    (_text(_data(0.1, "dac", "client", "\u0100")), "not a byte"),
    (_text(_data(0.2, "dac", "client", "a"), _data(0.1, "dac", "client", "b")),
     ":3: t = 0.1 goes back in time"),
    (_text(_data(-1, "dac", "client", "a")), "seconds >= 0"),
    (_text({"t": 0.1, "device": "dac", "conn": 0, "event": "open"}), "connection number"),
    (_text() + '{"t": 10, "event": "end"}\n', "after the session's end"),
    (json.dumps(HEADER) + "\nnot json\n", ":2: not JSON"),
    ('{"format": "ptb-session", "version": true, "devices": {}}', "version True"),
    ('{"format": "ptb-session", "version": 1, "devices": {"": {"wire": "tcp", '
     '"address": "x:1"}}}', "device name ''"),
    ('{"format": "ptb-session", "version": 1, "devices": {"../x": {"wire": "tcp", '
     '"address": "x:1"}}}', "device name '../x'"),
    (_text(_data(1e300, "dac", "client", "a")), "past a session's"),
])
def test_a_damaged_session_is_refused_with_its_line(bad, message):
    with pytest.raises(SessionError, match=message):
        Session.parse(bad, "s.jsonl")


def test_a_session_without_its_end_line_still_reads():
    s = Session.parse(_text(_data(0.1, "dac", "client", "id?\n"), end=False))
    assert not s.complete and len(s.exchanges()) == 1
    # a recorder killed mid-write: its last line cut short is left out, the rest is read
    text = _text(_data(0.1, "dac", "client", "id?\n"), _data(0.2, "dac", "device", "Q8\n"),
                 end=False)
    cut = Session.parse(text[:-9], "s.jsonl")
    assert cut.cut_line == 3 and [x.sent for x in cut.exchanges()] == [b"id?\n"]
    with pytest.raises(SessionError, match=":3: not JSON"):     # in the middle: refused
        Session.parse(text[:-9] + "\n" + json.dumps(_data(0.3, "dac", "client", "x")) + "\n")


def test_comparison_ignores_lines_and_tolerates_numbers():
    exact = Comparison()
    assert exact.same(b"+1.5000 V\n", b"+1.5000 V\n")
    assert not exact.same(b"+1.5000 V\n", b"+1.5001 V\n")
    loose = Comparison(rel_tol=1e-3)
    assert loose.same(b"-3.01234E+000,5\r\n", b"-3.01300E+000,5\r\n")
    assert not loose.same(b"-3.0 dBm\r\n", b"-3.1 dBm\r\n")
    assert not loose.same(b"-3.0 dBm\r\n", b"-3.0 W\r\n")
    assert not loose.same(b"9e999\r\n", b"1\r\n") and not loose.same(b"1\r\n", b"9e999\r\n")
    assert loose.same(b"9e999\r\n", b"9e999\r\n")      # beyond a float: the same text only
    quiet = Comparison(ignore=("^E90:00$",))
    assert quiet.same(b"E90:00\nQ8iv-0001\n", b"Q8iv-0001\n")
    with pytest.raises(SessionError, match="not a regular expression"):
        Comparison(ignore=("(",))
    with pytest.raises(SessionError, match="tolerance"):
        Comparison(rel_tol=2.0)


@pytest.mark.parametrize("text, wire", [
    ("/dev/ttyACM0", Wire("serial", path="/dev/ttyACM0")),
    ("ASRL/dev/ttyUSB1::INSTR", Wire("serial", path="/dev/ttyUSB1")),
    ("COM3", Wire("serial", path="COM3")),
    ("TCPIP::10.0.0.9::5025::SOCKET", Wire("tcp", host="10.0.0.9", port=5025)),
    ("tcpip0::[::1]::7000::socket", Wire("tcp", host="::1", port=7000)),
    ("10.0.0.9", Wire("tcp", host="10.0.0.9", port=5025)),
    ("bench-ocs:6000", Wire("tcp", host="bench-ocs", port=6000)),
])
def test_addresses(text, wire):
    assert parse_address(text, 5025) == wire


@pytest.mark.parametrize("text, message", [
    ("USB0::0x2A8D::0x1301::MY1::INSTR", "only serial ports and raw sockets"),
    ("TCPIP::h::70000::SOCKET", "not in 1..65535"),
    ("not an address!", "is not a device address"),
])
def test_bad_addresses(text, message):
    with pytest.raises(SessionError, match=message):
        parse_address(text, 5025)


def test_device_wires_from_words_endpoints_and_rig(tmp_path):
    ep = tmp_path / "endpoints.json"
    ep.write_text(json.dumps({"dac": "/tmp/x/dac", "ocs": "TCPIP::127.0.0.1::4000::SOCKET",
                              "control": "tcp://127.0.0.1:4003"}))
    wires, notes = device_wires(ep, None, ["ocs=127.0.0.1:4100"])
    assert set(wires) == {"dac", "ocs"} and wires["ocs"].port == 4100 and not notes
    with pytest.raises(SessionError, match="expected DEVICE=ADDRESS"):
        device_wires(None, None, ["127.0.0.1:4100"])
    ep.write_text("[1, 2]")
    with pytest.raises(SessionError, match="device -> address"):
        device_wires(ep)


# ---- the relays and the players on plain sockets -------------------------------------------------

class EchoDevice:
    """A line device on a loopback socket: answers `X?` with `X!\\r\\n`, `bye` by closing."""

    def __init__(self):
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.received = bytearray()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self):
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            with conn:
                buf = b""
                while True:
                    try:
                        data = conn.recv(4096)
                    except OSError:                  # reset by the relay: that connection ends
                        break
                    if not data:
                        break
                    self.received += data
                    buf += data
                    while b"\n" in buf:
                        line, buf = buf.split(b"\n", 1)
                        if line == b"bye":
                            break
                        if line.endswith(b"?"):
                            conn.sendall(line[:-1] + b"!\r\n")
                    else:
                        continue
                    break

    def close(self):
        self.listener.close()


def _ask(address: str, lines: list[bytes]) -> list[bytes]:
    wire = parse_address(address)
    with socket.create_connection((wire.host, wire.port), timeout=10) as s:
        answers = []
        f = s.makefile("rb")
        for line in lines:
            s.sendall(line)
            if line.endswith(b"?\n"):
                answers.append(f.readline())
        return answers


def test_record_then_replay_then_play_the_device(tmp_path):
    device = EchoDevice()
    path = tmp_path / "s.jsonl"
    try:
        wire = Wire("tcp", host="127.0.0.1", port=device.port)
        with Recorder(path, {"echo": wire}) as rec:
            assert _ask(rec.addresses["echo"], [b"a?\n", b"set 1\n", b"b?\n"]) == \
                [b"a!\r\n", b"b!\r\n"]
            assert _ask(rec.addresses["echo"], [b"c?\n"]) == [b"c!\r\n"]
        session = Session.load(path)
        assert session.complete
        assert [(x.conn, x.sent, x.answer) for x in session.exchanges()] == [
            (1, b"a?\n", b"a!\r\n"), (1, b"set 1\nb?\n", b"b!\r\n"), (2, b"c?\n", b"c!\r\n")]
        assert bytes(device.received) == b"a?\nset 1\nb?\nc?\n"     # every byte, unchanged

        report = replay(session, {"echo": wire})
        assert report.ok and report.played == 3, report.describe()

        # the client under test against the recorded device
        with ScriptedDevices(session) as scripted:
            address = scripted.addresses["echo"]
            assert _ask(address, [b"a", b"?\n", b"set 1\nb?\n"]) == [b"a!\r\n", b"b!\r\n"]
            assert _ask(address, [b"c?\n"]) == [b"c!\r\n"]
            assert scripted.wait(10)
        assert scripted.report.ok, scripted.report.describe()

        with ScriptedDevices(session) as scripted:
            address = scripted.addresses["echo"]
            _ask(address, [b"a?\n"])
            wire_s = parse_address(address)
            with socket.create_connection((wire_s.host, wire_s.port), timeout=10) as s:
                s.sendall(b"set 2\n")
                assert s.recv(10) == b""            # the scripted device hangs up on it
        report = scripted.report
        assert not report.ok and report.first.exchange.index == 2
        assert "the client sent 'set 2\\n'" in report.describe()
        assert "exchange 3 (echo, connection 2" in report.describe()   # never reached
    finally:
        device.close()


def test_a_device_that_sends_a_lot_and_closes_is_relayed_whole(tmp_path):
    """What the device sent before it closed reaches the client whole, as the session says,
    although the client takes it slowly (it was dropped with the connection)."""
    import random
    blob = random.Random(7).randbytes(4_000_000)
    listener = socket.create_server(("127.0.0.1", 0))

    def serve():
        conn, _ = listener.accept()
        with conn:
            conn.recv(16)
            conn.sendall(blob)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    path = tmp_path / "bulk.jsonl"
    try:
        wire = Wire("tcp", host="127.0.0.1", port=listener.getsockname()[1])
        with Recorder(path, {"bulk": wire}) as rec:
            relayed = parse_address(rec.addresses["bulk"])
            with socket.create_connection((relayed.host, relayed.port), timeout=30) as s:
                s.sendall(b"GO\n")
                time.sleep(0.5)                      # the device has sent it all and closed
                got = bytearray()
                while chunk := s.recv(65536):
                    got += chunk
        assert len(got) == len(blob) and bytes(got) == blob
        thread.join(10)
    finally:
        listener.close()
    recorded = b"".join(e.data for e in Session.load(path).events
                        if e.kind == "data" and e.source == "device")
    assert recorded == blob


class _FillingFile:
    """A session file on a disk that fills after `room` characters."""

    def __init__(self, f, room: int):
        self.f, self.room = f, room

    def write(self, text: str) -> int:
        if len(text) > self.room:
            self.f.write(text[:self.room])               # a partial line reaches the disk
            self.f.flush()
            self.room = 0
            raise OSError(28, "No space left on device")
        self.room -= len(text)
        return self.f.write(text)

    def __getattr__(self, name):
        return getattr(self.f, name)


def test_a_session_file_that_cannot_be_written_stops_the_recording_whole_lines_kept(tmp_path):
    device = EchoDevice()
    path = tmp_path / "s.jsonl"
    try:
        wire = Wire("tcp", host="127.0.0.1", port=device.port)
        rec = Recorder(path, {"echo": wire})
        rec.start()
        try:
            assert _ask(rec.addresses["echo"], [b"a?\n"]) == [b"a!\r\n"]
            deadline = time.monotonic() + 10
            while path.read_text().count("\n") < 4 and time.monotonic() < deadline:
                time.sleep(0.01)                         # open, a?, a! written
            rec.writer._file = _FillingFile(rec.writer._file, 150)
            relayed = parse_address(rec.addresses["echo"])
            with socket.create_connection((relayed.host, relayed.port), timeout=10) as s:
                for _ in range(200):
                    try:
                        s.sendall(b"x" * 100 + b"?\n")
                        if not s.recv(4096):
                            break                        # the recorder stopped relaying
                    except OSError:
                        break
                else:
                    raise AssertionError("the relay went on after the session stopped")
            assert rec.writer.failed.wait(10)
        finally:
            with pytest.raises(SessionError, match="No space left on device"):
                rec.close()
    finally:
        device.close()
    text = path.read_text()
    assert text.endswith("\n")                          # whole lines only, no end line
    session = Session.load(path)
    assert not session.complete and session.exchanges()[0].answer == b"a!\r\n"


def test_replay_names_an_answer_that_changed_and_a_device_that_hung_up(tmp_path):
    session = Session.parse(_text(
        {"t": 0.0, "device": "ocs", "conn": 1, "event": "open"},
        _data(0.1, "ocs", "client", "a?\n"), _data(0.2, "ocs", "device", "a!\r\n"),
        _data(0.3, "ocs", "client", "z?\n"), _data(0.4, "ocs", "device", "old\r\n"),
        _data(0.5, "ocs", "client", "bye\n"), _data(0.6, "ocs", "client", "b?\n"),
        _data(0.7, "ocs", "device", "b!\r\n"),
        {"t": 0.8, "device": "ocs", "conn": 1, "event": "close", "by": "client"}).replace(
        '"dac": {"wire": "serial", "address": "/dev/ttyACM0", "baud": 115200}', '"dac": '
        '{"wire": "serial", "address": "/dev/null"}'), "s.jsonl")
    device = EchoDevice()
    try:
        wires = {"ocs": Wire("tcp", host="127.0.0.1", port=device.port),
                 "dac": Wire("serial", path="/dev/null")}
        report = replay(session, wires, timeout_s=0.5)
    finally:
        device.close()
    assert [d.exchange.index for d in report.differences] == [2, 3]
    assert report.first.describe() == (
        "exchange 2 (ocs, connection 1; session line 5, t = 0.300000 s): sent 'z?\\n'; "
        "recorded answer 'old\\r\\n', got 'z!\\r\\n'")
    assert "the device closed the connection" in report.differences[1].describe()
    assert report.describe().splitlines()[1].startswith("first difference: exchange 2 ")


def test_replay_stops_waiting_on_a_device_that_went_silent(tmp_path):
    """A device that takes every line and answers none: three exchanges wait their timeout,
    the rest are reported not played rather than each waited for."""
    events = [{"t": 0.0, "device": "ocs", "conn": 1, "event": "open"}]
    for k in range(10):
        events += [_data(0.1 + 0.5 * k, "ocs", "client", f"q{k}?\n"),
                   _data(0.15 + 0.5 * k, "ocs", "device", f"a{k}\r\n")]
    session = Session.parse(_text(*events), "s.jsonl")
    listener = socket.create_server(("127.0.0.1", 0))
    taken = []

    def swallow():
        conn, _ = listener.accept()
        with conn:
            while True:
                data = conn.recv(4096)
                if not data:
                    return
                taken.append(data)
    t = threading.Thread(target=swallow, daemon=True)
    t.start()
    try:
        report = replay(session, {"ocs": Wire("tcp", host="127.0.0.1",
                                               port=listener.getsockname()[1])}, timeout_s=0.2)
    finally:
        listener.close()
        t.join(5)
    assert report.played == 3 and not report.ok
    notes = [d.note for d in report.differences]
    assert len(notes) == 10
    assert all(n.startswith("no complete answer within") for n in notes[:3])
    assert notes[3:] == ["not played: the device answered none of the last 3 exchanges on "
                         "this connection"] * 7
    assert b"".join(taken) == b"q0?\nq1?\nq2?\n"


def test_replay_refuses_a_device_it_cannot_reach(tmp_path):
    session = Session.parse(_text(_data(0.1, "ocs", "client", "a?\n")))
    with pytest.raises(ReplayError, match="no address for ocs"):     # the dac is not used
        replay(session, {"dac": Wire("serial", path="/dev/null")})
    with pytest.raises(ReplayError, match="cannot connect to TCPIP::127.0.0.1::1::SOCKET"):
        replay(session, {"ocs": Wire("tcp", host="127.0.0.1", port=1)})


def test_the_serial_relay_passes_bytes_both_ways_and_keeps_the_port_locked(tmp_path):
    """A pty stands for the device: the recorder holds its port with the lock our driver
    takes, and the client's pty carries every byte both ways."""
    master, slave = os.openpty()
    device_path = os.ttyname(slave)
    path = tmp_path / "s.jsonl"
    try:
        with Recorder(path, {"dac": Wire("serial", path=device_path)},
                      link_dir=tmp_path) as rec:
            with pytest.raises(serial.SerialException, match="exclusively lock"):
                serial.Serial(device_path, exclusive=True)
            with pytest.raises(RecorderError, match="cannot open the serial port"):
                Recorder(tmp_path / "t.jsonl", {"dac": Wire("serial", path=device_path)},
                         link_dir=tmp_path / "x").start()
            with serial.Serial(rec.addresses["dac"], 115200, timeout=10) as client:
                client.write(b"id?\n")
                got = b""
                while not got.endswith(b"\n"):
                    got += os.read(master, 64)
                assert got == b"id?\n"
                os.write(master, b"Q8iv-\xff01\n")
                assert client.readline() == b"Q8iv-\xff01\n"
        s = Session.load(path)
        assert [(x.sent, x.answer) for x in s.exchanges()] == [(b"id?\n", b"Q8iv-\xff01\n")]
        assert not (tmp_path / "dac").exists()          # the link went with the recorder
    finally:
        os.close(master)
        os.close(slave)


def test_ptb_record_relays_a_rig_file_and_runs_the_client(tmp_path):
    """`ptb record --rig r.toml --write-rig rec.toml --run CLIENT`: the client finds the relays
    in the rig file written, the recording stops when it ends, its exit code is the command's."""
    import subprocess
    import sys

    from photonic_testbed.hil import rig as rigfile
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    device = EchoDevice()
    try:
        (tmp_path / "r.toml").write_text(
            '[rig]\nname = "bench"\n[bus]\ncurve = false\n'
            f'[devices.laser]\nkind = "laser"\naddress = "TCPIP::127.0.0.1::{device.port}'
            '::SOCKET"\n')
        client = ("import socket, sys; from photonic_testbed.hil import rig; "
                  "from photonic_testbed.hil.lab.session import parse_address; "
                  "w = parse_address(rig.load('rec.toml').devices['laser'].address); "
                  "s = socket.create_connection((w.host, w.port)); s.sendall(b'p?\\n'); "
                  "assert s.makefile('rb').readline() == b'p!\\r\\n'; sys.exit(7)")
        done = subprocess.run(
            [sys.executable, "-m", "photonic_testbed.ptb", "record", "--rig", "r.toml",
             "--write-rig", "rec.toml", "--out", "s.jsonl", "--run",
             f'{sys.executable} -c "{client}"'],
            cwd=tmp_path, env=dict(os.environ, PYTHONPATH=root), capture_output=True,
            text=True, timeout=120)
    finally:
        device.close()
    assert done.returncode == 7, done.stdout + done.stderr
    assert "the client exited 7" in done.stdout and "written to s.jsonl" in done.stdout
    assert rigfile.load(tmp_path / "rec.toml").devices["laser"].address != \
        rigfile.load(tmp_path / "r.toml").devices["laser"].address
    session = Session.load(tmp_path / "s.jsonl")
    assert session.complete
    assert [(x.sent, x.answer) for x in session.exchanges()] == [(b"p?\n", b"p!\r\n")]


def test_a_scripted_serial_device_waits_for_its_client_to_read_the_last_answer(tmp_path):
    """`ptb replay --as-device --until-done` closes the devices once every exchange was
    played; a serial client still reading its last answer gets it first (closing the pty
    dropped it: the client saw EIO while the report said "as recorded")."""
    path = tmp_path / "dac.jsonl"
    lines = [{"format": "ptb-session", "version": 1, "started": "2026-11-24T00:00:00.000Z",
              "clock": "seconds since started (monotonic)",
              "devices": {"dac": {"wire": "serial", "address": "/dev/ttyACM0", "baud": 115200}}},
             {"t": 0.0, "device": "dac", "conn": 1, "event": "open"},
             {"t": 0.1, "device": "dac", "conn": 1, "from": "client", "data": "vall?\n"},
             {"t": 0.11, "device": "dac", "conn": 1, "from": "device", "data": "1.5,2.5\n"},
             {"t": 0.5, "device": "dac", "conn": 1, "event": "close", "by": "client"},
             {"t": 0.6, "event": "end"}]
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    got: list[bytes] = []
    with ScriptedDevices(Session.load(path)) as scripted:
        def client():
            with serial.Serial(scripted.addresses["dac"], 115200, timeout=10) as port:
                port.write(b"vall?\n")
                time.sleep(0.3)                      # busy elsewhere while the answer waits
                got.append(port.readline())
        thread = threading.Thread(target=client)
        thread.start()
        assert scripted.wait(20)                     # every exchange played...
        assert scripted.taken(20)                    # ...and read by its client
    thread.join(20)
    assert got == [b"1.5,2.5\n"]
    assert scripted.report.ok, scripted.report.describe()
