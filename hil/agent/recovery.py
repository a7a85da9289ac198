"""Recovery: an agent (re)started takes up where the last one left, from its journal.

The switches are reconciled with the journal's intended circuits first (only what differs is
repaired). Then the jobs are read back: each admission not released since, with the rank map
of its last swap (or of its admission) and its phase as last decided: the admission's first
phase, a swap's phase, or a `PhaseIntent` (journaled with the phase's intended circuits, before
the job was granted it), the one set up ahead named `ready` until another is decided. A journal
written before phases were decided so (no `PhaseIntent` for the job) gives its last `phase`
entry, or the first phase whose circuits the switches were told to hold. A swap decided but
never announced (the agent was killed between the two) is finished: its circuits made so,
verified, and the job told, so the job hears of it exactly once and no switch moves more than
it would have.
"""
from __future__ import annotations

import threading
from concurrent.futures import Future
from dataclasses import dataclass

import orjson

from photonic_testbed.common.jobplan import JobPlan
from photonic_testbed.common.rack_layout import RackLayout
from photonic_testbed.hil.agent import policies
from photonic_testbed.hil.agent.entries import (
    Admit,
    PhaseIntent,
    PhaseSwitched,
    RankMapAnnounced,
    Release,
    Start,
    Swap,
)
from photonic_testbed.hil.agent.failover import Failover, Matchings
from photonic_testbed.hil.agent.jobs import Job, Key, SwapOutcome
from photonic_testbed.hil.agent.journal import Journal
from photonic_testbed.hil.agent.pool import GpuPool
from photonic_testbed.hil.agent.writer import SwitchWriter


@dataclass
class Recovered:
    """A job as the journal has it, and the swap of it decided but not announced, if any
    (its decision, and the entry's cause)."""
    job: Job
    unfinished: tuple[Swap, str] | None = None


@dataclass
class _Found:
    """What the journal says of a job so far: its admission, its last swap (with the entry's
    sequence number and cause), its last announced rank map, its phase (and the one set up
    ahead) as last decided, and whether a `PhaseIntent` said so (else the phase of its last
    `phase` entry, in a journal of before)."""
    admit: Admit
    swap: tuple[Swap, int, str] | None = None
    announced: int = 0
    phase: Key | None = None
    ready: Key | None = None
    decided: bool = False


class CircuitsAhead:
    """Jobs' circuits worked out ahead of need (a standby's, from the journal it follows:
    hil.agent.warm), that `read_jobs` takes rather than work out again as the replica takes the
    lead, or waits for if they are being worked out: by the job's name, plan, rank map and the
    matchings and rack they are worked out for. Only those of the last reading are kept."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._kept: dict[tuple, Future[policies.JobCircuits]] = {}
        self._used: set[tuple] = set()
        self._layout: RackLayout | None = None
        self.taken = 0              # circuits `read_jobs` took from here
        self.made = 0               # circuits worked out here

    def reading(self, layout: RackLayout) -> None:
        """A reading of the journal against `layout` begins (circuits of another rack go)."""
        with self._lock:
            if layout != self._layout:
                self._layout, self._kept = layout, {}
            self._used = set()

    def read(self) -> None:
        """The reading is over: circuits it did not ask for go."""
        with self._lock:
            self._kept = {k: f for k, f in self._kept.items() if k in self._used}

    def circuits(self, name: str, admit: Admit, rank_map: dict[int, str],
                 layout: RackLayout, matchings: Matchings, mine: bool = False
                 ) -> policies.JobCircuits:
        """Job `name`'s circuits (as admitted, on `rank_map`): those worked out ahead if any,
        else worked out now (and kept, unless `mine`: the reading of the replica taking the
        lead, whose jobs then own them)."""
        key = (name, orjson.dumps(admit.plan, option=orjson.OPT_SORT_KEYS),
               tuple(sorted(rank_map.items())), matchings)
        with self._lock:
            made = self._kept.get(key) if layout == self._layout else None
            self._used.add(key)
            ahead = made is not None
            if made is None:
                made = Future()
                if not mine:
                    self._kept[key] = made
        if ahead:                   # (worked out, or being worked out by another reading)
            try:
                got = made.result()
            except Exception:
                if not mine:
                    raise
            else:
                self.taken += mine
                return got
        made = made if not ahead else Future()      # (what failed ahead is worked out again)
        self.made += 1
        try:
            made.set_result(policies.JobCircuits(JobPlan.from_dict(admit.plan), layout,
                                                 rank_map, matchings))
        except BaseException as e:
            made.set_exception(e)
            with self._lock:                        # (a failure is not kept for the next)
                if self._kept.get(key) is made:
                    del self._kept[key]
        return made.result()


def read_jobs(journal: Journal, layout: RackLayout, matchings: Matchings,
              ahead: CircuitsAhead | None = None, mine: bool = True) -> list[Recovered]:
    """The jobs the journal holds (admitted and not released), in the order admitted; their
    circuits from `ahead` when worked out there (`mine`: the reading of the replica taking the
    lead, see `CircuitsAhead.circuits`)."""
    found: dict[str, _Found] = {}
    last = ""                   # (an entry without a job's name: the job admitted last)
    for e in journal.entries(kinds=("decision", "rank_map", "phase")):
        d = e.details
        if isinstance(d, Admit):
            last = d.name()
            found[last] = _Found(d)
            continue
        if not isinstance(d, (Swap, Release, RankMapAnnounced, PhaseSwitched, PhaseIntent)):
            continue            # (a switch's intended circuits: read whole below)
        f = found.get(d.job or last)
        if f is None:
            continue
        if isinstance(d, Release):
            del found[d.job or last]
        elif isinstance(d, Swap):
            f.swap = (d, e.seq, e.cause)
            if d.phase:
                f.phase, f.ready = d.phase, None
        elif isinstance(d, RankMapAnnounced):
            f.announced = e.seq
        elif isinstance(d, PhaseIntent):
            f.phase, f.decided = (d.phase, d.round), True
            f.ready = f.phase if d.ahead else None
        elif d.phase and not f.decided:
            f.phase = (d.phase, d.round)
    intended = {n: dict(c) for n, c in journal.intended().items()}
    out = []
    for name, f in found.items():
        plan = JobPlan.from_dict(f.admit.plan)
        swap = f.swap[0] if f.swap is not None else None
        rank_map = dict(swap.rank_map if swap is not None else f.admit.rank_map)
        circuits = ahead.circuits(name, f.admit, rank_map, layout, matchings, mine) \
            if ahead is not None else policies.JobCircuits(plan, layout, rank_map, matchings)
        job = Job(name, plan, circuits, f.phase or next(iter(circuits.targets)),
                  dict(rank_map), ready=f.ready, owner=f.admit.owner)
        if not f.decided:
            job.phase = _held_phase(job, circuits, intended)
        unfinished = None
        if f.swap is not None and f.swap[1] >= f.announced:
            unfinished = (f.swap[0], f.swap[2])
        out.append(Recovered(job, unfinished))
    return out


def _held_phase(job: Job, circuits: policies.JobCircuits,
                intended: dict[str, dict[int, int]]) -> Key:
    """A journal written before phases were decided before their grant: the phase of the
    job's last `phase` entry (written after its grant, so a kill just after a switch may have
    lost it), else the first phase whose circuits the switches were last told to hold."""
    def held(key: Key) -> bool:
        targets = circuits.targets.get(key)
        if not targets:
            return False
        return all(
            all(intended.get(n, {}).get(i) == o for i, o in c.items())
            for n, c in targets.items())
    if held(job.phase):
        return job.phase
    return next((k for k in circuits.targets if held(k)), job.phase)


def recover(journal: Journal, layout: RackLayout, jobs: dict[str, Job], pool: GpuPool,
            writer: SwitchWriter, failover: Failover, matchings: Matchings,
            term: int | None = None, ahead: CircuitsAhead | None = None
            ) -> SwapOutcome | None:
    """What `Agent.start` does: journal the start (with the agent's `term`), reconcile the
    switches, rebuild `jobs` (and the GPUs and switch parts they hold) from the journal, and
    finish each swap decided but not announced. Returns the outcome of the (last) swap
    finished."""
    journal.record(Start(term=term), "agent started")
    writer.reconcile("agent start")
    jobs.clear()                          # what the journal says, from scratch
    pool.release_all()
    writer.drop_all()
    outcome = None
    for r in read_jobs(journal, layout, matchings, ahead):
        job = r.job
        jobs[job.name] = job
        pool.take(job.name, list(job.rank_map.values()))
        writer.hold(job.name, job.circuits.targets[job.key()])
        if r.unfinished is not None:
            swap, cause = r.unfinished
            outcome = failover.resume(job, list(swap.failed), dict(swap.swaps), cause)
    return outcome
