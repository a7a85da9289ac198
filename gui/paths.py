"""Light paths through a chip drawn from its topology (no Qt here).

A chip service describes its mesh as data (cells and links, see docs/gui.md; read with
`common.topology.Topology.from_dict`, the model every layer shares) and publishes each cell's
state. Where the light of a circuit goes is found by walking the links from the
circuit's input port: a cell in `bar` sends the top input to the top output, in `cross` to the
bottom output, and a `partial` cell sends light to both (the path splits).
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from photonic_testbed.common.topology import Topology

STATES = ("bar", "cross", "partial")

# Cell arms: 0 = top input, 1 = bottom input, 2 = top output, 3 = bottom output.
_FORWARD = {"bar": {0: (2,), 1: (3,)}, "cross": {0: (3,), 1: (2,)}}
_BACKWARD = {"bar": {2: (0,), 3: (1,)}, "cross": {3: (0,), 2: (1,)}}


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
    todo: list[tuple] = [("port", port)]
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
