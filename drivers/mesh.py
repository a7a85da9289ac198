"""The mesh driver: circuits on a programmable photonic chip, as heater voltages.

`Mesh` joins a chip topology, a calibration (heater voltage <-> phase) and the heater DAC
driver, and is a `CircuitSwitch`: `apply(circuits)` routes the circuits (Benes looping, the
Clements decomposition, or paths along the waveguides of a square or hexagonal mesh), turns cell
phases into voltages and sends only the heaters that change, merged into as few serial lines as
the DAC driver can. `Mesh.load_calibration` swaps the calibration while the chip carries
circuits (re-deriving their heater settings).

The topology and the calibration are the chip's shared model (`common.topology`,
`common.calibration`, re-exported here); this module adds what touches files and devices:
`read_topology` (a name or a JSON file), `read_calibration` and `write_calibration` (atomic).
"""
from __future__ import annotations

import logging
import math
import os
import pathlib
import time
from collections.abc import Mapping, Sequence

import numpy as np

from photonic_testbed.common.calibration import (  # noqa: F401
    MAX_FILE_BYTES,
    Calibration,
    CalibrationError,
    CalibrationFileError,
    HeaterCalibration,
)
from photonic_testbed.common.topology import (
    Topology,
    TopologyError,
    topology_from_json,
    topology_named,
)
from photonic_testbed.drivers.circuit_switch import (
    ApplyReport,
    Circuits,
    CircuitSwitch,
    SwitchError,
)
from photonic_testbed.drivers.routing import (
    BAR,
    CROSS,
    RoutingError,
    benes_cell_states,
    circuits_to_permutation,
    clements_decompose,
    mzi,
    permutation_matrix,
    route_waveguides,
    trace_states,
    trace_waveguides,
)

log = logging.getLogger(__name__)

STATE_TOLERANCE_RAD = 0.05       # a cell read back within this of pi / 0 is bar / cross
# Circuit sets (and heater vectors) whose worked-out heater voltages (cell states) are kept,
# for the calibration in use: a job's phases come back round after round.
KEPT = 64


def read_topology(spec: str | os.PathLike) -> Topology:
    """A chip topology from its name ("benes16", "hexagonal4x4") or a JSON file of its
    description (a path ending in .json). Raises TopologyError."""
    spec = os.fspath(spec)
    if not spec.endswith(".json"):
        return topology_named(spec)
    try:
        data = pathlib.Path(spec).read_bytes()
    except OSError as e:
        raise TopologyError(f"cannot read the topology file {spec}: {e.strerror or e}") from None
    return topology_from_json(data, spec)


def read_calibration(path: str | os.PathLike) -> Calibration:
    """A calibration file: exactly the values written, or CalibrationFileError naming the file
    and what is wrong (common.calibration). Version 1 and 2 files load with a warning."""
    path = pathlib.Path(path)
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_FILE_BYTES + 1)
    except OSError as e:
        raise CalibrationFileError(f"cannot read calibration {path}: {e.strerror or e}") from None
    return Calibration.parse(data, str(path))


def write_calibration(calibration: Calibration, path: str | os.PathLike) -> None:
    """Write the file atomically: a temp file beside it, flushed, then renamed over it."""
    path = pathlib.Path(path)
    text = calibration.dumps()
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


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

    def __init__(self, topology: Topology | str, dac, calibration: Calibration | str |
                 os.PathLike | None = None, *, name: str | None = None, own_dac: bool = True,
                 chip_id: str = ""):
        if not isinstance(topology, Topology):
            topology = read_topology(topology)       # "benes16", or a JSON file
        if topology.recirculating and not topology.joins:
            raise SwitchError(f"{topology.name}: a recirculating mesh needs its waveguide "
                              "joins (Topology.joins) to be driven")
        self.topology = topology
        self.dac = dac
        self.name = name or topology.name
        self.chip_id = chip_id
        self._own_dac = own_dac
        self._channels = [ch for c in topology.cells for ch in c.channels]
        if calibration is None:
            calibration = Calibration.ideal(self._channels, topology.name)
        self.calibration = self._fitting(calibration)
        if dac.channels < topology.channels:
            raise SwitchError(f"{topology.name} needs {topology.channels} heater channels; "
                              f"the DAC has {dac.channels}")
        self._active: Circuits | None = None
        self.lines_sent = 0
        self._kept_for: Calibration | None = None
        self._kept: dict[str, dict] = {}

    def _fitting(self, calibration: Calibration | str | os.PathLike) -> Calibration:
        """The calibration (read from its file when a path), checked against this chip."""
        if not isinstance(calibration, Calibration):
            calibration = read_calibration(calibration)
        calibration.check_chip(self.topology.name, self.chip_id)
        missing = set(self._channels) - set(calibration.heaters)
        if missing:
            raise CalibrationError(f"calibration {calibration.source} lacks heater channels "
                                   f"{sorted(missing)[:8]}")
        return calibration

    def load_calibration(self, calibration: Calibration | str | os.PathLike) -> int:
        """Drive the chip with another calibration from now on (a file or a Calibration). The
        circuits `apply` made stay made: their heater settings are derived again with the new
        calibration and the heaters that change are sent. Without circuits applied the heaters
        are left as they are (their phases are read with the new calibration). Returns the
        number of heaters changed. A calibration for another chip, one lacking heaters, or one
        that cannot reach the circuits' phases is refused before anything changes."""
        calibration = self._fitting(calibration)
        changed: dict[int, float] = {}
        if self._active is not None:
            volts = calibration.voltages(self.heater_phases(self.cell_phases(self._active)))
            commanded = self.dac.commanded
            changed = {ch: v for ch, v in volts.items() if abs(commanded[ch] - v) > 1e-4}
        if changed:
            self.lines_sent += self.dac.set_voltages(changed)
        previous, self.calibration = self.calibration.source, calibration
        log.info("%s: calibration %s replaces %s; %d heaters changed", self.name,
                 calibration.source, previous, len(changed))
        return len(changed)

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

    def _keep(self, table: str, key, work):
        """`work()`, kept under `key` while the calibration stays the one in use (at most
        KEPT keys a table, the oldest dropped first)."""
        if self._kept_for is not self.calibration:
            self._kept_for, self._kept = self.calibration, {}
        kept = self._kept.setdefault(table, {})
        got = kept.get(key)
        if got is None:
            got = kept[key] = work()
            if len(kept) > KEPT:
                del kept[next(iter(kept))]
        return got

    def heater_settings(self, circuits: Circuits) -> dict[int, float]:
        """{channel: volts} making these (checked) circuits with the calibration in use:
        routed and solved once per circuit set, then kept (read only)."""
        def work():
            try:
                cells = self.cell_phases(circuits)
            except RoutingError as e:
                raise SwitchError(f"{self.name}: {e}") from e
            return self.calibration.voltages(self.heater_phases(cells))
        return self._keep("volts", tuple(sorted(circuits.items())), work)

    def apply(self, circuits: Mapping[int, int]) -> ApplyReport:
        t0 = time.perf_counter()
        circuits = self.check(circuits)
        volts = self.heater_settings(circuits)
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
        mine = tuple(volts[ch] for ch in self._channels)

        def work():
            phases = self.calibration.phases(dict(zip(self._channels, mine, strict=True)))
            out = {}
            for c in self.topology.cells:
                theta = phases[c.channels[0]]
                phi = phases[c.channels[1]] if len(c.channels) > 1 else 0.0
                out[c.id] = {"state": classify(theta), "theta": theta, "phi": phi}
            return out
        return {cid: dict(s) for cid, s in self._keep("cells", mine, work).items()}

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


def open_chip(address: str, *, topology: str, calibration: str = "", **dac_options) -> Mesh:
    """The chip as one device: a Mesh that owns the heater DAC at `address` (the bus's `chip`
    kind constructs it from the rig file's [chip] section)."""
    from photonic_testbed.drivers.heater_dac import HeaterDAC
    topo = read_topology(topology)
    dac = HeaterDAC(address, **dac_options)
    dac.open()
    try:
        return Mesh(topo, dac, calibration or None, own_dac=True)
    except Exception:
        dac.close()
        raise
