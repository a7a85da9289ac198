"""Chip topologies and routing: Benes looping, Clements decomposition, mesh MILP, matchings."""
from __future__ import annotations

import itertools
import json
import math
from collections import Counter

import numpy as np
import pytest
from scipy.stats import unitary_group

from photonic_testbed.common.topology import (
    Topology,
    TopologyError,
    benes,
    build,
    clements,
    hexagonal,
    square,
)
from photonic_testbed.drivers.circuit_switch import CircuitConflict
from photonic_testbed.drivers.routing import (
    BAR,
    CROSS,
    RoutingError,
    benes_cell_states,
    benes_route,
    circuits_to_permutation,
    clements_decompose,
    matching_schedule,
    mzi,
    permutation_matrix,
    round_robin,
    route_mesh,
    trace_states,
)

# ---- topology data ---------------------------------------------------------------------------

def test_benes16_shape_matches_the_shared_contract():
    t = benes(16)
    d = json.loads(json.dumps(t.describe()))
    assert d["kind"] == "benes" and d["name"] == "benes16" and d["ports"] == 16
    assert len(d["cells"]) == 56 and t.channels == 56
    assert d["cells"][0] == {"id": "s0r0", "x": 0.0, "y": 0.0, "channels": [0]}
    assert sorted(ch for c in d["cells"] for ch in c["channels"]) == list(range(56))
    # Every input port feeds one cell input, every output port hears one cell output, and
    # every cell arm is used exactly once.
    ends = (Counter(tuple(link["from"]) for link in d["links"])
            + Counter(tuple(link["to"]) for link in d["links"]))
    assert all(v == 1 for v in ends.values())
    assert {e for e in ends if e[0] == "port"} == {("port", p) for p in range(1, 33)}
    assert len([e for e in ends if e[0] == "cell"]) == 56 * 4
    assert Topology.from_dict(d) == t


def test_clements_has_n_n_minus_1_over_2_cells_with_two_heaters():
    for n in (2, 3, 8, 9):
        t = clements(n)
        assert len(t.cells) == n * (n - 1) // 2
        assert max(c.x for c in t.cells) == (n - 1 if n > 2 else 0)
        assert all(len(c.channels) == 2 for c in t.cells)
        assert t.channels == n * (n - 1)


def test_recirculating_meshes_put_ports_on_every_edge_stub():
    sq, hx = square(9), hexagonal(9)
    assert sq.ports == hx.ports == 36
    assert len(sq.cells) == 2 * 9 * 8
    assert len(hx.cells) < len(sq.cells)
    assert max(Counter(v for e in hx.edges for v in e).values()) == 3
    assert Topology.from_dict(json.loads(json.dumps(sq.describe()))) == sq


@pytest.mark.parametrize("bad", [lambda: benes(12), lambda: benes(1), lambda: clements(1),
                                 lambda: square(1), lambda: build("ring", 8),
                                 lambda: Topology.from_dict({"kind": "benes"}),
                                 lambda: benes(4).cell("nope")])
def test_bad_topologies_are_refused_clearly(bad):
    with pytest.raises(TopologyError):
        bad()


# ---- Benes ---------------------------------------------------------------------------------

def _compile(t: Topology):
    """Arrays to trace many state sets at once: next end for each cell output and port."""
    ids = {c.id: k for k, c in enumerate(t.cells)}
    n = t.ports

    def code(end):
        return -int(end[1]) if end[0] == "port" else 4 * ids[end[1]] + int(end[2])

    nxt = {code(a): code(b) for a, b in t.links}
    table = np.zeros(4 * len(t.cells), dtype=int)
    for k in range(len(t.cells)):
        for arm in (2, 3):
            table[4 * k + arm] = nxt[4 * k + arm]
    starts = np.array([nxt[-p] for p in range(1, n + 1)])
    return ids, table, starts


def test_looping_routes_all_40320_permutations_of_8():
    t = benes(8)
    ids, table, starts = _compile(t)
    perms = np.array(list(itertools.permutations(range(8))))
    order = [ids[f"s{s}r{r}"] for s in range(5) for r in range(4)]
    states = np.zeros((len(perms), len(t.cells)), dtype=np.int8)
    for k, p in enumerate(perms):
        states[k, order] = np.frombuffer(b"".join(benes_route(p)), dtype=np.int8)
    end = np.broadcast_to(starts, perms.shape).copy()
    rows = np.arange(len(perms))[:, None]
    while (end >= 0).any():
        live = end >= 0
        cell, arm = np.where(live, end // 4, 0), np.where(live, end % 4, 0)
        cross = states[rows, cell] == 1
        out = np.where(cross, 3 - arm, arm + 2)
        end = np.where(live, table[4 * cell + out], end)
    assert (-end - 9 == perms).all()


@pytest.mark.parametrize("n", [2, 4, 16, 64, 256, 1024])
def test_looping_routes_random_permutations(n):
    rng = np.random.default_rng(n)
    t = benes(n)
    for _ in range(3):
        p = [int(x) for x in rng.permutation(n)]
        assert trace_states(t, benes_cell_states(p)) == p


def test_benes_refuses_non_permutations():
    with pytest.raises(RoutingError):
        benes_route([0, 0, 1, 2])
    with pytest.raises(RoutingError):
        benes_route([0, 1, 2])


def test_partial_circuits_are_completed_with_the_leftover_outputs():
    assert circuits_to_permutation({1: 8, 3: 5}, 4) == [3, 1, 0, 2]
    with pytest.raises(CircuitConflict):
        circuits_to_permutation({1: 2}, 4)


# ---- Clements --------------------------------------------------------------------------------

def test_cell_matrix_is_the_textbook_mzi():
    # theta = pi: bar (top -> top); theta = 0: cross; theta = pi/2 splits 50:50.
    assert np.allclose(np.abs(mzi(math.pi, 0.3)) ** 2, [[1, 0], [0, 1]])
    assert np.allclose(np.abs(mzi(0.0, 0.3)) ** 2, [[0, 1], [1, 0]])
    assert np.allclose(np.abs(mzi(math.pi / 2, 0.0)) ** 2, 0.5)
    b = np.array([[1, 1j], [1j, 1]]) / math.sqrt(2)
    theta, phi = 0.7, 1.9
    expect = b @ np.diag([np.exp(1j * theta), 1]) @ b @ np.diag([np.exp(1j * phi), 1])
    assert np.allclose(mzi(theta, phi), expect)


@pytest.mark.parametrize("n", [2, 3, 4, 5, 8, 9, 16, 32])
def test_clements_rebuilds_random_unitaries(n):
    u = unitary_group.rvs(n, random_state=n)
    dec = clements_decompose(u)
    assert len(dec.cells) == n * (n - 1) // 2
    assert np.abs(dec.matrix() - u).max() < 1e-10
    placed = dec.cell_phases()
    assert set(placed) == {c.id for c in clements(n).cells}


def test_clements_routes_permutations():
    rng = np.random.default_rng(2)
    for _ in range(5):
        p = rng.permutation(8)
        u = permutation_matrix(p)
        assert np.abs(clements_decompose(u).matrix() - u).max() < 1e-10


def test_clements_refuses_non_unitaries():
    with pytest.raises(RoutingError):
        clements_decompose(np.ones((4, 4)))
    with pytest.raises(RoutingError):
        clements_decompose(np.eye(3)[:2])


# ---- recirculating meshes ---------------------------------------------------------------------

def _check_paths(t, route, capacity):
    use = Counter(c for path in route.paths.values() for c in path)
    assert max(use.values(), default=0) <= capacity
    ids = {c.id: k for k, c in enumerate(t.cells)}
    for (a, b), path in route.paths.items():
        node = t.port_nodes[a - 1]
        for cid in path:
            u, v = t.edges[ids[cid]]
            assert node in (u, v)
            node = v if node == u else u
        assert node == t.port_nodes[b - 1]
    assert route.cells_crossed == sum(len(p) for p in route.paths.values())


def test_mesh_route_takes_the_shortest_path_for_one_pair():
    t = square(5)
    r = route_mesh(t, [(1, 11)])          # top-left corner to the bottom-right corner
    assert r.cells_crossed == 8
    _check_paths(t, r, 1)


# Three cells meet at a hexagonal node, so two cell-disjoint paths cannot cross there: a hexagonal
# mesh routes crossing pairs only when a cell's two waveguides may carry a path each.
@pytest.mark.parametrize("maker, capacity", [(square, 1), (hexagonal, 2)])
def test_mesh_routes_random_pairs_disjointly(maker, capacity):
    t = maker(6)
    rng = np.random.default_rng(4)
    ports = rng.permutation(np.arange(1, t.ports + 1))[:8].reshape(4, 2)
    pairs = [tuple(int(x) for x in p) for p in ports]
    r = route_mesh(t, pairs, capacity=capacity)
    _check_paths(t, r, capacity)
    assert set(r.paths) == {(min(a, b), max(a, b)) for a, b in pairs}


def test_mesh_says_clearly_when_pairs_cannot_be_routed():
    t = square(2)                  # 4 nodes, 4 cells, two ports per corner node
    at = {}
    for p, nd in enumerate(t.port_nodes, start=1):
        at.setdefault(nd, []).append(p)
    # Two circuits between each pair of opposite corners need 8 cells; there are 4.
    pairs = [(at[0][0], at[3][0]), (at[0][1], at[3][1]), (at[1][0], at[2][0]),
             (at[1][1], at[2][1])]
    with pytest.raises(RoutingError, match="cannot route"):
        route_mesh(t, pairs)
    r = route_mesh(t, pairs, capacity=2)
    _check_paths(t, r, 2)


def test_mesh_refuses_bad_requests():
    with pytest.raises(RoutingError):
        route_mesh(benes(4), [(1, 2)])
    with pytest.raises(CircuitConflict):
        route_mesh(square(3), [(1, 2), (2, 3)])
    with pytest.raises(CircuitConflict):
        route_mesh(square(3), [(1, 99)])


# ---- matchings -------------------------------------------------------------------------------

@pytest.mark.parametrize("n", range(2, 13))
def test_round_robin_gives_every_pair_once_in_the_fewest_rounds(n):
    rounds = round_robin(n)
    assert len(rounds) == (n - 1 if n % 2 == 0 else n)
    pairs = [p for r in rounds for p in r]
    assert sorted(pairs) == sorted(itertools.combinations(range(1, n + 1), 2))
    for r in rounds:
        ports = [x for p in r for x in p]
        assert len(ports) == len(set(ports)) >= n - 1


def test_matching_schedules_are_routable_on_each_topology():
    sched = matching_schedule(benes(8))
    assert len(sched) == 7
    for circuits in sched:
        p = circuits_to_permutation(circuits, 8)
        assert trace_states(benes(8), benes_cell_states(p)) == p
        assert all(circuits[circuits[a] - 8] == a + 8 for a in circuits)
    assert len(matching_schedule(clements(6))) == 5
    assert len(matching_schedule(square(3), endpoints=6)) == 5
    with pytest.raises(RoutingError):
        matching_schedule(benes(4), endpoints=6)
    with pytest.raises(RoutingError):
        round_robin(1)


def test_states_constants():
    assert (BAR, CROSS) == ("bar", "cross")


def test_two_ports_at_one_corner_node_join_without_crossing_a_cell():
    t = square(3)
    a, b = 1, t.ports                    # the top-left corner has the first and the last port
    assert t.port_nodes[a - 1] == t.port_nodes[b - 1]
    r = route_mesh(t, [(a, b), (2, 5)])
    assert r.paths[(a, b)] == ()
    _check_paths(t, r, 1)
