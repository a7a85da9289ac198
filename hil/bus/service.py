"""A device service: one driver behind a ROUTER socket (requests) and a PUB socket (state,
telemetry, heartbeats).

The service is the device's one writer: a single loop takes requests one at a time, in the
order they arrived, so two clients never interleave commands on the wire. A changing request
may name the state version it was computed from (`expect`); if the device moved on since, it is
refused with `StaleState` and nothing is sent to the hardware (compare-and-set).

What a service offers depends on its device kind. A kind is a few lines in `KINDS`: the driver
class to open, the operations (each a function of the driver and the request's arguments,
returning the result and the state keys it changed), the state it starts from, and optional
telemetry. Every service also answers `ping`, `describe` and `snapshot`.
"""
from __future__ import annotations

import collections
import functools
import importlib
import logging
import math
import threading
import time
import uuid
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import zmq

from photonic_testbed.drivers.circuit_switch import CircuitSwitch, check_circuits
from photonic_testbed.hil.bus import schema
from photonic_testbed.hil.bus.mirror import StatePublisher
from photonic_testbed.hil.bus.security import ServerKeys, make_server, server_keys, \
    start_authenticator

log = logging.getLogger(__name__)

QUEUE_LIMIT = 1000              # requests taken off the socket ahead of the one being run
HARD_FRAME_LIMIT = 16 * schema.MAX_FRAME   # above this ZeroMQ drops the peer's connection


class ServiceError(Exception):
    """The service cannot start or run (bad configuration, driver that cannot open)."""


class StaleState(Exception):
    """Compare-and-set refused: the device's state version is not the one the request named."""


class DeadlineExceeded(Exception):
    """The request's deadline passed while it waited its turn; it was not run."""


class UnknownOperation(Exception):
    """The device kind does not offer this operation."""


class BadRequest(Exception):
    """The request's arguments do not make sense for this device."""


class UnencodableResult(Exception):
    """The driver returned something JSON cannot carry (NaN, infinity, bytes)."""


# ---- device kinds -----------------------------------------------------------------------------

# (driver, args) -> (result, state changes); a change's value may be a function of nothing,
# called once the reply has gone (work the caller does not wait for)
Op = Callable[[Any, dict], tuple[Any, dict]]


@dataclass(frozen=True)
class DeviceKind:
    name: str
    driver: str                                   # default driver class, "module:Class"
    ops: Mapping[str, Op]
    state: Callable[[Any], dict]                  # the published state, read from the driver
    describe: Callable[[Any], dict]
    telemetry: Callable[[Any], dict] | None = None
    telemetry_hz: float = 0.0                     # default rate (the rig may change it)


def _heater_volts(args: dict) -> dict[int, float]:
    first = args.get("first", 0)
    if first < 0:
        raise BadRequest(f"first channel {first} is negative")
    out = {}
    for i, v in enumerate(args["volts"]):
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise BadRequest(f"volts[{i}] must be a finite number, not {v!r}")
        out[first + i] = float(v)
    return out


def _set_heaters(dac, args):
    lines = dac.set_voltages(_heater_volts(args))
    return {"lines": lines}, {"volts": dac.commanded}


def _read_heaters(dac, args):
    return {"volts": dac.voltages()}, {}


def _describe_heaters(dac) -> dict:
    info = dac.info
    return {"kind": "heater_dac", "port": dac.port, "ident": info.ident,
            "firmware": info.firmware, "channels": info.channels, "vfull": info.vfull,
            "ifull": info.ifull, "modules": [m.ident for m in info.modules]}


def _apply_circuits(switch: CircuitSwitch, args):
    circuits = check_circuits(schema.circuits_from_wire(args["circuits"]), switch.ports)
    report = switch.apply(circuits)
    return ({"added": schema.circuits_to_wire(report.added),
             "removed": schema.circuits_to_wire(report.removed), "seconds": report.seconds},
            {"circuits": schema.circuits_to_wire(circuits)})


def _read_circuits(switch: CircuitSwitch, args):
    circuits = schema.circuits_to_wire(switch.circuits())
    return {"circuits": circuits}, {"circuits": circuits}


def _read_power(meter, args):
    channels = args.get("channels")
    power = meter.read_power(channels)
    return {"power": {str(k): float(v) for k, v in power.items()}}, {}


def _number(args: dict, key: str, lo: float, hi: float) -> float | None:
    v = args.get(key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not lo <= v <= hi:
        raise BadRequest(f"{key} must be a number in {lo:g}..{hi:g}, not {v!r}")
    return float(v)


def _laser_state(laser) -> dict:
    return {"on": laser.is_on(), "power_mw": laser.power_mw(),
            "wavelength_nm": laser.wavelength_nm()}


def _set_laser(laser, args):
    wavelength = _number(args, "wavelength_nm", 1000.0, 2000.0)
    power = _number(args, "power_mw", 0.0, 1000.0)
    on = args.get("on")
    if on is not None and not isinstance(on, bool):
        raise BadRequest(f"on must be true or false, not {on!r}")
    if wavelength is not None:
        laser.set_wavelength_nm(wavelength)
    if power is not None:
        laser.set_power_mw(power)
    if on is not None:
        laser.set_output(on)
    state = _laser_state(laser)
    return state, state


def _chip_state(mesh) -> dict:
    volts = list(mesh.dac.commanded)
    return {"circuits": schema.circuits_to_wire(mesh.circuits()), "ports": mesh.ports,
            "cells": mesh.cell_states(volts), "volts": volts}


def _chip_apply(mesh, args):
    result, changes = _apply_circuits(mesh, args)
    volts = list(mesh.dac.commanded)
    # the cells' states are worked out after the reply has gone (DeviceService.publish)
    return result, {**changes, "cells": functools.partial(mesh.cell_states, volts),
                    "volts": volts}


def _chip_set_heaters(mesh, args):
    lines = mesh.dac.set_voltages(_heater_volts(args))
    volts = list(mesh.dac.commanded)
    return {"lines": lines}, {"volts": volts, "cells": mesh.cell_states(volts),
                              "circuits": schema.circuits_to_wire(mesh.circuits())}


def _chip_describe(mesh) -> dict:
    d = dict(mesh.describe())
    d["kind"] = "chip"
    d["heaters"] = _describe_heaters(mesh.dac)
    return d


def _switch_telemetry(switch) -> dict:
    """The switch's own port power monitors where it has them (an OCS's `:PMON:POW?`), dBm."""
    if not callable(getattr(switch, "port_power", None)):
        return {}
    power = switch.port_power(range(1, 2 * switch.ports + 1))
    return {"power_dbm": {str(p): float(v) for p, v in power.items()}}


KINDS: dict[str, DeviceKind] = {
    "heater_dac": DeviceKind(
        "heater_dac", "photonic_testbed.drivers.heater_dac:HeaterDAC",
        ops={"set_heaters": _set_heaters, "read_heaters": _read_heaters},
        state=lambda dac: {"volts": dac.commanded, "channels": dac.channels},
        describe=_describe_heaters,
        telemetry=lambda dac: {"total_power_mw": dac.total_power()}, telemetry_hz=1.0),
    # Any CircuitSwitch (an OCS, the chip's mesh): name its class in the rig (`driver =`).
    "switch": DeviceKind(
        "switch", "",
        ops={"apply_circuits": _apply_circuits, "read_circuits": _read_circuits},
        state=lambda sw: {"circuits": schema.circuits_to_wire(sw.circuits()),
                          "ports": sw.ports},
        describe=lambda sw: sw.describe(),
        telemetry=_switch_telemetry, telemetry_hz=2.0),
    # A power meter driver offers read_power(channels or None) -> {channel: mW}.
    "power_meter": DeviceKind(
        "power_meter", "photonic_testbed.drivers.power_meter:PowerMeter",
        ops={"read_power": _read_power}, state=lambda m: {},
        describe=lambda m: m.describe() if hasattr(m, "describe") else {"kind": "power_meter"},
        telemetry=lambda m: {"power": {str(k): float(v) for k, v in m.read_power(None).items()}},
        telemetry_hz=2.0),
    # A chip: the mesh driver owns the heater DAC (one writer); topology and calibration
    # come from the rig's [chip] section. Rigs without a chip keep `heater_dac`.
    "chip": DeviceKind(
        "chip", "photonic_testbed.drivers.mesh:open_chip",
        ops={"apply_circuits": _chip_apply, "read_circuits": _read_circuits,
             "set_heaters": _chip_set_heaters,
             "read_heaters": lambda mesh, args: _read_heaters(mesh.dac, args)},
        state=_chip_state, describe=_chip_describe,
        telemetry=lambda mesh: {"total_power_mw": mesh.dac.total_power()}, telemetry_hz=1.0),
    "laser": DeviceKind(
        "laser", "photonic_testbed.drivers.laser:Laser",
        ops={"set_laser": _set_laser, "read_laser": lambda laser, args: (_laser_state(laser), {})},
        state=_laser_state, describe=lambda laser: laser.describe()),
}


# The top-level names of releases before 0.2, when every folder installed as its own package.
_OLD_ROOTS = ("firmware", "drivers", "calibration", "hil", "gui", "ptb")


def load_class(path: str) -> type:
    module, _, name = path.partition(":")
    if not module or not name:
        raise ServiceError(f"a driver is named 'module:Class', not {path!r}")
    if module.partition(".")[0] in _OLD_ROOTS:
        new = f"{__name__.partition('.')[0]}.{module}"
        warnings.warn(f"driver {path!r}: the module is now {new!r} (one import root since "
                      "0.2); update the rig file", DeprecationWarning, stacklevel=2)
        module = new
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as e:
        raise ServiceError(f"cannot load the driver {path}: {e}") from None


def open_driver(kind: DeviceKind, driver: str, address: str, options: Mapping) -> Any:
    cls = load_class(driver or kind.driver)
    try:
        drv = cls(address, **options)
        if callable(getattr(drv, "open", None)):
            drv.open()
    except Exception as e:
        raise ServiceError(f"cannot open {cls.__name__} at {address}: "
                           f"{type(e).__name__}: {e}") from e
    return drv


# ---- the service ------------------------------------------------------------------------------

@dataclass
class ServiceSpec:
    """Everything a service needs to run (picklable: it crosses into a child process)."""
    name: str
    kind: str
    address: str
    request: str = "tcp://127.0.0.1:0"
    publish: str = "tcp://127.0.0.1:0"
    driver: str = ""
    options: dict = field(default_factory=dict)
    heartbeat: float = 0.5
    health: float = 2.0
    telemetry_hz: float | None = None
    curve_secret: str | None = None           # server certificate (.key_secret)
    curve_authorized: str | None = None       # folder of authorised client .key files


class Publisher:
    """A PUB socket sending schema messages under their topics."""

    def __init__(self, ctx: zmq.Context, endpoint: str, keys: ServerKeys | None,
                 sndhwm: int = 100_000):
        self.sock = ctx.socket(zmq.PUB)
        self.sock.linger = 0
        self.sock.ipv6 = "[" in endpoint      # an IPv6 literal, tcp://[::1]:port
        self.sock.sndhwm = sndhwm
        make_server(self.sock, keys)
        self.sock.bind(endpoint)
        self.endpoint = self.sock.last_endpoint.decode()
        self._topics: dict[tuple[str, str], bytes] = {}

    def send(self, msg: dict) -> None:
        key = (msg["type"], msg["device"])
        topic = self._topics.get(key)
        if topic is None:
            kind = schema.STATE if msg["type"] in ("snapshot", "delta") else msg["type"]
            topic = self._topics[key] = schema.topic(kind, msg["device"])
        # Two plain sends: pyzmq's send_multipart costs several times more per message.
        self.sock.send(topic, zmq.SNDMORE)
        self.sock.send(schema.encode(msg))

    def close(self) -> None:
        self.sock.close(linger=0)


def bind_sockets(ctx: zmq.Context, keys: ServerKeys | None, request: str,
                 publish: str) -> tuple[zmq.Socket, Publisher]:
    """The ROUTER socket that takes requests and the publisher, bound (CURVE with `keys`):
    what a device service and any other state owner on the bus (`StateServer`) open."""
    router = ctx.socket(zmq.ROUTER)
    try:
        router.linger = 0
        router.ipv6 = "[" in request         # an IPv6 literal, tcp://[::1]:port
        router.maxmsgsize = HARD_FRAME_LIMIT
        router.router_mandatory = False
        make_server(router, keys)
        router.bind(request)
        return router, Publisher(ctx, publish, keys)
    except Exception:
        router.close(linger=0)
        raise


def close_sockets(router: zmq.Socket | None, pub: Publisher | None, auth: Any = None) -> None:
    if router is not None:
        router.close(linger=0)
    if pub is not None:
        pub.close()
    if auth is not None:
        auth.stop()


class DeviceService:
    """One device on the bus. `bind()`, then `serve(stop)` until `stop` is set; `close()`."""

    def __init__(self, spec: ServiceSpec, driver: Any = None,
                 context: zmq.Context | None = None):
        if spec.kind not in KINDS:
            raise ServiceError(f"unknown device kind {spec.kind!r}; known: "
                               f"{', '.join(sorted(KINDS))}")
        self.spec = spec
        self.kind = KINDS[spec.kind]
        self.name = spec.name
        self._own_ctx = context is None
        self.ctx = context or zmq.Context()
        self.keys: ServerKeys | None = None
        self.auth = None
        self.driver = driver
        self.router: zmq.Socket | None = None
        self.pub: Publisher | None = None
        self.mirror: StatePublisher | None = None
        self.changes = 0
        self.online = True
        self.requests = 0
        self._queue: collections.deque = collections.deque()
        self._seen_empty = time.monotonic()     # when the request socket was last seen empty
        self._telemetry_seq = 0
        self._unpublished: dict = {}            # state changes made, to publish after the reply

    # ---- lifecycle ------------------------------------------------------------------------

    def bind(self) -> tuple[str, str]:
        """Open the driver and bind both sockets; returns the bound (request, publish)."""
        spec = self.spec
        try:
            if spec.curve_secret:
                self.keys = server_keys(spec.curve_secret, spec.curve_authorized or "")
                self.auth = start_authenticator(self.ctx, self.keys)
            if self.driver is None:
                self.driver = open_driver(self.kind, spec.driver, spec.address, spec.options)
            self.router, self.pub = bind_sockets(self.ctx, self.keys, spec.request,
                                                 spec.publish)
            incarnation = uuid.uuid4().hex[:12]
            state = {"kind": spec.kind, "online": True, "version": f"{incarnation}:0",
                     **self.kind.state(self.driver)}
            self.mirror = StatePublisher(self.name, state, self.pub.send, incarnation)
        except Exception:
            self.close()
            raise
        request = self.router.last_endpoint.decode()
        log.info("service %s (%s) on %s, publishing on %s", self.name, spec.kind, request,
                 self.pub.endpoint)
        return request, self.pub.endpoint

    def close(self) -> None:
        close_sockets(self.router, self.pub, self.auth)
        self.router = self.pub = self.auth = None
        if self.driver is not None and callable(getattr(self.driver, "close", None)):
            try:
                self.driver.close()
            except Exception as e:        # closing must not hide why we stopped
                log.warning("%s: closing the driver failed: %s", self.name, e)
        self.driver = None
        if self._own_ctx and not self.ctx.closed:
            self.ctx.term()

    @property
    def version(self) -> str:
        return self._unpublished.get("version") or self.mirror.state["version"]

    def publish(self) -> None:
        """Send the state changes of the requests answered so far as one delta. The loop calls
        it right after each reply: the caller waiting on the device hears first, the
        subscribers a moment later (the version in the reply is already the new one)."""
        if self._unpublished:
            updates, self._unpublished = self._unpublished, {}
            for k, v in list(updates.items()):
                if callable(v):
                    try:
                        updates[k] = v()
                    except Exception as e:       # the rest (and the version) still goes out
                        log.error("%s: state %r could not be worked out: %s: %s", self.name,
                                  k, type(e).__name__, e)
                        del updates[k]
            self.mirror.update(updates)

    # ---- the loop ------------------------------------------------------------------------------

    def serve(self, stop: threading.Event) -> None:
        spec = self.spec
        hz = self.kind.telemetry_hz if spec.telemetry_hz is None else spec.telemetry_hz
        period = 1.0 / hz if hz and self.kind.telemetry else math.inf
        now = time.monotonic()
        next_beat, next_health, next_tel = now, now + spec.health, now + period
        while not stop.is_set():
            now = time.monotonic()
            if now >= next_beat:
                self._heartbeat()
                next_beat = now + spec.heartbeat
            if now >= next_health:
                self._check_health()
                next_health = time.monotonic() + spec.health
            if now >= next_tel:
                self._telemetry()
                next_tel = time.monotonic() + period
            wait = min(next_beat, next_health, next_tel, now + 0.1) - time.monotonic()
            if not self._queue and not self.router.poll(0):
                # Nothing waiting now: whatever arrives during this wait arrives "now".
                self._seen_empty = time.monotonic()
                if not self.router.poll(max(0, int(wait * 1e3))):
                    continue
                self._seen_empty = time.monotonic()
            self._drain()
            if self._queue:
                envelope, frame, arrived = self._queue.popleft()
                self._reply(envelope, self.handle(frame, arrived))
                self.publish()

    def _drain(self) -> None:
        """Take waiting requests off the socket, stamped with the last moment the socket was
        seen empty: no later than their arrival, so a deadline counts (at least) the time a
        request waited behind a slow device call, without a second thread on the fast path."""
        router, more = self.router, zmq.RCVMORE
        arrived = self._seen_empty
        while len(self._queue) < QUEUE_LIMIT:
            try:
                frames = [router.recv(zmq.NOBLOCK)]     # cheaper than recv_multipart
            except zmq.Again:
                self._seen_empty = time.monotonic()
                return
            while router.getsockopt(more):
                frames.append(router.recv())
            if len(frames) < 2 or len(frames) > 3:
                self._reply(frames[:1], self._error(None, schema.BadFrame(
                    f"a request is one frame after the envelope, not {len(frames) - 1}")))
                continue
            self._queue.append((frames[:-1], frames[-1], arrived))

    def _reply(self, envelope: list[bytes], msg: dict) -> None:
        try:
            frame = schema.encode(msg)
        except (TypeError, ValueError) as e:     # a result JSON cannot carry (NaN, bytes...)
            frame = schema.encode(self._error(msg.get("id"), UnencodableResult(
                f"the result of the request cannot be sent as JSON: {e}")))
        try:
            for part in envelope:
                self.router.send(part, zmq.NOBLOCK | zmq.SNDMORE)
            self.router.send(frame, zmq.NOBLOCK)
        except zmq.ZMQError as e:     # the client went away; its loss
            log.debug("%s: reply not delivered: %s", self.name, e)

    def _error(self, rid: str | None, exc: BaseException) -> dict:
        return schema.make("error", id=rid, error=type(exc).__name__,
                           message=str(exc) or type(exc).__name__,
                           version=self.version if self.mirror else None)

    def handle(self, frame: bytes, arrived: float | None = None) -> dict:
        """One request frame -> the reply or error message (never raises)."""
        self.requests += 1
        self.publish()                      # what an earlier request changed, if not yet sent
        rid = None
        try:
            msg = schema.decode(frame)
            if msg["type"] != "request":
                raise schema.UnknownType(f"a service takes requests, not {msg['type']!r}")
            rid = msg["id"]
            ttl = msg.get("ttl_ms")
            if ttl is not None and arrived is not None and \
                    time.monotonic() > arrived + ttl / 1e3:
                raise DeadlineExceeded(f"{msg['op']} waited longer than its {ttl:.0f} ms "
                                       "deadline behind other requests and was not run")
            result = self._run(msg["op"], msg.get("args", {}), msg.get("expect"))
            return schema.make("reply", id=rid, result=result, version=self.version)
        except Exception as e:
            if not isinstance(e, (schema.SchemaError, StaleState, DeadlineExceeded,
                                  UnknownOperation, BadRequest)):
                log.info("%s: request %s failed: %s: %s", self.name, rid, type(e).__name__, e)
            return self._error(rid, e)

    def _run(self, op: str, args: dict, expect: str | None):
        if op == "ping":
            return {"device": self.name, "kind": self.spec.kind, "online": self.online,
                    "incarnation": self.mirror.incarnation, "version": self.version}
        if op == "describe":
            return {"name": self.name, "kind": self.spec.kind,
                    "operations": sorted({"ping", "describe", "snapshot", *self.kind.ops}),
                    "device": self.kind.describe(self.driver)}
        if op == "snapshot":
            return self.mirror.snapshot()
        fn = self.kind.ops.get(op)
        if fn is None:
            raise UnknownOperation(f"{self.name} ({self.spec.kind}) does not offer {op!r}; "
                                   f"it offers: ping, describe, snapshot, "
                                   f"{', '.join(sorted(self.kind.ops))}")
        changing = op in schema.CHANGING
        if changing and expect is not None and expect != self.version:
            raise StaleState(f"{self.name} is at state version {self.version}, not {expect}: "
                             "it changed since you read it; re-read the state and decide again")
        try:
            result, changes = fn(self.driver, args)
        except (TypeError, KeyError) as e:
            raise BadRequest(f"{op}: bad arguments: {e}") from None
        finally:
            if changing:
                # The hardware may have changed even if the call failed half way: a new version.
                self.changes += 1
        self._unpublished.update(changes)
        if changing:
            self._unpublished["version"] = f"{self.mirror.incarnation}:{self.changes}"
        return result

    def _heartbeat(self) -> None:
        self.pub.send(schema.make("heartbeat", device=self.name,
                                  incarnation=self.mirror.incarnation, seq=self.mirror.seq,
                                  t=time.time(), online=self.online,
                                  interval=self.spec.heartbeat))

    def _check_health(self) -> None:
        ping = getattr(self.driver, "ping", None)
        if not callable(ping):
            return
        try:
            ping()
            online = True
        except Exception as e:
            log.warning("%s: device does not answer: %s: %s", self.name, type(e).__name__, e)
            online = False
        if online != self.online:
            self.online = online
            self.mirror.update({"online": online})

    def _telemetry(self) -> None:
        try:
            values = self.kind.telemetry(self.driver)
        except Exception as e:
            log.debug("%s: telemetry read failed: %s", self.name, e)
            return
        if not values:
            return                          # this driver has nothing to report
        self._telemetry_seq += 1
        self.pub.send(schema.telemetry(self.name, self._telemetry_seq, time.time(), values))


def run_service(spec: ServiceSpec, ready=None, stop: threading.Event | None = None) -> None:
    """Run one service until `stop` is set or SIGTERM (process entry point). `ready`, a
    multiprocessing Connection, receives the bound endpoints (or the error text)."""
    import signal
    stop = stop or threading.Event()
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, lambda *_: stop.set())
        signal.signal(signal.SIGINT, lambda *_: stop.set())
    service = DeviceService(spec)
    try:
        endpoints = service.bind()
    except Exception as e:
        if ready is not None:
            ready.send(("error", f"{type(e).__name__}: {e}"))
        raise
    if ready is not None:
        ready.send(("ready", endpoints))
    try:
        service.serve(stop)
    finally:
        service.close()
