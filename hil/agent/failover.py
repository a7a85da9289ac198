"""Failover: failed GPUs of a job replaced by spares, the job's circuits changed and verified.

The spares are chosen by what the swap costs (the ports or cells that change, then the path's
loss) among those the job's phases can use; a GPU that no single spare can replace (its ranks
talk to its server's other GPUs over the server's scale-up fabric) moves with its whole server
to a spare server. The decision is journaled, then applied, then verified by light at the
spares' circuits. A spare whose circuits stay dark and cannot hear itself is rejected, a GPU of
the job that cannot is lost too, and the swap is decided again. Without a spare the job runs
on fewer ranks if its plan allows, else it is stopped and a person is called. The job hears
its new rank map last (`announce`), once the journal holds everything before it.
"""
from __future__ import annotations

import logging
from collections.abc import Callable, Collection, Mapping

from photonic_testbed.common.jobplan import round_robin_matchings
from photonic_testbed.common.rack_layout import RackLayout
from photonic_testbed.hil.agent import policies
from photonic_testbed.hil.agent.diagnosis import Diagnosis
from photonic_testbed.hil.agent.entries import Alarm, Detected, Note, Swap
from photonic_testbed.hil.agent.jobs import Job, SwapOutcome
from photonic_testbed.hil.agent.journal import Journal
from photonic_testbed.hil.agent.policies import RankMap
from photonic_testbed.hil.agent.pool import GpuPool
from photonic_testbed.hil.agent.writer import SwitchWriter

log = logging.getLogger(__name__)

Matchings = Callable[[int], list[list[tuple[int, int]]]]
LossDb = Callable[[str, int, int], float]
# (job, cause, restart, changed ranks or None: every rank that differs from the last told)
Announce = Callable[[Job, str, bool, "RankMap | None"], None]


class Failover:
    """The cost of a swap, server swaps, and the failover loop (decide, apply, verify,
    diagnose, decide again), and a swap resumed after a restart."""

    def __init__(self, layout: RackLayout, pool: GpuPool, writer: SwitchWriter,
                 diagnosis: Diagnosis, journal: Journal, clock: Callable[[], float],
                 alarm: Callable[[str, Alarm], None], announce: Announce, *,
                 matchings: Matchings = round_robin_matchings, loss_db: LossDb | None = None):
        self.layout = layout
        self.pool = pool
        self.writer = writer
        self.diagnosis = diagnosis
        self.journal = journal
        self.clock = clock
        self.alarm = alarm
        self.announce = announce
        self.matchings = matchings
        self.loss_db = loss_db

    def cost(self, job: Job, failed: str, spare: str) -> tuple[float, float] | None:
        """(ports or cells to change, path loss dB) of giving `failed`'s ranks to `spare` in
        the current phase, from the circuits that change alone; None if it cannot."""
        key = job.key()
        try:
            delta = job.circuits.delta({failed: spare}, keys=(key,))
        except policies.PolicyError:
            return None
        moves = loss = 0.0
        for _, s, removed, added in delta:
            cur = self.writer.current(s)
            fn = getattr(self.writer.switches[s], "change_cost", None)
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

    def server_swaps(self, job: Job, left: list[str], taken: Mapping[str, str]
                     ) -> dict[str, str]:
        """For failed GPUs no single spare can replace (their ranks talk to their server's
        other GPUs over its scale-up fabric, which a GPU elsewhere cannot reach): the whole
        server's ranks moved to a spare server, GPU for GPU in rack order. The server is the
        failed element then."""
        free: dict[str, list[str]] = {}
        for g in self.pool.spares():
            server = self.layout.servers.get(g)
            if server is not None and g not in taken.values():
                free.setdefault(server, []).append(g)
        out: dict[str, str] = {}
        for g in left:
            server = self.layout.servers.get(g)
            if server is None or g in out:
                continue
            members = [h for h in self.layout.server_gpus[server]
                       if self.pool.holder(h) == job.name]
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
                self.journal.record(Note(swaps=dict(mapping), job=job.name),
                                    f"{g} failed: server {server}'s ranks move to server "
                                    f"{other} (its GPUs share a scale-up fabric)", defer=True)
                break
        return out

    def run(self, job: Job, failed: list[str], cause: str, *, name_job: bool = False,
            among: Collection[str] = ()) -> SwapOutcome | None:
        """Replace `job`'s `failed` GPUs (those it holds); None when it holds none of them.
        `name_job`: the cause names the job (several jobs share the rack). `among`: the spares
        to choose from while any of them is free (where the job keeps a warm standby)."""
        failed = [g for g in failed if self.pool.holder(g) == job.name]
        if not failed:
            return None
        t0 = self.clock()
        steps: dict[str, float] = {}
        rejected: list[str] = []
        cause = f"{cause}: {', '.join(failed)}"
        if name_job:
            cause = f"{job.name}: {cause}"
        while True:
            free = self.pool.spares()
            swaps, left = policies.choose_spares(
                failed, [g for g in free if g in among] or free,
                lambda f, s: self.cost(job, f, s),
                lambda f, s: job.circuits.feasible({f: s}))
            if left and self.layout.servers:
                moved = self.server_swaps(job, left, swaps)
                swaps.update(moved)
                left = [g for g in left if g not in moved]
            degraded = False
            undo = None
            if left:
                world = len(job.rank_map) - len(left)
                if not job.plan.allows(world):
                    self.alarm(f"no healthy spare for {', '.join(left)} and job "
                               f"{job.name!r} cannot run on {world} ranks: job stopped",
                               Alarm(gpus=list(left), job=job.name))
                    return SwapOutcome(tuple(failed), swaps, dict(job.rank_map), stopped=True,
                                       rejected_spares=tuple(rejected),
                                       latency_s=self.clock() - t0)
                degraded = True
                self.alarm(f"no healthy spare for {', '.join(left)}: job continues "
                           f"degraded on {world} ranks",
                           Alarm(gpus=list(left), world=world, job=job.name))
                # every rank renumbered: the job's circuits worked out afresh
                new_map = policies.shrink_ranks(policies.swap_ranks(job.rank_map, swaps), left)
                circuits = policies.JobCircuits(job.plan, self.layout, new_map, self.matchings)
            else:
                # the failed GPUs' ranks' links change, nothing else
                circuits = job.circuits
                undo = circuits.swap(swaps, job.key())
                new_map = dict(circuits.rank_map)
            key = job.phase if job.phase in circuits.targets else next(iter(circuits.targets))
            self.journal.record(Swap(job=job.name, failed=list(failed), swaps=dict(swaps),
                                     rank_map=dict(new_map), phase=key, degraded=degraded),
                                cause, self.clock() - t0, defer=True)
            steps["decided"] = self.clock() - t0
            self.writer.apply(job.name, circuits.targets[key], cause)
            steps["applied"] = self.clock() - t0
            bad = self.diagnosis.verify(
                self.diagnosis.points(circuits.targets[key], list(swaps.values())), cause, t0)
            if not bad:
                steps["verified"] = self.clock() - t0
                break
            # Which end is dark: a spare that cannot hear itself is rejected, a GPU of the job
            # that cannot is lost too (within the eviction bounds); nobody is blamed for the
            # other end's fault.
            blamed = self.diagnosis.diagnose([b[:3] for b in bad], cause)
            spares_blamed = [g for g in blamed if g in swaps.values() and g not in rejected]
            lost = [g for g in blamed if self.pool.holder(g) == job.name and g not in failed]
            if not spares_blamed and not lost:
                # the job's circuits set again (the loopback test took their ends) and
                # verified once more: a path the diagnosis moved them off is lit now
                self.writer.apply(job.name, circuits.targets[key], cause)
                bad = self.diagnosis.verify(self.diagnosis.points(
                    circuits.targets[key], list(swaps.values())), cause, t0)
                if bad:
                    self.alarm(f"{cause}: circuits do not verify and no GPU is to blame",
                               Alarm(dark=[list(b[:3]) for b in bad]))
                else:
                    steps["verified"] = self.clock() - t0
                break
            if undo is not None:
                circuits.undo(undo)         # decided again below, from the same job
            for g in spares_blamed:
                rejected.append(g)
                self.pool.reject(g)
            for g in lost:
                self.journal.record(Detected(gpu=g), f"GPU {g} cannot hear itself", defer=True)
                self.pool.report(g, "failed")
                failed.append(g)
            log.warning("%s: rejected spare(s) %s, lost %s; deciding again", cause,
                        spares_blamed, lost)
        if degraded:                             # renumbered: work the difference out
            kept = set(new_map.values())
            self.pool.give_back([g for g in job.rank_map.values() if g not in kept])
            self.pool.take(job.name, [g for g in new_map.values()
                                      if self.pool.holder(g) is None])
        else:                                    # what the swap changed, not the rank map
            self.pool.give_back(list(swaps))
            self.pool.take(job.name, list(swaps.values()))
        job.rank_map, job.circuits, job.phase, job.ready = new_map, circuits, key, None
        self.announce(job, cause, True, None if degraded else
                      {circuits.rank_of[s]: s for s in swaps.values()})
        steps["announced"] = self.clock() - t0
        return SwapOutcome(tuple(failed), swaps, dict(new_map), degraded, False,
                           tuple(rejected), self.clock() - t0, steps)

    def resume(self, job: Job, failed: list[str], swaps: dict[str, str], cause: str
               ) -> SwapOutcome:
        """A swap decided (journaled) but never announced by an agent that was stopped: its
        circuits made so (only what differs moves), verified, and the job told."""
        t0 = self.clock()
        cause = "resume " + cause
        targets = job.circuits.targets[job.key()]
        self.writer.apply(job.name, targets, cause)
        bad = self.diagnosis.verify(self.diagnosis.points(targets, list(swaps.values())),
                                    cause, t0)
        if bad:
            self.alarm("swap resumed after restart does not verify",
                       Alarm(dark=[list(b) for b in bad]))
        self.announce(job, cause, True, None)
        return SwapOutcome(tuple(failed), swaps, dict(job.rank_map),
                           latency_s=self.clock() - t0)
