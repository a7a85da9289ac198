"""Recirculating (square, hexagonal) meshes: the waveguide model at the nodes, the physics
(light both ways, loops) and `Mesh` driving them, end to end over the real wires."""
from __future__ import annotations

import math
from collections import Counter

import numpy as np
import pytest

from photonic_testbed.common.topology import Topology, hexagonal, square
from photonic_testbed.drivers.circuit_switch import CircuitConflict, SwitchError
from photonic_testbed.drivers.heater_dac import HeaterDAC
from photonic_testbed.drivers.mesh import Calibration, Mesh
from photonic_testbed.drivers.routing import (
    BAR,
    RoutingError,
    mzi,
    route_waveguides,
    trace_waveguides,
)
from photonic_testbed.emulator.chip import OUTPUT_TAP, ChipError
from photonic_testbed.emulator.mesh_chip import RecirculatingChip, make_chip
from photonic_testbed.emulator.rig import EmulatedRig
from photonic_testbed.hil.rig import rig_spec


def random_pairs(topology, count, rng):
    ports = rng.choice(np.arange(1, topology.ports + 1), 2 * count, replace=False)
    return [(int(ports[2 * i]), int(ports[2 * i + 1])) for i in range(count)]


def shares(chip, circuits):
    """Each port of each circuit lit alone: the share of the light leaving the chip's ports
    that leaves by the other end of its circuit."""
    out = []
    for a, b in circuits.items():
        for src, dst in ((a, b), (b, a)):
            p = chip.transfer({src: 1.0})
            out.append(p[dst] / sum(p.values()))
    return np.array(out)


class Clock:
    """A test clock for the heaters' thermal lag: each set_states lets the chip settle."""

    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def chip_of(topology, **kw):
    clock = Clock()
    chip = RecirculatingChip(topology.describe(), clock=clock, **kw)
    chip.clock_ = clock
    return chip


def set_states(chip, topology, states):
    full = {c.id: BAR for c in topology.cells}
    full.update(states)
    chip.set_voltages(chip.oracle_voltages(full))
    chip.clock_.now += 1.0                   # thousands of thermal time constants


# ---- the waveguide model -------------------------------------------------------------------------

@pytest.mark.parametrize("make", [hexagonal, square])
def test_every_arm_and_port_is_joined_once_and_only_neighbouring_cells_meet(make):
    t = make(5)
    ends = Counter(tuple(e) for j in t.joins for e in j)
    assert max(ends.values()) == 1
    assert all(ends[("port", p)] == 1 for p in range(1, t.ports + 1))
    for a, b in t.joins:
        assert a != b and not (a[0] == b[0] == "port")
        if a[0] == b[0] == "cell":
            assert a[1] != b[1]
    # An interior node: hexagonal, its 3 cells joined pairwise; square, each cell to its two
    # neighbours around the node, never straight through.
    node = 2 * 5 + 2
    cells = {f"e{k}" for k, e in enumerate(t.edges) if node in e}
    at_node = [(a[1], b[1]) for a, b in t.joins if a[0] == b[0] == "cell" and
               {a[1], b[1]} <= cells and
               all(t.edges[int(x[1][1:])][x[2] // 2] == node for x in (a, b))]
    assert len(at_node) == len(cells) and Counter(c for j in at_node for c in j) == \
        {c: 2 for c in cells}
    if make is square:
        for x, y in at_node:
            # a horizontal cell sits at a half-integer x, a vertical one at an integer x
            assert (t.cell(x).x % 1 == 0) != (t.cell(y).x % 1 == 0)
    assert Topology.from_dict(t.describe()) == t


def test_a_single_cell_is_the_textbook_mzi_both_ways():
    t = square(2)
    chip = chip_of(t, ideal=True, monitors=False)
    for theta in (0.0, 1.1, math.pi):
        set_states(chip, t, {"e0": {"theta": theta}})
        s = chip._scatter().toarray()[:4, :4]
        forward, backward = s[2:, :2], s[:2, 2:]
        want = mzi(theta, 0.0)
        assert np.allclose(forward, want, atol=1e-9)
        assert np.allclose(backward, want.T, atol=1e-9)
        assert np.allclose(forward.conj().T @ forward, np.eye(2), atol=1e-9)
    assert np.allclose(chip.fields(), chip.fields().T)          # reciprocal


@pytest.mark.parametrize("make", [hexagonal, square])
def test_ideal_mesh_routes_random_pairs_with_over_99_percent(make):
    t = make(5)
    chip = chip_of(t, ideal=True)
    rng = np.random.default_rng(11)
    routed = tried = 0
    while routed < 4 and tried < 60:
        tried += 1
        pairs = random_pairs(t, int(rng.integers(1, 4)), rng)
        try:
            route = route_waveguides(t, pairs, time_limit=0.5)
        except RoutingError:
            continue
        routed += 1
        set_states(chip, t, route.states)
        circuits = dict((min(p), max(p)) for p in pairs)
        assert trace_waveguides(t, {**{c.id: BAR for c in t.cells}, **route.states}) \
            .items() >= circuits.items()
        assert shares(chip, circuits).min() > 0.99
    assert routed == 4


@pytest.mark.parametrize("make", [hexagonal, square])
def test_energy_is_conserved_up_to_the_modelled_loss(make):
    t = make(4)
    rng = np.random.default_rng(3)
    ideal = chip_of(t, ideal=True, monitors=False)
    ideal.set_voltages({ch: float(v) for ch, v in
                        zip(ideal.channels, rng.uniform(0, 7, len(ideal.channels)), strict=True)})
    light = {1: 1.0, 6: 2.5}
    out = sum(ideal.transfer(light).values()) / (1 - OUTPUT_TAP) + ideal.free_end_mw(light)
    assert out == pytest.approx(3.5, rel=1e-9)
    lossy = chip_of(t, seed=5)
    lossy.set_voltages({ch: float(v) for ch, v in
                        zip(lossy.channels, rng.uniform(0, 7, len(lossy.channels)), strict=True)})
    out = sum(lossy.transfer(light).values()) / (1 - OUTPUT_TAP) + lossy.free_end_mw(light)
    assert 0.0 < out < 3.5 * 0.99


def test_recirculating_chip_refuses_bad_descriptions_and_ports():
    d = hexagonal(3).describe()
    assert isinstance(make_chip(d), RecirculatingChip)
    bad = dict(d, joins=d["joins"] + [d["joins"][0]])
    with pytest.raises(ChipError, match="twice"):
        RecirculatingChip(bad)
    with pytest.raises(ChipError, match="joins"):
        RecirculatingChip({k: v for k, v in d.items() if k != "joins"})
    chip = RecirculatingChip(d, ideal=True)
    with pytest.raises(ChipError, match="ports"):
        chip.transfer({d["ports"] + 1: 1.0})
    with pytest.raises(ChipError, match="ports"):
        chip.output_power_mw(0)


# ---- Mesh over the real wires --------------------------------------------------------------------

@pytest.fixture
def rig(tmp_path):
    with EmulatedRig(rig_spec("hexmesh"), seed=3, workdir=tmp_path, ideal_chip=True) as r:
        yield r


def test_mesh_drives_a_hexagonal_chip_end_to_end(rig):
    t = hexagonal(4)
    assert rig.chip.ports == t.ports == 16
    mesh = Mesh(t, HeaterDAC(rig.endpoints["dac"], timeout=10.0).__enter__())
    try:
        rng = np.random.default_rng(2)
        done, before = 0, {}
        for _ in range(40):
            pairs = random_pairs(t, 2, rng)
            try:
                report = mesh.apply(pairs)
            except SwitchError as e:
                assert "cannot route" in str(e)
                continue
            circuits = dict((min(p), max(p)) for p in pairs)
            assert report.added == {a: b for a, b in circuits.items() if before.get(a) != b}
            before = circuits
            assert shares(rig.chip, circuits).min() > 0.99
            assert mesh.circuits() == circuits
            assert all(s["state"] in ("bar", "cross") for s in mesh.cell_states().values())
            sent = mesh.lines_sent
            mesh.apply(pairs)                       # nothing changes: nothing on the wire
            assert mesh.lines_sent == sent
            done += 1
            if done == 2:
                break
        assert done == 2
        with pytest.raises(CircuitConflict):
            mesh.apply({3: 3})
        with pytest.raises(CircuitConflict):
            mesh.apply({1: 17})
    finally:
        mesh.close()


def test_unroutable_requests_get_a_clear_error():
    t = square(3)
    # On a square mesh light turns at every node: two ports on the top edge one node apart
    # enter horizontal cells and would need an odd number of cells; this pair has none.
    chip = chip_of(t, ideal=True)

    class Wired:
        channels = 24
        commanded = [0.0] * 24

        def set_voltages(self, values):
            for ch, v in values.items():
                self.commanded[ch] = v
                chip.set_voltage(ch, v)
            return 1

        def close(self):
            pass

    mesh = Mesh(t, Wired())
    bad = None
    for a in range(1, t.ports + 1):
        for b in range(a + 1, t.ports + 1):
            try:
                route_waveguides(t, [(a, b)])
            except RoutingError:
                bad = (a, b)
                break
        if bad:
            break
    assert bad is not None
    with pytest.raises(SwitchError, match="cannot route"):
        mesh.apply([bad])
    everything = [(p, p + 1) for p in range(1, t.ports, 2)]
    with pytest.raises(SwitchError, match="cannot route"):
        mesh.apply(everything)


def test_seeded_hexagonal_chip_needs_calibration():
    """Without calibration (ideal phase law on the seeded chip) the circuits visibly fail;
    with the true parameters (what calibration aims at) they work."""
    t = hexagonal(5)
    chip = chip_of(t, seed=7, monitors=False)
    circuits = {1: 10, 3: 12}
    states = route_waveguides(t, circuits.items()).states
    full = {c.id: BAR for c in t.cells}
    full.update(states)
    ideal = Calibration.ideal(range(t.channels), t.name)     # what Mesh uses uncalibrated
    mesh_volts = ideal.voltages({c.channels[0]: math.pi if full[c.id] == BAR else 0.0
                                 for c in t.cells})
    chip.set_resistances([1000.0] * t.channels)
    chip.set_voltages(mesh_volts)
    chip.clock_.now += 1.0
    uncalibrated = shares(chip, circuits)
    set_states(chip, t, states)
    calibrated = shares(chip, circuits)
    assert uncalibrated.mean() < 0.2          # seed 7: 0.07 on average, best 0.22
    assert calibrated.min() > 0.99
