"""The datacenter rig over the real sockets: `opus2048` (2,048 GPUs, 64 rail OCSes, each its
own SCPI endpoint in the emulator) with `ptb serve --one-process` (64 switch services as
threads of one process) and `ptb agent`, as processes; zero device delays.

- CPU: each process's user + system time over the timed phase switches, per switch.
- Start-up: each process from launch to ready, and the emulator's alone against the issue's
  30 s; resident memory (RSS) of the emulator, the services and the agent, before and after a
  job of every working GPU is admitted and run.
- Phase switch: one job on every working GPU (1,984: TP inside each server, then a DP ring and
  an all-to-all over the servers of each pod on every rail, so that each (phase, round) sets
  circuits on all 64 OCSes); `Fabric.phase` timed from the job's request to the grant, the job
  computing `--gap-ms` between two.
- Journal: how much the agent's journal grows per timed phase switch (its pages, as SQLite
  counts them, before and after).
- Failover: the GPU of a rank fails (control endpoint); its server's ranks move to a spare
  server of its pod (8 OCSes, one per rail); timed from the failure event on the bus (the
  `gpus` delta, as a subscriber here hears it) to the new circuits applied on every OCS
  involved and verified by the receivers' light (the journal's timestamps). Healed after each
  run, so every run is a full swap.
"""
from __future__ import annotations

import functools
import os
import sqlite3
import statistics
import time
import urllib.parse
from typing import cast

from photonic_testbed.common import heap
from photonic_testbed.common.jobplan import JobPlan, PhaseSpec
from photonic_testbed.common.rack_layout import RackLayout
from photonic_testbed.hil.agent.entries import PhaseSwitched, Swap, words
from photonic_testbed.hil.agent.sqlite_journal import SqliteJournal
from photonic_testbed.hil.bus.mirror import SubscriberThread
from photonic_testbed.hil.job.fabric_client import Fabric
from photonic_testbed.hil.lab.control_client import request
from photonic_testbed.hil.rig import RigFileError, rig_spec
from photonic_testbed.ptb.bench import integer, number
from photonic_testbed.ptb.bench.measure import (
    agent_stack,
    percentile,
    stack_cpu_s,
    stack_rss_mb,
    wait_for,
)
from photonic_testbed.ptb.cli import CommandFailed
from photonic_testbed.ptb.stack import Stack

NAME = "datacenter"
HELP = ("opus2048 over the real sockets: start-up, memory, failover and a phase switch on "
        "all 64 OCSes")
START_GOAL_S = 30.0
FAILOVER_GOAL_S = 0.050
PHASE_GOAL_S = 0.020


def add_arguments(p) -> None:
    p.add_argument("--rig", default="opus2048",
                   help="a datacenter rig (default %(default)s) or an [emulator] TOML of one")
    p.add_argument("--phases", type=integer(1, 10 ** 6), default=300,
                   help="phase switches timed (default %(default)s)")
    p.add_argument("--failovers", type=integer(1, 10 ** 5), default=100,
                   help="failovers timed (default %(default)s)")
    p.add_argument("--gap-ms", type=number(0, 10_000), default=5.0,
                   help="the job's compute between two phase requests (default %(default)s)")
    p.add_argument("--journal-sync", choices=("full", "normal"), default="full")


def rack_plan(spec) -> tuple[JobPlan, int]:
    """A job on every working GPU of a datacenter rig and its servers per pod: TP inside
    each server, then per pod and rail a DP ring and an all-to-all over the pod's working
    servers (every (phase, round) but TP sets circuits on every OCS)."""
    if not spec.servers:
        raise CommandFailed(f"rig {spec.name} is not a datacenter rig (no rail OCSes)")
    per_pod = spec.pod or spec.servers
    if spec.servers % per_pod:
        raise CommandFailed(f"rig {spec.name}: pods of unequal size ({spec.servers} servers "
                            f"in pods of {per_pod}); the bench's job needs equal pods")
    group = per_pod - spec.spare_servers
    if group < 2:
        raise CommandFailed(f"rig {spec.name}: a pod needs 2 working servers for the job")
    world = spec.rails * group * (spec.servers // per_pod)
    return JobPlan("datacenter", world, (
        PhaseSpec("tp", "ring", group=spec.rails, stride=1),
        PhaseSpec("dp", "ring", group=group, stride=spec.rails),
        PhaseSpec("ep", "all_to_all", group=group, stride=spec.rails))), group


def rail_layout(spec) -> RackLayout:
    """The rack of a datacenter rig: its GPUs on the rail OCSes."""
    layout = spec.rack_layout()
    if layout is None:
        raise CommandFailed(f"rig {spec.name} has no rack of GPUs")
    return layout


def _rows(label: str, xs: list[float]) -> dict:
    return {"case": label, "runs": len(xs), "p50_ms": f"{1e3 * statistics.median(xs):.2f}",
            "p99_ms": f"{1e3 * percentile(xs, 0.99):.2f}", "max_ms": f"{1e3 * max(xs):.2f}"}


def journal_bytes(path) -> int:
    """The journal's size as SQLite counts it (pages in use, the write-ahead log's included)."""
    db = sqlite3.connect(f"file:{urllib.parse.quote(os.path.abspath(path))}?mode=ro",
                         uri=True)
    try:
        return db.execute("PRAGMA page_count").fetchone()[0] * \
            db.execute("PRAGMA page_size").fetchone()[0]
    finally:
        db.close()


def _phases(stack: Stack, fabric: Fabric, plan: JobPlan, runs: int, gap_s: float
            ) -> tuple[list[float], list[int], float]:
    """Time `runs` phase requests; each one's number of OCSes written (from the journal), and
    the journal's growth per switch (bytes)."""
    seq = plan.sequence()
    for ph, rnd in seq:                        # warm-up: every circuit set seen once
        fabric.phase(ph, rnd)
    times: list[float] = []
    with SqliteJournal(stack.journal, read_only=True) as j:
        last = j.entries()[-1].seq
        size0 = journal_bytes(stack.journal)
        while len(times) < runs:
            for ph, rnd in seq:
                time.sleep(gap_s)
                t = time.perf_counter()
                fabric.phase(ph, rnd)
                times.append(time.perf_counter() - t)
                if len(times) == runs:
                    break
        wait_for(lambda: len([e for e in j.entries(since=last, kinds=("phase",))]) >= runs,
                 f"the {runs} timed phase switches in the journal")
        grown = (journal_bytes(stack.journal) - size0) / runs
        written = [len(e.details.applied) for e in j.entries(since=last, kinds=("phase",))
                   if isinstance(e.details, PhaseSwitched)][:runs]
    return times, written, grown


def _failovers(stack: Stack, fabric: Fabric, rank_map: dict[int, str], runs: int,
               per_pod_ranks: int) -> dict[str, list[float]]:
    seen: dict[str, float] = {}

    def on_gpus(device, state, ops):
        now = time.time()
        for gpu, h in state.get("gpus", {}).items():
            if h.get("state") == "failed":
                seen.setdefault(gpu, now)
            else:
                seen.pop(gpu, None)
    parts: dict[str, list[float]] = {k: [] for k in (
        "bus event", "detect", "decide", "apply", "verify", "from bus event", "ocs")}
    sub = SubscriberThread({"gpus": stack.rig.gpus_endpoints()}, on_state=on_gpus,
                           telemetry=False).start()
    pods = len(rank_map) // per_pod_ranks
    try:
        with SqliteJournal(stack.journal, read_only=True) as j:
            last = j.entries()[-1].seq
            for run in range(-1, runs):          # run -1: a warm-up, not kept
                # a rank in a different pod each run (rank 43: GPU 3 of the 6th server)
                victim = rank_map[(run % pods) * per_pod_ranks + 43 % per_pod_ranks]
                t_fail = time.time()
                request(stack.control, {"cmd": "fail_gpu", "gpu": victim}, 30.0)

                journaled: list[str] = []

                def done(last: int = last, journaled: list[str] = journaled) -> list | None:
                    es = j.entries(since=last)
                    kinds = {e.kind for e in es}
                    journaled[:] = [e.kind for e in es]
                    return es if kinds & {"verified", "verify_failed"} and \
                        {"decision", "applied", "rank_map"} <= kinds else None
                try:
                    es = wait_for(done, f"the swap of {victim} in the journal")
                except CommandFailed:
                    raise CommandFailed(
                        f"the swap of {victim} was not journaled whole in 30 s (a decision, "
                        f"the switches applied, verified, the rank map): the journal has "
                        f"{', '.join(journaled) or 'nothing'} since the failure") from None
                last = es[-1].seq
                t: dict[str, float] = {}
                for e in es:
                    t.setdefault(e.kind, e.ts)
                dec = next(e for e in es if isinstance(e.details, Swap))
                rank_map = dict(cast(Swap, dec.details).rank_map)
                if "verified" not in t:
                    dark = [words(e.details) for e in es if e.kind == "verify_failed"]
                    raise CommandFailed(f"the swap of {victim} did not verify: {dark}")
                t_bus = wait_for(functools.partial(seen.get, victim),
                                 f"{victim}'s failure on the bus")
                request(stack.control, {"cmd": "heal_gpu", "gpu": victim}, 30.0)
                wait_for(lambda: victim not in seen,  # noqa: B023 (waited for at once)
                         f"{victim} healed on the bus")
                time.sleep(0.05)          # the healed GPU is seen before the next run
                if run < 0:
                    continue
                parts["bus event"].append(t_bus - t_fail)
                parts["detect"].append(t["detected"] - t_fail)
                parts["decide"].append(dec.ts - t["detected"])
                parts["apply"].append(t["applied"] - dec.ts)
                parts["verify"].append(t["verified"] - t["applied"])
                parts["from bus event"].append(t["verified"] - t_bus)
                parts["ocs"].append(sum(1 for e in es if e.kind == "applied"))
    finally:
        sub.close()
    return parts


def run(args) -> dict:
    try:
        spec = rig_spec(args.rig)
    except (RigFileError, ValueError) as e:
        raise CommandFailed(str(e)) from None
    plan, group = rack_plan(spec)
    stack = agent_stack(args.rig, one_process=True, journal_sync=args.journal_sync)
    fabric = None
    try:
        rss = {"idle": stack_rss_mb(stack)}
        workers = [g.name for g in stack.rig.gpus if not g.spare]
        fabric = Fabric(*stack.rig.agent_endpoints(), timeout=60)
        t = time.perf_counter()
        rank_map = fabric.admit(plan, dict(enumerate(workers)))
        admit_s = time.perf_counter() - t
        rss["job admitted"] = stack_rss_mb(stack)
        heap.settle("the job's admission")   # this process is the job: the plan is kept
        cpu0 = stack_cpu_s(stack)
        phase_s, written, grown = _phases(stack, fabric, plan, args.phases,
                                          args.gap_ms / 1e3)
        cpu1 = stack_cpu_s(stack)
        cpu_ms = {name: 1e3 * (cpu1[name] - cpu0[name]) / len(phase_s) for name in cpu0}
        parts = _failovers(stack, fabric, rank_map, args.failovers, spec.rails * group)
        rss["after the runs"] = stack_rss_mb(stack)
    finally:
        if fabric is not None:
            fabric.close()
        stack.close()
    switches = len(rail_layout(spec).switches)
    all_ocs = [x for x, n in zip(phase_s, written, strict=False) if n == switches]
    rows = [{"case": f"start-up: {k} (launch to ready)", "runs": 1,
             "p50_ms": f"{1e3 * v:.0f}", "p99_ms": "", "max_ms": ""}
            for k, v in stack.started.items()]
    rows.append({"case": f"admit the job ({plan.world} ranks)", "runs": 1,
                 "p50_ms": f"{1e3 * admit_s:.0f}", "p99_ms": "", "max_ms": ""})
    rows.append(_rows(f"phase switch, every (phase, round) ({switches} OCSes or none)",
                      phase_s))
    if all_ocs:
        rows.append(_rows(f"phase switch writing all {switches} OCSes", all_ocs))
    for k in ("bus event", "detect", "decide", "apply", "verify", "from bus event"):
        rows.append(_rows(f"failover: {k}", parts[k]))
    mem = [{"process": name, **{when: f"{got[name]:.0f} MiB" for when, got in rss.items()}}
           for name in rss["idle"]]
    start = stack.started["emulator"]
    fo99 = percentile(parts["from bus event"], 0.99)
    ph99 = percentile(all_ocs or phase_s, 0.99)
    notes = [
        f"ptb emulate --rig {spec.name}: {start:.1f} s to its rig file (goal < "
        f"{START_GOAL_S:g} s: {'met' if start < START_GOAL_S else 'NOT met'})",
        f"failover (a server's ranks to a spare server: {statistics.median(parts['ocs']):.0f} "
        f"OCSes written) from the failure event on the bus to verified: p99 "
        f"{1e3 * fo99:.1f} ms (goal <= {1e3 * FAILOVER_GOAL_S:g} ms: "
        f"{'met' if fo99 <= FAILOVER_GOAL_S else 'NOT met'})",
        f"phase switch on all {switches} OCSes ({len(all_ocs)} of {len(phase_s)}): p99 "
        f"{1e3 * ph99:.1f} ms (goal <= {1e3 * PHASE_GOAL_S:g} ms: "
        f"{'met' if ph99 <= PHASE_GOAL_S else 'NOT met'})",
    ]
    notes.append("CPU per phase switch (user + system, over the timed switches): " +
                 ", ".join(f"{name} {ms:.1f} ms" for name, ms in cpu_ms.items()))
    notes.append(f"journal: {grown / 1e3:.1f} KB more per timed phase switch")
    notes += [f"RSS of {m['process']}: " + ", ".join(f"{k} {v}" for k, v in m.items()
                                                    if k != "process") for m in mem]
    return {"rows": rows, "memory": mem, "notes": notes, "started_s": stack.started,
            "rss_mib": rss, "cpu_ms_per_phase_switch": cpu_ms,
            "journal_bytes_per_phase_switch": round(grown), "samples_ms": {
                "phase": [round(1e3 * x, 3) for x in phase_s], "ocs_written": written,
                **{f"failover {k}": [round(1e3 * x, 3) for x in v]
                   for k, v in parts.items() if k != "ocs"}}}
