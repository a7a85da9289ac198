"""The emulated training job and the communication plans it runs."""
from __future__ import annotations

import queue
from itertools import combinations

import pytest
from hypothesis import given
from hypothesis import strategies as st
from optics_doubles import PermutationSwitch

from photonic_testbed.common.jobplan import (
    JobPlan,
    PhaseSpec,
    PlanError,
    dp_ring,
    dp_tp,
    round_robin_matchings,
)
from photonic_testbed.common.rack_layout import lumion
from photonic_testbed.emulator.clock import SimClock, WallClock
from photonic_testbed.emulator.job import JobError, TrainingJob
from photonic_testbed.emulator.rack import EmulatedRack

RING = {i: 17 + (i % 8) for i in range(1, 9)}
RANKS = {r: f"gpu{r}" for r in range(8)}


@given(st.integers(min_value=2, max_value=17))
def test_round_robin_pairs_everyone_exactly_once(n):
    rounds = round_robin_matchings(n)
    pairs = [p for r in rounds for p in r]
    assert sorted(pairs) == sorted(combinations(range(n), 2))
    for r in rounds:
        members = [x for p in r for x in p]
        assert len(members) == len(set(members))
    assert len(rounds) == (n - 1 if n % 2 == 0 else n)


def test_phase_patterns():
    plan = dp_tp(8, tp=2)
    links = plan.links()
    assert links[("tp", 0)] == [(0, 1), (1, 0), (2, 3), (3, 2), (4, 5), (5, 4), (6, 7), (7, 6)]
    assert sorted(links[("dp", 0)]) == sorted([(0, 2), (2, 4), (4, 6), (6, 0),
                                               (1, 3), (3, 5), (5, 7), (7, 1)])
    pp = PhaseSpec("pp", "chain").rounds(4)
    assert pp == [[(0, 1), (1, 2), (2, 3)]]
    ep = JobPlan("ep", 4, (PhaseSpec("ep", "all_to_all"),)).links()
    assert len(ep) == 3 and all(len(v) == 4 for v in ep.values())
    assert JobPlan.from_dict(plan.to_dict()) == plan
    assert dp_ring(8).allows(7) and not plan.allows(7) and not dp_ring(8).allows(9)
    with pytest.raises(PlanError, match="does not tile"):
        JobPlan("x", 6, (PhaseSpec("dp", "ring", group=4),))
    with pytest.raises(PlanError, match="unknown pattern"):
        PhaseSpec("x", "tree")
    with pytest.raises(PlanError, match="repeat"):
        JobPlan("x", 4, (PhaseSpec("a"), PhaseSpec("a")))
    with pytest.raises(PlanError, match="not a job plan"):
        JobPlan.from_dict({"name": "x"})


def make(plan, circuits=RING, **kw):
    clock = SimClock()
    chip = PermutationSwitch("chip", 16, loss_db={i: 1.0 for i in range(1, 17)})
    chip.apply(circuits)
    rack = EmulatedRack(lumion(), {"chip": chip}, clock)
    rack_map = {r: f"gpu{r}" for r in range(plan.world)}
    return TrainingJob(plan, rack_map, rack, clock, **kw), rack, chip


def test_step_time_is_compute_plus_communication():
    plan = dp_ring(8, bytes=1e9, compute_s=0.02)
    q: queue.Queue = queue.Queue()
    job, rack, _ = make(plan, gated=False, events=q)
    assert job.run(5) == "done"
    assert [r.step for r in job.records] == [1, 2, 3, 4, 5]
    for r in job.records:
        assert r.compute_s == pytest.approx(0.02) and r.comm_s == pytest.approx(8e9 / 400e9)
        assert r.wait_s == pytest.approx(0.0, abs=1e-12)
        assert r.t_end - r.t_start == pytest.approx(r.compute_s + r.comm_s + r.wait_s)
    assert all(c.all_up for c in job.communications)
    kinds = [q.get_nowait().kind for _ in range(q.qsize())]
    assert kinds.count("phase") == 5 and kinds[-1] == "done"


def test_slow_link_slows_the_job():
    plan = dp_ring(8, bytes=1e9, compute_s=0.0)
    job, rack, chip = make(plan, gated=False)
    chip.loss_db[3] = 10.5          # gpu2 -> gpu3 with 1.5 dB margin: half rate
    job.run(1)
    assert job.records[0].comm_s == pytest.approx(8e9 / 200e9)


def test_gated_job_waits_for_the_grant_and_fails_without_it():
    plan = dp_ring(8, compute_s=0.0)
    job, rack, _ = make(plan, grant_timeout_s=0.05, restart_timeout_s=0.1)
    job.subscribe(lambda ev: ev.kind == "phase" and ev.step < 2 and job.grant(ev.phase, ev.round))
    assert job.run(5) == "aborted"
    assert job.step == 2
    failure = next(e for e in job.log if e.kind == "failure")
    assert "not granted" in failure.details["reason"]


def test_down_link_stalls_then_fails_and_restart_resumes_from_checkpoint():
    plan = dp_ring(8, compute_s=0.01)
    job, rack, chip = make(plan, gated=False, checkpoint_every=4, link_timeout_s=0.05,
                           restart_s=0.5)
    cut = []
    def on(ev):
        if ev.kind == "step" and ev.step == 6 and not cut:
            cut.append(rack.faults.cut_fibre("chip", 4))     # gpu3's TX
        if ev.kind == "failure":
            rack.faults.clear()
            job.restart(dict(RANKS), "fibre spliced")
    job.subscribe(on)
    assert job.run(10) == "done"
    kinds = [e.kind for e in job.log]
    assert "stall" in kinds and kinds.index("stall") < kinds.index("failure")
    failure = next(e for e in job.log if e.kind == "failure")
    assert failure.details["links"] == [["gpu3", "gpu4"]] and failure.step == 6
    restarted = next(e for e in job.log if e.kind == "restarted")
    assert restarted.details["lost_steps"] == 2 and restarted.step == 4
    assert [r.step for r in job.records] == [1, 2, 3, 4, 5, 6, 5, 6, 7, 8, 9, 10]
    assert all(c.all_up for c in job.communications)


def test_failed_gpu_fails_the_job_and_bad_restarts_are_refused():
    plan = dp_ring(8, compute_s=0.01)
    job, rack, chip = make(plan, gated=False, restart_timeout_s=0.2)
    orders = [{r: "gpu0" for r in range(8)},                      # refused: one GPU, 8 ranks
              {r: ("spare0" if r == 3 else f"gpu{r}") for r in range(8)}]
    def on(ev):
        if ev.kind == "step" and ev.step == 2 and not rack.faults.gpus:
            rack.faults.fail_gpu("gpu3")
        if ev.kind in ("failure", "restart_refused") and orders:
            m = orders.pop(0)
            if m[3] == "spare0":
                chip.apply({1: 18, 2: 19, 3: 25, 9: 21, 5: 22, 6: 23, 7: 24, 8: 17})
            job.restart(m, "test")
    job.subscribe(on)
    assert job.run(4) == "done"
    assert job.rank_map[3] == "spare0" and job.restarts == 1
    reasons = [e.details["reason"] for e in job.log if e.kind in ("failure", "restart_refused")]
    assert reasons[0] == "GPU(s) gpu3 failed" and "two ranks" in reasons[1]


def test_job_refuses_bad_rank_maps():
    plan = dp_tp(8)
    with pytest.raises(JobError, match="ranks must be"):
        make(plan)[0].__class__(plan, {1: "gpu0"}, make(plan)[1])
    job, rack, _ = make(plan)
    with pytest.raises(JobError, match="not in rack"):
        TrainingJob(plan, {r: f"x{r}" for r in range(8)}, rack)
    with pytest.raises(JobError, match="two ranks"):
        TrainingJob(plan, {r: "gpu0" for r in range(8)}, rack)
    with pytest.raises(JobError, match="cannot run on 6"):
        TrainingJob(plan, {r: f"gpu{r}" for r in range(6)}, rack)


def test_wall_clock_thread_runs_and_stops():
    plan = dp_ring(8, bytes=1e6, compute_s=0.001)
    job, rack, _ = make(plan, gated=False)
    job.clock = WallClock()
    job.start(3)
    with pytest.raises(JobError, match="already running"):
        job.start(3)
    job.join(timeout=10)
    assert job.state == "done" and job.step == 3
    job.close()
    job2, _, _ = make(plan, grant_timeout_s=30.0)
    job2.clock = WallClock()
    job2.start(100)
    job2.close()                     # stops a job waiting for its grant
    assert job2.state == "stopped"


# ---- bounded history and the job's own restart records (issue 15, items 7 and 8) -------------

def _fail_every(job, rack, every: int):
    """Fail gpu3 every `every` steps done (redone ones included, so the job gets past each
    failure); each is answered by healing it and restarting on the same rank map (as an agent
    that swapped it back would)."""
    def on(ev):
        if ev.kind == "step" and job.steps_done % every == 0 and not rack.faults.gpus:
            rack.faults.fail_gpu("gpu3")
        if ev.kind == "failure":
            rack.faults.clear()
            job.restart(dict(RANKS), "healed")
    job.subscribe(on)


def test_a_long_run_with_repeated_failures_keeps_bounded_history():
    plan = dp_ring(8, compute_s=0.01)
    kept = {"records_kept": 40, "comms_kept": 30, "events_kept": 60, "restarts_kept": 4}
    job, rack, _ = make(plan, gated=False, checkpoint_every=5, **kept)
    _fail_every(job, rack, 7)
    steps = []
    job.subscribe(lambda ev: ev.kind == "step" and steps.append(ev.step))
    assert job.run(400) == "done"
    assert job.restarts > 4 * kept["restarts_kept"]                # more happened than is kept
    assert len(job.records) == kept["records_kept"]
    assert len(job.communications) == kept["comms_kept"]
    assert len(job.log) == kept["events_kept"]
    assert len(job.restart_records) == kept["restarts_kept"]
    # what is kept is the latest; the running totals count the whole run
    assert job.records[-1].step == 400 and job.log[-1].kind == "done"
    assert job.steps_done == len(steps) > 400                     # redone steps count again
    assert job.down_communications == 0


def test_default_history_is_bounded():
    from photonic_testbed.emulator import job as job_module
    plan = dp_ring(8, compute_s=0.0)
    job, _, _ = make(plan, gated=False)
    for ring, kept in ((job.records, job_module.RECORDS_KEPT),
                       (job.communications, job_module.COMMS_KEPT),
                       (job.log, job_module.EVENTS_KEPT),
                       (job.restart_records, job_module.RESTARTS_KEPT)):
        assert ring.maxlen == kept and 0 < kept <= 10_000
    with pytest.raises(JobError, match="records_kept"):
        make(plan, records_kept=0)


def test_restart_records_say_when_the_job_failed_restarted_and_resumed():
    plan = dp_ring(8, compute_s=0.01)
    job, rack, _ = make(plan, gated=False, checkpoint_every=4, restart_s=0.5)
    _fail_every(job, rack, 6)
    assert job.run(20) == "done"
    records = list(job.restart_records)
    assert len(records) == job.restarts >= 3
    failures = [e for e in job.log if e.kind == "failure"]
    restarted = [e for e in job.log if e.kind == "restarted"]
    for rec, fail, back in zip(records, failures, restarted, strict=True):
        assert rec.failed_t == fail.t and rec.failure == "GPU(s) gpu3 failed"
        assert rec.t == back.t and rec.t >= rec.failed_t + 0.5       # the checkpoint reload
        assert rec.cause == "healed" and rec.rank_map == RANKS
        assert rec.lost_steps == back.details["lost_steps"] and rec.from_step % 4 == 0
        first = next(r for r in job.records if r.t_end > rec.t)
        assert (rec.resumed_t, rec.resumed_step) == (first.t_end, first.step)
        assert rec.resumed_step == rec.from_step + 1
    d = records[0].to_dict(offset=100.0)
    assert d["t"] == records[0].t + 100.0 and d["failed_t"] == records[0].failed_t + 100.0
    assert d["rank_map"] == {str(r): g for r, g in RANKS.items()}
