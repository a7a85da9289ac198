"""`ptb leco`: the opus rig's instruments as LECO actors (hil.bridges.leco), driven by a pyleco
client through a LECO coordinator on loopback: the laser set, an OCS circuit made, the meter
read, and what an actor refuses."""
from __future__ import annotations

import os
import pathlib
import queue
import subprocess
import sys
import threading

import pytest

pytest.importorskip("pyleco")

from pyleco.directors.director import Director  # noqa: E402
from pyleco.json_utils.errors import JSONRPCError  # noqa: E402

from photonic_testbed.emulator.rig import EmulatedRig  # noqa: E402
from photonic_testbed.hil import rig as rigfile  # noqa: E402
from photonic_testbed.hil.bridges import leco  # noqa: E402
from photonic_testbed.hil.bus.client import ServiceClient  # noqa: E402
from photonic_testbed.hil.rig import rig_spec  # noqa: E402
from photonic_testbed.hil.rig.emulated import free_port  # noqa: E402
from tests.test_bus import Supervised  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parent.parent
ASK_S = 20.0           # a LECO request's deadline here (pyleco's own default is 0.1 s)


def _ptb(*args) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.Popen([sys.executable, "-m", "photonic_testbed.ptb", *args], cwd=ROOT,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _lines(proc) -> queue.Queue:
    q: queue.Queue = queue.Queue()

    def read():
        for line in proc.stdout:
            q.put(line)
        q.put(None)
    threading.Thread(target=read, daemon=True).start()
    return q


def _wait_for(q: queue.Queue, text: str, timeout: float = 60.0) -> str:
    seen = []
    while True:
        line = q.get(timeout=timeout)
        if line is None:
            raise AssertionError(f"ended before {text!r}:\n{''.join(seen)}")
        seen.append(line)
        if text in line:
            return line


@pytest.fixture
def opus_over_leco(tmp_path):
    with EmulatedRig(rig_spec("opus"), seed=6, switching_s=0.0) as emulated:
        rig = rigfile.for_emulator("opus", emulated.endpoints)
        path = tmp_path / "opus.toml"
        rigfile.write(path, rig)
        port = free_port()
        routing = threading.Event()
        leco.start_coordinator("127.0.0.1", port, "lab", routing)
        with Supervised(rig.service_specs()) as supervised:
            proc = _ptb("leco", "--rig", str(path), "--coordinator", f"127.0.0.1:{port}")
            try:
                _wait_for(_lines(proc), "signed in")
                yield rig, supervised, port, proc
            finally:
                proc.terminate()
                proc.wait(30)
                routing.set()


def _director(actor: str, port: int) -> Director:
    return Director(actor=actor, name=f"test-{actor}", host="127.0.0.1", port=port,
                    timeout=ASK_S)


def test_a_leco_client_sets_the_laser_and_reads_the_meter(opus_over_leco):
    rig, supervised, port, proc = opus_over_leco
    laser, ocs, meter = (_director(n, port) for n in ("laser", "ocs", "powermeter"))
    with laser, ocs, meter, ServiceClient(supervised.endpoints["laser"][0], timeout=5) as bus, \
            ServiceClient(supervised.endpoints["powermeter"][0], timeout=5) as bus_meter:
        laser.set_parameters({"output": True, "power_mw": 2.0, "wavelength_nm": 1550.0})
        state = bus.call("read_laser")                     # what the laser itself says
        assert state["on"] is True and state["power_mw"] == pytest.approx(2.0)
        assert laser.get_parameters(["output", "power_dbm"]) == {
            "output": True, "power_dbm": pytest.approx(3.0103, abs=1e-3)}
        # the laser feeds ingress 1; meter port 1 reads egress 33
        ocs.call_action("connect", 1, 33)
        assert ocs.get_parameters(["circuits"])["circuits"] == {"1": 33}
        assert ocs.get_parameters(["port_map"])["port_map"][:2] == [33, 0]
        got = meter.get_parameters(["ports", "power_mw"])
        assert got["ports"] == 4 and len(got["power_mw"]) == 4
        direct = bus_meter.call("read_power", channels=[1])["power"][1]
        assert got["power_mw"][0] == pytest.approx(direct, rel=0.02)
        assert 1.0 < direct < 2.0                         # 2 mW less the path's loss
        mw, dbm = meter.call_action("read", 1)
        assert mw == pytest.approx(direct, rel=0.02) and dbm == pytest.approx(
            10 * __import__("math").log10(mw), abs=1e-6)
        laser.call_action("off")
        assert bus.call("read_laser")["on"] is False
        assert meter.call_action("read_power", [1])["1"] < 1e-4

        # refusals come back as errors that say what is wrong; the actors go on serving
        refusals = [
            (lambda: laser.get_parameters(["colour"]), "no parameter 'colour'"),
            (lambda: meter.set_parameters({"ports": 8}), "ports is read-only"),
            (lambda: laser.set_parameters({"power_mw": 5000.0}), "power_mw"),
            (lambda: laser.set_parameters({"power_mw": -1.0}), "it must be at least 0 mW"),
            (lambda: laser.call_action("set"), "no action 'set'"),
            (lambda: meter.call_action("read", 9), "port 9 is not in 1..4"),
            (lambda: ocs.call_action("connect", 1), "connect"),
            (lambda: ocs.set_parameters({"circuits": {"1": 40, "2": 40}}), "40"),
            (lambda: ocs.call_action("disconnect", 5), "input 5 has no circuit"),
            (lambda: meter.call_action("connect"), "no action 'connect'"),
        ]
        for ask, says in refusals:
            with pytest.raises(JSONRPCError) as e:
                ask()
            assert says in str(e.value.rpc_error), (says, e.value.rpc_error)
        assert ocs.get_parameters(["circuits"])["circuits"] == {"1": 33}
        assert laser.get_parameters(["power_mw"])["power_mw"] == pytest.approx(2.0)
    assert proc.poll() is None


def test_what_a_leco_client_may_not_do_to_ptb_leco(opus_over_leco):
    """Bytes that are no message, pyleco's own `shut_down` and polling, settings of which one
    is refused, a port read thousands of times: refused or dropped; every actor serves on."""
    from pyleco.core.message import MessageTypes
    rig, supervised, port, proc = opus_over_leco
    laser, ocs, meter = (_director(n, port) for n in ("laser", "ocs", "powermeter"))
    with laser, ocs, meter:
        laser.set_parameters({"power_mw": 2.0, "wavelength_nm": 1550.0})
        for payload in (b"\xff\xfe{", b"[" * 100_000 + b"]" * 100_000, b"5"):
            ocs.send(data=payload, message_type=MessageTypes.JSON)
        for ask, says in (
                (lambda: laser.ask_rpc("shut_down"), "Method not found"),
                (lambda: meter.ask_rpc("start_polling", polling_interval=0.001),
                 "Method not found"),
                (lambda: meter.ask_rpc("set_log_level", level="DEBUG"), "Method not found"),
                (lambda: meter.ask_rpc("get_parameters", parameters=["ports"], bogus=1),
                 "unexpected keyword argument 'bogus'"),
                (lambda: laser.set_parameters({"power_mw": 3.0, "output": None}),
                 "output needs a value"),
                (lambda: ocs.call_action("apply", {"\uff11": 17}), "must be a whole number"),
                (lambda: laser.set_parameters({"wavelength_nm": 5.0}), "Invalid params"),
                # one setting refused: none made
                (lambda: laser.set_parameters({"power_mw": 1.5, "wavelength_nm": 5}),
                 "wavelength_nm"),
                (lambda: meter.call_action("read_power", [1] * 4096), "4096 ports asked"),
                (lambda: meter.call_action("read_power", [1, 1]), "port 1 asked twice"),
                (lambda: ocs.call_action("apply", {"1": 33.5}),
                 "ocs: an output must be a whole number from 1, not 33.5"),
                (lambda: laser.call_action("set_power_dbm", 1e6), "beyond any laser"),
        ):
            with pytest.raises(JSONRPCError) as e:
                ask()
            assert says in str(e.value.rpc_error), (says, e.value.rpc_error)
        assert laser.get_parameters(["power_mw", "wavelength_nm"]) == {
            "power_mw": pytest.approx(2.0), "wavelength_nm": pytest.approx(1550.0)}
        assert ocs.get_parameters(["ports"]) == {"ports": 32}
        assert len(meter.get_parameters(["power_mw"])["power_mw"]) == 4
        # a name asked a thousand times is one measurement of the 4 ports (0.1 s each), not
        # a thousand (past the request's 20 s deadline)
        assert len(meter.get_parameters(["power_mw"] * 1000)["power_mw"]) == 4
    assert proc.poll() is None


def test_ptb_leco_stops_at_once_when_asked_while_it_waits_for_the_devices(tmp_path):
    """Ctrl-C (SIGINT) or SIGTERM while it waits for services that are not up: it stops
    then, not at the end of --wait."""
    import signal
    import time
    path = tmp_path / "opus.toml"
    with EmulatedRig(rig_spec("opus"), seed=6) as emulated:
        rigfile.write(path, rigfile.for_emulator("opus", emulated.endpoints))
    port = free_port()
    routing = threading.Event()
    leco.start_coordinator("127.0.0.1", port, "lab", routing)
    try:
        for sig in (signal.SIGINT, signal.SIGTERM):
            proc = _ptb("leco", "--rig", str(path), "--coordinator", f"127.0.0.1:{port}",
                        "--wait", "600")
            time.sleep(2.0)                  # it waits for the services (none runs)
            t = time.monotonic()
            proc.send_signal(sig)
            out, _ = proc.communicate(timeout=120)
            assert proc.returncode == 0, out
            assert "stopped before the actors were up" in out
            assert time.monotonic() - t < 60     # not the 600 s of --wait
    finally:
        routing.set()


def test_ptb_leco_says_what_is_missing(tmp_path):
    path = tmp_path / "opus.toml"
    with EmulatedRig(rig_spec("opus"), seed=6) as emulated:
        rigfile.write(path, rigfile.for_emulator("opus", emulated.endpoints))
    # no coordinator at that address
    port = free_port()
    out = subprocess.run([sys.executable, "-m", "photonic_testbed.ptb", "leco", "--rig",
                          str(path), "--coordinator", f"127.0.0.1:{port}", "--wait", "1"],
                         cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)),
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 1
    assert "no LECO coordinator answers at 127.0.0.1" in out.stderr + out.stdout
    bad = subprocess.run([sys.executable, "-m", "photonic_testbed.ptb", "leco", "--rig",
                          str(path), "--coordinator", "nowhere"],
                         cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)),
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 1 and "--coordinator is HOST:PORT" in bad.stderr + bad.stdout
