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
import numbers
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from photonic_testbed.drivers.power_meter import mw_to_dbm
from photonic_testbed.hil.bridges.access import TIMEOUT_S, Access, BridgeError
from photonic_testbed.hil.bus import schema


@dataclass(frozen=True)
class Quantity:
    name: str            # as the drivers name it (a LECO parameter, an ophyd-async signal)
    units: str
    low: float | None = None
    high: float | None = None
    precision: int = 3

    def check(self, value: Any, where: str) -> float:
        """`value` (a real number: numpy's too, never a bool) as a float within the limits,
        else ValueError saying which."""
        number = real(value)
        if number is None or not math.isfinite(number):
            raise ValueError(f"{where}: {self.name} must be a finite number of {self.units}, "
                             f"not {value!r}")
        value = number
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


def real(value: Any) -> float | None:
    """A real number as a float (inf where too large for one); None for anything else, a
    bool among them."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
        return None
    try:
        return float(value)
    except OverflowError:                     # an integer too large for a float
        return math.inf if str(value)[:1] != "-" else -math.inf


def whole(value: Any, where: str, lowest: int = 1) -> int:
    """A port or channel number: a whole number (numpy's too, the digits of a JSON key) from
    `lowest`, else ValueError saying which."""
    if isinstance(value, str) and value.isascii() and value.isdigit() and len(value) < 10:
        value = int(value)
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral) \
            or value < lowest:
        raise ValueError(f"{where} must be a whole number from {lowest}, not {value!r}")
    return int(value)


def flag(value: Any, where: str) -> bool:
    """On or off: a bool (numpy's too), else ValueError."""
    if not isinstance(value, (bool, np.bool_)):
        raise ValueError(f"{where} must be true or false, not {value!r}")
    return bool(value)


# The longest averaging time of a power meter port: an N774x's (and `ptb calibrate
# --averaging-s`'s bound); a read of n ports may take n times it
METER_AVERAGING_MAX_S = 10.0


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
        try:
            k = whole(ch, self.name, 0)
        except ValueError:
            k = -1
        if not 0 <= k < self.channels:
            raise ValueError(f"{self.name}: channel {ch!r} is not in 0..{self.channels - 1}")
        return k

    def voltages(self) -> list[float]:
        """Every channel's volts, read back from the board."""
        return [float(v) for v in self.access.read("read_heaters")["volts"]]

    def voltage(self, ch: int) -> float:
        return self.voltages()[self._channel(ch)]

    def set_voltage(self, ch: int, volts: float) -> None:
        self.set_voltages({ch: volts})

    def set_voltages(self, values: Mapping[int, float] | Sequence[float]) -> None:
        """Channels' volts ({channel: volts}, or a list from channel 0), every value checked
        before anything is sent, then one change per run of consecutive channels (a device that
        refuses a later run: the error says which channels were set before it)."""
        if isinstance(values, Mapping):
            items = dict(values)
        elif isinstance(values, (str, bytes)) or not isinstance(values, (Sequence, np.ndarray)):
            raise ValueError(f"{self.name}: volts are {{channel: volts}} or a list from channel "
                             f"0, not {values!r}")
        else:
            items = dict(enumerate(values))
        if len(items) > self.channels:
            raise ValueError(f"{self.name}: {len(items)} values for {self.channels} channels")
        q = self.quantity("volts")
        checked: dict[int, float] = {}
        for ch, v in items.items():
            k = self._channel(ch)
            if k in checked:
                raise ValueError(f"{self.name}: channel {k} named twice")
            checked[k] = q.check(v, f"{self.name} channel {k}")
        runs: list[tuple[int, list[float]]] = []
        for ch in sorted(checked):
            if runs and ch == runs[-1][0] + len(runs[-1][1]):
                runs[-1][1].append(checked[ch])
            else:
                runs.append((ch, [checked[ch]]))
        done: list[str] = []
        for first, run in runs:
            try:
                self.access.change("set_heaters", volts=run, first=first)
            except BridgeError as e:
                if not done:
                    raise
                raise BridgeError(f"{e} (channels {', '.join(done)} were set before it)") \
                    from e
            done.append(f"{first}..{first + len(run) - 1}" if len(run) > 1 else str(first))


class Meter(Instrument):
    """A power meter's ports, 1..ports: each read is a new measurement."""

    family = "meter"

    def __init__(self, access: Access):
        super().__init__(access)
        self.ports = int(access.describe().get("ports", 1))

    def _port(self, port: Any) -> int:
        try:
            p = whole(port, self.name)
        except ValueError:
            p = 0
        if not 1 <= p <= self.ports:
            raise ValueError(f"{self.name}: port {port!r} is not in 1..{self.ports}")
        return p

    def read_power(self, ports: Sequence[int] | None = None) -> dict[int, float]:
        """New measurements of `ports` (all by default; each port once), mW."""
        if ports is None:
            wanted = list(range(1, self.ports + 1))
        elif isinstance(ports, (str, bytes)) or not isinstance(ports, (Sequence, np.ndarray)):
            raise ValueError(f"{self.name}: ports are a list, not {ports!r}")
        else:
            if len(ports) > self.ports:
                raise ValueError(f"{self.name}: {len(ports)} ports asked of {self.ports}")
            wanted = [self._port(p) for p in ports]
            twice = sorted({p for p in wanted if wanted.count(p) > 1})
            if twice:
                raise ValueError(f"{self.name}: port {twice[0]} asked twice (each read takes "
                                 "the meter's averaging time)")
        # each port takes its averaging time (up to METER_AVERAGING_MAX_S), one after another
        power = self.access.read("read_power", channels=wanted, within_s=TIMEOUT_S + len(
            wanted) * METER_AVERAGING_MAX_S)["power"]
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
            args["on"] = flag(on, f"{self.name}: on")
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
        """Make the circuits exactly these ({input: output}: whole numbers); what was added and
        removed."""
        if not isinstance(circuits, Mapping):
            raise ValueError(f"{self.name}: circuits are {{input: output}}, not {circuits!r}")
        pairs = sorted((whole(a, f"{self.name}: an input"), whole(b, f"{self.name}: an output"))
                       for a, b in circuits.items())
        return self.access.change("apply_circuits", circuits=[list(p) for p in pairs])

    def port_map(self) -> list[int]:
        """The circuits as a list: the output of input k at k - 1, 0 for none."""
        out = [0] * self.ports
        for a, b in self.circuits().items():
            if 1 <= a <= self.ports:
                out[a - 1] = b
        return out

    def apply_port_map(self, outputs: Sequence[int]) -> dict:
        """The circuits as a port map: the output of input k at k - 1, 0 for none."""
        if isinstance(outputs, (str, bytes)) or not isinstance(outputs, (Sequence, np.ndarray)) \
                or np.ndim(outputs) != 1 or len(outputs) != self.ports:
            raise ValueError(f"{self.name}: a port map is a list of one output per input "
                             f"({self.ports}), 0 for none; not {outputs!r}")
        checked = [whole(b, f"{self.name}: the output of input {k + 1}", 0)
                   for k, b in enumerate(outputs)]
        return self.apply({k + 1: b for k, b in enumerate(checked) if b})


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
