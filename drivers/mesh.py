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

What the chip was asked for is not in its heaters: a chip routes every input somewhere (the
inputs a request leaves out go to the outputs left over), so the circuits traced back from the
heater voltages are a full permutation, the asked circuits among them. `circuits()` reports
those asked; a mesh given a `memory` file keeps them there, so that a driver opened again (a
chip service killed and restarted) reports the same circuits and not every path the heaters
make. The memory is believed only while the heaters still make every circuit it names.
"""
from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import pathlib
import stat
import tempfile
import time
from collections.abc import Iterable, Mapping, Sequence

import numpy as np

from photonic_testbed.common import nesting
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
    Segment,
    avoiding,
    benes_cell_states,
    circuits_to_permutation,
    clements_decompose,
    mzi,
    permutation_matrix,
    route_waveguides,
    trace_path,
    trace_states,
    trace_waveguides,
)

log = logging.getLogger(__name__)

STATE_TOLERANCE_RAD = 0.05       # a cell read back within this of pi / 0 is bar / cross
# Circuit sets (and heater vectors) whose worked-out heater voltages (cell states) are kept,
# for the calibration in use: a job's phases come back round after round.
KEPT = 64
MAX_MEMORY_BYTES = 1 << 20       # a memory file bigger than this is not one of ours


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
                 chip_id: str = "", memory: str | os.PathLike | None = None):
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
        self.lines_sent = 0
        self._kept_for: Calibration | None = None
        self._kept: dict[str, dict] = {}
        # the circuits asked for (None: none since the driver opened, and no memory of any)
        self.memory = pathlib.Path(memory) if memory is not None else None
        self._memory_fd: int | None = None      # open from the first apply on
        # waveguides a circuit was moved off (`move`): every routing keeps the circuits asked
        # off them as far as it can, until `forget`; kept in the memory with the circuits
        self.avoid: frozenset[Segment] = frozenset()
        self._active: Circuits | None = self._recall()

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
            return {cid: (named[s], 0.0) for cid, s in self._benes_states(circuits).items()}
        return clements_decompose(permutation_matrix(perm)).cell_phases()

    def _benes_states(self, circuits: Mapping[int, int]) -> dict[str, str]:
        """The looping algorithm's cell states; with waveguides to avoid, the routing of the
        circuits (`drivers.routing.avoiding`) that crosses them least."""
        perm = circuits_to_permutation(circuits, self.ports)
        if not self.avoid:
            return benes_cell_states(perm)
        states, _, crossings = avoiding(self.topology, perm, circuits, self.avoid)
        if crossings:
            log.warning("%s: %d of the circuits' waveguides are ones they were moved off (no "
                        "routing of these %d circuits avoids them all)", self.name, crossings,
                        len(circuits))
        return states

    def move(self, inputs: Iterable[int], healthy: Iterable[int] = ()) -> dict:
        """Take the circuits of these inputs off every waveguide they cross now, but the one
        into their output port (one of them loses light), and keep every circuit off those
        waveguides from then on (`avoid`, until `forget`): the same circuits, made by other
        cells. `healthy`: inputs whose circuits carry their full light now: the waveguides
        they cross are cleared of suspicion (dropped from `avoid`), so that what is avoided
        narrows to where the loss can be. Refused (SwitchError, nothing changed) on a chip
        that is not a Benes network, for an input with no circuit asked, and when no routing
        found keeps every circuit asked off every waveguide avoided (with the used ports side
        by side every routing lights the same waveguides: the move would only hand the loss to
        another circuit). Returns what was avoided and the heater lines sent."""
        if self.topology.kind != "benes":
            raise SwitchError(f"{self.name}: circuits are moved off waveguides on a Benes chip, "
                              f"not a {self.topology.kind} one")
        active = dict(self._active or {})
        asked = sorted({int(i) for i in inputs})
        missing = [i for i in asked if i not in active]
        if not asked or missing:
            raise SwitchError(f"{self.name}: no circuit asked from input(s) "
                              f"{missing or asked} to move (circuits from inputs "
                              f"{sorted(active)})")
        fine = sorted({int(i) for i in healthy} & set(active) - set(asked))
        states = {cid: c["state"] for cid, c in self.cell_states().items()}
        try:
            paths = {i: trace_path(self.topology, states, i)[0] for i in asked + fine}
        except RoutingError as e:
            raise SwitchError(f"{self.name}: the cells make no path to move ({e})") from None
        off = {seg for i in asked for seg in paths[i][:-1]}
        cleared = {seg for i in fine for seg in paths[i]}
        before = self.avoid
        self.avoid = (before - cleared) | off
        try:
            new = self._benes_states(active)
            still = sorted(i for i in active
                           if not self.avoid.isdisjoint(trace_path(self.topology, new, i)[0]))
            if still:
                raise SwitchError(
                    f"{self.name}: no routing found of the {len(active)} circuits keeps them "
                    f"all off the {len(self.avoid)} waveguides avoided (input(s) {still} would "
                    "cross some): with the ports in use side by side every routing lights the "
                    "same waveguides (cable the GPUs to alternate ports); otherwise `forget` "
                    "what a repair has cleared")
            lines = self.lines_sent
            self.apply(active)
        except BaseException:
            self.avoid = before
            raise
        self._remember(active)
        log.info("%s: input(s) %s moved off %d waveguides (%d avoided in all, %d cleared)",
                 self.name, asked, len(off), len(self.avoid), len(before & cleared))
        return {"moved": asked, "off": sorted(off), "cleared": sorted(before & cleared),
                "avoid": sorted(self.avoid), "lines": self.lines_sent - lines}

    def forget(self) -> int:
        """Stop avoiding waveguides (they were repaired); the circuits stay where they are
        until the next change. Returns how many were avoided."""
        n, self.avoid = len(self.avoid), frozenset()
        if self._active is not None:
            self._remember(self._active)
        return n

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
        return self._keep("volts", (tuple(sorted(circuits.items())), self.avoid), work)

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
        if self._active != before or not before:
            self._remember(self._active)
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
        `apply` has run (in this driver, or in one before it with the same memory), only the
        circuits it was asked for are reported (every input of a chip goes somewhere); a
        circuit that is no longer made is missing."""
        made = self._made()
        if self._active is None:
            return made
        return {i: o for i, o in made.items() if i in self._active and self._active[i] == o}

    def _made(self) -> Circuits:
        """Every path the heaters make now, input to output (a full permutation on a
        feed-forward chip)."""
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
        return made

    # ---- what was asked, kept beyond this driver -------------------------------------------

    def _remember(self, circuits: Circuits) -> None:
        """Write the asked circuits to the memory file: one line, written over the one before
        in place, then the file cut to it (a reader takes the first line, so a process killed
        between the two leaves a whole line). In place, not a new file renamed over the old:
        ext4 writes a replaced file's blocks to the disk before the rename, a disk write on
        every apply; nor flushed, as the heaters do not outlive a power cut either. A memory
        that cannot be written is said, and the chip still switches."""
        if self.memory is None:
            return
        line = json.dumps({"chip": self.topology.name, "dac": self._dac_address(),
                           "circuits": sorted(circuits.items()),
                           "avoid": sorted(self.avoid)}).encode() + b"\n"
        try:
            if self._memory_fd is None:
                self._memory_fd = os.open(self.memory, os.O_RDWR | os.O_CREAT, 0o600)
            os.pwrite(self._memory_fd, line, 0)
            os.ftruncate(self._memory_fd, len(line))
        except OSError as e:
            log.warning("%s: the circuits asked for are not kept in %s (%s): a driver opened "
                        "after this one reports every path the heaters make", self.name,
                        self.memory, e.strerror or e)

    def _dac_address(self) -> str:
        """The heater board's address, as the memory names it (its board gone, a memory is
        forgotten: `forget_gone_boards`)."""
        port = getattr(self.dac, "port", "")
        return os.path.abspath(port) if isinstance(port, str) and port else ""

    def _recall(self) -> Circuits | None:
        """The circuits asked of this chip before this driver opened (the memory file), if the
        heaters still make every one of them; None otherwise (said why)."""
        path = self.memory
        if path is None:
            return None
        try:
            with open(path, "rb") as f:
                data = f.read(MAX_MEMORY_BYTES + 1)
        except FileNotFoundError:
            return None
        except OSError as e:
            log.warning("%s: cannot read the memory %s: %s", self.name, path, e.strerror or e)
            return None
        try:
            if len(data) > MAX_MEMORY_BYTES:
                raise ValueError(f"more than {MAX_MEMORY_BYTES} bytes")
            d = nesting.loads_json(data.split(b"\n", 1)[0], str(path))
            if not isinstance(d, dict) or d.get("chip") != self.topology.name:
                raise ValueError(f"not the memory of a {self.topology.name} chip")
            asked = self.check(d.get("circuits") or {})
        except (ValueError, TypeError, SwitchError) as e:
            log.warning("%s: the memory %s is not used: %s", self.name, path, e)
            return None
        made = self._made()
        lost = {i: o for i, o in asked.items() if made.get(i) != o}
        if lost:
            log.info("%s: the heaters no longer make %d of the %d circuits last asked for "
                     "(they were set since): every path they make is reported", self.name,
                     len(lost), len(asked))
            return None
        log.info("%s: %d circuits asked for before this driver opened, still made",
                 self.name, len(asked))
        try:
            self.avoid = frozenset(self._segment(x) for x in d.get("avoid") or ())
        except (ValueError, TypeError) as e:
            log.warning("%s: the waveguides to avoid in the memory %s are not used: %s",
                        self.name, path, e)
        return asked

    def _segment(self, x) -> Segment:
        """A waveguide as the memory names it: [cell id, output arm 2 | 3] of this chip."""
        if not (isinstance(x, list) and len(x) == 2 and isinstance(x[0], str)
                and x[1] in (2, 3) and not isinstance(x[1], bool)):
            raise ValueError(f"{x!r} is not a waveguide [cell, arm 2 | 3]")
        self.topology.cell(x[0])        # (TopologyError, a ValueError, for no such cell)
        return x[0], int(x[1])

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
        if self._memory_fd is not None:
            os.close(self._memory_fd)
            self._memory_fd = None
        if self._own_dac:
            self.dac.close()


def memory_folder() -> pathlib.Path | None:
    """This user's folder for what chips were asked ($XDG_RUNTIME_DIR/photonic-testbed, else
    ptb-UID in the temp folder), made mode 0700; None (said) where it is not this user's alone:
    another user could then make a chip report circuits it does not hold."""
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    folder = (pathlib.Path(runtime) / "photonic-testbed" if runtime
              else pathlib.Path(tempfile.gettempdir()) / f"ptb-{os.getuid()}")
    try:
        folder.mkdir(mode=0o700, exist_ok=True)
        st = folder.lstat()
    except OSError as e:
        log.warning("no folder for the chips' memories (%s): %s", folder, e.strerror or e)
        return None
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
        log.warning("%s is not a folder of this user's alone: the chips' memories are not "
                    "kept there", folder)
        return None
    return folder


def memory_path(address: str, topology: str) -> pathlib.Path | None:
    """The memory file of the chip whose heaters are on the board at `address`: one a board
    and topology, in `memory_folder()` (None where there is none). The memories of boards whose
    address is gone (an emulator's pty link, a board unplugged) are forgotten on the way."""
    folder = memory_folder()
    if folder is None:
        return None
    forget_gone_boards(folder)
    key = hashlib.sha256(f"{os.path.abspath(address)}\0{topology}".encode()).hexdigest()[:16]
    return folder / f"chip-{key}.json"


def forget_gone_boards(folder: pathlib.Path) -> None:
    """Remove the chips' memories in `folder` whose heater board's address no longer exists:
    nothing left to recall them for (a board plugged in again is driven afresh)."""
    for path in folder.glob("chip-*.json"):
        try:
            with open(path, "rb") as f:
                dac = nesting.loads_json(f.readline(MAX_MEMORY_BYTES), str(path)).get("dac")
        except (OSError, ValueError, AttributeError):
            continue                  # being written, or not ours to judge: left
        if isinstance(dac, str) and dac and not os.path.lexists(dac):
            path.unlink(missing_ok=True)


def open_chip(address: str, *, topology: str, calibration: str = "", memory: str = "",
              **dac_options) -> Mesh:
    """The chip as one device: a Mesh that owns the heater DAC at `address` (the bus's `chip`
    kind constructs it from the rig file's [chip] section). It keeps the circuits it is asked
    for in `memory` (default: `memory_path(address, topology)`), so that the chip service
    restarted reports what it reported before."""
    from photonic_testbed.drivers.heater_dac import HeaterDAC
    topo = read_topology(topology)
    dac = HeaterDAC(address, **dac_options)
    dac.open()
    try:
        return Mesh(topo, dac, calibration or None, own_dac=True,
                    memory=memory or memory_path(address, topo.name))
    except Exception:
        dac.close()
        raise
