"""The bus's message schema and the state mirror, without sockets."""
from __future__ import annotations

import json
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from photonic_testbed.hil.bus import schema
from photonic_testbed.hil.bus.mirror import Mirror, StatePublisher
from photonic_testbed.hil.bus.state import Delete, Set, StateError, apply, touched


def req(**fields):
    msg = {"v": 1, "type": "request", "id": "r1", "op": "ping"}
    msg.update(fields)
    return json.dumps(msg).encode()


@given(st.lists(st.floats(min_value=-1000, max_value=1000), max_size=64))
def test_heater_vectors_round_trip_exactly(volts):
    msg = schema.make("request", id="x", op="set_heaters", args={"volts": volts})
    back = schema.decode(schema.encode(msg))
    assert back["args"]["volts"] == volts
    assert all(type(a) is type(b) for a, b in zip(back["args"]["volts"], volts, strict=True))


def test_encode_refuses_what_json_cannot_carry_and_keeps_the_rest():
    for bad in (float("nan"), float("inf"), -float("inf")):
        with pytest.raises(ValueError):
            schema.encode({"x": [1.0, bad]})
    assert json.loads(schema.encode({"a": None, "b": "null", 1: 2})) == {"a": None, "b": "null",
                                                                       "1": 2}
    assert json.loads(schema.encode({"big": 2 ** 70})) == {"big": 2 ** 70}
    assert schema.decode(schema.encode(schema.make("error", id=None, error="E", message="m")))[
        "id"] is None


def test_heater_vector_is_compact():
    volts = [round(0.123456 * i, 4) for i in range(56)]
    frame = schema.encode(schema.make("request", id="1", op="set_heaters",
                                      args={"volts": volts}))
    assert len(frame) < 56 * 9 + 80


@pytest.mark.parametrize("frame, error, words", [
    (b"\xff\xfe garbage", schema.BadFrame, "not UTF-8 JSON"),
    (b"[1, 2]", schema.BadFrame, "JSON object"),
    (req(v=2), schema.UnknownVersion, "version 2"),
    (req(v=True), schema.UnknownVersion, "version True"),
    (req(type="launch"), schema.UnknownType, "launch"),
    (json.dumps({"v": 1, "type": "request", "op": "ping"}).encode(), schema.MissingField, "`id`"),
    (req(id=7), schema.WrongType, "Expected `str`, got `int` (at id)"),
    (req(ttl_ms=True), schema.WrongType, "got `bool` (at ttl_ms)"),
    (req(extra=1), schema.WrongType, "unknown field `extra`"),
    (req(op="set_heaters", args={"volts": "1,2"}), schema.BadRequest,
     "Expected `array`, got `str` (at volts)"),
    (req(op="set_heaters", args={}), schema.BadRequest, "missing required field `volts`"),
    (req(op="set_heaters", args={"volts": [1e6]}), schema.BadRequest, "<= 1000.0 (at volts[0])"),
    (req(op="read_power", args={"channels": [True]}), schema.BadRequest,
     "got `bool` (at channels[0])"),
    (req(op="read_power", args={"channels": list(range(1, 5000))}), schema.BadRequest,
     "length <= 4096 (at channels)"),
    (req(op="apply_circuits", args={"circuits": [[1, 17, 3]]}), schema.BadRequest,
     "length 2, got 3 (at circuits[0])"),
    (req(op="apply_circuits", args={"circuits": [[0, 17]]}), schema.BadRequest,
     ">= 1 (at circuits[0][0])"),
])
def test_decode_refuses_with_a_clear_message(frame, error, words):
    with pytest.raises(error) as got:
        schema.decode(frame)
    assert words in str(got.value)


def test_oversized_frame_is_refused_before_parsing():
    with pytest.raises(schema.FrameTooLarge, match="exceeds the limit"):
        schema.decode(b"x" * (schema.MAX_FRAME + 1))


def test_every_message_type_has_a_valid_example():
    examples = {
        "request": dict(id="a", op="ping"),
        "reply": dict(id="a", result=None, version="i:0"),
        "error": dict(id=None, error="BadFrame", message="m"),
        "snapshot": dict(device="d", incarnation="i", seq=0, state={}),
        "delta": dict(device="d", incarnation="i", seq=1, ops=[Set(["a"], 1), Delete(["b"])]),
        "telemetry": dict(device="d", seq=1, t=1.5, values={}),
        "heartbeat": dict(device="d", incarnation="i", seq=0, t=1.0, online=True, interval=0.5),
    }
    assert set(examples) == set(schema.MESSAGES)
    for kind, fields in examples.items():
        msg = schema.make(kind, **fields)
        assert schema.decode(schema.encode(msg)) == msg


def test_circuits_on_the_wire():
    assert schema.circuits_to_wire({2: 18, 1: 17}) == [[1, 17], [2, 18]]
    import numpy as np  # ports worked out with numpy go out as JSON integers
    wire = schema.circuits_to_wire({np.int64(2): np.int32(18), 1: 17})
    assert wire == [[1, 17], [2, 18]] and {type(p) for pair in wire for p in pair} == {int}
    assert json.loads(schema.encode(schema.make("delta", device="x", incarnation="i", seq=1,
                      ops=[Set(["circuits"], wire)])))
    assert schema.circuits_from_wire([[1, 17]]) == {1: 17}
    with pytest.raises(schema.WrongType):
        schema.circuits_from_wire([[1, "17"]])
    with pytest.raises(schema.WrongType):
        schema.circuits_from_wire([[True, 17]])
    with pytest.raises(schema.BadRequest, match="input 1 is named twice"):
        schema.circuits_from_wire([[1, 17], [1, 18]])
    with pytest.raises(schema.BadRequest, match="output 17 is named twice"):
        schema.circuits_from_wire([[1, 17], [2, 17]])


def test_every_operation_is_declared_once_with_its_arguments():
    for name, op in schema.OPERATIONS.items():
        assert op.name == name and op.doc
        assert issubclass(op.args, schema.Args)
    reads = {n for n, op in schema.OPERATIONS.items() if op.read_only}
    assert {"ping", "describe", "snapshot", "read_circuits", "read_power", "rx_power"} <= reads
    # the changes that a retry must never repeat
    assert {"apply_circuits", "set_heaters", "set_laser", "admit", "phase", "job_failure",
            "swap", "clear_gpu", "load_calibration"}.isdisjoint(reads)
    checked = schema.check_args(schema.OPERATIONS["set_heaters"], {"volts": [1]})
    # the handler receives the operation's own Struct, defaults filled in (not a dict)
    assert checked == schema.SetHeaters(volts=[1.0], first=0)
    assert type(checked.volts[0]) is float


def test_state_operations_paths_and_errors():
    state = {"a": {"b": [1, 2]}, "c": 1}
    apply(state, [Set(["a", "b", 1], 5), Set(["a", "b", 2], 6), Delete(["c"])])
    assert state == {"a": {"b": [1, 5, 6]}}
    assert touched([Set(["a", "b", 1], 5), Delete(["c"])]) == {"a", "c"}
    with pytest.raises(StateError, match="does not exist"):
        apply(state, [Set(["x", "y"], 1)])
    with pytest.raises(StateError, match="non-empty"):
        apply(state, [Delete([])])


def test_state_operations_on_the_wire_are_the_lists_of_protocol_1():
    """The wire as docs/bus.md has it: `["set", path, value]` and `["del", path]`, read back
    as the same operations; anything else in a delta is refused when decoded."""
    ops = [Set(["gpus", "gpu3"], {"state": "failed"}), Set(["events", 4], None),
           Delete(["events", 0])]
    frame = schema.encode(schema.make("delta", device="agent", incarnation="i", seq=2,
                                      ops=ops))
    assert json.loads(frame)["ops"] == [["set", ["gpus", "gpu3"], {"state": "failed"}],
                                        ["set", ["events", 4], None], ["del", ["events", 0]]]
    assert schema.decode(frame)["ops"] == ops
    for bad in ([["put", ["a"], 1]], [["set", ["a"]]], [["del", "a"]], [["set", [1.5], 0]]):
        frame = json.dumps({"v": 1, "type": "delta", "device": "d", "incarnation": "i",
                            "seq": 1, "ops": bad}).encode()
        with pytest.raises(schema.SchemaError):
            schema.decode(frame)


def test_a_few_changed_heaters_travel_alone():
    sent = []
    owner = StatePublisher("dac", {"volts": [0.0] * 56}, sent.append)
    mirror = Mirror("dac")
    mirror.load(owner.snapshot())
    owner.update({"volts": [0.0] * 10 + [1.5] + [0.0] * 45, "version": "a:1"})
    assert sent[-1]["ops"] == [Set(["volts", 10], 1.5), Set(["version"], "a:1")]
    owner.update({"volts": [2.0] * 56})
    assert sent[-1]["ops"] == [Set(["volts"], [2.0] * 56)]
    for msg in sent:
        mirror.feed(msg)
    assert mirror.state == owner.state


def test_a_few_changed_cells_travel_alone_and_the_owner_keeps_its_own_copy():
    sent = []
    cells = {f"c{i}": {"state": "bar", "theta": 3.14} for i in range(8)}
    owner = StatePublisher("chip", {"cells": cells}, sent.append)
    mirror = Mirror("chip")
    mirror.load(owner.snapshot())
    new = {k: dict(v) for k, v in cells.items() if k != "c7"}
    new["c2"]["state"] = "cross"
    owner.update({"cells": new})
    assert sent[-1]["ops"] == [Set(["cells", "c2"], {"state": "cross", "theta": 3.14}),
                               Delete(["cells", "c7"])]
    new["c2"]["theta"] = 0.0                     # the caller's object is not the state
    assert owner.state["cells"]["c2"]["theta"] == 3.14
    owner.update({"cells": {"x": {}}})          # most members changed: the whole object
    assert sent[-1]["ops"] == [Set(["cells"], {"x": {}})]
    owner.update({"pairs": {1: 2}})             # keys JSON would turn into strings: whole
    owner.update({"pairs": {1: 2, 3: 4, 5: 6}})
    assert sent[-1]["ops"] == [Set(["pairs"], {1: 2, 3: 4, 5: 6})]
    for msg in sent[:-2]:
        mirror.feed(msg)
    assert mirror.state == {"cells": {"x": {}}}



def test_values_handed_over_are_kept_as_they_are_and_mirrored_the_same():
    """`owned`: an answer's state built for it is kept by the publisher without a copy (the
    caller keeps no reference); what is published, and what a mirror makes of it, is the
    same as with a copy."""
    sent, copied = [], []
    circuits = [[1, 9], [2, 10]]
    owner = StatePublisher("ocs", {"circuits": []}, sent.append)
    twin = StatePublisher("ocs", {"circuits": []}, copied.append)
    owner.update({"circuits": circuits, "version": "a:1"}, owned=True)
    twin.update({"circuits": [[1, 9], [2, 10]], "version": "a:1"})
    assert owner.state["circuits"] is circuits
    assert twin.state == owner.state
    assert [m["ops"] for m in sent] == [m["ops"] for m in copied]
    mirror = Mirror("ocs")
    mirror.load(twin.snapshot())
    assert mirror.state == owner.state

def test_late_subscriber_buffers_deltas_until_its_snapshot():
    sent = []
    owner = StatePublisher("sw", {"circuits": []}, sent.append)
    owner.set(["circuits"], [[1, 17]])
    mirror = Mirror("sw")
    owner.set(["circuits"], [[1, 18]])          # arrives before the snapshot
    mirror.feed(sent[-1])
    assert mirror.state is None and mirror.needs_snapshot
    snap = owner.snapshot()                      # taken after delta 2
    owner.set(["circuits"], [[2, 18]])
    mirror.feed(sent[-1])
    assert mirror.load(snap)
    assert mirror.state == owner.state and mirror.seq == owner.seq


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from("abc"), st.integers(0, 9), st.booleans()),
                min_size=1, max_size=40), st.randoms(use_true_random=False))
def test_a_mirror_that_loses_deltas_recovers_by_snapshot(changes, rnd):
    sent = []
    owner = StatePublisher("d", {}, sent.append)
    mirror = Mirror("d")
    mirror.load(owner.snapshot())
    for key, value, lost in changes:
        owner.update({key: value}) if rnd.random() < 0.7 else owner.change(
            [Delete([key])] if key in owner.state else [])
        while sent:
            msg = sent.pop(0)
            if not lost:
                mirror.feed(msg)
        if mirror.needs_snapshot:
            mirror.load(owner.snapshot())
        beat = schema.make("heartbeat", device="d", incarnation=owner.incarnation,
                           seq=owner.seq, t=0.0, online=True, interval=0.5)
        mirror.feed(beat)
        if mirror.needs_snapshot:
            mirror.load(owner.snapshot())
        assert mirror.state == owner.state


def test_a_restarted_owner_is_noticed():
    sent = []
    first = StatePublisher("d", {"x": 1}, sent.append)
    mirror = Mirror("d")
    mirror.load(first.snapshot())
    second = StatePublisher("d", {"x": 2}, sent.append)
    second.update({"x": 3})
    mirror.feed(sent[-1])
    assert mirror.needs_snapshot
    mirror.load(second.snapshot())
    assert mirror.state == {"x": 3}


def test_a_service_answers_an_unencodable_result_with_an_error():
    import threading

    from photonic_testbed.hil.bus.client import RemoteError, ServiceClient
    from photonic_testbed.hil.devices.service import DeviceService, ServiceSpec
    from tests.bus_doubles import MemoryPowerMeter

    class NanMeter(MemoryPowerMeter):
        def read_power(self, channels):
            return {1: float("nan")}
    service = DeviceService(ServiceSpec("pm", "power_meter", "mem", telemetry_hz=0.0),
                            driver=NanMeter("mem"))
    request, _ = service.bind()
    stop = threading.Event()
    thread = threading.Thread(target=service.serve, args=(stop,), daemon=True)
    thread.start()
    try:
        with ServiceClient(request, timeout=5) as c:
            with pytest.raises(RemoteError, match="UnencodableResult: .*cannot be sent as JSON"):
                c.call("read_power")
            assert c.call("ping")["device"] == "pm"          # and the service carries on
    finally:
        stop.set()
        thread.join(5)
        service.close()


def test_a_state_server_mirrors_the_agents_own_state():
    import threading

    from photonic_testbed.hil.bus.client import ServiceClient, UnknownOperation
    from photonic_testbed.hil.bus.mirror import StateSubscriber
    from photonic_testbed.hil.bus.server import Server

    spares = schema.Operation("spares", schema.Args, read_only=True, doc="how many spares")
    server = Server("agent", {"spares": ["gpu7"], "phase": "dp"}, heartbeat=0.05,
                    operations=[spares],
                    handlers={"spares": lambda args: len(server.state.state["spares"])})
    request, publish = server.bind()
    stop = threading.Event()
    updates: list[dict] = []

    def loop():                                   # the owner's loop: all socket use is here
        while not stop.is_set():
            server.poll(0.01)
            while updates:
                server.update(updates.pop(0))
    thread = threading.Thread(target=loop, daemon=True)
    thread.start()
    try:
        with StateSubscriber({"agent": (request, publish)}) as sub, \
                ServiceClient(request, timeout=5) as c:
            assert sub.wait_synced(10)
            assert sub.state("agent") == {"spares": ["gpu7"], "phase": "dp"}
            assert c.call("spares") == 1
            with pytest.raises(UnknownOperation, match="offers: describe, ping, snapshot, spares"):
                c.call("apply_circuits", circuits=[])
            updates.append({"phase": "pp"})
            deadline = time.monotonic() + 10
            while sub.state("agent")["phase"] != "pp" and time.monotonic() < deadline:
                sub.poll(0.05)
            assert sub.state("agent") == {"spares": ["gpu7"], "phase": "pp"}
    finally:
        stop.set()
        thread.join(5)
        server.close()


def test_a_server_service_or_client_used_outside_its_life_says_so():
    """A server's sockets and state exist from `bind` to `close`, a device service's server
    likewise, a client's socket until `close`: a use outside that is refused in a sentence
    that names what and why, not an AttributeError from deep inside."""
    from photonic_testbed.hil.bus.client import BusError, ServiceClient
    from photonic_testbed.hil.bus.server import Server
    from photonic_testbed.hil.devices.kinds import ServiceError
    from photonic_testbed.hil.devices.service import DeviceService, ServiceSpec
    from tests.bus_doubles import MemoryPowerMeter

    server = Server("agent", {"phase": "dp"})
    with pytest.raises(RuntimeError, match=r"^agent: the server is not bound \(bind\(\) it"):
        server.update({"phase": "tp"})
    server.bind()
    assert server.update({"phase": "tp"}) is not None
    server.close()
    with pytest.raises(RuntimeError, match=r"agent: the server is not bound .* or is closed$"):
        server.poll(0)
    service = DeviceService(ServiceSpec("pm", "power_meter", "mem", telemetry_hz=0.0),
                            driver=MemoryPowerMeter("mem"))
    with pytest.raises(ServiceError, match=r"^service pm is not bound"):
        service.handle(schema.encode(schema.make("request", id="1", op="ping")))
    client = ServiceClient("tcp://127.0.0.1:9")
    client.close()
    with pytest.raises(BusError, match=r"^the client of tcp://127.0.0.1:9 is closed$"):
        client.receive("1", time.monotonic())


def test_a_map_by_port_is_read_back_with_the_ports_as_integers():
    """JSON keys a map by strings; a client reads an operation's declared result with the
    ports as the drivers give them, and a result at odds with its type is a BadResult."""
    from photonic_testbed.hil.bus.errors import BadResult
    assert schema.read_result("read_power", {"power": {"3": 0.5, "12": 1e-3}}) == \
        {"power": {3: 0.5, 12: 1e-3}}
    assert schema.read_result("rx_power", {"dbm": {"9": -3.4}, "errors": {"10": "dark"}}) == \
        {"dbm": {9: -3.4}, "errors": {10: "dark"}}
    assert schema.read_result("ping", {"device": "x"}) == {"device": "x"}   # as it came
    with pytest.raises(BadResult, match=r"read_power answered a result not of its type "
                                         r"\(Expected `int`, got `str` - at `key` in `\$.power`"):
        schema.read_result("read_power", {"power": {"three": 0.5}})
