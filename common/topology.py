"""Chip topologies as data: 2 x 2 MZI cells, the heater channels that set them, and the links.

A chip is a graph of cells. Each cell has four arms: 0 = top input, 1 = bottom input,
2 = top output, 3 = bottom output; a cell is *bar* when its top input leaves by its top output.
Ports follow the CircuitSwitch convention: inputs 1..N on the left, outputs N+1..2N on the right
(a recirculating mesh has ports 1..P around its edge, not split into inputs and outputs).

`Topology.describe()` is the chip-topology shape every piece shares (the chip service sends it
on the bus, the GUI draws it, the emulator builds its physics from it):

    {"kind": "benes" | "clements" | "square" | "hexagonal", "name": "benes16", "ports": N,
     "cells": [{"id": "s0r0", "x": 0.0, "y": 0.0, "channels": [0] or [0, 1]}, ...],
     "links": [{"from": ["port", 1] | ["cell", "s0r0", arm], "to": [...]}, ...]}

`channels` are heater DAC channels, the internal phase first, then the external one if the cell
has one. A recirculating mesh (square, hexagonal) also carries "nodes" and "edges": its cells
sit on the edges of a lattice, light turns at the nodes, and port p enters at a boundary node.

`topology_named("benes16")` builds a topology from its name (docs/chip.md lists the forms);
`topology_from_json(text)` reads a description. Neither touches a file: callers read it.
"""
from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from photonic_testbed.common import nesting

KINDS = ("benes", "clements", "square", "hexagonal")
# Sizes beyond these are typing mistakes, not chips (and would take minutes to build).
MAX_PORTS = {"benes": 1024, "clements": 256}
MAX_SIDE = 64                    # nodes per side of a square or hexagonal lattice


class TopologyError(ValueError):
    """A topology cannot be built as asked, or a description does not hold together: the
    message names the faulty cell, link or field."""


@dataclass(frozen=True)
class Cell:
    id: str
    x: float                     # column (stage), cell units
    y: float                     # row, cell units
    channels: tuple[int, ...]    # heater channels: internal phase, then external phase


def _end(value: Any, cells: Mapping[str, int], ports: int, where: str) -> tuple:
    """A link end as a tuple ("port", p) or ("cell", id, arm), checked against the chip."""
    if isinstance(value, (list, tuple)) and len(value) == 2 and value[0] == "port":
        p = value[1]
        if isinstance(p, bool) or not isinstance(p, int):
            raise TopologyError(f"{where}: port number {p!r} is not an integer")
        if not 1 <= p <= ports:
            raise TopologyError(f"{where}: port {p} is outside 1..{ports}")
        return ("port", p)
    if isinstance(value, (list, tuple)) and len(value) == 3 and value[0] == "cell":
        cell, arm = value[1], value[2]
        if not isinstance(cell, str) or cell not in cells:
            raise TopologyError(f"{where}: cell {cell!r} is not in the topology's cells")
        if isinstance(arm, bool) or arm not in (0, 1, 2, 3):
            raise TopologyError(f"{where}: arm {arm!r} of cell {cell!r} is not 0..3")
        return ("cell", cell, int(arm))
    raise TopologyError(f"{where}: an end is ['port', n] or ['cell', id, arm], not {value!r}")


@dataclass(frozen=True)
class Topology:
    """A checked chip topology. Every link end names a cell of the chip (arm 0..3) or a port
    (1..2N; 1..P on a recirculating mesh), and cell ids are unique: a topology that exists
    holds together, however it was made."""
    kind: str
    name: str
    ports: int
    cells: tuple[Cell, ...]
    links: tuple[tuple[tuple, tuple], ...]       # (from end, to end); an end is a tuple
    # Recirculating meshes only: lattice nodes, the cell on each edge, the node of each port.
    nodes: tuple[tuple[float, float], ...] = ()
    edges: tuple[tuple[int, int], ...] = ()      # edges[k] joins two nodes through cells[k]
    port_nodes: tuple[int, ...] = ()             # port p (1-based) enters at port_nodes[p - 1]
    # Recirculating meshes only: the waveguides joining cell arms (and ports) at the nodes.
    joins: tuple[tuple[tuple, tuple], ...] = ()
    # cell id -> its place in `cells`; both made from the fields above by __post_init__
    _index: dict[str, int] = field(init=False, compare=False, repr=False)
    # link end -> [(link index, the link's other end)]: where light goes from an end
    _touching: dict[tuple, list[tuple[int, tuple]]] = field(init=False, compare=False,
                                                             repr=False)

    def __post_init__(self):
        if self.kind not in KINDS:
            raise TopologyError(f"topology kind {self.kind!r} is not one of {', '.join(KINDS)}")
        if isinstance(self.ports, bool) or not isinstance(self.ports, int) or self.ports < 1:
            raise TopologyError(f"topology ports must be an integer >= 1, not {self.ports!r}")
        index: dict[str, int] = {}
        for k, c in enumerate(self.cells):
            if c.id in index:
                raise TopologyError(f"cell id {c.id!r} appears twice")
            index[c.id] = k
        highest = self.ports if self.kind in ("square", "hexagonal") else 2 * self.ports
        links: list[tuple[tuple, tuple]] = []
        touching: dict[tuple, list[tuple[int, tuple]]] = {}
        for i, (a, b) in enumerate(self.links):
            a = _end(a, index, highest, f"link #{i} from")
            b = _end(b, index, highest, f"link #{i} to")
            links.append((a, b))
            touching.setdefault(a, []).append((i, b))
            touching.setdefault(b, []).append((i, a))
        joins = tuple((_end(a, index, highest, f"join #{i}"), _end(b, index, highest,
                                                                   f"join #{i}"))
                      for i, (a, b) in enumerate(self.joins))
        object.__setattr__(self, "links", tuple(links))
        object.__setattr__(self, "joins", joins)
        object.__setattr__(self, "_index", index)
        object.__setattr__(self, "_touching", touching)

    @property
    def recirculating(self) -> bool:
        return self.kind in ("square", "hexagonal")

    @property
    def channels(self) -> int:
        """Heater channels used (one past the highest channel number)."""
        return 1 + max((ch for c in self.cells for ch in c.channels), default=-1)

    @property
    def touching(self) -> Mapping[tuple, list[tuple[int, tuple]]]:
        """Link end -> [(link index, the link's other end)], for tracing light."""
        return self._touching

    def has_cell(self, cell_id: str) -> bool:
        return cell_id in self._index

    def cell(self, cell_id: str) -> Cell:
        try:
            return self.cells[self._index[cell_id]]
        except KeyError:
            raise TopologyError(f"no cell {cell_id!r} in {self.name}") from None

    def cell_index(self, cell_id: str) -> int:
        self.cell(cell_id)
        return self._index[cell_id]

    def describe(self) -> dict:
        d = {"kind": self.kind, "name": self.name, "ports": self.ports,
             "cells": [{"id": c.id, "x": float(c.x), "y": float(c.y),
                        "channels": list(c.channels)} for c in self.cells],
             "links": [{"from": list(a), "to": list(b)} for a, b in self.links]}
        if self.recirculating:
            d["nodes"] = [[float(x), float(y)] for x, y in self.nodes]
            d["edges"] = [list(e) for e in self.edges]
            d["port_nodes"] = list(self.port_nodes)
            d["joins"] = [[list(a), list(b)] for a, b in self.joins]
        return d

    @classmethod
    def from_dict(cls, d: Any) -> Topology:
        """A topology from its description (`describe()`'s shape, e.g. off the bus)."""
        if not isinstance(d, Mapping):
            raise TopologyError(f"a topology is a dict, not {type(d).__name__}")
        missing = [k for k in ("kind", "name", "ports", "cells", "links") if k not in d]
        if missing:
            raise TopologyError(f"topology lacks {', '.join(missing)}")
        if d["kind"] not in KINDS:
            raise TopologyError(f"topology kind {d['kind']!r} is not one of {', '.join(KINDS)}")
        if not isinstance(d["cells"], list) or not isinstance(d["links"], list):
            raise TopologyError("topology cells and links must be lists")
        cells = []
        for i, c in enumerate(d["cells"]):
            try:
                chans = c["channels"]
                if not isinstance(chans, list) or not all(
                        isinstance(ch, int) and not isinstance(ch, bool) and ch >= 0
                        for ch in chans):
                    raise ValueError("channels must be a list of heater channels >= 0")
                cells.append(Cell(str(c["id"]), _number(c["x"]), _number(c["y"]),
                                  tuple(chans)))
            except (KeyError, TypeError, ValueError) as e:
                raise TopologyError(f"cell #{i} ({c!r}) is malformed: {e}") from None
        links = []
        for i, link in enumerate(d["links"]):
            if not isinstance(link, Mapping) or "from" not in link or "to" not in link:
                raise TopologyError(f"link #{i} needs 'from' and 'to', got {link!r}")
            links.append((link["from"], link["to"]))
        try:
            nodes = tuple((_number(x), _number(y)) for x, y in d.get("nodes", ()))
            edges = tuple((int(a), int(b)) for a, b in d.get("edges", ()))
            port_nodes = tuple(int(n) for n in d.get("port_nodes", ()))
            joins = tuple((tuple(a), tuple(b)) for a, b in d.get("joins", ()))
            ports = d["ports"]
        except (TypeError, ValueError) as e:
            raise TopologyError(f"topology nodes, edges, port_nodes or joins malformed: "
                                f"{e}") from None
        return cls(str(d["kind"]), str(d["name"]), ports, tuple(cells), tuple(links),
                   nodes, edges, port_nodes, joins)


def _number(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{value!r} is not a finite number")
    return float(value)


def cell_id(stage: int, row: int) -> str:
    return f"s{stage}r{row}"


# ---- Benes --------------------------------------------------------------------------------------

def benes_stages(n: int) -> int:
    return 2 * int(math.log2(n)) - 1


def _check_power_of_two(n: int) -> None:
    if isinstance(n, bool) or not isinstance(n, int) or n < 2 or n & (n - 1) or \
            n > MAX_PORTS["benes"]:
        raise TopologyError(f"a Benes network has N = 2^k ports, 2..{MAX_PORTS['benes']}, "
                            f"not {n!r}")


def benes(n: int = 16, name: str | None = None) -> Topology:
    """N x N Benes network: 2 log2 N - 1 stages of N/2 cells; one heater per cell."""
    _check_power_of_two(n)
    stages = benes_stages(n)
    half = n // 2
    cells = tuple(Cell(cell_id(s, r), float(s), float(r), (s * half + r,))
                  for s in range(stages) for r in range(half))
    links: list = []

    def build(m: int, s0: int, r0: int):
        """Wire a Benes subnetwork of size m; returns (input sinks, output sources)."""
        if m == 2:
            cid = cell_id(s0, r0)
            return [("cell", cid, 0), ("cell", cid, 1)], [("cell", cid, 2), ("cell", cid, 3)]
        last = s0 + benes_stages(m) - 1
        up_in, up_out = build(m // 2, s0 + 1, r0)
        lo_in, lo_out = build(m // 2, s0 + 1, r0 + m // 4)
        ins, outs = [], []
        for c in range(m // 2):
            first, final = cell_id(s0, r0 + c), cell_id(last, r0 + c)
            links.append((("cell", first, 2), up_in[c]))
            links.append((("cell", first, 3), lo_in[c]))
            links.append((up_out[c], ("cell", final, 0)))
            links.append((lo_out[c], ("cell", final, 1)))
            ins += [("cell", first, 0), ("cell", first, 1)]
            outs += [("cell", final, 2), ("cell", final, 3)]
        return ins, outs

    ins, outs = build(n, 0, 0)
    links = [(("port", i + 1), sink) for i, sink in enumerate(ins)] + links + \
            [(src, ("port", n + 1 + o)) for o, src in enumerate(outs)]
    return Topology("benes", name or f"benes{n}", n, cells, tuple(links))


# ---- Clements -----------------------------------------------------------------------------------

def clements_cells(n: int) -> list[tuple[int, int]]:
    """(column, top mode) of every cell of an N-mode rectangular mesh, column by column."""
    return [(col, m) for col in range(n) for m in range(col % 2, n - 1, 2)]


def clements(n: int = 8, name: str | None = None) -> Topology:
    """N x N rectangular (Clements) mesh: N columns, N(N-1)/2 cells, two heaters per cell
    (internal theta, external phi on the top input arm)."""
    if isinstance(n, bool) or not isinstance(n, int) or not 2 <= n <= MAX_PORTS["clements"]:
        raise TopologyError(f"a Clements mesh has 2..{MAX_PORTS['clements']} modes, "
                            f"not {n!r}")
    cells = []
    links: list = []
    last: list[tuple] = [("port", m + 1) for m in range(n)]     # what feeds each mode so far
    for k, (col, m) in enumerate(clements_cells(n)):
        cid = cell_id(col, m // 2)
        cells.append(Cell(cid, float(col), m / 2, (2 * k, 2 * k + 1)))
        links.append((last[m], ("cell", cid, 0)))
        links.append((last[m + 1], ("cell", cid, 1)))
        last[m], last[m + 1] = ("cell", cid, 2), ("cell", cid, 3)
    links += [(last[m], ("port", n + 1 + m)) for m in range(n)]
    return Topology("clements", name or f"clements{n}", n, tuple(cells), tuple(links))


# ---- Recirculating meshes ------------------------------------------------------------------------

def _lattice(kind: str, rows: int, cols: int, name: str | None) -> Topology:
    if not all(isinstance(v, int) and not isinstance(v, bool) and 2 <= v <= MAX_SIDE
               for v in (rows, cols)):
        raise TopologyError(f"a {kind} mesh has 2..{MAX_SIDE} nodes a side, not "
                            f"{rows!r} x {cols!r}")
    node = {(r, c): r * cols + c for r in range(rows) for c in range(cols)}
    edges = []
    for r in range(rows):
        for c in range(cols):
            if c + 1 < cols:
                edges.append((node[r, c], node[r, c + 1]))
            # A hexagonal lattice drawn as a brick wall: every other vertical edge.
            if r + 1 < rows and (kind == "square" or (r + c) % 2 == 0):
                edges.append((node[r, c], node[r + 1, c]))
    nodes = tuple((float(c), float(r)) for r in range(rows) for c in range(cols))
    cells = []
    for k, (a, b) in enumerate(edges):
        (xa, ya), (xb, yb) = nodes[a], nodes[b]
        cells.append(Cell(f"e{k}", (xa + xb) / 2, (ya + yb) / 2, (k,)))
    # Undirected adjacency for drawing: cells meeting at a node are linked there.
    at_node: dict[int, list[tuple]] = {}
    for k, (a, b) in enumerate(edges):
        at_node.setdefault(a, []).append(("cell", f"e{k}", 0))
        at_node.setdefault(b, []).append(("cell", f"e{k}", 2))
    # Ports: one per edge stub leaving the lattice (a corner node has two), clockwise from
    # the top-left corner.
    ring = [(0, c) for c in range(cols)] + [(r, cols - 1) for r in range(rows)] + \
           [(rows - 1, c) for c in range(cols - 1, -1, -1)] + \
           [(r, 0) for r in range(rows - 1, -1, -1)]
    port_nodes = tuple(node[rc] for rc in ring)
    links = []
    for p, nd in enumerate(port_nodes, start=1):
        links.append((("port", p), at_node[nd][0]))
    for ends in at_node.values():
        for i in range(len(ends)):
            for j in range(i + 1, len(ends)):
                links.append((ends[i], ends[j]))
    # Stub directions (degrees, counter-clockwise from +x with y up) of the ring's ports.
    stub_angle = [90.0] * cols + [0.0] * rows + [270.0] * cols + [180.0] * rows
    joins = _joins(nodes, edges, port_nodes, stub_angle)
    return Topology(kind, name or f"{kind}{rows}x{cols}", len(port_nodes), tuple(cells),
                    tuple(links), nodes, tuple(edges), port_nodes, joins)


def _joins(nodes, edges, port_nodes, stub_angle) -> tuple:
    """The waveguides at the nodes of a recirculating mesh (docs/chip.md, "Recirculating
    meshes"): a cell on edge (a, b) has its arms 0, 1 at node a and 2, 3 at node b (waveguide
    0: arms 0 and 2, left of the way from a to b). Around each node, counter-clockwise (y up),
    each cell offers two waveguide ends and each port stub one; neighbouring ends of different
    cells (or a cell and a port, never two ports) are joined pairwise, choosing the pairing that
    joins every port and leaves fewest ends free (at most one, terminated)."""
    around: dict[int, list] = {}
    for k, (a, b) in enumerate(edges):
        (xa, ya), (xb, yb) = nodes[a], nodes[b]
        ang = math.degrees(math.atan2(-(yb - ya), xb - xa)) % 360.0
        # At a, looking out along the cell, arm 0 is on the counter-clockwise side; at b arm 2
        # is on the clockwise side.
        around.setdefault(a, []).extend([(ang, 0, ("cell", f"e{k}", 1), k),
                                         (ang, 1, ("cell", f"e{k}", 0), k)])
        back = (ang + 180.0) % 360.0
        around.setdefault(b, []).extend([(back, 0, ("cell", f"e{k}", 2), k),
                                         (back, 1, ("cell", f"e{k}", 3), k)])
    for p, (nd, ang) in enumerate(zip(port_nodes, stub_angle, strict=True), start=1):
        around.setdefault(nd, []).append((ang, 0, ("port", p), None))
    joins: list[tuple[tuple, tuple]] = []
    for nd in sorted(around):
        ends = sorted(around[nd], key=lambda e: (e[0], e[1]))
        n = len(ends)
        pairings: list[tuple[tuple[int, int], list[tuple[tuple, tuple]]]] = []
        for start in range(n):
            pairs, i = [], 0
            while i < n:
                e, f = ends[(start + i) % n], ends[(start + i + 1) % n]
                if i + 1 < n and (e[3] is None or f[3] is None or e[3] != f[3]) and \
                        not (e[3] is None and f[3] is None):
                    pairs.append((e[2], f[2]))
                    i += 2
                else:
                    i += 1
            ports = sum(1 for a, b in pairs for x in (a, b) if x[0] == "port")
            pairings.append(((ports, len(pairs)), pairs))
        # the best score; of equal ones, the first start
        joins += max(pairings, key=lambda scored: scored[0])[1]
    return tuple(joins)


def square(rows: int = 9, cols: int | None = None, name: str | None = None) -> Topology:
    """Recirculating square mesh of rows x cols nodes; a cell on every lattice edge; a port at
    every edge stub of the boundary (4 x side ports)."""
    return _lattice("square", rows, cols if cols is not None else rows, name)


def hexagonal(rows: int = 9, cols: int | None = None, name: str | None = None) -> Topology:
    """Recirculating hexagonal mesh (brick-wall drawing: three cells meet at each node)."""
    return _lattice("hexagonal", rows, cols if cols is not None else rows, name)


def build(kind: str, size: int) -> Topology:
    """A topology by kind and size (N ports for benes/clements, nodes per side for meshes)."""
    makers: dict[str, Callable[[int], Topology]] = {
        "benes": benes, "clements": clements, "square": square, "hexagonal": hexagonal}
    try:
        return makers[kind](size)
    except KeyError:
        raise TopologyError(f"topology kind {kind!r} is not one of {', '.join(KINDS)}") from None


_NAME = re.compile(r"(benes|clements)(\d{1,5})|(square|hexagonal)(\d{1,3})(?:x(\d{1,3}))?")


def topology_named(name: str) -> Topology:
    """The topology a name stands for: "benes16", "clements8" (N ports), "square9" or
    "hexagonal4x5" (nodes per side, rows x columns). A lattice's name is always written
    ROWSxCOLS: topology_named("hexagonal4").name == "hexagonal4x4"."""
    m = _NAME.fullmatch(name) if isinstance(name, str) else None
    if m is None:
        raise TopologyError(f"a topology is named KIND+SIZE (benes16, clements8, square9, "
                            f"hexagonal4x5), not {name!r}")
    if m.group(1):
        return build(m.group(1), int(m.group(2)))
    rows = int(m.group(4))
    cols = int(m.group(5)) if m.group(5) else rows
    return (square if m.group(3) == "square" else hexagonal)(rows, cols)


def topology_from_json(text: str | bytes, where: str = "topology") -> Topology:
    """A topology from the JSON text of its description (what `describe()` gives)."""
    try:
        data = nesting.loads_json(text, where)
    except nesting.NestingError as e:
        raise TopologyError(str(e)) from None
    except ValueError as e:             # (a UnicodeDecodeError is one)
        raise TopologyError(f"{where} is not a JSON topology: {e}") from None
    try:
        return Topology.from_dict(data)
    except TopologyError as e:
        raise TopologyError(f"{where}: {e}") from None
