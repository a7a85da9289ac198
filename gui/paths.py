"""Light paths through a chip drawn from its topology (no Qt here).

A chip service describes its mesh as data (cells and links, see docs/gui.md) and publishes
each cell's state. Where the light of a circuit goes is found by walking the links from the
circuit's input port: a cell in `bar` sends the top input to the top output, in `cross` to the
bottom output, and a `partial` cell sends light to both (the path splits).
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

STATES = ("bar", "cross", "partial")
KINDS = ("benes", "clements", "square", "hexagonal")

# Cell arms: 0 = top input, 1 = bottom input, 2 = top output, 3 = bottom output.
_FORWARD = {"bar": {0: (2,), 1: (3,)}, "cross": {0: (3,), 1: (2,)}}
_BACKWARD = {"bar": {2: (0,), 3: (1,)}, "cross": {3: (0,), 2: (1,)}}


class TopologyError(ValueError):
    """A chip topology that cannot be drawn: the message names the faulty cell or link."""


def _endpoint(value: Any, cells: set[str], where: str) -> tuple:
    if not isinstance(value, (list, tuple)) or not value:
        raise TopologyError(f"{where}: an endpoint is ['port', n] or ['cell', id, arm], "
                            f"not {value!r}")
    if value[0] == "port" and len(value) == 2:
        try:
            return ("port", int(value[1]))
        except (TypeError, ValueError):
            raise TopologyError(f"{where}: port number {value[1]!r} is not an integer") from None
    if value[0] == "cell" and len(value) == 3:
        cell, arm = str(value[1]), value[2]
        if cell not in cells:
            raise TopologyError(f"{where}: cell {cell!r} is not in the topology's cells")
        if arm not in (0, 1, 2, 3):
            raise TopologyError(f"{where}: arm {arm!r} of cell {cell!r} is not 0..3")
        return ("cell", cell, int(arm))
    raise TopologyError(f"{where}: an endpoint is ['port', n] or ['cell', id, arm], "
                        f"not {value!r}")


@dataclass(frozen=True)
class Cell:
    id: str
    x: float
    y: float
    channels: tuple[int, ...]


@dataclass
class Topology:
    """A checked chip topology with the index that path tracing needs."""
    kind: str
    name: str
    ports: int
    cells: dict[str, Cell]
    links: list[tuple[tuple, tuple]]
    # endpoint -> [(link index, the link's other endpoint)]
    touching: dict[tuple, list[tuple[int, tuple]]] = field(default_factory=dict)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "Topology":
        if not isinstance(data, Mapping):
            raise TopologyError(f"a topology is a dict, not {type(data).__name__}")
        missing = [k for k in ("kind", "name", "ports", "cells", "links") if k not in data]
        if missing:
            raise TopologyError(f"topology lacks {', '.join(missing)}")
        if data["kind"] not in KINDS:
            raise TopologyError(f"topology kind {data['kind']!r} is not one of {', '.join(KINDS)}")
        try:
            ports = int(data["ports"])
        except (TypeError, ValueError):
            raise TopologyError(f"topology ports {data['ports']!r} is not an integer") from None
        if ports < 1:
            raise TopologyError(f"topology ports must be >= 1, not {ports}")
        cells: dict[str, Cell] = {}
        for i, c in enumerate(data["cells"]):
            try:
                cell = Cell(str(c["id"]), float(c["x"]), float(c["y"]),
                            tuple(int(ch) for ch in c.get("channels", ())))
            except (KeyError, TypeError, ValueError) as e:
                raise TopologyError(f"cell #{i} ({c!r}) is malformed: {e}") from None
            if cell.id in cells:
                raise TopologyError(f"cell id {cell.id!r} appears twice")
            cells[cell.id] = cell
        names = set(cells)
        links = []
        touching: dict[tuple, list[tuple[int, tuple]]] = {}
        for i, link in enumerate(data["links"]):
            if not isinstance(link, Mapping) or "from" not in link or "to" not in link:
                raise TopologyError(f"link #{i} needs 'from' and 'to', got {link!r}")
            a = _endpoint(link["from"], names, f"link #{i} from")
            b = _endpoint(link["to"], names, f"link #{i} to")
            for p in (a, b):
                if p[0] == "port" and not 1 <= p[1] <= 2 * ports:
                    raise TopologyError(f"link #{i}: port {p[1]} is outside 1..{2 * ports}")
            links.append((a, b))
            touching.setdefault(a, []).append((i, b))
            touching.setdefault(b, []).append((i, a))
        return cls(str(data["kind"]), str(data["name"]), ports, cells, links, touching)


@dataclass
class LightPath:
    """Where the light injected at one input port goes."""
    start: int
    links: set[int] = field(default_factory=set)
    passes: set[tuple[str, int, int]] = field(default_factory=set)   # (cell, arm in, arm out)
    ends: set[int] = field(default_factory=set)                       # ports reached
    split: bool = False                                               # through a partial cell


def cell_routes(state: str, arm: int) -> tuple[int, ...]:
    """Arms that light entering `arm` of a cell in `state` leaves by."""
    if state == "partial":
        return (2, 3) if arm in (0, 1) else (0, 1)
    table = _FORWARD if arm in (0, 1) else _BACKWARD
    try:
        return table[state][arm]
    except KeyError:
        raise ValueError(f"cell state {state!r} is not one of {', '.join(STATES)}") from None


def trace(topology: Topology, cells: Mapping[str, Mapping[str, Any]], port: int) -> LightPath:
    """Follow the light from `port` through the links and the cells' states.

    A cell with no published state is treated as a dead end (the light is not drawn past it):
    the GUI does not guess hardware state.
    """
    path = LightPath(port)
    todo = [("port", port)]
    seen: set[tuple] = set()
    while todo:
        here = todo.pop()
        if here in seen:
            continue
        seen.add(here)
        for index, there in topology.touching.get(here, ()):
            if index in path.links:
                continue
            path.links.add(index)
            if there[0] == "port":
                path.ends.add(there[1])
                continue
            _, cell, arm = there
            state = cells.get(cell, {}).get("state")
            if state not in STATES:
                continue
            if state == "partial":
                path.split = True
            for out in cell_routes(state, arm):
                path.passes.add((cell, arm, out))
                todo.append(("cell", cell, out))
    path.ends.discard(port)
    return path
