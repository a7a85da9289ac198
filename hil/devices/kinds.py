"""The device kinds a service can serve: for each, the driver class it opens, its operations
(each a function of the driver and the request's checked arguments, returning the result and
the state keys it changed; each declared in `hil.bus.schema.OPERATIONS`), the state it starts
from, how it describes itself and its telemetry. A new kind of instrument is a few lines here.

A description is answered by the service's loop at once, never behind the device: it is made
without device I/O, from the driver's own attributes and the facts read from the device once,
when the service opened it. A telemetry pass may be a generator: each `yield` is a turn for the
requests that came meanwhile (a power meter reads its ports one at a time, each taking its
averaging time), and the pass's values are what it returns.
"""
from __future__ import annotations

import functools
import importlib
import time
import warnings
from collections.abc import Callable, Generator, Mapping
from dataclasses import dataclass, field
from typing import Any

from photonic_testbed import moved
from photonic_testbed.common.calibration import CalibrationError
from photonic_testbed.drivers.circuit_switch import ApplyReport, CircuitSwitch, SwitchError
from photonic_testbed.hil.bus import schema
from photonic_testbed.hil.bus.errors import BadRequest
from photonic_testbed.hil.bus.server import Answer


class ServiceError(Exception):
    """The service cannot start or run (bad configuration, driver that cannot open)."""


# (driver, the operation's checked arguments: its schema Struct) -> (result, state changes); a
# change's value may be a function of nothing, called once the reply has gone (work the caller
# does not wait for)
Op = Callable[[Any, Any], tuple[Any, dict]]
# (driver) -> the values, or a generator of them: it yields between its device calls (a turn
# for requests) and returns the values
Telemetry = Callable[[Any], dict | Generator[None, None, dict]]


def _no_facts(driver: Any) -> dict:
    return {}


@dataclass(frozen=True)
class DeviceKind:
    name: str
    driver: str                                   # default driver class, "module:Class"
    ops: Mapping[str, Op]
    state: Callable[[Any], dict]                  # the published state, read from the driver
    # (driver, facts) -> what the device is, without device I/O (answered by the loop at once)
    describe: Callable[[Any, Mapping], dict]
    telemetry: Telemetry | None = None
    telemetry_hz: float = 0.0                     # default rate (the rig may change it)
    # what the description needs from the device: read once, when the service opens it
    facts: Callable[[Any], dict] = _no_facts
    # An operation that can be sent now and its answer waited for on the device's socket
    # (served together, without a device thread's turn): (driver, args) -> None (not now:
    # run the op on the device's thread), the Answer (nothing to wait for), or
    # (PendingChange, Answer from what it concludes)
    begins: Mapping[str, Callable[[Any, Any], Any]] = field(default_factory=dict)
    # Published state read back from the device at each telemetry pass: a value that differs
    # from the one published changed behind the service (an OCS power cycled loses its
    # circuits) and is published as a change of the device (its version moves)
    observe: Callable[[Any], dict] | None = None


def _heater_volts(args: schema.SetHeaters) -> dict[int, float]:
    """{channel: volts} from the checked `set_heaters` arguments (finite numbers; the board
    refuses channels it does not have and volts above its limits)."""
    return {args.first + i: float(v) for i, v in enumerate(args.volts)}


def _set_heaters(dac: Any, args: schema.SetHeaters) -> tuple[dict, dict]:
    lines = dac.set_voltages(_heater_volts(args))
    return {"lines": lines}, {"volts": dac.commanded}


def _read_heaters(dac: Any, args: schema.Args) -> tuple[dict, dict]:
    return {"volts": dac.voltages()}, {}


def _heater_facts(dac: Any) -> dict:
    return {"power_budget_mw": dac.power_budget()}


def _describe_heaters(dac: Any, facts: Mapping) -> dict:
    info = dac.info                     # (read when the driver opened the board)
    return {"kind": "heater_dac", "port": dac.port, "ident": info.ident,
            "firmware": info.firmware, "channels": info.channels, "vfull": info.vfull,
            "ifull": info.ifull, "modules": [m.ident for m in info.modules],
            "power_budget_mw": facts["power_budget_mw"]}


def _apply_circuits(switch: CircuitSwitch, args: schema.ApplyCircuits) -> tuple[dict, dict]:
    # checked here, as the pairs came (an input or output named twice is refused, not merged)
    circuits = switch.check(args.circuits)
    return _applied(switch.apply(circuits), circuits)


def _applied(report, circuits) -> tuple[dict, dict]:
    """The answer to a change of circuits, and its state: the switch's whole map, put in wire
    form when it is published (after the reply; `circuits` is the map the switch now holds,
    which nothing changes in place)."""
    return ({"added": schema.circuits_to_wire(report.added),
             "removed": schema.circuits_to_wire(report.removed), "seconds": report.seconds},
            {"circuits": lambda: schema.circuits_to_wire(circuits)})


def _begin_apply_circuits(switch: Any, args: schema.ApplyCircuits) -> Any:
    """`apply_circuits` sent now, its answer waited for on the switch's socket, where the
    driver can (`begin_apply`, and `can_begin` now); None otherwise."""
    can = getattr(switch, "can_begin", None)
    if can is None or not can():
        return None
    # checked by the driver, as the pairs came (an input or output named twice is refused,
    # not merged); once made, the circuits are the map the driver knows the switch holds
    got = switch.begin_apply(args.circuits)

    def answer(report: ApplyReport) -> Answer:
        held = switch.known if switch.known is not None else switch.check(args.circuits)
        return Answer(*_applied(report, held))
    if isinstance(got, ApplyReport):
        return answer(got)
    return got, answer


def _read_circuits(switch: CircuitSwitch, args: schema.Args) -> tuple[dict, dict]:
    circuits = schema.circuits_to_wire(switch.circuits())
    return {"circuits": circuits}, {"circuits": circuits}


def _read_power(meter: Any, args: schema.ReadPower) -> tuple[dict, dict]:
    # each channel once: every read takes the meter's averaging time, and a list naming one
    # channel thousands of times would hold the meter from every other client for minutes
    if args.channels is not None and len(set(args.channels)) < len(args.channels):
        twice = next(c for c in args.channels if args.channels.count(c) > 1)
        raise BadRequest(f"read_power: channel {twice} named twice")
    power = meter.read_power(args.channels)
    return {"power": {str(k): float(v) for k, v in power.items()}}, {}


def _laser_state(laser) -> dict:
    return {"on": laser.is_on(), "power_mw": laser.power_mw(),
            "wavelength_nm": laser.wavelength_nm()}


def _set_laser(laser: Any, args: schema.SetLaser) -> tuple[dict, dict]:
    if args.wavelength_nm is not None:
        laser.set_wavelength_nm(args.wavelength_nm)
    if args.power_mw is not None:
        laser.set_power_mw(args.power_mw)
    if args.on is not None:
        laser.set_output(args.on)
    state = _laser_state(laser)
    return state, state


def _chip_state(mesh) -> dict:
    volts = list(mesh.dac.commanded)
    cal = mesh.calibration
    return {"circuits": schema.circuits_to_wire(mesh.circuits()), "ports": mesh.ports,
            "cells": mesh.cell_states(volts), "volts": volts,
            "calibration": {"chip_id": cal.chip_id, "date": cal.date},
            "avoid": [list(x) for x in sorted(getattr(mesh, "avoid", ()))]}


def _chip_apply(mesh: Any, args: schema.ApplyCircuits) -> tuple[dict, dict]:
    result, changes = _apply_circuits(mesh, args)
    volts = list(mesh.dac.commanded)
    # the cells' states are worked out after the reply has gone (DeviceService.publish)
    return result, {**changes, "cells": functools.partial(mesh.cell_states, volts),
                    "volts": volts}


def _chip_move(mesh: Any, args: schema.MoveCircuits) -> tuple[dict, dict]:
    """`move_circuits`: the circuits from `inputs` moved off the waveguides they cross (or,
    with `forget`, the waveguides avoided forgotten): the circuits stay the same, the cells
    making them change."""
    if args.forget == bool(args.inputs):
        raise BadRequest("move_circuits takes the `inputs` whose circuits to move, or "
                         "`forget`: true (and no inputs)")
    if args.forget:
        result = {"forgot": mesh.forget()}
    else:
        try:
            result = mesh.move(args.inputs, args.healthy)
        except SwitchError as e:
            raise BadRequest(str(e)) from None
        result = {**result, **{k: [list(x) for x in result[k]]
                               for k in ("off", "cleared", "avoid")}}
    volts = list(mesh.dac.commanded)
    return result, {"volts": volts, "cells": functools.partial(mesh.cell_states, volts),
                    "avoid": [list(x) for x in sorted(mesh.avoid)]}


def _chip_set_heaters(mesh: Any, args: schema.SetHeaters) -> tuple[dict, dict]:
    lines = mesh.dac.set_voltages(_heater_volts(args))
    volts = list(mesh.dac.commanded)
    return {"lines": lines}, {"volts": volts, "cells": mesh.cell_states(volts),
                              "circuits": schema.circuits_to_wire(mesh.circuits())}


def _chip_load_calibration(mesh: Any, args: schema.LoadCalibration) -> tuple[dict, dict]:
    """A new calibration file (its text) for the running chip: checked (a damaged file, or
    one for another chip, is refused before anything changes), then the circuits' heaters
    derived again with it."""
    from photonic_testbed.common.calibration import Calibration
    try:
        cal = Calibration.parse(args.calibration, where="sent with load_calibration")
        changed = mesh.load_calibration(cal)
    except CalibrationError as e:       # (a CalibrationFileError is one)
        raise BadRequest(str(e)) from None
    volts = list(mesh.dac.commanded)
    return ({"heaters_changed": changed, "chip_id": cal.chip_id, "method": cal.method},
            {"volts": volts, "cells": functools.partial(mesh.cell_states, volts),
             "calibration": {"chip_id": cal.chip_id, "date": cal.date}})


def _chip_describe(mesh: Any, facts: Mapping) -> dict:
    d = dict(mesh.describe())
    d["kind"] = "chip"
    d["heaters"] = _describe_heaters(mesh.dac, facts)
    return d


def _meter_describe(meter: Any, facts: Mapping) -> dict:
    return meter.describe() if hasattr(meter, "describe") else {"kind": "power_meter"}


def _meter_telemetry(meter: Any) -> Generator[None, None, dict]:
    """Every port's power, mW: one port at a time (each read takes the meter's averaging
    time), requests served between them; a driver that does not say its `ports`: one read."""
    ports = getattr(meter, "ports", None)
    if not isinstance(ports, int) or isinstance(ports, bool):
        return {"power": {str(k): float(v) for k, v in meter.read_power(None).items()}}
    power: dict[str, float] = {}
    for port in range(1, ports + 1):
        if port > 1:
            yield                       # a turn for the requests that came meanwhile
        power[str(port)] = float(meter.read_power([port])[port])
    return {"power": power}


def _ping_device(driver: Any, args: schema.Args) -> tuple[dict, dict]:
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
        describe=_describe_heaters, facts=_heater_facts,
        telemetry=lambda dac: {"total_power_mw": dac.total_power()}, telemetry_hz=1.0),
    # Any CircuitSwitch (an OCS, the chip's mesh): name its class in the rig (`driver =`).
    "switch": DeviceKind(
        "switch", "",
        ops={"apply_circuits": _apply_circuits, "read_circuits": _read_circuits},
        state=lambda sw: {"circuits": schema.circuits_to_wire(sw.circuits()),
                          "ports": sw.ports},
        describe=lambda sw, facts: sw.describe(),
        telemetry=_switch_telemetry, telemetry_hz=2.0,
        begins={"apply_circuits": _begin_apply_circuits},
        observe=lambda sw: {"circuits": schema.circuits_to_wire(sw.circuits())}),
    # A power meter driver offers read_power(channels or None) -> {channel: mW}, and says how
    # many `ports` it has (its telemetry reads them one at a time).
    "power_meter": DeviceKind(
        "power_meter", "photonic_testbed.drivers.power_meter:PowerMeter",
        ops={"read_power": _read_power}, state=lambda m: {}, describe=_meter_describe,
        telemetry=_meter_telemetry, telemetry_hz=2.0),
    # A chip: the mesh driver owns the heater DAC (one writer); topology and calibration
    # come from the rig's [chip] section. Rigs without a chip keep `heater_dac`.
    "chip": DeviceKind(
        "chip", "photonic_testbed.drivers.mesh:open_chip",
        ops={"apply_circuits": _chip_apply, "read_circuits": _read_circuits,
             "set_heaters": _chip_set_heaters, "load_calibration": _chip_load_calibration,
             "move_circuits": _chip_move,
             "read_heaters": lambda mesh, args: _read_heaters(mesh.dac, args),
             "ping_device": _ping_device},
        state=_chip_state, describe=_chip_describe,
        facts=lambda mesh: _heater_facts(mesh.dac),
        telemetry=lambda mesh: {"total_power_mw": mesh.dac.total_power()}, telemetry_hz=1.0),
    "laser": DeviceKind(
        "laser", "photonic_testbed.drivers.laser:Laser",
        ops={"set_laser": _set_laser, "read_laser": lambda laser, args: (_laser_state(laser), {})},
        state=_laser_state, describe=lambda laser, facts: laser.describe()),
}


def load_class(path: str) -> type:
    module, _, name = path.partition(":")
    if not module or not name:
        raise ServiceError(f"a driver is named 'module:Class', not {path!r}")
    found = moved.current(module)
    if found is not None:
        warnings.warn(f"driver {path!r}: the module is now {found[0]!r} (since {found[1]}); "
                      "update the rig file", DeprecationWarning, stacklevel=2)
        module = found[0]
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


