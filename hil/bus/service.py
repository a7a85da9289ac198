"""A device service: one driver behind the bus's request server (hil.bus.server: requests on
a ROUTER socket, state, telemetry and heartbeats on a PUB socket).

The service is the device's one writer: the server runs one request at a time, in the order
they arrived, so two clients never interleave commands on the wire. A changing request may name
the state version it was computed from (`expect`); if the device moved on since, it is refused
with `StaleState` and nothing is sent to the hardware (compare-and-set). A changing request runs
at most once per request id (a retry gets the first answer).

What a service offers depends on its device kind. A kind is a few lines in `KINDS`: the driver
class to open, the operations (each a function of the driver and the request's checked
arguments, returning the result and the state keys it changed; each declared in
`schema.OPERATIONS`), the state it starts from, and optional telemetry. Every service also
answers `ping`, `describe` and `snapshot`.
"""
from __future__ import annotations

import functools
import importlib
import logging
import math
import threading
import time
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import zmq

from photonic_testbed.drivers.circuit_switch import CircuitSwitch
from photonic_testbed.hil.bus import schema
from photonic_testbed.hil.bus.errors import BadRequest
from photonic_testbed.hil.bus.security import server_keys
from photonic_testbed.hil.bus.server import Server

log = logging.getLogger(__name__)


class ServiceError(Exception):
    """The service cannot start or run (bad configuration, driver that cannot open)."""


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
    """{channel: volts} from the checked `set_heaters` arguments (finite numbers; the board
    refuses channels it does not have and volts above its limits)."""
    first = args["first"]
    return {first + i: float(v) for i, v in enumerate(args["volts"])}


def _set_heaters(dac, args):
    lines = dac.set_voltages(_heater_volts(args))
    return {"lines": lines}, {"volts": dac.commanded}


def _read_heaters(dac, args):
    return {"volts": dac.voltages()}, {}


def _describe_heaters(dac) -> dict:
    info = dac.info
    return {"kind": "heater_dac", "port": dac.port, "ident": info.ident,
            "firmware": info.firmware, "channels": info.channels, "vfull": info.vfull,
            "ifull": info.ifull, "modules": [m.ident for m in info.modules],
            "power_budget_mw": dac.power_budget()}


def _apply_circuits(switch: CircuitSwitch, args):
    # checked here, as the pairs came (an input or output named twice is refused, not merged)
    circuits = switch.check(args["circuits"])
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


def _laser_state(laser) -> dict:
    return {"on": laser.is_on(), "power_mw": laser.power_mw(),
            "wavelength_nm": laser.wavelength_nm()}


def _set_laser(laser, args):
    if args["wavelength_nm"] is not None:
        laser.set_wavelength_nm(args["wavelength_nm"])
    if args["power_mw"] is not None:
        laser.set_power_mw(args["power_mw"])
    if args["on"] is not None:
        laser.set_output(args["on"])
    state = _laser_state(laser)
    return state, state


def _chip_state(mesh) -> dict:
    volts = list(mesh.dac.commanded)
    cal = mesh.calibration
    return {"circuits": schema.circuits_to_wire(mesh.circuits()), "ports": mesh.ports,
            "cells": mesh.cell_states(volts), "volts": volts,
            "calibration": {"chip_id": cal.chip_id, "date": cal.date}}


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


def _chip_load_calibration(mesh, args):
    """A new calibration file (its text) for the running chip: checked (a damaged file, or
    one for another chip, is refused before anything changes), then the circuits' heaters
    derived again with it."""
    from photonic_testbed.common.calibration import Calibration, CalibrationError
    try:
        cal = Calibration.parse(args["calibration"], where="sent with load_calibration")
        changed = mesh.load_calibration(cal)
    except CalibrationError as e:       # (a CalibrationFileError is one)
        raise BadRequest(str(e)) from None
    volts = list(mesh.dac.commanded)
    return ({"heaters_changed": changed, "chip_id": cal.chip_id, "method": cal.method},
            {"volts": volts, "cells": functools.partial(mesh.cell_states, volts),
             "calibration": {"chip_id": cal.chip_id, "date": cal.date}})


def _chip_describe(mesh) -> dict:
    d = dict(mesh.describe())
    d["kind"] = "chip"
    d["heaters"] = _describe_heaters(mesh.dac)
    return d


def _ping_device(driver, args):
    """One round trip to the device (its driver's `ping`, or its heater DAC's)."""
    ping = getattr(driver, "ping", None)
    if not callable(ping):
        ping = getattr(getattr(driver, "dac", None), "ping", None)
    if not callable(ping):
        raise ServiceError(f"{type(driver).__name__} has no ping")
    t0 = time.perf_counter()
    answer = ping()
    return {"answer": str(answer), "seconds": time.perf_counter() - t0}, {}


def _switch_telemetry(switch) -> dict:
    """The switch's own port power monitors where it has them (an OCS's `:PMON:POW?`), dBm."""
    if not callable(getattr(switch, "port_power", None)):
        return {}
    power = switch.port_power(range(1, 2 * switch.ports + 1))
    return {"power_dbm": {str(p): float(v) for p, v in power.items()}}


KINDS: dict[str, DeviceKind] = {
    "heater_dac": DeviceKind(
        "heater_dac", "photonic_testbed.drivers.heater_dac:HeaterDAC",
        ops={"set_heaters": _set_heaters, "read_heaters": _read_heaters,
             "ping_device": _ping_device},
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
             "set_heaters": _chip_set_heaters, "load_calibration": _chip_load_calibration,
             "read_heaters": lambda mesh, args: _read_heaters(mesh.dac, args),
             "ping_device": _ping_device},
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
        self.driver = driver
        self._context = context
        self.server: Server | None = None
        self._telemetry_seq = 0

    # ---- lifecycle ------------------------------------------------------------------------

    def bind(self) -> tuple[str, str]:
        """Open the driver and bind both sockets; returns the bound (request, publish)."""
        spec = self.spec
        try:
            keys = (server_keys(spec.curve_secret, spec.curve_authorized or "")
                    if spec.curve_secret else None)
            if self.driver is None:
                self.driver = open_driver(self.kind, spec.driver, spec.address, spec.options)
            self.server = Server(
                self.name, {"kind": spec.kind, "online": True, **self.kind.state(self.driver)},
                kind=spec.kind, request=spec.request, publish=spec.publish, keys=keys,
                heartbeat=spec.heartbeat,
                handlers={op: self._handler(fn) for op, fn in self.kind.ops.items()},
                describe=lambda: {"device": self.kind.describe(self.driver)},
                publish_version=True, context=self._context)
            request, publish = self.server.bind()
        except Exception:
            self.close()
            raise
        log.info("service %s (%s) on %s, publishing on %s", self.name, spec.kind, request,
                 publish)
        return request, publish

    def _handler(self, fn: Op) -> Callable[[dict], Any]:
        def run(args: dict):
            result, changes = fn(self.driver, args)
            self.server.defer(changes)           # published once the reply has gone
            return result
        return run

    def close(self) -> None:
        if self.server is not None:
            self.server.close()
            self.server = None
        if self.driver is not None and callable(getattr(self.driver, "close", None)):
            try:
                self.driver.close()
            except Exception as e:        # closing must not hide why we stopped
                log.warning("%s: closing the driver failed: %s", self.name, e)
        self.driver = None

    @property
    def version(self) -> str:
        return self.server.version

    @property
    def online(self) -> bool:
        return self.server.online

    def handle(self, frame: bytes, arrived: float | None = None) -> dict:
        """One request frame -> the answer message (in-process use and tests)."""
        return self.server.handle(frame, arrived)

    # ---- the loop ------------------------------------------------------------------------------

    def serve(self, stop: threading.Event) -> None:
        spec = self.spec
        hz = self.kind.telemetry_hz if spec.telemetry_hz is None else spec.telemetry_hz
        period = 1.0 / hz if hz and self.kind.telemetry else math.inf
        now = time.monotonic()
        next_health, next_tel = now + spec.health, now + period
        server = self.server
        while not stop.is_set():
            now = time.monotonic()
            if now >= next_health:
                self._check_health()
                next_health = time.monotonic() + spec.health
            if now >= next_tel:
                self._telemetry()
                next_tel = time.monotonic() + period
            server.poll(max(0.0, min(next_health, next_tel, now + 0.1) - time.monotonic()))

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
        if online != self.server.online:
            self.server.online = online
            self.server.update({"online": online})

    def _telemetry(self) -> None:
        try:
            values = self.kind.telemetry(self.driver)
        except Exception as e:
            log.debug("%s: telemetry read failed: %s", self.name, e)
            return
        if not values:
            return                          # this driver has nothing to report
        self._telemetry_seq += 1
        self.server.pub.send(schema.telemetry(self.name, self._telemetry_seq, time.time(),
                                              values))


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
