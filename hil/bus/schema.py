"""Every message and every operation on the bus, declared once, and the protocol version.

A message is one JSON object (UTF-8) in one ZeroMQ frame, with `v` (the protocol version) and
`type`. Each type is a msgspec Struct below; `decode` checks a frame against its type at once
(field names, types, ranges, sizes: JSON `true` is not a number, a port list holds integers)
and refuses anything else with a `SchemaError` that names the field. Numbers stay exact in both
directions (floats are written as the shortest text that reads back to the same double); NaN and
infinity are refused rather than sent (see `encode`).

Every operation any server offers (device services, the agent, the GPU monitors) is an
`Operation` in `OPERATIONS`: its arguments (a Struct: types, ranges, sizes, defaults), whether
it only reads, and the roles whose keys may call it (`ROLES`: a key's role is in its
certificate in the rig's authorised keys folder, hil.bus.security). A server refuses an
operation it does not offer, a caller whose role may not call it, and arguments that do not
fit, before anything reaches a device. What is not read-only is a change, and runs at most once
per request id (hil.bus.server).

docs/bus.md lists every socket, topic, message and operation with an example.
"""
from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Annotated, Any, Literal, TypedDict

import msgspec
import orjson

from photonic_testbed.hil.bus.errors import (  # noqa: F401  (the schema's errors, re-exported)
    BadFrame,
    BadRequest,
    BadResult,
    FrameTooLarge,
    MissingField,
    SchemaError,
    UnknownType,
    UnknownVersion,
    WrongType,
)
from photonic_testbed.hil.bus.state import Delete, Set, wire

VERSION = 1
MAX_FRAME = 1 << 20          # bytes; a whole 4096-channel heater vector is ~80 kB

# Topics on a server's PUB socket (first frame of each published message), followed by the
# device name: b"state.heaters", b"telemetry.heaters", b"heartbeat.heaters".
STATE, TELEMETRY, HEARTBEAT = "state", "telemetry", "heartbeat"
TOPICS = (STATE, TELEMETRY, HEARTBEAT)

# Sizes: what one request may carry. Ports of an N x N switch are 1..2N (Polatis: N <= 576).
MAX_PORT = 4096
MAX_CIRCUITS = 4096
MAX_TOGETHER = 1024          # switches in one apply_circuits_together
MAX_CHANNELS = 4096          # heater channels of one board chain, power meter channels
MAX_NAME = 64                # a device, GPU, phase or request name
MAX_TEXT = 4096              # free text (a failure's reason)
MAX_RANKS = 65536

# Who may call what: a client key's role (hil.bus.security reads it from the key's certificate).
# observer: reads and subscribes; tenant: a job's own requests, for the jobs its key names;
# operator: every job's, and the manual changes the agent makes for a person; agent: the one
# role device services take changes from.
OBSERVER, TENANT, OPERATOR, AGENT = "observer", "tenant", "operator", "agent"
ROLES = (OBSERVER, TENANT, OPERATOR, AGENT)
EVERYONE = frozenset(ROLES)


def _meta(**kw) -> msgspec.Meta:
    return msgspec.Meta(**kw)


Port = Annotated[int, _meta(ge=1, le=MAX_PORT)]
Circuit = tuple[Port, Port]
Name = Annotated[str, _meta(min_length=1, max_length=MAX_NAME)]
Text = Annotated[str, _meta(max_length=MAX_TEXT)]
Volts = Annotated[float, _meta(ge=-1000.0, le=1000.0)]  # the board refuses above its VMAX


# ---- messages ---------------------------------------------------------------------------------

class Message(msgspec.Struct, tag_field="type", forbid_unknown_fields=True, omit_defaults=True):
    v: Literal[1]


class Request(Message, tag="request"):
    """client -> server (DEALER -> ROUTER). `ttl_ms`: how long it may wait in the queue;
    `expect`: compare-and-set, the state version the change was computed from; `term`: the
    sending agent's term, a change refused below the highest its server has seen (a fence)."""
    id: Annotated[str, _meta(min_length=1, max_length=200)]
    op: Annotated[str, _meta(min_length=1, max_length=MAX_NAME)]
    args: dict[str, Any] = {}
    ttl_ms: Annotated[float, _meta(ge=0)] | None = None
    expect: Annotated[str, _meta(max_length=200)] | None = None
    term: Annotated[int, _meta(ge=0, le=2 ** 62)] | None = None


class Reply(Message, tag="reply"):
    id: str
    result: Any
    version: str


class Error(Message, tag="error"):
    id: str | None
    error: str
    message: str
    version: str | None = None


class Snapshot(Message, tag="snapshot"):
    device: str
    incarnation: str
    seq: int
    state: dict[str, Any]


class Delta(Message, tag="delta"):
    """A change of the device's state (hil.bus.state): `ops`, each `["set", path, value]` or
    `["del", path]` on the wire, a `Set` or a `Delete` once decoded."""
    device: str
    incarnation: str
    seq: int
    ops: list[Set | Delete]


class Telemetry(Message, tag="telemetry"):
    device: str
    seq: int
    t: float
    values: dict[str, Any]


class Heartbeat(Message, tag="heartbeat"):
    device: str
    incarnation: str
    seq: int
    t: float
    online: bool
    interval: float


MESSAGES: dict[str, type[Message]] = {
    cls.__struct_config__.tag: cls                       # type: ignore[misc]
    for cls in (Request, Reply, Error, Snapshot, Delta, Telemetry, Heartbeat)}
_DECODER = msgspec.json.Decoder(Request | Reply | Error | Snapshot | Delta | Telemetry
                                | Heartbeat)


# ---- operations -------------------------------------------------------------------------------

class Args(msgspec.Struct, forbid_unknown_fields=True):
    """An operation's arguments (none)."""


class ApplyCircuits(Args):
    circuits: Annotated[list[Circuit], _meta(max_length=MAX_CIRCUITS)]


class MoveCircuits(Args):
    """A chip's circuits from these inputs taken off the waveguides they cross (drivers.mesh
    `Mesh.move`); `forget`: stop avoiding the waveguides of earlier moves (repaired) instead."""
    inputs: Annotated[list[Port], _meta(max_length=MAX_CIRCUITS)] = []
    # inputs whose circuits carry their full light: the waveguides they cross are not at fault
    healthy: Annotated[list[Port], _meta(max_length=MAX_CIRCUITS)] = []
    forget: bool = False


class SwitchChange(msgspec.Struct, forbid_unknown_fields=True):
    """One switch's part of `apply_circuits_together`: its circuits, and the state version
    they were computed from (compare-and-set for that switch alone)."""
    switch: Name
    circuits: Annotated[list[Circuit], _meta(max_length=MAX_CIRCUITS)]
    expect: Annotated[str, _meta(max_length=MAX_NAME)] | None = None


class ApplyTogether(Args):
    changes: Annotated[list[SwitchChange], _meta(min_length=1, max_length=MAX_TOGETHER)]


class SetHeaters(Args):
    volts: Annotated[list[Volts], _meta(max_length=MAX_CHANNELS)]
    first: Annotated[int, _meta(ge=0, lt=MAX_CHANNELS)] = 0


class ReadPower(Args):
    channels: Annotated[list[Annotated[int, _meta(ge=1, le=MAX_CHANNELS)]],
                        _meta(max_length=MAX_CHANNELS)] | None = None


class SetLaser(Args):
    on: bool | None = None
    power_mw: Annotated[float, _meta(ge=0.0, le=1000.0)] | None = None
    wavelength_nm: Annotated[float, _meta(ge=1000.0, le=2000.0)] | None = None


class LoadCalibration(Args):
    calibration: Annotated[str, _meta(max_length=MAX_FRAME)]        # the file's text


class Admit(Args):
    plan: dict[str, Any]
    rank_map: Annotated[dict[str, Name], _meta(max_length=MAX_RANKS)] | None = None
    job: Name | None = None                  # the job's name (its plan's name by default)


class PhaseArgs(Args):
    phase: Name
    round: Annotated[int, _meta(ge=0, le=1_000_000)] = 0
    job: Name | None = None                  # which job (the only one when left out)


class JobFailure(Args):
    reason: Text = ""
    gpus: Annotated[list[Name], _meta(max_length=MAX_RANKS)] = []
    links: Annotated[list[tuple[Name, Name]], _meta(max_length=MAX_RANKS)] = []  # (src, dst)
    job: Name | None = None


class Rejoin(Args):
    plan: dict[str, Any]
    rank_map: Annotated[dict[str, Name], _meta(max_length=MAX_RANKS)]
    restart_seq: Annotated[int, _meta(ge=0)]
    state: Literal["running", "failed"]
    job: Name | None = None


class JobArgs(Args):
    job: Name | None = None


class JobReport(Args):
    """What a job says of itself (the GUI's job view): its state, its step, its throughput
    (steps a second) and, for a training job, its loss."""
    state: Literal["running", "waiting", "failed", "restarting", "stopped", "done"]
    job: Name | None = None
    step: Annotated[int, _meta(ge=0)] = 0
    throughput: Annotated[float, _meta(ge=0.0, le=1e9)] | None = None
    loss: Annotated[float, _meta(ge=-1e9, le=1e9)] | None = None
    detail: Text = ""


class GpuArgs(Args):
    gpu: Name


Seconds = Annotated[float, _meta(ge=0.0, le=1e6)]
# a rank's step: (its GPU, the job's generation, the step, seconds computing, seconds waiting)
Count = Annotated[int, _meta(ge=0, le=10 ** 12)]
StepTiming = tuple[Name, Count, Count, Seconds, Seconds]
MAX_TIMINGS = 16384


class JobTimings(Args):
    """Each rank's time per step, computing and waiting in collectives (hil/agent/gray.py),
    and the stall of the job's last planned swap as it measured it."""
    job: Name | None = None
    rows: Annotated[list[StepTiming], _meta(max_length=MAX_TIMINGS)] = []
    swap_stall_s: Seconds | None = None
    warm: Annotated[list[Name], _meta(max_length=MAX_TIMINGS)] = []   # its warm standbys


class Handover(Args):
    """The job stands at a step boundary: swap the GPU the agent decided to, for one of `warm`
    (where the job keeps a warm standby) while any of them is a free spare."""
    gpu: Name
    job: Name | None = None
    warm: Annotated[list[Name], _meta(max_length=MAX_TIMINGS)] = []


class ManualCircuits(Args):
    """An operator's circuits on one switch, the agent's part of its own beside the jobs':
    `connect` adds (or moves) circuits, `disconnect` takes the circuits of these inputs down."""
    switch: Name
    connect: Annotated[list[Circuit], _meta(max_length=MAX_CIRCUITS)] = []
    disconnect: Annotated[list[Port], _meta(max_length=MAX_CIRCUITS)] = []


class ManualHeaters(Args):
    """An operator's heater volts on a chip or heater DAC (`set_heaters`, sent by the agent);
    `version`: the device's state version the operator saw (sent as its `expect`)."""
    device: Name
    volts: Annotated[list[Volts], _meta(max_length=MAX_CHANNELS)]
    first: Annotated[int, _meta(ge=0, lt=MAX_CHANNELS)] = 0
    version: Annotated[str, _meta(max_length=200)] | None = None


class ManualLaser(Args):
    """An operator's laser settings (`set_laser`, sent by the agent)."""
    device: Name
    on: bool | None = None
    power_mw: Annotated[float, _meta(ge=0.0, le=1000.0)] | None = None
    wavelength_nm: Annotated[float, _meta(ge=1000.0, le=2000.0)] | None = None


class DeviceArgs(Args):
    device: Name


class RxPower(Args):
    switch: Name
    ports: Annotated[list[Port], _meta(max_length=2 * MAX_CHANNELS)]


class PowerByPort(TypedDict):
    """A power meter's readings, mW by its port (the driver's `read_power`)."""
    power: dict[int, float]


class RxPowerByPort(TypedDict, total=False):
    """Received power at transceivers, dBm by the switch's output port, and why a port reads
    dark where it does."""
    dbm: dict[int, float]
    errors: dict[int, str]


@dataclass(frozen=True)
class Operation:
    """One operation: its arguments, whether it only reads, and the roles whose keys may call
    it (every role for a read, the operator alone for a change unless it says). Not read-only
    means a change: it runs at most once per request id, with `expect` only at that state
    version, and with `term` only from an agent whose term is not below the highest seen.
    `result`, where given, is the type a client reads the answer as: JSON keys a map by strings,
    and a map by port is read back with the ports as integers, as the drivers give them."""
    name: str
    args: type[Args]
    read_only: bool
    doc: str = ""
    result: Any = None
    # a change that moves this server's version; False: it asks for changes of devices served
    # with it, each counted by that device's server (`Server.claim_change`)
    counted: bool = True
    roles: frozenset[str] = frozenset()     # none named: EVERYONE for a read, else OPERATOR

    def __post_init__(self) -> None:
        roles = self.roles
        if not roles:
            roles = EVERYONE if self.read_only else frozenset({OPERATOR})
        unknown = sorted(roles - EVERYONE)
        if unknown:
            raise ValueError(f"operation {self.name}: roles are some of {', '.join(ROLES)}, "
                             f"not {sorted(roles)}")
        if not self.read_only and OBSERVER in roles:
            raise ValueError(f"operation {self.name} changes something: not for observers")
        object.__setattr__(self, "roles", frozenset(roles))


DEVICE_WRITER = frozenset({AGENT})            # the one role device services take changes from
JOB_OWNER = frozenset({TENANT, OPERATOR})     # the job's own tenant (hil.agent.bus checks whose)


OPERATIONS: dict[str, Operation] = {op.name: op for op in (
    # every server
    Operation("ping", Args, True, "no device I/O: name, kind, online, incarnation, version"),
    Operation("describe", Args, True, "what the server is and the operations it offers"),
    Operation("snapshot", Args, True, "the whole published state, as a snapshot message"),
    Operation("ping_device", Args, True, "one round trip to the device itself (a heater "
              "DAC's `id?`): the bare cost of reaching it"),
    # switches (an OCS, a chip's mesh)
    Operation("read_circuits", Args, True, "the circuits, read from the device"),
    Operation("apply_circuits", ApplyCircuits, False, "make the circuits exactly these",
              roles=DEVICE_WRITER),
    Operation("apply_circuits_together", ApplyTogether, False,
              "apply_circuits on several switches served together with this one, each with "
              "its own expect; one answer per switch", counted=False, roles=DEVICE_WRITER),
    # heater DACs and chips
    Operation("read_heaters", Args, True, "heater volts read back from the board"),
    Operation("set_heaters", SetHeaters, False, "set heater volts from channel `first` on",
              roles=DEVICE_WRITER),
    Operation("move_circuits", MoveCircuits, False,
              "a chip: the circuits from these inputs moved off the waveguides they cross "
              "now (a fading path), or `forget` the waveguides avoided", roles=DEVICE_WRITER),
    Operation("load_calibration", LoadCalibration, False,
              "a chip: use this calibration file from now on (circuits re-set with it)",
              roles=DEVICE_WRITER),
    # instruments
    Operation("read_power", ReadPower, True, "power meter readings, mW by port",
              result=PowerByPort),
    Operation("set_laser", SetLaser, False, "laser output, power, wavelength",
              roles=DEVICE_WRITER),
    Operation("read_laser", Args, True, "the laser's state, read from it"),
    # the agent
    Operation("admit", Admit, False, "a job announces its plan; the answer is its rank map",
              roles=JOB_OWNER),
    Operation("phase", PhaseArgs, False, "a job's phase boundary; answered once the circuits "
              "are up and verified", roles=JOB_OWNER),
    Operation("job_failure", JobFailure, False, "a job reports a failure it saw",
              roles=JOB_OWNER),
    Operation("phase_done", PhaseArgs, False, "a job is done with a phase's links and "
              "computes: the next phase's circuits are set up meanwhile", roles=JOB_OWNER),
    Operation("swap", GpuArgs, False, "an operator swaps a GPU for a spare"),
    Operation("rejoin", Rejoin, False, "a running job tells a (re)started agent where it "
              "stands: plan, rank map, last restart order taken, waiting or not",
              roles=JOB_OWNER),
    Operation("release", JobArgs, False, "a job is done: its GPUs and circuits are freed",
              roles=JOB_OWNER),
    Operation("job_report", JobReport, False, "a job's own state, step, throughput, loss",
              roles=JOB_OWNER),
    Operation("job_timings", JobTimings, False, "a job's per-rank compute and wait times; "
              "the answer names a GPU to hand over when the agent decided a planned swap",
              roles=JOB_OWNER),
    Operation("handover", Handover, False, "a job at a step boundary: the GPU the agent "
              "decided to swap is swapped now (its restart order follows)", roles=JOB_OWNER),
    Operation("manual_circuits", ManualCircuits, False, "an operator's circuits on a switch, "
              "journaled and kept by the agent beside the jobs' (ports no job holds)"),
    Operation("manual_heaters", ManualHeaters, False, "an operator's heater volts, journaled "
              "and sent by the agent (`set_heaters`)"),
    Operation("manual_laser", ManualLaser, False, "an operator's laser settings, journaled "
              "and sent by the agent (`set_laser`)"),
    Operation("relay_ping", DeviceArgs, True, "the agent asks a switch's service to "
              "`ping_device`: the bare hops a phase switch crosses, to compare it with"),
    # GPU monitors
    Operation("rx_power", RxPower, True, "received power at transceivers on output ports",
              result=RxPowerByPort),
    Operation("clear_gpu", GpuArgs, False, "forget a GPU's kept fatal Xids"),
    # device services
    Operation("fence", Args, False, "an agent that has taken the lead raises the device's "
              "term to its own before anything else: a change of an earlier leader's term is "
              "refused from then on (nothing else changes)", counted=False,
              roles=DEVICE_WRITER),
)}


NO_ARGS = Args()             # what a handler of an operation without arguments receives


def read_result(op: str, result: Any) -> Any:
    """An answer as its operation's `result` type reads it (ports as integers); as it came for
    an operation without one. A result at odds with its type is a `BadResult` saying what does
    not fit."""
    declared = OPERATIONS.get(op)
    if declared is None or declared.result is None:
        return result
    try:
        return msgspec.convert(result, declared.result, strict=False)
    except msgspec.ValidationError as e:
        raise BadResult(f"{op} answered a result not of its type ({e})") from None


def check_args(op: Operation, args: Mapping[str, Any]) -> Args:
    """The operation's arguments checked (type, range, size) with defaults filled in: its
    Struct, as the handler receives it; BadRequest saying which argument is wrong."""
    try:
        return msgspec.convert(args, op.args)
    except msgspec.ValidationError as e:
        raise BadRequest(f"{op.name} arguments: {_where(str(e), '$')}") from None


# ---- frames -----------------------------------------------------------------------------------

def _where(text: str, root: str) -> str:
    """msgspec's `- at `$.args.volts[3]`` in our words: `(at volts[3])`."""
    head, sep, path = text.partition(" - at `")
    if not sep:
        return text
    path = path.rstrip("`")
    path = path[len(root):].lstrip(".") if path.startswith(root) else path
    return f"{head} (at {path or 'top level'})"


def _frame_error(e: msgspec.MsgspecError, frame: bytes) -> SchemaError:
    text = str(e)
    if not isinstance(e, msgspec.ValidationError):       # (a ValidationError is a DecodeError)
        return BadFrame(f"frame is not UTF-8 JSON: {text}")
    if text.startswith("Expected `object`") and " - at " not in text:
        return BadFrame(f"a message is a JSON object: {text}")
    if text.endswith("`$.v`") or text == "Object missing required field `v`":
        try:
            v = orjson.loads(frame).get("v")
        except (ValueError, AttributeError):
            v = "?"
        return UnknownVersion(f"protocol version {v!r} is not supported (this end speaks "
                              f"{VERSION})")
    if text.endswith("`$.type`") or text == "Object missing required field `type`":
        try:
            kind = orjson.loads(frame).get("type")
        except (ValueError, AttributeError):
            kind = "?"
        return UnknownType(f"unknown message type {kind!r}; known: {', '.join(MESSAGES)}")
    if text.startswith("Object missing required field"):
        return MissingField(_where(text, "$"))
    return WrongType(_where(text, "$"))


def decode_message(frame: bytes, max_size: int = MAX_FRAME) -> Message:
    """One frame -> its checked message Struct, or SchemaError saying what is wrong."""
    if len(frame) > max_size:
        raise FrameTooLarge(f"frame of {len(frame)} bytes exceeds the limit of {max_size}")
    try:
        return _DECODER.decode(frame)
    except msgspec.MsgspecError as e:
        raise _frame_error(e, frame) from None


_OPTIONAL = {cls: [f.name for f in msgspec.structs.fields(cls)
                   if not f.required and f.default is None] for cls in MESSAGES.values()}


def decode(frame: bytes, max_size: int = MAX_FRAME) -> dict:
    """One frame -> a checked message as a dict (with `v` and `type`). A request's arguments
    are checked against its operation when the operation is known."""
    msg = decode_message(frame, max_size)
    out = msgspec.structs.asdict(msg)
    out["type"] = msg.__struct_config__.tag
    for k in _OPTIONAL[type(msg)]:
        if out[k] is None:
            del out[k]                        # absent, as `make` leaves it
    if isinstance(msg, Request):
        op = OPERATIONS.get(msg.op)
        if op is not None:
            check_args(op, msg.args)
    return out


# each message type's required fields (msgspec's introspection is slow: worked out once)
_REQUIRED = {name: frozenset(f.name for f in msgspec.structs.fields(cls) if f.required)
             for name, cls in MESSAGES.items()}


def make(type_: str, **fields) -> dict:
    """A message dict, checked against its type (a bug here must not reach the wire); fields
    given as None are left out where the type allows."""
    cls = MESSAGES[type_]
    msg = {"v": VERSION, "type": type_}
    required = _REQUIRED[type_]
    msg.update({k: v for k, v in fields.items() if v is not None or k in required})
    if type_ == "request":
        msg.setdefault("args", {})            # as `decode` gives it
    try:
        msgspec.convert(msg, cls)
    except msgspec.ValidationError as e:
        raise WrongType(f"{type_}: {_where(str(e), '$')}") from None
    return msg


def telemetry(device: str, seq: int, t: float, values: dict) -> dict:
    """A telemetry message, built without `make`'s checks: this is the hot path, and every
    field's type is fixed here."""
    if not isinstance(values, dict):
        raise WrongType(f"telemetry values must be an object, not {type(values).__name__}")
    return {"v": VERSION, "type": "telemetry", "device": str(device), "seq": int(seq),
            "t": float(t), "values": values}


def _state_op(obj: Any) -> list:
    """A delta's operation as JSON has it (orjson and the standard library call this for what
    they do not know)."""
    if isinstance(obj, (Set, Delete)):
        return wire(obj)
    raise TypeError(f"{type(obj).__name__} is not JSON serializable")


_JSON = json.JSONEncoder(separators=(",", ":"), allow_nan=False, default=_state_op)


def encode(msg: Mapping) -> bytes:
    """A message as one compact JSON frame. NaN and infinities are refused (ValueError), not
    sent: orjson writes them as null, so a frame holding null is written again by the standard
    library, which refuses them (and writes a real None as the same null)."""
    try:
        frame = orjson.dumps(msg, default=_state_op)
    except TypeError:          # int keys, integers beyond 64 bits: the standard library's rules
        return _JSON.encode(msg).encode()
    if b"null" in frame:
        return _JSON.encode(msg).encode()
    return frame


def topic(kind: str, device: str) -> bytes:
    return f"{kind}.{device}".encode()


def circuits_to_wire(circuits: Mapping[int, int]) -> list[list[int]]:
    """{input: output} -> [[input, output], ...] sorted by input (JSON keys are strings)."""
    return [[a, b] if type(a) is int and type(b) is int else [int(a), int(b)]
            for a, b in sorted(circuits.items())]


def circuits_from_wire(pairs) -> dict[int, int]:
    """[[input, output], ...] -> {input: output}. Refused (BadRequest), never merged: a pair
    that is not two integers, an input named twice (which output was meant?), an output named
    twice (two inputs cannot both own it)."""
    out: dict[int, int] = {}
    outputs: set[int] = set()
    for pair in pairs:
        # the usual pair in one test; anything else is looked at closely (and maybe refused)
        if type(pair) in _PAIR_TYPES and len(pair) == 2:
            a, b = pair
            if type(a) is int and type(b) is int and a not in out and b not in outputs:
                out[a] = b
                outputs.add(b)
                continue
        a, b = _wire_pair(pair, out, outputs)
        out[a] = b
        outputs.add(b)
    return out


_PAIR_TYPES = (list, tuple)


def _wire_pair(pair, out: dict[int, int], outputs: set[int]) -> tuple[int, int]:
    if (not isinstance(pair, (list, tuple)) or len(pair) != 2
            or not all(isinstance(p, int) and not isinstance(p, bool) for p in pair)):
        raise WrongType(f"a circuit is [input, output] (two integers), not {pair!r}")
    a, b = pair
    if a in out:
        raise BadRequest(f"input {a} is named twice ([{a}, {out[a]}] and [{a}, {b}]): "
                         "a circuit set gives each input one output")
    if b in outputs:
        owner = next(i for i, o in out.items() if o == b)
        raise BadRequest(f"output {b} is named twice ([{owner}, {b}] and [{a}, {b}]): "
                         "two inputs cannot share an output")
    return a, b
