"""The agent's decisions as pure functions of plain data: no switches, no clocks, no I/O.

- `circuits_for`: the circuits of every switch that give each rank link its light path.
- `phase_circuits`: those circuits for every (phase, round) of a job, computed at admission.
- `choose_spares`: which healthy spare replaces which failed GPU (cheapest change first).
- `swap_ranks` / `shrink_ranks`: the new rank map after a swap or without a lost GPU.
- `changes`: how many ports a new configuration touches (the default change cost).
"""
from __future__ import annotations

from typing import Callable, Iterable, Mapping

from photonic_testbed.drivers.circuit_switch import CircuitConflict, Circuits, check_circuits
from photonic_testbed.hil.jobplan import JobPlan, round_robin_matchings
from photonic_testbed.hil.rack_layout import RackLayout

Targets = dict[str, Circuits]           # switch name -> circuits
RankMap = dict[int, str]


class PolicyError(ValueError):
    """No configuration satisfies the request (the message says which links clash)."""


def circuits_for(layout: RackLayout, rank_map: Mapping[int, str],
                 rank_links: Iterable[tuple[int, int]]) -> Targets:
    """Every switch's circuits so that each rank link (src, dst) is src.tx -> dst.rx on every
    switch both GPUs are cabled to; switches no link uses get no circuits."""
    out: Targets = {s: {} for s in layout.switches}
    for a, b in rank_links:
        try:
            ga, gb = rank_map[a], rank_map[b]
        except KeyError as e:
            raise PolicyError(f"rank {e.args[0]} is not in the rank map") from None
        shared = False
        for att in layout.gpus[ga]:
            peer = layout.attachment(gb, att.switch)
            if peer is None:
                continue
            shared = True
            if out[att.switch].get(att.tx, peer.rx) != peer.rx:
                raise PolicyError(f"{ga} would send to two peers on {att.switch}")
            out[att.switch][att.tx] = peer.rx
        if not shared:
            raise PolicyError(f"{ga} and {gb} share no switch: rank link {a}->{b} is impossible")
    for s, c in out.items():
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
                  cost: Callable[[str, str], tuple[float, ...]]
                  ) -> tuple[dict[str, str], list[str]]:
    """Give each failed GPU (in order) the spare of lowest `cost(failed, spare)` (a tuple such
    as (ports or cells to change, path loss dB)); ties go to the spare named first.
    Returns ({failed: spare}, [failed GPUs left without a spare])."""
    pool = list(dict.fromkeys(spares))
    chosen: dict[str, str] = {}
    left: list[str] = []
    for g in failed:
        if not pool:
            left.append(g)
            continue
        best = min(pool, key=lambda s: (tuple(cost(g, s)), pool.index(s)))
        chosen[g] = best
        pool.remove(best)
    return chosen, left
