"""An emulated training job: ranks on the rack's GPUs, a step loop of communication phases.

Each step runs the plan's phases in order (`common.jobplan`). For each (phase, round) the job
1. computes (phase.compute_s, split over the phase's rounds),
2. announces the phase (a "phase" event: it needs the round's links now, as a training loop
   calls `Fabric.phase` before its collective),
3. waits until it is granted the circuits (`grant(phase, round)`, when `gated`),
4. checks with the rack's optics that every link it needs is up; if not it stalls, and fails
   after `link_timeout_s` (a collective timing out),
5. communicates: phase.bytes over each link at the optics' rate; the slowest link sets the time,
6. releases the round's links (a "released" event: the fabric may set the next round up
   while the job computes, Opus's way of hiding the switch).
Step time = compute + communication + waiting, all recorded per step. Links inside a server
(its scale-up fabric) are up at the rack's SCALE_UP_GBPS.

A round of a 2,048-rank job costs its own links: the rack's optics of the switches it uses,
the failed GPUs looked up once, and a communication record that keeps the links that were not
up at full rate, not every link.

A rank whose GPU has failed fails the job: it reports a "failure" event and waits for a new
rank map (`restart(rank_map)`); it then reloads its last checkpoint (costing `restart_s`) and
redoes the steps since. Events go to subscribers (callbacks, called in the job's thread) and,
if given, a queue.Queue.

Time is a clock (`emulator.clock`): `SimClock` makes a run deterministic and instant for
tests; `WallClock` with `start()` runs the loop in a thread for demos.

History is bounded, so a job may run for days: the last `RECORDS_KEPT` steps, `COMMS_KEPT`
communications, `EVENTS_KEPT` events and `RESTARTS_KEPT` restart records are kept (rings);
running totals (`steps_done`, `down_communications`, `restarts`) count the whole run. Each
restart is the job's own record (`RestartRecord`): when it failed and why, when it restarted,
on which rank map, from which checkpoint, and when its first step after the restart completed.
"""
from __future__ import annotations

import collections
import functools
import logging
import queue
import threading
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from photonic_testbed.common.jobplan import JobPlan, PlanError, round_robin_matchings
from photonic_testbed.emulator.clock import WallClock
from photonic_testbed.emulator.rack import EmulatedRack

log = logging.getLogger(__name__)

RECORDS_KEPT = 2000          # steps (what throughput() and job_status read)
COMMS_KEPT = 1000            # communications, each with its links' state
EVENTS_KEPT = 2000           # job events
RESTARTS_KEPT = 100          # restart records
TIMED_RANKS = 256            # a job of up to this many ranks says each rank's step timings

EVENT_KINDS = ("phase", "released", "stall", "step", "checkpoint", "failure", "restarted",
               "restart_refused", "aborted", "done")


class JobError(Exception):
    """The job was given something it cannot run (a bad rank map, an unknown GPU)."""


@dataclass(frozen=True)
class JobEvent:
    kind: str
    t: float
    step: int
    phase: str = ""
    round: int = 0
    details: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Communication:
    """One phase round's traffic, with what the optics said when it started: how many links
    it used, and those that were down or slower than the fastest (a 2,048-rank round keeps
    its exceptions, not its 2,048 links)."""
    t: float
    step: int
    phase: str
    round: int
    links: int
    down: tuple[tuple[str, str], ...]                  # (src GPU, dst GPU) not up
    slow: tuple[tuple[str, str, float], ...]           # (src, dst, Gb/s) up below the best rate
    seconds: float

    @property
    def all_up(self) -> bool:
        return not self.down


@dataclass(frozen=True)
class StepRecord:
    step: int              # the step this completes (1-based)
    world: int
    t_start: float
    t_end: float
    compute_s: float
    comm_s: float
    wait_s: float


@dataclass
class RestartRecord:
    """One restart, as the job lived it (times on the job's clock)."""
    t: float                       # the restart was taken (checkpoint reloaded, new rank map)
    cause: str                     # what the agent said
    rank_map: dict[int, str]
    lost_steps: int                # steps redone (since the checkpoint)
    from_step: int                 # the checkpoint it resumed from
    failed_t: float | None = None  # the failure it answers (None: ordered without one)
    failure: str = ""
    resumed_t: float | None = None   # the first step after it completed ...
    resumed_step: int | None = None
    resumed_steps_done: int | None = None   # ... and steps_done then

    def to_dict(self, offset: float = 0.0) -> dict[str, Any]:
        """JSON-able, times shifted by `offset` (e.g. the clock's offset to Unix time)."""
        d = asdict(self)
        d["rank_map"] = {str(r): g for r, g in self.rank_map.items()}
        for k in ("t", "failed_t", "resumed_t"):
            if d[k] is not None:
                d[k] += offset
        return d


class _Restart(Exception):
    pass


class _Failure(Exception):
    def __init__(self, reason: str, gpus: list[str] | None = None,
                 links: list[tuple[str, str]] | None = None):
        super().__init__(reason)
        self.reason, self.gpus, self.links = reason, gpus or [], links or []


class _Stopped(Exception):
    pass


class TrainingJob:
    def __init__(self, plan: JobPlan, rank_map: dict[int, str], rack: EmulatedRack,
                 clock: Any = None, *, checkpoint_every: int = 10, restart_s: float = 0.5,
                 grant_timeout_s: float = 1.0, link_timeout_s: float = 1.0,
                 restart_timeout_s: float = 30.0, poll_s: float = 0.001, gated: bool = True,
                 matchings: Callable[[int], list[list[tuple[int, int]]]] = round_robin_matchings,
                 events: queue.Queue | None = None, records_kept: int = RECORDS_KEPT,
                 comms_kept: int = COMMS_KEPT, events_kept: int = EVENTS_KEPT,
                 restarts_kept: int = RESTARTS_KEPT):
        if checkpoint_every < 1:
            raise JobError("checkpoint_every must be >= 1 step")
        kept = {"records_kept": records_kept, "comms_kept": comms_kept,
                "events_kept": events_kept, "restarts_kept": restarts_kept}
        for name, n in kept.items():
            if not isinstance(n, int) or n < 1:
                raise JobError(f"{name} must be an int >= 1, not {n!r}")
        self.plan = plan
        self.rack = rack
        self.clock = clock or rack.clock or WallClock()
        self.checkpoint_every = checkpoint_every
        self.restart_s = restart_s
        self.grant_timeout_s = grant_timeout_s
        self.link_timeout_s = link_timeout_s
        self.restart_timeout_s = restart_timeout_s
        self.poll_s = poll_s
        self.gated = gated
        self.matchings = matchings
        self.queue = events
        self.rank_map = self._checked(rank_map)
        self._links = plan.links(len(self.rank_map), matchings)
        self.step = 0                 # completed steps
        self.checkpoint = 0           # step of the last checkpoint
        self.state = "idle"
        self.records: collections.deque[StepRecord] = collections.deque(maxlen=records_kept)
        self.communications: collections.deque[Communication] = collections.deque(
            maxlen=comms_kept)
        self.log: collections.deque[JobEvent] = collections.deque(maxlen=events_kept)
        self.restart_records: collections.deque[RestartRecord] = collections.deque(
            maxlen=restarts_kept)
        self.restarts = 0
        self.steps_done = 0           # steps completed in all (redone ones count again)
        self.down_communications = 0  # communications that ran over a down link, in all
        self.slow_communications = 0  # ... over a link slower than the round's fastest
        self._failure: tuple[float, str] | None = None    # the last failure, not yet answered
        self._listeners: list[Callable[[JobEvent], None]] = []
        self._lock = threading.Lock()
        self._granted: tuple[str, int] | None = None
        self._pending: tuple[dict[int, str], str, bool] | None = None
        # GPU -> how many times slower it computes (the emulator's slow_gpu); the step waits
        # for the slowest rank at each collective, and (up to TIMED_RANKS ranks) each rank's
        # compute and wait go with the step's event (`timings`: {gpu: [compute_s, wait_s]})
        self.slowdown: dict[str, float] = {}
        self.generation = 0           # of the rank map: one more at each restart
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # --- inputs (from the agent) ------------------------------------------------------------
    def _checked(self, rank_map: dict[int, str]) -> dict[int, str]:
        try:
            m = {int(r): str(g) for r, g in rank_map.items()}
        except (TypeError, ValueError, AttributeError):
            raise JobError(f"a rank map is {{rank: GPU}}, not {rank_map!r}") from None
        if sorted(m) != list(range(len(m))):
            raise JobError(f"ranks must be 0..{len(m) - 1}, got {sorted(m)}")
        if len(set(m.values())) != len(m):
            raise JobError(f"a GPU holds two ranks in {m}")
        unknown = [g for g in m.values() if g not in self.rack.layout.gpus]
        if unknown:
            raise JobError(f"GPU(s) {unknown} are not in rack {self.rack.layout.name!r}")
        if not self.plan.allows(len(m)):
            raise JobError(f"job {self.plan.name!r} cannot run on {len(m)} ranks")
        return m

    def grant(self, phase: str, round: int = 0) -> None:
        """The circuits of (phase, round) are up: the job may communicate."""
        with self._lock:
            self._granted = (phase, int(round))

    def restart(self, rank_map: dict[int, str], cause: str = "", planned: bool = False
                ) -> None:
        """Restart from the last checkpoint on this rank map (taken at the next safe point);
        `planned`: a planned swap at a step boundary, the spare already holding the state: on
        from the step reached, nothing reloaded."""
        with self._lock:
            self._pending = (dict(rank_map), cause, planned)

    def subscribe(self, listener: Callable[[JobEvent], None]) -> None:
        self._listeners.append(listener)

    def unsubscribe(self, listener: Callable[[JobEvent], None]) -> None:
        self._listeners.remove(listener)

    # --- running ----------------------------------------------------------------------------
    def _emit(self, kind: str, phase: str = "", round: int = 0, **details: Any) -> None:
        ev = JobEvent(kind, self.clock.now(), self.step, phase, round, details)
        self.log.append(ev)
        if self.queue is not None:
            self.queue.put(ev)
        for listener in list(self._listeners):
            listener(ev)

    def _wait(self, cond: Callable[[], bool], timeout_s: float) -> bool:
        deadline = self.clock.now() + timeout_s
        while not cond():
            if self._stop.is_set():
                raise _Stopped()
            if self._pending is not None:
                raise _Restart()
            if self.clock.now() >= deadline:
                return False
            self.clock.sleep(self.poll_s)
        return True

    def _is_granted(self, key: tuple[str, int]) -> bool:
        return self._granted == key

    def _failed_ranks(self) -> list[str]:
        failed = self.rack.failed_gpus()
        return [g for g in self.rank_map.values() if g in failed] if failed else []

    def _one_step(self) -> None:
        t_start = self.clock.now()
        compute = comm = wait = 0.0
        counts: dict[str, int] = {}
        for name, _ in self._links:
            counts[name] = counts.get(name, 0) + 1
        phases = {p.name: p for p in self.plan.phases}
        gpus = list(self.rank_map.values())
        timed = len(gpus) <= TIMED_RANKS
        slow = dict(self.slowdown)
        factor = {g: slow.get(g, 1.0) for g in gpus} if timed or slow else {}
        slowest = max(factor.values(), default=1.0)
        ranks = {g: [0.0, 0.0] for g in gpus} if timed else {}    # gpu -> [compute, wait]
        for (name, rnd), rank_links in self._links.items():
            if self._pending is not None:
                raise _Restart()
            if self._stop.is_set():
                raise _Stopped()
            dead = self._failed_ranks()
            if dead:
                raise _Failure(f"GPU(s) {', '.join(dead)} failed", gpus=dead)
            spec = phases[name]
            c = spec.compute_s / counts[name]
            self.clock.sleep(c * slowest)          # the collective waits for the slowest rank
            compute += c * slowest
            for g, cw in ranks.items():
                cw[0] += c * factor[g]
                cw[1] += c * (slowest - factor[g])
            with self._lock:
                self._granted = None
            t0 = self.clock.now()
            self._emit("phase", name, rnd)
            if self.gated and not self._wait(functools.partial(self._is_granted, (name, rnd)),
                                             self.grant_timeout_s):
                raise _Failure(f"circuits for {name} round {rnd} not granted in "
                               f"{self.grant_timeout_s} s")
            pairs = [(self.rank_map[a], self.rank_map[b]) for a, b in rank_links]
            state = self.rack.link_map(pairs)
            down = [p for p, t in state.items() if t is None or not t.up]
            if down:
                self._emit("stall", name, rnd, links=[list(p) for p in down])

                def all_up(pairs: list[tuple[str, str]] = pairs) -> bool:
                    nonlocal state
                    state = self.rack.link_map(pairs)
                    return all(t is not None and t.up for t in state.values())
                if not self._wait(all_up, self.link_timeout_s):
                    dead = self._failed_ranks()
                    down = [p for p, t in state.items() if t is None or not t.up]
                    raise _Failure(f"link(s) down: {', '.join(f'{a}->{b}' for a, b in down)}",
                                   gpus=dead, links=down)
            wait += self.clock.now() - t0
            # every link is up here (the wait above returns only then), so each has its truth
            links = {p: t for p, t in state.items() if t is not None}
            rates = {p: links[p].rate_gbps for p in pairs}
            slowest = min(rates.values(), default=0.0)
            seconds = spec.bytes * 8 / (slowest * 1e9) if pairs else 0.0
            best = max(rates.values(), default=0.0)
            comm_record = Communication(
                self.clock.now(), self.step + 1, name, rnd, len(pairs),
                tuple(p for p in pairs if not links[p].up),
                tuple((a, b, r) for (a, b), r in rates.items() if links[(a, b)].up and r < best),
                seconds)
            self.communications.append(comm_record)
            if not comm_record.all_up:
                self.down_communications += 1
            if comm_record.slow:
                self.slow_communications += 1
            self.clock.sleep(seconds)
            comm += seconds
            for cw in ranks.values():               # in the collective: waiting, for each rank
                cw[1] += self.clock.now() - t0
            # done with this round's links: the fabric may set the next round up while the
            # job computes (Opus)
            self._emit("released", name, rnd)
        self.step += 1
        self.steps_done += 1
        t_end = self.clock.now()
        self.records.append(StepRecord(self.step, len(self.rank_map), t_start, t_end,
                                       compute, comm, wait))
        last = self.restart_records[-1] if self.restart_records else None
        if last is not None and last.resumed_t is None:
            last.resumed_step, last.resumed_steps_done = self.step, self.steps_done
            last.resumed_t = t_end            # last: a reader that sees it sees the rest
        if timed:
            self._emit("step", seconds=self.clock.now() - t_start, generation=self.generation,
                       timings=ranks)
        else:
            self._emit("step", seconds=self.clock.now() - t_start)
        if self.step % self.checkpoint_every == 0:
            self.checkpoint = self.step
            self._emit("checkpoint")

    def _do_restart(self) -> None:
        with self._lock:
            pending, self._pending = self._pending, None
        # _Restart is raised only while one is pending, and only this thread takes it
        assert pending is not None
        rank_map, cause, planned = pending
        try:
            new = self._checked(rank_map)
            links = self.plan.links(len(new), self.matchings)
        except (JobError, PlanError) as e:
            log.error("job %s refuses restart: %s", self.plan.name, e)
            self._emit("restart_refused", reason=str(e))
            raise _Failure(f"restart refused: {e}") from None
        self.state = "restarting"
        lost = 0 if planned else self.step - self.checkpoint
        if not planned:
            self.clock.sleep(self.restart_s)      # reload the checkpoint
            self.step = self.checkpoint
        self.rank_map, self._links = new, links
        self.generation += 1
        self.restarts += 1
        failed_t, failure = self._failure or (None, "")
        self._failure = None
        self.restart_records.append(RestartRecord(self.clock.now(), cause, dict(new), lost,
                                                  self.step if planned else self.checkpoint,
                                                  failed_t, failure))
        self.state = "running"
        self._emit("restarted", rank_map=dict(new), cause=cause, lost_steps=lost)

    def _fail(self, f: _Failure) -> bool:
        """Report the failure, wait for a new rank map; False if none came (job aborted)."""
        self.state = "failed"
        if self._failure is None:         # a refused restart answers nothing: keep the first
            self._failure = (self.clock.now(), f.reason)
        log.warning("job %s failed at step %d: %s", self.plan.name, self.step, f.reason)
        self._emit("failure", reason=f.reason, gpus=f.gpus, links=[list(p) for p in f.links])
        try:
            got = self._wait(lambda: self._pending is not None, self.restart_timeout_s)
        except _Restart:
            got = True
        except _Stopped:                # stopped while it waited for a restart order
            self.state = "stopped"
            return False
        if not got:
            self.state = "aborted"
            self._emit("aborted", reason=f"no restart within {self.restart_timeout_s} s")
            return False
        return True

    def run(self, steps: int) -> str:
        """Run until `steps` steps are complete (or the job aborts or is stopped)."""
        self.state = "running"
        while self.step < steps:
            try:
                try:
                    self._one_step()
                except _Restart:
                    self._do_restart()
            except _Failure as f:
                if not self._fail(f):
                    return self.state
                # the new rank map is pending: the next _one_step takes it at once
            except _Stopped:
                self.state = "stopped"
                return self.state
        self.state = "done"
        self._emit("done")
        return self.state

    def start(self, steps: int) -> None:
        """Run in a thread (wall-clock demos); stop() ends it."""
        if self._thread is not None:
            raise JobError("the job is already running")
        self._stop.clear()
        self._thread = threading.Thread(target=self.run, args=(steps,), name="training-job",
                                        daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def join(self, timeout: float | None = None) -> None:
        if self._thread is not None:
            self._thread.join(timeout)

    def close(self) -> None:
        self.stop()
        self.join(timeout=5.0)
        self._thread = None

    def throughput(self, t0: float, t1: float) -> float:
        """Steps completed per second in [t0, t1) (redone steps count again)."""
        n = sum(1 for r in list(self.records) if t0 <= r.t_end < t1)
        return n / (t1 - t0) if t1 > t0 else 0.0
