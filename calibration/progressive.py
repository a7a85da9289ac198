"""Progressive calibration of a mesh with cell monitor photodiodes.

Written here for a feed-forward mesh (Benes); a recirculating (square, hexagonal) mesh is
calibrated the same way with its routes from `calibration.recirculating.MeshGraph` (light both
ways, loops: a route there also carries the cell's own light out of the chip).

Order: stage by stage from the inputs. A cell of stage s is reachable once every cell before it
is calibrated: the run traces a path back from one of the cell's input arms to a chip input,
sets the cells on it (already calibrated) to route the light there, lights that input through
the selector and sweeps the cell's heater. Light then enters the cell on one arm only, so the
photodiode on its bottom output arm follows

    y = mean + amp * cos(theta)            (light on the top arm; theta + pi on the bottom arm)

and the fitted fringe phase is the cell's internal phase theta (theta = 0 is cross). When the
light arrives from the bottom output arm of the cell before, that cell's photodiode reads the
light entering this one, and the run divides by it: drifts of the laser and the small changes
of the route while this heater warms its neighbours cancel.

The cells feeding the cell's other input arm are set so that this arm takes its light from
a dark chip input through them: the splitters' small leaks off the lit path then go elsewhere
and do not reach the second arm coherently, where they would shift the fringe. Phases measured
this way still contain the crosstalk of the route's heaters (their powers are recorded with each
sweep); `crosstalk.py` measures the coupling matrix and `finish()` removes it from the offsets.
"""
from __future__ import annotations

import logging
import math
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from photonic_testbed.calibration.fringe import FitError, adaptive_sweep
from photonic_testbed.calibration.station import Station, heater_volts
from photonic_testbed.common.topology import Topology

if TYPE_CHECKING:
    from photonic_testbed.calibration.recirculating import MeshGraph

log = logging.getLogger(__name__)

TWO_PI = 2.0 * math.pi
BAR, CROSS = "bar", "cross"
STATE_PHASE = {BAR: math.pi, CROSS: 0.0}
ROUTE_MARGIN_RAD = 0.8        # phase above zero power kept by heaters re-solved under load
# the adaptive sweep: 12 coarse points, then one round of 2 points either side of the fringe's
# maximum and minimum (16 readings); the refinements fix the offset and efficiency after it,
# and the extinctions are measured at the settings
SWEEP_FINE_ROUNDS = 1
SWEEP_FINE_OFFSETS_RAD = (-0.1, 0.1)


class CalibrationRunError(RuntimeError):
    """The calibration cannot go on (a cell shows no fringe, the topology is not supported)."""


class UnlitArm(CalibrationRunError):
    """The cell cannot be lit on this input arm, or on either (a recirculating mesh: the arm is
    at a free end, or no way in crosses calibrated cells only)."""


@dataclass(frozen=True)
class Route:
    port: int                     # chip input to light
    arm: int                      # the cell's input arm the light arrives on (0 top, 1 bottom)
    cells: dict[str, str]         # calibrated cells on the path -> bar / cross
    away: dict[str, str]          # the other feeder: sends its light away from the cell
    reference: str | None         # a cell whose photodiode reads the light entering this one


class Graph:
    """Where each cell's arms connect, from the topology's links."""

    def __init__(self, topology: Topology):
        if topology.recirculating:
            raise CalibrationRunError(f"{topology.name}: Graph is for feed-forward meshes "
                                      "(benes, clements); a recirculating one's routes are "
                                      "calibration.recirculating.MeshGraph's")
        self.topology = topology
        self.source: dict[tuple[str, int], tuple] = {}
        self.sink: dict[tuple[str, int], tuple] = {}
        for a, b in topology.links:
            if b[0] == "cell":
                self.source[(b[1], int(b[2]))] = tuple(a)
            if a[0] == "cell":
                self.sink[(a[1], int(a[2]))] = tuple(b)
        xs = sorted({c.x for c in topology.cells})
        self.stages = [[c.id for c in topology.cells if c.x == x] for x in xs]
        self.unreachable: list[str] = []
        self.retry_later = False       # a cell whose sweep fails stops the run

    def order(self) -> list[str]:
        """Cells in calibration order: stage by stage from the inputs."""
        return [c for stage in self.stages for c in stage]

    def needs(self, cell: str) -> set[str]:
        """The cells that must be calibrated before `cell` (its route's)."""
        route = self.route(cell)
        return set(route.cells) | set(route.away)

    @staticmethod
    def state_for(in_arm: int, out_arm: int) -> str:
        return BAR if (in_arm, out_arm) in ((0, 2), (1, 3)) else CROSS

    def route(self, cell: str, arm: int | None = None) -> Route:
        """A path of light from a chip input to one input arm of `cell` (`arm`, or the one
        preferred: fed from a bottom output arm, whose photodiode is the reference, then one
        fed straight from a chip input)."""
        sources = [self.source[(cell, a)] for a in (0, 1)]

        def rank(arm):
            s = sources[arm]
            return (0 if s[0] == "cell" and int(s[2]) == 3 else 1 if s[0] == "port" else 2, arm)
        if arm is None:
            arm = min((0, 1), key=rank)
        elif arm not in (0, 1):
            raise ValueError(f"a cell's input arm is 0 or 1, not {arm!r}")
        cells: dict[str, str] = {}
        src = sources[arm]
        reference = src[1] if src[0] == "cell" and int(src[2]) == 3 else None
        while src[0] == "cell":
            u, out = src[1], int(src[2])
            in_arm = 0                                  # either arm leads back to an input
            cells[u] = self.state_for(in_arm, out)
            src = self.source[(u, in_arm)]
        port = int(src[1])
        away: dict[str, str] = {}
        if not self._make_dark(sources[1 - arm], away, cells, port):
            log.debug("%s: no dark route to its second input arm", cell)
        return Route(port, arm, cells, away, reference)

    def _make_dark(self, src: tuple, assign: dict[str, str], path: dict[str, str],
                   lit: int, depth: int = 0) -> bool:
        """Set cells before `src` so that no light of the lit path (nor its first-order leaks)
        reaches signal `src`: each cell on the way takes its light from a dark input. Returns
        whether it could (assign holds the states chosen)."""
        if src[0] == "port":
            return int(src[1]) != lit
        x, out = src[1], int(src[2])
        if x in path or depth > 16:
            return False
        if x in assign:
            in_arm = (0, 1)[(assign[x] == BAR) == (out == 3)]
            return self._make_dark(self.source[(x, in_arm)], assign, path, lit, depth + 1)
        for in_arm in (0, 1):
            trial = dict(assign)
            trial[x] = self.state_for(in_arm, out)
            if self._make_dark(self.source[(x, in_arm)], trial, path, lit, depth + 1):
                assign.update(trial)
                return True
        assign[x] = self.state_for(0, out)
        return False


@dataclass
class CellFit:
    """One heater's fringe as measured (in the record) and fitted."""
    cell: str
    channel: int
    arm: int
    offset_apparent: float         # fitted theta at zero own power, with the route's crosstalk
    offset_std: float
    rad_per_mw: float
    rad_per_mw_std: float
    mean: float
    amplitude: float
    residual_rms: float
    background_mw: list[float]     # every heater's power during the sweep (own one set to 0)
    sweep_v: list[float]
    sweep_p_mw: list[float]
    readings: list[float]
    detector: str
    measurements: int

    @property
    def p_pi_mw(self) -> float:
        return math.pi / self.rad_per_mw

    @property
    def visibility(self) -> float:
        return self.amplitude / self.mean if self.mean > 0 else 0.0

    def to_dict(self) -> dict:
        return dict(self.__dict__)

    @classmethod
    def from_dict(cls, d: dict) -> CellFit:
        return cls(**d)


class Calibrator:
    """Runs the progressive sweep cell by cell; its `state` can be saved and resumed."""

    def __init__(self, station: Station, *, p_max_mw: float = 56.0,
                 p_pi_range_mw: tuple[float, float] = (12.0, 40.0),
                 state: dict | None = None,
                 on_progress: Callable[[str, int, int], None] | None = None,
                 on_checkpoint: Callable[[dict], None] | None = None):
        self.station = station
        self.p_max_mw = p_max_mw
        self.p_pi_range_mw = p_pi_range_mw
        self.sweep_fine_rounds = SWEEP_FINE_ROUNDS
        self.sweep_fine_offsets_rad: tuple[float, ...] = SWEEP_FINE_OFFSETS_RAD
        self.on_progress = on_progress or (lambda *a: None)
        self.on_checkpoint = on_checkpoint or (lambda s: None)
        self.state = state if state is not None else {}
        self.state.setdefault("fits", {})
        self.state.setdefault("crosstalk", {})
        self.graph: Graph | MeshGraph
        if station.topology.recirculating:
            # routes through the cells calibrated so far (calibration.recirculating)
            from photonic_testbed.calibration.recirculating import MeshGraph
            self.graph = MeshGraph(station.topology, known=lambda: self.state["fits"].keys())
        else:
            self.graph = Graph(station.topology)
        self.channels = station.channels
        if any(len(c.channels) != 1 for c in station.topology.cells):
            raise CalibrationRunError("the monitor-photodiode method calibrates one internal "
                                      "heater per cell (Benes); this chip has external phases")
        self.channel_of = {c.id: c.channels[0] for c in station.topology.cells}
        self.crosstalk: np.ndarray | None = None      # k[ch][ch'] once measured

    # ---- state ---------------------------------------------------------------------------

    @property
    def r_ohm(self) -> dict[int, float]:
        return {int(k): v for k, v in self.state["r_ohm"].items()}

    def fit(self, cell: str) -> CellFit:
        return CellFit.from_dict(self.state["fits"][cell])

    def coupling(self) -> np.ndarray:
        """The crosstalk matrix, for the steps that only run once it is measured."""
        if self.crosstalk is None:
            raise CalibrationRunError("the crosstalk is not measured yet")
        return self.crosstalk

    def fits(self) -> dict[str, CellFit]:
        return {c: CellFit.from_dict(d) for c, d in self.state["fits"].items()}

    # ---- heaters -------------------------------------------------------------------------

    def _powers(self) -> np.ndarray:
        """Every heater channel's power (mW), 0..the chip's highest (the crosstalk matrix's
        size; channels of the DAC beyond the chip drive nothing)."""
        v = self.station.commanded()
        r = self.r_ohm
        return np.array([1000.0 * v[ch] ** 2 / r[ch] if ch in r else 0.0
                         for ch in range(1 + max(self.channels))])

    def phase_of(self, cell: str, powers: np.ndarray) -> float:
        """The phase the current estimate predicts for `cell` under heater powers `powers`."""
        f = self.fit(cell)
        ch = f.channel
        if self.crosstalk is None:
            # background as during the sweep: only the own power moves
            return f.offset_apparent + f.rad_per_mw * powers[ch]
        offset = self.offsets()[cell]
        return offset + f.rad_per_mw * (powers[ch] + self.crosstalk[ch] @ powers)

    def settings(self, states: Mapping[str, str | float], keep_near: bool | set = False,
                 turns: dict[str, int] | None = None) -> dict[int, float]:
        """Heater volts that put calibrated cells in these states (bar, cross or a theta),
        every other heater keeping its power; crosstalk compensated once it is known.
        `keep_near` (True or a set of cells): those stay on the branch (mod 2 pi) nearest
        their present power; `turns` adds whole periods to a cell's power."""
        if not states:
            return {}
        extra_turns = turns or {}
        p_now = self._powers()
        chans = [self.channel_of[c] for c in states]
        want = np.array([STATE_PHASE[s] if isinstance(s, str) else float(s)
                         for s in states.values()])
        fits = [self.fit(c) for c in states]
        beta = np.array([f.rad_per_mw for f in fits])
        if self.crosstalk is None:
            off = np.array([f.offset_apparent for f in fits])
            p = (np.mod(want - off, TWO_PI)
                 + TWO_PI * np.array([extra_turns.get(c, 0) for c in states])) / beta
        else:
            offsets = self.offsets()
            off = np.array([offsets[c] for c in states])
            idx = np.array(chans)
            fixed = p_now.copy()
            fixed[idx] = 0.0
            mix = np.eye(len(idx)) + self.crosstalk[np.ix_(idx, idx)]
            rest = self.crosstalk[idx] @ fixed
            delta = np.mod(want - off - beta * rest, TWO_PI)
            if keep_near:
                # the branch (mod 2 pi) nearest each heater's present power: no jumps of a
                # whole period when a neighbour's heat moves the target across zero
                # (a heater near zero power may be asked slightly below it: it stays at zero,
                # a phase error of a few mrad, rather than jumping up a period)
                anchored = np.array([keep_near is True or c in keep_near for c in states])
                periods = np.round((beta * p_now[idx] - delta) / TWO_PI) * anchored
                delta = delta + TWO_PI * periods

            def solve(delta: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
                for _ in range(8):
                    p = np.linalg.solve(mix, delta / beta)
                    if keep_near:
                        p = np.where(anchored & (p < 0) & (beta * p > -0.05), 0.0, p)
                    if (p >= 0).all():
                        break
                    delta = delta + TWO_PI * (p < 0)
                return p, delta

            p, delta = solve(delta)
            if extra_turns:
                # whole periods above the solution found (the lowest non-negative one, or
                # the anchored branch), not above the target taken mod 2 pi
                p, delta = solve(delta + TWO_PI * np.array([extra_turns.get(c, 0)
                                                             for c in states]))
        r = self.r_ohm
        return {ch: heater_volts(float(max(x, 0.0)), r[ch]) for ch, x in zip(chans, p, strict=True)}

    def settings_with_margin(self, states: Mapping[str, str | float],
                             margin_rad: float = ROUTE_MARGIN_RAD) -> dict[int, float]:
        """As `settings` (crosstalk compensated), but every heater ends at least `margin_rad`
        of phase above zero power (a whole period higher where it would not): a neighbour's
        heat can then lower its power without pushing it below zero, so re-solving it while
        neighbours change keeps it on the same branch instead of jumping by a period (a
        jump moves tens of mW and heats every cell around)."""
        if self.crosstalk is None or not states:
            return self.settings(states)
        turns: dict[str, int] = {}
        volts = self.settings(states)
        r = self.r_ohm
        for _ in range(3):
            low = {c: turns.get(c, 0) + 1 for c in states
                   if self.fit(c).rad_per_mw * 1000.0 * volts[self.channel_of[c]] ** 2
                   / r[self.channel_of[c]] < margin_rad}
            if not low:
                break
            turns.update(low)
            volts = self.settings(states, turns=turns)
        return volts

    # ---- the run -------------------------------------------------------------------------

    def prepare(self) -> None:
        if "r_ohm" not in self.state:
            self.station.set_volts({ch: 0.0 for ch in self.channels})
            self.state["r_ohm"] = {str(k): v for k, v in
                                   self.station.measure_resistances().items()}
            self.on_checkpoint(self.state)
        if "dark_ua" not in self.state:
            # each photodiode's dark current, subtracted from its readings: near a fringe's
            # minimum it is a sizeable part of what the photodiode reads (about 1 nA against
            # some 5 uA at the maximum: a floor near 37 dB of extinction)
            dark = {}
            if self.station.selector is not None and self.station.monitors:
                dark = self.station.dark_currents_ua()
            self.state["dark_ua"] = dark
            self.on_checkpoint(self.state)

    def monitors(self) -> Mapping[str, float]:
        """Every cell's photocurrent (uA) less its dark current. Without dark currents the
        station's own mapping, which may read a cell only when asked (calibration.outputs)."""
        dark = self.state.get("dark_ua", {})
        readings = self.station.monitors_ua()
        if not dark:
            return readings
        return {cid: ua - dark.get(cid, 0.0) for cid, ua in readings.items()}

    def order(self, cells: list[str] | None = None) -> list[str]:
        """Cells in calibration order (the graph's: stage by stage on a feed-forward mesh); a
        subset keeps what it needs first."""
        flat = self.graph.order()
        if cells is None:
            if self.graph.unreachable:
                raise CalibrationRunError(
                    f"{self.station.topology.name}: cells {', '.join(self.graph.unreachable)} "
                    "cannot be lit on an input arm from any port through the waveguides: "
                    "their photodiodes never see a fringe")
            return flat
        need = set()
        for c in cells:
            if c not in self.channel_of:
                raise CalibrationRunError(f"no cell {c!r} on {self.station.topology.name}")
            need.add(c)
        changed = True
        while changed:
            changed = False
            for c in list(need):
                extra = self.graph.needs(c) - need
                if extra:
                    need |= extra
                    changed = True
        return [c for c in flat if c in need]

    def calibrate_cells(self, cells: list[str] | None = None) -> None:
        """Sweep the cells in order. On a recirculating mesh (`graph.retry_later`) a cell
        whose fringe cannot be fitted yet (light of its own comes back through cells not yet
        calibrated) waits and is swept again once the others are: the run stops only when
        every cell left fails in turn."""
        self.prepare()
        queue = deque(self.order(cells))
        total, done = len(queue), 0
        failed: list[CalibrationRunError] = []     # since the last cell swept
        while queue:
            cell = queue.popleft()
            if cell not in self.state["fits"]:
                try:
                    self.state["fits"][cell] = self.sweep_cell(cell).to_dict()
                except CalibrationRunError as e:
                    if not self.graph.retry_later:
                        raise
                    failed.append(e)
                    if len(failed) > len(queue):
                        # the first fringe that failed, rather than a cell that waited for it
                        raise next((f for f in failed if not isinstance(f, UnlitArm)),
                                   failed[0]) from None
                    log.info("%s: %s; swept again once more cells are calibrated", cell, e)
                    queue.append(cell)
                    continue
                self.on_checkpoint(self.state)
            failed.clear()
            done += 1
            self.on_progress(cell, done, total)

    def sweep_cell(self, cell: str) -> CellFit:
        st = self.station
        route = self.graph.route(cell)
        ch = self.channel_of[cell]
        # every heater off but the route's, set from what is known so far
        st.set_volts({c: 0.0 for c in self.channels})
        st.set_volts(self.settings({**route.cells, **route.away}))
        st.light(route.port)
        background = self._powers()
        background[ch] = 0.0
        r = self.r_ohm[ch]
        sweep_v: list[float] = []
        detector = "pd" if route.reference is None else f"pd/{route.reference}"

        def measure(p_mw: float) -> tuple[float, float]:
            v = heater_volts(min(max(p_mw, 0.0), self.p_max_mw * 1.2), r)
            st.set_volts({ch: v})
            v = float(st.commanded()[ch])
            pd = self.monitors()
            y = pd[cell]
            if route.reference is not None:
                ref = pd[route.reference]
                if ref <= 0:
                    raise CalibrationRunError(f"{cell}: no light on the reference "
                                              f"{route.reference}")
                y = y / ref
            sweep_v.append(v)
            return 1000.0 * v * v / r, y

        try:
            fit, sweep = adaptive_sweep(measure, self.p_max_mw, p_pi_range_mw=self.p_pi_range_mw,
                                        fine_rounds=self.sweep_fine_rounds,
                                        fine_offsets_rad=self.sweep_fine_offsets_rad)
        except FitError as e:
            raise CalibrationRunError(f"cell {cell} (heater {ch}, lit from input {route.port}): "
                                      f"{e}") from None
        st.set_volts({ch: 0.0})
        offset = (fit.offset - (math.pi if route.arm == 1 else 0.0)) % TWO_PI
        log.info("%s: offset %.4f +/- %.4f rad, P_pi %.3f mW, visibility %.4f (%d points)",
                 cell, offset, fit.offset_std, fit.p_pi_mw, fit.amplitude / max(fit.mean, 1e-30),
                 fit.points)
        return CellFit(cell, ch, route.arm, offset, fit.offset_std, fit.rad_per_mw,
                       fit.rad_per_mw_std, fit.mean, fit.amplitude, fit.residual_rms,
                       background.tolist(), sweep_v, sweep.p_mw, sweep.y, detector, fit.points)

    # ---- results -------------------------------------------------------------------------

    def offsets(self) -> dict[str, float]:
        """True offsets (rad, at zero power on every heater): the apparent ones less the
        crosstalk of the route's heaters during each sweep, once the matrix is known."""
        out = {}
        for cell, d in self.state["fits"].items():
            off = d["offset_apparent"]
            if self.crosstalk is not None:
                ch = d["channel"]
                off -= d["rad_per_mw"] * float(self.crosstalk[ch] @ np.asarray(d["background_mw"]))
            out[cell] = off % TWO_PI
        return out
