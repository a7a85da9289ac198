"""The agent's decisions at datacenter scale, in process: failover (a GPU fails: choose a
spare, the new rank map, every phase's circuits, the journal's entries) and phase switch (the
next phase's circuits), with switches that apply at once and receivers that always hear, so
that only the decision is timed. Rail racks of 8-GPU servers (common.rack_layout.rail_rack: one
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

from photonic_testbed.common.jobplan import JobPlan, PhaseSpec
from photonic_testbed.common.rack_layout import rail_rack
from photonic_testbed.drivers.circuit_switch import ApplyReport, CircuitSwitch
from photonic_testbed.hil.agent.agent import Agent
from photonic_testbed.hil.agent.config import AgentConfig
from photonic_testbed.hil.agent.sqlite_journal import SqliteJournal

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
    p.add_argument("--stream", type=int, default=3000,
                   help="events of the fragmentation stream (0: skip it)")
    p.add_argument("--pods", type=int, default=8, help="pods of 32 servers (default: 2,048 GPUs)")


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
    journal = SqliteJournal(workdir / f"{kind}-{servers}.db", "NORMAL")
    agent = Agent(layout, switches, journal, lambda s, p: -3.0,
                  config=AgentConfig(quarantine_s=0.0))
    try:
        t = time.perf_counter()
        agent.admit(plan)
        admit_s = time.perf_counter() - t
        keys = list(agent.job().circuits.targets)
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


def _exponent(sizes: list[int], times: list[float]) -> float | None:
    """The growth exponent: the slope of log(time) against log(GPUs); None from one size."""
    if len(set(sizes)) < 2:
        return None
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
        frag = []
        if args.stream:
            stream = _stream(args.seed, args.stream, args.pods)
            frag = [fragmentation(p, stream, args.pods, Path(d))
                    for p in ("first-fit", "best-fit")]
    notes = []
    for fr in frag:
        notes.append(f"fragmentation, {fr['policy']}: {fr['fragmented']} of {fr['asked']} "
                     f"admissions refused although enough whole servers were free "
                     f"({fr['fragmentation']:.1%}); {fr['refused']} refused in all")
    if len(frag) == 2 and frag[0]["fragmented"]:
        cut = 1 - frag[1]["fragmented"] / frag[0]["fragmented"]
        notes.append(f"best fit cuts fragmentation by {cut:.0%} against first fit on the same "
                     "stream (Morphlux: up to 70 %)")
    for kind, got in raw.items():
        sizes = [g["gpus"] for g in got]
        fo = _exponent(sizes, [statistics.median(g["failover"]) for g in got])
        ph = _exponent(sizes, [statistics.median(g["phase"]) for g in got])
        if fo is None or ph is None:
            notes.append(f"{kind}: no growth exponent from one size (give --servers two or "
                         "more)")
            continue
        notes.append(f"{kind}: growth exponent over {sizes[0]}..{sizes[-1]} GPUs: failover "
                     f"{fo:.2f}, phase switch {ph:.2f} (goal <= 1.2; <= 2 ms at 2,048)")
    return {"rows": rows, "notes": notes, "fragmentation": frag,
            "raw": {k: [{**g, "failover": g["failover"], "phase": g["phase"]} for g in v]
                    for k, v in raw.items()},
            "exponents": {k: _exponent([g["gpus"] for g in v],
                                       [statistics.median(g["failover"]) for g in v])
                          for k, v in raw.items()}}


# ---- fragmentation: an admission stream, best fit against first fit --------------------------

def _stream(seed: int, events: int, pods: int) -> list[tuple]:
    """A seeded stream of admissions (a job of k servers), completions and GPU failures:
    [("admit", job, servers) | ("end", job) | ("fail", index)]. Sizes lean small (as a
    cluster's do); jobs end in arrival-independent order; load keeps the rack mostly full."""
    rnd = random.Random(seed)
    sizes, weights = [1, 2, 4, 8, 16], [30, 25, 20, 15, 10]
    out: list[tuple] = []
    live: list[int] = []
    capacity = 31 * pods
    used = 0
    sized: dict[int, int] = {}
    for n in range(events):
        r = rnd.random()
        if r < 0.05:
            out.append(("fail", rnd.randrange(10**9)))
        elif live and (used > 0.85 * capacity or r < 0.45):
            job = live.pop(rnd.randrange(len(live)))
            used -= sized.pop(job)
            out.append(("end", job))
        else:
            k = rnd.choices(sizes, weights)[0]
            live.append(n)
            sized[n] = k
            used += k
            out.append(("admit", n, k))
    return out


def fragmentation(policy: str, stream: list[tuple], pods: int, workdir: Path) -> dict:
    """Play the stream with one allocation policy. A refusal while enough whole servers were
    free (in the rack, though in no single pod) is fragmentation."""
    layout = rail_rack(f"frag-{policy}", 32 * pods, rails=8, spare_servers=1, pod=32)
    switches = {s: InstantSwitch(s, n) for s, n in layout.switches.items()}
    journal = SqliteJournal(workdir / f"frag-{policy}.db", "NORMAL")
    agent = Agent(layout, switches, journal, lambda s, p: -3.0,
                  config=AgentConfig(quarantine_s=0.0, allocation=policy))
    admitted = refused = fragmented = 0
    stranded: list[int] = []
    names: dict[int, str] = {}
    try:
        for ev in stream:
            if ev[0] == "admit":
                _, job, k = ev
                free_servers = sum(
                    1 for s, gpus in layout.server_gpus.items()
                    if all(not agent.holds_rank(g) and g not in layout.spares for g in gpus))
                try:
                    agent.admit(plan_for("dp-tp-pp", k) if k % 4 == 0 else
                                JobPlan(f"j{job}", 8 * k, (PhaseSpec("tp", "ring", group=8,
                                                                     stride=1),)
                                        + ((PhaseSpec("dp", "ring", group=k, stride=8),)
                                           if k > 1 else ())), job=f"j{job}")
                    names[job] = f"j{job}"
                    admitted += 1
                except Exception:
                    refused += 1
                    if free_servers >= k:
                        fragmented += 1
                        stranded.append(free_servers)
            elif ev[0] == "end":
                name = names.pop(ev[1], None)
                if name is not None:
                    agent.release(name)
            else:
                held = [g for g in layout.gpus if agent.holds_rank(g)]
                if held:
                    g = held[ev[1] % len(held)]
                    agent.on_health({"gpu": g, "state": "failed", "reasons": ["stream"]})
                    agent.on_health({"gpu": g, "state": "ok"})      # repaired at once
    finally:
        journal.close()
    asked = admitted + refused
    return {"policy": policy, "asked": asked, "admitted": admitted, "refused": refused,
            "fragmented": fragmented,
            "fragmentation": fragmented / asked if asked else 0.0,
            "stranded_servers_mean": statistics.mean(stranded) if stranded else 0.0}
