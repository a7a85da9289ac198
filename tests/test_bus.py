"""Device services in their own processes over tcp://127.0.0.1, driving the emulator."""
from __future__ import annotations

import json
import os
import signal
import threading
import time

import pytest
import zmq

from photonic_testbed.emulator.rig import EmulatedRig
from photonic_testbed.hil.bus import schema
from photonic_testbed.hil.bus.client import (
    BadRequest,
    RemoteError,
    ServiceClient,
    ServiceUnavailable,
    StaleState,
    UnknownOperation,
)
from photonic_testbed.hil.bus.mirror import StateSubscriber, SubscriberThread
from photonic_testbed.hil.bus.security import authorize, client_keys, generate
from photonic_testbed.hil.devices.service import ServiceSpec
from photonic_testbed.hil.devices.supervisor import Manager
from photonic_testbed.hil.rig import rig_spec

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")    # the Qt test needs no display

SWITCH = "tests.bus_doubles:MemorySwitch"
METER = "tests.bus_doubles:MemoryPowerMeter"


class Supervised:
    """A manager watched by a thread, as `ptb serve` runs it."""

    def __init__(self, specs, **kwargs):
        self.manager = Manager(specs, backoff_min=0.05, **kwargs)
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.manager.run, args=(self.stop, 0.02),
                                       daemon=True)

    def __enter__(self):
        self.endpoints = self.manager.start()
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join(5)
        self.manager.close()


@pytest.fixture
def rig():
    with EmulatedRig(rig_spec("lumion"), seed=5) as r:
        yield r


@pytest.fixture
def heaters(rig):
    spec = ServiceSpec("heaters", "heater_dac", rig.endpoints["dac"], heartbeat=0.1,
                       telemetry_hz=20.0)
    with Supervised([spec]) as s:
        yield s


@pytest.fixture
def switches():
    specs = [ServiceSpec("ocs", "switch", "mem://ocs", driver=SWITCH, heartbeat=0.1,
                         options={"ports": 8, "settle_s": 0.02}),
             ServiceSpec("meter", "power_meter", "mem://pm", driver=METER, heartbeat=0.1,
                         telemetry_hz=50.0)]
    with Supervised(specs) as s:
        yield s


def test_heater_round_trip_reaches_the_emulated_board(rig, heaters):
    request, publish = heaters.endpoints["heaters"]
    with ServiceClient(request, timeout=5) as c:
        info = c.call("describe")
        assert info["device"]["channels"] == 56 and "set_heaters" in info["operations"]
        version = c.call("ping")["version"]
        volts = [0.25 * i for i in range(12)]
        c.call("set_heaters", volts=volts, first=4, expect=version)
        outputs = rig.dac.outputs
        assert outputs[4:16] == pytest.approx(volts, abs=12 / 65535)
        assert outputs[:4] == [0.0] * 4
        assert c.call("read_heaters")["volts"][4:16] == pytest.approx(volts, abs=2e-4)
        assert c.version != version
        with pytest.raises(UnknownOperation, match="does not offer 'apply_circuits'"):
            c.call("apply_circuits", circuits=[[1, 9]])
        with pytest.raises(BadRequest, match=r"Expected `float`, got `str` \(at volts\[1\]\)"):
            c.call("set_heaters", volts=[1.0, "hot"])
        with pytest.raises(RemoteError) as refused:       # the board's own refusal, typed
            c.call("set_heaters", volts=[50.0])
        assert refused.value.kind not in ("RemoteError", "Exception")
        assert "Traceback" not in str(refused.value)


def test_telemetry_and_power_meter(switches):
    request, publish = switches.endpoints["meter"]
    seen = []
    with ServiceClient(request, timeout=5) as c:
        assert c.call("read_power", channels=[2]) == {"power": {2: 0.002}}
        with pytest.raises(RemoteError, match="ValueError: channel 9 does not exist"):
            c.call("read_power", channels=[9])
    with StateSubscriber({"meter": (request, publish)},
                         on_telemetry=lambda d, m: seen.append(m)) as sub:
        deadline = time.monotonic() + 10
        while len(seen) < 3 and time.monotonic() < deadline:
            sub.poll(0.05)
    assert len(seen) >= 3 and seen[-1]["values"]["power"]["4"] == 0.004
    assert [m["seq"] for m in seen] == sorted(m["seq"] for m in seen)


def test_service_killed_is_restarted_while_a_client_keeps_working(heaters):
    request, publish = heaters.endpoints["heaters"]
    states = []
    with ServiceClient(request, timeout=10) as c, SubscriberThread(
            {"heaters": (request, publish)},
            on_state=lambda d, s, ops: states.append(s["version"])) as sub:
        c.call("set_heaters", volts=[1.5, 2.5])
        first_pid = heaters.manager.pid("heaters")
        first_incarnation = c.call("ping")["incarnation"]
        answers = 0
        for i in range(60):                              # bounded: about 1.5 s of calls
            if i == 10:
                os.kill(first_pid, signal.SIGKILL)
            assert c.call("read_heaters")["volts"][:2] == pytest.approx([1.5, 2.5], abs=2e-4)
            answers += 1
            time.sleep(0.02)
        assert answers == 60
        assert heaters.manager.pid("heaters") != first_pid
        assert heaters.manager.services["heaters"].restarts >= 1
        ping = c.call("ping")
        assert ping["incarnation"] != first_incarnation
        # The subscriber re-synced by itself to the new incarnation, state intact.
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            s = sub.states().get("heaters")
            if s and s["version"] == ping["version"]:
                break
            time.sleep(0.05)
        s = sub.states()["heaters"]
        assert s["version"] == ping["version"]
        assert s["volts"][:2] == pytest.approx([1.5, 2.5], abs=2e-4)
        assert sub.error is None


def test_subscriber_that_misses_deltas_recovers_by_snapshot(switches):
    request, publish = switches.endpoints["ocs"]
    with ServiceClient(request, timeout=5) as c, StateSubscriber(
            {"ocs": (request, publish)}, telemetry=False) as sub:
        assert sub.wait_synced(10)
        mirror = sub.mirror("ocs")
        resyncs = mirror.resyncs
        # Deaf for a while: the deltas of these changes never reach this subscriber.
        sub.sub.unsubscribe(schema.topic(schema.STATE, "ocs"))
        sub.sub.unsubscribe(schema.topic(schema.HEARTBEAT, "ocs"))
        for k in range(1, 6):
            c.call("apply_circuits", circuits=[[k, 9], [8, 16]])
        sub.poll(0.05)
        assert mirror.state["circuits"] == []            # it really missed them
        sub.sub.subscribe(schema.topic(schema.STATE, "ocs"))
        time.sleep(0.2)                                  # let the subscription reach the PUB
        c.call("apply_circuits", circuits=[[6, 9]])
        deadline = time.monotonic() + 10
        while mirror.state["circuits"] != [[6, 9]] and time.monotonic() < deadline:
            sub.poll(0.05)
        assert mirror.state["circuits"] == [[6, 9]]
        assert mirror.gaps >= 1 and mirror.resyncs > resyncs
        assert mirror.version == c.call("ping")["version"]


def _raw(endpoint):
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.linger = 0
    sock.rcvtimeo = 5000
    sock.connect(endpoint)
    return sock


def test_malformed_and_hostile_frames_get_errors_while_valid_clients_continue(switches):
    request, _ = switches.endpoints["ocs"]
    hostile = _raw(request)
    good = ServiceClient(request, timeout=5)
    cases = [
        ([b"\x00\xff garbage"], "BadFrame"),
        ([b"{" * 100], "BadFrame"),
        ([b"x" * (2 * schema.MAX_FRAME)], "FrameTooLarge"),
        ([json.dumps({"v": 99, "type": "request", "id": "a", "op": "ping"}).encode()],
         "UnknownVersion"),
        ([json.dumps({"v": 1, "type": "request", "op": "ping"}).encode()], "MissingField"),
        ([json.dumps({"v": 1, "type": "request", "id": "a", "op": "apply_circuits",
                      "args": {"circuits": [[1, "x"]]}}).encode()], "BadRequest"),
        ([json.dumps({"v": 1, "type": "request", "id": "b", "op": "apply_circuits",
                      "args": {"circuits": [[1, 2]]}}).encode()], "CircuitConflict"),
        ([json.dumps({"v": 1, "type": "request", "id": "c", "op": "apply_circuits",
                      "args": {"circuits": [[1, 9], [1, 10]]}}).encode()], "CircuitConflict"),
        ([json.dumps({"v": 1, "type": "request", "id": "d", "op": "read_circuits",
                      "args": {"channels": [1]}}).encode()], "BadRequest"),
        ([json.dumps({"v": 1, "type": "reply", "id": "a", "result": 1,
                      "version": "x"}).encode()], "UnknownType"),
        ([b"a", b"b", b"c"], "BadFrame"),
    ]
    try:
        for frames, error in cases:
            hostile.send_multipart(frames)
            reply = schema.decode(hostile.recv_multipart()[-1])
            assert reply["type"] == "error" and reply["error"] == error, reply
            assert "Traceback" not in reply["message"]
            assert good.call("ping")["device"] == "ocs"   # the valid client is unaffected
        good.call("apply_circuits", circuits=[[1, 9]])
        assert good.call("read_circuits") == {"circuits": [[1, 9]]}
    finally:
        hostile.close()
        good.close()


def test_two_clients_racing_to_change_a_switch_exactly_one_wins(switches):
    request, _ = switches.endpoints["ocs"]
    for _ in range(5):
        clients = [ServiceClient(request, timeout=5) for _ in range(2)]
        version = clients[0].call("ping")["version"]
        barrier = threading.Barrier(2)
        results: list = [None, None]

        def attempt(k, clients=clients, version=version, barrier=barrier, results=results):
            barrier.wait(5)
            try:
                clients[k].call("apply_circuits", circuits=[[1 + k, 9 + k]], expect=version)
                results[k] = "won"
            except StaleState as e:
                results[k] = e
        threads = [threading.Thread(target=attempt, args=(k,)) for k in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(10)
        for c in clients:
            c.close()
        assert sorted(map(str, results)).count("won") == 1, results
        loser = next(r for r in results if r != "won")
        assert isinstance(loser, StaleState) and "changed since you read it" in str(loser)
        winner = results.index("won")
        with ServiceClient(request) as c:
            assert c.call("read_circuits")["circuits"] == [[1 + winner, 9 + winner]]


def test_curve_listed_client_works_and_unlisted_cannot_change_anything(tmp_path):
    keys = tmp_path / "keys"
    generate(keys, "server")
    generate(keys, "operator", role="agent")       # (a device takes changes from the agent role)
    generate(keys, "intruder", role="agent")
    authorize(keys / "operator.key", keys / "authorized")
    spec = ServiceSpec("ocs", "switch", "mem://ocs", driver=SWITCH, heartbeat=0.1,
                       options={"ports": 8}, curve_secret=str(keys / "server.key_secret"),
                       curve_authorized=str(keys / "authorized"))
    operator = client_keys(keys / "operator.key_secret", keys / "server.key")
    intruder = client_keys(keys / "intruder.key_secret", keys / "server.key")
    with Supervised([spec], keys=operator) as s:
        request, publish = s.endpoints["ocs"]
        with ServiceClient(request, keys=operator, timeout=5) as c:
            c.call("apply_circuits", circuits=[[1, 9]])
            with StateSubscriber({"ocs": (request, publish)}, keys=operator) as sub:
                assert sub.wait_synced(10) and sub.state("ocs")["circuits"] == [[1, 9]]
            for keyset in (intruder, None):
                with ServiceClient(request, keys=keyset, timeout=0.5) as bad:
                    with pytest.raises(ServiceUnavailable):
                        bad.call("apply_circuits", circuits=[[2, 10]])
                    with pytest.raises(ServiceUnavailable):
                        bad.call("read_circuits")
            assert c.call("read_circuits") == {"circuits": [[1, 9]]}
            with StateSubscriber({"ocs": (request, publish)}, keys=intruder) as sub:
                assert not sub.wait_synced(0.5)


def test_device_unplugged_is_reported_and_comes_back(rig):
    spec = ServiceSpec("heaters", "heater_dac", rig.endpoints["dac"], heartbeat=0.1,
                       health=0.2, options={"reconnect_timeout": 0.3})
    with Supervised([spec]) as s, ServiceClient(s.endpoints["heaters"][0], timeout=5) as c, \
            StateSubscriber({"heaters": s.endpoints["heaters"]}) as sub:
        assert sub.wait_synced(10)
        c.call("set_heaters", volts=[2.0])
        rig.dac.unplug()
        with pytest.raises(RemoteError) as gone:
            c.call("read_heaters")
        assert gone.value.kind == "DACDisconnected"
        deadline = time.monotonic() + 10
        while sub.state("heaters")["online"] and time.monotonic() < deadline:
            sub.poll(0.05)
        assert sub.state("heaters")["online"] is False
        rig.dac.replug()
        while not sub.state("heaters")["online"] and time.monotonic() < deadline + 10:
            sub.poll(0.05)
        assert sub.state("heaters")["online"] is True
        assert c.call("read_heaters")["volts"][0] == pytest.approx(2.0, abs=2e-4)
        assert s.manager.services["heaters"].restarts == 0     # the service itself stayed up


def test_a_request_whose_deadline_passes_in_the_queue_is_not_run(switches):
    request, _ = switches.endpoints["ocs"]
    slow = ServiceSpec("slow", "switch", "mem://slow", driver=SWITCH, heartbeat=0.1,
                       options={"ports": 8, "settle_s": 0.3})
    with Supervised([slow]) as s, ServiceClient(s.endpoints["slow"][0], timeout=5) as a, \
            ServiceClient(s.endpoints["slow"][0], timeout=5) as b:
        busy = a.send("apply_circuits", {"circuits": [[1, 9]]}, wait=2)
        time.sleep(0.05)                                   # a's request is being run
        late = b.send("apply_circuits", {"circuits": [[2, 10]]}, ttl=0.05, wait=2)
        a.receive(busy, time.monotonic() + 5)
        with pytest.raises(RemoteError, match="DeadlineExceeded: apply_circuits waited"):
            b.receive(late, time.monotonic() + 5)
        assert b.call("read_circuits")["circuits"] == [[1, 9]]    # the late one never ran


def test_a_qt_event_loop_polls_the_mirror_without_blocking(switches, qtbot):
    from PySide6.QtCore import QTimer

    request, publish = switches.endpoints["ocs"]
    seen = []
    sub = StateSubscriber({"ocs": (request, publish)},
                          on_state=lambda d, s, ops: seen.append(s["circuits"]))
    timer = QTimer()
    timer.timeout.connect(lambda: sub.poll(0))       # never waits: the GUI thread stays free
    timer.start(10)
    try:
        qtbot.waitUntil(lambda: bool(seen), timeout=10_000)
        with ServiceClient(request, timeout=5) as c:
            c.call("apply_circuits", circuits=[[3, 11]], expect=sub.mirror("ocs").version)
        qtbot.waitUntil(lambda: seen[-1] == [[3, 11]], timeout=10_000)
    finally:
        timer.stop()
        sub.close()


def test_a_hung_service_is_killed_and_restarted():
    """A driver call that never ends: the service goes on answering `ping` but stops its
    heartbeats once the call has run `stuck_s`, and its supervisor restarts it afresh."""
    spec = ServiceSpec("wedged", "switch", "mem://w", driver="tests.bus_doubles:HangingSwitch",
                       heartbeat=0.1, stuck_s=0.5, options={"ports": 4})
    with Supervised([spec], silence_s=0.5) as s, \
            ServiceClient(s.endpoints["wedged"][0], timeout=10) as c:
        first = s.manager.pid("wedged")
        deadline = time.monotonic() + 10
        while not s.manager.services["wedged"].heard and time.monotonic() < deadline:
            time.sleep(0.05)                  # the manager hears it before it wedges
        with pytest.raises(ServiceUnavailable):
            c.call("apply_circuits", circuits=[[1, 5]], timeout=0.3)
        assert c.call("ping")["device"] == "wedged"     # its loop answers, its device hangs
        deadline = time.monotonic() + 10
        while s.manager.pid("wedged") in (first, None) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert s.manager.pid("wedged") not in (first, None)
        assert c.call("read_circuits") == {"circuits": []}     # a fresh service answers


def test_call_many_waits_for_the_slowest_and_keeps_every_answer():
    """A silent service does not hide the answer of another, and one that binds late (a
    restart) is asked again on a fresh socket and answers within the timeout."""
    from photonic_testbed.hil.bus.client import call_many
    from photonic_testbed.hil.bus.server import Server
    from photonic_testbed.hil.rig import free_port

    ctx = zmq.Context.instance()
    silent = ctx.socket(zmq.ROUTER)              # takes requests, never answers
    silent_ep = f"tcp://127.0.0.1:{silent.bind_to_random_port('tcp://127.0.0.1')}"
    late_ep = f"tcp://127.0.0.1:{free_port()}"
    stop = threading.Event()
    servers = []

    def serve(name, endpoint, delay):
        time.sleep(delay)
        server = Server(name, {"x": 1}, request=endpoint)
        server.bind()
        servers.append(server)
        while not stop.is_set():
            server.poll(0.01)
    prompt = Server("prompt", {"x": 2})
    prompt_ep = prompt.bind()[0]
    threads = [threading.Thread(target=serve, args=("late", late_ep, 0.4), daemon=True)]
    threads[0].start()

    def loop():
        while not stop.is_set():
            prompt.poll(0.01)
    threads.append(threading.Thread(target=loop, daemon=True))
    threads[1].start()
    clients = [ServiceClient(ep, timeout=2.0) for ep in (silent_ep, prompt_ep, late_ep)]
    try:
        got = call_many([(c, "ping", {}) for c in clients], timeout=2.0)
        assert isinstance(got[0], ServiceUnavailable) and "within 2 s" in str(got[0])
        assert got[1]["device"] == "prompt" and got[2]["device"] == "late"
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=5)
        for c in clients:
            c.close()
        for s in servers + [prompt]:
            s.close()
        silent.close(linger=0)


def test_a_device_that_dies_after_its_snapshot_before_any_heartbeat_is_seen_lost(monkeypatch):
    """A service that answers the subscriber's snapshot and dies before its first heartbeat
    (the mirror never learnt its interval) is marked down all the same, not alive for ever."""
    monkeypatch.setattr(StateSubscriber, "FIRST_HEARTBEAT_S", 0.5)
    ctx = zmq.Context.instance()
    router, pub = ctx.socket(zmq.ROUTER), ctx.socket(zmq.PUB)
    for sock in (router, pub):
        sock.linger = 0
    req_port = router.bind_to_random_port("tcp://127.0.0.1")
    pub_port = pub.bind_to_random_port("tcp://127.0.0.1")
    seen: list[tuple[str, bool]] = []
    sub = StateSubscriber({"ocs": (f"tcp://127.0.0.1:{req_port}", f"tcp://127.0.0.1:{pub_port}")},
                          on_online=lambda dev, alive: seen.append((dev, alive)))
    try:
        answered = False
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and seen != [("ocs", True), ("ocs", False)]:
            sub.poll(0.05)
            if not answered and router.poll(0):
                who, frame = router.recv_multipart()
                ask = schema.decode(frame)
                snap = schema.make("snapshot", device="ocs", incarnation="a1", seq=0,
                                   state={"circuits": []})
                router.send_multipart([who, schema.encode(schema.make(
                    "reply", id=ask["id"], result=snap, version="a1:0"))])
                answered = True         # then silence: no heartbeat, no more answers
        assert answered
        assert seen == [("ocs", True), ("ocs", False)]
    finally:
        sub.close()
        router.close()
        pub.close()


def test_a_call_gives_up_at_once_when_its_client_is_cancelled():
    """A call waiting on a silent server (its agent killed, say) ends when another thread sets
    the client's cancel event, not at its timeout: the owner closing does not wait it out."""
    from photonic_testbed.hil.bus.client import ServiceClient
    from photonic_testbed.hil.bus.errors import Cancelled
    ctx = zmq.Context()
    silent = ctx.socket(zmq.ROUTER)          # takes requests, answers none
    port = silent.bind_to_random_port("tcp://127.0.0.1")
    cancel = threading.Event()
    client = ServiceClient(f"tcp://127.0.0.1:{port}", timeout=60.0, cancel=cancel,
                           context=ctx)
    got: list = []
    caller = threading.Thread(target=lambda: got.append(_raised(client.call, "ping")))
    caller.start()
    time.sleep(0.3)
    cancel.set()
    caller.join(timeout=30)                    # half its timeout: it ended by the cancel
    assert not caller.is_alive(), "the call did not end once cancelled"
    assert isinstance(got[0], Cancelled) and "the client is closing" in str(got[0])
    client.close()
    silent.close(linger=0)
    ctx.term()


def _raised(fn, *args):
    try:
        return fn(*args)
    except Exception as e:
        return e
