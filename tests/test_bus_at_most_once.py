"""The request contract through the real sockets: a changing request whose handler is slower
than the client's retry interval runs exactly once, and its retry gets the first reply; for
every changing operation of every server (device services of each kind, the agent, the GPU
monitor, the emulated rack's monitor)."""
from __future__ import annotations

import contextlib
import threading
import time

import pytest

from photonic_testbed.common.jobplan import dp_ring
from photonic_testbed.emulator.rig import EmulatedRig
from photonic_testbed.hil.bus import schema
from photonic_testbed.hil.bus.client import FIRST_ATTEMPT_S, RemoteError, ServiceClient
from photonic_testbed.hil.bus.server import Server
from photonic_testbed.hil.devices.kinds import KINDS
from photonic_testbed.hil.devices.service import DeviceService, ServiceSpec
from photonic_testbed.hil.rig import rig_spec

SLOW_S = 2.5 * FIRST_ATTEMPT_S        # the client resends at least twice while it runs


class Counted:
    """Wraps a server's handler: counts the runs, and makes each one slow."""

    def __init__(self, server: Server, op: str):
        self.op = op
        self.runs = 0
        declared, self.handler = server._ops[op]
        server._ops[op] = (declared, self)

    def __call__(self, args):
        self.runs += 1
        time.sleep(SLOW_S)
        return self.handler(args)


@contextlib.contextmanager
def serving(loop, *args):
    stop = threading.Event()
    thread = threading.Thread(target=loop, args=(*args, stop), daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(10)


def _poll_until(server: Server, stop: threading.Event) -> None:
    while not stop.is_set():
        server.poll(0.01)


def once(client: ServiceClient, server: Server, op: str, args: dict, **kw):
    """Call `op` through a slow handler; assert one run, and that a retry by hand with the
    same request id gets the same answer without a second run."""
    counted = Counted(server, op)
    before = client.reconnects
    first = client.call(op, timeout=30, **kw, **args)
    assert client.reconnects > before, "the client never resent: the handler was not slow"
    assert counted.runs == 1, f"{op} ran {counted.runs} times"
    # the same id again, on its own socket: the first answer, and no run
    with ServiceClient(client.endpoint, timeout=10) as again:
        rid = "retry-" + op

        def answer():
            again.send(op, args, rid=rid, wait=5)
            try:
                return again.receive(rid, time.monotonic() + 10)
            except RemoteError as e:                 # (a second swap of one GPU is refused)
                return repr(e)
        second = answer()                            # a first run of this id
        third = answer()                             # ...and its retry
    assert counted.runs == 2 and third == second
    server._ops[op] = (server._ops[op][0], counted.handler)
    return first


def test_a_generic_server_runs_a_slow_change_once():
    runs = []
    change = schema.Operation("bump", schema.Args, read_only=False, doc="count")
    server = Server("counter", {"n": 0}, operations=[change],
                    handlers={"bump": lambda args: runs.append(1) or len(runs)})
    endpoint = server.bind()[0]
    try:
        with serving(_poll_until, server), ServiceClient(endpoint, timeout=10) as c:
            assert once(c, server, "bump", {}) == 1
            assert len(runs) == 2                   # the call, and the by-hand id
            # a read-only operation is simply run again
            assert c.call("ping")["device"] == "counter"
    finally:
        server.close()


def test_answers_are_kept_while_their_client_may_retry_and_no_longer(monkeypatch):
    """A change's answer serves its retries until the request's deadline (`ttl_ms`) and a grace
    after: a stream of changes keeps the answers of the last moments, not of ten minutes (a
    service of 64 OCSes grew to 850 MB under 1,500 phase switches)."""
    import photonic_testbed.hil.bus.server as server_module
    monkeypatch.setattr(server_module, "DONE_GRACE_S", 0.2)
    runs = []
    change = schema.Operation("bump", schema.Args, read_only=False, doc="count")
    server = Server("counter", {"n": 0}, operations=[change],
                    handlers={"bump": lambda args: runs.append(1) or len(runs)})
    endpoint = server.bind()[0]
    try:
        with serving(_poll_until, server), ServiceClient(endpoint, timeout=10) as c:
            def bump(rid: str, ttl: float):
                c.send("bump", {}, rid=rid, ttl=ttl, wait=5)
                return c.receive(rid, time.monotonic() + 10)
            assert bump("a", 0.3) == 1
            assert bump("a", 0.2) == 1 and len(runs) == 1      # a retry inside the deadline
            assert bump("long", 60.0) == 2                     # its client retries for a minute
            for k in range(100):
                assert bump(f"s{k}", 0.3) == 3 + k
            time.sleep(0.8)                                    # past their deadlines and grace
            for k in range(100, 200):
                assert bump(f"s{k}", 0.3) == 3 + k
            kept = set(server._done)
            assert "long" in kept and "a" not in kept          # whatever the order they came in
            assert not kept & {f"s{k}" for k in range(100)}, "answers kept past their deadline"
            assert "s199" in kept                              # the newest, inside its deadline
            assert bump("long", 59.0) == 2                     # still the first answer
    finally:
        server.close()


def _device_args(service: DeviceService, op: str) -> dict:
    state = service.server.state.state
    if op == "apply_circuits":
        n = state["ports"]
        return {"circuits": [[1, n + 2]]}
    if op == "set_heaters":
        return {"volts": [0.5, 0.25], "first": 1}
    if op == "set_laser":
        return {"power_mw": 1.5}
    if op == "load_calibration":
        from photonic_testbed.common.calibration import Calibration
        return {"calibration": Calibration.ideal(range(56), chip="benes16").dumps()}
    if op == "move_circuits":
        return {"forget": True}
    raise AssertionError(f"no example arguments for {op}")


CHANGING_DEVICE_OPS = sorted({(kind, op) for kind, k in KINDS.items() for op in k.ops
                              if not schema.OPERATIONS[op].read_only})


@pytest.fixture(scope="module")
def lumion():
    with EmulatedRig(rig_spec("lumion"), seed=2) as rig:
        yield rig


@pytest.mark.parametrize("kind, op", CHANGING_DEVICE_OPS)
def test_every_device_kind_runs_a_slow_change_once(lumion, kind, op):
    address = {"heater_dac": "dac", "chip": "dac", "switch": "ocs", "laser": "laser"}[kind]
    spec = ServiceSpec(kind, kind, lumion.endpoints[address], heartbeat=0.2, telemetry_hz=0.0,
                       driver="photonic_testbed.drivers.ocs:OpticalCircuitSwitch"
                       if kind == "switch" else "",
                       options={"topology": "benes16"} if kind == "chip" else {})
    service = DeviceService(spec)
    endpoint = service.bind()[0]
    try:
        with serving(service.serve), ServiceClient(endpoint, timeout=10) as c:
            version = c.call("ping")["version"]
            once(c, service.server, op, _device_args(service, op), expect=version)
            # the change happened once: one step of the version per run
            assert c.call("ping")["version"].endswith(":2")
    finally:
        service.close()


def test_the_agent_runs_each_slow_change_once(tmp_path):
    """admit, phase, job_failure and swap on the agent (in this process, on the opus rig)."""
    from photonic_testbed.hil.agent.bus import AgentProcess
    from tests.test_agent_bus import _rig_on_bus

    with _rig_on_bus(tmp_path, "opus", "ocs", switching_s=0.0) as (emu, rig, path):
        agent = AgentProcess(rig, str(tmp_path / "journal.db"))
        try:
            agent.start()
            with serving(agent.run), ServiceClient(rig.agent_endpoints()[0], timeout=10) as c:
                got = once(c, agent.server, "admit", {"plan": dp_ring(8).to_dict()})
                rank_map = got["rank_map"]
                assert sorted(rank_map) == [str(r) for r in range(8)]
                once(c, agent.server, "phase", {"phase": "dp", "round": 0})
                swapped = once(c, agent.server, "swap", {"gpu": rank_map["3"]})
                assert "rank_map" in swapped
                failures = len(agent.journal.entries(kinds=("failure",)))
                reply = once(c, agent.server, "job_failure",
                             {"reason": "collective timed out", "gpus": [], "links": []})
                assert "swapped" in reply
                # one failure entry per report, not one per retry
                assert len(agent.journal.entries(kinds=("failure",))) == failures + 2
        finally:
            agent.close()


def test_the_gpu_monitor_runs_a_slow_clear_once(tmp_path):
    from tests.test_gpu_monitor import recorded_ethtool, running_monitor

    with running_monitor(recorded_ethtool(set())) as (monitor, host, endpoints), \
            ServiceClient(endpoints[0], timeout=10) as client:
        gpu = sorted(monitor._tracks)[0]
        got = once(client, monitor.server, "clear_gpu", {"gpu": gpu})
        assert got["gpu"] == gpu


def test_every_server_declares_what_it_offers():
    """No server offers an operation that `schema.OPERATIONS` does not declare."""
    for kind in KINDS.values():
        assert set(kind.ops) <= set(schema.OPERATIONS)
    with pytest.raises(ValueError, match="not declared"):
        Server("x", {}, handlers={"launch": lambda args: None})


def test_a_running_chip_takes_a_new_calibration_and_refuses_a_damaged_one(lumion):
    """load_calibration on the chip service: the circuits made stay made (their heaters
    derived again with the new file); a damaged file or one for another chip changes
    nothing."""
    from photonic_testbed.common.calibration import Calibration
    spec = ServiceSpec("chip", "chip", lumion.endpoints["dac"], heartbeat=0.2,
                       telemetry_hz=0.0, options={"topology": "benes16"})
    service = DeviceService(spec)
    endpoint = service.bind()[0]
    try:
        with serving(service.serve), ServiceClient(endpoint, timeout=10) as c:
            c.call("apply_circuits", circuits=[[1, 18], [2, 17]])
            before = c.call("read_heaters")["volts"]
            shifted = Calibration.ideal(range(56), chip="benes16")
            for h in shifted.heaters.values():
                object.__setattr__(h, "offset_rad", 0.3)
            got = c.call("load_calibration", calibration=shifted.dumps())
            assert got["heaters_changed"] > 0
            after = c.call("read_heaters")["volts"]
            assert after != before
            assert c.call("read_circuits")["circuits"][:2] == [[1, 18], [2, 17]]
            text = shifted.dumps()
            damaged = text.replace('"offset_rad": 0.3', '"offset_rad": 0.4', 1)
            assert damaged != text
            with pytest.raises(RemoteError, match="BadRequest.*checksum"):
                c.call("load_calibration", calibration=damaged)
            other = Calibration.ideal(range(56), chip="clements8").dumps()
            with pytest.raises(RemoteError, match="BadRequest"):
                c.call("load_calibration", calibration=other)
            assert c.call("read_heaters")["volts"] == after
    finally:
        service.close()


def test_a_read_slower_than_the_retries_is_answered_once_and_in_time():
    """A read that takes longer than the client's longest wait between resends (a power meter
    reading 16 ports at 0.1 s each): every retry carries the same id, so the server runs it
    once and answers the client's newest socket; before, each retry ran the read again and
    each answer went to a socket the client had already given up (no answer at all)."""
    runs = []
    slow = schema.Operation("slow_read", schema.Args, read_only=True, doc="a slow instrument")

    def read(args):
        runs.append(1)
        time.sleep(3 * FIRST_ATTEMPT_S + 1.0)
        return {"power": len(runs)}
    server = Server("meter", {}, operations=[slow], handlers={"slow_read": read})
    endpoint = server.bind()[0]
    try:
        with serving(_poll_until, server), ServiceClient(endpoint, timeout=30) as c:
            assert c.call("slow_read") == {"power": 1}
            assert c.reconnects >= 2 and len(runs) == 1
    finally:
        server.close()
