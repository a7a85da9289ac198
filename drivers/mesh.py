"""The mesh driver: circuits on a programmable photonic chip, as heater voltages.

`Mesh` joins a chip topology, a calibration (heater voltage <-> phase) and the heater DAC
driver, and is a `CircuitSwitch`: `apply(circuits)` routes the circuits (Benes looping, the
Clements decomposition, or paths along the waveguides of a square or hexagonal mesh), turns cell
phases into voltages and sends only the heaters that change, merged into as few serial lines as
the DAC driver can.

Calibration, per heater channel: phase = offset + pi * P / P_pi with P = V^2 / R. Until a chip is
calibrated, `Calibration.ideal()` assumes P_pi = 22.5 mW, R = 1 kOhm and zero offset for every
heater, and no crosstalk: right for an ideal chip only (that is what calibration is for).
A calibration file is JSON (docs/calibration.md describes every key; version 1 files, without
the provenance and the per-cell record, still load):

    {"version": 2, "chip": "benes16", "chip_id": "...", "rig": "lumion", "date": "ISO 8601",
     "method": "monitors" | "outputs",
     "channels": [{"channel": 0, "cell": "s0r0", "offset_rad": 0.0, "offset_std": 0.001,
                   "p_pi_mw": 22.5, "p_pi_std_mw": 0.01, "r_ohm": 1000.0}, ...],
     "crosstalk": [[...], ...],          # optional: k[i][j], channels in the order listed
     "crosstalk_std": [[...], ...],      # optional, same shape
     "cells": {"s0r0": {...}, ...}}      # optional: the measured fringes, fits, extinction
"""
from __future__ import annotations

import json
import logging
import math
import os
import pathlib
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace

import numpy as np

from photonic_testbed.drivers.circuit_switch import ApplyReport, Circuits, CircuitSwitch, \
    SwitchError
from photonic_testbed.drivers.routing import BAR, CROSS, RoutingError, benes_cell_states, \
    circuits_to_permutation, clements_decompose, mzi, permutation_matrix, route_waveguides, \
    trace_states, trace_waveguides
from photonic_testbed.drivers.topology import Topology

log = logging.getLogger(__name__)

NOMINAL_P_PI_MW = 22.5
NOMINAL_R_OHM = 1000.0
STATE_TOLERANCE_RAD = 0.05       # a cell read back within this of pi / 0 is bar / cross
CALIBRATION_VERSION = 2
READABLE_VERSIONS = (1, 2)


class CalibrationError(ValueError):
    """A calibration file is missing, malformed, or does not fit the chip."""


@dataclass(frozen=True)
class HeaterCalibration:
    offset_rad: float = 0.0
    p_pi_mw: float = NOMINAL_P_PI_MW
    r_ohm: float = NOMINAL_R_OHM
    offset_std: float = 0.0
    p_pi_std_mw: float = 0.0
    cell: str = ""


@dataclass(frozen=True)
class Calibration:
    heaters: dict[int, HeaterCalibration]
    crosstalk: np.ndarray | None = None        # k[i][j] in sorted channel order
    chip: str = ""
    source: str = "ideal"
    chip_id: str = ""                          # the chip's identity (serial), "" if unknown
    rig: str = ""
    date: str = ""                             # ISO 8601, UTC
    method: str = ""                           # "monitors" or "outputs"
    crosstalk_std: np.ndarray | None = None
    cells: dict = field(default_factory=dict)  # per-cell record: fringes, fits, extinction

    @classmethod
    def ideal(cls, channels, chip: str = "") -> "Calibration":
        return cls({int(ch): HeaterCalibration() for ch in channels}, None, chip, "ideal")

    @classmethod
    def load(cls, path: str | os.PathLike) -> "Calibration":
        path = pathlib.Path(path)
        try:
            d = json.loads(path.read_text())
        except OSError as e:
            raise CalibrationError(f"cannot read calibration {path}: {e}") from None
        except json.JSONDecodeError as e:
            raise CalibrationError(f"calibration {path} is not JSON: {e}") from None
        return cls.from_dict(d, source=str(path))

    @classmethod
    def from_dict(cls, d: dict, source: str = "dict") -> "Calibration":
        try:
            if not isinstance(d, dict):
                raise CalibrationError(f"calibration {source} is not a JSON object")
            if d.get("version") not in READABLE_VERSIONS:
                raise CalibrationError(f"calibration version {d.get('version')!r} is not one of "
                                       f"{READABLE_VERSIONS}")
            heaters = {}
            for h in d["channels"]:
                cal = HeaterCalibration(float(h["offset_rad"]), float(h["p_pi_mw"]),
                                        float(h["r_ohm"]), float(h.get("offset_std", 0.0)),
                                        float(h.get("p_pi_std_mw", 0.0)), str(h.get("cell", "")))
                if not (cal.p_pi_mw > 0 and cal.r_ohm > 0):
                    raise CalibrationError(f"channel {h['channel']}: P_pi and R must be > 0")
                if not all(math.isfinite(x) for x in (cal.offset_rad, cal.p_pi_mw, cal.r_ohm)):
                    raise CalibrationError(f"channel {h['channel']}: values must be finite")
                if int(h["channel"]) in heaters:
                    raise CalibrationError(f"channel {h['channel']} is listed twice")
                heaters[int(h["channel"])] = cal
            if not heaters:
                raise CalibrationError(f"calibration {source} lists no heater channels")
            n = len(heaters)
            k = d.get("crosstalk")
            k = None if k is None else np.asarray(k, dtype=float)
            if k is not None and k.shape != (n, n):
                raise CalibrationError(f"crosstalk is {k.shape}, not {n} square")
            ks = d.get("crosstalk_std")
            ks = None if ks is None else np.asarray(ks, dtype=float)
            if ks is not None and ks.shape != (n, n):
                raise CalibrationError(f"crosstalk_std is {ks.shape}, not {n} square")
            cells = d.get("cells", {})
            if not isinstance(cells, dict):
                raise CalibrationError("cells must be an object keyed by cell id")
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            if isinstance(e, CalibrationError):
                raise
            raise CalibrationError(f"calibration {source} is malformed: {e!r}") from None
        return cls(heaters, k, str(d.get("chip", "")), source, str(d.get("chip_id", "")),
                   str(d.get("rig", "")), str(d.get("date", "")), str(d.get("method", "")),
                   ks, cells)

    def to_dict(self) -> dict:
        d = {"version": CALIBRATION_VERSION, "chip": self.chip, "chip_id": self.chip_id,
             "rig": self.rig, "date": self.date, "method": self.method,
             "channels": [{"channel": ch, "cell": h.cell, "offset_rad": h.offset_rad,
                           "offset_std": h.offset_std, "p_pi_mw": h.p_pi_mw,
                           "p_pi_std_mw": h.p_pi_std_mw, "r_ohm": h.r_ohm}
                          for ch, h in sorted(self.heaters.items())]}
        if self.crosstalk is not None:
            d["crosstalk"] = self.crosstalk.tolist()
        if self.crosstalk_std is not None:
            d["crosstalk_std"] = self.crosstalk_std.tolist()
        if self.cells:
            d["cells"] = self.cells
        return d

    def save(self, path: str | os.PathLike) -> None:
        """Write the file atomically: a temp file beside it, flushed, then renamed over it."""
        path = pathlib.Path(path)
        tmp = path.with_name(path.name + ".tmp")
        with open(tmp, "w") as f:
            f.write(json.dumps(self.to_dict(), indent=1, allow_nan=False) + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)

    def check_chip(self, chip: str, chip_id: str = "") -> None:
        """Refuse a calibration made for another chip (by topology name, and by chip id when
        both sides know it)."""
        if self.chip and chip and self.chip != chip:
            raise CalibrationError(f"calibration {self.source} is for chip {self.chip!r}, "
                                   f"not {chip!r}")
        if self.chip_id and chip_id and self.chip_id != chip_id:
            raise CalibrationError(f"calibration {self.source} is for chip id {self.chip_id!r}, "
                                   f"not {chip_id!r}")

    def merged(self, newer: "Calibration") -> "Calibration":
        """This calibration with what a later run of some cells measured (`ptb calibrate
        --cells ... --update FILE`): the newer run's heaters replace these, its crosstalk
        entries (pairs of heaters it calibrated) replace these, every other heater and entry is
        kept; the cells' records say when they were updated. Refused for another chip or
        another method, and when the newer run has heaters this file does not."""
        self.check_chip(newer.chip, newer.chip_id)
        if self.method and newer.method and self.method != newer.method:
            raise CalibrationError(f"calibration {self.source} was made from the "
                                   f"{self.method}; this run from the {newer.method}: "
                                   "calibrate every cell again to change the method")
        extra = sorted(set(newer.heaters) - set(self.heaters))
        if extra:
            raise CalibrationError(f"calibration {self.source} has no heater channel(s) "
                                   f"{extra}: calibrate every cell instead")
        heaters = {**self.heaters, **newer.heaters}
        chans = sorted(heaters)
        k, k_std = self.crosstalk, self.crosstalk_std
        if newer.crosstalk is not None:
            if k is None:
                raise CalibrationError(f"calibration {self.source} has no crosstalk matrix "
                                       "to update: calibrate every cell with the crosstalk")
            at = [chans.index(ch) for ch in sorted(newer.heaters)]
            k = k.copy()
            k[np.ix_(at, at)] = newer.crosstalk
            if k_std is not None and newer.crosstalk_std is not None:
                k_std = k_std.copy()
                k_std[np.ix_(at, at)] = newer.crosstalk_std
        cells = dict(self.cells)
        for cell, record in newer.cells.items():
            cells[cell] = {**record, "updated": newer.date}
        return replace(self, heaters=heaters, crosstalk=k, crosstalk_std=k_std, cells=cells,
                       date=newer.date or self.date, source=f"{self.source} + {newer.source}")

    def without_crosstalk(self) -> "Calibration":
        """The same heaters with no crosstalk compensation (for comparisons)."""
        return replace(self, crosstalk=None, crosstalk_std=None)

    def _arrays(self, channels):
        try:
            hs = [self.heaters[ch] for ch in channels]
        except KeyError as e:
            raise CalibrationError(f"the calibration has no heater channel {e.args[0]}") from None
        return (np.array([h.offset_rad for h in hs]), np.array([h.p_pi_mw for h in hs]),
                np.array([h.r_ohm for h in hs]))

    def voltages(self, phases: Mapping[int, float]) -> dict[int, float]:
        """Heater voltages giving these phases (rad) on these channels; every channel of the
        calibration must be named when it has crosstalk (all heaters solved together)."""
        chans = sorted(phases)
        off, p_pi, r = self._arrays(chans)
        delta = np.mod(np.array([phases[c] for c in chans]) - off, 2 * math.pi)
        if self.crosstalk is None:
            p = delta * p_pi / math.pi
        else:
            if chans != sorted(self.heaters):
                raise CalibrationError("with crosstalk, give phases for every heater")
            mix = np.eye(len(chans)) + self.crosstalk
            for _ in range(8):
                p = np.linalg.solve(mix, delta * p_pi / math.pi)
                if (p >= 0).all():
                    break
                delta = delta + 2 * math.pi * (p < 0)
            else:
                raise CalibrationError("no non-negative heater powers reach these phases")
        return {c: float(v) for c, v in zip(chans, np.sqrt(p * r / 1000.0))}

    def phases(self, volts: Mapping[int, float]) -> dict[int, float]:
        """Phases (rad, in [0, 2 pi)) the calibration predicts for these heater voltages."""
        chans = sorted(volts)
        off, p_pi, r = self._arrays(chans)
        p = 1000.0 * np.array([volts[c] for c in chans]) ** 2 / r
        if self.crosstalk is not None and chans == sorted(self.heaters):
            p = (np.eye(len(chans)) + self.crosstalk) @ p
        return {c: float(x) for c, x in zip(chans, np.mod(off + math.pi * p / p_pi, 2 * math.pi))}


def classify(theta: float) -> str:
    d_bar = abs((theta - math.pi + math.pi) % (2 * math.pi) - math.pi)
    d_cross = abs((theta + math.pi) % (2 * math.pi) - math.pi)
    if d_bar < STATE_TOLERANCE_RAD:
        return BAR
    if d_cross < STATE_TOLERANCE_RAD:
        return CROSS
    return "partial"


class Mesh(CircuitSwitch):
    """A Benes, Clements, square or hexagonal chip driven through a heater DAC.

    On a recirculating (square, hexagonal) mesh the ports 1..P are not split: circuits are
    pairs {a: b} with a < b (`check_circuits(split=False)`), routed along the mesh's waveguides
    by `route_waveguides`; cells no path crosses are left bar."""

    def __init__(self, topology: Topology, dac, calibration: Calibration | str | os.PathLike |
                 None = None, *, name: str | None = None, own_dac: bool = True,
                 chip_id: str = ""):
        if topology.recirculating and not topology.joins:
            raise SwitchError(f"{topology.name}: a recirculating mesh needs its waveguide "
                              "joins (Topology.joins) to be driven")
        self.topology = topology
        self.dac = dac
        self.name = name or topology.name
        self._own_dac = own_dac
        channels = [ch for c in topology.cells for ch in c.channels]
        if calibration is None:
            calibration = Calibration.ideal(channels, topology.name)
        elif not isinstance(calibration, Calibration):
            calibration = Calibration.load(calibration)
        calibration.check_chip(topology.name, chip_id)
        missing = set(channels) - set(calibration.heaters)
        if missing:
            raise CalibrationError(f"calibration {calibration.source} lacks heater channels "
                                   f"{sorted(missing)[:8]}")
        self.calibration = calibration
        if dac.channels < topology.channels:
            raise SwitchError(f"{topology.name} needs {topology.channels} heater channels; "
                              f"the DAC has {dac.channels}")
        self._channels = channels
        self._active: Circuits | None = None
        self.lines_sent = 0

    @property
    def ports(self) -> int:
        return self.topology.ports

    # ---- circuits -> phases -> volts --------------------------------------------------------

    def cell_phases(self, circuits: Mapping[int, int]) -> dict[str, tuple[float, float]]:
        """{cell id: (theta, phi)} making these circuits (the rest of the inputs go to the
        outputs left over)."""
        if self.topology.recirculating:
            states = {c.id: BAR for c in self.topology.cells}
            states.update(route_waveguides(self.topology, circuits.items()).states)
            named = {BAR: math.pi, CROSS: 0.0}
            return {cid: (named[s], 0.0) for cid, s in states.items()}
        perm = circuits_to_permutation(circuits, self.ports)
        if self.topology.kind == "benes":
            named = {BAR: math.pi, CROSS: 0.0}
            return {cid: (named[s], 0.0) for cid, s in benes_cell_states(perm).items()}
        return clements_decompose(permutation_matrix(perm)).cell_phases()

    def heater_phases(self, cell_phases: Mapping[str, tuple[float, float]]) -> dict[int, float]:
        phases = {}
        for cid, (theta, phi) in cell_phases.items():
            chans = self.topology.cell(cid).channels
            phases[chans[0]] = theta
            if len(chans) > 1:
                phases[chans[1]] = phi
        return phases

    @property
    def split(self) -> bool:
        return not self.topology.recirculating

    def apply(self, circuits: Mapping[int, int]) -> ApplyReport:
        t0 = time.perf_counter()
        circuits = self.check(circuits)
        try:
            cells = self.cell_phases(circuits)
        except RoutingError as e:
            raise SwitchError(f"{self.name}: {e}") from e
        volts = self.calibration.voltages(self.heater_phases(cells))
        commanded = self.dac.commanded
        changed = {ch: v for ch, v in volts.items() if abs(commanded[ch] - v) > 1e-4}
        if changed:
            self.lines_sent += self.dac.set_voltages(changed)
        before = self._active or {}
        self._active = dict(circuits)
        added = {i: o for i, o in circuits.items() if before.get(i) != o}
        removed = {i: o for i, o in before.items() if circuits.get(i) != o}
        log.info("%s: %d circuits, %d heaters changed", self.name, len(circuits), len(changed))
        # The thermal time constant is microseconds: the light has settled when the DAC answers.
        return ApplyReport(added, removed, time.perf_counter() - t0)

    # ---- read back ----------------------------------------------------------------------------

    def cell_states(self, volts: Sequence[float] | None = None) -> dict[str, dict]:
        """The chip-service state: {cell id: {"state", "theta", "phi"}} from heater voltages
        (read back from the board unless given) and the calibration."""
        if volts is None:
            volts = self.dac.voltages()
        phases = self.calibration.phases({ch: volts[ch] for ch in self._channels})
        out = {}
        for c in self.topology.cells:
            theta = phases[c.channels[0]]
            phi = phases[c.channels[1]] if len(c.channels) > 1 else 0.0
            out[c.id] = {"state": classify(theta), "theta": theta, "phi": phi}
        return out

    def circuits(self) -> Circuits:
        """Circuits the chip makes now, from the heater voltages read back from the board. Once
        `apply` has run, only the inputs it was asked about are reported (every input of a
        chip goes somewhere); a circuit that is no longer made is missing."""
        states = self.cell_states()
        n = self.ports
        if self.topology.recirculating:
            made = trace_waveguides(self.topology, {c: s["state"] for c, s in states.items()})
        elif self.topology.kind == "benes":
            try:
                perm = trace_states(self.topology, {c: s["state"] for c, s in states.items()})
            except RoutingError:
                return {}
            made = {i + 1: n + 1 + o for i, o in enumerate(perm)}
        else:
            u = self.transfer_matrix(states)
            power = np.abs(u) ** 2
            made = {i + 1: n + 1 + int(np.argmax(power[:, i])) for i in range(n)
                    if power[:, i].max() > 0.99}
        if self._active is None:
            return made
        return {i: o for i, o in made.items() if i in self._active and self._active[i] == o}

    def transfer_matrix(self, states: Mapping[str, dict] | None = None) -> np.ndarray:
        """The ideal field transfer matrix the cell phases make (Clements chips)."""
        if self.topology.kind != "clements":
            raise SwitchError("transfer_matrix is for Clements meshes")
        states = states or self.cell_states()
        n = self.ports
        u = np.eye(n, dtype=complex)
        for c in sorted(self.topology.cells, key=lambda c: c.x):
            m = int(round(2 * c.y))
            s = states[c.id]
            u[m:m + 2, :] = mzi(s["theta"], s["phi"]) @ u[m:m + 2, :]
        return u

    def describe(self) -> dict:
        return {"name": self.name, "kind": "Mesh", "ports": self.ports,
                "topology": self.topology.describe(), "calibration": self.calibration.source}

    def close(self) -> None:
        if self._own_dac:
            self.dac.close()


def topology_named(name: str) -> Topology:
    """A chip topology from its name ("benes16", "clements8") or a topology JSON file."""
    import re
    from photonic_testbed.drivers import topology as topo
    if name.endswith(".json"):
        try:
            return Topology.from_dict(json.loads(pathlib.Path(name).read_text()))
        except (OSError, json.JSONDecodeError) as e:
            raise SwitchError(f"cannot read the topology file {name}: {e}") from None
    m = re.fullmatch(r"(benes|clements|square|hexagonal)(\d+)", name)
    if m is None:
        raise SwitchError(f"a topology is named KIND+SIZE (benes16, clements8) or is a .json "
                          f"file, not {name!r}")
    return topo.build(m.group(1), int(m.group(2)))


def open_chip(address: str, *, topology: str, calibration: str = "", **dac_options) -> Mesh:
    """The chip as one device: a Mesh that owns the heater DAC at `address` (the bus's `chip`
    kind constructs it from the rig file's [chip] section)."""
    from photonic_testbed.drivers.heater_dac import HeaterDAC
    topo = topology_named(topology)
    dac = HeaterDAC(address, **dac_options)
    dac.open()
    try:
        return Mesh(topo, dac, calibration or None, own_dac=True)
    except Exception:
        dac.close()
        raise
