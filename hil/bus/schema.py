"""Every message on the bus: its type, fields, field types, and the protocol version.

A message is one JSON object (UTF-8) in one ZeroMQ frame, with `v` (the protocol version) and
`type`. JSON keeps numbers exact in both directions (floats are written as the shortest text
that reads back to the same double), and a vector of heater voltages is a plain JSON array:
about eight bytes a channel. Frames are written and read by `orjson` (strict JSON; NaN and
infinity are refused rather than sent, see `encode`). `decode` refuses anything that is not
exactly a known message of this version, with a `SchemaError` whose message says what was
wrong; the service answers such a frame with an `error` message and carries on.

docs/bus.md lists every socket, topic and message with an example.
"""
from __future__ import annotations

import json
from collections.abc import Mapping

import orjson

VERSION = 1
MAX_FRAME = 1 << 20          # bytes; a whole 4096-channel heater vector is ~80 kB

# Topics on a service's PUB socket (first frame of each published message), followed by the
# device name: b"state.heaters", b"telemetry.heaters", b"heartbeat.heaters".
STATE, TELEMETRY, HEARTBEAT = "state", "telemetry", "heartbeat"
TOPICS = (STATE, TELEMETRY, HEARTBEAT)

# Operations a service may offer, and for each its arguments: name -> (type, required).
# Which device kinds offer which operations is hil.bus.service.KINDS.
_NUM = (int, float)
OPS: dict[str, dict[str, tuple[tuple[type, ...], bool]]] = {
    "ping": {},
    "describe": {},
    "snapshot": {},
    "read_circuits": {},
    "apply_circuits": {"circuits": ((list,), True)},
    "read_heaters": {},
    "set_heaters": {"volts": ((list,), True), "first": ((int,), False)},
    "read_power": {"channels": ((list,), False)},
    "set_laser": {"on": ((bool,), False), "power_mw": (_NUM, False),
                  "wavelength_nm": (_NUM, False)},
    "read_laser": {},
}
# Operations that change hardware: serialised by the one writer, and compare-and-set when the
# request carries `expect`.
CHANGING = frozenset({"apply_circuits", "set_heaters", "set_laser", "swap", "admit"})

# Message fields: name -> (accepted types, required). `None` in a type tuple allows null.
_ANY = (object,)
MESSAGES: dict[str, dict[str, tuple[tuple, bool]]] = {
    # client -> service (DEALER -> ROUTER)
    "request": {"id": ((str,), True), "op": ((str,), True), "args": ((dict,), False),
                "ttl_ms": (_NUM, False), "expect": ((str,), False)},
    # service -> client
    "reply": {"id": ((str,), True), "result": (_ANY, True), "version": ((str,), True)},
    "error": {"id": ((str, type(None)), True), "error": ((str,), True),
              "message": ((str,), True), "version": ((str, type(None)), False)},
    # service -> subscribers (PUB), topic "state.<device>"
    "snapshot": {"device": ((str,), True), "incarnation": ((str,), True),
                 "seq": ((int,), True), "state": ((dict,), True)},
    "delta": {"device": ((str,), True), "incarnation": ((str,), True), "seq": ((int,), True),
              "ops": ((list,), True)},
    # topic "telemetry.<device>"
    "telemetry": {"device": ((str,), True), "seq": ((int,), True), "t": (_NUM, True),
                  "values": ((dict,), True)},
    # topic "heartbeat.<device>"
    "heartbeat": {"device": ((str,), True), "incarnation": ((str,), True),
                  "seq": ((int,), True), "t": (_NUM, True), "online": ((bool,), True),
                  "interval": (_NUM, True)},
}


class SchemaError(ValueError):
    """A frame that is not a valid message of this protocol version."""


class FrameTooLarge(SchemaError):
    pass


class BadFrame(SchemaError):
    """Not JSON, not an object, or not UTF-8."""


class UnknownVersion(SchemaError):
    pass


class UnknownType(SchemaError):
    pass


class MissingField(SchemaError):
    pass


class WrongType(SchemaError):
    pass


def _type_names(types: tuple) -> str:
    names = {int: "integer", float: "number", str: "string", dict: "object", list: "array",
             bool: "boolean", type(None): "null", object: "anything"}
    return " or ".join(names.get(t, t.__name__) for t in types)


def _is(value, types: tuple) -> bool:
    if object in types:
        return True
    if isinstance(value, bool) and bool not in types:
        return False          # JSON true is not a number here
    if isinstance(value, int) and float in types:
        return True
    return isinstance(value, types)


_ENVELOPE = frozenset({"v", "type"})


def check_fields(where: str, obj: Mapping, spec: Mapping, extra_ok: bool = False) -> None:
    for name, (types, required) in spec.items():
        if name not in obj:
            if required:
                raise MissingField(f"{where}: field {name!r} is missing")
            continue
        value = obj[name]
        if type(value) in types and type(value) is not bool:
            continue                                   # the common case, decided at once
        if not _is(value, types):
            raise WrongType(f"{where}: field {name!r} must be {_type_names(types)}, "
                            f"not {type(value).__name__}")
    if not extra_ok and not obj.keys() <= spec.keys() | _ENVELOPE:
        unknown = sorted(set(obj) - set(spec) - {"v", "type"})
        if unknown:
            raise WrongType(f"{where}: unknown field(s) {', '.join(map(repr, unknown))}")


def make(type_: str, **fields) -> dict:
    """A message dict (checked: a bug here must not reach the wire)."""
    spec = MESSAGES[type_]
    msg = {"v": VERSION, "type": type_,
           **{k: v for k, v in fields.items() if v is not None or spec.get(k, (0, False))[1]}}
    check_fields(type_, msg, MESSAGES[type_])
    return msg


def telemetry(device: str, seq: int, t: float, values: dict) -> dict:
    """A telemetry message, built without `make`'s checks: this is the hot path, and every
    field's type is fixed here."""
    if not isinstance(values, dict):
        raise WrongType(f"telemetry values must be an object, not {type(values).__name__}")
    return {"v": VERSION, "type": "telemetry", "device": str(device), "seq": int(seq),
            "t": float(t), "values": values}


_JSON = json.JSONEncoder(separators=(",", ":"), allow_nan=False)


def encode(msg: Mapping) -> bytes:
    """A message as one compact JSON frame. NaN and infinities are refused (ValueError), not
    sent: orjson writes them as null, so a frame holding null is written again by the standard
    library, which refuses them (and writes a real None as the same null)."""
    try:
        frame = orjson.dumps(msg)
    except TypeError:          # int keys, integers beyond 64 bits: the standard library's rules
        return _JSON.encode(msg).encode()
    if b"null" in frame:
        return _JSON.encode(msg).encode()
    return frame


def decode(frame: bytes, max_size: int = MAX_FRAME) -> dict:
    """One frame -> a checked message dict, or SchemaError saying what is wrong."""
    if len(frame) > max_size:
        raise FrameTooLarge(f"frame of {len(frame)} bytes exceeds the limit of {max_size}")
    try:
        msg = orjson.loads(frame)        # strict JSON (no NaN), 4x faster than json.loads
    except (UnicodeDecodeError, ValueError) as e:
        raise BadFrame(f"frame is not UTF-8 JSON: {e}") from None
    if not isinstance(msg, dict):
        raise BadFrame(f"a message is a JSON object, not {type(msg).__name__}")
    v = msg.get("v")
    if v != VERSION or isinstance(v, bool):
        raise UnknownVersion(f"protocol version {v!r} is not supported (this end speaks "
                             f"{VERSION})")
    kind = msg.get("type")
    if kind not in MESSAGES:
        raise UnknownType(f"unknown message type {kind!r}; known: {', '.join(MESSAGES)}")
    check_fields(kind, msg, MESSAGES[kind])
    if kind == "request":
        op = msg["op"]
        if op in OPS:
            check_fields(f"{op} arguments", msg.get("args", {}), OPS[op])
    return msg


def topic(kind: str, device: str) -> bytes:
    return f"{kind}.{device}".encode()


def circuits_to_wire(circuits: Mapping[int, int]) -> list[list[int]]:
    """{input: output} -> [[input, output], ...] sorted by input (JSON keys are strings)."""
    return [[int(a), int(b)] for a, b in sorted(circuits.items())]


def circuits_from_wire(pairs) -> dict[int, int]:
    out = {}
    for pair in pairs:
        if (not isinstance(pair, list) or len(pair) != 2
                or not all(isinstance(p, int) and not isinstance(p, bool) for p in pair)):
            raise WrongType(f"a circuit is [input, output] (two integers), not {pair!r}")
        out[pair[0]] = pair[1]
    return out
