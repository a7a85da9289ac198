"""Routing on chip topologies: which state each cell takes to make the circuits asked for.

- Benes: the looping algorithm (Waksman 1968; Opferman and Tsao-Wu 1971) routes any
  permutation in O(N log N).
- Clements: any unitary as cell phases on a rectangular mesh (Clements et al., Optica 2016),
  with the MZI of this project: a coupler, the internal phase theta on the top arm, a coupler,
  the external phase phi on the top input (`mzi(theta, phi)`); theta = pi is bar, 0 is cross.
- Recirculating square/hexagonal meshes: edge-disjoint paths for port pairs that cross the
  fewest cells, as an integer program (`scipy.optimize.milp`).
- Matchings: the round-robin schedule of perfect matchings (N - 1 rounds for even N), each
  checked routable on a topology.
"""
from __future__ import annotations

import cmath
import math
import random
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
from scipy import optimize, sparse
from scipy.sparse import csgraph

from photonic_testbed.common.topology import Topology, benes_stages, cell_id
from photonic_testbed.drivers.circuit_switch import check_circuits

BAR, CROSS = "bar", "cross"


class RoutingError(ValueError):
    """The circuits asked for cannot be made on this topology; the message says why."""


# ---- permutations --------------------------------------------------------------------------------

def check_permutation(perm: Sequence[int]) -> list[int]:
    n = len(perm)
    p = [int(x) for x in perm]
    if sorted(p) != list(range(n)):
        raise RoutingError(f"not a permutation of 0..{n - 1}: {list(perm)[:16]}")
    return p


def circuits_to_permutation(circuits: Mapping[int, int], n: int) -> list[int]:
    """{input: output} (ports 1..N -> N+1..2N) -> a full permutation of 0..N-1; inputs left
    out are joined to the outputs left over, in order (their light goes nowhere it should not)."""
    circuits = check_circuits(circuits, n)
    perm = [-1] * n
    for i, o in circuits.items():
        perm[i - 1] = o - n - 1
    free = iter(sorted(set(range(n)) - set(perm)))
    return [p if p >= 0 else next(free) for p in perm]


# ---- Benes: the looping algorithm ----------------------------------------------------------------

def benes_route(perm: Sequence[int], flips: random.Random | None = None) -> list[bytearray]:
    """Cell states for a Benes network routing input i to output perm[i] (0-based).

    Returns one bytearray per stage, one byte per row: 1 = cross, 0 = bar. The looping
    algorithm is free to send each loop's first input to either subnetwork: by default the
    upper one; with `flips`, as that generator draws (another routing of the same permutation,
    the same for the same seed).
    """
    p = check_permutation(perm)
    n = len(p)
    if n < 2 or n & (n - 1):
        raise RoutingError(f"a Benes network has N = 2^k >= 2 ports, not {n}")
    state = [bytearray(n // 2) for _ in range(benes_stages(n))]
    _loop(p, 0, 0, state, flips)
    return state


def _loop(p: list[int], s0: int, r0: int, state: list[bytearray],
          flips: random.Random | None = None) -> None:
    n = len(p)
    if n == 2:
        state[s0][r0] = p[0] != 0
        return
    q = [0] * n
    for i, o in enumerate(p):
        q[o] = i
    sub = [-1] * n                  # 0: upper subnetwork, 1: lower
    for start in range(0, n, 2):
        i = start
        side = flips.getrandbits(1) if flips is not None and sub[i] < 0 else 0
        while sub[i] < 0:
            sub[i] = side
            sub[i ^ 1] = 1 - side
            # the partner's output shares a cell with another output: that one goes the way
            # this one went
            i = q[p[i ^ 1] ^ 1]
    half = n // 2
    first, last = state[s0], state[s0 + 2 * int(math.log2(n)) - 2]
    up = [0] * half
    lo = [0] * half
    for c in range(half):
        a, b = 2 * c, 2 * c + 1
        if sub[a]:
            first[r0 + c] = 1
            up[c], lo[c] = p[b] >> 1, p[a] >> 1
        else:
            up[c], lo[c] = p[a] >> 1, p[b] >> 1
        last[r0 + c] = sub[q[a]]     # output 2c fed from the lower half: cross
    _loop(up, s0 + 1, r0, state, flips)
    _loop(lo, s0 + 1, r0 + half // 2, state, flips)


def benes_cell_states(perm: Sequence[int], flips: random.Random | None = None
                      ) -> dict[str, str]:
    """{cell id: "bar" | "cross"} for a Benes network routing perm (0-based); `flips`: as
    `benes_route`'s."""
    return {cell_id(s, r): CROSS if x else BAR
            for s, row in enumerate(benes_route(perm, flips)) for r, x in enumerate(row)}


# ---- Clements decomposition ----------------------------------------------------------------------

def mzi(theta: float, phi: float) -> np.ndarray:
    """Ideal cell: 50:50 coupler, theta on the top arm, 50:50 coupler, phi on the top input."""
    b = np.array([[1, 1j], [1j, 1]]) / math.sqrt(2)
    return b @ np.diag([np.exp(1j * theta), 1]) @ b @ np.diag([np.exp(1j * phi), 1])


@dataclass(frozen=True)
class Decomposition:
    """U = diag(exp(i output_phases)) @ (cells applied in order on modes (m, m + 1))."""
    n: int
    cells: tuple[tuple[int, float, float], ...]     # (top mode m, theta, phi), first applied first
    output_phases: np.ndarray

    def matrix(self) -> np.ndarray:
        u = np.eye(self.n, dtype=complex)
        for m, theta, phi in self.cells:
            u[m:m + 2, :] = mzi(theta, phi) @ u[m:m + 2, :]
        return np.exp(1j * self.output_phases)[:, None] * u

    def cell_phases(self) -> dict[str, tuple[float, float]]:
        """{cell id: (theta, phi)} on the Clements topology of the same N."""
        depth = [0] * self.n
        out = {}
        for m, theta, phi in self.cells:
            col = max(depth[m], depth[m + 1])
            if col % 2 != m % 2:
                col += 1
            depth[m] = depth[m + 1] = col + 1
            out[cell_id(col, m // 2)] = (theta, phi)
        if len(out) != len(self.cells) or max(depth) > self.n:
            raise RoutingError("decomposition does not fit the rectangular mesh")
        return out


def clements_decompose(u: np.ndarray, atol: float = 1e-8) -> Decomposition:
    """Decompose an N x N unitary into N(N-1)/2 cells on a rectangular mesh."""
    u = np.array(u, dtype=complex)
    if u.ndim != 2 or u.shape[0] != u.shape[1] or u.shape[0] < 2:
        raise RoutingError(f"need a square matrix of size >= 2, not shape {u.shape}")
    n = u.shape[0]
    if not np.allclose(u.conj().T @ u, np.eye(n), atol=atol):
        raise RoutingError("the matrix is not unitary (U^dagger U != I)")
    right: list[tuple[int, float, float]] = []
    left: list[tuple[int, float, float]] = []
    # mzi(theta, phi) = i e^{i theta/2} [[s e^{i phi}, c], [c e^{i phi}, -s]], s = sin(theta/2),
    # c = cos(theta/2): written out, since building 2 x 2 matrices per cell costs more than the
    # row and column updates themselves.
    for i in range(n - 1):
        if i % 2 == 0:
            for j in range(i + 1):          # null U[n-1-j, i-j] from the right: U <- U M^+
                r, m = n - 1 - j, i - j
                x, y = complex(u[r, m]), complex(u[r, m + 1])
                half = math.atan2(abs(y), abs(x))
                phi = cmath.phase(-x / y) if y != 0 else 0.0
                s, c = math.sin(half), math.cos(half)
                g = -1j * cmath.exp(-1j * half)
                e = cmath.exp(-1j * phi)
                a, b = u[:, m].copy(), u[:, m + 1].copy()
                u[:, m] = (g * s * e) * a + (g * c) * b
                u[:, m + 1] = (g * c * e) * a - (g * s) * b
                right.append((m, 2 * half, phi))
        else:
            for j in range(i + 1):          # null U[n-1-i+j, j] from the left: U <- M U
                r, col = n - 1 - i + j, j
                m = r - 1
                x, y = complex(u[m, col]), complex(u[r, col])
                half = math.atan2(abs(x), abs(y))
                phi = cmath.phase(y / x) if x != 0 else 0.0
                s, c = math.sin(half), math.cos(half)
                g = 1j * cmath.exp(1j * half)
                e = cmath.exp(1j * phi)
                a, b = u[m, :].copy(), u[r, :].copy()
                u[m, :] = (g * s * e) * a + (g * c) * b
                u[r, :] = (g * c * e) * a - (g * s) * b
                left.append((m, 2 * half, phi))
    # U = L1^+ ... Lk^+ D R_p ... R_1; move each L^+ through D: L^+ D = D' M(theta, phi').
    d = np.diag(u).copy()
    moved = []
    for m, theta, phi in reversed(left):
        d1, d2 = d[m], d[m + 1]
        g = -cmath.exp(-1j * theta)
        moved.append((m, theta, cmath.phase(d1 / d2)))
        d[m], d[m + 1] = g * cmath.exp(-1j * phi) * d2, g * d2
    cells = tuple(right) + tuple(moved)
    return Decomposition(n, cells, np.angle(d))


def permutation_matrix(perm: Sequence[int]) -> np.ndarray:
    p = check_permutation(perm)
    u = np.zeros((len(p), len(p)))
    u[p, range(len(p))] = 1.0
    return u


# ---- Recirculating meshes: edge-disjoint paths by integer programming ----------------------------

@dataclass(frozen=True)
class MeshRoute:
    paths: dict[tuple[int, int], tuple[str, ...]]    # (port a, port b) -> cell ids crossed
    cells_crossed: int


def route_mesh(topology: Topology, pairs: Iterable[tuple[int, int]], capacity: int = 1,
               time_limit: float = 10.0) -> MeshRoute:
    """Edge-disjoint paths joining each pair of edge ports, crossing the fewest cells in all.

    `capacity` is how many paths one cell may carry: 1 gives edge-disjoint paths; 2 lets a
    cell's two waveguides carry one path each (a tunable basic unit in bar state).
    """
    if capacity not in (1, 2):
        raise RoutingError(f"a cell carries 1 or 2 paths, not {capacity!r}")
    if not topology.recirculating:
        raise RoutingError(f"{topology.name} is not a recirculating mesh")
    pairs = list(check_circuits(list(pairs), topology.ports, split=False).items())
    if not pairs:
        return MeshRoute({}, 0)
    edges = np.asarray(topology.edges)
    n_nodes, n_edges, k = len(topology.nodes), len(edges), len(pairs)
    # Arc 2e goes edges[e][0] -> edges[e][1], arc 2e+1 the other way.
    tail = np.empty(2 * n_edges, dtype=int)
    head = np.empty(2 * n_edges, dtype=int)
    tail[0::2], head[0::2] = edges[:, 0], edges[:, 1]
    tail[1::2], head[1::2] = edges[:, 1], edges[:, 0]
    n_arcs = 2 * n_edges
    # Flow conservation per commodity and node: out - in = +1 at source, -1 at sink.
    arcs = np.arange(n_arcs)
    rows, cols, vals = [], [], []
    rhs = np.zeros(k * n_nodes)
    for c, (a, b) in enumerate(pairs):
        base = c * n_arcs
        rows += [c * n_nodes + tail, c * n_nodes + head]
        cols += [base + arcs, base + arcs]
        vals += [np.ones(n_arcs), -np.ones(n_arcs)]
        rhs[c * n_nodes + topology.port_nodes[a - 1]] += 1
        rhs[c * n_nodes + topology.port_nodes[b - 1]] -= 1
    flow = sparse.csr_array((np.concatenate(vals), (np.concatenate(rows), np.concatenate(cols))),
                            shape=(k * n_nodes, k * n_arcs))
    # Each cell carries at most `capacity` paths (in either direction).
    cap_rows = np.tile(np.repeat(np.arange(n_edges), 2), k)
    cap = sparse.csr_array((np.ones(k * n_arcs), (cap_rows, np.arange(k * n_arcs))),
                           shape=(n_edges, k * n_arcs))
    # No path re-enters its source or leaves its sink: these bounds cost nothing in optimality
    # and make the relaxation much tighter (the 9 x 9 benchmark solves at the root node).
    upper = np.ones((k, n_arcs))
    for c, (a, b) in enumerate(pairs):
        upper[c, head == topology.port_nodes[a - 1]] = 0
        upper[c, tail == topology.port_nodes[b - 1]] = 0
    # Ties between equally short routings leave the relaxation fractional; a tiny, fixed
    # preference per cell (all of them together worth less than one cell) breaks them.
    tie = np.random.default_rng(len(edges)).random(n_edges) / (2.0 * n_edges * k + 1.0)
    cost = 1.0 + np.tile(np.repeat(tie, 2), k)
    constraints = [optimize.LinearConstraint(flow, rhs, rhs),
                   optimize.LinearConstraint(cap, 0, capacity)]
    bounds = optimize.Bounds(0, upper.ravel())
    # The relaxation is usually integral already (a linear program, solved in a fraction of the
    # time of the integer program); branch and bound only when it is not.
    res = optimize.milp(cost, constraints=constraints, bounds=bounds)
    if res.status == 0 and np.abs(res.x - np.round(res.x)).max() > 1e-6:
        # A lower bound on the cells crossed (the tie-breaks add less than half a cell).
        fewest = math.ceil(res.fun - 0.5 - 1e-9)
        options = {"time_limit": time_limit,
                   # stop once no routing with one cell fewer can exist
                   "mip_rel_gap": 0.5 / (capacity * n_edges + 1)}
        integer = np.ones(k * n_arcs)
        # First on the arcs the relaxation uses: if that reaches the bound, it is optimal.
        support = optimize.Bounds(0, np.where(res.x > 1e-9, upper.ravel(), 0.0))
        small = optimize.milp(cost, constraints=constraints, integrality=integer,
                              bounds=support, options=options)
        if small.status == 0 and math.floor(small.fun + 1e-9) == fewest:
            res = small
        else:
            res = optimize.milp(cost, constraints=constraints, integrality=integer,
                                bounds=bounds, options=options)
    if res.status == 2 or res.x is None:
        raise RoutingError(f"cannot route {pairs} on {topology.name}: no set of cell-disjoint "
                           f"paths joins these ports")
    if res.status != 0:
        raise RoutingError(f"routing {len(pairs)} pairs on {topology.name} failed: {res.message}")
    x = res.x.reshape(k, n_arcs) > 0.5
    paths = {}
    for c, (a, b) in enumerate(pairs):
        nxt = {int(tail[e]): e for e in np.flatnonzero(x[c])}
        node, goal, path = topology.port_nodes[a - 1], topology.port_nodes[b - 1], []
        while node != goal:
            e = nxt.pop(node)
            path.append(topology.cells[e // 2].id)
            node = int(head[e])
        paths[(a, b)] = tuple(path)
    return MeshRoute(paths, int(np.floor(res.fun + 1e-9)))


# ---- Matchings -----------------------------------------------------------------------------------

def round_robin(n: int) -> list[list[tuple[int, int]]]:
    """Perfect matchings of ports 1..n giving every pair once: n - 1 rounds for even n (the
    circle method), n rounds with one port idle in each for odd n."""
    if not isinstance(n, int) or n < 2:
        raise RoutingError(f"a schedule of matchings needs at least 2 ports, not {n!r}")
    players = list(range(1, n + 1)) + ([None] if n % 2 else [])
    m = len(players)
    rounds = []
    for _ in range(m - 1):
        pairs = [(players[i], players[m - 1 - i]) for i in range(m // 2)]
        rounds.append([(min(a, b), max(a, b)) for a, b in pairs if a is not None and b is not None])
        players = [players[0], players[-1]] + players[1:-1]
    return rounds


def matching_circuits(pairs: Iterable[tuple[int, int]], n: int) -> dict[int, int]:
    """On a split N x N switch, a matching of endpoints 1..N (endpoint g sends on input g and
    hears on output N + g) is the circuits a -> N + b and b -> N + a."""
    circuits = {}
    for a, b in pairs:
        circuits[a] = n + b
        circuits[b] = n + a
    return check_circuits(circuits, n)


def matching_schedule(topology: Topology, endpoints: int | None = None) -> list[dict[int, int]]:
    """Round-robin matchings over `endpoints` (default: every port), each checked routable on
    the topology; returns each round's circuits."""
    n = topology.ports if endpoints is None else endpoints
    if not 2 <= n <= topology.ports:
        raise RoutingError(f"{topology.name} has {topology.ports} ports; cannot match {n}")
    schedule = []
    for rnd in round_robin(n):
        if topology.recirculating:
            route_mesh(topology, rnd)
            schedule.append(dict(rnd))
            continue
        circuits = matching_circuits(rnd, topology.ports)
        perm = circuits_to_permutation(circuits, topology.ports)
        if topology.kind == "benes":
            benes_route(perm)
        else:
            dec = clements_decompose(permutation_matrix(perm))
            dec.cell_phases()
        schedule.append(circuits)
    return schedule


def trace_states(topology: Topology, states: Mapping[str, str]) -> list[int]:
    """Follow each input through bar/cross cells of a feed-forward topology: the permutation
    (0-based) the cells make. A cell left out, or "partial", stops with a RoutingError."""
    n = topology.ports
    return [trace_path(topology, states, i)[1] - n - 1 for i in range(1, n + 1)]


Segment = tuple[str, int]          # a waveguide leaving a cell: (cell id, output arm 2 | 3)


def trace_path(topology: Topology, states: Mapping[str, str], port: int
               ) -> tuple[list[Segment], int]:
    """Where input `port` goes through bar/cross cells of a feed-forward topology: the
    waveguides it leaves each cell by, in order, and the output port it reaches."""
    if topology.recirculating:
        raise RoutingError(f"{topology.name} is a recirculating mesh: no input/output order")
    nxt = _links_of(topology)
    end = nxt[("port", port)]
    path: list[Segment] = []
    while end[0] == "cell":
        _, cid, arm = end
        state = states.get(cid)
        if state == BAR:
            out = arm + 2
        elif state == CROSS:
            out = 3 - arm
        else:
            raise RoutingError(f"cell {cid} is {state!r}, neither bar nor cross")
        path.append((cid, out))
        end = nxt[("cell", cid, out)]
    return path, int(end[1])


_LINKS: dict[int, tuple[Topology, dict]] = {}


def _links_of(topology: Topology) -> dict:
    """The topology's links as {from: to}, worked out once per topology."""
    kept = _LINKS.get(id(topology))
    if kept is None or kept[0] is not topology:
        kept = _LINKS[id(topology)] = (topology, {a: b for a, b in topology.links})
    return kept[1]


def avoiding(topology: Topology, perm: Sequence[int], inputs: Iterable[int],
             avoid: Iterable[Segment], moved: Iterable[int] = (), tries: int = 256
             ) -> tuple[dict[str, str], int, int]:
    """A Benes routing of `perm` (0-based) in which the paths of `inputs` (ports 1..N) cross
    the `avoid` waveguides as seldom as can be found, the paths of `moved` (some of `inputs`)
    first: the looping algorithm's routing, then others drawn with seeds 0, 1, ... (`tries`
    in all; the same answer every time). Returns the cell states, how many of the `moved`
    paths still cross an avoided waveguide, and how many crossings all `inputs` make."""
    avoid = frozenset(avoid)
    inputs, moved = sorted(set(inputs) | set(moved)), frozenset(moved)
    best: tuple[int, int, dict[str, str]] | None = None
    for seed in range(-1, tries - 1):
        states = benes_cell_states(perm, None if seed < 0 else random.Random(seed))
        moved_crossing = crossings = 0
        for i in inputs:
            n = len(avoid.intersection(trace_path(topology, states, i)[0]))
            crossings += n
            moved_crossing += bool(n) and i in moved
        if best is None or (moved_crossing, crossings) < best[:2]:
            best = (moved_crossing, crossings, states)
        if not crossings:
            break
    assert best is not None
    return best[2], best[0], best[1]


# ---- Recirculating meshes, waveguide by waveguide ---------------------------------------------

@dataclass(frozen=True)
class WaveguideRoute:
    """Paths a recirculating mesh can make: each path is its cells in order, with the arm the
    light enters and the arm it leaves; `states` sets each crossed cell (bar or cross)."""
    paths: dict[tuple[int, int], tuple[tuple[str, int, int], ...]]
    states: dict[str, str]
    cells_crossed: int


def route_waveguides(topology: Topology, pairs: Iterable[tuple[int, int]],
                     time_limit: float = 10.0) -> WaveguideRoute:
    """Paths joining each pair of edge ports that the mesh's waveguides can make, crossing
    the fewest cells in all (`scipy.optimize.milp`, multicommodity flow).

    `route_mesh` routes on the lattice graph, where a path may go straight through a square
    node; on the chip light leaving a cell can only reach the cells its waveguide is joined to
    at the node (`Topology.joins`). Here the vertices are the joins and each cell is four arcs
    (either input arm to either output arm: bar or cross) in each direction. Each waveguide
    carries at most one path, and a binary state per cell lets two paths share a cell (one on
    each waveguide) only when both need the same state, so every route found is physically
    realisable and fixes every crossed cell.
    """
    if not topology.recirculating:
        raise RoutingError(f"{topology.name} is not a recirculating mesh")
    if not topology.joins:
        raise RoutingError(f"{topology.name} has no waveguide joins (an old description?)")
    pairs = list(check_circuits(list(pairs), topology.ports, split=False).items())
    if not pairs:
        return WaveguideRoute({}, {}, 0)
    where: dict[tuple, int] = {}
    for j, (one, other) in enumerate(topology.joins):
        where[tuple(one)] = where[tuple(other)] = j
    port_join = {}
    for p in range(1, topology.ports + 1):
        if ("port", p) not in where:
            raise RoutingError(f"port {p} of {topology.name} is joined to no waveguide")
        port_join[p] = where[("port", p)]
    tails: list[int] = []
    heads: list[int] = []
    cells: list[int] = []
    arc_arms: list[tuple[int, int]] = []
    for index, cell in enumerate(topology.cells):
        for i in (0, 1):
            for o in (2, 3):
                ji, jo = where.get(("cell", cell.id, i)), where.get(("cell", cell.id, o))
                if ji is None or jo is None:
                    continue
                tails += [ji, jo]
                heads += [jo, ji]
                cells += [index, index]
                arc_arms += [(i, o), (o, i)]
    tail, head, arc_cell = np.array(tails), np.array(heads), np.array(cells)
    n_v, n_a, n_c, k = len(topology.joins), len(tail), len(topology.cells), len(pairs)
    # Quick refusal: ports no walk along the waveguides joins (on a square mesh, light turns
    # at every node, which splits the ports into classes that never meet).
    _, part = csgraph.connected_components(
        sparse.csr_array((np.ones(n_a), (tail, head)), shape=(n_v, n_v)), directed=False)
    apart = [(a, b) for a, b in pairs if part[port_join[a]] != part[port_join[b]]]
    if apart:
        raise RoutingError(f"cannot route {apart} on {topology.name}: no waveguide path joins "
                           f"these ports whatever the cell states")
    arcs = np.arange(n_a)
    rows, cols, vals = [], [], []
    rhs = np.zeros(k * n_v)
    upper = np.ones((k, n_a))
    for c, (a, b) in enumerate(pairs):
        rows += [c * n_v + tail, c * n_v + head]
        cols += [c * n_a + arcs, c * n_a + arcs]
        vals += [np.ones(n_a), -np.ones(n_a)]
        rhs[c * n_v + port_join[a]] += 1
        rhs[c * n_v + port_join[b]] -= 1
        upper[c, head == port_join[a]] = 0
        upper[c, tail == port_join[b]] = 0
        # a path touches no other request's port (its light would leave the chip there)
        for q, (x, y) in enumerate(pairs):
            if q != c:
                for p in (x, y):
                    upper[c, (head == port_join[p]) | (tail == port_join[p])] = 0
    n_x = k * n_a
    flow = sparse.csr_array((np.concatenate(vals), (np.concatenate(rows), np.concatenate(cols))),
                            shape=(k * n_v, n_x + n_c))
    # Each waveguide (cell arm) carries at most one path.
    arm_i = np.array([4 * c + i for c, (i, o) in zip(arc_cell, arc_arms, strict=True)])
    arm_o = np.array([4 * c + o for c, (i, o) in zip(arc_cell, arc_arms, strict=True)])
    arm_rows = np.concatenate([np.tile(arm_i, k), np.tile(arm_o, k)])
    arm_cap = sparse.csr_array((np.ones(2 * n_x), (arm_rows, np.tile(np.arange(n_x), 2))),
                               shape=(4 * n_c, n_x + n_c))
    # A cell is bar or cross (s = 1): the paths through it all need that state.
    bar = np.array([i % 2 == o % 2 for i, o in arc_arms])
    b_rows = np.concatenate([np.tile(np.where(bar, arc_cell, arc_cell + n_c), k),
                             np.arange(n_c), n_c + np.arange(n_c)])
    b_cols = np.concatenate([np.arange(n_x), n_x + np.arange(n_c), n_x + np.arange(n_c)])
    b_vals = np.concatenate([np.ones(n_x), np.full(n_c, 2.0), np.full(n_c, -2.0)])
    state = sparse.csr_array((b_vals, (b_rows, b_cols)), shape=(2 * n_c, n_x + n_c))
    tie = np.random.default_rng(n_c).random(n_c) / (2.0 * n_c * k + 1.0)
    cost = np.concatenate([1.0 + np.tile(tie[arc_cell], k), np.zeros(n_c)])
    constraints = [optimize.LinearConstraint(flow, rhs, rhs),
                   optimize.LinearConstraint(arm_cap, 0, 1),
                   optimize.LinearConstraint(state, -np.inf,
                                             np.concatenate([np.full(n_c, 2.0),
                                                             np.zeros(n_c)]))]
    bounds = optimize.Bounds(0, np.concatenate([upper.ravel(), np.ones(n_c)]))
    options = {"time_limit": time_limit, "mip_rel_gap": 0.5 / (2 * n_c + 1)}
    # First the easy problem: every cell carries at most one path (no state variables; the
    # relaxation is usually integral). Only when that fails may paths share cells.
    cell_cap = sparse.csr_array((np.ones(n_x), (np.tile(arc_cell, k), np.arange(n_x))),
                                shape=(n_c, n_x + n_c))
    strict = [constraints[0], optimize.LinearConstraint(cell_cap, 0, 1)]
    alone = optimize.Bounds(0, np.concatenate([upper.ravel(), np.zeros(n_c)]))
    res = optimize.milp(cost, constraints=strict, bounds=alone)
    if res.status == 0 and np.abs(res.x - np.round(res.x)).max() > 1e-6:
        res = optimize.milp(cost, constraints=strict, integrality=np.ones(n_x + n_c),
                            bounds=alone, options=options)
    if res.status != 0 or res.x is None:
        res = optimize.milp(cost, constraints=constraints, integrality=np.ones(n_x + n_c),
                            bounds=bounds, options=options)
    if res.status == 2 or (res.x is None and res.status == 0):
        raise RoutingError(f"cannot route {pairs} on {topology.name}: no set of paths along "
                           f"its waveguides joins these ports (a cell carries two paths only "
                           f"when both need the same state)")
    if res.x is None:
        raise RoutingError(f"routing {len(pairs)} pairs on {topology.name} failed: {res.message}")
    x = res.x[:n_x].reshape(k, n_a) > 0.5
    paths, states = {}, {}
    for c, (a, b) in enumerate(pairs):
        nxt = {int(tail[e]): int(e) for e in np.flatnonzero(x[c])}
        v, goal, path = port_join[a], port_join[b], []
        while v != goal:
            if v not in nxt:
                raise RoutingError(f"routing {len(pairs)} pairs on {topology.name}: the solver "
                                   f"returned no consistent path for {(a, b)} ({res.message})")
            e = nxt.pop(v)
            cid = topology.cells[arc_cell[e]].id
            i, o = arc_arms[e]
            path.append((cid, i, o))
            states[cid] = BAR if i % 2 == o % 2 else CROSS
            v = int(head[e])
        paths[(a, b)] = tuple(path)
    return WaveguideRoute(paths, states, sum(len(p) for p in paths.values()))


def trace_waveguides(topology: Topology, states: Mapping[str, str]) -> dict[int, int]:
    """Follow the light from each port of a recirculating mesh through bar/cross cells: the
    circuits {a: b} (a < b) it makes; light ending at a free waveguide end, in a loop, or at a
    cell neither bar nor cross joins nothing."""
    if not topology.recirculating:
        raise RoutingError(f"{topology.name} is not a recirculating mesh")
    other = {}
    for a, b in topology.joins:
        other[tuple(a)], other[tuple(b)] = tuple(b), tuple(a)
    made = {}
    for p in range(1, topology.ports + 1):
        end = other.get(("port", p))
        for _ in range(4 * len(topology.cells) + 2):
            if end is None or end[0] == "port":
                break
            _, cid, arm = end
            state = states.get(cid)
            if state not in (BAR, CROSS):
                end = None
                break
            side = 2 if arm < 2 else -2                  # to the other end of the cell
            out = arm + side if state == BAR else (arm ^ 1) + side
            end = other.get(("cell", cid, out))
        else:
            end = None
        if end is not None and end[0] == "port" and p < int(end[1]):
            made[p] = int(end[1])
    return made
