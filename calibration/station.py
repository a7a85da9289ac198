"""The instruments a calibration run uses, through their drivers only.

A `Station` is a chip's heater DAC (which also reads the cells' monitor photodiodes), the input
selector that brings the laser to one chip input (an OCS: ingress `laser_ingress` -> egress
`ocs.ports + k` is chip input k) and the power meter on the chip's output taps (meter port m
reads output N + m; on a recirculating mesh, port m). It counts what it does, for the
benchmark and the lab-time estimate.
"""
from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from photonic_testbed.common.topology import Topology
from photonic_testbed.drivers.heater_dac import Forbidden

log = logging.getLogger(__name__)


class StationError(RuntimeError):
    """The station cannot do what the calibration asks (no detector, no selector, ...)."""


@dataclass
class Counters:
    heater_writes: int = 0       # serial lines that set heaters
    pd_reads: int = 0            # PDALL? queries
    meter_reads: int = 0         # power meter reads (all ports)
    selector_switches: int = 0
    other_queries: int = 0       # current readback etc.

    @property
    def serial_commands(self) -> int:
        return self.heater_writes + self.pd_reads + self.other_queries

    def as_dict(self) -> dict:
        return {"heater_writes": self.heater_writes, "pd_reads": self.pd_reads,
                "meter_reads": self.meter_reads, "selector_switches": self.selector_switches,
                "other_queries": self.other_queries}


@dataclass
class Station:
    topology: Topology
    # the drivers, or doubles with their methods (tests)
    dac: Any                                 # drivers.heater_dac.HeaterDAC
    selector: Any = None                     # drivers.ocs.OpticalCircuitSwitch
    meter: Any = None                        # drivers.power_meter.PowerMeter
    laser_ingress: int = 1
    monitors: bool = True
    counters: Counters = field(default_factory=Counters)

    def __post_init__(self):
        self._lit: int | None = None
        self._monitors_asked = False
        self.channels = sorted(ch for c in self.topology.cells for ch in c.channels)
        # the monitor photodiode of a cell sits beside its first heater channel
        self.pd_channel = {c.id: c.channels[0] for c in self.topology.cells}

    # ---- light in ------------------------------------------------------------------------

    def light(self, chip_input: int) -> None:
        """Bring the laser to chip input `chip_input` (1..N) through the selector."""
        if self.selector is None:
            raise StationError("this station has no input selector: cannot choose the lit "
                               "input")
        if not 1 <= chip_input <= self.topology.ports:
            raise StationError(f"chip inputs are 1..{self.topology.ports}, not {chip_input}")
        if self._lit == chip_input:
            return
        self.selector.apply({self.laser_ingress: self.selector.ports + chip_input})
        self.counters.selector_switches += 1
        self._lit = chip_input

    def dark(self) -> None:
        """Take the laser off the chip (the selector disconnects its ingress)."""
        if self.selector is None:
            raise StationError("this station has no input selector: cannot darken the chip")
        self.selector.disconnect(self.laser_ingress)
        self.counters.selector_switches += 1
        self._lit = None

    def dark_currents_ua(self, reads: int = 4) -> dict[str, float]:
        """Every monitor photodiode's dark current (uA): the mean of `reads` readings with
        the laser off the chip; the light it was on is brought back by the next `light`."""
        self.dark()
        sums: dict[str, float] = {}
        for _ in range(reads):
            for cid, ua in self.monitors_ua().items():
                sums[cid] = sums.get(cid, 0.0) + ua
        return {cid: v / reads for cid, v in sums.items()}

    # ---- heaters -------------------------------------------------------------------------

    def set_volts(self, volts: Mapping[int, float]) -> None:
        if volts:
            self.counters.heater_writes += self.dac.set_voltages(dict(volts))

    def commanded(self) -> np.ndarray:
        return np.asarray(self.dac.commanded, dtype=float)

    def measure_resistances(self, probe_v: float = 4.0) -> dict[int, float]:
        """Every heater's resistance (ohm) from one current readback at `probe_v`."""
        before = self.commanded()
        self.set_volts({ch: probe_v for ch in self.channels})
        volts = self.commanded()
        amps = self.dac.currents()
        self.counters.other_queries += 1
        self.set_volts({ch: float(before[ch]) for ch in self.channels})
        r = {}
        for ch in self.channels:
            if not amps[ch] > 0:
                raise StationError(f"heater channel {ch} draws no current at {probe_v} V: open "
                                   "circuit?")
            r[ch] = 1000.0 * volts[ch] / amps[ch]
        return r

    # ---- light out -----------------------------------------------------------------------

    def has_monitors(self) -> bool:
        """Whether the chip's cells have monitor photodiodes: False when this station was
        told so, or when the DAC refuses to read a photodiode (E13: no photodiode inputs).
        The board is asked once."""
        if not self.monitors or self._monitors_asked:
            return self.monitors
        try:
            self.dac.photocurrent(self.channels[0])
        except Forbidden:
            self.monitors = False
        finally:
            self.counters.other_queries += 1
        self._monitors_asked = True             # the board's answer does not change
        return self.monitors

    def monitors_ua(self) -> Mapping[str, float]:
        if not self.monitors:
            raise StationError("this chip has no monitor photodiodes")
        pd = self.dac.photocurrents()
        self.counters.pd_reads += 1
        return {cid: float(pd[ch]) for cid, ch in self.pd_channel.items()}

    def outputs_mw(self) -> dict[int, float]:
        """Chip output port (N+1..2N; 1..P on a recirculating mesh, whose ports are inputs and
        outputs both) -> mW read on its tap."""
        if self.meter is None:
            raise StationError("this station has no power meter on the chip outputs")
        n = self.topology.ports
        power = self.meter.read_power(list(range(1, n + 1)))
        self.counters.meter_reads += 1
        first = 0 if self.topology.recirculating else n
        return {first + m: float(p) for m, p in power.items()}

    def lab_time_s(self, serial_s: float = 1e-3, meter_s: float = 10e-3,
                   switch_s: float = 25e-3) -> float:
        """How long the same run would take in a lab: per serial command, per meter reading
        (its averaging time) and per selector switch."""
        c = self.counters
        return c.serial_commands * serial_s + c.meter_reads * meter_s + \
            c.selector_switches * switch_s


def heater_volts(p_mw: float, r_ohm: float) -> float:
    if p_mw < 0 or not math.isfinite(p_mw):
        raise ValueError(f"heater power must be a finite number >= 0 mW, not {p_mw!r}")
    return math.sqrt(p_mw * r_ohm / 1000.0)
