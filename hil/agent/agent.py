"""The agent's orchestration: health and phase events in; circuits, rank maps and alarms out.

Inputs are plain method calls, so a bus adapter (or a test) connects them directly:
`admit(plan)` (or `admit_later(plan)`: a Future, its circuits worked out beside the agent),
`on_health(GpuHealth)`, `on_phase(phase, round)`, `on_job_failure(...)`,
`on_job_event(event)`, `release(job)`, `start()` (reconcile after a (re)start), `reconcile()`.
Outputs go to one events object given at construction (`events.AgentEvents`; subclass
`events.NoEvents`): `on_grant(phase, round)` (the job may communicate), `on_restart(rank_map,
cause)` and `on_order(job, rank_map, cause)`, `on_rank_map(rank_map)`, `on_alarm(text,
details)`.

Several jobs (tenants) share the rack: each holds its own GPUs (allocated at admission, whole
servers within one pod where the rack has servers, best fit) and its own circuits; a switch
holds the union of every job's part, so a phase switch or a failover of one job writes only
that job's ports, and never another job's. Spares are shared. The job methods take `job=` (the
job's name, its plan's name by default); with one job it may be left out.

Switches are `CircuitSwitch` objects; light is read through `read_power(switch, port) -> dBm`
(a power meter on the output fibres). Every decision is written to the journal *before* it is
applied (the intended circuits of each switch included), so an agent killed mid-swap and
started again repairs only what differs and finishes the swap without extra switch moves.
The journal is synced twice per failover, not once per entry: detection, decision and intended
circuits together before any switch moves; what was applied and verified together with the rank
map and restart order before the job hears it (`Journal.record(defer=True)`). A phase switch
syncs its decision (`PhaseIntent`: the job, its phase and round) with its intended circuits
before moving, so a restarted agent names the phase exactly; its outcome entry (what moved)
follows after the grant.

`Agent` is the facade of parts with one job each: `pool.GpuPool` (who holds which GPU, spares,
health, quarantine, allocation), `writer.SwitchWriter` (each job's part of every switch, the
journal's intent first, reconciliation), `diagnosis.Diagnosis` (verification by light,
loopback, eviction bounds), `failover.Failover` (the swap loop), `recovery.recover` (the
journal read back at start) and `admission.Admissions` (a job's circuits worked out in a worker
process, bounded, while the agent serves the others; its GPUs kept for it meanwhile). It holds
the jobs and the lock, and speaks to the outside.
"""
from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Collection, Mapping
from concurrent.futures import Future
from typing import Any

from photonic_testbed.common.jobplan import JobPlan, PlanError, round_robin_matchings
from photonic_testbed.common.rack_layout import RackLayout
from photonic_testbed.drivers.circuit_switch import ApplyReport, Circuits, CircuitSwitch
from photonic_testbed.hil.agent import admission, policies
from photonic_testbed.hil.agent.admission import Admissions
from photonic_testbed.hil.agent.config import AgentConfig
from photonic_testbed.hil.agent.diagnosis import Diagnosis
from photonic_testbed.hil.agent.entries import (
    Admit,
    Alarm,
    Detected,
    JobFailure,
    Note,
    PhaseIntent,
    PhaseSwitched,
    RankMapAnnounced,
    Release,
    RestartOrder,
)
from photonic_testbed.hil.agent.events import AgentEvents, NoEvents
from photonic_testbed.hil.agent.failover import Failover, LossDb, Matchings
from photonic_testbed.hil.agent.jobs import AgentError, Job, Key, SwapOutcome
from photonic_testbed.hil.agent.journal import Journal
from photonic_testbed.hil.agent.policies import RankMap, Targets
from photonic_testbed.hil.agent.pool import GpuPool
from photonic_testbed.hil.agent.recovery import CircuitsAhead, recover
from photonic_testbed.hil.agent.writer import SwitchWriter
from photonic_testbed.hil.gpus.health import GpuHealth

log = logging.getLogger(__name__)

__all__ = ["Agent", "AgentError", "Job", "SwapOutcome"]


def _now(fn: Callable[[], None]) -> None:
    fn()


class Agent:
    """The host agent: its jobs, its lock and its parts (the module's docstring says how)."""

    def __init__(self, layout: RackLayout, switches: Mapping[str, CircuitSwitch],
                 journal: Journal, read_power: Callable[[str, int], float], *,
                 config: AgentConfig | None = None, events: AgentEvents | None = None,
                 clock: Callable[[], float] = time.perf_counter,
                 loss_db: LossDb | None = None,
                 matchings: Matchings = round_robin_matchings):
        missing = set(layout.switches) - set(switches)
        if missing:
            raise AgentError(f"no CircuitSwitch given for switch(es) {sorted(missing)}")
        self.layout = layout
        self.journal = journal
        self.clock = clock
        self.config = config = config if config is not None else AgentConfig()
        self.matchings = matchings
        self.events: AgentEvents = events if events is not None else NoEvents()
        # how the work that follows a phase's grant is done: at once, by default; a caller
        # whose grant is a reply (the agent on the bus) runs it once the reply has gone
        self.after_grant: Callable[[Callable[[], None]], None] = _now
        # where a job whose circuits were worked out beside the agent (`admit_later`) is taken
        # on (its switches written, its journal entries): at once, on the admissions' thread,
        # by default; the agent on the bus, whose device clients are its loop's, runs it there
        self.take_on: Callable[[Callable[[], None]], None] = _now
        self.jobs: dict[str, Job] = {}
        self.pool = GpuPool(layout, clock, config)
        self.writer = SwitchWriter(layout, switches, journal, clock, self._alarm)
        self.switches = self.writer.switches
        self.diagnosis = Diagnosis(layout, read_power, journal, clock, self.writer, self.pool,
                                   self._alarm, config)
        self.failover = Failover(layout, self.pool, self.writer, self.diagnosis, journal,
                                 clock, self._alarm, self._announce, matchings=matchings,
                                 loss_db=loss_db)
        # jobs' circuits worked out beside the agent (`admit_later`), one at a time
        self.admissions = Admissions(layout, matchings)
        self._lock = threading.RLock()

    # --- jobs -----------------------------------------------------------------------------
    def job(self, name: str | None = None) -> Job:
        """The job of that name; with None, the only job."""
        if name is not None:
            try:
                return self.jobs[name]
            except KeyError:
                raise AgentError(f"no job {name!r} admitted; jobs: "
                                 f"{', '.join(self.jobs) or 'none'}") from None
        if len(self.jobs) == 1:
            return next(iter(self.jobs.values()))
        if not self.jobs:
            raise AgentError("no job admitted: call admit(plan) first")
        raise AgentError(f"{len(self.jobs)} jobs are admitted ({', '.join(self.jobs)}): "
                         "name one")

    def _first(self) -> Job | None:
        return next(iter(self.jobs.values()), None)

    # the single-job view (the first job admitted), as before several jobs could share a rack
    @property
    def plan(self) -> JobPlan | None:
        j = self._first()
        return j.plan if j else None

    @property
    def rank_map(self) -> RankMap:
        j = self._first()
        return j.rank_map if j else {}

    @property
    def phase(self) -> Key | None:
        j = self._first()
        return j.phase if j else None

    def holds_rank(self, gpu: str) -> bool:
        return self.pool.holder(gpu) is not None

    def health(self, gpu: str) -> str:
        """A GPU's health as last reported ("ok" until reported otherwise)."""
        return self.pool.health(gpu)

    def healths(self) -> Mapping[str, str]:
        """{gpu: health} of every GPU reported on (a read-only view, kept current)."""
        return self.pool.healths()

    def holder(self, gpu: str) -> Job | None:
        name = self.pool.holder(gpu)
        return self.jobs.get(name) if name is not None else None

    def spares(self) -> list[str]:
        """GPUs that may take a rank now (held by no job), in rack order."""
        return self.pool.spares()

    def return_to_pool(self, gpu: str) -> None:
        """An operator repaired a GPU that failed verification: it may be a spare again."""
        with self._lock:
            self.pool.return_to_pool(gpu)

    def close(self) -> None:
        self.admissions.close()
        self.writer.close()

    def _alarm(self, text: str, about: Alarm) -> None:
        log.error("alarm: %s", text)
        self.journal.record(about, text)
        self.events.on_alarm(text, about)

    def reconcile(self, cause: str = "reconcile") -> dict[str, int]:
        """Read every switch, repair only what differs from the journal's intended circuits.
        Returns {switch: circuits added + removed}."""
        with self._lock:
            return self.writer.reconcile(cause)

    def on_switches(self, found: Mapping[str, Circuits]) -> dict[str, int]:
        """Switches say what circuits they hold: where not what the jobs were given, put back
        (`SwitchWriter.noticed`), so that a phase is not granted on circuits the agent knows
        differ from what it made."""
        with self._lock:
            return self.writer.noticed(found)

    # --- recovery ---------------------------------------------------------------------------
    def start(self, term: int | None = None, ahead: CircuitsAhead | None = None
              ) -> SwapOutcome | None:
        """Reconcile the switches with the journal and take up where a previous agent left:
        its jobs, their rank maps and phases; a swap it decided but never announced is
        finished. Returns the outcome of the (last) swap finished. `term`: the one the
        switches' changes carry (journaled in the start entry); `ahead`: the jobs' circuits
        as a standby worked them out ahead (hil.agent.warm)."""
        with self._lock:
            return recover(self.journal, self.layout, self.jobs, self.pool, self.writer,
                           self.failover, self.matchings, term, ahead)

    # --- job admission and phases ----------------------------------------------------------
    def admit(self, plan: JobPlan, rank_map: Mapping[int, str] | None = None,
              job: str | None = None, owner: str | None = None) -> RankMap:
        """Take on a job (named `job`, its plan's name by default; `owner`, the key whose job
        it is): GPUs for its ranks (given, or allocated), every phase's circuits, worked out
        holding the agent (`admit_later`: beside it), and its first phase set up. Admitting a
        job of a name already admitted takes it on afresh."""
        with self._lock:
            name = job or plan.name
            ranks = self._choose(name, plan, rank_map)
            try:
                circuits = policies.JobCircuits(plan, self.layout, ranks, self.matchings)
            except (policies.PolicyError, PlanError) as e:
                raise AgentError(f"job {plan.name!r} does not fit rack {self.layout.name!r}: "
                                 f"{e}") from None
            return self._commit(name, plan, ranks, circuits, owner)

    def admit_later(self, plan: Mapping[str, Any], rank_map: Mapping[int, str] | None = None,
                    job: str | None = None, owner: str | None = None,
                    approve: Callable[[str], object] = lambda name: None
                    ) -> Future[tuple[str, RankMap]]:
        """`admit` off the hot path: the plan (its dict, as it came) read and its circuits
        worked out in the admissions' worker (`hil.agent.admission`, bounded in time, memory
        and size), while the agent serves its other jobs; its GPUs are kept for it meanwhile.
        `approve(name)` is asked as the job is taken on (what it raises refuses it). The Future
        gives (the job's name, its rank map), or the error that refused it."""
        def run(read: JobPlan, links: int, circuits: Callable[[RankMap], policies.JobCircuits]
                ) -> tuple[str, RankMap]:
            name = job or read.name
            with self._lock:
                ranks, kept = self._reserve(name, read, rank_map, links)
            try:
                made = circuits(ranks)              # the agent is not held meanwhile
            except BaseException:
                with self._lock:
                    self.pool.unreserve(kept)
                raise
            taken: Future[tuple[str, RankMap]] = Future()

            def commit() -> None:
                try:
                    with self._lock:
                        self.pool.unreserve(kept)
                        approve(name)
                        taken.set_result((name, self._commit(name, read, ranks, made, owner)))
                except BaseException as e:          # (the admission's answer)
                    taken.set_exception(e)
            self.take_on(commit)
            return self.admissions.wait(taken)
        return self.admissions.submit(plan, len(self.layout.gpus), run)

    def _choose(self, name: str, plan: JobPlan, rank_map: Mapping[int, str] | None
                ) -> RankMap:
        old = self.jobs.get(name)
        return self.pool.choose(name, plan, rank_map, old.gpus() if old else None)

    def _reserve(self, name: str, plan: JobPlan, rank_map: Mapping[int, str] | None,
                 links: int) -> tuple[RankMap, list[str]]:
        """A job to admit beside the agent: within the rank links all jobs may hold
        (`admission.ALL_LINKS`), its GPUs chosen and those no job holds kept for it."""
        old = self.jobs.get(name)
        held = sum(j.circuits.size for j in self.jobs.values() if j is not old)
        if held + links > admission.ALL_LINKS:
            raise AgentError(f"job {name!r}: its {links:,} rank links and the {held:,} of the "
                             f"jobs admitted would pass the {admission.ALL_LINKS:,} the agent "
                             "keeps: refused")
        ranks = self._choose(name, plan, rank_map)
        kept = [g for g in ranks.values() if self.pool.holder(g) is None]
        self.pool.reserve(kept)
        return ranks, kept

    def _commit(self, name: str, plan: JobPlan, ranks: RankMap,
                circuits: policies.JobCircuits, owner: str | None) -> RankMap:
        """Take on a job whose GPUs and circuits are decided: checked again (a failover may
        have taken a GPU meanwhile), an earlier admission of its name released, the job
        journaled, its first phase's circuits set and its rank map announced."""
        old = self.jobs.get(name)
        if old is not None:
            self.pool.give_back(list(old.rank_map.values()))
        try:
            self.pool.check(name, plan, ranks)
        except BaseException:
            if old is not None:
                self.pool.take(name, list(old.rank_map.values()))
            raise
        if old is not None:
            # its GPUs back to the rack; its part of every switch becomes the new one's in the
            # one write below (every switch is in a job's targets)
            del self.jobs[name]
        new = Job(name, plan, circuits, next(iter(circuits.targets)), dict(ranks), owner=owner)
        self.jobs[name] = new
        self.pool.take(name, list(ranks.values()))
        # the admission and its first phase ride the sync of that phase's intended circuits;
        # what the switches did follows in one entry, as a phase switch's does
        cause = f"job {name} admitted"
        first = new.phase
        applied = self.writer.apply(new.name, circuits.targets[first], cause, record=False,
                                    decisions=[Admit(job=name, plan=plan.to_dict(),
                                                     rank_map=ranks, owner=owner),
                                               PhaseIntent(job=name, phase=first[0],
                                                           round=first[1])])
        self.journal.record(PhaseSwitched(phase=first[0], round=first[1], job=name,
                                          applied=self.writer.reported(applied, cause)),
                            cause, defer=True)
        self._announce(new, cause, restart=False)
        return dict(ranks)

    def release(self, job: str | None = None, cause: str = "") -> RankMap:
        """The job is done: its GPUs go back to the rack, its circuits are taken down."""
        with self._lock:
            j = self.job(job)
            return self._release(j, cause or f"job {j.name} released")

    def _release(self, job: Job, cause: str, journal: bool = True) -> RankMap:
        if journal:
            self.journal.record(Release(job=job.name), cause)
        empty: Targets = {s: {} for s in job.circuits.targets[job.key()]}
        self.writer.apply(job.name, empty, cause)
        self.writer.drop(job.name)
        self.pool.give_back(list(job.rank_map.values()))
        del self.jobs[job.name]
        return dict(job.rank_map)

    def on_phase(self, phase: str, round: int = 0, job: str | None = None) -> None:
        """The job reached (phase, round): switch its rails, then grant it."""
        with self._lock:
            j = self.job(job)
            key = (str(phase), int(round))
            if key not in j.circuits.targets:
                raise AgentError(f"job {j.name!r} has no phase {phase!r} round {round}")
            t0 = self.clock()
            cause = f"phase {phase} round {round}"
            if len(self.jobs) > 1:
                cause = f"{j.name}: {cause}"
            previous, j.phase, j.ready = j.phase, key, None
            targets = j.circuits.refresh(key)        # up to date after a swap
            # the phase in force, journaled before the grant, with its intended circuits
            intent = [PhaseIntent(job=j.name, phase=key[0], round=key[1])] \
                if key != previous else []
            applied = self.writer.apply(j.name, targets, cause, record=False, decisions=intent)
            if self.config.verify_phases:
                if self.diagnosis.verify(self.diagnosis.points(targets, None), cause, t0):
                    self._alarm(f"{cause}: circuits do not verify",
                                Alarm(phase=key[0], round=key[1]))
                    return
            self.events.on_grant(*key)
            latency = self.clock() - t0
            self.after_grant(lambda: self._granted(j, key, previous, targets, applied, cause,
                                                   latency))

    def _granted(self, j: Job, key: Key, previous: Key | None, targets: Targets,
                 applied: dict[str, tuple[ApplyReport, float]], cause: str,
                 latency: float) -> None:
        """What follows a phase's grant, which nothing the job waits for needs: the next
        phase's circuits handed to the switches that can stage them, and the phase's journal
        entry (deferred: durable with the next sync, as before)."""
        with self._lock:
            staged = []
            if self.config.prestage:
                keys = list(j.circuits.targets)
                nxt = j.circuits.refresh(keys[(keys.index(key) + 1) % len(keys)])
                for s, c in nxt.items():
                    fn = getattr(self.switches[s], "prestage", None)
                    if callable(fn) and c != targets[s]:
                        fn(c)
                        staged.append(s)
            if key == previous and not applied and not staged:
                return      # the same phase again, nothing moved: no new journal entry
            self.journal.record(PhaseSwitched(
                phase=key[0], round=key[1], job=j.name,
                applied=self.writer.reported(applied, cause), prestaged=staged),
                cause, latency, defer=True)

    def on_phase_done(self, phase: str, round: int = 0, job: str | None = None) -> Key | None:
        """The job is done with (phase, round)'s links and computes before its next phase:
        that phase's circuits are set up now, during the compute, so that the job finds them
        up (and verified, with verify_phases) when it gets there. Returns the phase set up,
        or None when there is nothing to do (one phase only)."""
        with self._lock:
            j = self.job(job)
            key = (str(phase), int(round))
            if key not in j.circuits.targets:
                raise AgentError(f"job {j.name!r} has no phase {phase!r} round {round}")
            if j.phase != key:
                return None             # the job is elsewhere (a swap moved it): nothing staged
            nxt = j.next_key(key)
            if nxt == key:
                return None
            t0 = self.clock()
            cause = f"phase {nxt[0]} round {nxt[1]} set up ahead"
            if len(self.jobs) > 1:
                cause = f"{j.name}: {cause}"
            targets = j.circuits.refresh(nxt)
            j.phase = nxt
            applied = self.writer.apply(j.name, targets, cause, record=False, decisions=[
                PhaseIntent(job=j.name, phase=nxt[0], round=nxt[1], ahead=True)])
            if self.config.verify_phases and self.diagnosis.verify(
                    self.diagnosis.points(targets, None), cause, t0):
                self._alarm(f"{cause}: circuits do not verify",
                            Alarm(phase=nxt[0], round=nxt[1]))
                return None
            j.ready = nxt
            self.journal.record(PhaseSwitched(
                phase=nxt[0], round=nxt[1], job=j.name,
                applied=self.writer.reported(applied, cause), ahead=True),
                cause, self.clock() - t0, defer=True)
            return nxt

    def on_job_event(self, event: Any) -> None:
        """A job event (an object or dict with kind, phase, round, details) from the job."""
        get = (event.get if isinstance(event, Mapping)
               else lambda k, d=None: getattr(event, k, d))
        kind = get("kind")
        try:
            if kind == "phase":
                phase = get("phase")
                if phase is None:
                    raise AgentError("a phase event without its phase")
                self.on_phase(phase, get("round", 0))
            elif kind == "failure":
                d = get("details", {}) or {}
                self.on_job_failure(d.get("reason", ""), d.get("gpus", ()), d.get("links", ()))
        except AgentError as e:
            # the job's thread delivered this: tell the operator, leave the job to time out
            self._alarm(f"cannot serve job event {kind!r}: {e}",
                        Alarm(event=None if kind is None else str(kind)))

    # --- failures ---------------------------------------------------------------------------
    def on_health(self, *healths: GpuHealth | Mapping[str, Any]) -> SwapOutcome | None:
        """GPU health reports, as GpuHealth or its to_dict() form off the bus (several at
        once are handled as one failover per job they hit). Returns the last outcome."""
        with self._lock:
            failed = []
            for h in healths:
                if isinstance(h, Mapping):
                    try:
                        h = GpuHealth(**{**h, "reasons": tuple(h.get("reasons", ())),
                                         "xids": tuple(h.get("xids", ()))})
                    except TypeError as e:
                        raise AgentError(f"not a GPU health report: {e}") from None
                old = self.pool.report(h.gpu, h.state)
                if h.state == "failed":
                    if old != "failed":
                        self.journal.record(Detected(gpu=h.gpu, reasons=list(h.reasons)),
                                            f"GPU {h.gpu} failed", defer=True)
                        failed.append(h.gpu)
                elif h.state == "degraded" and old != "degraded":
                    self.journal.record(Note(reasons=list(h.reasons)), f"GPU {h.gpu} degraded")
            out = None
            for j, gpus in self._by_job(failed).items():
                out = self._failover(j, gpus, "GPU failure")
            if failed and not self._by_job(failed):
                self.journal.record(Note(gpus=failed), "GPU failure: no job holds "
                                    f"{', '.join(failed)}, nothing to swap")
            return out

    def _by_job(self, gpus: list[str]) -> dict[Job, list[str]]:
        out: dict[Job, list[str]] = {}
        for g in gpus:
            j = self.holder(g)
            if j is not None:
                out.setdefault(j, []).append(g)
        return out

    def on_job_failure(self, reason: str, gpus: Any = (), links: Any = (),
                       job: str | None = None) -> SwapOutcome | None:
        """The job failed. GPUs it names as lost are swapped out. Before anyone else is
        evicted, what the agent believes is checked against the switches (the difference is
        repaired), the links the job found down are measured again at their receivers, and a
        dark one is diagnosed end by end (`diagnose`). When nothing is left to blame, the
        current phase's circuits are verified and the job is restarted on the same GPUs."""
        with self._lock:
            t0 = self.clock()
            cause = f"job failure: {reason}" if reason else "job failure"
            self.journal.record(JobFailure(gpus=list(gpus), links=[(a, b) for a, b in links],
                                           job=job), reason or "job failure", defer=True)
            if not self.jobs:
                self.journal.record(Note(), f"{cause}: no job admitted, nothing to do")
                return None
            j = self.job(job)
            named = list(dict.fromkeys(gpus))
            lost = [g for g in named if self.pool.holder(g) == j.name]
            # A job speaks for its own links only: probing another job's would move its circuits
            links = [tuple(x) for x in links]
            own = [(s, d) for s, d in links
                   if self.pool.holder(s) == j.name and self.pool.holder(d) == j.name]
            if len(own) < len(links):
                self.journal.record(Note(job=j.name, links=[x for x in links if x not in own]),
                                    f"{cause}: links of GPUs job {j.name} does not hold are "
                                    "not its to report: ignored", defer=True)
            links = own
            if named and not lost and not links:
                # every GPU it names has been replaced already (the report crossed the order
                # that replaced them): the job has its order; nothing more to do
                self.journal.record(Note(job=j.name), f"{cause}: {', '.join(named)} already "
                                    "replaced, the job's restart order stands")
                return None
            self.reconcile(cause)                  # belief against the switches first
            dark = self.diagnosis.dark_links(links)
            blamed = [g for g in self.diagnose(dark, cause) if g not in lost] if dark else []
            blamed = [g for g in blamed if self.pool.holder(g) == j.name]
            for g in lost + blamed:
                if self.pool.health(g) != "failed":
                    self.journal.record(Detected(gpu=g, reason=reason),
                                        f"GPU {g} lost by the job", defer=True)
                self.pool.report(g, "failed")
            if lost or blamed:
                return self._failover(j, lost + blamed, "job failure")
            # Nobody to blame: the fabric as it should be, verified, and the job again.
            key = j.key()
            targets = j.circuits.refresh(key)
            self.writer.apply(j.name, targets, cause)
            bad = self.diagnosis.verify(self.diagnosis.points(targets, None), cause, t0)
            if bad:
                self._alarm(f"{cause}: circuits of phase {key[0]} round {key[1]} do not "
                            "verify and no GPU is to blame: a person is needed",
                            Alarm(dark=[list(b[:3]) for b in bad]))
                return None
            self._announce(j, f"{cause}: fabric verified, restart on the same GPUs")
            return SwapOutcome((), {}, dict(j.rank_map), latency_s=self.clock() - t0)

    def loopback(self, gpus: list[str], cause: str) -> dict[str, bool]:
        """Each GPU's own light sent back to it through each switch it is cabled to: {gpu:
        its receivers hear it} (`Diagnosis.loopback`)."""
        with self._lock:
            return self.diagnosis.loopback(gpus, cause)

    def diagnose(self, dark: list[tuple[str, int, int]], cause: str) -> list[str]:
        """Which end of each dark circuit is at fault (`Diagnosis.diagnose`): the GPUs to
        evict, within the eviction bounds."""
        with self._lock:
            return self.diagnosis.diagnose(dark, cause)

    def swap_out(self, gpu: str, cause: str = "manual swap", why: str = "",
                 among: Collection[str] = ()) -> SwapOutcome | None:
        """An operator (a planned swap: `why`, to one of `among` if free) swaps `gpu` out now:
        it is replaced as if it had failed, and stays out of the spares for the quarantine."""
        with self._lock:
            if gpu not in self.layout.gpus:
                raise AgentError(f"no GPU {gpu!r} in the rack: {', '.join(self.layout.gpus)}")
            job = self.holder(gpu)
            if job is None:
                raise AgentError(f"{gpu} holds no rank: there is nothing to swap")
            self.journal.record(Detected(gpu=gpu), why or f"operator asked to swap {gpu} out")
            self.pool.hold_out(gpu)
            return self._failover(job, [gpu], cause, among)

    def _failover(self, job: Job, failed: list[str], cause: str, among: Collection[str] = ()
                  ) -> SwapOutcome | None:
        return self.failover.run(job, failed, cause, name_job=len(self.jobs) > 1, among=among)

    def _announce(self, job: Job, cause: str, restart: bool = True,
                  changed: RankMap | None = None) -> None:
        # the whole map is in the decision before and the restart order after: this entry
        # says what changed (every rank at admission)
        rank_map = job.rank_map
        if changed is None:
            before = job.announced
            changed = {r: g for r, g in rank_map.items() if before.get(r) != g}
        job.announced = dict(rank_map)
        self.journal.record(RankMapAnnounced(job=job.name, world=len(rank_map), changed=changed),
                            cause, defer=restart)
        if restart:
            # durable: all before it
            self.journal.record(RestartOrder(job=job.name, rank_map=dict(rank_map)), cause)
        self.events.on_rank_map(dict(rank_map))
        if restart:
            self.events.on_restart(dict(rank_map), cause)
            self.events.on_order(job.name, dict(rank_map), cause)
