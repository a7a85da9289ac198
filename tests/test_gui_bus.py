"""The GUI on a rig's bus, offscreen: the emulated lumion rig's OCS and chip served by the
real device services, the agent's published state from a Server with the agent's state
shape (docs/agent-bus.md), the window opened from the rig file alone. Circuits changed by a
bus client show in the port map; the operator's commands reach the hardware as the same
request from a client would; refusals come back with their reason."""
from __future__ import annotations

import dataclasses
import os
import queue
import socket
import threading
import time

os.environ["QT_QPA_PLATFORM"] = "offscreen"

import pytest  # noqa: E402
from PySide6.QtCore import QSettings  # noqa: E402
from PySide6.QtWidgets import QMessageBox  # noqa: E402

from photonic_testbed.emulator.rig import EmulatedRig  # noqa: E402
from photonic_testbed.gui.app import rig_window  # noqa: E402
from photonic_testbed.gui.commands import Command  # noqa: E402
from photonic_testbed.gui.portmap import EMPTY, NO_POWER, circuit_colour, power_colour  # noqa: E402
from photonic_testbed.hil import rig as rigfile  # noqa: E402
from photonic_testbed.hil.agent.entries import Manual  # noqa: E402
from photonic_testbed.hil.agent.sqlite_journal import SqliteJournal  # noqa: E402
from photonic_testbed.hil.bus import schema  # noqa: E402
from photonic_testbed.hil.bus.client import ServiceClient  # noqa: E402
from photonic_testbed.hil.bus.server import Server  # noqa: E402
from photonic_testbed.hil.rig import rig_spec  # noqa: E402
from tests.test_agent_bus import _agent, _stop, lumion_bus  # noqa: E402,F401 (a fixture)
from tests.test_bus import Supervised  # noqa: E402
from tests.test_gui import _answer_dialog, assert_not_blank, colour_at, near, pixels  # noqa: E402

WAIT_MS = 8000
# The agent's ports of a rig file written at a module's start, held (bound, not listening: a
# connection is refused as if nothing were there) until a test's agent binds them: another
# process picking free ports meanwhile cannot take them.
_HELD: dict[str, socket.socket] = {}


def _hold(endpoint: str) -> None:
    host, port = endpoint.removeprefix("tcp://").rsplit(":", 1)
    held = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    held.bind((host, int(port)))
    _HELD[endpoint] = held


def _release(endpoint: str) -> None:
    held = _HELD.pop(endpoint, None)
    if held is not None:
        held.close()


def gpu(name, port, role="active", rank=None, health="ok"):
    return {"name": name, "switch": "chip", "port": port, "health": health, "role": role,
            "rank": rank}


def agent_state():
    rack = [gpu(f"gpu{i}", i + 1, rank=i) for i in range(4)] + \
           [gpu("spare0", 5, "spare"), gpu("spare1", 6, "spare")]
    return {"rack": rack, "rank_map": {str(i): f"gpu{i}" for i in range(4)}, "phase": "dp",
            "round": 0,
            "events": [{"seq": 1, "ts": time.time(), "kind": "start", "cause": "agent started",
                        "latency_s": None, "details": {}}],
            "alarms": []}


class Agent:
    """The agent's bus face: a Server named `agent` with its state shape and its `swap`
    request (the swap puts the first healthy spare in the GPU's place), on its own thread."""

    def __init__(self, endpoints, name="agent"):
        self.endpoints = endpoints
        self.server = Server(name, agent_state(), request=endpoints[0],
                                  publish=endpoints[1], heartbeat=0.1,
                                  handlers={"swap": self._swap})
        self.todo: queue.Queue = queue.Queue()
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self):
        for endpoint in self.endpoints:
            _release(endpoint)
        self.server.bind()
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join(5)
        self.server.close()

    def _run(self):
        while not self.stop.is_set():
            self.server.poll(0.02)
            while not self.todo.empty():
                self.server.update(self.todo.get())

    def _swap(self, args: schema.GpuArgs) -> dict:
        state = self.server.state.state
        rack = [dict(g) for g in state["rack"]]
        out = next((g for g in rack if g["name"] == args.gpu), None)
        if out is None or out["rank"] is None:
            raise ValueError(f"{args.gpu} holds no rank: there is nothing to swap")
        spare = next(g for g in rack if g["role"] == "spare")
        spare.update(role="in_use_spare", rank=out["rank"])
        out.update(role="active", rank=None, health="failed")
        seq = state["events"][-1]["seq"] + 1
        events = state["events"] + [{"seq": seq, "ts": time.time(), "kind": "applied",
                                     "cause": "manual swap", "latency_s": 0.042,
                                     "details": {out["name"]: spare["name"]}}]
        self.server.update({"rack": rack, "events": events,
                            "rank_map": {**state["rank_map"], str(spare["rank"]): spare["name"]}})
        return {"swaps": {out["name"]: spare["name"]}, "latency_s": 0.042}


@pytest.fixture(scope="module")
def lumion(tmp_path_factory):
    """The lumion rig's chip and OCS on the bus (its power meter and laser not served), and a
    rig file naming them all, the rack's GPUs and the agent (a rig without GPUs has none)."""
    path = tmp_path_factory.mktemp("rig") / "rig.toml"
    lay = rig_spec("lumion").rack_layout()
    gpus = tuple(rigfile.GpuConfig(g, a[0].switch, a[0].tx, g in lay.spares)
                 for g, a in lay.gpus.items())
    with EmulatedRig(rig_spec("lumion"), ideal_chip=True, switching_s=0.0) as emulated:
        rigfile.write(path, rigfile.for_emulator("lumion", emulated.endpoints, gpus=gpus))
        rig = rigfile.load(path)
        for endpoint in rig.agent_endpoints():
            _hold(endpoint)
        try:
            with Supervised(rig.service_specs(["chip", "ocs"])):
                yield rig
        finally:
            for endpoint in rig.agent_endpoints():
                _release(endpoint)


def _window(qtbot, rig, tmp_path):
    settings = QSettings(str(tmp_path / "gui.ini"), QSettings.Format.IniFormat)
    win, fabric = rig_window(rig, settings, down_after_s=0.5)
    qtbot.addWidget(win)
    win.resize(1500, 950)
    fabric.start()
    win.show()
    qtbot.waitExposed(win)
    return win, fabric


@pytest.fixture
def window(qtbot, lumion, tmp_path):
    win, fabric = _window(qtbot, lumion, tmp_path)
    yield win
    win.close()
    fabric.close()


@pytest.fixture
def bare_window(qtbot, lumion, tmp_path):
    """The window of the rig without its GPUs: no agent, so commands go to the devices."""
    win, fabric = _window(qtbot, dataclasses.replace(lumion, gpus=()), tmp_path)
    yield win
    win.close()
    fabric.close()


def client(rig, device):
    return ServiceClient(rig.devices[device].request, timeout=5.0)


def label(win, name):
    return win.services.labels[name].text() if name in win.services.labels else ""


def confirm_and_wait(qtbot, win, ask):
    """Run a manual-control form's `ask` with its confirmation accepted; the answer."""
    seen = []
    _answer_dialog(qtbot, QMessageBox.StandardButton.Ok, seen)
    with qtbot.waitSignal(win.control.answered, timeout=WAIT_MS) as got:
        assert ask()
    return got.args[0], seen[0]


def test_port_map_follows_circuits_set_by_a_bus_client(qtbot, window, lumion, tmp_path):
    win = window
    qtbot.waitUntil(lambda: {"chip", "ocs"} <= set(win.portmap.views), timeout=WAIT_MS)
    qtbot.waitUntil(lambda: label(win, "ocs").endswith("ocs: connected"), timeout=WAIT_MS)
    # Not served: shown down, while the others are connected.
    qtbot.waitUntil(lambda: label(win, "laser").endswith("laser: down"), timeout=WAIT_MS)
    ocs, chip = client(lumion, "ocs"), client(lumion, "chip")
    try:
        ocs.call("apply_circuits", circuits=[[3, 21], [5, 17]])
        chip.call("apply_circuits", circuits=[[1, 20], [2, 17]])
    finally:
        ocs.close()
        chip.close()
    view = win.portmap.views["ocs"]
    qtbot.waitUntil(lambda: win.model.switches["ocs"].circuits == {3: 21, 5: 17},
                    timeout=WAIT_MS)
    qtbot.waitUntil(lambda: not list(view.flashes.items()), timeout=WAIT_MS)
    # the switch's own port power monitors arrive as telemetry and colour its circuits
    qtbot.waitUntil(lambda: {17, 21} <= set(win.model.switches["ocs"].power_dbm),
                    timeout=WAIT_MS)
    power = win.model.switches["ocs"].power_dbm
    assert power[21] <= -50 and power[17] <= -50            # the laser is off: dark
    rgb = pixels(view, tmp_path / "ocs.png")
    assert_not_blank(rgb)
    assert near(colour_at(rgb, view.cell_rect(3, 21).center()), power_colour(power[21]), 12)
    assert near(colour_at(rgb, view.cell_rect(5, 17).center()), power_colour(power[17]), 12)
    assert not near(power_colour(power[21]), NO_POWER, 12)
    assert near(colour_at(rgb, view.cell_rect(3, 22).center()), EMPTY, 12)

    cv = win.portmap.views["chip"]
    qtbot.waitUntil(lambda: "chip" in win.model.topologies and
                    win.model.switches["chip"].circuits == {1: 20, 2: 17}, timeout=WAIT_MS)
    qtbot.waitUntil(lambda: cv.paths().get(1) is not None and cv.paths()[1].ends == {20},
                    timeout=WAIT_MS)
    assert cv.paths()[2].ends == {17}
    crossed = [c for c, s in win.model.cells["chip"].items() if s["state"] == "cross"]
    assert crossed, "routing 1->20, 2->17 crosses some cells"
    rgb = pixels(cv, tmp_path / "chip.png")
    assert_not_blank(rgb)
    links = sorted(cv.paths()[1].links)
    assert any(near(colour_at(rgb, cv.link_midpoint(i)), circuit_colour(1, 16)) for i in links)
    assert_not_blank(pixels(win, tmp_path / "window.png"), min_colours=50, min_fraction=0.2)


def test_manual_control_through_the_gui_equals_the_same_request_from_a_client(
        qtbot, bare_window, lumion):
    """On a rig without an agent, a command goes to the device's service."""
    win = bare_window
    ocs = client(lumion, "ocs")
    try:
        ocs.call("apply_circuits", circuits=[[1, 18]])
        qtbot.waitUntil(lambda: win.model.switches.get("ocs") is not None and
                        win.model.switches["ocs"].circuits == {1: 18}, timeout=WAIT_MS)
        panel = win.control
        panel.switch.setCurrentText("ocs")
        panel.input.setValue(4)
        panel.output.setValue(30)
        result, asked = confirm_and_wait(qtbot, win, panel.ask_connect)
        assert "ocs: connect input 4 to output 30" in asked
        assert result.ok, result.reason
        by_gui = ocs.call("read_circuits")["circuits"]
        # The same command from a client, from the same starting state.
        ocs.call("apply_circuits", circuits=[[1, 18]])
        ocs.call("apply_circuits", circuits=[[1, 18], [4, 30]])
        assert ocs.call("read_circuits")["circuits"] == by_gui == [[1, 18], [4, 30]]
        qtbot.waitUntil(lambda: win.model.switches["ocs"].circuits == {1: 18, 4: 30},
                        timeout=WAIT_MS)

        # Refused by the switch: output 18 already carries input 1.
        panel.input.setValue(2)
        panel.output.setValue(18)
        result, asked = confirm_and_wait(qtbot, win, panel.ask_connect)
        assert "Output 18 now hears input 1" in asked
        assert not result.ok and "18" in result.reason
        last = panel.log.item(panel.log.count() - 1).text()
        assert "refused" in last and result.reason in last
        assert ocs.call("read_circuits")["circuits"] == [[1, 18], [4, 30]]   # unchanged

        # Compare-and-set: a command computed from an older picture than the switch's.
        fabric = win.runner.backend
        with fabric._lock:
            fabric._states["ocs"]["version"] = "stale:0"
        panel.input.setValue(6)
        panel.output.setValue(25)
        result, _ = confirm_and_wait(qtbot, win, panel.ask_connect)
        assert not result.ok and "state version" in result.reason, result.reason
        assert ocs.call("read_circuits")["circuits"] == [[1, 18], [4, 30]]

        # A heater through the chip service, read back from the board.
        chip = client(lumion, "chip")
        try:
            panel.chip.setCurrentText("chip")
            panel.channel.setValue(5)
            panel.volts.setValue(1.25)
            result, asked = confirm_and_wait(qtbot, win, panel.ask_heater)
            assert "cell s0r5" in asked and result.ok, result.reason
            assert chip.call("read_heaters")["volts"][5] == pytest.approx(1.25, abs=0.01)
        finally:
            chip.close()
    finally:
        ocs.close()


def test_rack_shows_the_spare_in_use_after_a_swap_and_refusals_say_why(
        qtbot, window, lumion, tmp_path):
    win = window
    with Agent(lumion.agent_endpoints()) as agent:
        qtbot.waitUntil(lambda: label(win, "agent").endswith("agent: connected") and
                        len(win.model.rack) == 6, timeout=WAIT_MS)
        assert win.rack.table.item(win.rack.row_of("spare0"), 1).text() == "spare"
        panel = win.control
        panel.gpu.setCurrentText("gpu2")
        panel.spare.setCurrentText("(agent picks)")
        result, asked = confirm_and_wait(qtbot, win, panel.ask_swap)
        assert "Swap GPU gpu2 (rank 2, port 3 on chip)" in asked
        assert result.ok and "gpu2 -> spare0" in result.reason
        qtbot.waitUntil(lambda: win.model.rack["spare0"].role == "in_use_spare",
                        timeout=WAIT_MS)
        row = win.rack.row_of("spare0")
        assert win.rack.table.item(row, 1).text() == "in use (spare)"
        assert win.rack.table.item(row, 2).text() == "2"
        qtbot.waitUntil(lambda: any(e.cause == "manual swap" for e in win.model.entries),
                        timeout=WAIT_MS)
        assert_not_blank(pixels(win.rack, tmp_path / "rack.png"), min_fraction=0.02)
        assert_not_blank(pixels(win.events, tmp_path / "events.png"), min_fraction=0.02)

        # gpu2 no longer holds a rank: the agent refuses, the reason is shown.
        refused = []
        win.runner.finished.connect(refused.append)
        win.runner.submit(Command("swap", {"gpu": "gpu2", "spare": None}))
        qtbot.waitUntil(lambda: bool(refused), timeout=WAIT_MS)
        assert not refused[0].ok and "holds no rank" in refused[0].reason
        assert "holds no rank" in win.statusBar().currentMessage()

        agent.todo.put({"alarms": ["no spare left for rank 3"]})
        qtbot.waitUntil(lambda: "no spare left" in win.services.labels["agent"].toolTip(),
                        timeout=WAIT_MS)
    qtbot.waitUntil(lambda: label(win, "agent").endswith("agent: down"), timeout=WAIT_MS)


def test_a_gpu_failure_and_a_manual_swap_with_the_agent_process(qtbot, lumion_bus,  # noqa: F811
                                                                 tmp_path):
    """`ptb agent` on the lumion rig: a GPU fails, the rack shows the spare in use and the chip
    the circuits to its port; then the operator swaps another GPU out through the GUI."""
    from photonic_testbed.common.jobplan import dp_ring
    from photonic_testbed.hil.job.fabric_client import Fabric
    emu, rig, path = lumion_bus
    agent = _agent(path, tmp_path / "journal.db")
    fabric = win = None
    try:
        fabric = Fabric(*rig.agent_endpoints(), timeout=10)
        fabric.admit(dp_ring(8))
        fabric.phase("dp")
        settings = QSettings(str(tmp_path / "gui.ini"), QSettings.Format.IniFormat)
        win, bus = rig_window(rig, settings, down_after_s=0.5)
        qtbot.addWidget(win)
        win.resize(1500, 950)
        bus.start()
        win.show()
        qtbot.waitUntil(lambda: len(win.model.rack) == 10 and
                        "chip" in win.portmap.views, timeout=WAIT_MS)
        spare_port = {g.name: g.port for g in rig.gpus}
        emu.rack.rack.faults.fail_gpu("gpu3")
        qtbot.waitUntil(lambda: win.model.rack["spare0"].role == "in_use_spare", timeout=20000)
        assert win.model.rack["spare0"].rank == 3 and win.model.rack["gpu3"].health == "failed"
        assert win.rack.table.item(win.rack.row_of("spare0"), 1).text() == "in use (spare)"
        # The chip now carries light from and to the spare's port.
        port = spare_port["spare0"]
        qtbot.waitUntil(lambda: port in win.model.switches["chip"].circuits, timeout=WAIT_MS)
        qtbot.waitUntil(lambda: any(e.kind == "verified" for e in win.model.entries),
                        timeout=WAIT_MS)
        assert_not_blank(pixels(win, tmp_path / "failover.png"), min_colours=50,
                         min_fraction=0.2)

        panel = win.control
        panel.gpu.setCurrentText("gpu5")
        panel.spare.setCurrentText("(agent picks)")
        result, asked = confirm_and_wait(qtbot, win, panel.ask_swap)
        assert "Swap GPU gpu5 (rank 5" in asked
        assert result.ok and "gpu5 -> spare1" in result.reason, result.reason
        qtbot.waitUntil(lambda: win.model.rack["spare1"].role == "in_use_spare" and
                        win.model.rack["spare1"].rank == 5, timeout=WAIT_MS)
        # The same hardware state the agent reports on the bus.
        with ServiceClient(rig.devices["chip"].request, timeout=5) as chip:
            qtbot.waitUntil(lambda: win.model.switches["chip"].circuits == {
                a: b for a, b in chip.call("read_circuits")["circuits"]}, timeout=WAIT_MS)

            # A manual circuit goes to the agent, which journals it and keeps it beside the
            # job's; one on a port of the job's GPUs is refused, the reason shown.
            panel.switch.setCurrentText("chip")
            panel.input.setValue(12)
            panel.output.setValue(29)
            result, _ = confirm_and_wait(qtbot, win, panel.ask_connect)
            assert result.ok and "by the agent" in result.reason, result.reason
            assert [12, 29] in chip.call("read_circuits")["circuits"]
            panel.input.setValue(spare_port["gpu0"])
            panel.output.setValue(30)
            result, _ = confirm_and_wait(qtbot, win, panel.ask_connect)
            assert not result.ok and "which job dp holds" in result.reason, result.reason
            assert [12, 29] in chip.call("read_circuits")["circuits"]
        with SqliteJournal(tmp_path / "journal.db", read_only=True) as j:
            manual = [e.details for e in j.entries(kinds=("decision",))
                      if isinstance(e.details, Manual)]
        assert [(m.device, m.circuits) for m in manual] == [("chip", [(12, 29)])]
    finally:
        if win is not None:
            win.close()
            win.runner.backend.close()
        if fabric is not None:
            fabric.close()
        _stop(agent)


def _ep() -> str:
    return f"tcp://127.0.0.1:{rigfile.free_port()}"


def _one_switch_rig(tmp_path, name: str, **more) -> rigfile.Rig:
    """A rig file of one OCS (nothing serves it) and one GPU (so: an agent), every endpoint on
    a free loopback port, written to tmp_path/rig.toml."""
    eps = {k: _ep() for k in ("agent_request", "agent_publish", "gpus_request", "gpus_publish")}
    rig = rigfile.Rig(name, tmp_path / "rig.toml", rigfile.BusConfig(curve=False, **eps),
                      {"ocs": rigfile.DeviceConfig(
                          "ocs", "switch", "TCPIP::127.0.0.1::1::SOCKET",
                          "photonic_testbed.drivers.ocs:OpticalCircuitSwitch", _ep(), _ep())},
                      gpus=(rigfile.GpuConfig("gpu0", "ocs", 1),), **more)
    rigfile.write(rig.path, rig)
    return rig


def test_gui_opens_with_nothing_up_and_connects_when_the_agent_comes(qtbot, tmp_path):
    rig = _one_switch_rig(tmp_path, "empty")
    endpoints = {"agent_request": rig.bus.agent_request, "agent_publish": rig.bus.agent_publish}
    settings = QSettings(str(tmp_path / "gui.ini"), QSettings.Format.IniFormat)
    win, fabric = rig_window(rigfile.load(rig.path), settings, down_after_s=0.3)
    qtbot.addWidget(win)
    fabric.start()
    win.show()
    try:
        qtbot.waitUntil(lambda: label(win, "ocs").endswith("down") and
                        label(win, "agent").endswith("down"), timeout=WAIT_MS)
        results = []
        win.runner.finished.connect(results.append)
        win.runner.submit(Command("disconnect", {"switch": "ocs", "input": 1}))
        qtbot.waitUntil(lambda: bool(results), timeout=WAIT_MS)
        assert not results[0].ok and "no state from its service yet" in results[0].reason
        with Agent((endpoints["agent_request"], endpoints["agent_publish"])):
            qtbot.waitUntil(lambda: label(win, "agent").endswith("connected") and
                            len(win.model.rack) == 6, timeout=WAIT_MS)
            assert label(win, "ocs").endswith("down")
    finally:
        win.close()
        fabric.close()


def test_ptb_gui_refuses_a_bad_rig_file_with_the_reason(capsys, tmp_path):
    from photonic_testbed.ptb.cli import main
    assert main(["gui", "--rig", str(tmp_path / "rig.toml")]) == 1
    assert "cannot read the rig file" in capsys.readouterr().err
    bad = tmp_path / "bad.toml"
    bad.write_text("[rig]\nname = 'x'\n")
    assert main(["gui", "--rig", str(bad)]) == 1
    assert "devices" in capsys.readouterr().err
    keyless = tmp_path / "keyless.toml"
    keyless.write_text("[rig]\nname = 'x'\n[bus]\ncurve = true\nserver_key = 'no/s.key_secret'\n"
                       "server_public_key = 'no/s.key'\nauthorized_keys = 'no'\n"
                       "client_key = 'no/c.key_secret'\n"
                       "[devices.ocs]\nkind = 'switch'\naddress = 'TCPIP::h::1::SOCKET'\n"
                       "driver = 'photonic_testbed.drivers.ocs:OpticalCircuitSwitch'\n")
    assert main(["gui", "--rig", str(keyless), "--settings", str(tmp_path / "g.ini")]) == 1
    assert "CURVE keys" in capsys.readouterr().err


def test_the_gui_follows_the_leading_replica_and_says_when_none_leads(qtbot, tmp_path):
    """A replicated agent ([replicas]): the replica that leads is shown as the agent (its rack,
    its term); once it is gone and none leads, the agent's row and an alarm say the fabric is
    unmanaged, its circuits held as they are."""
    from photonic_testbed.gui.alarms import AlarmBook
    replicas = {n: (_ep(), _ep()) for n in ("r0", "r1")}
    rig = _one_switch_rig(tmp_path, "ha", replicas=replicas)
    settings = QSettings(str(tmp_path / "gui.ini"), QSettings.Format.IniFormat)
    win, fabric = rig_window(rigfile.load(rig.path), settings, down_after_s=0.3)
    qtbot.addWidget(win)
    fabric.start()
    win.show()
    def agent_row():
        return win.model.services.get("agent")
    try:
        with Agent(replicas["r1"], name="agent@r1") as leader:     # (as a replica publishes)
            leader.todo.put({"role": "leader", "term": 3, "etcd": {
                "127.0.0.1:2379": "ok", "127.0.0.1:2380": "ok",
                "127.0.0.1:2381": "down (ConnectionRefusedError)"}})
            qtbot.waitUntil(lambda: "replica r1 leads (term 3); etcd 2 of 3 members healthy "
                            "(127.0.0.1:2381 down" in getattr(agent_row(), "detail", "")
                            and len(win.model.rack) == 6, timeout=WAIT_MS)
            leader.todo.put({"alarms": ["a test alarm"]})          # its deltas come through
            qtbot.waitUntil(lambda: "ALARM: a test alarm" in agent_row().detail,
                            timeout=WAIT_MS)
            assert agent_row().state == "connected"
            assert fabric.endpoints["agent"] == replicas["r1"]      # where commands go
        qtbot.waitUntil(lambda: agent_row().state == "down", timeout=WAIT_MS)
        assert "the fabric is unmanaged" in agent_row().detail
        texts = [a.text for a in AlarmBook().evaluate(win.model)]
        assert any(t.startswith("agent down") and "unmanaged" in t for t in texts), texts
    finally:
        win.close()
        fabric.close()


def test_a_switch_no_gpu_is_on_is_changed_at_its_service_on_a_rig_with_an_agent(
        qtbot, tmp_path):
    """The agent drives the GPUs' switches; an input selector beside them (no GPU on it) takes
    the operator's circuit at its own service, not through an agent that does not drive it."""
    from photonic_testbed.hil.devices.service import DeviceService
    from tests.test_agent_bus import _serve
    rig = _one_switch_rig(tmp_path, "with-selector")
    sel = rigfile.DeviceConfig("sel", "switch", "mem", "tests.bus_doubles:MemorySwitch",
                               _ep(), _ep(), options={"ports": 8})
    rig = dataclasses.replace(rig, devices={**rig.devices, "sel": sel})
    rigfile.write(rig.path, rig)
    rig = rigfile.load(rig.path)
    assert rig.agent_changes("ocs") and not rig.agent_changes("sel")
    service = DeviceService(rig.service_specs(["sel"])[0])
    service.bind()
    stop_service = _serve(service)
    win = None
    try:
        settings = QSettings(str(tmp_path / "gui.ini"), QSettings.Format.IniFormat)
        win, bus = rig_window(rig, settings, down_after_s=0.5)
        qtbot.addWidget(win)
        bus.start()
        qtbot.waitUntil(lambda: "sel" in win.model.switches, timeout=WAIT_MS)
        done: queue.Queue = queue.Queue()
        bus.submit(Command("connect", {"switch": "sel", "input": 2, "output": 11}), done.put)
        result = done.get(timeout=30)
        assert result.ok and "by the agent" not in result.reason, result.reason
        with ServiceClient(rig.devices["sel"].request, timeout=5) as c:
            assert c.call("read_circuits")["circuits"] == [[2, 11]]
    finally:
        if win is not None:
            win.close()
            win.runner.backend.close()
        stop_service()
