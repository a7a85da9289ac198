"""Several jobs (tenants) on one rail rack: each gets whole servers of one pod; phase switches
and failovers of one job never move another job's circuits (read off the switches themselves);
spares are shared; a failure with no spare left degrades only the job it hits."""
from __future__ import annotations

import pytest

from photonic_testbed.common.jobplan import JobPlan, PhaseSpec
from photonic_testbed.common.rack_layout import rail_rack
from photonic_testbed.drivers.circuit_switch import ApplyReport, CircuitSwitch, check_circuits
from photonic_testbed.hil.agent.agent import Agent, AgentError
from photonic_testbed.hil.agent.config import AgentConfig
from photonic_testbed.hil.agent.sqlite_journal import SqliteJournal


class Switch(CircuitSwitch):
    """Holds what it is told; counts every port a write changes."""

    def __init__(self, name, n):
        self.name, self.n, self.c = name, n, {}
        self.touched: set[int] = set()

    @property
    def ports(self):
        return self.n

    def apply(self, circuits):
        want = check_circuits(circuits, self.n)
        for i in set(want) | set(self.c):
            if want.get(i) != self.c.get(i):
                self.touched |= {i, want.get(i) or self.c[i]}
        self.c = want
        return ApplyReport()

    def circuits(self):
        return dict(self.c)


def plan(name: str, servers: int) -> JobPlan:
    """TP inside each server; across servers (on each rail) a pipeline and a DP ring."""
    world = 8 * servers
    phases = [PhaseSpec("tp", "ring", group=8, stride=1)]
    if servers > 1:
        phases += [PhaseSpec("pp", "chain", group=servers, stride=8),
                   PhaseSpec("dp", "ring", group=servers, stride=8)]
    return JobPlan(name, world, tuple(phases), min_world=8)


@pytest.fixture
def rack(tmp_path):
    layout = rail_rack("pods", 16, rails=8, spare_servers=1, pod=8)   # 2 pods of 8 servers
    switches = {s: Switch(s, n) for s, n in layout.switches.items()}
    with SqliteJournal(tmp_path / "j.db") as journal:
        agent = Agent(layout, switches, journal, lambda s, p: -3.0,
                      config=AgentConfig(quarantine_s=1e9))
        yield layout, switches, agent


def ports_of(layout, gpus):
    out: dict[str, set[int]] = {}
    for g in gpus:
        for a in layout.gpus[g]:
            out.setdefault(a.switch, set()).update((a.tx, a.rx))
    return out


def circuits_of(switches, ports):
    return {s: {i: o for i, o in switches[s].c.items() if i in p or o in p}
            for s, p in ports.items()}


def test_jobs_get_whole_servers_of_one_pod_and_keep_out_of_each_others_ports(rack):
    layout, switches, agent = rack
    a = agent.admit(plan("a", 2))
    b = agent.admit(plan("b", 4))
    servers = {layout.servers[g] for g in a.values()}, {layout.servers[g] for g in b.values()}
    assert len(servers[0]) == 2 and len(servers[1]) == 4 and not servers[0] & servers[1]
    for gpus in (a.values(), b.values()):          # each job in one pod (one set of switches)
        assert len({frozenset(ports_of(layout, [g])) for g in gpus}) == 8
        assert len({s.split("-")[1] for g in gpus for s in ports_of(layout, [g])}) == 1
    with pytest.raises(AgentError, match="name one"):
        agent.on_phase("pp", 0)
    agent.on_phase("pp", 0, job="b")
    b_ports = ports_of(layout, b.values())
    b_before = circuits_of(switches, b_ports)
    assert any(b_before.values())
    for sw in switches.values():
        sw.touched.clear()
    # job a switches phases and loses a GPU: b's circuits stay as they were, port for port
    agent.on_phase("pp", 0, job="a")
    agent.on_phase("dp", 0, job="a")
    victim = a[9]
    out = agent.on_health({"gpu": victim, "state": "failed", "reasons": ["test"]})
    assert out is not None and victim in out.swaps
    assert circuits_of(switches, b_ports) == b_before
    for s, ports in b_ports.items():
        assert not switches[s].touched & ports, f"{s}: job b's ports were written"
    assert agent.jobs["b"].rank_map == b


def test_a_failure_with_no_spare_left_degrades_only_the_job_it_hits(rack):
    """Both jobs in one pod (best fit), which has one free server and one spare server: job
    a's first two failures take them (the failed GPU's server moves: its GPUs share a
    scale-up fabric), the third finds no spare that reaches its peers and stops job a (it
    cannot run on 31 ranks); job b keeps its GPUs and its circuits throughout."""
    layout, switches, agent = rack
    a = agent.admit(plan("a", 4))
    b = agent.admit(plan("b", 2))
    assert len({s.split("-")[1] for g in [*a.values(), *b.values()]
                for s in ports_of(layout, [g])}) == 1
    agent.on_phase("dp", 0, job="b")
    b_ports = ports_of(layout, b.values())
    b_before = circuits_of(switches, b_ports)
    outcomes = []
    for rank in (9, 17, 25):           # the pod's free server and its spare, then nothing
        outcomes.append(agent.on_health({"gpu": agent.jobs["a"].rank_map[rank],
                                         "state": "failed", "reasons": ["test"]}))
    assert [len(o.swaps) for o in outcomes[:2]] == [8, 8]
    assert not any(o.stopped for o in outcomes[:2]) and outcomes[2].stopped
    assert any("job 'a'" in e.cause and "stopped" in e.cause
               for e in agent.journal.entries(kinds=("alarm",)))
    assert agent.jobs["b"].rank_map == b
    assert circuits_of(switches, b_ports) == b_before


def test_released_jobs_free_their_servers_for_the_next(rack):
    layout, switches, agent = rack
    a = agent.admit(plan("a", 4))
    freed = agent.release("a")
    assert sorted(freed.values()) == sorted(a.values())
    assert not any(switches[s].c for s in switches)                # its circuits are down
    again = agent.admit(plan("c", 7))                               # a whole pod's workers
    assert len(again) == 56
    with pytest.raises(AgentError, match="whole free servers in one pod"):
        agent.admit(plan("d", 8))                                   # no pod has 8 free


def test_best_fit_leaves_room_that_first_fit_fragments(tmp_path):
    """Two pods of 7 working servers, one with 3 free and one with 7 (after a job left): a
    1-server job goes to the emptier pod by first fit (the first that fits), to the fuller by
    best fit; then a 7-server job finds a whole pod by best fit only."""
    results = {}
    for policy in ("first-fit", "best-fit"):
        layout = rail_rack("pods", 16, rails=8, spare_servers=1, pod=8)
        switches = {s: Switch(s, n) for s, n in layout.switches.items()}
        with SqliteJournal(tmp_path / f"{policy}.db") as journal:
            agent = Agent(layout, switches, journal, lambda s, p: -3.0,
                          config=AgentConfig(allocation=policy))
            agent.admit(plan("x", 4))                   # pod 0: 3 free, pod 1: 7 free
            agent.admit(plan("z", 4))                   # pod 1: 3 free
            agent.release("x")                          # pod 0: 7 free, pod 1: 3 free
            agent.admit(plan("small", 1))
            try:
                agent.admit(plan("whole-pod", 7))
                results[policy] = "placed"
            except AgentError:
                results[policy] = "refused"
    assert results == {"first-fit": "refused", "best-fit": "placed"}


def test_a_job_speaks_for_its_own_links_only(tmp_path):
    """A job's failure report naming another job's dark link is no reason to probe that link:
    the loopback test would move the other job's circuits (and spend its eviction budget)."""
    layout = rail_rack("pods", 16, rails=8, spare_servers=1, pod=8)
    switches = {s: Switch(s, n) for s, n in layout.switches.items()}
    dark: set[tuple[str, int]] = set()
    with SqliteJournal(tmp_path / "j.db") as journal:
        agent = Agent(layout, switches, journal,
                      lambda s, p: -40.0 if (s, p) in dark else -3.0,
                      config=AgentConfig(quarantine_s=1e9))
        a = agent.admit(plan("a", 2))
        b = agent.admit(plan("b", 2))
        agent.on_phase("pp", 0, job="b")              # b's pipeline: rank 0 -> rank 8
        src, dst = b[0], b[8]
        att = layout.gpus[dst][0]
        dark.add((att.switch, att.rx))                # b's link is dark (b has not said so)
        b_ports = ports_of(layout, b.values())
        before = circuits_of(switches, b_ports)
        for s in switches.values():
            s.touched.clear()
        agent.on_job_failure("a's report", links=[[src, dst]], job="a")
        assert all(not (switches[s].touched & p) for s, p in b_ports.items())
        assert circuits_of(switches, b_ports) == before
        assert agent.jobs["b"].rank_map == b and agent.jobs["a"].rank_map == a
        assert not [e for e in journal.entries(kinds=["diagnosis"])]
        assert any("not its to report" in e.cause for e in journal.entries(kinds=["note"]))
        # b's own report of the same link is diagnosed (its receiver is dark: b's GPU blamed)
        agent.on_job_failure("b's report", links=[[src, dst]], job="b")
        assert journal.entries(kinds=["diagnosis"])


def test_a_refused_readmission_leaves_the_job_as_it_was(rack):
    """Admitting a job again under its name takes it on afresh only if the new admission
    is accepted: a refused one changes nothing (its GPUs, its circuits, the journal)."""
    layout, switches, agent = rack
    agent.admit(plan("a", 2))
    b = agent.admit(plan("b", 2))
    free, circuits = len(agent.pool.free()), {s: dict(sw.c) for s, sw in switches.items()}
    with pytest.raises(AgentError, match="whole free servers"):
        agent.admit(plan("b", 12))                    # more servers than a pod has
    with pytest.raises(AgentError, match="ranks 0..7"):
        agent.admit(plan("b", 1), rank_map={r * 2: g for r, g in
                                             enumerate(list(b.values())[:8])})
    assert agent.jobs["b"].rank_map == b and len(agent.pool.free()) == free
    assert {s: sw.c for s, sw in switches.items()} == circuits
    # an accepted one replaces it (its old servers may be reused)
    b3 = agent.admit(plan("b", 3))
    assert len(b3) == 24 and len(agent.pool.free()) == free - 8
    assert set(agent.jobs) == {"a", "b"}


def test_a_plan_bigger_than_the_rack_is_refused_before_its_links_are_worked_out():
    """An all-to-all of 20,000 ranks costs the agent hours to work out: refused first."""
    from photonic_testbed.common.jobplan import PlanError
    huge = {"name": "e", "world": 20000, "phases": [{"name": "p", "pattern": "all_to_all"}]}
    with pytest.raises(PlanError, match="wants 20000 ranks; at most 128"):
        JobPlan.from_dict(huge, max_world=128)
    many = {"name": "e", "world": 8, "phases": [{"name": f"p{k}", "pattern": "ring"}
                                                for k in range(1000)]}
    with pytest.raises(PlanError, match="at most 64"):
        JobPlan.from_dict(many)
    with pytest.raises(PlanError, match="not a job plan"):
        JobPlan.from_dict({"name": "e", "world": "eight", "phases": []})
