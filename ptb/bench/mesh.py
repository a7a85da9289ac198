"""Routing speed on chip topologies: Benes looping, recirculating-mesh MILP, and the Clements
decomposition side by side with the `interferometer` package (W. Clements' reference code);
plus `Mesh.apply` end to end over the emulated lumion rig's pty."""
from __future__ import annotations

import functools
import statistics
import time
from collections.abc import Sequence
from typing import Any, cast

import numpy as np

from photonic_testbed.common.topology import benes, hexagonal, square
from photonic_testbed.drivers.heater_dac import HeaterDAC
from photonic_testbed.drivers.mesh import Mesh
from photonic_testbed.drivers.routing import (
    RoutingError,
    benes_route,
    clements_decompose,
    route_mesh,
    route_waveguides,
    trace_waveguides,
)
from photonic_testbed.emulator.rig import EmulatedRig
from photonic_testbed.hil.rig import rig_spec
from photonic_testbed.ptb.bench import SEED, integer

NAME = "mesh"
HELP = "chip routing: Benes looping, 9x9 mesh MILP, Clements vs the interferometer package"



def _route_next(perms) -> object:
    return benes_route(next(perms))

def add_arguments(p) -> None:
    p.add_argument("--repeats", type=integer(1, 10 ** 5), default=20,
                   help="timed runs per Benes size")
    p.add_argument("--mesh-trials", type=integer(1, 10 ** 5), default=5,
                   help="random 16-pair requests")
    p.add_argument("--seed", type=SEED, default=0)


def _median_time(fn, repeats):
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def run(args) -> dict:
    try:
        import interferometer
    except ImportError:
        interferometer = None
    rng = np.random.default_rng(args.seed)
    rows: list[dict] = []
    notes: list[str] = []
    result: dict[str, Any] = {"benes": {}, "clements": {}, "mesh": {}}

    for n in (16, 64, 256, 1024):
        # numpy permutations (as measured before): sequences of ints to benes_route
        perms = [cast(Sequence[int], rng.permutation(n)) for _ in range(args.repeats)]
        it = iter(perms)
        t = _median_time(functools.partial(_route_next, it), args.repeats)
        result["benes"][n] = t
        rows.append({"task": f"Benes looping N={n}", "ours_ms": f"{t * 1e3:.3f}",
                     "reference_ms": "", "ratio": "", "ours_err": "", "reference_err": ""})

    top = square(9)
    for capacity in (2, 1):
        times, routed = [], 0
        for k in range(args.mesh_trials):
            ports = np.random.default_rng([args.seed, k]).permutation(top.ports)[:32] + 1
            pairs = [(int(a), int(b)) for a, b in ports.reshape(16, 2)]
            t = time.perf_counter()
            try:
                route_mesh(top, pairs, capacity=capacity)
                routed += 1
            except RoutingError:
                pass
            times.append(time.perf_counter() - t)
        result["mesh"][capacity] = {"median_s": statistics.median(times), "max_s": max(times),
                                    "routed": routed, "trials": args.mesh_trials}
        rows.append({"task": f"9x9 square mesh, 16 pairs, {capacity} path/cell "
                             f"({routed}/{args.mesh_trials} routable)",
                     "ours_ms": f"{statistics.median(times) * 1e3:.1f} (max "
                                f"{max(times) * 1e3:.0f})",
                     "reference_ms": "", "ratio": "", "ours_err": "", "reference_err": ""})

    # Physically checked routing (what Mesh uses on square and hexagonal chips): along the
    # waveguides joined at the nodes, cells sharing paths only in one state; each route traced.
    result["waveguides"] = {}
    for make in (hexagonal, square):
        top = make(9)
        for count in (4, 8):
            times, routed = [], 0
            for k in range(args.mesh_trials):
                ports = np.random.default_rng([args.seed, k, count]).permutation(top.ports)
                pairs = [(int(a), int(b)) for a, b in (ports[:2 * count] + 1).reshape(count, 2)]
                t = time.perf_counter()
                try:
                    route = route_waveguides(top, pairs, time_limit=2.0)
                except RoutingError:
                    pass
                else:
                    states = {c.id: "bar" for c in top.cells}
                    states.update(route.states)
                    made = trace_waveguides(top, states)
                    routed += all(made.get(min(p)) == max(p) for p in pairs)
                times.append(time.perf_counter() - t)
            result["waveguides"][f"{top.name}/{count}"] = {
                "median_s": statistics.median(times), "max_s": max(times), "routed": routed,
                "trials": args.mesh_trials}
            rows.append({"task": f"{top.name}, {count} pairs along the waveguides "
                                 f"({routed}/{args.mesh_trials} routable)",
                         "ours_ms": f"{statistics.median(times) * 1e3:.1f} (max "
                                    f"{max(times) * 1e3:.0f})",
                         "reference_ms": "", "ratio": "", "ours_err": "", "reference_err": ""})

    from scipy.stats import unitary_group  # 0.8 s to import: not at `ptb --help`
    for n in (8, 32, 64):
        u = unitary_group.rvs(n, random_state=args.seed + n)
        reps = 5 if n < 64 else 3
        ours = _median_time(functools.partial(clements_decompose, u), reps)
        ours_err = float(np.abs(clements_decompose(u).matrix() - u).max())
        row = {"task": f"Clements decomposition N={n}", "ours_ms": f"{ours * 1e3:.2f}",
               "reference_ms": "", "ratio": "", "ours_err": f"{ours_err:.1e}",
               "reference_err": ""}
        entry = {"ours_s": ours, "ours_err": ours_err}
        if interferometer is not None:
            theirs = _median_time(functools.partial(interferometer.square_decomposition, u),
                                  3 if n < 64 else 1)
            dec = interferometer.square_decomposition(u)
            theirs_err = float(np.abs(dec.calculate_transformation() - u).max())
            row.update(reference_ms=f"{theirs * 1e3:.2f}", ratio=f"{theirs / ours:.1f}x",
                       reference_err=f"{theirs_err:.1e}")
            entry.update(reference_s=theirs, reference_err=theirs_err, ratio=theirs / ours)
        result["clements"][n] = entry
        rows.append(row)
    if interferometer is None:
        notes.append("the interferometer package is not installed: Clements timed alone")
    else:
        notes.append("reference: interferometer.square_decomposition (PyPI 'interferometer')")

    with EmulatedRig(rig_spec("lumion"), seed=args.seed, ideal_chip=True) as rig:
        mesh = Mesh(benes(16), HeaterDAC(rig.endpoints["dac"]).__enter__())
        try:
            circuits = [{i + 1: 17 + int(o) for i, o in enumerate(rng.permutation(16))}
                        for _ in range(args.repeats)]
            each = iter(circuits)
            t = _median_time(lambda: mesh.apply(next(each)), args.repeats)
        finally:
            mesh.close()
    result["mesh_apply_s"] = t
    rows.append({"task": "Mesh.apply, random permutation, benes16 over the pty",
                 "ours_ms": f"{t * 1e3:.2f}", "reference_ms": "", "ratio": "", "ours_err": "",
                 "reference_err": ""})
    result["rows"] = rows
    result["notes"] = notes
    return result
