"""Recovery: an agent (re)started takes up where the last one left, from its journal.

The switches are reconciled with the journal's intended circuits first (only what differs is
repaired). Then the jobs are read back: each admission not released since, with the rank map
of its last swap (or of its admission) and the phase whose circuits the switches were last
told to hold. A swap decided but never announced (the agent was killed between the two) is
finished: its circuits made so, verified, and the job told, so the job hears of it exactly
once and no switch moves more than it would have.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from photonic_testbed.common.jobplan import JobPlan
from photonic_testbed.common.rack_layout import RackLayout
from photonic_testbed.hil.agent import policies
from photonic_testbed.hil.agent.failover import Failover, Matchings
from photonic_testbed.hil.agent.jobs import Job, Key, SwapOutcome
from photonic_testbed.hil.agent.journal import Entry, Journal
from photonic_testbed.hil.agent.pool import GpuPool
from photonic_testbed.hil.agent.writer import SwitchWriter


@dataclass
class Recovered:
    """A job as the journal has it, and the swap of it decided but not announced, if any."""
    job: Job
    unfinished: Entry | None = None


def read_jobs(journal: Journal, layout: RackLayout, matchings: Matchings) -> list[Recovered]:
    """The jobs the journal holds (admitted and not released), in the order admitted."""
    found: dict[str, dict[str, Any]] = {}     # job -> admit, swap, announced, phase
    last = None
    for e in journal.entries(kinds=("decision", "rank_map", "phase")):
        action = e.details.get("action")
        if e.kind == "decision" and action == "admit":
            name = e.details.get("job") or e.details["plan"]["name"]
            found[name] = {"admit": e, "swap": None, "announced": 0, "phase": None}
            last = name
            continue
        name = e.details.get("job") or last
        if name not in found:
            continue
        if e.kind == "decision" and action == "release":
            del found[name]
        elif e.kind == "decision" and action == "swap":
            found[name]["swap"] = e
        elif e.kind == "rank_map":
            found[name]["announced"] = e.seq
        elif e.kind == "phase" and "phase" in e.details:
            found[name]["phase"] = (e.details["phase"], int(e.details.get("round", 0)))
    intended = {n: dict(c) for n, c in journal.intended().items()}
    out = []
    for name, f in found.items():
        plan = JobPlan.from_dict(f["admit"].details["plan"])
        swap = f["swap"]
        source = swap if swap is not None else f["admit"]
        rank_map = {int(r): g for r, g in source.details["rank_map"].items()}
        circuits = policies.JobCircuits(plan, layout, rank_map, matchings)
        phase = f["phase"]
        if swap is not None and swap.details.get("phase"):
            phase = tuple(swap.details["phase"])
        job = Job(name, plan, circuits, phase or next(iter(circuits.targets)), dict(rank_map))

        # The phase whose circuits the switches were last told to hold (a phase entry is
        # written after its grant, so a kill just after a switch may have lost it).
        def held(key: Key, circuits: policies.JobCircuits = circuits) -> bool:
            targets = circuits.targets.get(key)
            return bool(targets) and all(
                all(intended.get(n, {}).get(i) == o for i, o in c.items())
                for n, c in targets.items())
        if not held(job.phase):
            job.phase = next((k for k in circuits.targets if held(k)), job.phase)
        unfinished = swap if swap is not None and swap.seq >= f["announced"] else None
        out.append(Recovered(job, unfinished))
    return out


def recover(journal: Journal, layout: RackLayout, jobs: dict[str, Job], pool: GpuPool,
            writer: SwitchWriter, failover: Failover, matchings: Matchings
            ) -> SwapOutcome | None:
    """What `Agent.start` does: journal the start, reconcile the switches, rebuild `jobs` (and
    the GPUs and switch parts they hold) from the journal, and finish each swap decided but
    not announced. Returns the outcome of the (last) swap finished."""
    journal.record("start", "agent started")
    writer.reconcile("agent start")
    jobs.clear()                          # what the journal says, from scratch
    pool.release_all()
    writer.drop_all()
    outcome = None
    for r in read_jobs(journal, layout, matchings):
        job = r.job
        jobs[job.name] = job
        pool.take(job.name, list(job.rank_map.values()))
        writer.hold(job.name, job.circuits.targets[job.key()])
        if r.unfinished is not None:
            d = r.unfinished.details
            outcome = failover.resume(job, list(d.get("failed", ())), d.get("swaps", {}),
                                      r.unfinished.cause)
    return outcome
