"""Device services served together from one thread (`serve_together`, what `ptb serve
--one-process` runs): a switch's new circuits are sent from that thread and their answer read
there when it comes; whatever may block (a refusal's error queue, a dropped or silent session,
any other call) runs on the device's own thread. Checked on emulated OCSes over their real
sockets: answers and published state as served alone, one writer per device in arrival order,
a dropped session reconciled (never applied twice), a refusal and a silent switch failing
alone, a slow switch holding up only its own requests."""
from __future__ import annotations

import contextlib
import socket
import threading
import time

import pytest

from photonic_testbed.drivers.ocs import OpticalCircuitSwitch
from photonic_testbed.emulator.ocs import OCSInstrument, OCSPhysics
from photonic_testbed.emulator.scpi import SCPIError
from photonic_testbed.emulator.scpi_server import SCPIServer
from photonic_testbed.hil.bus.client import ServiceClient, call_many
from photonic_testbed.hil.bus.errors import BusError
from photonic_testbed.hil.devices.service import DeviceService, ServiceSpec
from photonic_testbed.hil.devices.together import serve_together
from tests.timeouts import DEVICE_S

N = 8
DRIVER = "photonic_testbed.drivers.ocs:OpticalCircuitSwitch"


class RefusingOCS(OCSInstrument):
    """An OCS that refuses its next `:CONN:ONLY` when told to (a stuck port)."""

    refuse = False

    def _only(self, session, sfx, arg) -> None:
        if self.refuse:
            self.refuse = False
            raise SCPIError(-240, "port 3 is stuck")
        super()._only(session, sfx, arg)


def rotation(k: int) -> list[list[int]]:
    return [[i, N + 1 + (i - 1 + k) % N] for i in range(1, N + 1)]


@contextlib.contextmanager
def served(switches: list[tuple[OCSInstrument, dict]]):
    """Each (emulated OCS, driver options) on its SCPI socket, their services served together
    on one thread; yields [(SCPIServer, request endpoint, service)]."""
    servers, services, out = [], [], []
    stop = threading.Event()
    loop = None
    try:
        for k, (instrument, options) in enumerate(switches):
            server = SCPIServer(instrument, name=f"ocs{k}")
            server.start()
            servers.append(server)
            service = DeviceService(ServiceSpec(f"ocs{k}", "switch", server.resource,
                                                driver=DRIVER, options=options))
            request, _ = service.bind()
            services.append(service)
            out.append((server, request, service))
        loop = threading.Thread(target=serve_together, args=(services, stop), daemon=True)
        loop.start()
        yield out
    finally:
        stop.set()
        if loop is not None:
            loop.join(10)
        for service in services:
            service.close()
        for server in servers:
            server.close()


@contextlib.contextmanager
def four_switches():
    """Four emulated 8 x 8 OCSes (the last moves in 1.5 s, the others at once), served
    together; yields [(SCPIServer, physics, request endpoint, service)]."""
    physics = [OCSPhysics(N, switching_s=1.5 if k == 3 else 0.0) for k in range(4)]
    with served([(RefusingOCS(p), {"settle_timeout_s": 10.0}) for p in physics]) as out:
        yield [(server, p, request, service)
               for p, (server, request, service) in zip(physics, out, strict=True)]


@pytest.fixture
def switches():
    with four_switches() as out:
        yield out


def test_changes_sent_together_are_answered_each_as_alone_and_published(switches):
    clients = [ServiceClient(request, timeout=30) for _, _, request, _ in switches[:3]]

    def blocking_apply(circuits):
        raise AssertionError("a change on a known map went to the device's thread")

    for _, _, _, service in switches[:3]:
        service.driver.apply = blocking_apply
    try:
        for k in range(1, 4):
            got = call_many([(c, "apply_circuits", {"circuits": rotation(k)}) for c in clients],
                            30)
            for g in got:
                assert not isinstance(g, BusError), g
                assert sorted(g["added"]) == rotation(k)
                assert sorted(g["removed"]) == ([] if k == 1 else rotation(k - 1))
        for c in clients:
            assert c.call("read_circuits")["circuits"] == rotation(3)
            snap = c.call("snapshot")
            assert snap["state"]["circuits"] == rotation(3)
            # the version moved once per change, and is published with the circuits
            assert snap["state"]["version"].endswith(":3")
    finally:
        for c in clients:
            c.close()


def test_requests_to_one_switch_run_one_at_a_time(switches):
    """Six changes to one switch at once, from six sockets (arriving in any order): each ran
    on what the one before it left (its `removed` is that one's circuits), none was lost."""
    _, _, request, _ = switches[0]
    clients = [ServiceClient(request, timeout=30) for _ in range(6)]
    try:
        got = call_many([(c, "apply_circuits", {"circuits": rotation(k)})
                         for k, c in enumerate(clients)], 30)
        assert all(not isinstance(g, BusError) for g in got), got
        by_removed = {tuple(map(tuple, sorted(g["removed"]))): k for k, g in enumerate(got)}
        assert len(by_removed) == 6, got
        chain, last = [], ()
        while last in by_removed:
            k = by_removed.pop(last)
            chain.append(k)
            last = tuple(map(tuple, rotation(k)))
        assert sorted(chain) == list(range(6)), (chain, got)
        assert clients[0].call("read_circuits")["circuits"] == rotation(chain[-1])
    finally:
        for c in clients:
            c.close()


@pytest.mark.parametrize("when", ["before", "after"])
def test_a_session_dropped_during_a_change_is_reconciled_once(switches, when):
    """The connection is cut before the switch runs the line (it must be sent again) or after
    (it must not be): the answer comes, and the switch holds the circuits."""
    server, physics, request, _ = switches[1]
    with ServiceClient(request, timeout=30) as c:
        c.call("apply_circuits", circuits=rotation(1))
        lines = server.instrument.lines_in
        server.drop_on(r":OXC:SWIT:CONN:ONLY", when)
        got = c.call("apply_circuits", circuits=rotation(2))
        assert sorted(got["added"]) == rotation(2)
        assert c.call("read_circuits")["circuits"] == rotation(2)
        assert server.instrument.lines_in > lines
        assert switches[1][3].driver.reconnects == 1
        # the next change takes the fast path again, on the new session
        c.call("apply_circuits", circuits=rotation(3))
        assert c.call("read_circuits")["circuits"] == rotation(3)


def test_a_refusal_fails_alone_with_the_switch_error(switches):
    server, _, request, _ = switches[2]
    other = switches[0][2]
    driver = switches[2][3].driver
    drained_on: list[str] = []
    errors = driver.errors

    def drain():                      # the error queue is read with blocking queries
        drained_on.append(threading.current_thread().name)
        return errors()

    driver.errors = drain
    with ServiceClient(request, timeout=30) as c, ServiceClient(other, timeout=30) as d:
        c.call("apply_circuits", circuits=rotation(1))
        server.instrument.refuse = True
        got = call_many([(c, "apply_circuits", {"circuits": rotation(2)}),
                         (d, "apply_circuits", {"circuits": rotation(2)})], 30)
        assert isinstance(got[0], BusError) and "port 3 is stuck" in str(got[0]), got[0]
        assert not isinstance(got[1], BusError), got[1]
        assert drained_on == ["ocs2-device"], drained_on      # not the thread serving all
        # what the switch holds is read back, and the next change goes through
        assert c.call("read_circuits")["circuits"] == rotation(1)
        c.call("apply_circuits", circuits=rotation(2))
        assert c.call("read_circuits")["circuits"] == rotation(2)


def moving(physics, timeout: float = 30.0) -> None:
    """Wait until the switch has started a move (a change sent to it is being carried out)."""
    deadline = time.monotonic() + timeout
    while physics.pending_until() <= time.monotonic():
        assert time.monotonic() < deadline, "the switch never started moving"
        time.sleep(0.002)


def test_a_slow_switch_holds_up_only_its_own_requests(switches):
    """ocs3 takes 1.5 s to move: while it moves (its answer awaited), another switch's changes
    are answered."""
    _, physics, slow, _ = switches[3]
    fast = switches[0][2]
    with ServiceClient(slow, timeout=30) as s, ServiceClient(fast, timeout=30) as f:
        s.call("apply_circuits", circuits=rotation(1))
        done: dict[str, float] = {}

        def move():
            s.call("apply_circuits", circuits=rotation(2))
            done["slow"] = time.monotonic()

        t = threading.Thread(target=move)
        t.start()
        moving(physics)
        for k in range(3, 6):
            f.call("apply_circuits", circuits=rotation(k))
        done["fast"] = time.monotonic()
        t.join(30)
        assert done["fast"] < done["slow"], done
        assert s.call("read_circuits")["circuits"] == rotation(2)


def test_a_switch_silent_past_its_settle_time_holds_up_only_itself():
    """A switch that takes the change and does not answer within the driver's settle time
    (its move takes 3 s): its change is handed to its own thread (the session reopened and
    the map read back), while the other switch's changes are answered before it."""
    phys = [OCSPhysics(N, switching_s=0.0), OCSPhysics(N, switching_s=3.0)]
    options = {"settle_timeout_s": 1.0, "timeout_s": 2.0, "reconnect_s": 2.0}
    with served([(OCSInstrument(p), options) for p in phys]) as out, \
            ServiceClient(out[0][1], timeout=30) as ok, \
            ServiceClient(out[1][1], timeout=30) as quiet:
        answers: list = []

        def change():
            answers.append(call_many(
                [(quiet, "apply_circuits", {"circuits": rotation(1)})], 30)[0])
            answers.append(time.monotonic())

        t = threading.Thread(target=change)
        t.start()
        moving(phys[1])
        for k in range(1, 4):
            assert "added" in ok.call("apply_circuits", circuits=rotation(k))
        others_done = time.monotonic()
        t.join(30)
        # the switch had made the change: reconciled, not sent again
        assert answers and not isinstance(answers[0], BusError), answers
        assert others_done < answers[1]
        assert quiet.call("read_circuits")["circuits"] == rotation(1)
        assert out[1][2].driver.reconnects == 1


def test_served_alone_the_answers_are_the_same(switches):
    """`DeviceService.serve` (one service, its driver called from the device's own thread,
    as every service's) gives the same answers."""
    server, _, _, _ = switches[0]
    service = DeviceService(ServiceSpec("alone", "switch", server.resource, driver=DRIVER))
    request, _ = service.bind()
    stop = threading.Event()
    t = threading.Thread(target=service.serve, args=(stop,), daemon=True)
    t.start()
    try:
        with ServiceClient(request, timeout=30) as c:
            got = c.call("apply_circuits", circuits=rotation(6))
            assert sorted(got["added"]) == rotation(6)
            assert c.call("read_circuits")["circuits"] == rotation(6)
            assert service.calls is not None
    finally:
        stop.set()
        t.join(10)
        service.close()


def test_a_change_whose_client_gave_up_while_queued_is_not_run(switches):
    """A change queued behind a slow one of the same switch, whose deadline (its request's
    ttl_ms) passes before its turn, is dropped, not run late."""
    _, physics, slow, _ = switches[3]
    with ServiceClient(slow, timeout=30) as s, ServiceClient(slow, timeout=0.15) as hasty:
        s.call("apply_circuits", circuits=rotation(1))
        t = threading.Thread(target=lambda: s.call("apply_circuits", circuits=rotation(2)))
        t.start()
        moving(physics)
        with pytest.raises(BusError):
            hasty.call("apply_circuits", circuits=rotation(3))
        t.join(30)
        # the next call is queued behind the dropped one: if it had run, it would show
        assert s.call("read_circuits")["circuits"] == rotation(2)


def test_a_waiting_reply_is_taken_off_the_socket_line_by_line(switches):
    """`take_waiting`: two replies pipelined on one session are taken one line each, the
    second left where it was; the library's own reads go on from there."""
    # a session of its own
    driver = OpticalCircuitSwitch(switches[0][0].resource, timeout_s=DEVICE_S)
    try:
        driver._res_io_write("*IDN?;:OXC:SWIT:SIZE?")
        driver._res_io_write(":OXC:SWIT:SIZE?")
        deadline = time.monotonic() + 30
        while b"\n" not in (driver.session_socket().recv(4096, socket.MSG_PEEK)
                            .partition(b"\n")[2]):
            assert time.monotonic() < deadline, "the second reply never came"
            time.sleep(0.002)
        first = driver.take_waiting(10)
        assert first.endswith(";8,8") and "\n" not in first, first
        assert driver.reply_state() == "line"
        assert driver.take_waiting(10) == "8,8"
        assert driver.reply_state() == "wait"
        assert driver.query(":OXC:SWIT:SIZE?") == "8,8"     # through the library again
    finally:
        driver.close()


def test_a_port_named_twice_is_refused_as_sent_on_the_path_that_awaits(switches):
    """On the path that sends from the serving thread (the map known), circuits naming an
    input or an output twice are refused as they came, never merged, and nothing is sent."""
    _, physics, request, service = switches[0]

    def blocking_apply(circuits):
        raise AssertionError("a change on a known map went to the device's thread")

    with ServiceClient(request, timeout=30) as c:
        c.call("apply_circuits", circuits=rotation(1))
        service.driver.apply = blocking_apply
        lines = switches[0][0].instrument.lines_in
        for bad, says in (([[1, 9], [1, 10]], "port 1 "), ([[1, 9], [2, 9]], "port 9 ")):
            with pytest.raises(BusError) as e:
                c.call("apply_circuits", circuits=bad)
            assert "CircuitConflict" in str(e.value) and says in str(e.value), e.value
        assert switches[0][0].instrument.lines_in == lines
        assert c.call("snapshot")["state"]["circuits"] == rotation(1)
