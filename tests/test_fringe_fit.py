"""Fitting one heater's fringe: recovers the phase offset and efficiency from few points."""
import math

import numpy as np
import pytest

from photonic_testbed.calibration.fringe import FitError, adaptive_sweep, fit_fringe


def fringe(offset, p_pi, mean=0.5, amplitude=0.48, noise=1e-3, seed=0):
    rng = np.random.default_rng(seed)

    def measure(p_mw):
        # the board dissipates slightly off the asked power (16-bit DAC, resistance)
        p_true = p_mw * (1 + rng.normal(0, 1e-4))
        y = mean + amplitude * math.cos(offset + math.pi * p_true / p_pi)
        return p_true, y * (1 + rng.normal(0, noise)) + 1e-7
    return measure


@pytest.mark.parametrize("offset, p_pi, seed", [
    (0.3, 20.0, 1), (2.9, 24.8, 2), (5.5, 22.0, 3), (4.0, 25.0, 4), (0.0, 21.3, 5)])
def test_adaptive_sweep_recovers_offset_and_p_pi(offset, p_pi, seed):
    fit, sweep = adaptive_sweep(fringe(offset, p_pi, seed=seed), p_max_mw=55.0)
    assert len(sweep.p_mw) <= 40
    err = (fit.offset - offset + math.pi) % (2 * math.pi) - math.pi
    assert abs(err) < 0.02
    assert fit.p_pi_mw == pytest.approx(p_pi, rel=0.02)
    # the uncertainty is an honest bound of the error it reports
    assert fit.offset_std < 0.02 and abs(err) < 6 * fit.offset_std + 1e-3
    # extinction of the simulated fringe: (0.98 / 0.02)
    assert fit.extinction_db == pytest.approx(10 * math.log10(0.98 / 0.02), abs=0.5)


def test_power_for_phase_lands_on_extremes():
    fit, _ = adaptive_sweep(fringe(1.0, 23.0, noise=0), p_max_mw=55.0)
    assert fit.model(fit.power_for_maximum()) == pytest.approx(0.98, abs=1e-4)
    assert fit.model(fit.power_for_minimum()) == pytest.approx(0.02, abs=1e-4)
    assert 0 <= fit.power_for_phase(7.0) < 2 * fit.p_pi_mw


def test_flat_reading_is_a_clear_error():
    with pytest.raises(FitError, match="does not change"):
        fit_fringe(np.linspace(0, 50, 12), np.full(12, 0.25))
    with pytest.raises(FitError, match="at least 6"):
        fit_fringe([0, 1, 2], [1, 2, 3])
    with pytest.raises(FitError, match="NaN"):
        fit_fringe(np.linspace(0, 50, 8), [1, 2, np.nan, 1, 2, 1, 2, 1])
