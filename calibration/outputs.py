"""Calibration of a Benes chip from its outputs alone (no cell monitor photodiodes).

A cell's fringe is read as the share of its light that leaves by its bottom output arm,
y = B / (T + B), where T and B are the meter readings (summed over groups of chip outputs)
that carry the light of its top and bottom output arms. The ratio cancels the light reaching
the cell, so the upstream cells need not be calibrated to *deliver* light, only to keep it on
one input arm. Two properties of the Benes network make a start possible without any
calibrated cell:

* up to the middle stage the network is a tree from each input: a cell of the first half is
  reached from input p on at most one arm, whatever the states of the cells before it; lighting
  an input in the cone of one arm lights that arm only.
* from the middle stage on it is a tree towards the outputs: the two output arms of a cell of
  the second half reach disjoint sets of outputs, and the total power on such a set is the
  power that enters it (the cells after are lossless up to a common loss), whatever their
  states: summing the meter over the set reads the arm.

Order (`bootstrap`): the middle stage first (one-arm light from an input, outputs read on the
two output cones), then the second half towards the outputs (light brought along calibrated
cells of the stages before, the cell's other arm kept dark), then the first half towards the
inputs (light from an input of the arm's cone; each output arm carried by calibrated cells up
to the middle stage, whose output arms then have disjoint cones). Every cell is then swept a
second time (`final`) with its light brought along calibrated routes (`progressive.Graph.route`,
the other arm dark) and each output arm carried by calibrated cells to one chip output, so that
the rest of the chip is dark and the two readings hold the cell's light only; the crosstalk
measurement and the refinement of `calibration.crosstalk` then run unchanged on these readings
(the meter takes the place of `PDALL?`).

The progressive machinery is reused as is: `OutputGraph.route` gives every cell a route whose
states include the cells that carry its outputs, and `OutputStation.monitors_ua()` answers a
cell's reading from the power meter.
"""
from __future__ import annotations

import itertools
import logging
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field, fields
from typing import cast

from photonic_testbed.calibration.progressive import CalibrationRunError, Calibrator, Graph, Route
from photonic_testbed.calibration.station import Station, StationError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Plan:
    """How one cell is lit and read: the route (states of calibrated cells) and the chip
    outputs whose powers carry its top and bottom output arms."""
    route: Route
    top: tuple[int, ...]
    bottom: tuple[int, ...]

    @property
    def detector(self) -> str:
        b = "+".join(map(str, self.bottom))
        return f"meter:{b}/({'+'.join(map(str, self.top))}+{b})"


class OutputGraph(Graph):
    """The chip's links, with the input and output cones of every signal, and the plans."""

    def __init__(self, topology):
        super().__init__(topology)
        if topology.kind != "benes":
            raise CalibrationRunError(f"{topology.name}: calibration from the outputs needs the "
                                      "tree structure of a Benes network (a cell of the first "
                                      "half reached on one arm, a cell of the second half "
                                      "read on disjoint outputs)")
        self.stage_of = {c: k for k, stage in enumerate(self.stages) for c in stage}
        self.middle = (len(self.stages) - 1) // 2
        self._in: dict[tuple, frozenset[int]] = {}
        self._out: dict[tuple, frozenset[int]] = {}
        self.mode = "bootstrap"           # or "final"
        self.known: set[str] = set()      # calibrated cells
        self._plans: dict[tuple[str, str], Plan] = {}

    # ---- cones ---------------------------------------------------------------------------

    def in_cone(self, src: tuple) -> frozenset[int]:
        """Chip inputs from which light can reach signal `src` (a port or a cell output)."""
        if src[0] == "port":
            return frozenset({int(src[1])})
        if src not in self._in:
            u = src[1]
            self._in[src] = self.in_cone(self.source[(u, 0)]) | self.in_cone(self.source[(u, 1)])
        return self._in[src]

    def out_cone(self, sig: tuple[str, int]) -> frozenset[int]:
        """Chip outputs that light on cell output (cell, arm) can reach."""
        if sig not in self._out:
            end = self.sink[sig]
            if end[0] == "port":
                self._out[sig] = frozenset({int(end[1])})
            else:
                self._out[sig] = self.out_cone((end[1], 2)) | self.out_cone((end[1], 3))
        return self._out[sig]

    # ---- plans ---------------------------------------------------------------------------

    def plan(self, cell: str) -> Plan:
        key = (self.mode, cell)
        if key not in self._plans:
            if self.mode == "bootstrap":
                route = self._bootstrap_route(cell)
            else:
                route = super().route(cell)
            states, top, bottom = self._outputs(cell, set(route.cells) | set(route.away))
            route = Route(route.port, route.arm, {**route.cells, **states}, route.away, None)
            self._plans[key] = Plan(route, top, bottom)
        return self._plans[key]

    def route(self, cell: str, arm: int | None = None) -> Route:
        """The route of the cell's plan; another input arm than the plan's is not offered
        (a plan's routes hold the cells on both sides of it)."""
        route = self.plan(cell).route
        if arm is not None and arm != route.arm:
            raise CalibrationRunError(f"{cell}: from the outputs it is lit on input arm "
                                      f"{route.arm} only, not {arm}")
        return route

    def bootstrap_routes(self, cell: str, limit: int = 16) -> list[Route]:
        """Up to `limit` bootstrap routes of a cell that light one of its arms only (through
        calibrated cells where there are any before it, the other arm kept dark)."""
        sources = [self.source[(cell, arm)] for arm in (0, 1)]
        found = []
        for arm in (0, 1):
            for states, end in self._traces_back(sources[arm]):
                for port in sorted(self.in_cone(end)):
                    away: dict[str, str] = {}
                    if self._dark(sources[1 - arm], away, set(states) | {cell}, port):
                        found.append(Route(port, arm, states, away, None))
        # spread over both arms and over inputs when there are more than `limit`
        step = max(1, len(found) // limit)
        return found[::step][:limit]

    def use_route(self, cell: str, route: Route) -> None:
        """Bootstrap: light `cell` along this route instead of the one chosen by default."""
        states, top, bottom = self._outputs(cell, set(route.cells) | set(route.away))
        self._plans[("bootstrap", cell)] = Plan(
            Route(route.port, route.arm, {**route.cells, **states}, route.away, None), top, bottom)

    def forget(self) -> None:
        self._plans.clear()

    def _traces_back(self, src: tuple) -> Iterator[tuple[dict[str, str], tuple]]:
        """Paths back from signal `src` through calibrated cells: (states, first signal that
        is a chip input or an uncalibrated cell's output)."""
        if src[0] == "port" or src[1] not in self.known:
            yield {}, src
            return
        u, out = src[1], int(src[2])
        for in_arm in (0, 1):
            for states, end in self._traces_back(self.source[(u, in_arm)]):
                yield {u: self.state_for(in_arm, out), **states}, end

    def _dark(self, src: tuple, assign: dict[str, str], path: set[str], lit: int) -> bool:
        """Choose states of calibrated cells so that no light of input `lit` reaches `src`."""
        if lit not in self.in_cone(src):
            return True
        if src[0] == "port":
            return False
        x, out = src[1], int(src[2])
        if x in path or x not in self.known:
            return False
        if x in assign:
            in_arm = (0, 1)[(assign[x] == "bar") == (out == 3)]
            return self._dark(self.source[(x, in_arm)], assign, path, lit)
        for in_arm in (0, 1):
            trial = dict(assign)
            trial[x] = self.state_for(in_arm, out)
            if self._dark(self.source[(x, in_arm)], trial, path, lit):
                assign.update(trial)
                return True
        return False

    def _bootstrap_route(self, cell: str) -> Route:
        """Light on one input arm of `cell` through calibrated cells only (any before them)."""
        sources = [self.source[(cell, arm)] for arm in (0, 1)]
        fallback: Route | None = None
        for arm in (0, 1):
            for states, end in self._traces_back(sources[arm]):
                for port in sorted(self.in_cone(end)):
                    away: dict[str, str] = {}
                    if self._dark(sources[1 - arm], away, set(states) | {cell}, port):
                        return Route(port, arm, states, away, None)
                    if fallback is None:
                        fallback = Route(port, arm, states, {}, None)
        if fallback is None:
            raise CalibrationRunError(f"{cell}: no chip input reaches it")
        log.warning("%s: no input keeps its second arm dark; its first sweep is approximate",
                    cell)
        return fallback

    def _traces_forward(self, sig: tuple[str, int], depth: int
                        ) -> Iterator[tuple[dict[str, str], tuple[str, int]]]:
        """Paths of `depth` calibrated cells from cell output `sig`: (states, last output)."""
        if depth == 0:
            yield {}, sig
            return
        end = self.sink[sig]
        if end[0] == "port" or end[1] not in self.known:
            return
        d, in_arm = end[1], int(end[2])
        for out in (2, 3):
            for states, last in self._traces_forward((d, out), depth - 1):
                yield {d: self.state_for(in_arm, out), **states}, last

    def _outputs(self, cell: str, upstream: set[str]
                 ) -> tuple[dict[str, str], tuple[int, ...], tuple[int, ...]]:
        """States of calibrated cells after `cell` that carry its two output arms to disjoint
        sets of chip outputs (bootstrap: none when its arms' cones are disjoint already;
        final: to one output each)."""
        top, bottom = (cell, 2), (cell, 3)
        # final plans: carried to one output each by calibrated cells (the rest of the chip
        # is dark then, and fewer ports hold less of the leaks); bootstrap: any disjoint sets
        single = self.mode == "final"
        for depth in range(len(self.stages)):
            for (st_t, end_t), (st_b, end_b) in itertools.product(
                    list(self._traces_forward(top, depth)),
                    list(self._traces_forward(bottom, depth))):
                if set(st_t) & set(st_b) or (set(st_t) | set(st_b)) & upstream:
                    continue
                ct, cb = self.out_cone(end_t), self.out_cone(end_b)
                if single and len(ct) + len(cb) > 2:
                    continue
                if not ct & cb:
                    return {**st_t, **st_b}, tuple(sorted(ct)), tuple(sorted(cb))
        raise CalibrationRunError(f"{cell}: the cells after it are not calibrated: its two "
                                  "outputs cannot be told apart at the chip's outputs")

    def bootstrap_order(self) -> list[str]:
        """Middle stage, then the second half towards the outputs, then the first half
        towards the inputs."""
        order = list(range(self.middle, len(self.stages))) + list(range(self.middle - 1, -1, -1))
        return [c for s in order for c in self.stages[s]]


class _Readings(Mapping):
    """A cell -> reading mapping that reads the meter only for the cells asked for."""

    def __init__(self, station: OutputStation):
        self.station = station
        self._cache: dict[str, float] = {}

    def __getitem__(self, cell: str) -> float:
        if cell not in self._cache:
            self._cache[cell] = self.station.cell_reading(cell)
        return self._cache[cell]

    def __iter__(self):
        return iter([c.id for c in self.station.topology.cells])

    def __len__(self) -> int:
        return len(self.station.topology.cells)


@dataclass
class OutputStation(Station):
    """The station seen by the progressive machinery: a cell's "monitor" is the share of its
    light on the outputs that carry its bottom output arm (meter readings)."""

    graph: OutputGraph = field(kw_only=True)
    base: Station = field(kw_only=True)      # the station this view reads for

    @classmethod
    def over(cls, station: Station, graph: OutputGraph) -> OutputStation:
        """A view of `station` (same instruments, same counters) that reads the outputs; the
        lit input stays the station's own, so the two never disagree about it."""
        view = cls(**{f.name: getattr(station, f.name) for f in fields(Station)},
                   graph=graph, base=station)
        view.monitors = False
        return view

    def light(self, chip_input: int) -> None:
        self.base.light(chip_input)

    def dark(self) -> None:
        self.base.dark()

    def monitors_ua(self) -> Mapping[str, float]:
        return _Readings(self)

    def cell_reading(self, cell: str) -> float:
        plan = self.graph.plan(cell)
        if self.meter is None:
            raise StationError("calibrating from the outputs needs the power meter on the chip "
                               "outputs")
        n = self.topology.ports
        ports = sorted(set(plan.top) | set(plan.bottom))
        power = self.meter.read_power([q - n for q in ports])
        self.counters.meter_reads += 1
        t = sum(power[q - n] for q in plan.top)
        b = sum(power[q - n] for q in plan.bottom)
        if not t + b > 0:
            raise CalibrationRunError(f"{cell}: no light on outputs {', '.join(map(str, ports))} "
                                      f"(lit from input {plan.route.port})")
        return b / (t + b)


def output_calibrator(station: Station, *, state: dict,
                      on_progress: Callable[[str, int, int], None] | None = None,
                      on_checkpoint: Callable[[dict], None] | None = None) -> Calibrator:
    """A Calibrator whose readings come from the chip's outputs."""
    cal = Calibrator(station, state=state, on_progress=on_progress, on_checkpoint=on_checkpoint)
    # the bootstrap reads fringes through uncalibrated cells, weaker and noisier than a
    # photodiode's: two fine rounds of 4 points each (28 readings), where 16 fail some fits on
    # a chip of twice the crosstalk
    cal.sweep_fine_rounds, cal.sweep_fine_offsets_rad = 2, (-0.12, -0.04, 0.04, 0.12)
    use_outputs(cal)
    return cal


def use_outputs(cal: Calibrator) -> Calibrator:
    """Make a Calibrator read its cells from the chip's outputs (final routes through the
    cells it knows): for the crosstalk, the refinement and the drift check."""
    graph = OutputGraph(cal.station.topology)
    graph.mode = "final"
    graph.known = set(cal.state["fits"])
    cal.station = OutputStation.over(cal.station, graph)
    cal.graph = graph
    return cal


def sweep_from_outputs(cal: Calibrator, cells: list[str] | None = None) -> None:
    """The bootstrap sweep of every cell, then the final sweep of `cells` (all when None):
    a cell's final route runs through cells before and after it, which between them are
    usually the whole chip, so every cell is bootstrapped whatever `cells` asks. Resumable:
    `cal.state` records where it stands."""
    graph = cast(OutputGraph, cal.graph)
    order = graph.bootstrap_order()
    if cells is not None:
        unknown = [c for c in cells if c not in graph.stage_of]
        if unknown:
            raise CalibrationRunError(f"no cell {unknown[0]!r} on {graph.topology.name}")
    final = order if cells is None else [c for c in order if c in set(cells)]
    cal.prepare()
    total = len(order) + len(final)
    state = cal.state
    state.setdefault("outputs_pass", "bootstrap")
    final_done = state.setdefault("outputs_final", [])
    if state["outputs_pass"] == "bootstrap":
        graph.mode = "bootstrap"
        for k, cell in enumerate(order):
            if cell not in state["fits"]:
                graph.known = set(state["fits"])
                graph.forget()
                state["fits"][cell] = _bootstrap_sweep(cal, cell)
                cal.on_checkpoint(state)
            cal.on_progress(cell, k + 1, total)
        state["outputs_pass"] = "final"
        cal.on_checkpoint(state)
    graph.mode = "final"
    graph.known = set(state["fits"])
    graph.forget()
    for k, cell in enumerate(final):
        if cell not in final_done:
            state["fits"][cell] = _sweep(cal, cell)
            final_done.append(cell)
            cal.on_checkpoint(state)
        cal.on_progress(cell, len(order) + k + 1, total)


def _sweep(cal: Calibrator, cell: str) -> dict:
    fit = cal.sweep_cell(cell)
    fit.detector = cast(OutputGraph, cal.graph).plan(cell).detector
    return fit.to_dict()


def _contrast(cal: Calibrator, cell: str, route: Route, p_step_mw: float = 11.0) -> float:
    """How strongly the cell's own heater modulates its reading along `route`: four readings
    about a quarter period apart (at a nominal P_pi); the light share the cell receives."""
    graph = cast(OutputGraph, cal.graph)
    graph.use_route(cell, route)
    st = cast(OutputStation, cal.station)
    ch = cal.channel_of[cell]
    st.set_volts({c: 0.0 for c in cal.channels})
    st.set_volts(cal.settings({**graph.route(cell).cells, **route.away}))
    st.light(route.port)
    r = cal.r_ohm[ch]
    ys = []
    for k in range(4):
        st.set_volts({ch: (k * p_step_mw * r / 1000.0) ** 0.5})
        ys.append(st.cell_reading(cell))
    st.set_volts({ch: 0.0})
    return ((ys[0] - ys[2]) ** 2 + (ys[1] - ys[3]) ** 2) ** 0.5


def _bootstrap_sweep(cal: Calibrator, cell: str) -> dict:
    """The first sweep of a cell. Of the routes that light one of its arms only (the cells
    before it that are not calibrated yet take any state), the one that gives the strongest
    modulation is taken: the cell then gets the largest share of the light, and the rest of
    the chip's light, which the cell's heat disturbs through the cells around, the smallest."""
    graph = cast(OutputGraph, cal.graph)
    candidates = graph.bootstrap_routes(cell)
    if len(candidates) > 1:
        ranked = sorted(candidates, key=lambda r: -_contrast(cal, cell, r))
    else:
        ranked = candidates
    if not ranked:
        return _sweep(cal, cell)
    errors: list[CalibrationRunError] = []
    for route in ranked[:4]:
        graph.use_route(cell, route)
        try:
            return _sweep(cal, cell)
        except CalibrationRunError as e:
            log.info("%s lit from input %d: %s; trying another input", cell, route.port, e)
            errors.append(e)
    raise errors[0]
