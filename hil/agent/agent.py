"""The agent's orchestration: health and phase events in; circuits, rank maps and alarms out.

Inputs are plain method calls, so a bus adapter (or a test) connects them directly:
`admit(plan)`, `on_health(GpuHealth)`, `on_phase(phase, round)`, `on_job_failure(...)`,
`on_job_event(event)`, `release(job)`, `start()` (reconcile after a (re)start), `reconcile()`.
Outputs are callbacks given at construction: `on_grant(phase, round)` (the job may
communicate), `on_restart(rank_map, cause)` and `on_order(job, rank_map, cause)`,
`on_rank_map(rank_map)`, `on_alarm(text, details)`.

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
syncs its intended circuits before moving; its outcome entry follows after the grant.
"""
from __future__ import annotations

import bisect
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

from photonic_testbed.drivers.circuit_switch import ApplyReport, CircuitSwitch, Circuits, \
    SwitchError
from photonic_testbed.hil.agent import policies
from photonic_testbed.hil.agent.policies import RankMap, Targets
from photonic_testbed.hil.gpus.health import GpuHealth
from photonic_testbed.common.jobplan import JobPlan, PlanError, round_robin_matchings
from photonic_testbed.hil.agent.journal import Journal
from photonic_testbed.common.rack_layout import RackLayout

log = logging.getLogger(__name__)

VERIFY_DBM = -12.0      # a verified circuit delivers at least the receivers' sensitivity
DIAGNOSED_PER_INCIDENT = 2      # GPUs evicted on the fabric's evidence alone, per incident...
DIAGNOSED_PER_WINDOW = 4        # ...and within EVICTION_WINDOW_S; beyond: an alarm for a person
EVICTION_WINDOW_S = 600.0


class AgentError(Exception):
    """The agent was asked something it cannot do (no job admitted, unknown phase...)."""


@dataclass(frozen=True)
class SwapOutcome:
    """What a failover did: who replaced whom, the new rank map, and how long it took."""
    failed: tuple[str, ...]
    swaps: dict[str, str]
    rank_map: RankMap
    degraded: bool = False
    stopped: bool = False               # no spare and the job cannot shrink: no restart sent
    rejected_spares: tuple[str, ...] = ()
    latency_s: float = 0.0
    steps: dict[str, float] = field(default_factory=dict)   # decided/applied/verified times


def _nothing(*args: Any) -> None:
    return None


def _now(fn: Callable[[], None]) -> None:
    fn()


Key = tuple[str, int]


@dataclass(eq=False)
class Job:
    """One admitted job: its plan, every phase's circuits (indexed by rank), the phase whose
    circuits it holds now, and the rank map it was last told."""
    name: str
    plan: JobPlan
    circuits: policies.JobCircuits
    phase: Key
    rank_map: RankMap
    announced: RankMap = field(default_factory=dict)
    ready: Key | None = None        # the phase set up ahead, while the job computed

    def next_key(self, key: Key) -> Key:
        """The (phase, round) a step runs after `key` (the first again after the last)."""
        keys = list(self.circuits.targets)
        return keys[(keys.index(key) + 1) % len(keys)]

    def key(self) -> Key:
        targets = self.circuits.targets
        return self.phase if self.phase in targets else next(iter(targets))


class Agent:
    def __init__(self, layout: RackLayout, switches: Mapping[str, CircuitSwitch],
                 journal: Journal, read_power: Callable[[str, int], float], *,
                 clock: Callable[[], float] = time.perf_counter,
                 verify_dbm: float = VERIFY_DBM,
                 loss_db: Callable[[str, int, int], float] | None = None,
                 matchings: Callable[[int], list[list[tuple[int, int]]]] = round_robin_matchings,
                 prestage: bool = False, verify_phases: bool = False, quarantine_s: float = 60.0,
                 allocation: str = "best-fit",
                 on_grant: Callable[[str, int], None] | None = None,
                 on_restart: Callable[[RankMap, str], None] | None = None,
                 on_order: Callable[[str, RankMap, str], None] | None = None,
                 on_rank_map: Callable[[RankMap], None] | None = None,
                 on_alarm: Callable[[str, dict], None] | None = None):
        missing = set(layout.switches) - set(switches)
        if missing:
            raise AgentError(f"no CircuitSwitch given for switch(es) {sorted(missing)}")
        if allocation not in ALLOCATIONS:
            raise AgentError(f"allocation is one of {', '.join(ALLOCATIONS)}, not "
                             f"{allocation!r}")
        self.layout = layout
        self.switches = dict(switches)
        self.journal = journal
        self.read_power = read_power
        self.clock = clock
        self.verify_dbm = verify_dbm
        self.loss_db = loss_db
        self.matchings = matchings
        self.prestage = prestage
        self.verify_phases = verify_phases
        self.quarantine_s = quarantine_s
        self.allocation = allocation
        self.on_grant = on_grant or _nothing
        self.on_restart = on_restart or _nothing
        self.on_order = on_order or _nothing
        self.on_rank_map = on_rank_map or _nothing
        self.on_alarm = on_alarm or _nothing
        # how the work that follows a phase's grant is done: at once, by default; a caller
        # whose grant is a reply (the agent on the bus) runs it once the reply has gone
        self.after_grant: Callable[[Callable[[], None]], None] = _now
        self.jobs: dict[str, Job] = {}
        self._holder: dict[str, str] = {}              # GPU -> the job holding it
        self._order = {g: i for i, g in enumerate(layout.gpus)}
        self._free: list[str] = list(layout.gpus)      # GPUs no job holds, in rack order
        self._held: dict[str, dict[str, Circuits]] = {s: {} for s in layout.switches}
        self._current: dict[str, Circuits] = {}
        self._health: dict[str, str] = {}
        self._failed_at: dict[str, float] = {}
        self._rejected: set[str] = set()
        self._diagnosed_at: list[float] = []      # when GPUs were evicted on diagnosis alone
        self._pool: ThreadPoolExecutor | None = None     # writes to several switches at once
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

    @property
    def _job(self) -> policies.JobCircuits | None:
        j = self._first()
        return j.circuits if j else None

    @property
    def _targets(self) -> dict[Key, Targets]:
        j = self._first()
        return j.circuits.targets if j else {}

    def holds_rank(self, gpu: str) -> bool:
        return gpu in self._holder

    def holder(self, gpu: str) -> Job | None:
        name = self._holder.get(gpu)
        return self.jobs.get(name) if name is not None else None

    def _take(self, job: str, gpus: list[str]) -> None:
        for g in gpus:
            self._holder[g] = job
            self._free.remove(g)

    def _give_back(self, gpus: list[str]) -> None:
        for g in gpus:
            if self._holder.pop(g, None) is not None:
                bisect.insort(self._free, g, key=self._order.__getitem__)

    # --- the switches -----------------------------------------------------------------------
    def _apply(self, job: Job, targets: Targets, cause: str, record: bool = True
               ) -> dict[str, tuple[ApplyReport, float]]:
        """Make `job`'s part of every switch `targets`, leaving every other job's part alone:
        journal, then apply, every switch whose circuits (the union of the jobs' parts) differ;
        {switch: (its report, seconds)}. With record=False the caller journals the change and
        its outcome in its own entry (phase rails: one entry per phase switch), with
        `_reported`, once the job has its grant."""
        todo: dict[str, Circuits] = {}
        for s, c in targets.items():
            parts = self._held.setdefault(s, {})
            if parts.get(job.name) != c:
                parts[job.name] = dict(c)
            if len(parts) == 1:
                union = parts[job.name]
            else:
                union = {}
                for part in parts.values():
                    union.update(part)
            if self._current.get(s) != union:
                todo[s] = union
        if todo:                                # write-ahead: intended state first, one sync
            self.journal.set_intended_many({s: c.items() for s, c in todo.items()}, cause,
                                           event=record)
        took: dict[str, tuple[ApplyReport, float]] = {}
        failed: list[tuple[str, SwitchError]] = []
        for s, c, rep in self._write(todo):
            if isinstance(rep, SwitchError):
                self._current.pop(s, None)        # unknown now: read back at reconcile
                failed.append((s, rep))
                continue
            took[s] = rep
            self._current[s] = dict(c)
            if record:
                self.journal.record("applied", cause, rep[1], switch=s, job=job.name,
                                    defer=True, **self._reported({s: rep}, cause)[s])
        for s, e in failed:
            self._alarm(f"switch {s} refused the circuits: {e}", switch=s, during=cause)
        if failed:
            s, e = failed[0]
            raise AgentError(f"switch {s} refused the circuits for {cause}: {e}") from e
        return took

    def _reported(self, took: Mapping[str, tuple[ApplyReport, float]], cause: str
                  ) -> dict[str, dict[str, Any]]:
        """{switch: what its report says changed, for the journal}. A report that cannot be
        read (a service at odds with the contract) is journaled as such, with an alarm: the
        switch said it made the circuits, which the agent holds it to."""
        out: dict[str, dict[str, Any]] = {}
        for s, (rep, seconds) in took.items():
            try:
                out[s] = {"seconds": seconds, "added": rep.pairs("added"),
                          "removed": rep.pairs("removed")}
            except Exception as e:
                why = str(e) if str(e).startswith(type(e).__name__) else \
                    f"{type(e).__name__}: {e}"
                out[s] = {"seconds": seconds, "unreadable": why}
                self._alarm(f"switch {s} made the circuits for {cause} but its report of "
                            f"them cannot be read: {e}", switch=s, during=cause)
        return out

    def _write(self, todo: dict[str, Circuits]):
        """Apply each switch's circuits; different switches at once (an OCS moving its
        mirrors does not wait for another). Yields (switch, circuits, (report, seconds) or
        the SwitchError it raised), in `todo`'s order."""
        def one(s: str, c: Circuits):
            t0 = self.clock()
            try:
                return self.switches[s].apply(c), self.clock() - t0
            except SwitchError as e:
                return e
        if len(todo) < 2:
            for s, c in todo.items():
                yield s, c, one(s, c)
            return
        done: dict[str, Any] = {}
        kinds: dict[type[CircuitSwitch], list[str]] = {}
        for s in todo:
            kinds.setdefault(type(self.switches[s]), []).append(s)
        rest = []
        for kind, names in kinds.items():
            t0 = self.clock()
            got = kind.apply_together([(self.switches[s], todo[s]) for s in names]) \
                if len(names) > 1 else None
            if got is None:
                rest += names
                continue
            took = self.clock() - t0
            for s, rep in zip(names, got):
                if isinstance(rep, SwitchError):
                    done[s] = rep
                elif isinstance(rep, Exception):
                    raise rep
                else:
                    done[s] = (rep, took)
        if len(rest) > 1:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(max_workers=min(32, len(self.switches)),
                                                thread_name_prefix="switch-write")
            futures = {s: self._pool.submit(one, s, todo[s]) for s in rest}
            for s, f in futures.items():
                done[s] = f.result()
        else:
            done.update((s, one(s, todo[s])) for s in rest)
        for s, c in todo.items():
            yield s, c, done[s]

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None

    def _verify(self, points: list[tuple[str, int, int]], cause: str, since: float
                ) -> list[tuple[str, int, int, float]]:
        """Read light at each (switch, in, out) circuit's output; returns the dark ones."""
        bad, seen = [], {}
        for s, i, o in points:
            p = float(self.read_power(s, o))
            seen[f"{s}:{o}"] = round(p, 2)
            if not p >= self.verify_dbm:
                bad.append((s, i, o, p))
        kind = "verify_failed" if bad else "verified"
        self.journal.record(kind, cause, self.clock() - since, dbm=seen,
                            dark=[[s, i, o] for s, i, o, _ in bad], defer=True)
        return bad

    def _alarm(self, text: str, **details: Any) -> None:
        log.error("alarm: %s", text)
        self.journal.record("alarm", text, **details)
        self.on_alarm(text, details)

    def reconcile(self, cause: str = "reconcile") -> dict[str, int]:
        """Read every switch, repair only what differs from the journal's intended circuits.
        Returns {switch: circuits added + removed}."""
        with self._lock:
            t0 = self.clock()
            intended = self.journal.intended()
            moves: dict[str, int] = {}
            for name, sw in self.switches.items():
                try:
                    actual = sw.circuits()
                except SwitchError as e:
                    self._current.pop(name, None)
                    self._alarm(f"cannot read switch {name}: {e}", switch=name)
                    continue
                if name not in intended:
                    self._current[name] = dict(actual)
                    continue
                want = dict(intended[name])
                moves[name] = policies.changes(actual, want)
                if moves[name]:
                    t1 = self.clock()
                    rep = sw.apply(want)
                    self.journal.record("reconcile", cause, self.clock() - t1, switch=name,
                                        added=rep.pairs("added"), removed=rep.pairs("removed"))
                self._current[name] = want
            self.journal.record("reconcile", cause, self.clock() - t0, moves=moves)
            return moves

    # --- recovery ---------------------------------------------------------------------------
    def start(self) -> SwapOutcome | None:
        """Reconcile the switches with the journal and take up where a previous agent left:
        its jobs, their rank maps and phases; a swap it decided but never announced is
        finished. Returns the outcome of the (last) swap finished."""
        with self._lock:
            self.journal.record("start", "agent started")
            self.reconcile("agent start")
            self.jobs.clear()                  # what the journal says, from scratch
            self._holder.clear()
            self._free = list(self.layout.gpus)
            self._held = {s: {} for s in self.layout.switches}
            found: dict[str, dict[str, Any]] = {}     # job -> admit, swap, announced, phase
            last = None
            for e in self.journal.entries(kinds=("decision", "rank_map", "phase")):
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
            intended = {n: dict(c) for n, c in self.journal.intended().items()}
            outcome = None
            for name, f in found.items():
                plan = JobPlan.from_dict(f["admit"].details["plan"])
                swap = f["swap"]
                source = swap if swap is not None else f["admit"]
                rank_map = {int(r): g for r, g in source.details["rank_map"].items()}
                circuits = policies.JobCircuits(plan, self.layout, rank_map, self.matchings)
                phase = f["phase"]
                if swap is not None and swap.details.get("phase"):
                    phase = tuple(swap.details["phase"])
                job = Job(name, plan, circuits, phase or next(iter(circuits.targets)),
                          dict(rank_map))
                self.jobs[name] = job
                self._take(name, list(rank_map.values()))

                # The phase whose circuits the switches were last told to hold (a phase entry
                # is written after its grant, so a kill just after a switch may have lost it).
                def held(key, circuits=circuits) -> bool:
                    targets = circuits.targets.get(key)
                    return bool(targets) and all(
                        all(intended.get(n, {}).get(i) == o for i, o in c.items())
                        for n, c in targets.items())
                if not held(job.phase):
                    job.phase = next((k for k in circuits.targets if held(k)), job.phase)
                for s, c in circuits.targets[job.key()].items():
                    self._held.setdefault(s, {})[name] = dict(c)
                if swap is None or swap.seq < f["announced"]:
                    continue
                # A swap was decided but not announced: make it so, verify, announce.
                t0 = self.clock()
                spares = list(swap.details.get("swaps", {}).values())
                cause = "resume " + swap.cause
                targets = circuits.targets[job.key()]
                self._apply(job, targets, cause)
                bad = self._verify(self._points(targets, spares), cause, t0)
                if bad:
                    self._alarm("swap resumed after restart does not verify", dark=bad)
                self._announce(job, cause)
                outcome = SwapOutcome(tuple(swap.details.get("failed", ())),
                                      swap.details.get("swaps", {}), dict(job.rank_map),
                                      latency_s=self.clock() - t0)
            return outcome

    # --- job admission and phases ----------------------------------------------------------
    def admit(self, plan: JobPlan, rank_map: Mapping[int, str] | None = None,
              job: str | None = None) -> RankMap:
        """Take on a job (named `job`, its plan's name by default): GPUs for its ranks
        (given, or allocated), every phase's circuits, and its first phase set up. Admitting
        a job of a name already admitted takes it on afresh."""
        with self._lock:
            name = job or plan.name
            old = self.jobs.get(name)
            if old is not None:
                # Decided as if the old admission's GPUs were free; nothing of it changes
                # unless the new one is accepted.
                self._give_back(list(old.rank_map.values()))
            try:
                rank_map, circuits = self._admission(name, plan, rank_map)
            except BaseException:
                if old is not None:
                    self._take(name, list(old.rank_map.values()))
                raise
            if old is not None:
                self._release(old, f"job {name} admitted again", journal=False)
            new = Job(name, plan, circuits, next(iter(circuits.targets)), dict(rank_map))
            self.jobs[name] = new
            self._take(name, list(rank_map.values()))
            self.journal.record("decision", f"admit job {name}", action="admit", job=name,
                                plan=plan.to_dict(), rank_map=rank_map)
            self._apply(new, circuits.targets[new.phase], f"job {name} admitted")
            self._announce(new, f"job {name} admitted", restart=False)
            return dict(rank_map)

    def _admission(self, name: str, plan: JobPlan, rank_map: Mapping[int, str] | None
                   ) -> tuple[RankMap, policies.JobCircuits]:
        """The GPUs (given, checked; or allocated) and circuits of a job to admit; changes
        nothing."""
        if rank_map is None:
            rank_map = self._allocate(plan)
        rank_map = {int(r): str(g) for r, g in rank_map.items()}
        if sorted(rank_map) != list(range(plan.world)):
            raise AgentError(f"job {name!r} wants ranks 0..{plan.world - 1}; the rank map "
                             f"gives {len(rank_map)} ranks"
                             + ("" if len(rank_map) != plan.world else
                                f", numbered {sorted(rank_map)[:8]}..."))
        taken = [g for g in rank_map.values() if g in self._holder]
        unknown = [g for g in rank_map.values() if g not in self.layout.gpus]
        if len(set(rank_map.values())) != len(rank_map):
            raise AgentError(f"job {name!r}: a GPU is named for two ranks")
        if unknown or taken:
            raise AgentError(f"job {name!r} cannot have "
                             + (f"GPUs the rack does not have: {unknown}" if unknown else
                                f"GPUs another job holds: "
                                f"{[(g, self._holder[g]) for g in taken]}"))
        unusable = {g: why for g in rank_map.values() if (why := self._unusable(g))}
        if unusable:
            raise AgentError(f"job {name!r} cannot have GPUs that cannot take a rank now: "
                             + "; ".join(f"{g} {why}" for g, why in
                                         list(unusable.items())[:8])
                             + (f" (and {len(unusable) - 8} more)" if len(unusable) > 8
                                else ""))
        try:
            circuits = policies.JobCircuits(plan, self.layout, rank_map, self.matchings)
        except (policies.PolicyError, PlanError) as e:
            raise AgentError(f"job {plan.name!r} does not fit rack {self.layout.name!r}: "
                             f"{e}") from None
        return rank_map, circuits

    def _allocate(self, plan: JobPlan) -> RankMap:
        """GPUs for a job's ranks. Where the rack has servers (GPUs sharing a scale-up fabric)
        and the job fills whole servers, whole free servers of one pod (servers cabled to the
        same switches), the pod chosen by `allocation` (best fit: the fullest pod that still
        fits, leaving big holes for big jobs; first fit: the first in rack order); else the
        first free workers in rack order."""
        if self.layout.servers:
            got = self._allocate_servers(plan)
            if got is not None:
                return got
        spares = set(self.layout.spares)
        free = [g for g in self._free if g not in spares and self._health.get(g, "ok") == "ok"]
        if len(free) < plan.world:
            raise AgentError(f"job {plan.name!r} needs {plan.world} GPUs; rack "
                             f"{self.layout.name!r} has {len(free)} free workers")
        return {r: free[r] for r in range(plan.world)}

    def _allocate_servers(self, plan: JobPlan) -> RankMap | None:
        per = {len(g) for g in self.layout.server_gpus.values()}
        if len(per) != 1 or plan.world % next(iter(per)):
            return None
        need = plan.world // next(iter(per))
        spares = set(self.layout.spares)
        pods: dict[frozenset, list[str]] = {}
        for server, gpus in self.layout.server_gpus.items():
            if all(g not in self._holder and g not in spares and
                   self._health.get(g, "ok") == "ok" for g in gpus):
                switches = frozenset(a.switch for g in gpus for a in self.layout.gpus[g])
                pods.setdefault(switches, []).append(server)
        fits = [(len(servers), k, servers) for k, servers in enumerate(pods.values())
                if len(servers) >= need]
        if not fits:
            raise AgentError(f"job {plan.name!r} needs {need} whole free servers in one pod; "
                             f"the pods have {sorted(len(s) for s in pods.values())} "
                             f"({len(self._free)} GPUs free in all)")
        if self.allocation == "best-fit":
            fits.sort()
        chosen = fits[0][2][:need]
        return dict(enumerate(g for server in chosen for g in self.layout.server_gpus[server]))

    def release(self, job: str | None = None, cause: str = "") -> RankMap:
        """The job is done: its GPUs go back to the rack, its circuits are taken down."""
        with self._lock:
            j = self.job(job)
            return self._release(j, cause or f"job {j.name} released")

    def _release(self, job: Job, cause: str, journal: bool = True) -> RankMap:
        if journal:
            self.journal.record("decision", cause, action="release", job=job.name)
        empty: Targets = {s: {} for s in job.circuits.targets[job.key()]}
        self._apply(job, empty, cause)
        for parts in self._held.values():
            parts.pop(job.name, None)
        self._give_back(list(job.rank_map.values()))
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
            applied = self._apply(j, targets, cause, record=False)
            if self.verify_phases:
                if self._verify(self._points(targets, None), cause, t0):
                    self._alarm(f"{cause}: circuits do not verify", phase=phase, round=round)
                    return
            self.on_grant(*key)
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
            if self.prestage:
                keys = list(j.circuits.targets)
                nxt = j.circuits.refresh(keys[(keys.index(key) + 1) % len(keys)])
                for s, c in nxt.items():
                    fn = getattr(self.switches[s], "prestage", None)
                    if callable(fn) and c != targets[s]:
                        fn(c)
                        staged.append(s)
            if key == previous and not applied and not staged:
                return      # the same phase again, nothing moved: no new journal entry
            self.journal.record("phase", cause, latency, phase=key[0], round=key[1],
                                job=j.name, applied=self._reported(applied, cause),
                                prestaged=staged, defer=True)

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
            applied = self._apply(j, targets, cause, record=False)
            if self.verify_phases and self._verify(self._points(targets, None), cause, t0):
                self._alarm(f"{cause}: circuits do not verify", phase=nxt[0], round=nxt[1])
                return None
            j.ready = nxt
            self.journal.record("phase", cause, self.clock() - t0, phase=nxt[0], round=nxt[1],
                                job=j.name, applied=self._reported(applied, cause), ahead=True,
                                defer=True)
            return nxt

    def on_job_event(self, event: Any) -> None:
        """A job event (an object or dict with kind, phase, round, details) from the job."""
        get = (event.get if isinstance(event, Mapping)
               else lambda k, d=None: getattr(event, k, d))
        kind = get("kind")
        try:
            if kind == "phase":
                self.on_phase(get("phase"), get("round", 0))
            elif kind == "failure":
                d = get("details", {}) or {}
                self.on_job_failure(d.get("reason", ""), d.get("gpus", ()), d.get("links", ()))
        except AgentError as e:
            # the job's thread delivered this: tell the operator, leave the job to time out
            self._alarm(f"cannot serve job event {kind!r}: {e}", event=kind)

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
                old = self._health.get(h.gpu, "ok")
                self._health[h.gpu] = h.state
                if h.state == "failed":
                    self._failed_at[h.gpu] = self.clock()
                    if old != "failed":
                        self.journal.record("detected", f"GPU {h.gpu} failed",
                                            reasons=list(h.reasons), defer=True)
                        failed.append(h.gpu)
                elif h.state == "degraded" and old != "degraded":
                    self.journal.record("note", f"GPU {h.gpu} degraded", reasons=list(h.reasons))
            out = None
            for j, gpus in self._by_job(failed).items():
                out = self._failover(j, gpus, "GPU failure")
            if failed and not self._by_job(failed):
                self.journal.record("note", "GPU failure: no job holds "
                                    f"{', '.join(failed)}, nothing to swap", gpus=failed)
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
            self.journal.record("failure", reason or "job failure", gpus=list(gpus),
                                links=[list(x) for x in links], job=job, defer=True)
            if not self.jobs:
                self.journal.record("note", f"{cause}: no job admitted, nothing to do")
                return None
            j = self.job(job)
            named = list(dict.fromkeys(gpus))
            lost = [g for g in named if self._holder.get(g) == j.name]
            # A job speaks for its own links only: probing another job's would move its circuits
            links = [tuple(x) for x in links]
            own = [(s, d) for s, d in links
                   if self._holder.get(s) == j.name and self._holder.get(d) == j.name]
            if len(own) < len(links):
                self.journal.record("note", f"{cause}: links of GPUs job {j.name} does not "
                                    "hold are not its to report: ignored", job=j.name,
                                    links=[list(x) for x in links if x not in own], defer=True)
            links = own
            if named and not lost and not links:
                # every GPU it names has been replaced already (the report crossed the order
                # that replaced them): the job has its order; nothing more to do
                self.journal.record("note", f"{cause}: {', '.join(named)} already replaced, "
                                    "the job's restart order stands", job=j.name)
                return None
            self.reconcile(cause)                  # belief against the switches first
            dark = self._dark_links(links)
            blamed = [g for g in self.diagnose(dark, cause) if g not in lost] if dark else []
            blamed = [g for g in blamed if self._holder.get(g) == j.name]
            for g in lost + blamed:
                if self._health.get(g) != "failed":
                    self.journal.record("detected", f"GPU {g} lost by the job", reason=reason,
                                        defer=True)
                self._health[g] = "failed"
                self._failed_at[g] = self.clock()
            if lost or blamed:
                return self._failover(j, lost + blamed, "job failure")
            # Nobody to blame: the fabric as it should be, verified, and the job again.
            key = j.key()
            targets = j.circuits.refresh(key)
            self._apply(j, targets, cause)
            bad = self._verify(self._points(targets, None), cause, t0)
            if bad:
                self._alarm(f"{cause}: circuits of phase {key[0]} round {key[1]} do not "
                            "verify and no GPU is to blame: a person is needed",
                            dark=[list(b[:3]) for b in bad])
                return None
            self._announce(j, f"{cause}: fabric verified, restart on the same GPUs")
            return SwapOutcome((), {}, dict(j.rank_map), latency_s=self.clock() - t0)

    def _dark_links(self, links: Any) -> list[tuple[str, int, int]]:
        """The circuits of the (src GPU, dst GPU) links that are set now and whose receiver
        reads dark."""
        dark = []
        for src, dst in links:
            for att in self.layout.gpus.get(dst, ()):
                src_att = self.layout.gpus.get(src) and self.layout.attachment(src, att.switch)
                if not src_att or self._current.get(att.switch, {}).get(src_att.tx) != att.rx:
                    continue
                if not float(self.read_power(att.switch, att.rx)) >= self.verify_dbm:
                    dark.append((att.switch, src_att.tx, att.rx))
        return dark

    def loopback(self, gpus: list[str], cause: str) -> dict[str, bool]:
        """Each GPU's own light sent back to it (its TX to its RX through each switch it is
        cabled to): {gpu: its receivers hear it}. Only those GPUs' ports move; the journal's
        intended circuits stay as they were (a probe is not a decision: an agent restarted
        mid-probe puts the switches back)."""
        loops: dict[str, dict[int, int]] = {}
        for g in gpus:
            for att in self.layout.gpus.get(g, ()):
                loops.setdefault(att.switch, {})[att.tx] = att.rx
        heard = {g: True for g in gpus}
        for s, pairs in loops.items():
            ports = set(pairs) | set(pairs.values())
            probe = {i: o for i, o in self._current.get(s, {}).items()
                     if i not in ports and o not in ports}
            probe.update(pairs)
            try:
                self.switches[s].apply(probe)
            except SwitchError as e:
                self._current.pop(s, None)
                raise AgentError(f"loopback test on {s} refused: {e}") from e
            self._current[s] = probe
            for i, o in pairs.items():
                g = self.layout.owner(s, i)
                heard[g] = heard[g] and float(self.read_power(s, o)) >= self.verify_dbm
        self.journal.record("diagnosis", cause, loopback=heard, defer=True)
        return heard

    def diagnose(self, dark: list[tuple[str, int, int]], cause: str) -> list[str]:
        """Which end of each dark circuit is at fault, found by a loopback test of both ends
        (and of an idle GPU, as a control): the end that cannot hear itself. Both ends hearing
        themselves blames the switch's path; every GPU deaf, the control included, blames
        the switch or the light: nobody is evicted then, and a person is called."""
        ends = list(dict.fromkeys(g for s, i, o in dark for g in (self.layout.owner(s, i),
                                                                   self.layout.owner(s, o))
                                  if g is not None))
        switches = {s for s, _, _ in dark}
        control = next((g for g in self.spares() if g not in ends and
                        any(a.switch in switches for a in self.layout.gpus[g])), None)
        heard = self.loopback(ends + ([control] if control else []), cause)
        if not any(heard.values()) and (control is not None or len(ends) > 1):
            self._alarm(f"{cause}: no GPU hears its own light through the switch "
                        f"({', '.join(heard)}): the switch or the light is at fault, nobody "
                        "is evicted", tested=heard)
            return []
        blamed = [g for g in ends if not heard[g]]
        for s, i, o in dark:
            src, dst = self.layout.owner(s, i), self.layout.owner(s, o)
            if heard.get(src) and heard.get(dst):
                self._alarm(f"{cause}: {src} -> {dst} is dark on {s} ({i} -> {o}) although "
                            "both hear themselves: the switch's path is at fault",
                            switch=s, circuit=[i, o])
        return self._bound_evictions(blamed, cause)

    def _bound_evictions(self, blamed: list[str], cause: str) -> list[str]:
        """At most DIAGNOSED_PER_INCIDENT GPUs per incident and DIAGNOSED_PER_WINDOW in
        EVICTION_WINDOW_S on the fabric's evidence alone; beyond that, none, and an alarm:
        a cascade through the rack is not possible."""
        now = self.clock()
        self._diagnosed_at = [t for t in self._diagnosed_at if now - t < EVICTION_WINDOW_S]
        if len(blamed) > DIAGNOSED_PER_INCIDENT or \
                len(self._diagnosed_at) + len(blamed) > DIAGNOSED_PER_WINDOW:
            self._alarm(f"{cause}: diagnosis blames {', '.join(blamed)}; evicting them would "
                        f"exceed {DIAGNOSED_PER_INCIDENT} per incident or "
                        f"{DIAGNOSED_PER_WINDOW} per {EVICTION_WINDOW_S:.0f} s: nobody is "
                        "evicted, a person is needed", gpus=blamed,
                        recent=len(self._diagnosed_at))
            return []
        self._diagnosed_at += [now] * len(blamed)
        return blamed

    def _unusable(self, gpu: str) -> str | None:
        """Why `gpu` cannot take a rank now (failed, failed its circuits' verification, or
        in quarantine after a failure), or None."""
        if self._health.get(gpu) == "failed":
            return "has failed"
        if gpu in self._rejected:
            return "failed its circuits' verification (return it to the pool once repaired)"
        since = self.clock() - self._failed_at.get(gpu, -float("inf"))
        if since < self.quarantine_s:
            return (f"failed {since:.1f} s ago (in quarantine for {self.quarantine_s:g} s "
                    f"after a failure)")
        return None

    def spares(self) -> list[str]:
        """GPUs that may take a rank now (held by no job), in rack order."""
        now = self.clock()
        return [g for g in self._free
                if g not in self._rejected and self._health.get(g, "ok") == "ok"
                and now - self._failed_at.get(g, -float("inf")) >= self.quarantine_s]

    def return_to_pool(self, gpu: str) -> None:
        """An operator repaired a GPU that failed verification: it may be a spare again."""
        with self._lock:
            self._rejected.discard(gpu)
            self._failed_at.pop(gpu, None)

    def _points(self, targets: Targets, gpus: list[str] | None) -> list[tuple[str, int, int]]:
        """Circuits to verify: those touching `gpus` (all circuits when None), found from the
        GPUs' own ports rather than by reading every circuit of the rack."""
        if gpus is None:
            return [(s, i, o) for s, c in targets.items() for i, o in sorted(c.items())]
        out = set()
        for g in gpus:
            for att in self.layout.gpus.get(g, ()):
                c = targets.get(att.switch)
                if not c:
                    continue
                if att.tx in c:
                    out.add((att.switch, att.tx, c[att.tx]))
                out.update((att.switch, i, o) for i, o in c.items() if o == att.rx)
        order = {s: k for k, s in enumerate(targets)}
        return sorted(out, key=lambda p: (order[p[0]], p[1]))

    def _cost(self, job: Job, failed: str, spare: str) -> tuple[float, float] | None:
        """(ports or cells to change, path loss dB) of giving `failed`'s ranks to `spare` in
        the current phase, from the circuits that change alone; None if it cannot."""
        key = job.key()
        try:
            delta = job.circuits.delta({failed: spare}, keys=(key,))
        except policies.PolicyError:
            return None
        moves = loss = 0.0
        for _, s, removed, added in delta:
            cur = self._current.get(s, {})
            fn = getattr(self.switches[s], "change_cost", None)
            if callable(fn):
                target = dict(cur)
                for i, _ in removed:
                    target.pop(i, None)
                target.update(added)
                moves += fn(cur, target)
            else:
                moves += sum(1 for i, o in removed if cur.get(i) == o) + \
                    sum(1 for i, o in added if cur.get(i) != o)
            if self.loss_db is not None:
                loss += sum(self.loss_db(s, i, o) for i, o in added)
        return moves, loss

    def _server_swaps(self, job: Job, left: list[str], taken: Mapping[str, str]
                      ) -> dict[str, str]:
        """For failed GPUs no single spare can replace (their ranks talk to their server's
        other GPUs over its scale-up fabric, which a GPU elsewhere cannot reach): the whole
        server's ranks moved to a spare server, GPU for GPU in rack order. The server is the
        failed element then."""
        free: dict[str, list[str]] = {}
        for g in self.spares():
            server = self.layout.servers.get(g)
            if server is not None and g not in taken.values():
                free.setdefault(server, []).append(g)
        out: dict[str, str] = {}
        for g in left:
            server = self.layout.servers.get(g)
            if server is None or g in out:
                continue
            members = [h for h in self.layout.server_gpus[server]
                       if self._holder.get(h) == job.name]
            lanes = {h: frozenset(a.switch for a in self.layout.gpus[h]) for h in members}
            for other, gpus in list(free.items()):
                if other == server or len(gpus) < len(members):
                    continue
                by_lane = {frozenset(a.switch for a in self.layout.gpus[h]): h for h in gpus}
                if not all(lane in by_lane for lane in lanes.values()):
                    continue                # a GPU of that server is in use or unhealthy
                mapping = {h: by_lane[lanes[h]] for h in members}
                if not job.circuits.feasible(mapping):
                    continue
                out.update(mapping)
                del free[other]
                self.journal.record("note", f"{g} failed: server {server}'s ranks move to "
                                    f"server {other} (its GPUs share a scale-up fabric)",
                                    swaps=mapping, job=job.name, defer=True)
                break
        return out

    def _failover(self, job: Job, failed: list[str], cause: str) -> SwapOutcome | None:
        failed = [g for g in failed if self._holder.get(g) == job.name]
        if not failed:
            return None
        t0 = self.clock()
        steps: dict[str, float] = {}
        rejected: list[str] = []
        cause = f"{cause}: {', '.join(failed)}"
        if len(self.jobs) > 1:
            cause = f"{job.name}: {cause}"
        while True:
            swaps, left = policies.choose_spares(
                failed, self.spares(), lambda f, s: self._cost(job, f, s),
                lambda f, s: job.circuits.feasible({f: s}))
            if left and self.layout.servers:
                moved = self._server_swaps(job, left, swaps)
                swaps.update(moved)
                left = [g for g in left if g not in moved]
            degraded = False
            undo = None
            if left:
                world = len(job.rank_map) - len(left)
                if not job.plan.allows(world):
                    self._alarm(f"no healthy spare for {', '.join(left)} and job "
                                f"{job.name!r} cannot run on {world} ranks: job stopped",
                                gpus=left, job=job.name)
                    return SwapOutcome(tuple(failed), swaps, dict(job.rank_map), stopped=True,
                                       rejected_spares=tuple(rejected),
                                       latency_s=self.clock() - t0)
                degraded = True
                self._alarm(f"no healthy spare for {', '.join(left)}: job continues "
                            f"degraded on {world} ranks", gpus=left, world=world,
                            job=job.name)
                # every rank renumbered: the job's circuits worked out afresh
                new_map = policies.shrink_ranks(policies.swap_ranks(job.rank_map, swaps), left)
                circuits = policies.JobCircuits(job.plan, self.layout, new_map, self.matchings)
            else:
                # the failed GPUs' ranks' links change, nothing else
                circuits = job.circuits
                undo = circuits.swap(swaps, job.key())
                new_map = dict(circuits.rank_map)
            key = job.phase if job.phase in circuits.targets else next(iter(circuits.targets))
            self.journal.record("decision", cause, self.clock() - t0, action="swap",
                                job=job.name, failed=failed, swaps=swaps, rank_map=new_map,
                                phase=list(key), degraded=degraded, defer=True)
            steps["decided"] = self.clock() - t0
            self._apply(job, circuits.targets[key], cause)
            steps["applied"] = self.clock() - t0
            bad = self._verify(self._points(circuits.targets[key], list(swaps.values())),
                               cause, t0)
            if not bad:
                steps["verified"] = self.clock() - t0
                break
            # Which end is dark: a spare that cannot hear itself is rejected, a GPU of the job
            # that cannot is lost too (within the eviction bounds); nobody is blamed for the
            # other end's fault.
            blamed = self.diagnose([b[:3] for b in bad], cause)
            spares_blamed = [g for g in blamed if g in swaps.values() and g not in rejected]
            lost = [g for g in blamed if self._holder.get(g) == job.name and g not in failed]
            if not spares_blamed and not lost:
                self._alarm(f"{cause}: circuits do not verify and no GPU is to blame",
                            dark=[list(b[:3]) for b in bad])
                break
            if undo is not None:
                circuits.undo(undo)         # decided again below, from the same job
            for g in spares_blamed:
                rejected.append(g)
                self._rejected.add(g)
            for g in lost:
                self.journal.record("detected", f"GPU {g} cannot hear itself", defer=True)
                self._health[g] = "failed"
                self._failed_at[g] = self.clock()
                failed.append(g)
            log.warning("%s: rejected spare(s) %s, lost %s; deciding again", cause,
                        spares_blamed, lost)
        if degraded:                             # renumbered: work the difference out
            kept = set(new_map.values())
            self._give_back([g for g in job.rank_map.values() if g not in kept])
            self._take(job.name, [g for g in new_map.values() if g not in self._holder])
        else:                                    # what the swap changed, not the rank map
            self._give_back(list(swaps))
            self._take(job.name, list(swaps.values()))
        job.rank_map, job.circuits, job.phase, job.ready = new_map, circuits, key, None
        self._announce(job, cause, changed=None if degraded else
                       {circuits.rank_of[s]: s for s in swaps.values()})
        steps["announced"] = self.clock() - t0
        return SwapOutcome(tuple(failed), swaps, dict(new_map), degraded, False,
                           tuple(rejected), self.clock() - t0, steps)

    def _announce(self, job: Job, cause: str, restart: bool = True,
                  changed: RankMap | None = None) -> None:
        # the whole map is in the decision before and the restart order after: this entry
        # says what changed (every rank at admission)
        rank_map = job.rank_map
        if changed is None:
            before = job.announced
            changed = {r: g for r, g in rank_map.items() if before.get(r) != g}
        job.announced = dict(rank_map)
        self.journal.record("rank_map", cause, job=job.name, world=len(rank_map),
                            changed=changed, defer=restart)
        if restart:
            # durable: all before it
            self.journal.record("restart", cause, job=job.name, rank_map=rank_map)
        self.on_rank_map(dict(rank_map))
        if restart:
            self.on_restart(dict(rank_map), cause)
            self.on_order(job.name, dict(rank_map), cause)


ALLOCATIONS = ("best-fit", "first-fit")
