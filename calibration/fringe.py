"""The interference fringe of one heater, its fit, and an adaptive sweep that measures it.

A thermo-optic MZI seen at one detector follows

    y(P) = mean + amplitude * cos(offset + rad_per_mw * P)

where P is the heater's electrical power in mW (measured as V * I, so heater resistance and its
drift need no separate model), `offset` is the unknown phase at zero power and `rad_per_mw` is
pi / P_pi. Fitting in power rather than in volts keeps the phase linear in the fitted variable.

The sweep measures a coarse grid over a bit more than one period, fits, then spends the rest of
its budget around the fringe's extremes, where the bar and cross settings lie and where the
extinction is decided, instead of sampling a fixed dense grid.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
from scipy.optimize import least_squares

TWO_PI = 2.0 * math.pi


class FitError(RuntimeError):
    """The measurements do not show a fringe that can be fitted (no light, no modulation)."""


@dataclass(frozen=True)
class FringeFit:
    offset: float              # rad, in [0, 2 pi): phase at zero heater power
    rad_per_mw: float          # pi / P_pi
    mean: float                # detector units (mW of light, or uA of photocurrent)
    amplitude: float           # >= 0; the offset absorbs the sign
    offset_std: float
    rad_per_mw_std: float
    mean_std: float
    amplitude_std: float
    residual_rms: float
    points: int

    @property
    def p_pi_mw(self) -> float:
        return math.pi / self.rad_per_mw

    @property
    def p_pi_std_mw(self) -> float:
        return math.pi * self.rad_per_mw_std / self.rad_per_mw ** 2

    @property
    def extinction_db(self) -> float:
        """Ratio of the fringe's maximum to its minimum (inf when the fit reaches zero)."""
        lo = self.mean - self.amplitude
        if lo <= 0:
            return math.inf
        return 10.0 * math.log10((self.mean + self.amplitude) / lo)

    def model(self, p_mw: np.ndarray | float) -> np.ndarray | float:
        return self.mean + self.amplitude * np.cos(self.offset + self.rad_per_mw * np.asarray(p_mw))

    def phase(self, p_mw: float) -> float:
        return self.offset + self.rad_per_mw * p_mw

    def power_for_phase(self, phase: float) -> float:
        """Smallest heater power (mW) that brings the fringe to `phase` (mod 2 pi)."""
        return ((phase - self.offset) % TWO_PI) / self.rad_per_mw

    def power_for_maximum(self) -> float:
        return self.power_for_phase(0.0)

    def power_for_minimum(self) -> float:
        return self.power_for_phase(math.pi)


def _linear_fit(p: np.ndarray, y: np.ndarray, beta: float) -> tuple[np.ndarray, float]:
    """For a fixed rad_per_mw the model is linear in (mean, c, s): solve it exactly."""
    design = np.column_stack([np.ones_like(p), np.cos(beta * p), np.sin(beta * p)])
    coef, *_ = np.linalg.lstsq(design, y, rcond=None)
    resid = y - design @ coef
    return coef, float(resid @ resid)


def _scan_costs(p: np.ndarray, y: np.ndarray, betas: np.ndarray) -> np.ndarray:
    """Residual sum of squares of the linear fit at every candidate rad_per_mw, all at once
    (batched 3 x 3 normal equations)."""
    bp = betas[:, None] * p[None, :]
    design = np.stack([np.ones_like(bp), np.cos(bp), np.sin(bp)], axis=2)    # (b, n, 3)
    gram = np.einsum("bni,bnj->bij", design, design)
    rhs = np.einsum("bni,n->bi", design, y)
    gram += 1e-12 * np.eye(3)
    coef = np.linalg.solve(gram, rhs[..., None])[..., 0]
    resid = y[None, :] - np.einsum("bni,bi->bn", design, coef)
    return np.einsum("bn,bn->b", resid, resid)


def fit_fringe(p_mw: Sequence[float], y: Sequence[float],
               p_pi_range_mw: tuple[float, float] = (12.0, 40.0)) -> FringeFit:
    """Fit the fringe model to measured (heater power, detector reading) points.

    The period is found by a scan over `p_pi_range_mw` with the linear parameters solved
    exactly at each candidate, then all four parameters are refined together by least squares;
    the standard deviations come from the Jacobian at the optimum.
    """
    p = np.asarray(p_mw, dtype=float)
    yv = np.asarray(y, dtype=float)
    if p.shape != yv.shape or p.ndim != 1:
        raise ValueError("heater powers and readings must be two sequences of equal length")
    if len(p) < 6:
        raise FitError(f"a fringe needs at least 6 points, got {len(p)}")
    if not (np.all(np.isfinite(p)) and np.all(np.isfinite(yv))):
        raise FitError("the measurements contain NaN or infinite values")
    scale = float(np.max(np.abs(yv)))
    if scale <= 0 or float(np.ptp(yv)) < 1e-6 * scale or scale == 0:
        raise FitError("the detector reading does not change with the heater: no light reaches "
                       "the detector, or the heater does not act on this path")
    ys = yv / scale
    lo, hi = math.pi / p_pi_range_mw[1], math.pi / p_pi_range_mw[0]
    betas = np.linspace(lo, hi, 400)
    beta0 = float(betas[int(np.argmin(_scan_costs(p, ys, betas)))])
    (a0, c0, s0), _ = _linear_fit(p, ys, beta0)
    b0 = math.hypot(c0, s0)
    # c cos(bP) + s sin(bP) = b0 cos(bP + phi) with phi = atan2(-s, c)
    phi0 = math.atan2(-s0, c0)

    def resid(x: np.ndarray) -> np.ndarray:
        a, b, phi, beta = x
        return a + b * np.cos(phi + beta * p) - ys

    sol = least_squares(resid, [a0, b0, phi0, beta0], method="lm")
    a, b, phi, beta = sol.x
    if b < 0:
        b, phi = -b, phi + math.pi
    dof = max(1, len(p) - 4)
    rss = float(sol.fun @ sol.fun)
    sigma2 = rss / dof
    try:
        cov = np.linalg.inv(sol.jac.T @ sol.jac) * sigma2
        std = np.sqrt(np.clip(np.diag(cov), 0.0, None))
    except np.linalg.LinAlgError:
        std = np.full(4, math.inf)
    if not (lo * 0.5 <= beta <= hi * 2):
        raise FitError(f"the fitted P_pi {math.pi / beta:.1f} mW is outside the plausible range "
                       f"{p_pi_range_mw[0]}-{p_pi_range_mw[1]} mW")
    return FringeFit(offset=phi % TWO_PI, rad_per_mw=float(beta), mean=float(a) * scale,
                     amplitude=float(b) * scale, offset_std=float(std[2]),
                     rad_per_mw_std=float(std[3]), mean_std=float(std[0]) * scale,
                     amplitude_std=float(std[1]) * scale,
                     residual_rms=math.sqrt(rss / len(p)) * scale, points=len(p))


@dataclass
class Sweep:
    """Measured points of one fringe: heater power (mW, as measured) and detector reading."""
    p_mw: list[float]
    y: list[float]

    def add(self, p: float, y: float) -> None:
        self.p_mw.append(float(p))
        self.y.append(float(y))


def adaptive_sweep(measure: Callable[[float], tuple[float, float]], p_max_mw: float,
                   coarse: int = 12, fine_rounds: int = 2,
                   fine_offsets_rad: Sequence[float] = (-0.12, -0.04, 0.04, 0.12),
                   p_pi_range_mw: tuple[float, float] = (12.0, 40.0)) -> tuple[FringeFit, Sweep]:
    """Measure and fit one fringe with few points.

    `measure(p_mw)` sets the heater to (about) that electrical power and returns the power it
    actually dissipates (mW, from the board's voltage and current readback) and the detector
    reading. `p_max_mw` must cover a bit more than one period (e.g. 2.2 x the largest
    plausible P_pi). The coarse grid is uniform in power; each fine round adds points around
    the fitted maximum and minimum and refits.
    """
    if p_max_mw <= 0:
        raise ValueError("p_max_mw must be positive")
    sweep = Sweep([], [])
    for p in np.linspace(0.0, p_max_mw, coarse):
        sweep.add(*measure(float(p)))
    fit = fit_fringe(sweep.p_mw, sweep.y, p_pi_range_mw)
    for _ in range(fine_rounds):
        for centre_phase in (0.0, math.pi):
            centre = fit.power_for_phase(centre_phase)
            for d in fine_offsets_rad:
                p = centre + d / fit.rad_per_mw
                if 0.0 <= p <= p_max_mw:
                    sweep.add(*measure(p))
        fit = fit_fringe(sweep.p_mw, sweep.y, p_pi_range_mw)
        fine_offsets_rad = [d / 3.0 for d in fine_offsets_rad]
    return fit, sweep
