"""`apply_circuits_together`: one request to one switch's service changing the switches served
together with it (`ptb serve --one-process`), each switch's part checked against its own
`expect`, queued behind its own calls (one writer per device) and counted in its own version;
one answer per switch. Checked on emulated OCSes over their real sockets, and from the agent's
side (`BusSwitch.apply_together` sends one request per group)."""
from __future__ import annotations

import contextlib
import gc
import logging
import threading
import time

import pytest
import zmq

from photonic_testbed.drivers.circuit_switch import ApplyReport, SwitchError
from photonic_testbed.emulator.ocs import OCSInstrument, OCSPhysics
from photonic_testbed.hil.agent.bus_switch import BusSwitch
from photonic_testbed.hil.bus import schema
from photonic_testbed.hil.bus.client import BadRequest, ServiceClient
from photonic_testbed.hil.bus.errors import BusError
from photonic_testbed.hil.bus.server import Server
from photonic_testbed.hil.bus.state import Set
from tests.test_serve_together import four_switches, moving, rotation, served


@pytest.fixture
def switches():
    with four_switches() as out:
        yield out


ALL = ["ocs0", "ocs1", "ocs2", "ocs3"]


def _state(request: str) -> dict:
    with ServiceClient(request, timeout=30) as c:
        return c.call("snapshot")["state"]


def _held(physics) -> list[list[int]]:
    """The circuits the emulated switch holds (its own state, not a service's belief)."""
    with physics.lock:
        return sorted([a, b] for a, b in physics.actual.items())


def _changes(names: list[str], k: int, versions: dict | None = None) -> list[dict]:
    return [{"switch": n, "circuits": rotation(k), "expect": (versions or {}).get(n)}
            for n in names]


def _listen(service) -> zmq.Socket:
    """A subscriber to a service's state, connected (a heartbeat of it came)."""
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.linger = 0
    for kind in (schema.STATE, schema.HEARTBEAT):
        sub.subscribe(schema.topic(kind, service.name))
    sub.connect(service.server.pub.endpoint)
    _next_message(sub, lambda msg: msg["type"] == "heartbeat")
    return sub


def _next_message(sub: zmq.Socket, wanted, timeout: float = 10.0) -> dict:
    deadline = time.monotonic() + timeout
    while sub.poll(max(1, int((deadline - time.monotonic()) * 1e3))):
        _, frame = sub.recv_multipart()
        msg = schema.decode(frame)
        if wanted(msg):
            return msg
        assert time.monotonic() < deadline
    raise AssertionError(f"no such message within {timeout} s")


def test_each_switch_is_changed_counted_and_published_as_its_own(switches):
    requests = {service.name: request for _, _, request, service in switches}
    before = {n: _state(requests[n])["version"] for n in ALL[:3]}
    sub = _listen(switches[2][3])
    with ServiceClient(requests["ocs1"], timeout=30) as c:
        got = c.call("apply_circuits_together",
                     changes=_changes(["ocs2", "ocs0", "ocs1"], 1, before))
        assert [part["switch"] for part in got["changes"]] == ["ocs2", "ocs0", "ocs1"]
        # ocs2's new circuits and version went out on its own publisher, unasked
        delta = _next_message(sub, lambda msg: msg["type"] == "delta")
        sub.close()
        changed = {tuple(op.path): op.value for op in delta["ops"] if isinstance(op, Set)}
        assert changed[("circuits",)] == rotation(1), delta
        assert changed[("version",)] == got["changes"][0]["version"], delta
        for part in got["changes"]:
            assert sorted(part["result"]["added"]) == rotation(1), part
            assert part["result"]["removed"] == []
        # each switch's version moved once (the one receiving the request too), and its
        # circuits and version went out on its own publisher
        for part in got["changes"]:
            incarnation, n = before[part["switch"]].rsplit(":", 1)
            assert part["version"] == f"{incarnation}:{int(n) + 1}"
            state = _state(requests[part["switch"]])
            assert state["version"] == part["version"]
            assert state["circuits"] == rotation(1)
    for _, physics, _, service in switches:
        assert _held(physics) == (rotation(1) if service.name != "ocs3" else [])
    # a switch not named is untouched, its version too
    assert _state(requests["ocs3"])["version"].endswith(":0")


def test_a_retry_is_answered_with_the_first_answer_and_runs_nothing_again(switches):
    requests = {service.name: request for _, _, request, service in switches}
    with ServiceClient(requests["ocs0"], timeout=30) as c, \
            ServiceClient(requests["ocs1"], timeout=30) as other:
        rid = c.send("apply_circuits_together", {"changes": _changes(["ocs0", "ocs1"], 1)},
                     wait=10)
        first = c.receive(rid, time.monotonic() + 30)
        other.call("apply_circuits", circuits=rotation(2))      # ocs1 moved on since
        again = c.send("apply_circuits_together", {"changes": _changes(["ocs0", "ocs1"], 1)},
                       rid=rid, wait=10)
        assert c.receive(again, time.monotonic() + 30) == first
        assert other.call("read_circuits")["circuits"] == rotation(2)   # not set back
    assert _state(requests["ocs0"])["version"].endswith(":1")


def test_a_stale_refused_or_conflicting_switch_fails_alone(switches):
    requests = {service.name: request for _, _, request, service in switches}
    versions = {n: _state(requests[n])["version"] for n in ALL[:3]}
    versions["ocs1"] = versions["ocs1"].rsplit(":", 1)[0] + ":7"        # not its version
    switches[2][0].instrument.refuse = True                            # ocs2: a stuck port
    with ServiceClient(requests["ocs0"], timeout=30) as c:
        got = c.call("apply_circuits_together",
                     changes=_changes(["ocs0", "ocs1", "ocs2"], 1, versions)
                     + [{"switch": "ocs3", "circuits": [[1, 9], [2, 9]]}])["changes"]
    assert sorted(got[0]["result"]["added"]) == rotation(1)
    assert got[1]["error"] == "StaleState" and "not " in got[1]["message"], got[1]
    assert got[1]["version"].endswith(":0")                # refused before anything ran
    assert "port 3 is stuck" in got[2]["message"], got[2]
    assert got[2]["version"].endswith(":1")                # it may have changed half way
    assert got[3]["error"] == "CircuitConflict" and "9" in got[3]["message"], got[3]
    assert _held(switches[0][1]) == rotation(1)
    assert _held(switches[1][1]) == _held(switches[2][1]) == _held(switches[3][1]) == []


@pytest.mark.parametrize("changes, expect, says", [
    (_changes(["ocs0", "ocs9"], 1), None, "ocs9 not served together with ocs0"),
    (_changes(["ocs0", "ocs1", "ocs0"], 1), None, "names ocs0 more than once"),
    ([{"switch": "ocs1", "circuits": rotation(1), "extra": 1}], None, "extra"),
    ([], None, "length >= 1"),
    (_changes(["ocs0", "ocs1"], 1), "x:0", "each with its own expected version"),
])
def test_a_request_that_cannot_run_as_sent_changes_no_switch(switches, changes, expect, says):
    requests = {service.name: request for _, _, request, service in switches}
    with ServiceClient(requests["ocs0"], timeout=30) as c:
        with pytest.raises(BadRequest) as e:
            c.call("apply_circuits_together", changes=changes, expect=expect)
    assert says in str(e.value), e.value
    for _, physics, request, _ in switches:
        assert _held(physics) == []
        assert _state(request)["version"].endswith(":0")


def test_a_switch_part_waits_behind_its_own_calls_and_others_wait_behind_it(switches):
    """ocs3 moves in 1.5 s: a change to it sent alone, then one together with ocs0, then one
    alone again: each ran on what the one before it left (one writer, in arrival order),
    while ocs0's part did not wait for ocs3's first move."""
    requests = {service.name: request for _, _, request, service in switches}
    physics = switches[3][1]
    out: dict[str, object] = {}
    with ServiceClient(requests["ocs3"], timeout=30) as a, \
            ServiceClient(requests["ocs0"], timeout=30) as b, \
            ServiceClient(requests["ocs3"], timeout=30) as c:
        first = threading.Thread(target=lambda: out.__setitem__(
            "first", a.call("apply_circuits", circuits=rotation(1))))
        first.start()
        moving(physics)
        together = threading.Thread(target=lambda: out.__setitem__(
            "together", b.call("apply_circuits_together",
                               changes=_changes(["ocs0", "ocs3"], 2))))
        together.start()
        # ocs0's part is done long before ocs3 is free
        deadline = time.monotonic() + 30
        while _held(switches[0][1]) != rotation(2):
            assert time.monotonic() < deadline
            time.sleep(0.005)
        assert "first" not in out
        third = c.call("apply_circuits", circuits=rotation(3))
        first.join(30)
        together.join(30)
    parts = {p["switch"]: p for p in out["together"]["changes"]}
    assert sorted(parts["ocs3"]["result"]["removed"]) == rotation(1)
    assert sorted(third["removed"]) == rotation(2)
    assert _held(physics) == rotation(3)


def _bus_switches(switches, names=ALL[:3]) -> list[BusSwitch]:
    by_name = {service.name: request for _, _, request, service in switches}
    return [BusSwitch(n, ServiceClient(by_name[n], timeout=30)) for n in names]


def test_the_agent_sends_switches_served_together_in_one_request(switches):
    bus = _bus_switches(switches)
    try:
        assert len({sw.group for sw in bus}) == 1 and bus[0].group is not None
        assert bus[0].group[1] == frozenset(ALL)
        asked = sum(service.server.requests for *_, service in switches)
        got = BusSwitch.apply_together([(sw, dict(rotation(1))) for sw in bus])
        assert sum(service.server.requests for *_, service in switches) == asked + 1
        assert all(isinstance(r, ApplyReport) and r.added == dict(rotation(1)) for r in got)
        # a switch changed under the agent is read again and written; the others once
        with ServiceClient(switches[1][2], timeout=30) as someone:
            someone.call("apply_circuits", circuits=rotation(5))
        got = BusSwitch.apply_together([(sw, dict(rotation(2))) for sw in bus])
        assert all(isinstance(r, ApplyReport) for r in got), got
        assert got[1].removed == dict(rotation(5)) and got[0].removed == dict(rotation(1))
        for _, physics, _, _ in switches[:3]:
            assert _held(physics) == rotation(2)
        assert [sw.version for sw in bus] == [_state(r)["version"]
                                             for _, _, r, _ in switches[:3]]
    finally:
        for sw in bus:
            sw.close()


def test_switches_the_agent_thought_together_but_served_apart_are_sent_each_its_own(switches):
    """A group that is no longer served together (the services restarted apart): the request
    together is refused and each switch is sent its own, alone until it asks its service
    again (REGROUP_S later): then with the group its service says it is in."""
    phys = OCSPhysics(8, switching_s=0.0)
    with served([(OCSInstrument(phys), {})]) as apart:
        bus = _bus_switches(switches, ["ocs0", "ocs1"])
        lone = BusSwitch("ocs0", ServiceClient(apart[0][1], timeout=30))   # another ocs0
        bus[1].group = lone.group = bus[0].group
        try:
            got = BusSwitch.apply_together([(lone, dict(rotation(1))),
                                            (bus[1], dict(rotation(1)))])
            assert all(isinstance(r, ApplyReport) for r in got), got
            assert _held(phys) == rotation(1) and _held(switches[1][1]) == rotation(1)
            assert _held(switches[0][1]) == []          # the ocs0 served together: untouched
            assert lone.group is None and bus[1].group is None
            # asked again once REGROUP_S has passed: ocs1's service says it serves ocs0..3
            # together, the lone ocs0's that it serves ocs0 alone
            for sw in (lone, bus[1]):
                assert sw._regroup_at is not None and sw._regroup_at > time.monotonic()
                sw._regroup_at = time.monotonic()
            got = BusSwitch.apply_together([(bus[0], dict(rotation(2))),
                                            (bus[1], dict(rotation(2))),
                                            (lone, dict(rotation(2)))])
            assert all(isinstance(r, ApplyReport) for r in got), got
            assert bus[1].group == bus[0].group and bus[0].group[1] == frozenset(ALL)
            assert lone.group is None and lone._regroup_at > time.monotonic()
            assert _held(switches[0][1]) == _held(switches[1][1]) == _held(phys) == rotation(2)
        finally:
            for sw in (*bus, lone):
                sw.close()


def test_a_service_served_alone_says_so_and_is_sent_its_own_requests(switches):
    with served([(OCSInstrument(OCSPhysics(8, switching_s=0.0)), {})]) as alone:
        sw = BusSwitch("ocs0", ServiceClient(alone[0][1], timeout=30))
        try:
            assert sw.group is None
            got = BusSwitch.apply_together([(sw, dict(rotation(1)))])
            assert isinstance(got[0], ApplyReport) and not isinstance(got[0], BusError)
        finally:
            sw.close()


def test_changes_together_leave_nothing_for_the_collector(switches):
    """What a change together makes is freed as soon as it is answered (reference counts),
    none of it left in cycles for the collector: the collector's passes over that garbage
    paused the serving thread 25-40 ms every second under a stream of 64-switch changes."""
    requests = {service.name: request for _, _, request, service in switches}
    with ServiceClient(requests["ocs0"], timeout=30) as c:
        c.call("apply_circuits_together", changes=_changes(ALL[:3], 1))
        gc.collect()
        gc.disable()
        try:
            for k in range(2, 42):
                c.call("apply_circuits_together", changes=_changes(ALL[:3], k % 8))
            found = gc.collect()
        finally:
            gc.enable()
    assert found < 200, found


@contextlib.contextmanager
def _contrary_server(name: str, ports: int, handlers: dict):
    """A switch server whose handlers answer at odds with the contract, polled on a thread;
    yields its request endpoint."""
    with Server(name, {"ports": ports}, kind="switch", handlers=handlers,
                publish_version=True) as server:
        stop = threading.Event()
        t = threading.Thread(target=lambda: [server.poll(0.02) for _ in iter(stop.is_set, True)],
                             daemon=True)
        t.start()
        try:
            yield server.router.getsockopt_string(zmq.LAST_ENDPOINT)
        finally:
            stop.set()
            t.join(10)


@pytest.mark.parametrize("answer", [{"changes": []}, {"changes": [{"switch": "b"}]}, [1, 2],
                                    {"changes": [{"switch": "b"}, {"switch": "a"}]}])
def test_an_answer_together_for_other_switches_fails_each_switch_not_the_agent(answer):
    """A service that answers the changes together with entries for other switches than those
    asked (at odds with the contract): each switch fails with a SwitchError, nothing raised."""
    handlers = {"apply_circuits_together": lambda args: answer,
                "describe": lambda args: {"together": {"group": "g", "switches": ["a", "b"]}}}
    with _contrary_server("a", 8, handlers) as request:
        bus = [BusSwitch(n, ServiceClient(request, timeout=10)) for n in ("a", "b")]
        assert bus[0].group == bus[1].group is not None
        got = BusSwitch.apply_together([(sw, {1: 9}) for sw in bus])
        assert all(isinstance(r, SwitchError) and "other switches" in str(r)
                   for r in got), got
        for sw in bus:
            sw.close()


@pytest.mark.parametrize("together", [
    {"group": "g", "switches": "ab"},            # a string: 'a' is in it, as a substring
    {"group": "g", "switches": ["a", 2]}, {"group": 7, "switches": ["a", "b"]},
    {"group": "g"}, ["a", "b"], "g", 0,
])
def test_a_together_not_as_documented_leaves_the_switch_on_its_own(together, caplog):
    """A service whose `describe` names the switches served together in another shape than
    {group: an id, switches: [names]}: the switch is sent its own requests, with a warning
    saying why, and still applies its circuits."""
    handlers = {"describe": lambda args: {"together": together},
                "apply_circuits": lambda args: {"added": [[1, 9]], "removed": [],
                                                "seconds": 0.0}}
    with _contrary_server("a", 8, handlers) as request:
        with caplog.at_level(logging.WARNING, logger="photonic_testbed.hil.agent.bus"):
            sw = BusSwitch("a", ServiceClient(request, timeout=10))
        assert sw.group is None
        assert "not {group: an id, switches: [names]}" in caplog.text
        assert sw.apply({1: 9}).added == {1: 9}
        sw.close()


def test_a_report_that_cannot_be_read_is_journaled_as_such_after_the_grant(tmp_path):
    """A service answers a change with a result whose circuit lists cannot be read (at odds
    with the contract): the switch said it made the circuits, so the job gets its grant; the
    journal says which report could not be read, and an alarm is raised."""
    from agent_events import Heard

    from photonic_testbed.common.jobplan import dp_tp
    from photonic_testbed.common.rack_layout import opus
    from photonic_testbed.hil.agent import Agent
    from photonic_testbed.hil.agent.sqlite_journal import SqliteJournal
    bad = {"added": [[1, 40], [1, 41]], "removed": "none", "seconds": 0.0}
    handlers = {"apply_circuits": lambda args: bad}
    with _contrary_server("ocs", 32, handlers) as request, \
            SqliteJournal(tmp_path / "j.db") as journal:
        sw = BusSwitch("ocs", ServiceClient(request, timeout=10))
        heard = Heard()
        agent = Agent(opus(), {"ocs": sw}, journal, lambda s, p: 0.0, events=heard)
        alarms, grants = heard.alarms, heard.grants
        agent.admit(dp_tp(8))                   # its first phase's outcome: one entry
        applied = journal.entries(kinds=("phase",))[-1].details.applied["ocs"]
        assert applied.added == [] and "input 1 is named twice" in applied.unreadable
        key = next(k for k in agent.job().circuits.targets if k != agent.phase)
        agent.on_phase(*key)                    # a phase switch: one entry for it
        assert grants == [key]
        phase = journal.entries(kinds=("phase",))[-1].details
        assert "input 1 is named twice" in phase.applied["ocs"].unreadable
        assert len(alarms) == 2 and all("cannot be read" in a for a in alarms), alarms
        sw.close()


@pytest.mark.parametrize("raw", [
    [[3, 40], [1, 33], [2, 35]],          # the usual list, out of order
    [],
    [[1, 33], [2, 33]],                   # an output named twice
    [[1, 33], [1, 34]],                   # an input named twice
    [[1, True]], [[1, 2.0]], [[1, 2, 3]], [1, 2], "(@1),(@33)", None,
])
def test_a_reports_lists_are_journaled_as_reading_them_as_circuits_says(raw):
    """The agent's one-pass reading of a service's report gives the pairs, or the refusal,
    that reading the list as circuits gives."""
    from photonic_testbed.drivers.circuit_switch import ApplyReport
    from photonic_testbed.hil.agent.bus_switch import _AnsweredReport

    def outcome(read):
        try:
            return read(_AnsweredReport({"added": raw, "removed": []}, 0.0), "added")
        except Exception as e:                         # noqa: BLE001 (compared below)
            return type(e), str(e)
    want = outcome(ApplyReport.pairs)
    assert outcome(_AnsweredReport.pairs) == want
    if isinstance(want, list):
        assert want == sorted(want) and all(type(a) is int and type(b) is int for a, b in want)
