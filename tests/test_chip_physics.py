"""The emulated chip's physics: cell matrices, routing power, loss, lag, truth and oracle."""
from __future__ import annotations

import math

import numpy as np
import pytest

from photonic_testbed.common.topology import benes, clements
from photonic_testbed.drivers.routing import benes_cell_states, clements_decompose
from photonic_testbed.emulator.chip import (
    MONITOR_TAP,
    NOMINAL_P_PI_MW,
    OUTPUT_TAP,
    ChipError,
    EmulatedChip,
    cell_matrix,
)


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def settled(chip, clock, volts):
    chip.set_voltages(volts)
    clock.t += 1e-3          # a millisecond is hundreds of thermal time constants


def test_cell_matches_the_textbook_mzi():
    # Balanced couplers, theta on the top arm between them: [[e^{i t} - 1, i(e^{i t} + 1)],
    # [i(e^{i t} + 1), 1 - e^{i t}]] / 2, then phi on the top input.
    for theta, phi in [(0.0, 0.0), (math.pi, 0.0), (0.4, 2.2), (math.pi / 2, -1.0)]:
        a = np.exp(1j * theta)
        expect = np.array([[a - 1, 1j * (a + 1)], [1j * (a + 1), 1 - a]]) / 2
        expect = expect @ np.diag([np.exp(1j * phi), 1])
        assert np.allclose(cell_matrix(theta, phi, 0.5, 0.5), expect)
    # Loss scales power; a lossless cell is unitary whatever its couplers.
    t = cell_matrix(0.9, 0.3, 0.47, 0.53)
    assert np.allclose(t.conj().T @ t, np.eye(2))
    assert np.allclose(np.abs(cell_matrix(0.9, 0.3, 0.5, 0.5, 3.0)) ** 2,
                       np.abs(cell_matrix(0.9, 0.3, 0.5, 0.5)) ** 2 * 10 ** -0.3)


def test_coupler_errors_bound_the_extinction_at_bar():
    # theta = pi gives bar for any ratios; leakage is (sqrt(r1(1-r2)) - sqrt(r2(1-r1)))^2.
    r1, r2 = 0.52, 0.47
    leak = abs(cell_matrix(math.pi, 0.0, r1, r2)[1, 0]) ** 2
    assert leak == pytest.approx((math.sqrt(r1 * (1 - r2)) - math.sqrt(r2 * (1 - r1))) ** 2)
    assert 1e-4 < leak < 1e-2


def test_ideal_benes_routes_sampled_permutations_with_over_999_permille():
    clock = Clock()
    chip = EmulatedChip(benes(16).describe(), ideal=True, clock=clock)
    rng = np.random.default_rng(0)
    for _ in range(25):
        p = rng.permutation(16)
        settled(chip, clock, chip.oracle_voltages(benes_cell_states(p)))
        power = np.abs(chip.fields()) ** 2
        share = power[p, np.arange(16)] / power.sum(axis=0)
        assert share.min() > 0.999


def test_ideal_clements_makes_any_unitary():
    from scipy.stats import unitary_group
    clock = Clock()
    chip = EmulatedChip(clements(6).describe(), ideal=True, monitors=False, clock=clock)
    u = unitary_group.rvs(6, random_state=7)
    dec = clements_decompose(u)
    states = {c: {"theta": t, "phi": f} for c, (t, f) in dec.cell_phases().items()}
    settled(chip, clock, chip.oracle_voltages(states))
    # The chip has no output phase screen: it makes U up to output phases.
    assert np.allclose(np.abs(chip.fields()), np.abs(u), atol=1e-3)


def test_energy_is_conserved_up_to_the_modelled_loss():
    clock = Clock()
    for ideal in (True, False):
        chip = EmulatedChip(benes(16).describe(), seed=3, ideal=ideal, clock=clock)
        settled(chip, clock, {ch: v for ch, v in enumerate(np.linspace(0, 6, 56))})
        t = chip.truth()
        stages = 7
        worst = 10 ** (-(t.loss_db.max() * stages) / 10) * (1 - MONITOR_TAP) ** stages
        best = 10 ** (-(t.loss_db.min() * stages) / 10)
        for port in (1, 9, 16):
            total = sum(chip.transfer({port: 2.0}).values()) / (2.0 * (1 - OUTPUT_TAP))
            assert worst - 1e-12 <= total <= best + 1e-12
        # Without monitor photodiodes a lossless chip keeps every photon.
    lossless = EmulatedChip(benes(8).describe(), ideal=True, monitors=False, clock=clock)
    settled(lossless, clock, {0: 3.0, 5: 4.0})
    assert sum(lossless.transfer({1: 1.0, 2: 1.0}).values()) == pytest.approx(2 * (1 - OUTPUT_TAP))


def test_inputs_are_independent_sources_whose_powers_add():
    clock = Clock()
    chip = EmulatedChip(benes(8).describe(), seed=1, clock=clock)
    settled(chip, clock, {0: 2.0, 3: 5.0, 9: 1.0})
    a, b = chip.transfer({1: 1.0}), chip.transfer({4: 3.0})
    both = chip.transfer({1: 1.0, 4: 3.0})
    assert all(both[o] == pytest.approx(a[o] + b[o]) for o in both)
    chip.set_inputs({1: 1.0})
    chip.inject(4, 3.0)
    assert chip.inputs == {1: 1.0, 4: 3.0}
    assert chip.output_power_mw(10) == pytest.approx(both[10])
    assert chip.tap_power_mw(10) == pytest.approx(both[10] * OUTPUT_TAP / (1 - OUTPUT_TAP),
                                                  rel=0.01, abs=1e-6)


def test_the_seeded_truth_has_the_documented_spread():
    t = EmulatedChip(benes(16).describe(), seed=11).truth()
    assert abs(t.couplers.mean() - 0.5) < 0.01 and 0.01 < t.couplers.std() < 0.03
    assert ((0 <= t.offset_rad) & (t.offset_rad < 2 * math.pi)).all()
    assert ((20 <= t.p_pi_mw) & (t.p_pi_mw <= 25)).all()
    assert ((0.1 <= t.loss_db) & (t.loss_db <= 0.3)).all()
    assert ((1e-6 <= t.tau_s) & (t.tau_s <= 1e-5)).all()
    k = t.crosstalk
    # Nearest neighbours (s0r0 and s0r1, one cell apart) a few percent; far heaters nothing.
    assert 0.01 < k[0, 1] < 0.05 and k[0, 55] == 0.0
    def offsets(seed):
        return EmulatedChip(benes(16).describe(), seed=seed).truth().offset_rad
    assert np.array_equal(t.offset_rad, offsets(11))
    assert not np.array_equal(t.offset_rad, offsets(12))


def test_phase_follows_heater_power_with_a_first_order_lag():
    clock = Clock()
    chip = EmulatedChip(benes(4).describe(), ideal=True, clock=clock)
    tau = chip.truth().tau_s[0]
    v_pi = math.sqrt(NOMINAL_P_PI_MW * 1.0)          # P_pi into 1 kOhm
    chip.set_voltage(0, v_pi)
    assert chip.phases()[0] == pytest.approx(0.0)
    clock.t += tau
    assert chip.phases()[0] == pytest.approx(math.pi * (1 - math.exp(-1)))
    clock.t += 50 * tau
    assert chip.phases()[0] == pytest.approx(math.pi)
    chip.set_voltage(99, 5.0)                          # a DAC channel with no heater: ignored


def test_oracle_voltages_set_an_imperfect_chip_to_its_extinction_limit():
    clock = Clock()
    chip = EmulatedChip(benes(16).describe(), seed=5, clock=clock)
    p = np.random.default_rng(5).permutation(16)
    settled(chip, clock, chip.oracle_voltages(benes_cell_states(p)))
    power = np.abs(chip.fields()) ** 2
    share = power[p, np.arange(16)] / power.sum(axis=0)
    # Coupler errors (sigma 2 %) leave a little light in the wrong arm of each of 7 cells.
    assert share.min() > 0.97
    theta = chip.phases()
    named = benes_cell_states(p)
    ids = chip.cell_ids
    for i, cid in enumerate(ids):
        want = math.pi if named[cid] == "bar" else 0.0
        assert abs((theta[i] - want + math.pi) % (2 * math.pi) - math.pi) < 1e-3


def test_monitor_photodiodes_see_the_bottom_arm():
    clock = Clock()
    chip = EmulatedChip(benes(4).describe(), ideal=True, clock=clock)
    settled(chip, clock, chip.oracle_voltages({"s0r0": "bar", "s1r0": "bar", "s2r0": "bar",
                                               "s0r1": "bar", "s1r1": "bar", "s2r1": "bar"}))
    chip.set_inputs({2: 1.0})        # input 2 is s0r0's bottom arm: bar keeps it there
    cur = chip.monitor_currents_ua()
    assert cur["s0r0"] == pytest.approx(MONITOR_TAP * 1000.0, rel=1e-3)
    assert cur["s0r1"] < 0.01
    off = EmulatedChip(benes(4).describe(), ideal=True, monitors=False)
    with pytest.raises(ChipError):
        off.monitor_currents_ua()


@pytest.mark.parametrize("bad", [
    lambda c: c.transfer({0: 1.0}), lambda c: c.transfer({1: -1.0}),
    lambda c: c.transfer({1: float("nan")}), lambda c: c.output_power_mw(3),
    lambda c: c.oracle_voltages({"nope": "bar"}), lambda c: c.oracle_voltages({"s0r0": "half"}),
    lambda c: c.monitor_current_ua("nope")])
def test_bad_requests_are_refused_clearly(bad):
    with pytest.raises(ChipError):
        bad(EmulatedChip(benes(4).describe(), seed=0))


def test_only_feed_forward_topologies_are_emulated():
    from photonic_testbed.common.topology import square
    with pytest.raises(ChipError, match="feed-forward"):
        EmulatedChip(square(3).describe())
    d = benes(4).describe()
    d["links"] = d["links"][1:]
    with pytest.raises(ChipError, match="unconnected"):
        EmulatedChip(d)
    with pytest.raises(ChipError):
        EmulatedChip({"kind": "benes"})
