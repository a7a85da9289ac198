"""Reconfigure the emulated 32 x 32 OCS with random full permutations over its real socket:
our driver (one `ONLY` line per reconfiguration) versus one `ADD`/`SUB` line per circuit."""
from __future__ import annotations

import statistics
import time

import numpy as np

from photonic_testbed.drivers.ocs import OpticalCircuitSwitch, format_circuits
from photonic_testbed.emulator.rig import EmulatedRig
from photonic_testbed.hil.rig import rig_spec
from photonic_testbed.ptb.bench import SEED, integer

NAME = "ocs"
HELP = "32x32 OCS full-permutation reconfigurations: ONLY per map vs ADD/SUB per circuit"


def add_arguments(p) -> None:
    p.add_argument("--reconfigurations", type=integer(1, 10 ** 7), default=1000,
                   help="random full permutations per client (default %(default)s)")
    p.add_argument("--seed", type=SEED, default=0)


def _one(ocs: OpticalCircuitSwitch, line: str) -> None:
    reply = ocs.query(f"{line};*OPC?;:SYST:ERR?")
    if reply != '1;0,"No error"':
        raise RuntimeError(f"{line!r} answered {reply!r}")


def _stats(times: list[float], wire: int, count: int) -> dict:
    ts = sorted(times)
    return {"median_s": statistics.median(ts), "p99_s": ts[min(len(ts) - 1,
                                                                int(0.99 * len(ts)))],
            "bytes": wire / count}


def _row(label: str, s: dict, lines: str) -> dict:
    return {"client": label, "lines_per_reconfig": lines,
            "median_ms": f"{s['median_s'] * 1e3:.3f}", "p99_ms": f"{s['p99_s'] * 1e3:.3f}",
            "bytes_per_reconfig": f"{s['bytes']:.0f}"}


def run(args) -> dict:
    rng = np.random.default_rng(args.seed)
    n = 32
    perms = [dict(zip(range(1, n + 1), (int(x) for x in rng.permutation(n) + n + 1), strict=True))
             for _ in range(args.reconfigurations)]
    with EmulatedRig(rig_spec("opus"), seed=args.seed, switching_s=0.0) as rig:
        if rig.optics is None:
            raise RuntimeError("the opus rig has no optical bench")
        server = rig.optics.servers["ocs"]
        physics = rig.optics.selector()
        moves0 = physics.moves
        with OpticalCircuitSwitch(rig.endpoints["ocs"]) as ocs:
            ocs.apply({})
            times = []
            before = server.bytes_in + server.bytes_out
            for p in perms:
                t = time.perf_counter()
                ocs.apply(p)
                times.append(time.perf_counter() - t)
            ours = _stats(times, server.bytes_in + server.bytes_out - before, len(perms))
            ours_moves = physics.moves - moves0
            if ocs.circuits() != perms[-1]:
                raise RuntimeError("the switch does not hold the last map applied")

            # The same maps, one line and one confirmation per circuit broken or made, as a
            # script using single ADD/SUB commands does (the per-circuit *OPC? is what such a
            # script needs to know each move is done).
            ocs.disconnect_all()
            state: dict[int, int] = {}
            times = []
            lines = 0
            before = server.bytes_in + server.bytes_out
            for p in perms:
                t = time.perf_counter()
                for i, e in state.items():
                    if p.get(i) != e:
                        _one(ocs, f":OXC:SWIT:CONN:SUB {format_circuits({i: e})}")
                        lines += 1
                for i, e in p.items():
                    if state.get(i) != e:
                        _one(ocs, f":OXC:SWIT:CONN:ADD {format_circuits({i: e})}")
                        lines += 1
                times.append(time.perf_counter() - t)
                state = p
            per = _stats(times, server.bytes_in + server.bytes_out - before, len(perms))
    rows = [_row("ptb OpticalCircuitSwitch.apply (ONLY;*OPC?;:SYST:ERR?)", ours, "1"),
            _row("one ADD/SUB per circuit (+*OPC?;:SYST:ERR?)", per,
                 f"{lines / len(perms):.1f}")]
    return {"ports": n, "reconfigurations": len(perms), "ours": ours, "per_circuit": per,
            "ours_moves_per_reconfig": ours_moves / len(perms),
            "speedup_median": per["median_s"] / ours["median_s"],
            "byte_ratio": per["bytes"] / ours["bytes"], "rows": rows,
            "notes": [f"ONLY is {per['median_s'] / ours['median_s']:.1f}x faster (median) and "
                      f"sends {per['bytes'] / ours['bytes']:.1f}x fewer bytes "
                      "(both directions counted at the emulated switch)"]}
