"""The emulated training job at datacenter scale, in one process on simulated time.

Scaling: the job (`emulator.job.TrainingJob`, one process simulating every rank, the
rack's link physics per rank pair) on rail racks of 32 to 256 servers (pods of 32, one spare
server each: up to 1,984 ranks on 2,048 GPUs and 64 OCSes), with the agent in the same process
switching the OCSes' physics; wall time per step and per (round, link).

Training overhead: the same job and agent, the switches taking `--move-ms` (25 ms, a MEMS
OCS) to settle after any change, or `--heater-us` (10 us) for the chip, against a fabric
that settles at once (zero latency). A phase request is granted when its circuits have
settled (the agent waits for the switches before it grants, as over the bus); with phases
set up ahead the next round's circuits start moving when the job releases a round
(`Fabric.done`), so only what the compute between does not cover is seen. Overhead = (time
of the steps with the real fabric - with the zero-latency one) / the latter. The job's plan
per iteration: TP inside each server (its scale-up fabric), then a pipeline and a DP ring
across the servers of each pod on every rail (three phase switches per iteration); the
compute before each phase (`--compute-ms`, a sweep) and the bytes each link carries are the
bench's parameters (Opus, arXiv 2507.08119: under 6 % at production OCS latencies).
"""
from __future__ import annotations

import tempfile
import time
from pathlib import Path
from typing import Any

from photonic_testbed.common.jobplan import JobPlan, PhaseSpec
from photonic_testbed.common.rack_layout import RackLayout, duplex_rack
from photonic_testbed.drivers.circuit_switch import ApplyReport, CircuitSwitch, check_circuits
from photonic_testbed.emulator.clock import SimClock
from photonic_testbed.emulator.job import JobEvent, TrainingJob
from photonic_testbed.emulator.ocs import OCSPhysics
from photonic_testbed.emulator.rack import EmulatedRack
from photonic_testbed.hil.agent.agent import Agent
from photonic_testbed.hil.agent.config import AgentConfig
from photonic_testbed.hil.agent.events import NoEvents
from photonic_testbed.hil.agent.sqlite_journal import SqliteJournal
from photonic_testbed.hil.rig import RigSpec
from photonic_testbed.ptb.bench import integer, number
from photonic_testbed.ptb.bench.datacenter import rack_plan, rail_layout

NAME = "job"
HELP = ("the emulated job on up to 2,048 GPUs (wall time per step) and its training overhead "
        "with realistic switches against a zero-latency fabric")
OPUS_OVERHEAD = 0.06          # Opus: under 6 % training overhead at production OCS latencies


def add_arguments(p) -> None:
    p.add_argument("--servers", type=integer(2, 1024), nargs="+", default=[32, 64, 128, 256],
                   help="rail racks for the scaling rows, in servers of 8 GPUs (pods of 32)")
    p.add_argument("--steps", type=integer(1, 1000), default=2,
                   help="steps timed per scaling row (default %(default)s)")
    p.add_argument("--overhead-steps", type=integer(1, 1000), default=4,
                   help="steps per overhead run (default %(default)s)")
    p.add_argument("--overhead-servers", type=integer(2, 1024), default=32,
                   help="the rail rack of the overhead sweep (default %(default)s: one pod)")
    p.add_argument("--compute-ms", type=number(0, 60_000), nargs="+",
                   default=[5.0, 10.0, 25.0, 50.0, 100.0, 200.0],
                   help="compute before each phase, swept (ms)")
    p.add_argument("--move-ms", type=number(0, 10_000), default=25.0,
                   help="an OCS's settling time after a change (default %(default)s)")
    p.add_argument("--heater-us", type=number(0, 1e6), default=10.0,
                   help="the chip's heater settling time (default %(default)s)")


class SettlingSwitch(CircuitSwitch):
    """A switch over an OCS's physics that notes whether an apply changed anything (how long
    it then takes to settle is the fabric's, on the job's simulated clock)."""

    def __init__(self, name: str, physics: OCSPhysics):
        self.name, self.physics = name, physics
        self.changed = False

    @property
    def ports(self) -> int:
        return self.physics.n

    def apply(self, circuits) -> ApplyReport:
        want = check_circuits(circuits, self.physics.n)
        if want != self.physics.commanded:
            self.changed = True
            self.physics.replace(want)
        return ApplyReport()

    def circuits(self):
        return dict(self.physics.commanded)


class World:
    """A rack, its switches' physics, the agent and the job, on one simulated clock."""

    def __init__(self, layout: RackLayout, plan: JobPlan, workdir: Path,
                 rank_map: dict[int, str] | None = None, poll_s: float = 1e-4):
        self.clock = SimClock()
        self.physics = {s: OCSPhysics(n, seed=k, switching_s=0.0)
                        for k, (s, n) in enumerate(layout.switches.items())}
        self.rack = EmulatedRack(layout, self.physics, self.clock)
        self.switches = {s: SettlingSwitch(s, p) for s, p in self.physics.items()}
        self.journal = SqliteJournal(workdir / f"{layout.name}-{time.monotonic_ns()}.db", "NORMAL")
        self.agent = Agent(layout, self.switches, self.journal,
                           lambda s, p: self.rack.port_powers_dbm(s, [p])[p],
                           config=AgentConfig(quarantine_s=0.0))
        rank_map = self.agent.admit(plan, rank_map)
        self.job = TrainingJob(plan, rank_map, self.rack, self.clock, poll_s=poll_s,
                               grant_timeout_s=60.0, link_timeout_s=1.0)

    def close(self) -> None:
        self.agent.close()
        self.journal.close()


class _Grants(NoEvents):
    """The agent's grants passed straight to the job."""

    def __init__(self, job: TrainingJob):
        self.job = job

    def on_grant(self, phase: str, round: int) -> None:
        self.job.grant(phase, round)


class SimFabric:
    """The agent behind switches that take `settle_s` after a change, in simulated time: the
    job's phase request is granted once its circuits have settled; with `ahead`, a released
    round's successor starts switching at once (the job computes meanwhile)."""

    def __init__(self, world: World, settle_s: float, ahead: bool):
        self.w, self.settle_s, self.ahead = world, settle_s, ahead
        self.ready: tuple[tuple[str, int], float] | None = None
        self.stalls: list[float] = []
        world.agent.events = NoEvents()      # granted here, once settled
        world.job.subscribe(self.on_event)

    def _switch(self, change) -> tuple[float, Any]:
        for s in self.w.switches.values():
            s.changed = False
        got = change()
        moved = any(s.changed for s in self.w.switches.values())
        return self.w.clock.now() + (self.settle_s if moved else 0.0), got

    def on_event(self, ev: JobEvent) -> None:
        agent, clock, job = self.w.agent, self.w.clock, self.w.job
        key = (ev.phase, ev.round)
        if ev.kind == "phase":
            if self.ready is not None and self.ready[0] == key:
                at = self.ready[1]
            else:
                at, _ = self._switch(lambda: agent.on_phase(*key))
            self.ready = None
            self.stalls.append(max(0.0, at - clock.now()))
            if at <= clock.now():
                job.grant(*key)
            else:
                clock.call_at(at, lambda: job.grant(*key))
        elif ev.kind == "released" and self.ahead:
            at, nxt = self._switch(lambda: agent.on_phase_done(*key))
            self.ready = (nxt, at) if nxt is not None else None


def opus_plan(servers_per_pod: int, pods: int, compute_s: float) -> JobPlan:
    """TP in each server, then a pipeline and a DP ring over each pod's servers on every rail;
    each link carries 25 MB of TP traffic (scale-up fabric), 50 MB of pipeline activations and
    250 MB of gradients (5 ms at 400 Gb/s) per iteration."""
    world = 8 * servers_per_pod * pods
    return JobPlan("opus", world, (
        PhaseSpec("tp", "ring", group=8, stride=1, bytes=25e6, compute_s=compute_s),
        PhaseSpec("pp", "chain", group=servers_per_pod, stride=8, bytes=50e6,
                  compute_s=compute_s),
        PhaseSpec("dp", "ring", group=servers_per_pod, stride=8, bytes=250e6,
                  compute_s=compute_s)))


def _scaling(servers: int, steps: int, workdir: Path) -> dict:
    spec = RigSpec(f"rails{servers}", "", servers=servers, rails=8, pod=min(32, servers),
                   spare_servers=1)
    layout = rail_layout(spec)
    plan, _ = rack_plan(spec)
    t = time.perf_counter()
    w = World(layout, plan, workdir, dict(enumerate(layout.workers)))
    setup_s = time.perf_counter() - t
    try:
        w.agent.events = _Grants(w.job)
        w.job.subscribe(w.agent.on_job_event)
        w.job.run(1)                                       # warm-up: every round seen once
        t = time.perf_counter()
        state = w.job.run(1 + steps)
        wall = (time.perf_counter() - t) / steps
        links = sum(len(v) for v in plan.links().values())
    finally:
        w.close()
    if state != "done":
        raise RuntimeError(f"the job on {servers} servers ended {state}")
    return {"GPUs": len(layout.gpus), "ranks": plan.world, "OCSes": len(layout.switches),
            "rounds/step": len(plan.sequence()), "links/step": links,
            "set-up s": f"{setup_s:.2f}", "wall s/step": f"{wall:.2f}",
            "us/link": f"{1e6 * wall / links:.1f}"}


def _overhead(layout: RackLayout, plan: JobPlan, steps: int, settle_s: float, workdir: Path,
              rank_map: dict[int, str] | None = None) -> dict:
    """Simulated time of `steps` steps: zero latency, realistic, realistic set up ahead."""
    out = {}
    for case, s, ahead in (("zero", 0.0, False), ("realistic", settle_s, False),
                           ("ahead", settle_s, True)):
        # the job looks for its grant every 1 % of a settling time (its wait's resolution)
        w = World(layout, plan, workdir, rank_map, poll_s=max(1e-7, settle_s / 100))
        try:
            fabric = SimFabric(w, s, ahead)
            t0 = w.clock.now()
            state = w.job.run(steps)
            if state != "done":
                raise RuntimeError(f"the job ended {state} ({case})")
            out[case] = (w.clock.now() - t0, fabric.stalls)
        finally:
            w.close()
    return out


def run(args) -> dict:
    rows: list[dict] = []
    raw: dict[str, list] = {"scaling": [], "overhead": []}
    with tempfile.TemporaryDirectory(prefix="ptb-job-") as d:
        workdir = Path(d)
        for servers in args.servers:
            got = _scaling(servers, args.steps, workdir)
            raw["scaling"].append(got)
            rows.append({"what": "scaling", **got})
        spec = RigSpec("overhead", "", servers=args.overhead_servers, rails=8,
                       pod=min(32, args.overhead_servers), spare_servers=1)
        layout = rail_layout(spec)
        group = (spec.pod or spec.servers) - 1
        pods = spec.servers // (spec.pod or spec.servers)
        chip = duplex_rack("chip-rack", "chip", 16, 8, 2)
        overhead_rows = []
        for compute_ms in args.compute_ms:
            for fabric, lay, plan, settle in (
                    ("OCS", layout, opus_plan(group, pods, compute_ms / 1e3),
                     args.move_ms / 1e3),
                    ("chip", chip, _chip_plan(compute_ms / 1e3), args.heater_us / 1e6)):
                rank_map = (dict(enumerate(lay.workers)) if fabric == "OCS" else None)
                got = _overhead(lay, plan, args.overhead_steps, settle, workdir, rank_map)
                zero = got["zero"][0]
                row = {"fabric": fabric, "GPUs": len(lay.gpus), "compute/phase ms": compute_ms,
                       "step ms (zero latency)": f"{1e3 * zero / args.overhead_steps:.1f}",
                       "overhead": f"{(got['realistic'][0] - zero) / zero:.1%}",
                       "overhead, set up ahead": f"{(got['ahead'][0] - zero) / zero:.1%}",
                       "stall/switch ahead ms": f"{1e3 * max(got['ahead'][1]):.2f}"}
                overhead_rows.append(row)
                raw["overhead"].append({**row, "seconds": {k: v[0] for k, v in got.items()}})
    notes = [f"{r['fabric']}, {r['compute/phase ms']} ms of compute per phase: overhead "
             f"{r['overhead']} ({r['overhead, set up ahead']} set up ahead) against Opus's "
             f"< {OPUS_OVERHEAD:.0%}" for r in overhead_rows]
    return {"rows": rows, "overhead": overhead_rows, "notes": notes, "raw": raw}


def _chip_plan(compute_s: float) -> JobPlan:
    """LUMION's rack: TP pairs then DP rings on 8 GPUs, every link through the chip."""
    return JobPlan("chip", 8, (
        PhaseSpec("tp", "ring", group=2, stride=1, bytes=25e6, compute_s=compute_s),
        PhaseSpec("dp", "ring", group=4, stride=2, bytes=250e6, compute_s=compute_s)))
