"""The agent's pure decisions."""
from __future__ import annotations

import pytest
from optics_doubles import PermutationSwitch

from photonic_testbed.common.jobplan import dp_ring, dp_tp
from photonic_testbed.common.rack_layout import Attachment, RackLayout, lumion
from photonic_testbed.emulator.clock import SimClock
from photonic_testbed.emulator.rack import EmulatedRack
from photonic_testbed.hil.agent import Agent, policies
from photonic_testbed.hil.agent.policies import PolicyError
from photonic_testbed.hil.agent.sqlite_journal import SqliteJournal


def test_circuits_for_a_ring_and_for_tp_pairs():
    lu = lumion()
    ranks = {r: f"gpu{r}" for r in range(8)}
    ring = policies.circuits_for(lu, ranks, dp_ring(8).links()[("dp", 0)])
    assert ring == {"chip": {i: 17 + (i % 8) for i in range(1, 9)}}
    tp = policies.circuits_for(lu, ranks, dp_tp(8).links()[("tp", 0)])
    assert tp["chip"][1] == 18 and tp["chip"][2] == 17
    swapped = policies.circuits_for(lu, policies.swap_ranks(ranks, {"gpu3": "spare1"}),
                                    dp_ring(8).links()[("dp", 0)])
    assert swapped["chip"][3] == 26 and swapped["chip"][10] == 21 and 4 not in swapped["chip"]


def test_circuits_refuse_impossible_links():
    two = RackLayout("two", {"a": 4, "b": 4}, {"x": (Attachment("a", 1, 5),),
                                                "y": (Attachment("b", 1, 5),)})
    with pytest.raises(PolicyError, match="share no switch"):
        policies.circuits_for(two, {0: "x", 1: "y"}, [(0, 1)])
    with pytest.raises(PolicyError, match="two peers"):
        policies.circuits_for(lumion(), {0: "gpu0", 1: "gpu1", 2: "gpu2"}, [(0, 1), (0, 2)])
    with pytest.raises(PolicyError, match="rank 5"):
        policies.circuits_for(lumion(), {0: "gpu0"}, [(0, 5)])


def test_every_switch_a_gpu_is_cabled_to_gets_the_circuit():
    dual = RackLayout("dual", {"a": 4, "b": 4},
                      {"x": (Attachment("a", 1, 5), Attachment("b", 2, 6)),
                       "y": (Attachment("a", 2, 6), Attachment("b", 1, 5))})
    c = policies.circuits_for(dual, {0: "x", 1: "y"}, [(0, 1), (1, 0)])
    assert c == {"a": {1: 6, 2: 5}, "b": {2: 5, 1: 6}}


def test_choose_spares_and_rank_maps():
    cost = {("g1", "s0"): (4, 2.0), ("g1", "s1"): (4, 1.0), ("g2", "s0"): (2, 9.0),
            ("g2", "s1"): (4, 0.0)}
    chosen, left = policies.choose_spares(["g1", "g2", "g3"], ["s0", "s1"],
                                          lambda f, s: cost.get((f, s), (0, 0)))
    assert chosen == {"g1": "s1", "g2": "s0"} and left == ["g3"]
    assert policies.choose_spares(["g"], ["a", "b"], lambda f, s: (1,))[0] == {"g": "a"}
    assert policies.shrink_ranks({0: "a", 1: "b", 2: "c"}, ["b"]) == {0: "a", 1: "c"}
    assert policies.changes({1: 5, 2: 6}, {1: 6, 2: 5}) == 4
    assert policies.changes({1: 5}, {1: 5, 2: 6}) == 1


def test_switch_change_cost_counts_before_loss(tmp_path):
    """A switch that knows its cost (a chip counting cells to flip) steers the choice."""
    clock = SimClock()
    chip = PermutationSwitch("chip", 16, clock=clock)
    chip.change_cost = lambda cur, new: 1 if 10 in new else 6      # spare1 needs fewer cells
    rack = EmulatedRack(lumion(), {"chip": chip}, clock)
    with SqliteJournal(tmp_path / "j.db") as j:
        agent = Agent(lumion(), {"chip": chip}, j, rack.port_power_dbm, clock=clock.now)
        agent.admit(dp_ring(8))
        rack.faults.fail_gpu("gpu0")
        assert agent.on_health(rack.gpu_health("gpu0")).swaps == {"gpu0": "spare1"}


def test_a_phases_peers_are_the_ranks_its_links_join():
    from photonic_testbed.common.jobplan import JobPlan, PhaseSpec
    phases = [PhaseSpec("tp", "ring", group=2, stride=1), PhaseSpec("ring", "ring", group=4,
                                                                    stride=2),
              PhaseSpec("pp", "chain", group=4, stride=4), PhaseSpec("ep", "all_to_all",
                                                                     group=8, stride=2)]
    for phase in phases:
        plan = JobPlan("p", 16, (phase,))
        links = [link for ls in plan.links(16).values() for link in ls]
        for r in range(16):
            want = {b if a == r else a for a, b in links if r in (a, b)}
            assert phase.peers(r, 16) == want, (phase.name, r)


def test_the_rank_index_answers_as_a_plain_index_of_every_link():
    """`JobCircuits.by_rank` (links sorted by rank once) against a dict of lists built link by
    link, for every rank and (phase, round) of plans of every pattern, self-links included."""
    from photonic_testbed.common.jobplan import JobPlan, PhaseSpec
    from photonic_testbed.hil.agent.policies import _RankIndex
    plan = JobPlan("p", 24, (PhaseSpec("tp", "ring", group=2, stride=1),
                             PhaseSpec("pp", "chain", group=3, stride=8),
                             PhaseSpec("ep", "all_to_all", group=6, stride=4)))
    links = plan.links()
    links[("self", 0)] = [(5, 5), (7, 3)]               # a link to itself is listed once
    plain: dict[int, dict] = {}
    for key, ls in links.items():
        for a, b in ls:
            plain.setdefault(a, {}).setdefault(key, []).append((a, b))
            if b != a:
                plain.setdefault(b, {}).setdefault(key, []).append((a, b))
    index = _RankIndex(links)
    for r in range(26):                                  # 24, 25: ranks with no link
        assert index.keys(r) == list(plain.get(r, {})), r
        for key in links:
            assert list(index.links(r, key)) == plain.get(r, {}).get(key, []), (r, key)
            assert list(index.links(r, key)) == plain.get(r, {}).get(key, []), (r, key)
    assert index.links(0, ("no such phase", 0)) == []
    assert _RankIndex({}).keys(0) == []


def test_circuits_refuse_an_output_named_twice():
    # two ranks sending to one in the same round: both into gpu2's one receiver
    with pytest.raises(PolicyError, match=r"chip: port \d+ is in two circuits"):
        policies.circuits_for(lumion(), {0: "gpu0", 1: "gpu1", 2: "gpu2"}, [(0, 2), (1, 2)])


def test_a_schedule_that_is_not_made_of_matchings_is_refused_without_listing_links():
    from photonic_testbed.common.jobplan import JobPlan, PhaseSpec, PlanError

    def bad(n):                       # member 0 twice in one round
        return [[(0, 1), (0, 2)]] if n >= 3 else [[(0, 1)]]

    def outside(n):
        return [[(0, n)]]

    plan = JobPlan("a2a", 12, (PhaseSpec("ep", "all_to_all", group=4, stride=1),))
    for matchings in (bad, outside):
        with pytest.raises(PlanError, match="two peers at once"):
            plan.check(matchings=matchings)
        with pytest.raises(PlanError, match="two peers at once"):
            plan.links(matchings=matchings)
    plan.check()
    assert len(plan.links()) == 3
    with pytest.raises(PlanError, match="does not tile"):
        plan.check(10)
