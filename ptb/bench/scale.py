"""The agent's decisions at datacenter scale, in process: failover (a GPU fails: choose a
spare, the new rank map, every phase's circuits, the journal's entries) and phase switch (the
next phase's circuits), with switches that apply at once and receivers that always hear, so
that only the decision is timed. Rail racks of 8-GPU servers (hil.rack_layout.rail_rack: one
OCS per rail), 32 to 2,048 GPUs; two plans: DP x TP x PP (TP inside a server, PP 4 stages and
DP rings across servers on each rail) and all-to-all across servers on each rail (expert
parallel). The journal is a file with synchronous=NORMAL (no fsync)."""
from __future__ import annotations

import random
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from photonic_testbed.drivers.circuit_switch import ApplyReport, CircuitSwitch
from photonic_testbed.hil.agent.agent import Agent
from photonic_testbed.hil.jobplan import JobPlan, PhaseSpec
from photonic_testbed.hil.journal import Journal
from photonic_testbed.hil.rack_layout import rail_rack

NAME = "scale"
HELP = "agent decision time (failover, phase switch) for 32 ... 2,048 GPUs, in process"
SERVERS = (4, 8, 16, 32, 64, 128, 256)


def add_arguments(p) -> None:
    p.add_argument("--servers", type=int, nargs="+", default=list(SERVERS),
                   help="working servers of 8 GPUs per size (default %(default)s)")
    p.add_argument("--failovers", type=int, default=30, help="failovers per size and plan")
    p.add_argument("--phases", type=int, default=200, help="phase switches per size and plan")
    p.add_argument("--plans", nargs="+", default=["dp-tp-pp", "all-to-all"],
                   choices=["dp-tp-pp", "all-to-all"])
    p.add_argument("--seed", type=int, default=0)


class InstantSwitch(CircuitSwitch):
    """Applies at once, holds what it was told."""

    def __init__(self, name: str, n: int):
        self.name, self._n = name, n
        self._c: dict[int, int] = {}

    @property
    def ports(self) -> int:
        return self._n

    def apply(self, circuits) -> ApplyReport:
        self._c = dict(circuits)
        return ApplyReport()

    def circuits(self):
        return dict(self._c)


def plan_for(kind: str, servers: int) -> JobPlan:
    world = 8 * servers
    if kind == "dp-tp-pp":
        stages = 4 if servers % 4 == 0 else 1
        phases = [PhaseSpec("tp", "ring", group=8, stride=1)]
        if stages > 1:
            phases.append(PhaseSpec("pp", "chain", group=stages, stride=world // stages))
        if servers // stages > 1:
            phases.append(PhaseSpec("dp", "ring", group=servers // stages, stride=8))
        return JobPlan("dp-tp-pp", world, tuple(phases))
    return JobPlan("all-to-all", world, (PhaseSpec("ep", "all_to_all", group=servers,
                                                   stride=8),))


def _measure(kind: str, servers: int, failovers: int, phases: int, rnd: random.Random,
             workdir: Path) -> dict:
    layout = rail_rack(f"rails{servers}", servers + 1, rails=8, spare_servers=1)
    switches = {s: InstantSwitch(s, n) for s, n in layout.switches.items()}
    plan = plan_for(kind, servers)
    journal = Journal(workdir / f"{kind}-{servers}.db", "NORMAL")
    agent = Agent(layout, switches, journal, lambda s, p: -3.0, quarantine_s=0.0)
    try:
        t = time.perf_counter()
        agent.admit(plan)
        admit_s = time.perf_counter() - t
        keys = list(agent._targets)
        agent.on_phase(*keys[0])
        fail_s = []
        for _ in range(failovers):
            victim = agent.rank_map[rnd.randrange(len(agent.rank_map))]
            t = time.perf_counter()
            out = agent.on_health({"gpu": victim, "state": "failed", "reasons": ["bench"]})
            fail_s.append(time.perf_counter() - t)
            assert out is not None and victim in out.swaps, out
            agent.on_health({"gpu": victim, "state": "ok"})     # repaired: a spare again
        phase_s = []
        for i in range(phases):
            key = keys[(i + 1) % len(keys)]
            t = time.perf_counter()
            agent.on_phase(*key)
            phase_s.append(time.perf_counter() - t)
    finally:
        journal.close()
    return {"gpus": len(layout.gpus), "admit_s": admit_s, "failover": fail_s,
            "phase": phase_s, "rounds": len(keys)}


def _exponent(sizes: list[int], times: list[float]) -> float:
    """The growth exponent: the slope of log(time) against log(GPUs)."""
    if len(sizes) < 2:
        return float("nan")
    slope, _ = np.polyfit(np.log(sizes), np.log(times), 1)
    return float(slope)


def run(args) -> dict:
    rnd = random.Random(args.seed)
    rows, raw = [], {}
    with tempfile.TemporaryDirectory(prefix="ptb-scale-") as d:
        for kind in args.plans:
            got = [_measure(kind, s, args.failovers, args.phases, rnd, Path(d))
                   for s in args.servers]
            raw[kind] = got
            for g in got:
                f = np.asarray(g["failover"]) * 1e3
                p = np.asarray(g["phase"]) * 1e3
                rows.append({"plan": kind, "GPUs": g["gpus"], "rounds": g["rounds"],
                             "admit ms": f"{g['admit_s'] * 1e3:.1f}",
                             "failover p50 ms": f"{np.percentile(f, 50):.3f}",
                             "failover p99 ms": f"{np.percentile(f, 99):.3f}",
                             "phase p50 ms": f"{np.percentile(p, 50):.3f}",
                             "phase p99 ms": f"{np.percentile(p, 99):.3f}"})
    notes = []
    for kind, got in raw.items():
        sizes = [g["gpus"] for g in got]
        fo = _exponent(sizes, [statistics.median(g["failover"]) for g in got])
        ph = _exponent(sizes, [statistics.median(g["phase"]) for g in got])
        notes.append(f"{kind}: growth exponent over {sizes[0]}..{sizes[-1]} GPUs: failover "
                     f"{fo:.2f}, phase switch {ph:.2f} (goal <= 1.2; <= 2 ms at 2,048)")
    return {"rows": rows, "notes": notes,
            "raw": {k: [{**g, "failover": g["failover"], "phase": g["phase"]} for g in v]
                    for k, v in raw.items()},
            "exponents": {k: _exponent([g["gpus"] for g in v],
                                       [statistics.median(g["failover"]) for g in v])
                          for k, v in raw.items()}}
