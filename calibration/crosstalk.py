"""Thermal crosstalk between heaters, measured on calibrated cells, and a refinement of the
offsets once the crosstalk is known.

Coupling k_ij: with cell i lit as for its sweep, its phase is read at quadrature (the fringe
phase set to pi/2 and 3 pi/2 by its own heater): with y = s (m + a cos(phi)), the two readings
give sin(shift) = (y2 - y1) / (y2 + y1) * m / a whatever the light s reaching the cell. Then
neighbour j is heated by exactly one period of its own (2 P_pi_j, so its own cell's state does
not change, even when j lies on the lit route) and the shift of i's phase divided by
beta_i * 2 P_pi_j is k_ij. Neighbours are the heaters within `radius` cells (x, y of the
topology), nearest and next-nearest at least.

Refinement: with the matrix known, each cell is lit again with its route set by the compensated
solve and its phase is measured by four-step phase shifting (fringe phases 0, pi/2, pi, 3 pi/2
as predicted: the error is atan2(y3 - y1, y0 - y2), independent of the light level); the
correction is added to the cell's offset.
"""
from __future__ import annotations

import logging
import math
from collections.abc import Callable

import numpy as np

from photonic_testbed.calibration.progressive import (
    TWO_PI,
    CalibrationRunError,
    Calibrator,
    UnlitArm,
)
from photonic_testbed.calibration.station import heater_volts

log = logging.getLogger(__name__)

BASE_REPEATS = 4      # baseline readings (pairs) before and after a row's neighbours, last pass


def neighbours(cal: Calibrator, radius: float) -> dict[int, list[int]]:
    """Heater channel -> the channels within `radius` cells of it."""
    pos = {}
    for c in cal.station.topology.cells:
        pos[c.channels[0]] = (c.x, c.y)
    out = {}
    for i, (xi, yi) in pos.items():
        out[i] = [j for j, (xj, yj) in pos.items()
                  if j != i and math.hypot(xi - xj, yi - yj) <= radius + 1e-9]
    return out


class _Probe:
    """Cell `cell` lit along its route, read at chosen fringe phases of its own heater."""

    def __init__(self, cal: Calibrator, cell: str, compensated: bool, arm: int | None = None):
        self.cal, self.cell = cal, cell
        st = cal.station
        self.route = cal.graph.route(cell, arm)
        self.fit = cal.fit(cell)
        self.ch = self.fit.channel
        st.set_volts({c: 0.0 for c in cal.channels})
        route = {**self.route.cells, **self.route.away}
        # compensated: the route is re-solved while other heaters change, so it keeps a
        # margin above zero power (no jumps of a period)
        st.set_volts(cal.settings_with_margin(route) if compensated else cal.settings(route))
        st.light(self.route.port)
        self.compensated = compensated
        self.arm_shift = math.pi if self.route.arm == 1 else 0.0

    def power_for(self, fringe_phase: float) -> float:
        """Own heater power giving this fringe phase (as predicted now)."""
        cal, f = self.cal, self.fit
        if not self.compensated:
            # same background as the sweep: the apparent offset holds
            off = f.offset_apparent + self.arm_shift
            return ((fringe_phase - off) % TWO_PI) / f.rad_per_mw
        p = cal._powers()
        p[self.ch] = 0.0
        theta0 = cal.phase_of(self.cell, p)
        return ((fringe_phase - theta0 - self.arm_shift) % TWO_PI) / \
            (f.rad_per_mw * (1.0 + cal.coupling()[self.ch, self.ch]))

    def read(self, p_mw: float) -> float:
        st = self.cal.station
        st.set_volts({self.ch: heater_volts(p_mw, self.cal.r_ohm[self.ch])})
        return self._reading()

    def four_step(self, turns: int = 0) -> tuple[float, float]:
        """Phase error (rad) of the prediction, and the cell's own heater power it belongs to
        (mW; `mean_powers` holds every heater's): the cell and its route solved together for
        each step, so the route does not move while the cell's own heater changes. `turns`
        adds whole periods to the cell's power."""
        route = {**self.route.cells, **self.route.away}
        st = self.cal.station
        anchor = {self.cal.channel_of[c]: float(st.commanded()[self.cal.channel_of[c]])
                  for c in route}
        ys, ps = [], []
        for k in range(4):
            theta = (k * math.pi / 2 - self.arm_shift) % TWO_PI
            st.set_volts(anchor)          # the route stays on its branch at every step
            st.set_volts(self.cal.settings({self.cell: theta, **route}, keep_near=set(route),
                                           turns={self.cell: turns}))
            powers = self.cal._powers()
            ps.append(powers)
            ys.append(self._reading())
        # to first order the estimate is the mean of the errors at the two quadrature steps
        # (1 and 3): when the error changes with the own power (an efficiency still off),
        # it belongs to their mean power, not to the mean of all four
        self.mean_powers = (ps[1] + ps[3]) / 2.0
        return math.atan2(ys[3] - ys[1], ys[0] - ys[2]), float(self.mean_powers[self.ch])

    def _reading(self) -> float:
        pd = self.cal.monitors()
        y = pd[self.cell]
        if self.route.reference is not None:
            y /= max(pd[self.route.reference], 1e-12)
        return y


def measure_crosstalk(cal: Calibrator, radius: float = 2.5, passes: int = 2,
                      on_progress: Callable[[str, int, int], None] | None = None,
                      between: Callable[[int], object] | None = None) -> np.ndarray:
    """Measure k_ij for every calibrated pair within `radius`; resumable per probe cell (in
    cal.state). The first pass leaves the route as set from the sweeps; the next ones set it
    with the crosstalk compensated, and keep it so while a neighbour is heated (re-solving the
    route's heaters, whose own small change is subtracted), which removes the first pass's
    error from light leaking off a route that the heated neighbour detunes. `between(npass)`
    runs after each pass but the last, with that pass's matrix (a refinement of the
    efficiencies, which the next pass's quadrature points depend on)."""
    if passes < 1:
        raise ValueError(f"crosstalk passes must be at least 1, not {passes}")
    n = 1 + max(cal.channels)
    near = neighbours(cal, radius)
    cells = [c for c in cal.order() if c in cal.state["fits"]]
    for npass in range(passes):
        key = "crosstalk" if npass == 0 else f"crosstalk{npass + 1}"
        done = cal.state.setdefault(key, {})
        fits = cal.fits()
        for k, cell in enumerate(cells):
            if cell not in done:
                # the last pass gives the matrix: its baseline is averaged (see BASE_REPEATS)
                done[cell] = _probe_neighbours(cal, cell, near, fits, compensated=npass > 0,
                                               repeats=BASE_REPEATS if npass == passes - 1
                                               else 1)
                cal.on_checkpoint(cal.state)
            if on_progress:
                on_progress(cell, npass * len(cells) + k + 1, passes * len(cells))
        cal.crosstalk = matrix = crosstalk_matrix(done, n)
        if between is not None and npass < passes - 1:
            between(npass)
    return matrix


def crosstalk_matrix(rows: dict, n: int) -> np.ndarray:
    k = np.zeros((n, n))
    for row in rows.values():
        i = int(row["channel"])
        for j, v in row["k"].items():
            k[i, int(j)] = v
    return k


def _probe_neighbours(cal: Calibrator, cell: str, near: dict[int, list[int]],
                      fits: dict, compensated: bool, repeats: int = 1) -> dict:
    """One row of the matrix: probe `cell`'s phase shift while each neighbour in turn is
    heated by one period of its own. When compensated, the probe's route is solved again at
    every reading (a route cell that is the heated neighbour is solved one period higher, so
    its state holds exactly), and every heater's actual change of power is recorded: the
    row then comes from the linear system  shift_j = sum_m k_im dP_m^(j)  over the heated
    neighbours j, which accounts for the route's own moves with the row being measured
    rather than with an earlier estimate."""
    st = cal.station
    probe = _Probe(cal, cell, compensated=compensated)
    f = probe.fit
    q1, q2 = probe.power_for(math.pi / 2), probe.power_for(3 * math.pi / 2)
    route = {**probe.route.cells, **probe.route.away}
    route_volts = {cal.channel_of[c]: float(st.commanded()[cal.channel_of[c]]) for c in route}
    cell_of = {cal.channel_of[c]: c for c in route}

    def read_at(qs, heated: int | None = None) -> tuple[list[float], list[np.ndarray]]:
        """The probe's readings at own powers `qs` and every heater's power at each; when
        compensated, the route is solved again at each point (the probe's own heat would
        detune it differently otherwise)."""
        ys, ps = [], []
        turns = {cell_of[heated]: 1} if heated in cell_of else None
        for q in qs:
            st.set_volts({probe.ch: heater_volts(q, cal.r_ohm[probe.ch])})
            if compensated:
                # the same start, so the same branch each time (the heated one a period up)
                st.set_volts(route_volts)
                st.set_volts(cal.settings(route, keep_near=True, turns=turns))
            ps.append(cal._powers())
            ys.append(probe._reading())
        return ys, ps

    m_over_a = f.mean / max(f.amplitude, 1e-30)        # the sweep's, until measured here

    def skews(ps: list[np.ndarray]) -> np.ndarray:
        """The probe's phase at each point less its phase at the points' mean powers, from
        the other heaters' powers and the matrix known so far: the route, solved again under
        the probe's own heat, is not where it was at the other points, and its heat moves the
        probe (some 0.05 rad between quadrature points next to a hexagonal mesh's route).
        0 without a matrix (the route then stays as it is)."""
        if cal.crosstalk is None:
            return np.zeros(len(ps))
        d = np.array(ps) - np.mean(ps, axis=0)
        d[:, probe.ch] = 0.0
        return f.rad_per_mw * (d @ cal.crosstalk[probe.ch])

    def shift(heated: int | None = None) -> tuple[float, np.ndarray]:
        """The probe's phase from fringe phases pi/2 and 3 pi/2 (0 at quadrature), at the
        mean powers of the two points. With e the skew, y1 ~ m - a sin(x + e) and
        y2 ~ m + a sin(x - e): r = (y2 - y1) / (y2 + y1) = sin x cos e / (m/a - cos x sin e),
        so sin(x + psi) = r (m/a) / A with A = hypot(cos e, r sin e), psi = atan2(r sin e,
        cos e). Without the skew taken out, a shift x reads about x (1 - e a / 2 m): a
        coupling 1.5 % short on the hexagonal mesh, 4 % with twice its crosstalk."""
        ys, ps = read_at((q1, q2), heated)
        r = (ys[1] - ys[0]) / (ys[1] + ys[0])
        e = float(skews(ps)[0])
        amp = math.hypot(math.cos(e), r * math.sin(e))
        x = math.asin(min(1.0, max(-1.0, r * m_over_a / amp))) - \
            math.atan2(r * math.sin(e), math.cos(e))
        return x, np.mean(ps, axis=0)

    base, p_base = shift()
    # centre the two points on quadrature, where the reading is linear in the phase, and
    # measure the fringe's contrast in place (four steps): the route, its leaks and the
    # reference seen now, not during the sweep, set the scale of every shift
    period = TWO_PI / f.rad_per_mw
    q1, q2 = ((q - base / f.rad_per_mw) % period for q in (q1, q2))
    q0, q3 = (q1 - period / 4) % period, (q1 + period / 4) % period
    # y_k = m + a cos(theta_k + e_k + x0) at the four fringe phases theta_k, with their skews
    # e_k: linear in m, a cos x0, a sin x0 (the skews would bias the plain mean by a e / 2)
    ys, ps = read_at((q0, q1, q3, q2))
    at = np.arange(4) * math.pi / 2.0 + skews(ps)
    (m, c, s), *_ = np.linalg.lstsq(np.column_stack([np.ones(4), np.cos(at), -np.sin(at)]),
                                    np.asarray(ys), rcond=None)
    if math.hypot(c, s) > 0:
        m_over_a = m / math.hypot(c, s)
    # the baseline is shared by every neighbour's shift: its noise would move the whole row
    # together (an error that adds up under a heavy load), so it is read `repeats` times
    # before the neighbours and as many after (the mean also cancels a linear drift)
    first = [shift() for _ in range(repeats)]
    base = float(np.mean([b for b, _ in first]))
    p_base = np.mean([p for _, p in first], axis=0)
    by_channel = {ff.channel: ff for ff in fits.values()}
    powers = cal._powers()
    heated = [j for j in near[probe.ch] if j in by_channel]   # others: no 2 pi known
    cols = {m: n for n, m in enumerate(near[probe.ch])}
    shifts = np.zeros(len(heated))
    moves = np.zeros((len(heated), len(cols)))
    for row, j in enumerate(heated):
        dp = 2.0 * by_channel[j].p_pi_mw
        if not (compensated and j in cell_of):
            st.set_volts({j: heater_volts(powers[j] + dp, cal.r_ohm[j])})
        sh, p_shift = shift(j)
        moved = p_shift - p_base
        moved[probe.ch] = 0.0
        if not compensated:
            moved[:] = 0.0                   # the route is not solved again: only j moved
            moved[j] = p_shift[j] - p_base[j]
        shifts[row] = sh
        moves[row] = [moved[m] for m in cols]
        st.set_volts({j: heater_volts(powers[j], cal.r_ohm[j])})
        if compensated:
            st.set_volts(route_volts)
    last = [shift() for _ in range(repeats)]
    end = float(np.mean([b for b, _ in last]))
    drift = abs(end - base)
    if drift > 0.01:
        log.warning("%s: phase drifted %.3f rad while measuring its crosstalk", cell, drift)
    ks: dict[str, float] = {}
    if heated:
        # shifts from the mean baseline of before and after; unknowns: the row's couplings
        # to every neighbour (one that could not be heated, not calibrated, is taken as not
        # coupled)
        keep = [cols[j] for j in heated]
        solved = np.linalg.solve(moves[:, keep], (shifts - (base + end) / 2.0) / f.rad_per_mw)
        ks = {str(j): float(v) for j, v in zip(heated, solved, strict=True)}
    return {"channel": probe.ch, "k": ks, "drift_rad": drift}


def refine_offsets(cal: Calibrator, rounds: int = 1,
                   on_progress: Callable[[str, int, int], None] | None = None,
                   key: str = "refined") -> dict[str, float]:
    """Four-step phase checks of every calibrated cell with compensated routes; the corrections
    go into each fit's apparent offset (so `cal.offsets()` includes them) and efficiency.
    `key`: where the state keeps this refinement's progress (a run may refine twice)."""
    if cal.crosstalk is None:
        raise CalibrationRunError("refine the offsets after measuring the crosstalk")
    refined = cal.state.setdefault(key, {})
    # a crosstalk row measures beta_i k_ij: when the refinement corrects beta_i, the row is
    # scaled by old / new beta so that the product (what was measured) holds. The matrix is
    # rebuilt from the raw rows by `measure_crosstalk`, so the scales of cells refined before
    # a resume are applied again here.
    row_scale = cal.state.setdefault("row_scale" if key == "refined" else f"row_scale_{key}",
                                     {})
    for ch, scale in row_scale.items():
        cal.crosstalk[int(ch)] *= scale
    cells = [c for c in cal.order() if c in cal.state["fits"]]
    for k, cell in enumerate(cells):
        if cell not in refined:
            total = 0.0
            fit = cal.state["fits"][cell]
            for _ in range(rounds):
                probe = _Probe(cal, cell, compensated=True)
                err0, p0 = probe.four_step(0)
                err1, p1 = probe.four_step(1)
                # the error grows with the own power when the efficiency is off
                d_beta = ((err1 - err0 + math.pi) % TWO_PI - math.pi) / (p1 - p0)
                if abs(d_beta) < 0.25 * fit["rad_per_mw"]:
                    scale = fit["rad_per_mw"] / (fit["rad_per_mw"] + d_beta)
                    fit["rad_per_mw"] += d_beta
                    cal.crosstalk[fit["channel"]] *= scale
                    row = str(fit["channel"])
                    row_scale[row] = row_scale.get(row, 1.0) * scale
                else:
                    d_beta = 0.0
                err = err0 - d_beta * p0
                fit["offset_apparent"] = (fit["offset_apparent"] + err) % TWO_PI
                fit["measurements"] += 8
                total += err
            refined[cell] = total
            # the load of the measurement just made, at which the model is now right
            cal.state.setdefault("refine_load", {})[cell] = probe.mean_powers.tolist()
            cal.on_checkpoint(cal.state)
        if on_progress:
            on_progress(cell, k + 1, len(cells))
    return dict(refined)


LOAD_STATES = ("bar", "cross")   # every other cell in one of these while a cell is checked
K_PRIOR = 2e-4                   # expected error of a measured coupling (noise), 1 / mW
K_SCALE_PRIOR = 0.02             # and its part in proportion (a row's common scale error)
OFFSET_PRIOR_RAD = 0.02          # expected error of an apparent offset
PHASE_NOISE_RAD = 1.5e-3         # of one four-step phase measurement


def refine_under_load(cal: Calibrator, loads: tuple[str, ...] = LOAD_STATES,
                      radius: float = 2.5,
                      on_progress: Callable[[str, int, int], None] | None = None) -> dict:
    """Check every cell under heavy loads and correct its crosstalk row and offset.

    Cell i is lit along its route (compensated, as in the refinement) while every other cell
    is set to one state of `loads` (all bar, then all cross: every heater on, the largest
    crosstalk load the chip sees); its phase error e is measured by four-step phase shifting.
    The model  e = dA + sum_j dc_j (P_j - bg_j)  (dA: the apparent offset's error, dc_j:
    the error of beta_i k_ij, bg: the sweep's powers) is then solved for the smallest
    correction, weighted by the expected errors (K_PRIOR, K_SCALE_PRIOR, OFFSET_PRIOR_RAD),
    that also keeps the refinement's own measurement (route load, error 0 after it) right.
    The noise of the crosstalk measurement adds up over twenty neighbours under a full load;
    this removes what of it the loads measured. Resumable per cell; 4 readings per cell and
    load."""
    if cal.crosstalk is None:
        raise CalibrationRunError("check under load after measuring the crosstalk")
    done = cal.state.setdefault("loaded", {})
    for entry in done.values():                  # re-applied to the rebuilt matrix
        _apply_row(cal, entry)
    near = neighbours(cal, radius)          # the neighbours the crosstalk measured
    fits = cal.state["fits"]
    cells = [c for c in cal.order() if c in fits]
    for k, cell in enumerate(cells):
        if cell not in done:
            done[cell] = _check_under_load(cal, cell, cells, near, loads)
            _apply_row(cal, done[cell])
            fits[cell]["offset_apparent"] = (fits[cell]["offset_apparent"]
                                             + done[cell]["d_offset"]) % TWO_PI
            fits[cell]["measurements"] += 4 * len(loads)
            cal.on_checkpoint(cal.state)
        if on_progress:
            on_progress(cell, k + 1, len(cells))
    return done


def _apply_row(cal: Calibrator, entry: dict) -> None:
    i = int(entry["channel"])
    crosstalk = cal.coupling()
    for j, v in entry["dk"].items():
        crosstalk[i, int(j)] += v


def _check_under_load(cal: Calibrator, cell: str, cells: list[str],
                      near: dict[int, list[int]], loads: tuple[str, ...]) -> dict:
    st = cal.station
    fit = cal.fit(cell)
    ch = fit.channel
    beta = fit.rad_per_mw
    bg = np.asarray(fit.background_mw)
    cols = [j for j in near[ch] if j < len(bg)]
    rows, errors, sigmas = [], [], []
    ref = cal.state.get("refine_load", {}).get(cell)
    if ref is not None:
        # the refinement left the model right at its own load
        rows.append(np.concatenate([[1.0], np.asarray(ref)[cols] - bg[cols]]))
        errors.append(0.0)
        sigmas.append(PHASE_NOISE_RAD)
    probe = _Probe(cal, cell, compensated=True)
    route = {**probe.route.cells, **probe.route.away}
    volts = st.commanded()
    anchor = {cal.channel_of[c]: float(volts[cal.channel_of[c]]) for c in route}
    for load in loads:                  # each load's settings set every heater
        others = {c: load for c in cells if c != cell and c not in route}
        st.set_volts(cal.settings({**others, **route, cell: 0.0}, keep_near=set(route)))
        st.set_volts(anchor)
        err, _ = probe.four_step(0)
        p = probe.mean_powers
        rows.append(np.concatenate([[1.0], p[cols] - bg[cols]]))
        errors.append(err)
        sigmas.append(PHASE_NOISE_RAD)
    g = np.array(rows)
    k_row = np.abs(cal.coupling()[ch, cols])
    prior = np.concatenate([[OFFSET_PRIOR_RAD ** 2],
                            beta ** 2 * (K_PRIOR ** 2 + (K_SCALE_PRIOR * k_row) ** 2)])
    cov = (g * prior) @ g.T + np.diag(np.square(sigmas))
    x = prior * (g.T @ np.linalg.solve(cov, np.asarray(errors)))
    return {"channel": ch, "errors": [float(e) for e in errors[-len(loads):]],
            "d_offset": float(x[0]),
            "dk": {str(j): float(v / beta) for j, v in zip(cols, x[1:], strict=True)}}


EXTINCTION_PROBE_RAD = 0.1       # the two readings either side of the bar / cross setting
EXTINCTION_CAP_DB = 60.0         # beyond the detector's floor: written as this


def extinction_db(lo: float, hi: float) -> float:
    """A fringe's extinction, max / min in dB, EXTINCTION_CAP_DB where the minimum is 0."""
    return EXTINCTION_CAP_DB if lo <= 0 else min(EXTINCTION_CAP_DB,
                                                  round(10.0 * math.log10(hi / lo), 3))


def measure_extinctions(cal: Calibrator,
                        on_progress: Callable[[str, int, int], None] | None = None
                        ) -> dict[str, dict[str, float]]:
    """Each cell's bar and cross extinction as its couplers allow, from its own photodiode.

    The photodiode is on the bottom output arm. With light on the top input arm it follows
    m + a cos(theta), whose minimum (theta = pi, bar) is the light the cell leaks across in
    the bar state, about (r1 - r2)^2 for couplers r1, r2; with light on the bottom input arm
    it follows m - a cos(theta), whose minimum (theta = 0, cross) is the cross state's leak,
    about (r1 + r2 - 1)^2. For each, three readings with the crosstalk compensated, at the
    maximum and 0.1 rad either side of the minimum, determine m, a and the small error of
    the setting (y is linear in m, a cos theta0 and a sin theta0): the extinction is
    (m + a) / (m - a), the photodiode's dark current subtracted. Resumable per cell;
    6 readings per cell. An input arm that cannot be lit (on a recirculating mesh, one at a
    free end) leaves its state's extinction unmeasured."""
    if cal.crosstalk is None:
        raise CalibrationRunError("measure the extinctions after the crosstalk")
    done = cal.state.setdefault("extinction", {})
    fits = cal.state["fits"]
    cells = [c for c in cal.order() if c in fits]
    for k, cell in enumerate(cells):
        if cell not in done:
            done[cell] = {}
            for key, arm, minimum in (("bar_db", 0, math.pi), ("cross_db", 1, 0.0)):
                try:
                    done[cell][key] = _extinction(cal, cell, arm=arm, minimum=minimum)
                except UnlitArm as e:
                    # (a recirculating mesh: an input arm at a free end, or none of its ways
                    # in crosses calibrated cells only) that state's leak is not measured
                    log.info("%s: %s", cell, e)
                    continue
                fits[cell]["measurements"] += 3
            cal.on_checkpoint(cal.state)
        if on_progress:
            on_progress(cell, k + 1, len(cells))
    return dict(done)


def _extinction(cal: Calibrator, cell: str, arm: int, minimum: float) -> float:
    probe = _Probe(cal, cell, compensated=True, arm=arm)
    route = {**probe.route.cells, **probe.route.away}
    st = cal.station
    anchor = {cal.channel_of[c]: float(st.commanded()[cal.channel_of[c]]) for c in route}
    thetas = (minimum + math.pi, minimum - EXTINCTION_PROBE_RAD, minimum + EXTINCTION_PROBE_RAD)
    ys = []
    for theta in thetas:
        st.set_volts(anchor)
        st.set_volts(cal.settings({cell: theta % TWO_PI, **route}, keep_near=set(route)))
        ys.append(probe._reading())
    design = np.array([[1.0, math.cos(t), math.sin(t)] for t in thetas])
    m, u, v = np.linalg.solve(design, np.asarray(ys))
    a = math.hypot(u, v)
    lo, hi = m - a, m + a
    if hi <= 0:
        raise CalibrationRunError(f"{cell}: no light on its photodiode from input arm {arm}")
    return extinction_db(lo, hi)
