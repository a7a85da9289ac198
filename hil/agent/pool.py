"""The rack's GPUs as the agent sees them: who holds which, which are free, and which may take
a rank now.

A GPU is held by at most one job. The free GPUs are kept in rack order, so a spare or a new
job's GPUs are chosen the same way whatever happened before. A GPU may take a rank when it is
free, healthy, has not failed its circuits' verification (`reject`, until an operator returns
it), and has not failed within the quarantine (a flapping GPU stays out). Allocation for a new
job takes whole servers of one pod where the rack has servers (best fit or first fit), else the
first free workers.
"""
from __future__ import annotations

import heapq
import types
from collections.abc import Callable, Mapping

from photonic_testbed.common.jobplan import JobPlan
from photonic_testbed.common.rack_layout import RackLayout
from photonic_testbed.hil.agent.config import AgentConfig
from photonic_testbed.hil.agent.jobs import AgentError
from photonic_testbed.hil.agent.policies import RankMap


class GpuPool:
    """Who holds which GPU, GPUs free in rack order, health, failure times, quarantine and
    rejected spares; and the allocation of GPUs to a new job."""

    def __init__(self, layout: RackLayout, clock: Callable[[], float], config: AgentConfig):
        self.layout = layout
        self.clock = clock
        self.quarantine_s = config.quarantine_s
        self.allocation = config.allocation
        self._holder: dict[str, str] = {}              # GPU -> the job holding it
        self._order = {g: i for i, g in enumerate(layout.gpus)}
        self._free: list[str] = list(layout.gpus)      # GPUs no job holds, in rack order
        self._reserved: set[str] = set()               # ... nor any job, being admitted
        self._health: dict[str, str] = {}
        self._failed_at: dict[str, float] = {}
        self._rejected: set[str] = set()

    # --- holding ----------------------------------------------------------------------------
    def holder(self, gpu: str) -> str | None:
        """The name of the job holding `gpu`, or None."""
        return self._holder.get(gpu)

    def take(self, job: str, gpus: list[str]) -> None:
        self._unfree(gpus)
        for g in gpus:
            self._holder[g] = job

    def give_back(self, gpus: list[str]) -> None:
        self._refree([g for g in gpus if self._holder.pop(g, None) is not None])

    def reserve(self, gpus: list[str]) -> None:
        """Free `gpus` are kept for a job being admitted (its circuits worked out meanwhile):
        neither spares nor another job's until unreserved."""
        self._unfree(gpus)
        self._reserved.update(gpus)

    def unreserve(self, gpus: list[str]) -> None:
        back = [g for g in gpus if g in self._reserved]
        self._reserved.difference_update(back)
        self._refree(back)

    # (a job's thousand GPUs in one pass over the free list, not one pass each)
    def _unfree(self, gpus: list[str]) -> None:
        gone = set(gpus)
        kept = [g for g in self._free if g not in gone]
        if len(kept) != len(self._free) - len(gone):
            raise ValueError(f"GPUs not free: {sorted(gone - set(self._free))[:8]}")
        self._free = kept

    def _refree(self, gpus: list[str]) -> None:
        order = self._order.__getitem__
        self._free = list(heapq.merge(self._free, sorted(gpus, key=order), key=order))

    def release_all(self) -> None:
        """No job holds any GPU (the jobs are read from the journal afresh)."""
        self._holder.clear()
        self._reserved.clear()
        self._free = list(self.layout.gpus)

    def free(self) -> list[str]:
        """The GPUs no job holds, in rack order."""
        return list(self._free)

    # --- health -----------------------------------------------------------------------------
    def health(self, gpu: str) -> str:
        return self._health.get(gpu, "ok")

    def healths(self) -> Mapping[str, str]:
        """{gpu: its health} for every GPU ever reported (a read-only view, kept current)."""
        return types.MappingProxyType(self._health)

    def report(self, gpu: str, state: str) -> str:
        """A GPU's health as reported; returns the health it had. A failure starts its
        quarantine."""
        old = self._health.get(gpu, "ok")
        self._health[gpu] = state
        if state == "failed":
            self._failed_at[gpu] = self.clock()
        return old

    def hold_out(self, gpu: str) -> None:
        """Keep `gpu` out of the spares for the quarantine, as after a failure (an operator
        swapped it out)."""
        self._failed_at[gpu] = self.clock()

    def reject(self, gpu: str) -> None:
        """`gpu` failed its circuits' verification: no spare until returned to the pool."""
        self._rejected.add(gpu)

    def rejected(self) -> frozenset[str]:
        return frozenset(self._rejected)

    def return_to_pool(self, gpu: str) -> None:
        """An operator repaired a GPU that failed verification: it may be a spare again."""
        self._rejected.discard(gpu)
        self._failed_at.pop(gpu, None)

    def unusable(self, gpu: str) -> str | None:
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

    # --- admission --------------------------------------------------------------------------
    def choose(self, name: str, plan: JobPlan, rank_map: Mapping[int, str] | None,
               held: list[str] | None = None) -> RankMap:
        """The GPUs of a job to admit (given, checked; or allocated), decided as if the GPUs
        an earlier admission of its name holds (`held`) were free (nothing of it changes
        unless the new one is accepted); changes nothing."""
        if held is not None:
            self.give_back(held)
        try:
            return self.check(name, plan, self.allocate(plan) if rank_map is None
                              else rank_map)
        finally:
            if held is not None:
                self.take(name, held)

    def check(self, name: str, plan: JobPlan, rank_map: Mapping[int, str]) -> RankMap:
        """A rank map given for a job to admit, checked: one GPU per rank 0..world-1, each a
        GPU of the rack that no job holds and that may take a rank now."""
        ranks = {int(r): str(g) for r, g in rank_map.items()}
        if sorted(ranks) != list(range(plan.world)):
            raise AgentError(f"job {name!r} wants ranks 0..{plan.world - 1}; the rank map "
                             f"gives {len(ranks)} ranks"
                             + ("" if len(ranks) != plan.world else
                                f", numbered {sorted(ranks)[:8]}..."))
        taken = [g for g in ranks.values() if g in self._holder or g in self._reserved]
        unknown = [g for g in ranks.values() if g not in self.layout.gpus]
        if len(set(ranks.values())) != len(ranks):
            raise AgentError(f"job {name!r}: a GPU is named for two ranks")
        if unknown or taken:
            held = [(g, self._holder.get(g, "being admitted")) for g in taken[:8]]
            raise AgentError(f"job {name!r} cannot have "
                             + (f"GPUs the rack does not have: {unknown}" if unknown else
                                f"GPUs another job holds: {held}"
                                + (f" (and {len(taken) - 8} more)" if len(taken) > 8 else "")))
        unusable = {g: why for g in ranks.values() if (why := self.unusable(g))}
        if unusable:
            raise AgentError(f"job {name!r} cannot have GPUs that cannot take a rank now: "
                             + "; ".join(f"{g} {why}" for g, why in
                                         list(unusable.items())[:8])
                             + (f" (and {len(unusable) - 8} more)" if len(unusable) > 8
                                else ""))
        return ranks

    def allocate(self, plan: JobPlan) -> RankMap:
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
        pods: dict[frozenset[str], list[str]] = {}
        for server, gpus in self.layout.server_gpus.items():
            if all(g not in self._holder and g not in self._reserved and g not in spares and
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
