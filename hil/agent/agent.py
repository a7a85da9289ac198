"""The agent's orchestration: health and phase events in; circuits, rank maps and alarms out.

Inputs are plain method calls, so a bus adapter (or a test) connects them directly:
`admit(plan)`, `on_health(GpuHealth)`, `on_phase(phase, round)`, `on_job_failure(...)`,
`on_job_event(event)`, `start()` (reconcile after a (re)start), `reconcile()`.
Outputs are callbacks given at construction: `on_grant(phase, round)` (the job may
communicate), `on_restart(rank_map, cause)`, `on_rank_map(rank_map)`, `on_alarm(text, details)`.

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

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

from photonic_testbed.drivers.circuit_switch import CircuitSwitch, Circuits, SwitchError
from photonic_testbed.hil.agent import policies
from photonic_testbed.hil.agent.policies import RankMap, Targets
from photonic_testbed.hil.gpu_health import GpuHealth
from photonic_testbed.hil.jobplan import JobPlan, PlanError, round_robin_matchings
from photonic_testbed.hil.journal import Journal
from photonic_testbed.hil.rack_layout import RackLayout

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


def _pairs(c: Mapping[int, int]) -> list[tuple[int, int]]:
    return sorted((int(a), int(b)) for a, b in c.items())


def _nothing(*args: Any) -> None:
    return None


class Agent:
    def __init__(self, layout: RackLayout, switches: Mapping[str, CircuitSwitch],
                 journal: Journal, read_power: Callable[[str, int], float], *,
                 clock: Callable[[], float] = time.perf_counter,
                 verify_dbm: float = VERIFY_DBM,
                 loss_db: Callable[[str, int, int], float] | None = None,
                 matchings: Callable[[int], list[list[tuple[int, int]]]] = round_robin_matchings,
                 prestage: bool = False, verify_phases: bool = False, quarantine_s: float = 60.0,
                 on_grant: Callable[[str, int], None] | None = None,
                 on_restart: Callable[[RankMap, str], None] | None = None,
                 on_rank_map: Callable[[RankMap], None] | None = None,
                 on_alarm: Callable[[str, dict], None] | None = None):
        missing = set(layout.switches) - set(switches)
        if missing:
            raise AgentError(f"no CircuitSwitch given for switch(es) {sorted(missing)}")
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
        self.on_grant = on_grant or _nothing
        self.on_restart = on_restart or _nothing
        self.on_rank_map = on_rank_map or _nothing
        self.on_alarm = on_alarm or _nothing
        self.plan: JobPlan | None = None
        self.rank_map: RankMap = {}
        self.phase: tuple[str, int] | None = None
        self._job: policies.JobCircuits | None = None     # every phase's circuits, by rank
        self._current: dict[str, Circuits] = {}
        self._health: dict[str, str] = {}
        self._failed_at: dict[str, float] = {}
        self._rejected: set[str] = set()
        self._diagnosed_at: list[float] = []      # when GPUs were evicted on diagnosis alone
        self._announced: RankMap = {}             # the rank map last announced
        self._lock = threading.RLock()

    @property
    def _targets(self) -> dict[tuple[str, int], Targets]:
        return self._job.targets if self._job is not None else {}

    def holds_rank(self, gpu: str) -> bool:
        return self._job is not None and gpu in self._job.rank_of

    # --- the switches -----------------------------------------------------------------------
    def _apply(self, targets: Targets, cause: str, record: bool = True
               ) -> dict[str, dict[str, Any]]:
        """Journal then apply every switch whose circuits differ; {switch: what changed}.
        With record=False the caller journals the change and its outcome in its own entry
        (phase rails: one entry per phase switch, not a decision and an applied per switch)."""
        todo = {s: c for s, c in targets.items() if self._current.get(s) != c}
        if todo:                                # write-ahead: intended state first, one sync
            self.journal.set_intended_many({s: c.items() for s, c in todo.items()}, cause,
                                           event=record)
        took: dict[str, dict[str, Any]] = {}
        for s, c in todo.items():
            t0 = self.clock()
            try:
                rep = self.switches[s].apply(c)
            except SwitchError as e:
                self._current.pop(s, None)        # unknown now: read back at reconcile
                self._alarm(f"switch {s} refused the circuits: {e}", switch=s, cause=cause)
                raise AgentError(f"switch {s} refused the circuits for {cause}: {e}") from e
            took[s] = {"seconds": self.clock() - t0, "added": _pairs(rep.added),
                       "removed": _pairs(rep.removed)}
            self._current[s] = dict(c)
            if record:
                self.journal.record("applied", cause, took[s]["seconds"], switch=s,
                                    added=took[s]["added"], removed=took[s]["removed"],
                                    defer=True)
        return took

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
                                        added=_pairs(rep.added), removed=_pairs(rep.removed))
                self._current[name] = want
            self.journal.record("reconcile", cause, self.clock() - t0, moves=moves)
            return moves

    # --- recovery ---------------------------------------------------------------------------
    def start(self) -> SwapOutcome | None:
        """Reconcile the switches with the journal and take up where a previous agent left:
        its job, rank map and phase; a swap it decided but never announced is finished."""
        with self._lock:
            self.journal.record("start", "agent started")
            self.reconcile("agent start")
            admit = swap = None
            announced = 0
            for e in self.journal.entries(kinds=("decision", "rank_map", "phase")):
                action = e.details.get("action")
                if e.kind == "decision" and action == "admit":
                    admit, swap, self.phase = e, None, None
                elif e.kind == "decision" and action == "swap":
                    swap = e
                elif e.kind == "rank_map":
                    announced = e.seq
                elif e.kind == "phase" and "phase" in e.details:
                    self.phase = (e.details["phase"], int(e.details.get("round", 0)))
            if admit is None:
                return None
            self.plan = JobPlan.from_dict(admit.details["plan"])
            last = swap if swap is not None else admit
            self.rank_map = {int(r): g for r, g in last.details["rank_map"].items()}
            if swap is not None and swap.details.get("phase"):
                self.phase = tuple(swap.details["phase"])
            self._job = policies.JobCircuits(self.plan, self.layout, self.rank_map,
                                             self.matchings)
            # The phase whose circuits the switches were last told to hold (a phase entry is
            # written after its grant, so a kill just after a switch may have lost it).
            intended = {n: dict(c) for n, c in self.journal.intended().items()}

            def held(key) -> bool:
                targets = self._targets.get(key)
                return bool(targets) and all(intended.get(n) == dict(c)
                                             for n, c in targets.items())
            if not held(self.phase):
                self.phase = next((k for k in self._targets if held(k)), self.phase)
            if swap is None or swap.seq < announced:
                return None
            # A swap was decided but not announced: make it so, verify, announce.
            t0 = self.clock()
            spares = list(swap.details.get("swaps", {}).values())
            cause = "resume " + swap.cause
            targets = self._targets[self._key()]
            self._apply(targets, cause)
            bad = self._verify(self._points(targets, spares), cause, t0)
            if bad:
                self._alarm("swap resumed after restart does not verify", dark=bad)
            self._announce(self.rank_map, cause)
            return SwapOutcome(tuple(swap.details.get("failed", ())), swap.details.get("swaps", {}),
                               dict(self.rank_map), latency_s=self.clock() - t0)

    # --- job admission and phases ----------------------------------------------------------
    def _key(self) -> tuple[str, int]:
        targets = self._targets
        return self.phase if self.phase in targets else next(iter(targets))

    def admit(self, plan: JobPlan, rank_map: Mapping[int, str] | None = None) -> RankMap:
        """Take on a job: precompute every phase's circuits and set up its first phase."""
        with self._lock:
            if rank_map is None:
                workers = self.layout.workers
                if len(workers) < plan.world:
                    raise AgentError(f"job {plan.name!r} needs {plan.world} GPUs; rack "
                                     f"{self.layout.name!r} has {len(workers)} workers")
                rank_map = {r: workers[r] for r in range(plan.world)}
            rank_map = {int(r): str(g) for r, g in rank_map.items()}
            if len(rank_map) != plan.world:
                raise AgentError(f"rank map has {len(rank_map)} ranks, job wants {plan.world}")
            try:
                job = policies.JobCircuits(plan, self.layout, rank_map, self.matchings)
            except (policies.PolicyError, PlanError) as e:
                raise AgentError(f"job {plan.name!r} does not fit rack {self.layout.name!r}: "
                                 f"{e}") from None
            self.plan, self.rank_map, self._job = plan, rank_map, job
            targets = job.targets
            self.phase = next(iter(targets))
            self.journal.record("decision", f"admit job {plan.name}", action="admit",
                                plan=plan.to_dict(), rank_map=rank_map)
            self._apply(targets[self.phase], f"job {plan.name} admitted")
            self._announce(rank_map, f"job {plan.name} admitted", restart=False)
            return dict(rank_map)

    def on_phase(self, phase: str, round: int = 0) -> None:
        """The job reached (phase, round): switch the rails, then grant it."""
        with self._lock:
            if self.plan is None:
                raise AgentError("no job admitted: call admit(plan) first")
            key = (str(phase), int(round))
            if key not in self._targets:
                raise AgentError(f"job {self.plan.name!r} has no phase {phase!r} round {round}")
            t0 = self.clock()
            cause = f"phase {phase} round {round}"
            previous, self.phase = self.phase, key
            targets = self._job.refresh(key)        # up to date after a swap
            applied = self._apply(targets, cause, record=False)
            if self.verify_phases:
                if self._verify(self._points(targets, None), cause, t0):
                    self._alarm(f"{cause}: circuits do not verify", phase=phase, round=round)
                    return
            self.on_grant(*key)
            staged = []
            if self.prestage:
                keys = list(self._targets)
                nxt = self._job.refresh(keys[(keys.index(key) + 1) % len(keys)])
                for s, c in nxt.items():
                    fn = getattr(self.switches[s], "prestage", None)
                    if callable(fn) and c != targets[s]:
                        fn(c)
                        staged.append(s)
            if key == previous and not applied and not staged:
                return      # the same phase again, nothing moved: no new journal entry
            self.journal.record("phase", cause, self.clock() - t0, phase=phase, round=round,
                                applied=applied, prestaged=staged, defer=True)

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
            self._alarm(f"cannot serve job event {kind!r}: {e}", kind=kind)

    # --- failures ---------------------------------------------------------------------------
    def on_health(self, *healths: GpuHealth | Mapping[str, Any]) -> SwapOutcome | None:
        """GPU health reports, as GpuHealth or its to_dict() form off the bus (several at
        once are handled as one failover)."""
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
            return self._failover(failed, "GPU failure") if failed else None

    def on_job_failure(self, reason: str, gpus: Any = (), links: Any = ()) -> SwapOutcome | None:
        """The job failed. GPUs it names as lost are swapped out. Before anyone else is
        evicted, what the agent believes is checked against the switches (the difference is
        repaired), the links the job found down are measured again at their receivers, and a
        dark one is diagnosed end by end (`diagnose`). When nothing is left to blame, the
        current phase's circuits are verified and the job is restarted on the same GPUs."""
        with self._lock:
            t0 = self.clock()
            cause = f"job failure: {reason}" if reason else "job failure"
            self.journal.record("failure", reason or "job failure", gpus=list(gpus),
                                links=[list(x) for x in links], defer=True)
            if self.plan is None:
                self.journal.record("note", f"{cause}: no job admitted, nothing to do")
                return None
            lost = [g for g in dict.fromkeys(gpus) if self.holds_rank(g)]
            self.reconcile(cause)                  # belief against the switches first
            dark = self._dark_links(links)
            blamed = [g for g in self.diagnose(dark, cause) if g not in lost] if dark else []
            for g in lost + blamed:
                if self._health.get(g) != "failed":
                    self.journal.record("detected", f"GPU {g} lost by the job", reason=reason,
                                        defer=True)
                self._health[g] = "failed"
                self._failed_at[g] = self.clock()
            if lost or blamed:
                return self._failover(lost + blamed, "job failure")
            # Nobody to blame: the fabric as it should be, verified, and the job again.
            key = self._key()
            targets = self._targets[key]
            self._apply(targets, cause)
            bad = self._verify(self._points(targets, None), cause, t0)
            if bad:
                self._alarm(f"{cause}: circuits of phase {key[0]} round {key[1]} do not "
                            "verify and no GPU is to blame: a person is needed",
                            dark=[list(b[:3]) for b in bad])
                return None
            self._announce(self.rank_map, f"{cause}: fabric verified, restart on the same GPUs")
            return SwapOutcome((), {}, dict(self.rank_map), latency_s=self.clock() - t0)

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
        control = next((g for g in self.spares() if g not in ends), None)
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

    def spares(self) -> list[str]:
        """GPUs that may take a rank now, in rack order."""
        now = self.clock()
        free = self._job.free if self._job is not None else self.layout.gpus
        return [g for g in free
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

    def _cost(self, failed: str, spare: str) -> tuple[float, float] | None:
        """(ports or cells to change, path loss dB) of giving `failed`'s ranks to `spare` in
        the current phase, from the circuits that change alone; None if it cannot."""
        key = self._key()
        try:
            delta = self._job.delta({failed: spare}, keys=(key,))
        except policies.PolicyError:
            return None
        moves = loss = 0.0
        for _, s, removed, added in delta:
            cur = self._current.get(s, {})
            fn = getattr(self.switches[s], "change_cost", None)
            if callable(fn):
                target = dict(self._targets[key][s])
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

    def _feasible(self, failed: str, spare: str) -> bool:
        """Whether `spare` can carry every link of `failed`'s ranks, in every phase (its cost
        looked at the current phase alone)."""
        return self._job.feasible({failed: spare})

    def _server_swaps(self, left: list[str], taken: Mapping[str, str]) -> dict[str, str]:
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
            members = [h for h in self.layout.server_gpus[server] if self.holds_rank(h)]
            lanes = {h: frozenset(a.switch for a in self.layout.gpus[h]) for h in members}
            for other, gpus in list(free.items()):
                if other == server or len(gpus) < len(members):
                    continue
                by_lane = {frozenset(a.switch for a in self.layout.gpus[h]): h for h in gpus}
                if not all(lane in by_lane for lane in lanes.values()):
                    continue                # a GPU of that server is in use or unhealthy
                mapping = {h: by_lane[lanes[h]] for h in members}
                if not self._job.feasible(mapping):
                    continue
                out.update(mapping)
                del free[other]
                self.journal.record("note", f"{g} failed: server {server}'s ranks move to "
                                    f"server {other} (its GPUs share a scale-up fabric)",
                                    swaps=mapping, defer=True)
                break
        return out

    def _failover(self, failed: list[str], cause: str) -> SwapOutcome | None:
        if self.plan is None:
            self.journal.record("note", f"{cause}: no job admitted, nothing to swap",
                                gpus=failed)
            return None
        failed = [g for g in failed if self.holds_rank(g)]
        if not failed:
            return None
        t0 = self.clock()
        steps: dict[str, float] = {}
        rejected: list[str] = []
        cause = f"{cause}: {', '.join(failed)}"
        while True:
            swaps, left = policies.choose_spares(failed, self.spares(), self._cost,
                                                 self._feasible)
            if left and self.layout.servers:
                moved = self._server_swaps(left, swaps)
                swaps.update(moved)
                left = [g for g in left if g not in moved]
            degraded = False
            undo = None
            if left:
                world = len(self.rank_map) - len(left)
                if not self.plan.allows(world):
                    self._alarm(f"no healthy spare for {', '.join(left)} and job "
                                f"{self.plan.name!r} cannot run on {world} ranks: job stopped",
                                gpus=left)
                    return SwapOutcome(tuple(failed), swaps, dict(self.rank_map), stopped=True,
                                       rejected_spares=tuple(rejected),
                                       latency_s=self.clock() - t0)
                degraded = True
                self._alarm(f"no healthy spare for {', '.join(left)}: job continues "
                            f"degraded on {world} ranks", gpus=left, world=world)
                # every rank renumbered: the job's circuits worked out afresh
                new_map = policies.shrink_ranks(policies.swap_ranks(self.rank_map, swaps), left)
                job = policies.JobCircuits(self.plan, self.layout, new_map, self.matchings)
            else:
                # the failed GPUs' ranks' links change, nothing else
                job = self._job
                undo = job.swap(swaps, self._key())
                new_map = dict(job.rank_map)
            key = self.phase if self.phase in job.targets else next(iter(job.targets))
            self.journal.record("decision", cause, self.clock() - t0, action="swap",
                                failed=failed, swaps=swaps, rank_map=new_map, phase=list(key),
                                degraded=degraded, defer=True)
            steps["decided"] = self.clock() - t0
            self._apply(job.targets[key], cause)
            steps["applied"] = self.clock() - t0
            bad = self._verify(self._points(job.targets[key], list(swaps.values())), cause, t0)
            if not bad:
                steps["verified"] = self.clock() - t0
                break
            # Which end is dark: a spare that cannot hear itself is rejected, a GPU of the job
            # that cannot is lost too (within the eviction bounds); nobody is blamed for the
            # other end's fault.
            blamed = self.diagnose([b[:3] for b in bad], cause)
            spares_blamed = [g for g in blamed if g in swaps.values() and g not in rejected]
            lost = [g for g in blamed if g in self.rank_map.values() and g not in failed]
            if not spares_blamed and not lost:
                self._alarm(f"{cause}: circuits do not verify and no GPU is to blame",
                            dark=[list(b[:3]) for b in bad])
                break
            if undo is not None:
                job.undo(undo)              # decided again below, from the same job
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
        self.rank_map, self._job, self.phase = new_map, job, key
        self._announce(new_map, cause, changed=None if degraded else
                       {job.rank_of[s]: s for s in swaps.values()})
        steps["announced"] = self.clock() - t0
        return SwapOutcome(tuple(failed), swaps, dict(new_map), degraded, False,
                           tuple(rejected), self.clock() - t0, steps)

    def _announce(self, rank_map: RankMap, cause: str, restart: bool = True,
                  changed: RankMap | None = None) -> None:
        # the whole map is in the decision before and the restart order after: this entry
        # says what changed (every rank at admission)
        if changed is None:
            before = self._announced
            changed = {r: g for r, g in rank_map.items() if before.get(r) != g}
        self._announced = dict(rank_map)
        self.journal.record("rank_map", cause, world=len(rank_map), changed=changed,
                            defer=restart)
        if restart:
            self.journal.record("restart", cause, rank_map=rank_map)   # durable: all before it
        self.on_rank_map(dict(rank_map))
        if restart:
            self.on_restart(dict(rank_map), cause)
