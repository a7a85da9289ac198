"""The agent's values: an admitted job, what a failover did, and the agent's error.

Every part of the agent (`pool`, `writer`, `diagnosis`, `failover`, `recovery`) speaks of a
job by these; the `Agent` facade holds the jobs themselves.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from photonic_testbed.common.jobplan import JobPlan
from photonic_testbed.hil.agent import policies
from photonic_testbed.hil.agent.policies import RankMap

Key = tuple[str, int]          # a phase and its round


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
    owner: str | None = None        # the key that admitted it (None: no key's)

    def gpus(self) -> list[str]:
        """The GPUs its ranks are on."""
        return list(self.rank_map.values())

    def next_key(self, key: Key) -> Key:
        """The (phase, round) a step runs after `key` (the first again after the last)."""
        keys = list(self.circuits.targets)
        return keys[(keys.index(key) + 1) % len(keys)]

    def key(self) -> Key:
        targets = self.circuits.targets
        return self.phase if self.phase in targets else next(iter(targets))
