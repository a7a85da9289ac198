"""The agent on an emulated rack: spare swap, phase rails, all-to-all, reconcile, journal.

The switches are in-process doubles (a permutation with loss); the rack's optics decide
whether a link is up, and the agent verifies its circuits by reading light off the rack."""
from __future__ import annotations

from dataclasses import dataclass

import pytest
from agent_events import Heard
from optics_doubles import PermutationSwitch

from photonic_testbed.common.jobplan import JobPlan, PhaseSpec, dp_ring, dp_tp
from photonic_testbed.common.rack_layout import lumion, opus
from photonic_testbed.emulator.clock import SimClock
from photonic_testbed.emulator.job import TrainingJob
from photonic_testbed.emulator.rack import EmulatedRack
from photonic_testbed.hil.agent import Agent, AgentError, policies
from photonic_testbed.hil.agent.config import AgentConfig
from photonic_testbed.hil.agent.sqlite_journal import SqliteJournal


class Killed(BaseException):
    """The agent process dies here (kill -9): nothing after this line runs."""


@dataclass
class World:
    clock: SimClock
    switch: PermutationSwitch
    rack: EmulatedRack
    journal: SqliteJournal
    agent: Agent
    heard: Heard
    job: TrainingJob | None = None


def make_world(tmp_path, layout, plan=None, latency_s=0.0, seed=0, name="j.db", loss_db=None,
               **settings):
    """The rack, its switch, the agent (`settings`: its AgentConfig's) and the job of `plan`."""
    clock = SimClock()
    (sname, n), = layout.switches.items()
    sw = PermutationSwitch(sname, n, clock=clock, latency_s=latency_s, seed=seed)
    rack = EmulatedRack(layout, {sname: sw}, clock)
    journal = SqliteJournal(tmp_path / name)
    heard = Heard()
    agent = Agent(layout, {sname: sw}, journal, rack.port_power_dbm, clock=clock.now,
                  config=AgentConfig(**settings), events=heard, loss_db=loss_db)
    w = World(clock, sw, rack, journal, agent, heard)
    if plan is not None:
        connect(w, plan)
    return w


def connect(w: World, plan: JobPlan, **job_kw) -> TrainingJob:
    rank_map = w.agent.admit(plan)
    job = TrainingJob(plan, rank_map, w.rack, w.clock, **job_kw)
    w.heard.job = job
    job.subscribe(w.agent.on_job_event)
    w.rack.subscribe(w.agent.on_health)
    w.clock.on_tick(w.rack.poll)
    w.job = job
    return job


def fail_at_step(w: World, step: int, *gpus: str, **kw) -> None:
    done = []

    def on(ev):
        if ev.kind == "step" and ev.step == step and not done:
            done.append(step)
            for g in gpus:
                w.rack.faults.fail_gpu(g, **kw)
    w.job.subscribe(on)


def ring_is_up(w: World) -> bool:
    m = w.job.rank_map
    n = len(m)
    return all(w.rack.link(m[r], m[(r + 1) % n]).up for r in range(n))


@pytest.mark.parametrize("failed", [f"gpu{i}" for i in range(8)])
def test_any_one_gpu_failure_resumes_on_a_spare(tmp_path, failed):
    w = make_world(tmp_path, lumion(), dp_ring(8, compute_s=0.05), latency_s=1e-5,
                   loss_db=None)
    fail_at_step(w, 5, failed)
    assert w.job.run(20) == "done"
    assert failed not in w.job.rank_map.values()
    spare = w.job.rank_map[int(failed[3:])]
    assert spare in ("spare0", "spare1") and w.job.restarts == 1
    assert ring_is_up(w)                                  # by the rack's physics
    assert all(c.all_up for c in w.job.communications)
    kinds = [e.kind for e in w.journal.entries()]
    for k in ("detected", "decision", "applied", "verified", "rank_map", "restart"):
        assert k in kinds
    restart = w.journal.entries(kinds=("restart",))[-1]
    assert restart.details.rank_map[int(failed[3:])] == spare
    applied = w.journal.entries(kinds=("applied",))
    assert all(e.latency_s is not None for e in applied)


def test_spare_with_lowest_loss_wins(tmp_path):
    chosen = {}
    for with_loss in (False, True):
        w = make_world(tmp_path, lumion(), dp_ring(8), seed=5, name=f"{with_loss}.db")
        w.switch.loss_db.update({9: 2.5, 10: 0.7})        # spare1's TX is the better path
        if with_loss:
            w.agent.failover.loss_db = lambda s, i, o, sw=w.switch: sw.path_loss_db(i, o)
        w.rack.faults.fail_gpu("gpu4")
        out = w.agent.on_health(w.rack.gpu_health("gpu4"))
        chosen[with_loss] = out.swaps["gpu4"]
        # either spare costs the same on a permutation switch: 2 circuits out, 2 in
        assert policies.changes(w.switch.history[-2], w.switch.history[-1]) == 4
    assert chosen == {False: "spare0", True: "spare1"}


def test_two_simultaneous_failures(tmp_path):
    w = make_world(tmp_path, lumion(), dp_ring(8, compute_s=0.05))
    fail_at_step(w, 3, "gpu2", "gpu3")
    assert w.job.run(15) == "done"
    assert {w.job.rank_map[2], w.job.rank_map[3]} == {"spare0", "spare1"}
    assert ring_is_up(w) and all(c.all_up for c in w.job.communications)


def test_two_failures_reported_together_are_one_swap(tmp_path):
    w = make_world(tmp_path, lumion(), dp_ring(8))
    for g in ("gpu1", "gpu6"):
        w.rack.faults.fail_gpu(g)
    before = w.switch.applies
    out = w.agent.on_health(w.rack.gpu_health("gpu1"), w.rack.gpu_health("gpu6"))
    assert out.swaps == {"gpu1": "spare0", "gpu6": "spare1"} and w.switch.applies == before + 1
    w.job.run(1)
    assert ring_is_up(w)


def test_spares_exhausted_raises_alarm_and_runs_degraded(tmp_path):
    w = make_world(tmp_path, lumion(), dp_ring(8, compute_s=0.05))
    alarms = w.heard.alarms
    fail_at_step(w, 2, "gpu1", "gpu4", "gpu6")
    assert w.job.run(12) == "done"
    assert len(w.job.rank_map) == 7 and alarms and "no healthy spare" in alarms[0]
    assert not {"gpu1", "gpu4", "gpu6"} & set(w.job.rank_map.values())
    assert ring_is_up(w) and all(c.all_up for c in w.job.communications)
    assert w.journal.entries(kinds=("alarm",))


def test_spares_exhausted_and_job_cannot_shrink_stops_it(tmp_path):
    w = make_world(tmp_path, lumion(), dp_tp(8, compute_s=0.01))
    alarms = w.heard.alarms
    w.job.restart_timeout_s = 0.5
    fail_at_step(w, 2, "gpu1", "gpu4", "gpu6")
    assert w.job.run(12) == "aborted"
    assert any("job stopped" in a for a in alarms)


def test_an_operator_swap_replaces_the_gpu_and_keeps_it_out_for_the_quarantine(tmp_path):
    w = make_world(tmp_path, lumion(), dp_ring(8), quarantine_s=30.0)
    with pytest.raises(AgentError, match="no GPU 'gpu99' in the rack"):
        w.agent.swap_out("gpu99")
    with pytest.raises(AgentError, match="spare1 holds no rank"):
        w.agent.swap_out("spare1")
    out = w.agent.swap_out("gpu2")
    assert out.swaps == {"gpu2": "spare0"} and w.heard.restarts[-1][2] == "spare0"
    assert w.agent.health("gpu2") == "ok" and "gpu2" not in w.agent.spares()
    w.clock.sleep(31.0)
    assert "gpu2" in w.agent.spares()
    assert w.journal.entries(kinds=("detected",))[-1].cause == "operator asked to swap gpu2 out"


def test_spare_failing_during_swap_falls_back_to_the_next(tmp_path):
    w = make_world(tmp_path, lumion(), dp_ring(8, compute_s=0.05))
    hit = []

    def spare_dies(circuits):
        if 9 in circuits and not hit:                    # spare0's TX just got a circuit
            hit.append(w.rack.faults.fail_transceiver("spare0", side="tx"))
    w.switch.after_apply.append(spare_dies)
    outcomes = w.heard.restarts
    fail_at_step(w, 4, "gpu5")
    assert w.job.run(15) == "done"
    assert hit and w.job.rank_map[5] == "spare1" and len(outcomes) == 1
    assert w.journal.entries(kinds=("verify_failed",))
    assert ring_is_up(w) and all(c.all_up for c in w.job.communications)
    assert "spare0" not in w.agent.spares()


@pytest.mark.parametrize("where", ["before_apply", "after_apply"])
def test_agent_killed_mid_swap_restarts_correctly_without_extra_moves(tmp_path, where):
    # reference: the same failure without a kill
    ref = make_world(tmp_path, lumion(), dp_ring(8), name="ref.db")
    ref.rack.faults.fail_gpu("gpu3")
    ref.agent.on_health(ref.rack.gpu_health("gpu3"))
    ref_moves, ref_state = ref.switch.moves, ref.switch.circuits()

    w = make_world(tmp_path, lumion(), dp_ring(8))
    hooks = getattr(w.switch, where)

    def die(circuits):
        hooks.clear()
        raise Killed()
    hooks.append(die)
    w.rack.faults.fail_gpu("gpu3")
    with pytest.raises(Killed):
        w.agent.on_health(w.rack.gpu_health("gpu3"))
    assert w.job.restarts == 0
    # a new agent process: same journal file, same switch, no memory
    w.job.unsubscribe(w.agent.on_job_event)
    w.rack.unsubscribe(w.agent.on_health)
    w.journal.close()
    journal = SqliteJournal(tmp_path / "j.db")
    agent = Agent(lumion(), {"chip": w.switch}, journal, w.rack.port_power_dbm, clock=w.clock.now,
                  events=Heard(w.job))
    out = agent.start()
    assert out is not None and agent.rank_map[3] == "spare0"
    assert w.switch.moves == ref_moves and w.switch.circuits() == ref_state
    w.job.subscribe(agent.on_job_event)
    assert w.job.run(3) == "done" and w.job.rank_map[3] == "spare0" and ring_is_up(w)
    assert agent.start() is None and w.switch.moves == ref_moves   # nothing left to do
    journal.close()


def test_agent_killed_just_after_a_phase_switch_knows_the_phase_and_moves_nothing(tmp_path):
    w = make_world(tmp_path, opus(), dp_tp(8, compute_s=0.01))
    first, second = list(w.agent.job().circuits.targets)[:2]
    assert w.agent.phase == first
    w.switch.after_apply.append(lambda circuits: (_ for _ in ()).throw(Killed()))
    with pytest.raises(Killed):                 # moved, then died before its phase entry
        w.agent.on_phase(*second)
    moves, state = w.switch.moves, w.switch.circuits()
    w.journal.close()
    journal = SqliteJournal(tmp_path / "j.db")
    # the admission's entry for its first phase alone: the second's never came
    assert [e.details.phase for e in journal.entries(kinds=("phase",))] == [first[0]]
    w.switch.after_apply.clear()
    agent = Agent(opus(), {"ocs": w.switch}, journal, w.rack.port_power_dbm, clock=w.clock.now)
    agent.start()
    assert agent.phase == second                # from the intended circuits
    assert w.switch.moves == moves and w.switch.circuits() == state
    agent.on_phase(*second)                     # the job asks again: nothing to move
    assert w.switch.moves == moves
    journal.close()


def test_reconcile_repairs_only_the_difference(tmp_path):
    w = make_world(tmp_path, lumion(), dp_ring(8))
    good = w.switch.circuits()
    bad = dict(good)
    bad[1], bad[2] = good[2], good[1]                     # someone swapped two circuits by hand
    del bad[8]
    w.switch.apply(bad)
    moves = w.switch.moves
    assert w.agent.reconcile() == {"chip": policies.changes(bad, good)}
    assert w.switch.circuits() == good and w.switch.moves - moves == policies.changes(bad, good)
    assert w.agent.reconcile() == {"chip": 0} and w.switch.moves - moves == 5


def test_opus_dp_tp_run_reconfigures_every_boundary_and_never_uses_a_down_link(tmp_path):
    w = make_world(tmp_path, opus(), dp_tp(8, compute_s=0.01), latency_s=0.025)
    assert w.job.run(100) == "done"
    phases = [e for e in w.job.log if e.kind == "phase"]
    assert len(phases) == 200
    # every boundary changed the circuits, and every circuit set was what the phase needs
    assert w.switch.applies == 200
    assert len({tuple(sorted(h.items())) for h in w.switch.history}) == 2
    assert not [e for e in w.job.log if e.kind == "stall"]
    assert len(w.job.communications) == 200 and all(c.all_up for c in w.job.communications)
    # the waiting is the OCS latency; the journal holds each phase with its latency
    assert sum(r.wait_s for r in w.job.records) == pytest.approx(199 * 0.025)
    # (the first phase's circuits were set at admission, journaled as its entry: its event
    # moves nothing and adds none; every later boundary moves circuits and is journaled)
    assert len(w.journal.entries(kinds=("phase",))) == 1 + 199


def test_without_the_agent_the_job_would_stall(tmp_path):
    # the check above can fail: the same job with no one switching rails stalls and fails
    w = make_world(tmp_path, opus())
    rank_map = w.agent.admit(dp_tp(8, compute_s=0.01))
    job = TrainingJob(dp_tp(8, compute_s=0.01), rank_map, w.rack, w.clock, gated=False,
                      link_timeout_s=0.01, restart_timeout_s=0.01)
    assert job.run(3) == "aborted"
    assert [e for e in job.log if e.kind == "stall"]


def test_all_to_all_cycles_through_matchings(tmp_path):
    plan = JobPlan("moe", 8, (PhaseSpec("ep", "all_to_all", bytes=1e8, compute_s=0.001),))
    w = make_world(tmp_path, opus(), plan, latency_s=0.025)
    assert w.job.run(2) == "done"
    rounds = [(e.phase, e.round) for e in w.job.log if e.kind == "phase"]
    assert rounds == [("ep", r) for r in range(7)] * 2
    pairs = set()
    for state in w.switch.history[:7]:
        for i, o in state.items():
            a, b = sorted((f"server{i - 1}", f"server{o - 33}"))
            pairs.add((a, b))
            assert state.get(o - 32) == i + 32           # each matching is both ways
    assert len(pairs) == 28                                # everyone met everyone once
    assert all(c.all_up for c in w.job.communications)


def test_prestage_hands_the_next_phase_to_switches_that_can(tmp_path):
    w = make_world(tmp_path, opus(), dp_tp(8), prestage=True)
    staged = []
    w.switch.prestage = staged.append
    w.agent.on_phase("tp", 0)
    assert staged == [w.agent.job().circuits.targets[("dp", 0)]["ocs"]]
    assert w.journal.entries(kinds=("phase",))[-1].details.prestaged == ["ocs"]


def test_flapping_gpu_is_swapped_and_kept_out_of_the_pool(tmp_path):
    w = make_world(tmp_path, lumion(), dp_ring(8, compute_s=0.05))
    fail_at_step(w, 2, "gpu2", mode="flapping", period_s=0.2)
    assert w.job.run(20) == "done"
    assert w.job.rank_map[2] == "spare0" and w.rack.gpu_state("gpu2") in ("ok", "failed")
    assert "gpu2" not in w.agent.spares()                 # quarantined
    assert w.job.restarts == 1


def test_job_reported_dark_link_swaps_the_silent_gpu(tmp_path):
    w = make_world(tmp_path, lumion(), dp_ring(8, compute_s=0.01))
    w.job.link_timeout_s = 0.02
    done = []

    def on(ev):
        if ev.kind == "step" and ev.step == 3 and not done:
            done.append(w.rack.faults.cut_fibre("chip", 6))     # gpu5's TX fibre
    w.job.subscribe(on)
    assert w.job.run(10) == "done"
    assert w.job.rank_map[5] == "spare0" and ring_is_up(w)


def test_bad_requests_get_clear_errors(tmp_path):
    w = make_world(tmp_path, lumion())
    with pytest.raises(AgentError, match="no job admitted"):
        w.agent.on_phase("dp")
    with pytest.raises(AgentError, match="needs 12 GPUs"):
        w.agent.admit(dp_ring(12))
    w.agent.admit(dp_ring(8))
    with pytest.raises(AgentError, match="no phase 'tp'"):
        w.agent.on_phase("tp")
    with pytest.raises(AgentError, match="no CircuitSwitch"):
        Agent(lumion(), {}, w.journal, w.rack.port_power_dbm)
    with pytest.raises(AgentError, match="named for two ranks"):
        w.agent.admit(dp_ring(8), {r: "gpu0" if r < 2 else f"gpu{r}" for r in range(8)})
    assert w.agent.on_health(w.rack.gpu_health("spare1")) is None


def test_wall_clock_threads_failover(tmp_path):
    """The demo's arrangement: the job in its thread, the rack polling health in another."""
    from photonic_testbed.emulator.clock import WallClock
    clock = WallClock()
    sw = PermutationSwitch("chip", 16)
    rack = EmulatedRack(lumion(), {"chip": sw}, clock)
    with SqliteJournal(tmp_path / "j.db") as journal:
        agent = Agent(lumion(), {"chip": sw}, journal, rack.port_power_dbm)
        plan = dp_ring(8, bytes=1e6, compute_s=0.002)
        job = TrainingJob(plan, agent.admit(plan), rack, clock, restart_s=0.01,
                          checkpoint_every=2, link_timeout_s=5.0, grant_timeout_s=5.0)
        agent.events = Heard(job)
        job.subscribe(agent.on_job_event)
        rack.subscribe(agent.on_health)
        job.subscribe(lambda ev: ev.kind == "step" and ev.step == 3 and job.restarts == 0
                      and not rack.faults.gpus and rack.faults.fail_gpu("gpu6"))
        rack.start_monitor(0.002)
        try:
            job.start(10)
            job.join(timeout=30)
        finally:
            job.close()
            rack.close()
        assert job.state == "done" and job.rank_map[6] == "spare0" and job.restarts == 1
        assert all(c.all_up for c in job.communications)


def test_verified_phases_withhold_the_grant_from_dark_circuits(tmp_path):
    w = make_world(tmp_path, opus(), verify_phases=True)
    alarms, grants = w.heard.alarms, w.heard.grants
    w.agent.admit(dp_tp(8))
    w.agent.on_phase("dp", 0)
    assert grants == [("dp", 0)] and w.journal.entries(kinds=("verified",))
    w.rack.faults.cut_fibre("ocs", 35)                   # server2's RX fibre
    w.agent.on_phase("tp", 0)
    assert grants == [("dp", 0)] and "do not verify" in alarms[-1]
    dark = w.journal.entries(kinds=("verify_failed",))[-1].details.dark
    assert dark == [("ocs", 4, 35)]


def test_throughput_drops_during_failover(tmp_path):
    w = make_world(tmp_path, lumion(), dp_ring(8, compute_s=0.05), latency_s=0.001)
    w.job.restart_s = 1.0
    fail_at_step(w, 10, "gpu1")
    w.job.run(30)
    t_fail = next(e.t for e in w.job.log if e.kind == "failure")
    t_back = next(e.t for e in w.job.log if e.kind == "restarted")
    before = w.job.throughput(0.0, t_fail + 1e-9)
    during = w.job.throughput(t_fail + 1e-9, t_back)
    after = w.job.throughput(t_back, w.job.records[-1].t_end + 1e-9)
    assert during == 0.0 and before == pytest.approx(after, rel=0.05) and before > 10


def test_health_reports_as_dicts_from_the_bus(tmp_path):
    w = make_world(tmp_path, lumion(), dp_ring(8))
    w.rack.faults.fail_gpu("gpu2")
    out = w.agent.on_health(w.rack.gpu_health("gpu2").to_dict())
    assert out.swaps == {"gpu2": "spare0"}
    with pytest.raises(AgentError, match="not a GPU health report"):
        w.agent.on_health({"gpu": "gpu1", "colour": "red"})


def test_a_cut_receive_fibre_evicts_only_the_gpu_that_cannot_hear(tmp_path):
    """gpu3's receive fibre is cut: the link gpu2 -> gpu3 goes dark. The loopback test finds
    gpu2 hears itself and gpu3 does not: gpu3 alone is replaced, no spare is rejected."""
    w = make_world(tmp_path, lumion(), dp_ring(8, compute_s=0.01))
    w.job.link_timeout_s = 0.02
    done = []

    def on(ev):
        if ev.kind == "step" and ev.step == 3 and not done:
            done.append(w.rack.faults.cut_fibre("chip", 17 + 3))     # gpu3's RX fibre
    w.job.subscribe(on)
    assert w.job.run(12) == "done"
    assert done and w.job.restarts == 1
    assert set(w.job.rank_map.values()) - {f"gpu{i}" for i in range(8)} == {"spare0"}
    assert w.job.rank_map[3] == "spare0" and ring_is_up(w)
    assert not w.agent.pool.rejected()
    diagnosis = w.journal.entries(kinds=("diagnosis",))
    assert diagnosis and diagnosis[0].details.loopback["gpu3"] is False
    assert diagnosis[0].details.loopback["gpu2"] is True


def test_circuits_changed_behind_the_agents_back_are_repaired_without_evictions(tmp_path):
    """Someone removes the ring's circuits on the switch itself: the job's links go down, the
    agent compares its belief with the switch, repairs the difference, and restarts the job
    on the same GPUs."""
    w = make_world(tmp_path, lumion(), dp_ring(8, compute_s=0.01))
    w.job.link_timeout_s = 0.02
    done = []

    def on(ev):
        if ev.kind == "step" and ev.step == 3 and not done:
            done.append(w.switch.apply({1: 18}))       # two inputs' worth of ring gone
    w.job.subscribe(on)
    before = dict(w.job.rank_map)
    assert w.job.run(10) == "done"
    assert done and w.job.rank_map == before and w.job.restarts == 1
    assert ring_is_up(w)
    reconciled = [e.details.moves for e in w.journal.entries(kinds=("reconcile",))
                  if e.details.moves]
    assert reconciled and reconciled[-1]["chip"] > 0
    restart = w.journal.entries(kinds=("restart",))[-1]
    assert "restart on the same GPUs" in restart.cause


def test_a_switch_that_passes_no_light_evicts_nobody(tmp_path):
    """Every receiver dark (the switch dead): the loopback test blames no GPU (an idle spare,
    the control, is deaf too), an alarm calls a person, the rank map is unchanged."""
    w = make_world(tmp_path, lumion(), dp_ring(8, compute_s=0.01))
    before = dict(w.agent.rank_map)
    for port in range(17, 33):
        w.rack.faults.cut_fibre("chip", port)            # every output fibre
    out = w.agent.on_job_failure("links down", links=[("gpu2", "gpu3"), ("gpu4", "gpu5")])
    assert out is None and w.agent.rank_map == before and not w.agent.pool.rejected()
    alarms = [e.cause for e in w.journal.entries(kinds=("alarm",))]
    assert any("nobody is evicted" in a for a in alarms)


@pytest.mark.parametrize("per_window", [AgentConfig().diagnosed_per_window, 1])
def test_evictions_on_diagnosis_are_bounded(tmp_path, per_window):
    """Receivers going deaf one after another: past the bound per window (the default, or as
    set), nobody more is evicted and a person is called (no cascade through the rack)."""
    w = make_world(tmp_path, lumion(), dp_ring(6), quarantine_s=1e9,
                   diagnosed_per_window=per_window)
    evicted = []
    for k in range(per_window + 2):
        victim = w.agent.rank_map[k % 6]
        peer = w.agent.rank_map[(k - 1) % 6]
        rx = w.agent.layout.gpus[victim][0].rx
        w.rack.faults.cut_fibre("chip", rx)
        out = w.agent.on_job_failure("link down", links=[(peer, victim)])
        if out is not None and out.swaps:
            evicted += list(out.swaps)
    assert 0 < len(evicted) <= per_window
    assert any("a person is needed" in e.cause for e in w.journal.entries(kinds=("alarm",)))


def test_a_switch_that_refuses_and_a_job_event_that_fails_raise_alarms_not_type_errors(tmp_path):
    """The alarms' details never collide with the journal's own arguments."""
    from photonic_testbed.drivers.circuit_switch import SwitchError
    w = make_world(tmp_path, lumion(), dp_tp(8))

    def refuse(circuits):
        raise SwitchError("the switch is in local mode")
    w.switch.apply = refuse
    with pytest.raises(AgentError, match="refused the circuits"):
        w.agent.on_phase("dp", 0)
    w.agent.on_job_event({"kind": "phase", "phase": "nope", "round": 0})
    alarms = [e.cause for e in w.journal.entries(kinds=("alarm",))]
    assert any("refused the circuits" in a for a in alarms)
    assert any("cannot serve job event 'phase'" in a for a in alarms)


def test_a_rank_map_naming_a_gpu_that_cannot_take_a_rank_is_refused(tmp_path):
    """An explicit rank map is checked against what the agent knows of each GPU: a failed one,
    one that failed its circuits' verification and one still in quarantine after a failure
    are each refused by name; once the quarantine is over and the GPU reports ok, it may be
    named again."""
    from photonic_testbed.hil.gpus.health import GpuHealth
    w = make_world(tmp_path, lumion(), quarantine_s=30.0)
    ranks = {r: f"gpu{r}" for r in range(8)}
    w.agent.on_health(GpuHealth("gpu3", "failed", ("xid 79",)))
    with pytest.raises(AgentError, match=r"gpu3 has failed"):
        w.agent.admit(dp_ring(8), ranks)
    w.agent.on_health(GpuHealth("gpu3", "ok"))
    with pytest.raises(AgentError, match=r"gpu3 failed 0\.0 s ago \(in quarantine for 30 s"):
        w.agent.admit(dp_ring(8), ranks)
    w.agent.pool.reject("gpu5")            # as a failed verification leaves it
    w.clock.sleep(31.0)
    with pytest.raises(AgentError, match=r"gpu5 failed its circuits' verification") as e:
        w.agent.admit(dp_ring(8), ranks)
    assert "gpu3" not in str(e.value)
    assert w.agent.jobs == {}                # nothing was taken by the refusals
    w.agent.return_to_pool("gpu5")
    assert w.agent.admit(dp_ring(8), ranks) == ranks
