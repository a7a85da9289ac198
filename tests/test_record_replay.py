"""Sessions of clients we did not write, recorded through `ptb record` and replayed with
`ptb replay`, against the emulated lumion rig (issue 19): the unmodified `qontrol` client on
the heater DAC and plain pyvisa on the OCS. A fresh emulator answers every exchange as
recorded; one with a fault injected (a stuck OCS port) or another board is named at its first
differing exchange; and the recorded devices play back to the client under test.

tests/sessions/ holds two such sessions, recorded by these same clients through `ptb record`:
`session_fixture` turns each into a regression test of the emulator."""
from __future__ import annotations

import contextlib
import json
import os
import pathlib
import signal
import subprocess
import sys
import time

import pytest

from photonic_testbed.drivers.laser import Laser
from photonic_testbed.emulator.rig import EmulatedRig
from photonic_testbed.hil.lab.replayer import ScriptedDevices
from photonic_testbed.hil.lab.session import Session
from photonic_testbed.hil.rig import rig_spec
from photonic_testbed.ptb.replay import _wait_for_power_up, replay_on_emulator, session_fixture
from tests.timeouts import DEVICE_S

qontrol = pytest.importorskip("qontrol")
pyvisa = pytest.importorskip("pyvisa")

ROOT = pathlib.Path(__file__).resolve().parents[1]
SESSIONS = pathlib.Path(__file__).resolve().parent / "sessions"
START_S = 60                      # generous: a busy 2-core machine starts processes slowly
SEED = 3
# The qontrol client waits this long for each answer (and once, at start, for stale bytes):
# generous, so that a busy machine does not make it retry and change the session.
QONTROL_TIMEOUT_S = 1.0


def _ptb(*args) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.Popen([sys.executable, "-m", "photonic_testbed.ptb", *args], cwd=ROOT,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)


def _run(*args, timeout=120) -> tuple[int, str]:
    proc = _ptb(*args)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
        raise AssertionError(f"ptb {' '.join(args)} did not finish:\n{out}") from None
    return proc.returncode, out


def laser_on(endpoints: dict) -> None:
    """The bench the OCS sessions were recorded on: the laser on ingress 1 at 1 mW."""
    laser = Laser(endpoints["laser"], timeout_s=DEVICE_S)
    try:
        laser.set_power_mw(1.0)
        laser.on()
    finally:
        laser.close()


@contextlib.contextmanager
def lumion(tmp_path, seed: int = SEED, light: bool = False):
    """A fresh emulated lumion rig, its endpoints file written, its board powered up."""
    workdir = tmp_path / f"rig{time.time_ns()}"
    workdir.mkdir()
    rig = EmulatedRig(rig_spec("lumion"), seed=seed, workdir=workdir)
    with rig:
        _wait_for_power_up(rig.dac)
        if light:
            laser_on(rig.endpoints)
        path = rig.workdir / "endpoints.json"
        rig.write_endpoints(path)
        yield rig, path


@contextlib.contextmanager
def recording(endpoints: pathlib.Path, out: pathlib.Path):
    """`ptb record --endpoints ...` running; yields the relays' endpoints."""
    relays = out.with_suffix(".relays.json")
    proc = _ptb("record", "--endpoints", str(endpoints), "--out", str(out),
                "--write-endpoints", str(relays))
    try:
        deadline = time.monotonic() + START_S
        while not relays.exists():
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[0]
            time.sleep(0.05)
        yield json.loads(relays.read_text())
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
        try:
            text = proc.communicate(timeout=30)[0]
        except subprocess.TimeoutExpired:
            proc.kill()
            text = proc.communicate()[0]
    assert proc.returncode == 0 and "Traceback" not in text, text
    assert f"written to {out}" in text


def qontrol_client(port: str, volts: float = 1.5) -> list:
    """What a user of the qontrol library does: open, set a heater, read it back."""
    q = qontrol.QXOutput(serial_port_name=port, response_timeout=QONTROL_TIMEOUT_S)
    try:
        q.v[3] = volts
        return [q.n_chs, q.v[3], q.i[3], q.get_all_values("V")[:4]]
    finally:
        q.close()


def pyvisa_client(resource: str) -> list[str]:
    """Plain pyvisa on the OCS (explicit terminations): who are you, one circuit, its light."""
    rm = pyvisa.ResourceManager("@py")
    ocs = rm.open_resource(resource, read_termination="\n", write_termination="\n",
                           timeout=10_000)
    try:
        out = [ocs.query("*IDN?"), ocs.query(":OXC:SWIT:SIZE?")]
        ocs.write(":OXC:SWIT:CONN:ADD (@1),(@17)")
        out += [ocs.query("*OPC?"), ocs.query(":OXC:SWIT:CONN:STAT?"),
                ocs.query(":PMON:POW? (@1,17)"), ocs.query(":SYST:ERR?")]
        return [s.strip() for s in out]
    finally:
        ocs.close()


def test_a_qontrol_session_replays_on_a_fresh_board_and_names_another_board(tmp_path):
    session_path = tmp_path / "qontrol.jsonl"
    with lumion(tmp_path) as (rig, endpoints):
        with recording(endpoints, session_path) as relays:
            n, v3, i3, first4 = qontrol_client(relays["dac"])
        assert n == 56 and v3 == 1.5 and first4 == [0.0, 0.0, 0.0, 1.5]
        assert i3 == pytest.approx(1500.0 / rig.dac.resistances[3], abs=2e-3)
    session = Session.load(session_path)
    sent = [x.sent for x in session.exchanges()]
    assert sent[:3] == [b"id?\n", b"nup=0\n", b"nupall?\n"] and b"V3=1.5\n" in sent
    assert all(x.answer for x in session.exchanges())          # the board answers every line

    with lumion(tmp_path) as (_, endpoints):
        code, out = _run("replay", str(session_path), "--endpoints", str(endpoints))
    assert code == 0 and "every one of the answers as recorded" in out, out

    with lumion(tmp_path, seed=SEED + 1) as (_, endpoints):      # another board of the type
        code, out = _run("replay", str(session_path), "--endpoints", str(endpoints),
                         "--report", str(tmp_path / "report.json"))
    assert code == 3, out
    assert ("first difference: exchange 1 (dac, connection 1; session line 3, t = "
            in out), out
    assert "sent 'id?\\n'; recorded answer 'Q8iv-0301\\n', got 'Q8iv-0401\\n'" in out
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["first"] == 1 and not report["ok"]
    assert any(d["sent"] == "I3?\n" for d in report["differences"])   # its heater differs

    # the recorded board plays back to the client under test: as before, then changed
    with ScriptedDevices(session) as board:
        assert qontrol_client(board.addresses["dac"]) == [n, v3, i3, first4]
        assert board.wait(30)
    assert board.report.ok, board.report.describe()
    with ScriptedDevices(session) as board:
        with pytest.raises(RuntimeError, match="Timed out"):    # no answer to the change
            qontrol_client(board.addresses["dac"], volts=2.5)
    first = board.report.first
    assert first.side == "client" and first.exchange.sent == b"V3=1.5\n"
    assert "the client sent 'V3=2.5\\n'" in board.report.describe()


def test_a_pyvisa_ocs_session_replays_and_a_stuck_port_is_named(tmp_path):
    session_path = tmp_path / "ocs.jsonl"
    with lumion(tmp_path, light=True) as (_, endpoints):
        with recording(endpoints, session_path) as relays:
            answers = pyvisa_client(relays["ocs"])
    assert answers[2:4] == ["1", "(@1),(@17)"] and answers[5] == '0,"No error"'
    lit = [float(x) for x in answers[4].split(",")]
    assert -3.0 < lit[1] < 0.0                  # the laser's light through the new circuit

    with lumion(tmp_path, light=True) as (_, endpoints):
        code, out = _run("replay", str(session_path), "--endpoints", str(endpoints))
    assert code == 0 and "6 exchanges replayed, every one of the answers" in out, out

    with lumion(tmp_path, light=True) as (rig, endpoints):
        from photonic_testbed.emulator.control import request
        request(rig.endpoints["control"], {"cmd": "stick", "port": 1})
        code, out = _run("replay", str(session_path), "--endpoints", str(endpoints))
    assert code == 3, out
    first = next(line for line in out.splitlines() if line.startswith("first difference"))
    assert "(ocs, connection 1; session line " in first
    assert f"sent ':PMON:POW? (@1,17)\\n'; recorded answer '{answers[4]}\\r\\n', got " \
        f"'{answers[4].split(',')[0]},-60.00\\r\\n'" in first
    assert "1 of 6 exchanges differ" in out

    # a dropped connection (armed on a header) is named at the line that met it
    report = replay_on_emulator(session_path, rig="lumion", seed=SEED, prepare=laser_on,
                                control=[{"cmd": "drop", "device": "ocs", "when": "before",
                                          "header": "CONN:STAT"}])
    assert report.first.exchange.sent == b":OXC:SWIT:CONN:STAT?\n"
    assert report.first.note == "the device closed the connection"


# ---- recorded sessions as regression tests (tests/sessions/) -------------------------------------

qontrol_session = session_fixture(SESSIONS / "qontrol-lumion-seed3.jsonl", rig="lumion",
                                  seed=SEED)
ocs_session = session_fixture(SESSIONS / "pyvisa-ocs-lumion-seed3.jsonl", rig="lumion",
                              seed=SEED, prepare=laser_on)


def test_the_recorded_qontrol_session_still_replays(qontrol_session):
    assert qontrol_session.ok, qontrol_session.describe()


def test_the_recorded_ocs_session_still_replays(ocs_session):
    assert ocs_session.ok, ocs_session.describe()
