"""The rig's instruments as ophyd-async devices, for Bluesky's RunEngine (docs/bluesky.md).

    from bluesky import RunEngine, plans as bp
    from ophyd_async.plan_stubs import ensure_connected
    from photonic_testbed.hil.bridges.bluesky import rig_devices

    found = rig_devices(rig)                       # through the rig's bus (direct=True: drivers)
    chip, meter = found["chip"], found["powermeter"]
    RE = RunEngine()
    RE(ensure_connected(chip, meter))
    RE(bp.scan([meter.port[3]], chip.channel[5], 0.0, 5.0, 41))    # a fringe

Devices (each signal's source is `ptb://DEVICE/...`; units and limits are `hil.bridges.devices`'):

    HeaterBank      .channel[k]: a HeaterChannel, Movable; its `volts` (V, 0..vfull) read back
                    from the board at each read; the bank reads as `volts`, every channel's
    PowerMeter      .port[p]: a MeterPort, Triggerable: one measurement per trigger, read as
                    `power_mw` and `power_dbm` (the same measurement; NaN before the first);
                    the meter itself: every port measured by one trigger
    LaserSource     `on`, `power_mw`, `wavelength_nm`: each Movable, read from the laser
    CircuitSwitch   `port_map` (output per input, 0 = none; set = make exactly these circuits),
                    `ports` (configuration)

The device I/O runs on worker threads (one request at a time per device), never on the
RunEngine's event loop. A value out of its limits fails the move's status with the reason
before anything is sent; a device's refusal fails it with the device's reason.
"""
from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable
from typing import Any

try:
    import numpy as np
    from bluesky.protocols import Reading
    from event_model import DataKey
    from ophyd_async.core import (
        Array1D,
        AsyncStatus,
        Callback,
        DeviceVector,
        SignalBackend,
        SignalR,
        SignalRW,
        StandardReadable,
        StandardReadableFormat,
    )
except ImportError as e:              # an optional extra
    raise ImportError(f"the Bluesky bridge needs ophyd-async and bluesky ({e.name} is not "
                      "installed): pip install 'photonic-testbed[bluesky]'") from None

from photonic_testbed.drivers.power_meter import mw_to_dbm
from photonic_testbed.hil.bridges import devices as bridged
from photonic_testbed.hil.bridges.access import Access, open_rig
from photonic_testbed.hil.rig import Rig

Format = StandardReadableFormat


class BridgeBackend(SignalBackend):
    """A signal whose value is read (`get`) and set (`put`) by blocking calls run on a worker
    thread; without `get`, the value is the last one `hold` was given (a measurement made by
    a trigger). Units, precision and control limits from its `Quantity`."""

    def __init__(self, datatype: type, source: str, *, get: Callable[[], Any] | None = None,
                 put: Callable[[Any], Any] | None = None,
                 quantity: bridged.Quantity | None = None, initial: Any = None,
                 dtype: type = np.int64):
        super().__init__(datatype)
        self._source, self._get, self._put = source, get, put
        self.quantity = quantity
        self._dtype = dtype                     # an array signal's elements
        self._setpoint = initial
        self.reading: Reading = self._reading(initial)
        self.callback: Callback[Reading] | None = None

    def _convert(self, value: Any) -> Any:
        if self.datatype is bool:
            return bool(value)
        if self.datatype is float:            # NaN: nothing measured yet
            return float(value) if value is not None else math.nan
        if self.datatype is int:
            return int(value) if value is not None else 0
        return np.asarray(value if value is not None else [], dtype=self._dtype)

    def _reading(self, value: Any) -> Reading:
        return Reading(value=self._convert(value), timestamp=time.time(), alarm_severity=0)

    def hold(self, value: Any) -> None:
        """A new value, read elsewhere (a trigger's measurement)."""
        self.reading = self._reading(value)
        if self.callback is not None:
            self.callback(self.reading)

    def source(self, name: str, read: bool) -> str:
        return self._source

    async def connect(self, timeout: float) -> None:
        if self._get is not None:     # the device answers, or connecting says why not
            await asyncio.wait_for(self._fetch(), timeout)

    async def _fetch(self) -> Any:
        assert self._get is not None
        self.hold(await asyncio.to_thread(self._get))
        return self.reading["value"]

    async def put(self, value: Any) -> None:
        if self._put is None:
            raise TypeError(f"{self._source} is read-only")
        if self.quantity is not None:
            value = self.quantity.check(value, self._source)
        await asyncio.to_thread(self._put, value)
        self._setpoint = value           # (a refused move leaves the last one taken)
        if self._get is not None:
            await self._fetch()
        else:
            self.hold(value)

    async def get_datakey(self, source: str) -> DataKey:
        key: dict[str, Any] = {"source": source, "shape": [], "dtype": "number"}
        value = self.reading["value"]
        if isinstance(value, np.ndarray):
            key.update(dtype="array", shape=list(value.shape), dtype_numpy=value.dtype.str)
        elif isinstance(value, bool):
            key.update(dtype="boolean", dtype_numpy="|b1")
        else:
            key["dtype_numpy"] = np.dtype(type(value)).str
        q = self.quantity
        if q is not None:
            key.update(units=q.units, precision=q.precision)
            if q.low is not None or q.high is not None:
                key["limits"] = {"control": {"low": q.low, "high": q.high}}
        return DataKey(**key)  # type: ignore[typeddict-item]

    async def get_reading(self) -> Reading:
        if self._get is not None:
            await self._fetch()
        return self.reading             # (a measurement not made yet: NaN)

    async def get_value(self) -> Any:
        return (await self.get_reading())["value"]

    async def get_setpoint(self) -> Any:
        return self._setpoint if self._setpoint is not None else await self.get_value()

    def set_callback(self, callback: Callback[Reading] | None) -> None:
        if callback is not None and self.callback is not None:
            raise RuntimeError(f"{self._source}: a callback is already set")
        self.callback = callback
        if callback is not None:
            callback(self.reading)


def _source(device: str, what: str) -> str:
    return f"ptb://{device}/{what}"


class HeaterChannel(StandardReadable):
    """One heater channel: set to volts (Movable), read back from the board."""

    def __init__(self, heaters: bridged.Heaters, channel: int, name: str = ""):
        heaters._channel(channel)
        self._heaters, self._ch = heaters, channel
        with self.add_children_as_readables(Format.HINTED_UNCACHED_SIGNAL):
            self.volts = SignalRW(BridgeBackend(
                float, _source(heaters.name, f"heater/{channel}"),
                get=lambda: heaters.voltage(channel),
                put=lambda v: heaters.set_voltage(channel, v),
                quantity=heaters.quantity("volts")))
        super().__init__(name=name)

    def set(self, value: float, timeout: float | None = None) -> AsyncStatus:
        return self.volts.set(value, timeout=timeout)


class HeaterBank(StandardReadable):
    """A heater DAC's channels (or a chip's heaters): `.channel[k]`, k from 0."""

    def __init__(self, heaters: bridged.Heaters, name: str = ""):
        self.heaters = heaters
        self.channel = DeviceVector({k: HeaterChannel(heaters, k)
                                     for k in range(heaters.channels)})
        q = heaters.quantity("volts")
        with self.add_children_as_readables(Format.UNCACHED_SIGNAL):
            self.volts = SignalR(BridgeBackend(
                Array1D[np.float64], _source(heaters.name, "heaters"), get=heaters.voltages,
                quantity=bridged.Quantity(q.name, q.units, precision=q.precision),
                dtype=np.float64))
        super().__init__(name=name)


class MeterPort(StandardReadable):
    """One port of a power meter: a trigger measures (the meter's averaging time), a read
    gives that measurement in mW and dBm."""

    def __init__(self, meter: bridged.Meter, port: int, name: str = ""):
        meter._port(port)
        self._meter, self._port = meter, port
        self._mw = BridgeBackend(float, _source(meter.name, f"port/{port}/mW"),
                                 quantity=meter.quantity("power_mw"))
        self._dbm = BridgeBackend(float, _source(meter.name, f"port/{port}/dBm"),
                                  quantity=meter.quantity("power_dbm"))
        with self.add_children_as_readables(Format.HINTED_SIGNAL):
            self.power_mw = SignalR(self._mw)
            self.power_dbm = SignalR(self._dbm)
        super().__init__(name=name)

    def hold(self, mw: float) -> None:
        """A measurement of this port, made here or by the meter's trigger."""
        self._mw.hold(mw)
        self._dbm.hold(mw_to_dbm(mw))

    @AsyncStatus.wrap
    async def trigger(self) -> None:
        if self._mock is not None:        # connected in mock mode: the meter is not asked
            return
        mw, _ = await asyncio.to_thread(self._meter.read, self._port)
        self.hold(mw)


class PowerMeter(StandardReadable):
    """A power meter's ports: `.port[p]`, p from 1. As a detector itself, a trigger measures
    every port (one request) and a read gives each port's."""

    def __init__(self, meter: bridged.Meter, name: str = ""):
        self.meter = meter
        self.port = DeviceVector({p: MeterPort(meter, p) for p in range(1, meter.ports + 1)})
        self.add_readables(list(self.port.values()), Format.CHILD)
        super().__init__(name=name)

    @AsyncStatus.wrap
    async def trigger(self) -> None:
        if self._mock is not None:
            return
        power = await asyncio.to_thread(self.meter.read_power)
        for p, mw in power.items():
            self.port[p].hold(mw)


class LaserSource(StandardReadable):
    """A tunable laser: `on`, `power_mw`, `wavelength_nm`, each set on its own."""

    def __init__(self, laser: bridged.Laser, name: str = ""):
        self.laser = laser

        def signal(key: str, datatype: type, quantity: bridged.Quantity | None) -> SignalRW:
            return SignalRW(BridgeBackend(datatype, _source(laser.name, key),
                                          get=lambda: laser.state()[key],
                                          put=lambda v: laser.set(**{key: v}),
                                          quantity=quantity))
        with self.add_children_as_readables(Format.UNCACHED_SIGNAL):
            self.on = signal("on", bool, None)
            self.power_mw = signal("power_mw", float, laser.quantity("power_mw"))
            self.wavelength_nm = signal("wavelength_nm", float, laser.quantity("wavelength_nm"))
        super().__init__(name=name)


class CircuitSwitch(StandardReadable):
    """An OCS (or a chip as a switch): its circuits as a port map, output per input."""

    def __init__(self, switch: bridged.Switch, name: str = ""):
        self.switch = switch
        with self.add_children_as_readables(Format.UNCACHED_SIGNAL):
            self.port_map = SignalRW(BridgeBackend(
                Array1D[np.int64], _source(switch.name, "port_map"),
                get=switch.port_map, put=switch.apply_port_map))
        with self.add_children_as_readables(Format.CONFIG_SIGNAL):
            self.ports = SignalR(BridgeBackend(int, _source(switch.name, "ports"),
                                               initial=switch.ports))
        super().__init__(name=name)


def device_for(access: Access, name: str = "") -> StandardReadable:
    """The ophyd-async device of one instrument (named after it unless `name`)."""
    inst = bridged.instrument(access)
    name = name or access.name
    if isinstance(inst, bridged.Heaters):
        return HeaterBank(inst, name=name)
    if isinstance(inst, bridged.Meter):
        return PowerMeter(inst, name=name)
    if isinstance(inst, bridged.Laser):
        return LaserSource(inst, name=name)
    assert isinstance(inst, bridged.Switch)
    return CircuitSwitch(inst, name=name)


def rig_devices(rig: Rig, names: list[str] | None = None, *,
                direct: bool = False) -> dict[str, StandardReadable]:
    """The rig's instruments (`names`, or every one a bridge knows) as ophyd-async devices,
    through its bus (or, `direct`, through drivers opened here). Each asks its device what it
    is (channels, ports) once, here; connecting the devices reads them."""
    found = open_rig(rig, names, direct=direct)
    try:
        return {n: device_for(a) for n, a in found.items()}
    except BaseException:
        for a in found.values():
            a.close()
        raise


def close(devices: dict[str, StandardReadable]) -> None:
    """Release the connections (or drivers) behind devices made by `rig_devices`."""
    for dev in devices.values():
        inst = next((getattr(dev, k) for k in ("heaters", "meter", "laser", "switch")
                     if hasattr(dev, k)), None)
        if inst is not None:
            inst.close()
