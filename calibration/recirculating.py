"""Routes of light for the progressive calibration of a recirculating (square, hexagonal) mesh.

A cell of such a mesh has its arms 0, 1 at one node and 2, 3 at the other; the topology's `joins`
say which arm is joined by a waveguide to which (a port, another cell's arm, or nothing: a free,
terminated end). Light entering arms 0, 1 leaves by 2, 3 and the reverse; bar joins 0-2 and 1-3,
cross 0-3 and 1-2, either way. The monitor photodiode taps the light leaving by arm 3 after
entering by arm 0 or 1, so a cell is read with light on one of its arms 0, 1: then, as on a
feed-forward mesh, it follows `mean + amp cos(theta)` (arm 0; theta + pi from arm 1).

Nothing goes one way only here, so a route is more than a path in. For cell X lit on input arm i:

* the **path**: from a chip port through calibrated cells (a shortest one; the cell that feeds
  arm i from its arm 3 reads the light entering X on its own photodiode, the reference, and the
  arm with one is preferred), each set bar or cross to carry the light on;
* the **dark feed** (`away`): the cells feeding X's other input arm are set so that it takes its
  light from a free end or an unlit port, never from a cell that the lit path or X's own output
  crosses: the splitters' leaks then reach it only through two leaks;
* the **dumps**: X's two output arms are carried by calibrated cells, set for the shortest way
  to a port or a free end, out of the chip. Left to cells in unknown states, X's own light goes
  round the mesh's loops and part of it comes back into X's input arms, where it interferes
  with the light coming in: the fringe is no longer a cosine (offsets 0.1-0.2 rad off on the
  seeded hexagonal 4 x 4 chip, where every cell's outputs go into the unknown).

Only calibrated cells can be set, so a route depends on what is known: while the cells are swept
one by one, the dumps and the dark feed go as far as the calibrated cells allow, and once every
cell is known (the crosstalk, the refinements, the extinctions) every route is whole. The cells
neither on a route nor set by it stay at zero power. The order (`order`) takes next the cell
whose route is most complete, then the nearest to a port; a sweep that cannot be fitted yet
(on a square mesh, whose loops are four cells short, some early cells' own light comes back
too strongly) waits until more cells are known (`retry_later`). The sweeps are only a start:
the refinements after the crosstalk (calibration.crosstalk, calibration.run) measure every cell
again with its whole route.
"""
from __future__ import annotations

from collections import deque
from collections.abc import Callable, Collection, Iterator, Mapping

from photonic_testbed.calibration.progressive import (
    BAR,
    CROSS,
    CalibrationRunError,
    Route,
    UnlitArm,
)
from photonic_testbed.common.topology import Topology

End = tuple          # ("cell", id, arm) or ("port", p)


def state_for(in_arm: int, out_arm: int) -> str:
    """The state that joins two arms at opposite ends of a cell (either way round)."""
    return BAR if in_arm % 2 == out_arm % 2 else CROSS


def far_side(arm: int) -> tuple[int, int]:
    """The arms at the other end of the cell from `arm`."""
    return (2, 3) if arm < 2 else (0, 1)


class MeshGraph:
    """A recirculating mesh's waveguides, the order in which its cells can be calibrated, and
    the route that lights a cell through the cells `known()` (calibrated) at the time."""

    def __init__(self, topology: Topology, known: Callable[[], Collection[str]]):
        if not topology.recirculating:
            raise CalibrationRunError(f"{topology.name} is not a recirculating mesh")
        if not topology.joins:
            raise CalibrationRunError(f"{topology.name}: a recirculating mesh needs its "
                                      "waveguide joins (Topology.joins) to be calibrated")
        self.topology = topology
        self.known = known
        self.joined: dict[End, End] = {}
        for a, b in topology.joins:
            self.joined[tuple(a)] = tuple(b)
            self.joined[tuple(b)] = tuple(a)
        self._index = {c.id: k for k, c in enumerate(topology.cells)}
        self._routes: dict[tuple, Route] = {}
        self._order, self._needs = self._progressive_order()
        self.unreachable = [c.id for c in topology.cells if c.id not in self._needs]
        # a sweep that fails (its own light comes back through cells in unknown states) is
        # tried again once more cells are calibrated (Calibrator.calibrate_cells)
        self.retry_later = True

    # ---- the order ---------------------------------------------------------------------------

    def order(self) -> list[str]:
        """Cells in calibration order: each can be lit through cells before it."""
        return list(self._order)

    def needs(self, cell: str) -> set[str]:
        """The cells that must be calibrated before `cell` (its path in)."""
        try:
            return set(self._needs[cell])
        except KeyError:
            raise CalibrationRunError(f"{self.topology.name}: cell {cell} cannot be lit on an "
                                      "input arm (0 or 1) from any port through the "
                                      "waveguides: its photodiode never sees a fringe") from None

    def _progressive_order(self) -> tuple[list[str], dict[str, set[str]]]:
        """Greedy: of the cells a path reaches through those already ordered, next the one
        whose route is most complete (its outputs carried out of the chip and its other input
        dark, through ordered cells or straight out: no light of its own comes back into the
        fringe), then with the shortest path (one with a reference first), then the
        topology's order."""
        known: set[str] = set()
        order: list[str] = []
        needs: dict[str, set[str]] = {}
        left = [c.id for c in self.topology.cells]
        while left:
            best = None
            for cell in left:
                found = self._best_path(cell, None, known)
                if found is None:
                    continue
                no_reference, length, arm = found[0]
                port, _, path, _ = found[1]
                missed = min(self._surround(cell, arm, port, path, known, dark_first)[0][0]
                             for dark_first in (True, False))
                key = (missed, length, no_reference, self._index[cell])
                if best is None or key < best[0]:
                    best = (key, cell, path)
            if best is None:
                break
            _, cell, path = best
            order.append(cell)
            needs[cell] = set(path)
            known.add(cell)
            left.remove(cell)
        return order, needs

    # ---- routes ------------------------------------------------------------------------------

    def route(self, cell: str, arm: int | None = None) -> Route:
        """Light on input arm `arm` of `cell` (or the arm preferred: a reference, then the
        shorter path) with its dark feed and dumps, through the cells known now."""
        if cell not in self._index:
            raise CalibrationRunError(f"no cell {cell!r} in {self.topology.name}")
        if arm is not None and arm not in (0, 1):
            raise ValueError(f"a cell is lit on its input arm 0 or 1, not {arm!r}")
        known = frozenset(self.known()) - {cell}
        key = (cell, arm, known)
        if key not in self._routes:
            self._routes[key] = self._route(cell, arm, known)
        return self._routes[key]

    def _route(self, cell: str, arm: int | None, known: frozenset[str]) -> Route:
        found = self._best_path(cell, arm, known)
        if found is None:
            where = f"on its input arm {arm}" if arm is not None else "on an input arm"
            raise UnlitArm(f"{self.topology.name}: cell {cell} cannot be lit {where} from a "
                           "port through the calibrated cells")
        _, (port, lit_arm, path, reference) = found
        # the dark feed and the dumps compete for the cells around: try either first, keep
        # the one that completes more of them, then the one that sets fewer cells
        _, dumps, dark = min((self._surround(cell, lit_arm, port, path, known, dark_first)
                              for dark_first in (True, False)), key=lambda option: option[0])
        return Route(port, lit_arm, {**path, **dumps}, dark, reference)

    def _surround(self, cell: str, lit_arm: int, port: int, path: dict[str, str],
                  known: Collection[str], dark_first: bool
                  ) -> tuple[tuple[int, int], dict[str, str], dict[str, str]]:
        """((ways not found, cells set), dumps, dark feed) around a lit path."""
        other_in = self.joined.get(("cell", cell, 1 - lit_arm))
        taken = dict(path)
        dark = self._dark(other_in, cell, port, known, taken) if dark_first else None
        taken.update(dark or {})
        dumps: dict[str, str] = {}
        missed = 0
        for out in (3, 2):
            way = self._exit(self.joined.get(("cell", cell, out)), cell, known, taken)
            if way is None:
                missed += 1
                continue
            dumps.update(way)
            taken.update(way)
        if not dark_first:
            dark = self._dark(other_in, cell, port, known, taken)
        return (missed + (dark is None), len(dumps) + len(dark or {})), dumps, dark or {}

    def _best_path(self, cell: str, arm: int | None, known: Collection[str]):
        """((preference), (port, arm, path states, reference)) of the best way in, or None."""
        best = None
        for a in ((0, 1) if arm is None else (arm,)):
            src = self.joined.get(("cell", cell, a))
            path = self._path_in(src, cell, known)
            if path is None:
                continue
            port, states = path
            reference = src[1] if src is not None and src[0] == "cell" and src[2] == 3 else None
            key = (reference is None, len(states), a)
            if best is None or key < best[0]:
                best = (key, (port, a, states, reference))
        return best

    def _path_in(self, src: End | None, cell: str, known: Collection[str]
                 ) -> tuple[int, dict[str, str]] | None:
        """A shortest path of light from a port to the input fed by `src` (the end joined to
        it), through known cells, each crossed once: (port, {cell: state})."""
        for end, states in self._walk(src, cell, known, {}):
            if end is not None:
                return int(end[1]), states
        return None

    def _dark(self, src: End | None, cell: str, lit: int, known: Collection[str],
              taken: dict[str, str]) -> dict[str, str] | None:
        """States of free known cells (fewest) that make the input fed by `src` take its light
        from a free end or a port other than `lit`, through no cell already `taken` and not
        through `cell` itself (its own output would come back); None when there are none."""
        for end, states in self._walk(src, cell, known, taken):
            if end is None or (end[0] == "port" and int(end[1]) != lit):
                return states
        return None

    def _exit(self, end: End | None, cell: str, known: Collection[str],
              taken: dict[str, str]) -> dict[str, str] | None:
        """States of free known cells (fewest) that carry light entering at `end` (joined to
        an output arm of `cell`) out of the chip, to a port or a free end; None when it
        cannot be carried out (it then meets cells in unknown states)."""
        for last, states in self._walk(end, cell, known, taken):
            if last is None or last[0] == "port":
                return states
        return None

    def _walk(self, start: End | None, cell: str, known: Collection[str],
              taken: Mapping[str, str]) -> Iterator[tuple[End | None, dict[str, str]]]:
        """Breadth first from `start` (an end joined to an arm of `cell`) through free known
        cells (not `cell`, not `taken`, none twice), each set to join the arm the light goes
        through to either arm at its other end: every port or free end (None) reached, with
        the states that lead there, nearest first. Light goes either way along what this
        finds, so it serves the way in, the dark feed and the way out alike. Each end is
        passed once (the first time is by the shortest way), which keeps the search to the
        mesh's size."""
        queue: deque = deque([(start, {})])
        seen: set = set()
        while queue:
            end, states = queue.popleft()
            if end is None or end[0] == "port":
                yield end, states
                continue
            _, other, arm = end
            if other == cell or other in taken or other in states or other not in known or \
                    end in seen:
                continue
            seen.add(end)
            for far in far_side(arm):
                queue.append((self.joined.get(("cell", other, far)),
                              {**states, other: state_for(arm, far)}))
