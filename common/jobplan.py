"""A training job's communication plan as plain data: which ranks talk in which phase.

A step is a sequence of phases (e.g. TP all-reduce within pairs, then DP ring across them).
Each phase has a pattern over groups of ranks and, per round, a set of directed rank links
(src, dst) the phase needs. With one transceiver per GPU, every round's links must be a partial
permutation (each rank sends to at most one peer and hears at most one), which is what a
circuit switch gives; `JobPlan` refuses plans that are not.

Patterns, over the groups of a phase (members ordered by rank):
- "ring":       member i -> member i+1 (cyclic); a group of 2 is one bidirectional link.
- "chain":      member i -> member i+1 (no wrap): a pipeline.
- "all_to_all": one round per matching of a round-robin schedule; in each round matched
                members exchange both ways (expert parallel's shuffle).
Groups: `group` consecutive slots of size `group` with ranks `stride` apart; e.g. with 8 ranks,
TP pairs are group=2, stride=1 ({0,1}, {2,3}, ...) and the DP ring across them is group=4,
stride=2 ({0,2,4,6}, {1,3,5,7}). group=0 means the whole world.

The emulated job, the agent and the job-side client all read this module; nothing here knows
about switches.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

PATTERNS = ("ring", "chain", "all_to_all")

RankLink = tuple[int, int]


MAX_PHASES = 64                  # phases of one job's plan, at most


class PlanError(ValueError):
    """The plan cannot run on this world size, or is not a valid plan."""


def round_robin_matchings(n: int) -> list[list[tuple[int, int]]]:
    """A round-robin (circle method) schedule: n-1 perfect matchings of 0..n-1 for even n
    (n rounds with one member idle per round for odd n) that together pair everyone once.

    Kept small and replaceable: the mesh drivers bring their own minimal schedules, and the
    agent takes any callable of this shape (`matchings=` of `JobPlan.links`)."""
    if n < 2:
        return []
    slots = list(range(n)) + ([None] if n % 2 else [])
    m = len(slots)
    rounds = []
    for _ in range(m - 1):
        pairs = []
        for i in range(m // 2):
            a, b = slots[i], slots[m - 1 - i]
            if a is not None and b is not None:
                pairs.append((min(a, b), max(a, b)))
        rounds.append(sorted(pairs))
        slots = [slots[0], slots[-1]] + slots[1:-1]   # rotate all but the first
    return rounds


@dataclass(frozen=True)
class PhaseSpec:
    name: str
    pattern: str = "ring"
    group: int = 0            # members per group; 0 = the whole world
    stride: int = 1           # rank distance between consecutive members
    bytes: float = 1e9        # bytes each link carries in this phase (per round)
    compute_s: float = 0.01   # compute before this phase's communication

    def __post_init__(self) -> None:
        if self.pattern not in PATTERNS:
            raise PlanError(f"phase {self.name!r}: unknown pattern {self.pattern!r}; "
                            f"one of {', '.join(PATTERNS)}")
        if self.group < 0 or self.group == 1 or self.stride < 1:
            raise PlanError(f"phase {self.name!r}: group must be 0 or >= 2 and stride >= 1")
        if self.bytes < 0 or self.compute_s < 0:
            raise PlanError(f"phase {self.name!r}: bytes and compute_s cannot be negative")

    def groups(self, world: int) -> list[list[int]]:
        g = self.group or world
        if world % (g * self.stride):
            raise PlanError(f"phase {self.name!r} ({self.pattern}, group {g}, stride "
                            f"{self.stride}) does not tile a world of {world} ranks")
        out = []
        for block in range(0, world, g * self.stride):
            for offset in range(self.stride):
                out.append([block + offset + k * self.stride for k in range(g)])
        return out

    def peers(self, rank: int, world: int) -> set[int]:
        """The ranks `rank` has a link with in some round of this phase, worked out from its
        group (without listing the phase's links)."""
        g = self.group or world
        span = g * self.stride
        block = rank - rank % span
        offset = (rank - block) % self.stride
        members = [block + offset + k * self.stride for k in range(g)]
        i = members.index(rank)
        if self.pattern == "all_to_all":
            out = set(members)
        elif self.pattern == "ring":
            out = {members[(i - 1) % g], members[(i + 1) % g]}
        else:
            out = {members[j] for j in (i - 1, i + 1) if 0 <= j < g}
        out.discard(rank)
        return out

    def schedule(self, g: int,
                 matchings: Callable[[int], list[list[tuple[int, int]]]] = round_robin_matchings
                 ) -> list[list[tuple[int, int]]]:
        """An all-to-all group's rounds: `matchings(g)`, each checked to be a matching of
        members 0..g-1. The groups tile the world, so every round of the phase is then a
        permutation of the ranks (checked on the g members, not on the world's links)."""
        schedule = matchings(g)
        for r, matching in enumerate(schedule):
            ends = [x for pair in matching for x in pair]
            if len(set(ends)) != len(ends) or not all(
                    isinstance(x, int) and 0 <= x < g for x in ends):
                raise PlanError(f"phase {self.name!r} round {r} needs a rank to send to or "
                                f"hear two peers at once; one transceiver cannot")
        return schedule

    def rounds(self, world: int,
               matchings: Callable[[int], list[list[tuple[int, int]]]] = round_robin_matchings
               ) -> list[list[RankLink]]:
        """The directed rank links of each round of this phase."""
        groups = self.groups(world)
        if self.pattern == "ring":
            links = []
            for members in groups:
                n = len(members)
                pairs = {(members[i], members[(i + 1) % n]) for i in range(n)}
                links += sorted(pairs)
            return [sorted(links)]
        if self.pattern == "chain":
            return [sorted((m[i], m[i + 1]) for m in groups for i in range(len(m) - 1))]
        schedule = self.schedule(len(groups[0]), matchings)
        rounds = []
        for matching in schedule:
            links = []
            for members in groups:
                for a, b in matching:
                    links += [(members[a], members[b]), (members[b], members[a])]
            rounds.append(sorted(links))
        return rounds


@dataclass(frozen=True)
class JobPlan:
    name: str
    world: int
    phases: tuple[PhaseSpec, ...]
    min_world: int | None = None     # smallest world the job may shrink to (None: cannot)

    def __post_init__(self) -> None:
        if self.world < 2:
            raise PlanError(f"job {self.name!r}: a world needs at least 2 ranks")
        if not self.phases:
            raise PlanError(f"job {self.name!r} has no phases")
        names = [p.name for p in self.phases]
        if len(set(names)) != len(names):
            raise PlanError(f"job {self.name!r}: phase names repeat: {names}")
        self.check(self.world)   # refuse a plan that does not fit its own world

    def allows(self, world: int) -> bool:
        """Whether the job can run (possibly degraded) on `world` ranks."""
        if world == self.world:
            return True
        if self.min_world is None or not self.min_world <= world < self.world:
            return False
        try:
            self.check(world)
        except PlanError:
            return False
        return True

    def links(self, world: int | None = None,
              matchings: Callable[[int], list[list[tuple[int, int]]]] = round_robin_matchings
              ) -> dict[tuple[str, int], list[RankLink]]:
        """{(phase, round): directed rank links}, in step order; refuses non-permutations."""
        world = self.world if world is None else world
        out: dict[tuple[str, int], list[RankLink]] = {}
        for phase in self.phases:
            for r, links in enumerate(phase.rounds(world, matchings)):
                out[(phase.name, r)] = links
        return out

    def check(self, world: int | None = None,
              matchings: Callable[[int], list[list[tuple[int, int]]]] = round_robin_matchings
              ) -> None:
        """Raise PlanError unless the plan runs on `world` ranks (every phase's groups tile
        it, every schedule is made of matchings), without listing its links (an all-to-all
        over 2,048 ranks has half a million)."""
        world = self.world if world is None else world
        for phase in self.phases:
            groups = phase.groups(world)
            if phase.pattern == "all_to_all":
                phase.schedule(len(groups[0]), matchings)

    def sequence(self, world: int | None = None) -> list[tuple[str, int]]:
        """(phase, round) in the order one step runs them."""
        return list(self.links(world))

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "world": self.world, "min_world": self.min_world,
                "phases": [asdict(p) for p in self.phases]}

    @classmethod
    def from_dict(cls, d: dict[str, Any], max_world: int | None = None) -> JobPlan:
        """A plan from its dict (`to_dict`). `max_world`: refuse a bigger world before its
        links are worked out (they cost the world's square for an all-to-all)."""
        try:
            world = int(d["world"])
            if max_world is not None and world > max_world:
                raise PlanError(f"job {d.get('name')!r} wants {world} ranks; at most "
                                f"{max_world} can run here")
            if not isinstance(d["phases"], (list, tuple)) or len(d["phases"]) > MAX_PHASES:
                raise PlanError(f"job {d.get('name')!r}: phases are a list of at most "
                                f"{MAX_PHASES}")
            return cls(str(d["name"]), int(d["world"]),
                       tuple(PhaseSpec(**p) for p in d["phases"]),
                       None if d.get("min_world") is None else int(d["min_world"]))
        except PlanError:
            raise
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise PlanError(f"not a job plan: {e!r}") from None


def dp_ring(world: int, name: str = "dp", **kw: Any) -> JobPlan:
    """Pure data parallelism: one all-reduce ring over every rank; may shrink to 2 ranks."""
    return JobPlan(name, world, (PhaseSpec("dp", "ring", **kw),), min_world=2)


def dp_tp(world: int, tp: int = 2, name: str = "dp-tp", tp_bytes: float = 2e8,
          dp_bytes: float = 1e9, compute_s: float = 0.01) -> JobPlan:
    """TP groups of `tp` consecutive ranks, then DP rings across them (Opus's two rails)."""
    return JobPlan(name, world, (
        PhaseSpec("tp", "ring", group=tp, stride=1, bytes=tp_bytes, compute_s=compute_s),
        PhaseSpec("dp", "ring", group=world // tp, stride=tp, bytes=dp_bytes, compute_s=compute_s),
    ))
