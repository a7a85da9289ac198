"""Scoring a calibration against the emulated chip's hidden truth (tests only).

The oracle is the chip's own `oracle_voltages`: the settings from the true offsets, P_pi, R and
crosstalk; splitter errors bound what it reaches, and a calibration is scored relative to it.
"""
from __future__ import annotations

import math
from contextlib import contextmanager

import numpy as np

from photonic_testbed.common.topology import benes, topology_named
from photonic_testbed.drivers.heater_dac import HeaterDAC
from photonic_testbed.drivers.laser import Laser
from photonic_testbed.drivers.ocs import OpticalCircuitSwitch
from photonic_testbed.drivers.power_meter import PowerMeter
from photonic_testbed.drivers.routing import benes_cell_states
from photonic_testbed.emulator.chip import cell_matrix
from photonic_testbed.emulator.rig import EmulatedRig
from photonic_testbed.hil.rig import rig_spec

N = 16


@contextmanager
def lumion_station(seed: int, tmp_path, crosstalk_scale: float = 1.0, monitors: bool = True):
    """The lumion rig (zero delays) and a calibration Station on its wires; `monitors=False`:
    its chip has no cell photodiodes."""
    with rig_station("lumion", seed, tmp_path, crosstalk_scale, monitors) as (rig, station):
        yield rig, station


@contextmanager
def rig_station(name: str, seed: int, tmp_path, crosstalk_scale: float = 1.0,
                monitors: bool = True):
    """An emulated rig with a chip (zero delays) and a calibration Station on its wires."""
    from photonic_testbed.calibration.station import Station
    spec = rig_spec(name)
    topology = topology_named(spec.chip_topology)
    with EmulatedRig(spec, seed=seed, workdir=tmp_path, switching_s=0.0,
                     crosstalk_scale=crosstalk_scale, chip_monitors=monitors) as rig:
        ep = rig.endpoints
        # generous timeouts: the emulator shares this process's CPU, on a machine that may be
        # busy (a lab's instruments answer in milliseconds)
        dac = HeaterDAC(ep["dac"], timeout=10.0)
        dac.open()
        selector = OpticalCircuitSwitch(ep["ocs"], timeout_s=10.0)
        meter = PowerMeter(ep["powermeter"], ports=topology.ports, timeout_s=10.0)
        for port in range(1, topology.ports + 1):
            meter.set_averaging_time(port, 0.0)
        laser = Laser(ep["laser"], timeout_s=10.0)
        laser.set_power_mw(1.0)
        laser.on()
        try:
            yield rig, Station(topology, dac, selector, meter)
        finally:
            for d in (dac, selector, meter, laser):
                d.close()


def _db(x):
    return 10.0 * np.log10(np.maximum(x, 1e-30))


def cell_extinctions(rig, dac, volts: dict[int, float], state: str) -> np.ndarray:
    """Per cell, the worse of its two inputs' extinction (dB) in `state` with these volts."""
    dac.set_voltages(volts)
    chip = rig.chip
    t = chip.truth()
    ph = chip.phases()
    m = cell_matrix(ph, np.zeros_like(ph), t.couplers[:, 0], t.couplers[:, 1], 0.0)
    p = np.abs(m) ** 2
    if state == "bar":
        e = np.minimum(p[:, 0, 0] / p[:, 1, 0], p[:, 1, 1] / p[:, 0, 1])
    else:
        e = np.minimum(p[:, 1, 0] / p[:, 0, 0], p[:, 0, 1] / p[:, 1, 1])
    return _db(e)


def extinction_scores(rig, dac, calibration) -> dict:
    chans = sorted(calibration.heaters)
    out = {}
    for state, theta in (("bar", math.pi), ("cross", 0.0)):
        ours = cell_extinctions(rig, dac, calibration.voltages({c: theta for c in chans}), state)
        oracle = cell_extinctions(rig, dac, rig.chip.oracle_voltages(
            {c: state for c in rig.chip.cell_ids}), state)
        out[state] = (ours, oracle)
    return out


def extinction_ok(ours: np.ndarray, oracle: np.ndarray) -> np.ndarray:
    return (ours >= oracle - 1.0) | ((oracle >= 40.0) & (ours >= 40.0))


def permutation_scores(rig, dac, calibration, perms: int, seed: int = 11) -> dict:
    """For random permutations: per input, intended-output power (dB) and worst crosstalk into
    another output (dB, relative to the input), ours and the oracle's."""
    from photonic_testbed.drivers.mesh import Mesh
    mesh = Mesh(benes(N), dac, calibration, own_dac=False)
    rng = np.random.default_rng(seed)
    res = {"ours_main": [], "oracle_main": [], "ours_xt": [], "oracle_xt": []}
    for _ in range(perms):
        perm = rng.permutation(N)
        circuits = {i + 1: N + 1 + int(perm[i]) for i in range(N)}
        for who in ("ours", "oracle"):
            if who == "ours":
                mesh.apply(circuits)
            else:
                states = benes_cell_states(perm)
                dac.set_voltages(rig.chip.oracle_voltages(states))
            power = np.abs(rig.chip.fields()) ** 2          # (outputs, inputs)
            main = power[perm, np.arange(N)]
            other = power.copy()
            other[perm, np.arange(N)] = 0.0
            res[f"{who}_main"].append(_db(main))
            res[f"{who}_xt"].append(_db(other.max(axis=0)))
        mesh._active = None
    return {k: np.array(v) for k, v in res.items()}


def wrapped(x):
    """Angles (rad) folded into [-pi, pi)."""
    return (np.asarray(x) + math.pi) % (2 * math.pi) - math.pi


def heater_errors(rig, calibration) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per heater of the chip (its channel order): |offset error| (rad), |efficiency error|
    (a fraction) and |resistance error| (a fraction) of a calibration against the truth."""
    truth = rig.chip.truth()
    chans = list(truth.channels)
    if sorted(calibration.heaters) != sorted(chans):
        raise AssertionError(f"the calibration has heaters {sorted(calibration.heaters)}, the "
                             f"chip {chans}")
    hs = [calibration.heaters[c] for c in chans]
    off = np.abs(wrapped(np.array([h.offset_rad for h in hs]) - truth.offset_rad))
    eff = np.abs(truth.p_pi_mw / np.array([h.p_pi_mw for h in hs]) - 1)
    r = np.abs(np.array([h.r_ohm for h in hs]) / truth.resistance_ohm - 1)
    return off, eff, r


def permutation_errors(rig, dac, calibration, perms: int) -> tuple[float, float]:
    """Over random permutations: the largest |intended output - the oracle's| (dB) and the
    largest excess of the worst crosstalk over the oracle's worst (dB)."""
    s = permutation_scores(rig, dac, calibration, perms=perms)
    main = float(np.abs(s["ours_main"] - s["oracle_main"]).max())
    xt = float((s["ours_xt"].max(axis=1) - s["oracle_xt"].max(axis=1)).max())
    return main, xt


# ---- recirculating meshes (the hexmesh rig) ----------------------------------------------------

def random_circuits(topology, sets: int, pairs: int, seed: int = 5) -> list[dict[int, int]]:
    """`sets` sets of `pairs` circuits each (port pairs {a: b}, a < b) that the waveguides of a
    recirculating mesh can make."""
    from photonic_testbed.drivers.routing import RoutingError, route_waveguides
    rng = np.random.default_rng(seed)
    out: list[dict[int, int]] = []
    for _ in range(50 * sets):
        if len(out) == sets:
            break
        ports = rng.choice(np.arange(1, topology.ports + 1), 2 * pairs, replace=False)
        circuits = {int(min(ports[2 * i], ports[2 * i + 1])): int(max(ports[2 * i],
                                                                       ports[2 * i + 1]))
                    for i in range(pairs)}
        try:
            route_waveguides(topology, circuits.items())
        except RoutingError:
            continue
        out.append(circuits)
    if len(out) < sets:
        raise AssertionError(f"only {len(out)} routable sets of {pairs} circuits found")
    return out


def circuit_scores(rig, dac, calibration, circuit_sets) -> dict:
    """Each set of circuits made on a recirculating chip by the Mesh with `calibration`, and
    with the oracle's settings of the same cell states: each end of each circuit lit alone, the
    power leaving by its other end and the most leaving by any other port (dB of the light put
    in), ours and the oracle's: per set, an array over its circuit ends."""
    from photonic_testbed.drivers.mesh import Mesh
    topology = topology_named(rig.spec.chip_topology)
    mesh = Mesh(topology, dac, calibration, own_dac=False)
    res: dict[str, list] = {"ours_main": [], "oracle_main": [], "ours_xt": [], "oracle_xt": []}
    for circuits in circuit_sets:
        thetas = {cid: theta for cid, (theta, _) in mesh.cell_phases(circuits).items()}
        for who in ("ours", "oracle"):
            if who == "ours":
                mesh.apply(circuits)
            else:
                dac.set_voltages(rig.chip.oracle_voltages(thetas))
            power = np.abs(rig.chip.fields()) ** 2          # (port out, port in)
            main, other = [], []
            for a, b in circuits.items():
                for src, dst in ((a, b), (b, a)):
                    col = power[:, src - 1].copy()
                    main.append(col[dst - 1])
                    col[dst - 1] = 0.0
                    other.append(col.max())
            res[f"{who}_main"].append(_db(np.array(main)))
            res[f"{who}_xt"].append(_db(np.array(other)))
        mesh._active = None
    return res


def circuit_errors(rig, dac, calibration, circuit_sets) -> tuple[float, float]:
    """Over the sets of circuits: the largest |intended output - the oracle's| (dB) of any
    circuit end, and the largest excess of a set's worst light at another port over the
    oracle's worst (dB)."""
    s = circuit_scores(rig, dac, calibration, circuit_sets)
    main = max(float(np.abs(o - r).max())
               for o, r in zip(s["ours_main"], s["oracle_main"], strict=True))
    xt = max(float(o.max() - r.max()) for o, r in zip(s["ours_xt"], s["oracle_xt"], strict=True))
    return main, xt


def main(argv: list[str] | None = None) -> int:
    """`python -m tests.calibration_score`: calibrate a seeded chip (the lumion rig's, or the
    hexmesh rig's) through its wires and print its scores against the truth (BENCHMARKS.md
    and docs/calibration.md quote it)."""
    import argparse
    import tempfile
    import time

    from photonic_testbed.calibration.run import calibrate
    p = argparse.ArgumentParser(prog="python -m tests.calibration_score",
                                description=main.__doc__)
    p.add_argument("--rig", choices=("lumion", "hexmesh"), default="lumion")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--crosstalk-scale", type=float, default=1.0)
    p.add_argument("--method", choices=("monitors", "outputs"), default="monitors")
    p.add_argument("--perms", type=int, default=100,
                   help="random permutations scored (hexmesh: sets of 1..3 circuits)")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp, \
            rig_station(args.rig, args.seed, tmp, crosstalk_scale=args.crosstalk_scale,
                        monitors=args.method == "monitors") as (rig, station):
        t0 = time.perf_counter()
        cal = calibrate(station, rig=args.rig, method=args.method)
        wall = time.perf_counter() - t0
        err, eff, _ = heater_errors(rig, cal)
        print(f"{args.rig} seed {args.seed}, crosstalk x{args.crosstalk_scale:g}, "
              f"{args.method}: offsets median {np.median(err):.4f} max {err.max():.4f} rad "
              f"({(err > 0.02).sum()} above 0.02); efficiency max {eff.max() * 100:.2f} %; "
              f"{wall:.1f} s, {station.counters.pd_reads} photodiode reads, "
              f"{station.counters.serial_commands} serial commands in all, "
              f"{station.counters.selector_switches} selector switches: about "
              f"{station.lab_time_s():.0f} s in a lab")
        for state, (ours, oracle) in extinction_scores(rig, station.dac, cal).items():
            print(f"{state} extinction: {extinction_ok(ours, oracle).sum()}/{len(ours)} cells "
                  "within 1 dB of the oracle or >= 40 dB")
        if args.rig == "hexmesh":
            truth = rig.chip.truth()
            k = cal.crosstalk - truth.crosstalk
            print(f"crosstalk matrix: rms error {np.sqrt(np.mean(k ** 2)):.1e}, worst "
                  f"{np.abs(k).max():.1e} (largest coupling {truth.crosstalk.max():.3f})")
            topology = station.topology
            sets = [c for n in (1, 2, 3) for c in
                    random_circuits(topology, -(-args.perms // 3), n, seed=n)][:args.perms]
            for label, c in (("compensated", cal), ("without compensation",
                                                    cal.without_crosstalk())):
                main_db, xt_db = circuit_errors(rig, station.dac, c, sets)
                print(f"{len(sets)} sets of circuits, {label}: intended outputs within "
                      f"{main_db:.4f} dB of the oracle's, the most light at another port within "
                      f"{xt_db:.3f} dB of the oracle's")
            return 0
        for label, c in (("compensated", cal), ("without compensation", cal.without_crosstalk())):
            s = permutation_scores(rig, station.dac, c, perms=args.perms)
            main_db = np.abs(s["ours_main"] - s["oracle_main"]).max()
            xt_db = (s["ours_xt"].max(axis=1) - s["oracle_xt"].max(axis=1)).max()
            print(f"{args.perms} permutations, {label}: intended outputs within {main_db:.4f} "
                  f"dB of the oracle's, worst crosstalk within {xt_db:.3f} dB (mean worst "
                  f"{s['ours_xt'].max(axis=1).mean():.1f} dB, the oracle "
                  f"{s['oracle_xt'].max(axis=1).mean():.1f} dB)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
