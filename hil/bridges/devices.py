"""The instruments as the bridges offer them: each one's quantities, with their units and limits
in one place (`QUANTITIES`), read and set through an `Access` (the bus or the driver).

    Heaters   volts per channel (V), 0 .. the board's full scale (its description's `vfull`)
    Meter     power per port, mW and dBm (one measurement gives both)
    Laser     output on/off, power (mW, dBm), wavelength (nm)
    Switch    circuits {input: output}, or as a port map (output per input, 0 = none)

A value outside its limits, not finite, or for a channel or port the device does not have is
refused here with what is wrong, before anything is sent; the device refuses what it must
besides (a channel's own lower limit, the heater power budget, a laser's range) and its refusal
comes back as a `BridgeError` with its reason.
"""
from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from photonic_testbed.drivers.power_meter import mw_to_dbm
from photonic_testbed.hil.bridges.access import Access, BridgeError
from photonic_testbed.hil.bus import schema


@dataclass(frozen=True)
class Quantity:
    name: str            # as the drivers name it (a LECO parameter, an ophyd-async signal)
    units: str
    low: float | None = None
    high: float | None = None
    precision: int = 3

    def check(self, value: Any, where: str) -> float:
        """`value` as a float within the limits, else ValueError saying which."""
        if isinstance(value, bool) or not isinstance(value, (int, float)) \
                or not math.isfinite(value):
            raise ValueError(f"{where}: {self.name} must be a finite number of {self.units}, "
                             f"not {value!r}")
        if (self.low is not None and value < self.low) or \
                (self.high is not None and value > self.high):
            raise ValueError(f"{where}: {self.name} {value:g} {self.units}: it must be "
                             f"{self.limits_text()}")
        return float(value)

    def limits_text(self) -> str:
        if self.high is None:
            return f"at least {self.low:g} {self.units}"
        if self.low is None:
            return f"at most {self.high:g} {self.units}"
        return f"in {self.low:g}..{self.high:g} {self.units}"


# The quantities of each kind of instrument; a limit of None is the device's to enforce alone.
QUANTITIES: dict[str, dict[str, Quantity]] = {
    "heaters": {"volts": Quantity("volts", "V", 0.0, None, 4)},   # high: the board's vfull
    "meter": {"power_mw": Quantity("power_mw", "mW", precision=6),
              "power_dbm": Quantity("power_dbm", "dBm", precision=3)},
    "laser": {"power_mw": Quantity("power_mw", "mW", 0.0, None, 4),
              "wavelength_nm": Quantity("wavelength_nm", "nm", precision=4)},
}


class Instrument:
    """One device behind its access."""

    family = ""

    def __init__(self, access: Access):
        self.access = access
        self.name = access.name

    def quantity(self, name: str) -> Quantity:
        return QUANTITIES[self.family][name]

    def close(self) -> None:
        self.access.close()


class Heaters(Instrument):
    """A heater DAC's channels, or a chip's heaters (its mesh owns the DAC)."""

    family = "heaters"

    def __init__(self, access: Access):
        super().__init__(access)
        d = access.describe()
        d = d.get("heaters", d)          # a chip describes its heater DAC inside
        self.channels = int(d["channels"])
        self.vfull = float(d["vfull"])

    def quantity(self, name: str) -> Quantity:
        q = super().quantity(name)
        return Quantity(q.name, q.units, q.low, self.vfull, q.precision)

    def _channel(self, ch: Any) -> int:
        if isinstance(ch, bool) or not isinstance(ch, int) or not 0 <= ch < self.channels:
            raise ValueError(f"{self.name}: channel {ch!r} is not in 0..{self.channels - 1}")
        return ch

    def voltages(self) -> list[float]:
        """Every channel's volts, read back from the board."""
        return [float(v) for v in self.access.read("read_heaters")["volts"]]

    def voltage(self, ch: int) -> float:
        return self.voltages()[self._channel(ch)]

    def set_voltage(self, ch: int, volts: float) -> None:
        self.set_voltages({ch: volts})

    def set_voltages(self, values: Mapping[int, float] | Sequence[float]) -> None:
        """Channels' volts ({channel: volts}, or a list from channel 0), in one change per run
        of consecutive channels."""
        items = dict(values) if isinstance(values, Mapping) else dict(enumerate(values))
        q = self.quantity("volts")
        checked = {self._channel(ch): q.check(v, f"{self.name} channel {ch}")
                   for ch, v in items.items()}
        run: list[float] = []
        first = None
        for ch in sorted(checked):
            if first is not None and ch != first + len(run):
                self.access.change("set_heaters", volts=run, first=first)
                run, first = [], None
            first = ch if first is None else first
            run.append(checked[ch])
        if run:
            self.access.change("set_heaters", volts=run, first=first)


class Meter(Instrument):
    """A power meter's ports, 1..ports: each read is a new measurement."""

    family = "meter"

    def __init__(self, access: Access):
        super().__init__(access)
        self.ports = int(access.describe().get("ports", 1))

    def _port(self, port: Any) -> int:
        if isinstance(port, bool) or not isinstance(port, int) or not 1 <= port <= self.ports:
            raise ValueError(f"{self.name}: port {port!r} is not in 1..{self.ports}")
        return port

    def read_power(self, ports: Sequence[int] | None = None) -> dict[int, float]:
        """New measurements of `ports` (all by default), mW."""
        wanted = list(range(1, self.ports + 1)) if ports is None else \
            [self._port(p) for p in ports]
        power = self.access.read("read_power", channels=wanted)["power"]
        return {int(p): float(v) for p, v in power.items()}

    def read(self, port: int) -> tuple[float, float]:
        """One new measurement of `port`: (mW, dBm)."""
        mw = self.read_power([port])[port]
        return mw, mw_to_dbm(mw)


class Laser(Instrument):
    family = "laser"

    def state(self) -> dict:
        """{"on", "power_mw", "wavelength_nm"}, read from the laser."""
        got = self.access.read("read_laser")
        return {"on": bool(got["on"]), "power_mw": float(got["power_mw"]),
                "wavelength_nm": float(got["wavelength_nm"])}

    def set(self, *, on: bool | None = None, power_mw: float | None = None,
            wavelength_nm: float | None = None) -> dict:
        """Any of the settings at once; the laser's state after."""
        args: dict[str, Any] = {}
        if on is not None:
            if not isinstance(on, bool):
                raise ValueError(f"{self.name}: on must be true or false, not {on!r}")
            args["on"] = on
        if power_mw is not None:
            args["power_mw"] = self.quantity("power_mw").check(power_mw, self.name)
            if args["power_mw"] <= 0:
                raise ValueError(f"{self.name}: power must be positive, not {power_mw} mW "
                                 "(turn the output off instead)")
        if wavelength_nm is not None:
            args["wavelength_nm"] = self.quantity("wavelength_nm").check(wavelength_nm,
                                                                         self.name)
        if not args:
            raise ValueError(f"{self.name}: nothing to set (on, power_mw, wavelength_nm)")
        return self.access.change("set_laser", **args)


class Switch(Instrument):
    """An OCS or a chip as a circuit switch: inputs 1..ports; its outputs as it numbers them
    (an OCS's egress ports are ports + 1 .. 2 ports)."""

    family = "switch"

    def __init__(self, access: Access):
        super().__init__(access)
        self.ports = int(access.describe()["ports"])

    def circuits(self) -> dict[int, int]:
        """{input: output}, read from the switch."""
        return schema.circuits_from_wire(self.access.read("read_circuits")["circuits"])

    def apply(self, circuits: Mapping[int, int]) -> dict:
        """Make the circuits exactly these; what was added and removed."""
        pairs = [[int(a), int(b)] for a, b in sorted(dict(circuits).items())]
        return self.access.change("apply_circuits", circuits=pairs)

    def port_map(self) -> list[int]:
        """The circuits as a list: the output of input k at k - 1, 0 for none."""
        out = [0] * self.ports
        for a, b in self.circuits().items():
            if 1 <= a <= self.ports:
                out[a - 1] = b
        return out

    def apply_port_map(self, outputs: Sequence[int]) -> dict:
        if len(outputs) != self.ports:
            raise ValueError(f"{self.name}: a port map has one output per input ({self.ports}),"
                             f" not {len(outputs)}")
        return self.apply({k + 1: int(b) for k, b in enumerate(outputs) if int(b)})


FAMILIES: dict[str, type[Instrument]] = {
    "heater_dac": Heaters, "chip": Heaters, "power_meter": Meter, "laser": Laser,
    "switch": Switch}


def instrument(access: Access) -> Instrument:
    """The instrument a device of this kind is (a chip offers its heaters: its circuits are the
    agent's, or a `Switch(access)` when asked for)."""
    cls = FAMILIES.get(access.kind)
    if cls is None:
        raise BridgeError(f"{access.name}: no bridge for a device of kind {access.kind!r}")
    return cls(access)
