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

With `--admission`, instead: admission off the hot path. Another tenant (8 servers of pod 0: TP
inside each, then a DP ring and an all-to-all over them on every rail, so that its grants write
pod 0's 8 OCSes) has its phases granted again and again (`--gap-ms` apart) while the issue's
heavy admission is worked out `--admissions` times (1,024 ranks on the first 16 servers of each
pod, 64 all-to-all phases over each rail's 16 servers: 960 (phase, round)s on all 64 OCSes,
admitted again under the same name each time), each after a quiet time as long as the last
(at least a second). The grants that overlap an admission or the tenth of a second after it
(its answer published) are compared with the others, interleaved with them on the same machine
(p99 goal: within 2x).
"""
from __future__ import annotations

import functools
import os
import sqlite3
import statistics
import threading
import time
import urllib.parse
from typing import cast

from photonic_testbed.common import heap
from photonic_testbed.common.jobplan import MAX_PHASES, JobPlan, PhaseSpec
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
    journal_reader,
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
    p.add_argument("--journal", choices=("sqlite", "etcd"), default="sqlite",
                   help="the agent's journal: its SQLite file (default), or a group of one "
                   "replica on a local 3-member etcd cluster (docs/control-plane.md)")
    p.add_argument("--admission", action="store_true",
                   help="instead: another tenant's phase grants alone and during the heavy "
                   "admission (1,024 ranks, 64 all-to-all phases on the 64 OCSes)")
    p.add_argument("--admissions", type=integer(1, 1000), default=10,
                   help="heavy admissions worked out with --admission (default %(default)s)")


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
    etcd = (stack.workdir / "etcd.json").exists()
    with journal_reader(stack) as j:
        last = j.entries()[-1].seq
        size0 = 0 if etcd else journal_bytes(stack.journal)
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
        grown = float("nan") if etcd else (journal_bytes(stack.journal) - size0) / runs
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
        with journal_reader(stack) as j:
            last = j.entries()[-1].seq
            for run in range(-1, runs):          # run -1: a warm-up, not kept
                # a rank in a different pod each run (rank 43: GPU 3 of the 6th server)
                victim = rank_map[(run % pods) * per_pod_ranks + 43 % per_pod_ranks]
                t_fail = time.time()
                request(stack.control, {"cmd": "fail_gpu", "gpu": victim}, 30.0)

                journaled: list[str] = []

                def done(last: int = last, journaled: list[str] = journaled) -> list | None:
                    if not isinstance(j, SqliteJournal):
                        time.sleep(0.002)       # (asking etcd costs it a round trip)
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


HEAVY_SERVERS, TENANT_SERVERS = 16, 8     # of each pod / of pod 0, after the heavy job's
ADMISSION_GOAL = 2.0                       # the tenant's grant p99 during it / alone, at most
AFTER_ADMISSION_S = 0.1                    # a grant this soon after an admission is "during"


def _pods(spec) -> list[list[str]]:
    """Each pod's working servers, in rack order."""
    layout = rail_layout(spec)
    spare = {layout.servers[g] for g in layout.spares}
    servers = [s for s in layout.server_gpus if s not in spare]
    per_pod = (spec.pod or spec.servers) - spec.spare_servers
    pods = [servers[k:k + per_pod] for k in range(0, len(servers), per_pod)]
    if per_pod < HEAVY_SERVERS + TENANT_SERVERS or spec.rails < 2:
        raise CommandFailed(f"rig {spec.name}: --admission needs pods of "
                            f"{HEAVY_SERVERS + TENANT_SERVERS} working servers on 2 rails or "
                            "more")
    return pods


def heavy_admission(spec) -> tuple[JobPlan, dict[int, str]]:
    """The issue's heavy admission: a rank per GPU of the first 16 servers of each pod (1,024
    on opus2048), 64 all-to-all phases over each rail's 16 servers of a pod (15 rounds each:
    960 (phase, round)s, every one on every OCS)."""
    layout = rail_layout(spec)
    gpus = [g for pod in _pods(spec) for s in pod[:HEAVY_SERVERS] for g in layout.server_gpus[s]]
    plan = JobPlan("heavy", len(gpus), tuple(
        PhaseSpec(f"a2a{k}", "all_to_all", group=HEAVY_SERVERS, stride=spec.rails)
        for k in range(MAX_PHASES)))
    return plan, dict(enumerate(gpus))


def tenant_job(spec) -> tuple[JobPlan, dict[int, str]]:
    """The other tenant: the next 8 servers of pod 0; TP inside each, a DP ring and an
    all-to-all over them on each rail."""
    layout = rail_layout(spec)
    servers = _pods(spec)[0][HEAVY_SERVERS:HEAVY_SERVERS + TENANT_SERVERS]
    gpus = [g for s in servers for g in layout.server_gpus[s]]
    plan = JobPlan("tenant", len(gpus), (
        PhaseSpec("tp", "ring", group=spec.rails, stride=1),
        PhaseSpec("dp", "ring", group=TENANT_SERVERS, stride=spec.rails),
        PhaseSpec("ep", "all_to_all", group=TENANT_SERVERS, stride=spec.rails)))
    return plan, dict(enumerate(gpus))


def _grants(fabric: Fabric, keys: list[tuple[str, int]], gap_s: float, runs: int | None,
            until: threading.Event | None = None) -> list[tuple[float, float]]:
    """(start, end) of each phase grant (time.monotonic), the job computing `gap_s` between
    two: `runs` of them, or until `until` is set."""
    out: list[tuple[float, float]] = []
    while (runs is None or len(out) < runs) and not (until is not None and until.is_set()):
        time.sleep(gap_s)
        t = time.monotonic()
        fabric.phase(*keys[len(out) % len(keys)])
        out.append((t, time.monotonic()))
    return out


def _admission(args, spec) -> dict:
    """The tenant's grants alone, then during the heavy admissions (module docstring)."""
    heavy_plan, heavy_map = heavy_admission(spec)
    plan, rank_map = tenant_job(spec)
    keys = plan.sequence()
    gap_s = args.gap_ms / 1e3
    stack = agent_stack(args.rig, one_process=True, journal_sync=args.journal_sync,
                        journal=args.journal)
    tenant = heavy = None
    spans: list[tuple[float, float]] = []
    failed: list[BaseException] = []
    try:
        tenant = Fabric(*stack.rig.agent_endpoints(), timeout=60, job="tenant")
        heavy = Fabric(*stack.rig.agent_endpoints(), timeout=600, job="heavy")
        tenant.admit(plan, rank_map)
        _grants(tenant, keys, gap_s, 2 * len(keys))                 # warm-up
        rss = {"tenant admitted": stack_rss_mb(stack)}
        done = threading.Event()

        def admit() -> None:
            try:
                quiet = 1.0
                for _ in range(args.admissions):
                    done.wait(quiet)
                    t = time.monotonic()
                    heavy.admit(heavy_plan, heavy_map)          # (again: the same name)
                    spans.append((t, time.monotonic()))
                    quiet = max(1.0, spans[-1][1] - t)
                done.wait(quiet)
            except BaseException as e:                          # (said below, not lost)
                failed.append(e)
            finally:
                done.set()
        thread = threading.Thread(target=admit, name="heavy admissions", daemon=True)
        thread.start()
        grants = _grants(tenant, keys, gap_s, None, until=done)
        thread.join()
        rss["after the admissions"] = stack_rss_mb(stack)
    finally:
        for fabric in (tenant, heavy):
            if fabric is not None:
                fabric.close()
        stack.close()
    if failed:
        raise CommandFailed(f"the heavy admission failed: {failed[0]}")
    overlap = [any(s < end and start < e + AFTER_ADMISSION_S for s, e in spans)
               for start, end in grants]
    a = [end - start for (start, end), o in zip(grants, overlap, strict=True) if not o]
    d = [end - start for (start, end), o in zip(grants, overlap, strict=True) if o]
    if not d or not a:
        raise CommandFailed("the tenant's grants were all during the heavy admissions, or "
                            "none was")
    took = [e - s for s, e in spans]
    ratio = percentile(d, 0.99) / percentile(a, 0.99)
    rows = [_rows(f"tenant's phase grant ({plan.world} ranks), between admissions", a),
            _rows("the same, during the heavy admission", d),
            {"case": f"heavy admission ({heavy_plan.world} ranks, "
                     f"{len(heavy_plan.sequence())} (phase, round)s)", "runs": len(took),
             "p50_ms": f"{1e3 * statistics.median(took):.0f}", "p99_ms": "",
             "max_ms": f"{1e3 * max(took):.0f}"}]
    notes = [f"the tenant's grant p99 during the heavy admission / alone: {ratio:.2f}x (goal "
             f"<= {ADMISSION_GOAL:g}x: {'met' if ratio <= ADMISSION_GOAL else 'NOT met'})"]
    notes += [f"RSS of {name} (its children included): " +
              ", ".join(f"{when} {got[name]:.0f} MiB" for when, got in rss.items())
              for name in rss["tenant admitted"]]
    return {"rows": rows, "notes": notes, "rss_mib": rss, "ratio_p99": round(ratio, 3),
            "samples_ms": {"alone": [round(1e3 * x, 3) for x in a],
                           "during": [round(1e3 * x, 3) for x in d],
                           "admission": [round(1e3 * x, 3) for x in took]}}


def run(args) -> dict:
    try:
        spec = rig_spec(args.rig)
    except (RigFileError, ValueError) as e:
        raise CommandFailed(str(e)) from None
    if args.admission:
        return _admission(args, spec)
    plan, group = rack_plan(spec)
    stack = agent_stack(args.rig, one_process=True, journal_sync=args.journal_sync,
                        journal=args.journal)
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
    if grown == grown:               # (not NaN: a journal file to weigh)
        notes.append(f"journal: {grown / 1e3:.1f} KB more per timed phase switch")
    else:
        notes.append(f"journal: on etcd ({args.journal}); its size is etcd's")
    notes += [f"RSS of {m['process']}: " + ", ".join(f"{k} {v}" for k, v in m.items()
                                                    if k != "process") for m in mem]
    return {"rows": rows, "memory": mem, "notes": notes, "started_s": stack.started,
            "rss_mib": rss, "cpu_ms_per_phase_switch": cpu_ms,
            "journal_bytes_per_phase_switch": round(grown) if grown == grown else None,
            "journal": args.journal, "samples_ms": {
                "phase": [round(1e3 * x, 3) for x in phase_s], "ocs_written": written,
                **{f"failover {k}": [round(1e3 * x, 3) for x in v]
                   for k, v in parts.items() if k != "ocs"}}}
