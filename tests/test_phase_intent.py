"""The phase in force is journaled before the grant (`PhaseIntent`, durable with the phase's
intended circuits, in the same sync), so that an agent killed at any point names the phase the
job was last granted exactly. Before, the phase's entry followed the grant and a restarted agent
took the first phase whose circuits were all on the switches: a pipeline's circuits are a subset
of a ring's, and a phase without circuits always matches (both tests of that failed then)."""
from __future__ import annotations

import pytest
from agent_events import Heard
from optics_doubles import PermutationSwitch

from photonic_testbed.common.jobplan import JobPlan, PhaseSpec
from photonic_testbed.common.rack_layout import RackLayout, lumion, rail_rack
from photonic_testbed.hil.agent import Agent
from photonic_testbed.hil.agent.entries import PhaseIntent
from photonic_testbed.hil.agent.sqlite_journal import SqliteJournal


class Killed(BaseException):
    """The agent process dies here (kill -9): nothing after this line runs."""


class KilledAtGrant(Heard):
    """The agent dies the moment it has granted a phase: the job has its grant, the agent
    has done nothing after it."""

    def on_grant(self, phase: str, round: int) -> None:
        super().on_grant(phase, round)
        raise Killed()


def pipeline_and_ring() -> tuple[RackLayout, JobPlan]:
    """Lumion's chip: a pipeline (0 -> 1 -> ... -> 7) whose circuits are all in the ring's."""
    return lumion(), JobPlan("pp-dp", 8, (PhaseSpec("pp", "chain"), PhaseSpec("dp", "ring")))


def a_phase_without_circuits() -> tuple[RackLayout, JobPlan]:
    """Two servers on two rails: TP inside each server (no OCS circuit), DP across them."""
    return rail_rack("rails", 3, rails=2), JobPlan("tp-dp", 4, (
        PhaseSpec("tp", "ring", group=2, stride=1), PhaseSpec("dp", "ring", group=2, stride=2)))


def _agent(layout: RackLayout, journal: SqliteJournal, switches: dict, events=None) -> Agent:
    return Agent(layout, switches, journal, lambda switch, port: 0.0, events=events)


@pytest.mark.parametrize("rack", [pipeline_and_ring, a_phase_without_circuits])
def test_an_agent_killed_at_a_grant_names_the_phase_it_granted(tmp_path, rack):
    layout, plan = rack()
    switches = {s: PermutationSwitch(s, n) for s, n in layout.switches.items()}
    keys = plan.sequence()
    for k, granted in enumerate(keys):          # each phase, from the one before it
        path = tmp_path / f"j{k}.db"
        journal = SqliteJournal(path)
        agent = _agent(layout, journal, switches)
        agent.start()
        agent.admit(plan, job="j")
        agent.on_phase(*keys[k - 1], job="j")
        heard = KilledAtGrant()
        agent.events = heard
        with pytest.raises(Killed):
            agent.on_phase(*granted, job="j")
        assert heard.grants == [granted]
        journal.close()                       # (what a kill leaves: what was synced)
        journal = SqliteJournal(path)
        again = _agent(layout, journal, switches)
        again.start()
        assert again.job("j").phase == granted, f"granted {granted} after {keys[k - 1]}"
        journal.close()


def test_a_phase_set_up_ahead_is_named_with_it_after_a_kill(tmp_path):
    """The next phase set up while the job computes is the job's, `ready`, as the agent before
    the kill published it; a phase asked for later is named alike."""
    layout, plan = pipeline_and_ring()
    (name, n), = layout.switches.items()
    switch = PermutationSwitch(name, n)
    journal = SqliteJournal(tmp_path / "j.db")
    agent = _agent(layout, journal, {name: switch})
    agent.start()
    agent.admit(plan, job="j")
    agent.on_phase("pp", 0, job="j")
    switch.after_apply.append(lambda circuits: (_ for _ in ()).throw(Killed()))
    with pytest.raises(Killed):                 # moved, then died
        agent.on_phase_done("pp", 0, job="j")
    switch.after_apply.clear()
    journal.close()
    journal = SqliteJournal(tmp_path / "j.db")
    again = _agent(layout, journal, {name: switch})
    again.start()
    job = again.job("j")
    assert (job.phase, job.ready) == (("dp", 0), ("dp", 0))
    moves = switch.moves
    again.on_phase("dp", 0, job="j")            # the job asks: nothing moves, granted
    assert switch.moves == moves and again.job("j").ready is None
    journal.close()


class Syncs:
    """A journal that counts the writes it makes durable (each a disk sync)."""

    def __init__(self, journal: SqliteJournal):
        self.journal = journal
        self.synced: list[str] = []

    def __getattr__(self, name: str):
        return getattr(self.journal, name)

    def record(self, details, cause="", latency_s=None, ts=None, *, defer=False) -> int:
        if not defer:
            self.synced.append(f"{details.kind} {type(details).__name__}")
        return self.journal.record(details, cause, latency_s, ts, defer=defer)

    def set_intended_many(self, switches, cause, *, event=True) -> int:
        self.synced.append("intended")
        return self.journal.set_intended_many(switches, cause, event=event)

    def flush(self) -> None:
        self.synced.append("flush")
        self.journal.flush()


def test_the_phase_rides_the_sync_its_intended_circuits_pay_for(tmp_path):
    layout, plan = pipeline_and_ring()
    (name, n), = layout.switches.items()
    journal = Syncs(SqliteJournal(tmp_path / "j.db"))
    agent = _agent(layout, journal, {name: PermutationSwitch(name, n)})   # type: ignore[arg-type]
    agent.admit(plan, job="j")
    journal.synced.clear()
    agent.on_phase("dp", 0, job="j")            # the ring's closing circuit moves
    assert journal.synced == ["intended"]       # one sync before the grant, the phase in it
    decided = [e.details for e in journal.journal.entries(kinds=("decision",))]
    assert PhaseIntent(job="j", phase="dp", round=0) in decided
    journal.synced.clear()
    agent.on_phase("dp", 0, job="j")            # the same phase again: nothing to write
    assert journal.synced == []
    journal.journal.close()
