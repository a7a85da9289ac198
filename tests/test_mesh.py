"""The mesh driver: calibration files, and circuits made end to end over the real wires
(Mesh -> HeaterDAC -> pty -> firmware -> heaters -> chip physics -> output taps)."""
from __future__ import annotations

import json
import math
from dataclasses import replace

import numpy as np
import pytest

from photonic_testbed.common.topology import Topology, TopologyError, benes, clements, square
from photonic_testbed.drivers.circuit_switch import CircuitConflict, CircuitSwitch, SwitchError
from photonic_testbed.drivers.heater_dac import HeaterDAC
from photonic_testbed.drivers.mesh import (
    Calibration,
    CalibrationError,
    HeaterCalibration,
    Mesh,
    read_calibration,
    write_calibration,
)
from photonic_testbed.emulator import chip as chip_physics
from photonic_testbed.emulator.chip import EmulatedChip
from photonic_testbed.emulator.rig import EmulatedRig
from photonic_testbed.hil.rig import rig_spec


def random_circuits(n, seed):
    p = np.random.default_rng(seed).permutation(n)
    return {i + 1: n + 1 + int(p[i]) for i in range(n)}


def shares(chip, circuits):
    """For each input lit alone at 1 mW, the share of the output taps' light (what the power
    meter's channels read) that reaches the intended output."""
    n = chip.ports
    out = []
    for i, o in circuits.items():
        chip.set_inputs({i: 1.0})
        taps = {p: chip.tap_power_mw(p) for p in range(n + 1, 2 * n + 1)}
        out.append(taps[o] / sum(taps.values()))
    chip.set_inputs({})
    return np.array(out)


@pytest.fixture
def rig(request, tmp_path):
    ideal = getattr(request, "param", True)
    with EmulatedRig(rig_spec("lumion"), seed=7, workdir=tmp_path, ideal_chip=ideal) as r:
        yield r


@pytest.fixture
def mesh(rig):
    m = Mesh(benes(16), HeaterDAC(rig.endpoints["dac"], timeout=10.0).__enter__())
    yield m
    m.close()


# ---- calibration ---------------------------------------------------------------------------------

def test_ideal_calibration_is_the_documented_phase_to_voltage_law():
    cal = Calibration.ideal(range(4))
    v = cal.voltages({0: math.pi, 1: 0.0, 2: math.pi / 2, 3: 3 * math.pi})
    assert v[0] == pytest.approx(math.sqrt(22.5))          # P_pi = 22.5 mW into 1 kOhm
    assert v[1] == 0.0 and v[2] == pytest.approx(math.sqrt(22.5 / 2))
    assert v[3] == pytest.approx(v[0])                     # phases wrap at 2 pi
    assert chip_physics.NOMINAL_P_PI_MW == 22.5 and chip_physics.NOMINAL_R_OHM == 1000.0


def test_calibration_round_trips_through_its_file(tmp_path):
    rng = np.random.default_rng(1)
    cal = Calibration({ch: HeaterCalibration(float(rng.uniform(0, 6)), float(rng.uniform(20, 25)),
                                             float(rng.uniform(950, 1050))) for ch in range(3)},
                      rng.uniform(0, 0.03, (3, 3)) * (1 - np.eye(3)), "benes4")
    path = tmp_path / "cal.json"
    write_calibration(cal, path)
    back = read_calibration(path)
    assert back.heaters == cal.heaters and np.allclose(back.crosstalk, cal.crosstalk)
    phases = {0: 1.0, 1: 2.0, 2: 5.5}
    assert back.phases(back.voltages(phases)) == pytest.approx(phases)


@pytest.mark.parametrize("text", ["not json", json.dumps({"version": 2, "channels": []}),
                                  json.dumps({"version": 1, "channels": [{"channel": 0}]}),
                                  json.dumps({"version": 1, "channels": [
                                      {"channel": 0, "offset_rad": 0, "p_pi_mw": -1,
                                       "r_ohm": 1000}]})])
def test_bad_calibration_files_are_refused_clearly(tmp_path, text):
    path = tmp_path / "cal.json"
    path.write_text(text)
    with pytest.raises(CalibrationError):
        read_calibration(path)
    with pytest.raises(CalibrationError):
        read_calibration(tmp_path / "missing.json")


# ---- end to end over the pty ---------------------------------------------------------------------

def test_mesh_is_a_circuit_switch_that_describes_its_topology(mesh):
    assert isinstance(mesh, CircuitSwitch) and mesh.ports == 16
    d = json.loads(json.dumps(mesh.describe()))
    assert d["topology"] == benes(16).describe() and d["calibration"] == "ideal"


def test_ideal_chip_lights_exactly_the_intended_outputs(rig, mesh):
    before: dict[int, int] = {}
    for seed in (1, 2):
        circuits = random_circuits(16, seed)
        report = mesh.apply(circuits)
        assert report.added == {i: o for i, o in circuits.items() if before.get(i) != o}
        assert report.removed == {i: o for i, o in before.items() if circuits[i] != o}
        before = circuits
        s = shares(rig.chip, circuits)
        assert s.min() > 0.999
        assert mesh.circuits() == circuits
        states = mesh.cell_states()
        assert {v["state"] for v in states.values()} <= {"bar", "cross"}


def test_partial_circuits_are_made_and_read_back(rig, mesh):
    mesh.apply({1: 20, 5: 17})
    assert mesh.circuits() == {1: 20, 5: 17}
    assert shares(rig.chip, {1: 20, 5: 17}).min() > 0.999
    with pytest.raises(CircuitConflict):
        mesh.apply({1: 20, 2: 20})
    with pytest.raises(CircuitConflict):
        mesh.apply({1: 2})


def test_only_changed_heaters_go_on_the_wire(rig, mesh):
    circuits = random_circuits(16, 3)
    mesh.apply(circuits)
    sent, wire = mesh.lines_sent, rig.dac.bytes_in
    mesh.apply(circuits)                       # nothing changes: nothing is sent
    assert (mesh.lines_sent, rig.dac.bytes_in) == (sent, wire)
    swapped = dict(circuits)
    swapped[1], swapped[2] = circuits[2], circuits[1]
    mesh.apply(swapped)                        # a swap touches few cells, in few lines
    assert 0 < mesh.lines_sent - sent <= 7
    assert mesh.circuits() == swapped


@pytest.mark.parametrize("rig", [False], indirect=True)
def test_imperfect_chip_without_calibration_visibly_fails(rig, mesh):
    # Seed 7: random heater offsets (0..2 pi), P_pi 20-25 mW, R +/- 5 %, 2 % coupler errors
    # and crosstalk. With the ideal calibration the intended output gets 8 % of an input's
    # light on average (measured: mean 0.080, median 0.048, best input 0.40, worst 0.0008; an
    # ideal chip gives > 0.999): the light goes almost anywhere.
    circuits = random_circuits(16, 1)
    mesh.apply(circuits)
    s = shares(rig.chip, circuits)
    assert s.mean() < 0.2 and np.median(s) < 0.1 and s.max() < 0.5
    # A calibration that knows the chip (here, read from the truth) fixes it: calibration is
    # both necessary and sufficient.
    good = Mesh(benes(16), mesh.dac, truth_calibration(rig.chip), own_dac=False)
    good.apply(circuits)
    assert shares(rig.chip, circuits).min() > 0.97
    assert good.circuits() == circuits


def truth_calibration(chip) -> Calibration:
    """The calibration that knows the emulated chip (read from its hidden truth)."""
    t = chip.truth()
    return Calibration({ch: HeaterCalibration(float(t.offset_rad[i]), float(t.p_pi_mw[i]),
                                              float(t.resistance_ohm[i]))
                        for i, ch in enumerate(t.channels)}, t.crosstalk, "benes16", "truth")


@pytest.mark.parametrize("rig", [False], indirect=True)
def test_a_running_mesh_takes_a_new_calibration(rig, mesh, tmp_path):
    """`Mesh.load_calibration`: the circuits applied stay made, their heaters derived again
    with the new calibration; a calibration that does not fit is refused before anything
    changes."""
    sent = mesh.lines_sent
    assert mesh.load_calibration(Calibration.ideal(range(56), "benes16")) == 0
    assert mesh.lines_sent == sent                     # no circuits yet: the heaters stay
    circuits = random_circuits(16, 1)
    mesh.apply(circuits)
    assert shares(rig.chip, circuits).mean() < 0.2     # the ideal calibration scrambles them
    path = tmp_path / "truth.json"
    truth = truth_calibration(rig.chip)
    write_calibration(truth, path)
    damaged = tmp_path / "damaged.json"
    damaged.write_bytes(path.read_bytes().replace(b'"p_pi_mw": 2', b'"p_pi_mw": 3', 1))
    before = mesh.dac.voltages()
    for wrong, message in ((replace(truth, chip="benes8"), "for chip 'benes8'"),
                           (Calibration.ideal(range(8), "benes16"), "lacks heater channels"),
                           (damaged, "checksum"), (tmp_path / "none.json", "cannot read")):
        with pytest.raises(CalibrationError, match=message):
            mesh.load_calibration(wrong)
        assert mesh.dac.voltages() == before and mesh.calibration.source == "ideal"
    assert mesh.load_calibration(path) > 0
    assert mesh.calibration.source == str(path) and mesh.calibration.verified
    assert shares(rig.chip, circuits).min() > 0.97
    assert mesh.circuits() == circuits
    sent = mesh.lines_sent
    assert mesh.load_calibration(path) == 0 and mesh.lines_sent == sent   # same: nothing sent


@pytest.mark.parametrize("rig", [False], indirect=True)
def test_settings_kept_for_a_circuit_set_follow_the_calibration(rig, mesh):
    """A circuit set's heater voltages (and a heater vector's cell states) are worked out once
    and kept while the calibration stays: the same as worked out afresh; a new calibration
    works them out again (a kept setting of the old one would scramble the light)."""
    sets = [random_circuits(16, seed) for seed in (1, 2, 3)]
    fresh = mesh.calibration.voltages(mesh.heater_phases(mesh.cell_phases(sets[1])))
    for circuits in sets + sets:                        # the second round from what was kept
        mesh.apply(circuits)
        assert mesh.heater_settings(circuits) == \
            mesh.calibration.voltages(mesh.heater_phases(mesh.cell_phases(circuits)))
    states = mesh.cell_states()
    states[next(iter(states))]["state"] = "changed by the caller"
    assert mesh.cell_states() != states                 # what is kept is not the caller's
    mesh.load_calibration(truth_calibration(rig.chip))
    assert mesh.heater_settings(sets[1]) != fresh
    for circuits in sets:                               # each set seen before, under the old one
        mesh.apply(circuits)
        assert shares(rig.chip, circuits).min() > 0.97
        assert mesh.circuits() == circuits


def test_a_mesh_takes_its_topology_by_name():
    """`Mesh("benes16", dac)` as the docs write it: a name (or a JSON file) is read with
    `read_topology`."""
    mesh = Mesh("benes16", WiredDAC(None, 56))
    assert mesh.topology == benes(16) and mesh.name == "benes16"
    with pytest.raises(TopologyError, match="KIND\\+SIZE"):
        Mesh("benes-16", WiredDAC(None, 56))


# ---- a Clements chip, with the DAC board as a plain test double -------------------------------

class WiredDAC:
    """Stands in for HeaterDAC: voltages go straight to the chip's heaters."""

    def __init__(self, chip, channels):
        self.chip, self.channels = chip, channels
        self.commanded = [0.0] * channels

    def set_voltages(self, values):
        for ch, v in values.items():
            self.commanded[ch] = v
            self.chip.set_voltage(ch, v)
        return 1

    def voltages(self):
        return list(self.commanded)

    def close(self):
        pass


def test_clements_mesh_routes_permutations():
    top = clements(6)
    chip = EmulatedChip(top.describe(), ideal=True, monitors=False, clock=lambda: 1.0)
    chip._clock = lambda: 0.0
    mesh = Mesh(top, WiredDAC(chip, top.channels))
    circuits = {i: o for i, o in zip(range(1, 7), [9, 7, 12, 8, 11, 10], strict=True)}
    mesh.apply(circuits)
    chip._clock = lambda: 1.0
    assert shares(chip, circuits).min() > 0.999
    assert mesh.circuits() == circuits


def test_mesh_refuses_what_it_cannot_drive():
    old = square(3).describe()
    del old["joins"]                 # a description from before the waveguide model
    with pytest.raises(SwitchError, match="joins"):
        Mesh(Topology.from_dict(old), WiredDAC(None, 24))
    with pytest.raises(SwitchError, match="heater channels"):
        Mesh(benes(16), WiredDAC(None, 8))
    with pytest.raises(CalibrationError):
        Mesh(benes(4), WiredDAC(None, 8), Calibration.ideal(range(2)))


def test_circuits_survive_a_dac_power_cycle(rig, mesh):
    circuits = random_circuits(16, 4)
    mesh.apply(circuits)
    rig.dac.replug(power_cycle=True)           # every heater drops to 0 V: the light goes astray
    assert shares(rig.chip, circuits).min() < 0.5
    # The driver reopens the port, sees the power-up and restores the voltages it had set.
    assert mesh.circuits() == circuits
    assert shares(rig.chip, circuits).min() > 0.999
