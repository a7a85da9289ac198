"""The programmable photonic chip, emulated: 2 x 2 MZI cells set by heaters, light as fields.

The chip is built from a chip-topology description (the dict that common.topology's
`Topology.describe` gives; the rig passes it in) and listens to the emulated DAC board:
`set_voltage(ch, volts)` is the board's `on_output` callback. Light is injected at input
ports (`set_inputs`), and read at the outputs (`transfer`, `output_power_mw`, the 1 % monitor
taps `tap_power_mw`) and at the monitor photodiode of each cell (`monitor_current_ua`).

A cell, with its hidden truth: coupler of power ratio r1 (bar fraction), the internal phase
theta on the top arm, coupler r2, and (Clements cells) the external phase phi on the top input:

    T = sqrt(loss) * B(r2) diag(e^{i theta}, 1) B(r1) diag(e^{i phi}, 1),
    B(r) = [[sqrt(r), i sqrt(1 - r)], [i sqrt(1 - r), sqrt(r)]]

so theta = pi is bar and theta = 0 is cross, whatever r1 and r2 (they bound the extinction).
Each heater h: phase = offset_h + pi / P_pi_h * (P_h + sum_j k_hj P_j), P = V^2 / R, with the
heater's own power lagging its command with a first-order time constant of a few us.

Sources at different inputs are independent lasers (mutually incoherent): output powers add.
`fields()` gives the coherent transfer matrix for anyone who needs phases. Only tests and the
control endpoint may read `truth()` and `oracle_voltages()`.
"""
from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace

import numpy as np

log = logging.getLogger(__name__)

NOMINAL_P_PI_MW = 22.5        # ideal chip: the middle of the 20-25 mW spread (Harris 2014: 24.8)
NOMINAL_R_OHM = 1000.0        # ideal heater resistance
OUTPUT_TAP = 0.01             # fraction of each output's light sent to its monitor tap
MONITOR_TAP = 0.01            # fraction of a cell's bottom output arm sent to its photodiode
RESPONSIVITY_A_PER_W = 1.0    # monitor photodiode
TAP_NOISE_FLOOR_MW = 1e-7     # detector noise floor (-70 dBm), standard deviation
TAP_RELATIVE_NOISE = 1e-3
DARK_CURRENT_UA = 1e-3
MAX_VOLTS = 12.0
SETTLED_TAUS = 30.0           # a heater this many time constants after a change has settled


class ChipError(ValueError):
    """The chip cannot be built from this description, or a request to it is malformed."""


@dataclass(frozen=True)
class ChipTruth:
    """The hidden parameters of one chip (per cell and per heater channel)."""
    cells: tuple[str, ...]
    couplers: np.ndarray          # (cells, 2): bar power ratio of the first and second coupler
    loss_db: np.ndarray           # (cells,)
    channels: tuple[int, ...]     # heater channel numbers, in the order of the arrays below
    offset_rad: np.ndarray        # (heaters,)
    p_pi_mw: np.ndarray           # (heaters,)
    resistance_ohm: np.ndarray    # (heaters,)
    crosstalk: np.ndarray         # (heaters, heaters): k_hj, zero diagonal
    tau_s: np.ndarray             # (heaters,)


FADE_STEP_DB = 0.01           # a fading waveguide's loss, as the light is worked out again
MAX_FADE_DB = 60.0


@dataclass(frozen=True)
class Fade:
    """A waveguide segment losing light: `db_per_s` more every second from `since` up to
    `max_db` (a fade: a contaminated or cracked cladding, a bend relaxing), or, with
    `period_s`, `max_db` lost for a period and nothing the next, starting lossy (a flap)."""
    cell: str
    arm: int
    since: float
    max_db: float
    db_per_s: float = 0.0
    period_s: float = 0.0

    def loss_db(self, now: float) -> float:
        t = max(0.0, now - self.since)
        if self.period_s > 0:
            return self.max_db if int(t // self.period_s) % 2 == 0 else 0.0
        if self.db_per_s <= 0:
            return self.max_db
        return min(self.max_db, self.db_per_s * t)


class EmulatedChip:
    """A feed-forward mesh of MZI cells (Benes, Clements) with seeded imperfections."""

    _truth: ChipTruth

    def __init__(self, topology: Mapping, *, seed: int = 0, ideal: bool = False,
                 resistances: Sequence[float] | None = None, monitors: bool = True,
                 ideal_loss_db: float = 0.0, noise: bool | None = None,
                 clock: Callable[[], float] = time.monotonic, crosstalk_scale: float = 1.0):
        self.topology = dict(topology)
        self.ideal = ideal
        self.monitors = monitors
        self.noise = (not ideal) if noise is None else noise
        self._clock = clock
        self._lock = threading.Lock()
        self._build_graph(self.topology)
        if not 0.0 <= crosstalk_scale <= 10.0:
            raise ChipError(f"crosstalk_scale must be in 0..10, not {crosstalk_scale!r}")
        self._truth: ChipTruth = self._draw_truth(seed, ideal, resistances, ideal_loss_db)
        if crosstalk_scale != 1.0:     # a chip with stronger (or weaker) thermal crosstalk
            self.truth_ = replace(self.truth_, crosstalk=self.truth_.crosstalk * crosstalk_scale)
        self._rng = np.random.default_rng([seed, 0xC41B])
        h = len(self.channels)
        self._p_target = np.zeros(h)
        self._p_start = np.zeros(h)
        self._t_start = np.zeros(h)
        self._volts = np.zeros(h)
        self._inputs = np.zeros(self.ports)
        self._lit = 0                     # bumped when the inputs change
        self._mix = np.eye(h) + self.truth_.crosstalk
        # The light is worked out again only when something changed (a heater, the inputs)
        # or a heater is still warming up: a read of one port costs a lookup, not the chip.
        self._version = 0
        self._settled_at = 0.0            # when the last heater change has settled (clock)
        self._cache: tuple[int, bool, np.ndarray, tuple] | None = None
        self._fades: dict[int, Fade] = {}     # signal (a cell's output arm) -> its fade

    # ---- building ------------------------------------------------------------------------

    def _read_cells(self, cells, max_heaters: int) -> dict[str, int]:
        """Cell ids, drawing positions and the heater channels of each cell (internal phase
        first, then external); returns cell id -> index."""
        self.cell_ids = tuple(str(c["id"]) for c in cells)
        index = {cid: k for k, cid in enumerate(self.cell_ids)}
        if len(index) != len(cells):
            raise ChipError("a cell id appears twice in the topology")
        self._x = np.array([float(c["x"]) for c in cells])
        self._y = np.array([float(c["y"]) for c in cells])
        channels, cell_of, role = [], [], []
        for k, c in enumerate(cells):
            chs = [int(ch) for ch in c["channels"]]
            if not 1 <= len(chs) <= max_heaters:
                raise ChipError(f"cell {c['id']} has {len(chs)} heater channels "
                                f"(1{' or 2' if max_heaters == 2 else ''} on a {self.kind} chip)")
            for j, ch in enumerate(chs):
                channels.append(ch)
                cell_of.append(k)
                role.append(j)        # 0 internal theta, 1 external phi
        if len(set(channels)) != len(channels):
            raise ChipError("a heater channel drives two phase shifters")
        self.channels = tuple(channels)
        self._chan_index = {ch: i for i, ch in enumerate(channels)}
        self._heater_cell = np.array(cell_of)
        self._heater_role = np.array(role)
        return index

    def _build_graph(self, d: Mapping) -> None:
        try:
            kind, n, cells, links = d["kind"], int(d["ports"]), d["cells"], d["links"]
        except (KeyError, TypeError, ValueError) as e:
            raise ChipError(f"not a chip topology description (missing {e})") from None
        if kind not in ("benes", "clements"):
            raise ChipError(f"EmulatedChip models feed-forward meshes (benes, clements), not "
                            f"{kind!r}; square and hexagonal meshes are "
                            f"emulator.mesh_chip.RecirculatingChip")
        self.kind, self.ports = kind, n
        index = self._read_cells(cells, max_heaters=2)
        c = len(cells)
        # Signal numbering: input port p -> p - 1; cell k output arm 2 -> n + 2k, arm 3 -> n+2k+1.
        src = np.full((c, 2), -1)
        out_src = np.full(n, -1)

        def signal(end) -> int:
            if end[0] == "port":
                p = int(end[1])
                if not 1 <= p <= n:
                    raise ChipError(f"link from port {p}: inputs are 1..{n}")
                return p - 1
            if end[0] == "cell" and int(end[2]) in (2, 3) and end[1] in index:
                return n + 2 * index[end[1]] + int(end[2]) - 2
            raise ChipError(f"a link starts at {list(end)}: not an input port or a cell output")

        for link in links:
            a, b = link["from"], link["to"]
            s = signal(a)
            if b[0] == "port":
                p = int(b[1])
                if not n < p <= 2 * n:
                    raise ChipError(f"link to port {p}: outputs are {n + 1}..{2 * n}")
                out_src[p - n - 1] = s
            elif b[0] == "cell" and b[1] in index and int(b[2]) in (0, 1):
                src[index[b[1]], int(b[2])] = s
            else:
                raise ChipError(f"a link ends at {list(b)}: not an output port or a cell input")
        if (src < 0).any() or (out_src < 0).any():
            raise ChipError("the topology leaves a cell input or an output port unconnected")
        # Stages in x order; every cell must hear only ports or cells of earlier stages.
        xs = sorted(set(self._x.tolist()))
        self._stages = [np.flatnonzero(self._x == x) for x in xs]
        done = np.zeros(n + 2 * c, dtype=bool)
        done[:n] = True
        for stage in self._stages:
            if not done[src[stage]].all():
                raise ChipError("the topology is not feed-forward in x: the emulator models "
                                "Benes and Clements meshes")
            done[n + 2 * stage] = done[n + 2 * stage + 1] = True
        self._src, self._out_src = src, out_src

    def _draw_truth(self, seed: int, ideal: bool, resistances, ideal_loss_db: float) -> ChipTruth:
        c, h = len(self.cell_ids), len(self.channels)
        if resistances is not None:
            r = np.asarray(resistances, dtype=float)
            if len(r) <= max(self.channels):
                raise ChipError(f"{len(r)} heater resistances for channels up to "
                                f"{max(self.channels)}")
            r = r[list(self.channels)]
        else:
            r = np.full(h, NOMINAL_R_OHM)
        rng = np.random.default_rng([seed, 0xC41])
        if ideal:
            return ChipTruth(self.cell_ids, np.full((c, 2), 0.5), np.full(c, ideal_loss_db),
                             self.channels, np.zeros(h), np.full(h, NOMINAL_P_PI_MW), r,
                             np.zeros((h, h)), np.full(h, 3e-6))
        couplers = np.clip(0.5 + rng.normal(0.0, 0.02, (c, 2)), 0.0, 1.0)
        offset = rng.uniform(0.0, 2 * math.pi, h)
        p_pi = rng.uniform(20.0, 25.0, h)
        loss = rng.uniform(0.1, 0.3, c)
        tau = rng.uniform(2e-6, 5e-6, h)
        # Heater positions: internal at the cell, external a little to its left.
        hx = self._x[self._heater_cell] - 0.35 * self._heater_role
        hy = self._y[self._heater_cell]
        dist = np.hypot(hx[:, None] - hx[None, :], hy[:, None] - hy[None, :])
        k = 0.03 * rng.uniform(0.7, 1.3, (h, h)) / np.maximum(dist, 0.35) ** 2
        k[(dist > 2.5) | (dist == 0)] = 0.0
        np.fill_diagonal(k, 0.0)
        return ChipTruth(self.cell_ids, couplers, loss, self.channels, offset, p_pi, r, k, tau)

    @classmethod
    def from_calibration(cls, topology: Mapping, calibration, *, seed: int = 0,
                         **kwargs) -> EmulatedChip:
        """A digital twin: the chip whose hidden truth is a measured calibration's (a
        `common.calibration.Calibration`, see `truth_from_calibration`); `crosstalk_scale`
        scales the file's crosstalk (what if it were twice as strong)."""
        scale = kwargs.pop("crosstalk_scale", 1.0)
        chip = cls(topology, seed=seed, **kwargs)
        truth = chip.truth_from_calibration(calibration, seed)
        chip.truth_ = replace(truth, crosstalk=truth.crosstalk * scale)
        return chip

    def truth_from_calibration(self, calibration, seed: int = 0) -> ChipTruth:
        """This chip's hidden truth taken from a measured calibration: each heater's offset,
        P_pi and resistance, the crosstalk matrix (zero where the file has none), and each
        cell's couplers from its bar and cross extinctions. An extinction fixes |r1 - r2|
        and |r1 + r2 - 1| (docs/calibration.md, step 7), not their signs: those, a cell's
        missing extinction, the losses and the thermal lags come from `seed`."""
        heaters = calibration.heaters
        missing = [ch for ch in self.channels if ch not in heaters]
        extra = sorted(set(heaters) - set(self.channels))
        if missing or extra:
            raise ChipError(f"the calibration's heaters ({len(heaters)}) are not this chip's "
                            f"({len(self.channels)}): " + (f"no channel {missing[:5]}"
                                                          if missing else
                                                          f"channels {extra[:5]} are not on it"))
        drawn = self._draw_truth(seed, False, None, 0.0)
        hs = [heaters[ch] for ch in self.channels]
        k = np.zeros((len(self.channels), len(self.channels)))
        if calibration.crosstalk is not None:
            at = [sorted(heaters).index(ch) for ch in self.channels]
            k = np.asarray(calibration.crosstalk, dtype=float)[np.ix_(at, at)].copy()
            np.fill_diagonal(k, 0.0)
        else:
            log.warning("the calibration has no crosstalk: the twin has none")
        rng = np.random.default_rng([seed, 0x7F1])
        couplers = drawn.couplers.copy()
        for i, cid in enumerate(self.cell_ids):
            record = calibration.cells.get(cid, {})
            bar, cross = record.get("extinction_db"), record.get("cross_extinction_db")
            signs = rng.choice([-1.0, 1.0], 2)
            if bar is None and cross is None:
                continue
            r1, r2 = drawn.couplers[i]
            # couplers' power odds x = r / (1 - r): x1 / x2 = rho_bar^(+-2), x1 x2 =
            # rho_cross^(+-2), rho = (1 + q) / (1 - q), q = 10^(-dB / 20)
            rho_b = _odds_ratio(bar) if bar is not None else \
                math.sqrt(r1 * (1 - r2) / (r2 * (1 - r1)))
            rho_c = _odds_ratio(cross) if cross is not None else \
                math.sqrt(r1 * r2 / ((1 - r1) * (1 - r2)))
            x1 = rho_b ** signs[0] * rho_c ** signs[1]
            x2 = rho_c ** signs[1] / rho_b ** signs[0]
            couplers[i] = (x1 / (1 + x1), x2 / (1 + x2))
        return replace(drawn, couplers=couplers,
                       offset_rad=np.mod([h.offset_rad for h in hs], 2 * math.pi),
                       p_pi_mw=np.array([h.p_pi_mw for h in hs], dtype=float),
                       resistance_ohm=np.array([h.r_ohm for h in hs], dtype=float),
                       crosstalk=k)

    # ---- the heaters (the DAC board's on_output callback) ----------------------------------

    def set_resistances(self, resistances: Sequence[float]) -> None:
        """The heaters are the DAC board's loads: take their resistances (ohm, per board
        channel) from the board so both agree on P = V^2 / R."""
        r = np.asarray(resistances, dtype=float)
        if len(r) <= max(self.channels):
            raise ChipError(f"{len(r)} heater resistances for channels up to "
                            f"{max(self.channels)}")
        with self._lock:
            self._truth = replace(self._truth, resistance_ohm=r[list(self.channels)])
            self._p_target = 1000.0 * self._volts ** 2 / self.truth_.resistance_ohm
            self._changed(self._clock(), float(self.truth_.tau_s.max()))

    def set_voltage(self, channel: int, volts: float) -> None:
        """A DAC output changed; channels with no heater on this chip are ignored."""
        i = self._chan_index.get(channel)
        if i is None:
            return
        volts = float(volts)
        with self._lock:
            now = self._clock()
            tau = float(self.truth_.tau_s[i])
            target, start = float(self._p_target[i]), float(self._p_start[i])
            decay = math.exp(-max(now - float(self._t_start[i]), 0.0) / tau)
            self._p_start[i] = target + (start - target) * decay
            self._t_start[i] = now
            self._volts[i] = volts
            self._p_target[i] = 1000.0 * volts * volts / float(self.truth_.resistance_ohm[i])
            self._changed(now, tau)

    def set_voltages(self, volts: Mapping[int, float]) -> None:
        """DAC outputs changed: each heater starts towards its new power from the power it
        has now (what it touches: the changed heaters, not the chip)."""
        pairs = [(self._chan_index[ch], float(v)) for ch, v in volts.items()
                 if ch in self._chan_index]
        if not pairs:
            return
        i = np.fromiter((k for k, _ in pairs), dtype=int, count=len(pairs))
        v = np.fromiter((x for _, x in pairs), dtype=float, count=len(pairs))
        with self._lock:
            now = self._clock()
            tau = self.truth_.tau_s[i]
            decay = np.exp(-np.maximum(now - self._t_start[i], 0.0) / tau)
            self._p_start[i] = self._p_target[i] + (self._p_start[i] - self._p_target[i]) * decay
            self._t_start[i] = now
            self._volts[i] = v
            self._p_target[i] = 1000.0 * v * v / self.truth_.resistance_ohm[i]
            self._changed(now, float(tau.max()))

    @property
    def truth_(self) -> ChipTruth:
        return self._truth

    @truth_.setter
    def truth_(self, truth: ChipTruth) -> None:
        """A new hidden truth (a test's drifted chip, a twin's): the light is worked out
        afresh, with the new crosstalk."""
        self._truth = truth
        if hasattr(self, "_version"):
            with self._lock:
                self._mix = np.eye(len(self.channels)) + truth.crosstalk
                self._changed(self._clock(), 0.0)

    def _changed(self, now: float, tau: float) -> None:
        """Something the light depends on changed (caller holds the lock)."""
        self._version += 1
        self._settled_at = max(self._settled_at, now + SETTLED_TAUS * tau)

    def _heater_power(self, now: float) -> np.ndarray:
        """Heater powers (mW) as the waveguides feel them now, after the thermal lag."""
        decay = np.exp(-np.maximum(now - self._t_start, 0.0) / self.truth_.tau_s)
        return self._p_target + (self._p_start - self._p_target) * decay

    def phases(self) -> np.ndarray:
        """The phase (rad) each heater channel imposes now, in `channels` order."""
        with self._lock:
            p = self._heater_power(self._clock())
        t = self.truth_
        return t.offset_rad + math.pi / t.p_pi_mw * (self._mix @ p)

    # ---- light ---------------------------------------------------------------------------

    def cell_matrices(self, phases: np.ndarray | None = None) -> np.ndarray:
        """(cells, 2, 2) field transfer matrices (row: output arm, column: input arm)."""
        ph = self.phases() if phases is None else phases
        c = len(self.cell_ids)
        theta, phi = np.zeros(c), np.zeros(c)
        internal = self._heater_role == 0
        theta[self._heater_cell[internal]] = ph[internal]
        phi[self._heater_cell[~internal]] = ph[~internal]
        return cell_matrix(theta, phi, self.truth_.couplers[:, 0], self.truth_.couplers[:, 1],
                           self.truth_.loss_db,
                           bottom_tap=MONITOR_TAP if self.monitors else 0.0)

    def _propagate(self) -> np.ndarray:
        """Fields on every signal for unit fields at each input: (signals, ports). Kept
        while nothing changes, every heater has settled and no fading waveguide's loss has
        moved by FADE_STEP_DB."""
        with self._lock:
            version, now = self._version, self._clock()
            faded = self._faded(now) if self._fades else ()
            cached = self._cache
            if cached is not None and cached[0] == version and cached[1] and \
                    cached[3] == faded:
                return cached[2]
            settled = now >= self._settled_at
        f = self._compute_fields(dict(faded))
        with self._lock:
            if self._version == version:
                self._cache = (version, settled, f, faded)
        return f

    def _faded(self, now: float) -> tuple[tuple[int, float], ...]:
        """(signal, loss dB) of every fading waveguide now, in steps of FADE_STEP_DB."""
        return tuple((sig, round(fd.loss_db(now) / FADE_STEP_DB) * FADE_STEP_DB)
                     for sig, fd in sorted(self._fades.items()))

    def _compute_fields(self, faded: Mapping[int, float]) -> np.ndarray:
        """`faded`: {signal: dB} lost on fading waveguides (dims what they carry onwards)."""
        t = self.cell_matrices()
        n = self.ports
        f = np.zeros((n + 2 * len(self.cell_ids), n), dtype=complex)
        f[:n] = np.eye(n)
        for stage in self._stages:
            e = f[self._src[stage]]                          # (k, 2, n)
            out = t[stage] @ e
            f[n + 2 * stage] = out[:, 0]
            f[n + 2 * stage + 1] = out[:, 1]
            for k in stage.tolist() if faded else ():
                for sig in (n + 2 * k, n + 2 * k + 1):
                    if sig in faded:
                        f[sig] *= 10 ** (-faded[sig] / 20)
        return f

    # ---- fading waveguides (faults the emulator injects) -----------------------------------

    def _signal(self, cell: str, arm: int) -> int:
        if self.kind not in ("benes", "clements"):
            raise ChipError(f"fading waveguides are modelled on feed-forward chips, not "
                            f"{self.kind!r} meshes")
        try:
            k = self.cell_ids.index(cell)
        except ValueError:
            raise ChipError(f"no cell {cell!r} on this chip") from None
        if arm not in (2, 3) or isinstance(arm, bool):
            raise ChipError(f"a waveguide leaves a cell by its output arm 2 or 3, not {arm!r}")
        return self.ports + 2 * k + arm - 2

    def fade(self, cell: str, arm: int, *, max_db: float, db_per_s: float = 0.0,
             period_s: float = 0.0) -> Fade:
        """The waveguide leaving `cell` by output `arm` starts losing light (`Fade`)."""
        for name, v, top in (("max_db", max_db, MAX_FADE_DB), ("db_per_s", db_per_s, 10.0),
                             ("period_s", period_s, 3600.0)):
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v <= top:
                raise ChipError(f"{name} must be a number in 0..{top:g}, not {v!r}")
        if not max_db > 0:
            raise ChipError("max_db must be above 0 dB: a fade loses some light")
        signal = self._signal(str(cell), arm)
        fd = Fade(str(cell), int(arm), self._clock(), float(max_db), float(db_per_s),
                  float(period_s))
        with self._lock:
            self._fades[signal] = fd
        log.info("chip: the waveguide out of %s arm %d fades (%s)", cell, arm, fd)
        return fd

    def clear_fades(self) -> None:
        with self._lock:
            self._fades.clear()

    def fades(self) -> list[dict]:
        """Every fading waveguide: its fade and the light it loses now (dB)."""
        now = self._clock()
        with self._lock:
            fades = list(self._fades.values())
        return [{**{k: getattr(fd, k) for k in ("cell", "arm", "max_db", "db_per_s",
                                                 "period_s")},
                 "age_s": round(now - fd.since, 3), "loss_db": round(fd.loss_db(now), 3)}
                for fd in fades]

    def path(self, port: int) -> list[tuple[str, int]]:
        """The waveguides input `port`'s light leaves its cells by: (cell, arm), at each cell
        the output arm its input arm sends the more power to, as the heaters set the cell now
        (not the light itself: a waveguide that fades does not move the path)."""
        if self.kind not in ("benes", "clements"):
            raise ChipError(f"a path through a {self.kind!r} mesh is not traced here")
        if not 1 <= int(port) <= self.ports:
            raise ChipError(f"inputs are ports 1..{self.ports}, not {port}")
        t = np.abs(self.cell_matrices()) ** 2                  # (cells, out arm, in arm)
        into = {int(s): (k, a) for k, arms in enumerate(self._src.tolist())
                for a, s in enumerate(arms)}                   # signal -> (cell, input arm)
        n, out, sig = self.ports, [], int(port) - 1
        while sig in into:
            k, a = into[sig]
            arm = 0 if t[k, 0, a] >= t[k, 1, a] else 1
            out.append((self.cell_ids[k], 2 + arm))
            sig = n + 2 * k + arm
        return out

    def fields(self) -> np.ndarray:
        """Coherent transfer matrix (outputs x inputs) up to the output taps."""
        return self._propagate()[self._out_src]

    def _check_inputs(self, inputs_mw: Mapping[int, float]) -> np.ndarray:
        p = np.zeros(self.ports)
        for port, mw in inputs_mw.items():
            if not 1 <= int(port) <= self.ports:
                raise ChipError(f"light can enter at input ports 1..{self.ports}, not {port}")
            mw = float(mw)
            if not mw >= 0.0 or math.isinf(mw):
                raise ChipError(f"input power must be a finite number >= 0 mW, not {mw!r}")
            p[int(port) - 1] += mw
        return p

    def transfer(self, inputs_mw: Mapping[int, float]) -> dict[int, float]:
        """mW at each output port (N+1..2N, after its 1 % tap) for mW at inputs (1..N)."""
        p = self._check_inputs(inputs_mw)
        power = np.abs(self.fields()) ** 2 @ p * (1.0 - OUTPUT_TAP)
        return {self.ports + 1 + o: float(x) for o, x in enumerate(power)}

    # The light sources wired to the chip (the laser through its input selector, transceivers).
    def set_inputs(self, inputs_mw: Mapping[int, float]) -> None:
        p = self._check_inputs(inputs_mw)
        with self._lock:
            if not np.array_equal(p, self._inputs):
                self._inputs = p
                self._lit += 1

    def inject(self, port: int, mw: float) -> None:
        """Light one more input (others stay as they are); 0 mW darkens it."""
        p = self._check_inputs({port: mw})
        with self._lock:
            if self._inputs[int(port) - 1] != p[int(port) - 1]:
                self._inputs[int(port) - 1] = p[int(port) - 1]
                self._lit += 1

    @property
    def light_version(self) -> tuple:
        """Changes whenever what the chip's light depends on changes (a heater, the truth, the
        inputs, a fading waveguide): a reading kept under one version is still what the chip
        would give."""
        with self._lock:
            faded = self._faded(self._clock()) if self._fades else ()
        return self._version, self._lit, faded

    @property
    def inputs(self) -> dict[int, float]:
        return {i + 1: float(x) for i, x in enumerate(self._inputs) if x > 0}

    def _check_output(self, port: int) -> int:
        if not self.ports < int(port) <= 2 * self.ports:
            raise ChipError(f"outputs are ports {self.ports + 1}..{2 * self.ports}, not {port}")
        return int(port)

    def output_power_mw(self, port: int) -> float:
        """Power leaving output `port` under the light now injected (mW)."""
        return self.transfer(self.inputs)[self._check_output(port)]

    def _noisy(self, x: float) -> float:
        if not self.noise:
            return x
        return max(0.0, x * (1 + TAP_RELATIVE_NOISE * self._rng.standard_normal())
                   + TAP_NOISE_FLOOR_MW * self._rng.standard_normal())

    def tap_power_mw(self, port: int) -> float:
        """What a power meter on output `port`'s 1 % monitor tap reads (mW, with noise)."""
        through = self.output_power_mw(port)
        return self._noisy(through / (1.0 - OUTPUT_TAP) * OUTPUT_TAP)

    def monitor_currents_ua(self) -> dict[str, float]:
        """Each cell's monitor photodiode (on its bottom output arm) current, uA."""
        if not self.monitors:
            raise ChipError("this chip has no cell monitor photodiodes")
        f = self._propagate()
        n = self.ports
        bottom = np.abs(f[n + 2 * np.arange(len(self.cell_ids)) + 1]) ** 2 @ self._inputs
        # The field after the cell already lost MONITOR_TAP to the photodiode.
        tapped = bottom / (1.0 - MONITOR_TAP) * MONITOR_TAP
        return {cid: self._noisy(float(mw)) * RESPONSIVITY_A_PER_W * 1000.0 + DARK_CURRENT_UA
                for cid, mw in zip(self.cell_ids, tapped, strict=True)}

    def monitor_current_ua(self, cell: str) -> float:
        currents = self.monitor_currents_ua()
        try:
            return currents[cell]
        except KeyError:
            raise ChipError(f"no cell {cell!r} on this chip") from None

    # ---- truth (tests and the control endpoint only) ----------------------------------------

    def truth(self) -> ChipTruth:
        t = self.truth_
        return replace(t, couplers=t.couplers.copy(), loss_db=t.loss_db.copy(),
                       offset_rad=t.offset_rad.copy(), p_pi_mw=t.p_pi_mw.copy(),
                       resistance_ohm=t.resistance_ohm.copy(), crosstalk=t.crosstalk.copy(),
                       tau_s=t.tau_s.copy())

    def oracle_voltages(self, cell_states: Mapping[str, object]) -> dict[int, float]:
        """Voltages that set the named cells exactly (true offsets, P_pi, R and crosstalk);
        other heaters keep their power. A state is "bar", "cross", a theta in rad, or a dict
        with "state" and/or "theta" and "phi"; phi defaults to 0. Returns {channel: volts}."""
        t = self.truth_
        target = {}
        index = {cid: k for k, cid in enumerate(self.cell_ids)}
        for cid, st in cell_states.items():
            if cid not in index:
                raise ChipError(f"no cell {cid!r} on this chip")
            theta, phi = _state_phases(cid, st)
            for i in np.flatnonzero(self._heater_cell == index[cid]):
                target[int(i)] = theta if self._heater_role[i] == 0 else phi
        sel = np.array(sorted(target), dtype=int)
        if not len(sel):
            return {}
        with self._lock:
            fixed = self._p_target.copy()
        fixed[sel] = 0.0
        a = self._mix[np.ix_(sel, sel)]
        rest = self._mix[sel] @ fixed
        delta = np.mod(np.array([target[i] for i in sel]) - t.offset_rad[sel], 2 * math.pi)
        for _ in range(8):
            p = np.linalg.solve(a, delta * t.p_pi_mw[sel] / math.pi - rest)
            if (p >= 0).all():
                break
            delta = delta + 2 * math.pi * (p < 0)
        else:
            raise ChipError("no non-negative heater powers reach these phases")
        volts = np.sqrt(p * t.resistance_ohm[sel] / 1000.0)
        if (volts > MAX_VOLTS).any():
            raise ChipError(f"setting these cells needs more than {MAX_VOLTS} V")
        return {self.channels[i]: float(v) for i, v in zip(sel, volts, strict=True)}


def _odds_ratio(extinction_db: float) -> float:
    """sqrt of a cell's odds ratio behind an extinction: (1 + q) / (1 - q), q = 10^(-dB/20);
    extinctions below 0.1 dB are taken as 0.1 dB (a cell that does not switch at all)."""
    q = 10.0 ** (-max(float(extinction_db), 0.1) / 20.0)
    return (1.0 + q) / (1.0 - q)


def _state_phases(cid: str, st) -> tuple[float, float]:
    named = {"bar": math.pi, "cross": 0.0}
    if isinstance(st, str):
        if st not in named:
            raise ChipError(f"cell {cid}: state {st!r} is not bar or cross")
        return named[st], 0.0
    if isinstance(st, Mapping):
        state = st.get("state")
        theta = st.get("theta", named.get(state) if isinstance(state, str) else None)
        if theta is None:
            raise ChipError(f"cell {cid}: give a state (bar/cross) or theta")
        return float(theta), float(st.get("phi", 0.0))
    if isinstance(st, (int, float)):
        return float(st), 0.0
    raise ChipError(f"cell {cid}: cannot read state {st!r}")


def cell_matrix(theta, phi, r1, r2, loss_db=0.0, bottom_tap: float = 0.0) -> np.ndarray:
    """Field transfer matrices of MZI cells, vectorised over cells: shape (..., 2, 2)."""
    theta, phi, r1, r2, loss_db = np.broadcast_arrays(*(np.asarray(v, dtype=float) for v in
                                                        (theta, phi, r1, r2, loss_db)))

    def coupler(r):
        m = np.empty(r.shape + (2, 2), dtype=complex)
        m[..., 0, 0] = m[..., 1, 1] = np.sqrt(r)
        m[..., 0, 1] = m[..., 1, 0] = 1j * np.sqrt(1.0 - r)
        return m

    b1, b2 = coupler(r1), coupler(r2)
    inner = b1.copy()
    inner[..., 0, :] *= np.exp(1j * theta)[..., None]
    t = b2 @ inner
    t[..., :, 0] *= np.exp(1j * phi)[..., None]
    t *= np.sqrt(10 ** (-loss_db / 10))[..., None, None]
    if bottom_tap:
        t[..., 1, :] *= math.sqrt(1.0 - bottom_tap)
    return t
