"""The agent's decisions as pure functions of plain data: no switches, no clocks, no I/O.

- `circuits_for`: the circuits of every switch that give each rank link its light path.
- `phase_circuits`: those circuits for every (phase, round) of a job, computed at admission.
- `choose_spares`: which healthy spare replaces which failed GPU (cheapest change first).
- `swap_ranks` / `shrink_ranks`: the new rank map after a swap or without a lost GPU.
- `changes`: how many ports a new configuration touches (the default change cost).
"""
from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Iterator, Mapping

import numpy as np

from photonic_testbed.common.jobplan import JobPlan, round_robin_matchings
from photonic_testbed.common.rack_layout import RackLayout
from photonic_testbed.drivers.circuit_switch import CircuitConflict, Circuits, check_circuits

Targets = dict[str, Circuits]           # switch name -> circuits
RankMap = dict[int, str]


class PolicyError(ValueError):
    """No configuration satisfies the request (the message says which links clash)."""


def circuits_for(layout: RackLayout, rank_map: Mapping[int, str],
                 rank_links: Iterable[tuple[int, int]]) -> Targets:
    """Every switch's circuits so that each rank link (src, dst) is src.tx -> dst.rx on every
    switch both GPUs are cabled to (a link inside one server needs none: its scale-up
    fabric carries it); switches no link uses get no circuits."""
    out: Targets = {s: {} for s in layout.switches}
    server_of, tx_of, rx_of = layout.wiring
    for a, b in rank_links:
        try:
            ga, gb = rank_map[a], rank_map[b]
        except KeyError as e:
            raise PolicyError(f"rank {e.args[0]} is not in the rank map") from None
        server = server_of[ga]
        if server is not None and server == server_of[gb]:
            continue
        shared = False
        peer = rx_of[gb]
        for switch, tx in tx_of[ga]:
            rx = peer.get(switch)
            if rx is None:
                continue
            shared = True
            if out[switch].setdefault(tx, rx) != rx:
                raise PolicyError(f"{ga} would send to two peers on {switch}")
        if not shared:
            raise PolicyError(f"{ga} and {gb} share no switch: rank link {a}->{b} is impossible")
    for s, c in out.items():
        # Every port comes from the layout (checked when it was made), and an input has one
        # output by construction: what is left to refuse is an output named twice.
        if len(set(c.values())) != len(c):
            try:
                check_circuits(c, layout.switches[s])
            except CircuitConflict as e:
                raise PolicyError(f"{s}: {e}") from None
    return out


def phase_circuits(plan: JobPlan, layout: RackLayout, rank_map: Mapping[int, str],
                   matchings: Callable[[int], list[list[tuple[int, int]]]] = round_robin_matchings
                   ) -> dict[tuple[str, int], Targets]:
    """{(phase, round): targets} for the whole step, in step order."""
    return {key: circuits_for(layout, rank_map, links)
            for key, links in plan.links(len(rank_map), matchings).items()}


def changes(current: Mapping[int, int], target: Mapping[int, int]) -> int:
    """Circuits removed plus circuits added to go from current to target."""
    removed = sum(1 for i, o in current.items() if target.get(i) != o)
    added = sum(1 for i, o in target.items() if current.get(i) != o)
    return removed + added


def swap_ranks(rank_map: Mapping[int, str], swaps: Mapping[str, str]) -> RankMap:
    """The rank map with each failed GPU's ranks given to its spare."""
    return {r: swaps.get(g, g) for r, g in sorted(rank_map.items())}


def shrink_ranks(rank_map: Mapping[int, str], lost: Iterable[str]) -> RankMap:
    """The rank map without the lost GPUs, renumbered 0..n-1 in the old rank order."""
    lost = set(lost)
    keep = [g for _, g in sorted(rank_map.items()) if g not in lost]
    return dict(enumerate(keep))


def choose_spares(failed: Iterable[str], spares: Iterable[str],
                  cost: Callable[[str, str], tuple[float, ...] | None],
                  feasible: Callable[[str, str], bool] | None = None
                  ) -> tuple[dict[str, str], list[str]]:
    """Give each failed GPU (in order) the spare of lowest `cost(failed, spare)` (a tuple such
    as (ports or cells to change, path loss dB); None: this spare cannot take its place, e.g.
    it shares no switch with the failed GPU's peers) that is `feasible` (checked in order of
    cost, so that a dearer check runs for the chosen spare alone); ties go to the spare named
    first. Returns ({failed: spare}, [failed GPUs left without a spare])."""
    pool = list(dict.fromkeys(spares))
    chosen: dict[str, str] = {}
    left: list[str] = []
    for g in failed:
        scored = sorted((tuple(c), i, s) for i, s in enumerate(pool)
                        if (c := cost(g, s)) is not None)
        best = next((s for _, _, s in scored if feasible is None or feasible(g, s)), None)
        if best is None:
            left.append(g)
            continue
        chosen[g] = best
        pool.remove(best)
    return chosen, left


Key = tuple[str, int]                    # (phase, round)
Delta = list[tuple[Key, str, list[tuple[int, int]], list[tuple[int, int]]]]


def link_circuits(layout: RackLayout, ga: str, gb: str) -> list[tuple[str, int, int]]:
    """The circuits (switch, tx, rx) that carry GPU ga's light to GPU gb: on every switch both
    are cabled to; none inside a server. PolicyError when they share no switch."""
    out = layout.links_between(ga, gb)
    if out is None:
        raise PolicyError(f"{ga} and {gb} share no switch")
    return out


class JobCircuits:
    """A job's circuits for every (phase, round), computed once at admission and indexed by
    rank, so that replacing a GPU costs what changes (the failed ranks' links), not the job or
    the rack.

    `targets[(phase, round)][switch]` is {input: output}. A swap changes the current phase's
    circuits at once (`swap`); every other phase the swapped ranks take part in is marked
    stale with the GPUs its circuits still name, and brought up to date when the job reaches
    it (`refresh`): an all-to-all job's 255 rounds are not rewritten while the job waits.

    A swap keeps the rank map one to one (the spare holds no rank), so its new circuits take
    exactly the ports the failed GPU's circuits free on the peers' side, and the spare's own,
    which nothing else uses: no port can be claimed twice, and only the cabling can refuse (a
    spare that shares no switch with a peer: `feasible`)."""

    def __init__(self, plan: JobPlan, layout: RackLayout, rank_map: Mapping[int, str],
                 matchings: Callable[[int], list[list[tuple[int, int]]]] = round_robin_matchings):
        self._hold(plan, layout, rank_map)
        links = plan.links(len(self.rank_map), matchings)
        self.size = sum(len(x) for x in links.values())    # rank links, every phase's
        # rank -> {(phase, round): its links there}
        self.by_rank = _RankIndex(links)
        self.targets: Mapping[Key, Targets] = {
            key: circuits_for(layout, self.rank_map, x) for key, x in links.items()}

    def _hold(self, plan: JobPlan, layout: RackLayout, rank_map: Mapping[int, str]) -> None:
        self.layout, self.plan = layout, plan
        self.rank_map: RankMap = {int(r): str(g) for r, g in rank_map.items()}
        self.rank_of = {g: r for r, g in self.rank_map.items()}
        if len(self.rank_of) != len(self.rank_map):
            raise PolicyError("a GPU holds two ranks in the rank map")
        # (phase, round) -> {rank: the GPU its circuits there still name}
        self.stale: dict[Key, dict[int, str]] = {}

    @classmethod
    def assembled(cls, plan: JobPlan, layout: RackLayout, rank_map: Mapping[int, str],
                  by_rank: _RankIndex, targets: PackedTargets, size: int) -> JobCircuits:
        """A job's circuits worked out in another process (`hil.agent.admission`), from the
        parts it made there: its rank index and every phase's circuits, packed."""
        self = cls.__new__(cls)
        self._hold(plan, layout, rank_map)
        self.size, self.by_rank = size, by_rank
        self.targets = targets
        return self

    def _circuits(self, rank_map: Mapping[int, str], a: int, b: int):
        try:
            return link_circuits(self.layout, rank_map[a], rank_map[b])
        except PolicyError as e:
            raise PolicyError(f"rank link {a}->{b}: {e}") from None

    def _delta(self, old: Mapping[int, str], new: Mapping[int, str], ranks: Iterable[int],
               keys: Iterable[Key]) -> Delta:
        seen: set[tuple[int, int]] = set()
        changes: dict[tuple[Key, str], tuple[list, list]] = {}
        for key in keys:
            seen.clear()
            for r in ranks:
                for a, b in self.by_rank.links(r, key):
                    if (a, b) in seen:
                        continue
                    seen.add((a, b))
                    for s, i, o in self._circuits(old, a, b):
                        changes.setdefault((key, s), ([], []))[0].append((i, o))
                    for s, i, o in self._circuits(new, a, b):
                        changes.setdefault((key, s), ([], []))[1].append((i, o))
        return [(key, s, rem, add) for (key, s), (rem, add) in changes.items()]

    def delta(self, swaps: Mapping[str, str], keys: Iterable[Key] | None = None) -> Delta:
        """What giving each failed GPU's ranks to its spare changes, per (phase, round) and
        switch: (key, switch, circuits removed, circuits added); every phase unless `keys`."""
        over = {self.rank_of[f]: s for f, s in swaps.items()}
        ranks = list(over)
        if keys is None:
            keys = list(dict.fromkeys(k for r in ranks for k in self.by_rank.keys(r)))
        return self._delta(self.rank_map, _Overlay(self.rank_map, over), ranks, keys)

    def feasible(self, swaps: Mapping[str, str]) -> bool:
        """Whether every link of the failed GPUs' ranks, in every phase, has a switch (or a
        server) to run through once their spares hold them."""
        over = {self.rank_of[f]: s for f, s in swaps.items()}
        reach = self.layout.reaches
        for r, spare in over.items():
            for p in self.peers(r):
                if not reach(spare, over.get(p) or self.rank_map[p]):
                    return False
        return True

    def peers(self, r: int) -> set[int]:
        """The ranks rank r has a link with in some phase."""
        world = len(self.rank_map)
        out: set[int] = set()
        for phase in self.plan.phases:
            out |= phase.peers(r, world)
        return out

    def swap(self, swaps: Mapping[str, str], now: Key) -> tuple:
        """Give the failed GPUs' ranks to their spares: the circuits of phase `now` changed,
        the other phases of those ranks marked stale. Returns what `undo` takes."""
        delta = self.delta(swaps, keys=(now,))
        for key, s, removed, added in delta:
            c = self.targets[key][s]
            for i, _ in removed:
                c.pop(i, None)
            c.update(added)
        marked: list[tuple[Key, int]] = []
        for failed, spare in swaps.items():
            r = self.rank_of.pop(failed)
            self.rank_map[r] = spare
            self.rank_of[spare] = r
            for key in self.by_rank.keys(r):
                if key != now:
                    stale = self.stale.setdefault(key, {})
                    if r not in stale:
                        stale[r] = failed
                        marked.append((key, r))
        return delta, dict(swaps), marked

    def undo(self, token: tuple) -> None:
        delta, swaps, marked = token
        for key, s, removed, added in reversed(delta):
            c = self.targets[key][s]
            for i, _ in added:
                c.pop(i, None)
            c.update(removed)
        for failed, spare in swaps.items():
            r = self.rank_of.pop(spare)
            self.rank_map[r] = failed
            self.rank_of[failed] = r
        for key, r in marked:
            self.stale[key].pop(r, None)
            if not self.stale[key]:
                del self.stale[key]

    def refresh(self, key: Key) -> Targets:
        """Phase `key`'s circuits for the rank map as it is now (brought up to date from the
        GPUs they still name, if a swap left them stale)."""
        stale = self.stale.pop(key, None)
        if stale:
            old = _Overlay(self.rank_map, stale)
            for k, s, removed, added in self._delta(old, self.rank_map, list(stale), (key,)):
                c = self.targets[k][s]
                for i, _ in removed:
                    c.pop(i, None)
                c.update(added)
        return self.targets[key]


class _RankIndex:
    """Which links each rank takes part in, per (phase, round): the links sorted by rank once
    (numpy) and cut into one slice per rank when it is asked about, so that a failover asks for
    one rank's links of one phase, or the phases a rank is in, without a dict of lists per rank
    and phase built at admission (an all-to-all job of 2,048 ranks has half a million links:
    1.2 s), and without a Python object per link (arrays: sent whole from the admission's
    worker, and nothing for the cyclic collector to walk)."""

    def __init__(self, links: Mapping[Key, list[tuple[int, int]]]):
        self._keys = list(links)
        self._index = {key: i for i, key in enumerate(self._keys)}
        n = sum(len(v) for v in links.values())
        pairs = np.fromiter(itertools.chain.from_iterable(
            itertools.chain.from_iterable(links.values())), dtype=np.int32,
            count=2 * n).reshape(n, 2)
        key_of = np.repeat(np.arange(len(self._keys), dtype=np.int32),
                           [len(v) for v in links.values()])
        index = np.arange(n, dtype=np.int32)
        other = pairs[:, 1] != pairs[:, 0]            # a link to itself is listed once
        ranks = np.concatenate([pairs[:, 0], pairs[other, 1]])
        where = np.concatenate([index, index[other]])
        order = np.lexsort((where, ranks))            # by rank, then in step order
        self._pairs = pairs                           # the links, in step order
        self._ranks = ranks[order]
        self._where = where[order]
        self._key_of = key_of[self._where]            # the (phase, round) of each, by index
        # rank -> ({phase-round index: (start, end) in its links}, its links in step order)
        self._made: dict[int, tuple[dict[int, tuple[int, int]], list[tuple[int, int]]]] = {}

    def _of(self, rank: int) -> tuple[dict[int, tuple[int, int]], list[tuple[int, int]]]:
        got = self._made.get(rank)
        if got is None:
            # (asked in the array's own type: a tuple of ints would have numpy cast the
            # whole array to int64 first, 0.1 ms a rank on a 1,024-rank all-to-all)
            lo, hi = self._ranks.searchsorted(
                np.array((rank, rank + 1), dtype=self._ranks.dtype)).tolist()
            if lo == hi:
                return {}, []
            ks = self._key_of[lo:hi]            # ascending: the links are in step order
            bounds = (np.flatnonzero(ks[1:] != ks[:-1]) + 1).tolist()
            starts, ends = [0, *bounds], [*bounds, hi - lo]
            spans = dict(zip(ks[starts].tolist(), zip(starts, ends, strict=True),
                             strict=True))
            a, b = self._pairs[self._where[lo:hi]].T.tolist()
            got = self._made[rank] = (spans, list(zip(a, b, strict=True)))
        return got

    def keys(self, rank: int) -> list[Key]:
        """The (phase, round)s in which `rank` has a link, in step order."""
        return [self._keys[k] for k in self._of(rank)[0]]

    def links(self, rank: int, key: Key) -> list[tuple[int, int]]:
        """`rank`'s links in (phase, round) `key`, in their order there."""
        spans, links = self._of(rank)
        a, b = spans.get(self._index.get(key, -1), (0, 0))
        return links[a:b]


class PackedTargets(Mapping[Key, Targets]):
    """Every (phase, round)'s circuits as three arrays (switch, input, output), as the
    admission's worker sends them: a few array buffers, read without a Python object per
    circuit. A (phase, round) is made a dict of switch -> circuits the first time it is asked
    for, and kept (a swap changes it in place)."""

    def __init__(self, switches: list[str], targets: Mapping[Key, Targets]):
        self._switches = list(switches)
        self._keys = list(targets)
        self._index = {key: i for i, key in enumerate(self._keys)}
        number = {s: i for i, s in enumerate(self._switches)}
        counts = [sum(len(c) for c in t.values()) for t in targets.values()]
        self._starts = np.concatenate(([0], np.cumsum(counts, dtype=np.int64)))
        n = int(self._starts[-1])
        self._switch = np.fromiter((number[s] for t in targets.values() for s, c in t.items()
                                    for _ in range(len(c))), dtype=np.int32, count=n)
        self._ends = np.fromiter(itertools.chain.from_iterable(
            itertools.chain.from_iterable(c.items() for t in targets.values()
                                          for c in t.values())), dtype=np.int32,
            count=2 * n).reshape(n, 2)
        self._made: dict[Key, Targets] = {}

    def __getitem__(self, key: Key) -> Targets:
        got = self._made.get(key)
        if got is None:
            i = self._index[key]
            a, b = int(self._starts[i]), int(self._starts[i + 1])
            got = {s: {} for s in self._switches}
            names = self._switches
            for k, (x, y) in zip(self._switch[a:b].tolist(), self._ends[a:b].tolist(),
                                 strict=True):
                got[names[k]][x] = y
            self._made[key] = got
        return got

    def __contains__(self, key: object) -> bool:
        return key in self._index

    def __iter__(self) -> Iterator[Key]:
        return iter(self._keys)

    def __len__(self) -> int:
        return len(self._keys)


class _Overlay(Mapping):
    """A rank map with a few ranks given to other GPUs, without copying it."""

    def __init__(self, base: Mapping[int, str], over: Mapping[int, str]):
        self.base, self.over = base, over

    def __getitem__(self, r: int) -> str:
        return self.over[r] if r in self.over else self.base[r]

    def __iter__(self):
        return iter(self.base)

    def __len__(self) -> int:
        return len(self.base)
