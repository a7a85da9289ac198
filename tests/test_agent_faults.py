"""Fault injection through the real processes: the agent (`ptb agent`) killed with SIGKILL at
random points of GPU swaps while the emulated job runs, and started again on its journal. After
every kill the job must be running again, on a rank map without the failed GPU, over links the
rack's physics says are up."""
from __future__ import annotations

import os
import random
import signal
import time

from photonic_testbed.hil.bus.client import ServiceClient
from tests.test_agent_bus import _ptb, _rig_on_bus, _stop, _until

SWAPS = int(os.environ.get("PTB_FAULT_SWAPS", "50"))


def _start_agent(path, journal):
    proc = _ptb("agent", "--rig", str(path), "--journal", str(journal), "--quarantine", "0")
    return proc


def _running_without(host, failed: str, after_step: int):
    """The job's rank map once it runs again past `after_step` without `failed`, over links
    that are up; else None."""
    job = host.job
    if job is None or job.state != "running" or job.step <= after_step:
        return None
    rank_map = dict(job.rank_map)
    if failed in rank_map.values():
        return None
    n = len(rank_map)
    ring = [(rank_map[r], rank_map[(r + 1) % n]) for r in range(n)]
    if not all(t is not None and t.up for t in host.rack.link_map(ring).values()):
        return None
    return rank_map


def test_the_job_survives_the_agent_killed_at_random_points_of_swaps(tmp_path):
    rnd = random.Random(7)
    with _rig_on_bus(tmp_path, "lumion", "chip", ideal_chip=True) as (emu, rig, path):
        host = emu.rack
        journal = tmp_path / "journal.db"
        agent = _start_agent(path, journal)
        try:
            with ServiceClient(rig.agent_endpoints()[0], timeout=30) as c:
                c.call("ping")
            host.start_job("dp", 10**9, checkpoint_every=5, restart_s=0.02)
            _until(lambda: host.job.step >= 2, timeout=60, what="the job's first steps")
            kills = 0
            for k in range(SWAPS):
                victim = host.job.rank_map[rnd.randrange(len(host.job.rank_map))]
                step = host.job.step
                host.rack.faults.fail_gpu(victim)
                time.sleep(rnd.uniform(0.0, 0.25))      # somewhere in the swap, or after
                agent.send_signal(signal.SIGKILL)
                agent.communicate(timeout=10)
                kills += 1
                agent = _start_agent(path, journal)
                got = _until(lambda v=victim, s=step: _running_without(host, v, s), timeout=60,
                             what=f"swap {k}: the job running again without {victim}")
                assert len(got) == 8, f"swap {k}: the job shrank to {got}"
                host.rack.faults.heal_gpu(victim)       # back in the pool as a spare
            assert kills == SWAPS
            assert host.job.state == "running"
            assert sum(1 for c in host.job.communications if not c.all_up) == 0
        finally:
            if host.job is not None:
                host.job.close()
            _stop(agent)


def test_a_job_stopped_past_its_grant_timeout_runs_again_once_the_agent_is_back(tmp_path):
    """The agent is down longer than the job waits for a grant: the job gives up and fails,
    its report reaches nobody. The agent started again: the job's client rejoins it, the agent
    checks the fabric and orders a restart on the same GPUs."""
    with _rig_on_bus(tmp_path, "lumion", "chip", ideal_chip=True) as (emu, rig, path):
        host = emu.rack
        journal = tmp_path / "journal.db"
        agent = _start_agent(path, journal)
        try:
            with ServiceClient(rig.agent_endpoints()[0], timeout=30) as c:
                c.call("ping")
            host.start_job("dp", 10**9, checkpoint_every=5, restart_s=0.02)
            _until(lambda: host.job.step >= 2, timeout=60, what="the job's first steps")
            before = dict(host.job.rank_map)
            agent.send_signal(signal.SIGKILL)
            agent.communicate(timeout=10)
            _until(lambda: host.job.state == "failed", timeout=60,
                   what="the job giving up on its grant")
            step = host.job.step
            agent = _start_agent(path, journal)
            got = _until(lambda: _running_without(host, "none", step), timeout=60,
                         what="the job running again")
            assert got == before
            assert host.fabric.rejoins >= 1
        finally:
            if host.job is not None:
                host.job.close()
            _stop(agent)


def test_a_restart_order_journaled_but_never_published_reaches_the_job(tmp_path):
    """The agent killed after it journaled a restart order and before the job took it: the
    agent started again publishes that order whole (its rank map, not an empty one), and the
    job's client takes it."""
    from photonic_testbed.common.jobplan import dp_ring
    from photonic_testbed.hil.agent.bus import AgentProcess
    from photonic_testbed.hil.agent.entries import RankMapAnnounced, RestartOrder, Swap
    from photonic_testbed.hil.agent.sqlite_journal import SqliteJournal
    from photonic_testbed.hil.job.fabric_client import Fabric
    from tests.test_bus_at_most_once import serving

    with _rig_on_bus(tmp_path, "lumion", "chip", ideal_chip=True) as (emu, rig, path):
        journal = tmp_path / "journal.db"
        agent = AgentProcess(rig, str(journal))
        agent.start()
        fabric = Fabric(*rig.agent_endpoints(), timeout=10)
        try:
            with serving(agent.run):
                rank_map = fabric.admit(dp_ring(8))
                fabric.phase("dp")
            agent.close()
            # what the killed agent left: the swap decided, applied, verified and journaled
            # with its restart order; nothing published
            new_map = dict(rank_map)
            new_map[5] = "spare0"
            with SqliteJournal(journal) as j:
                j.record(Swap(failed=["gpu5"], swaps={"gpu5": "spare0"}, rank_map=new_map,
                              phase=("dp", 0)), "GPU failure: gpu5")
                j.record(RankMapAnnounced(rank_map=new_map), "GPU failure: gpu5")
                j.record(RestartOrder(rank_map=new_map), "GPU failure: gpu5")
            agent = AgentProcess(rig, str(journal))
            agent.start()
            with serving(agent.run):
                order = fabric.wait_restart(timeout=30)
            assert order is not None, "the journaled order never reached the job"
            assert order[0] == new_map and order[1] == "GPU failure: gpu5"
        finally:
            fabric.close()
            agent.close()


def test_a_cut_receive_fibre_on_the_real_stack_evicts_only_the_deaf_gpu(tmp_path):
    """The issue's report, through the processes and wires: the fibre to gpu3's receiver is
    cut while the emulated job runs. The agent diagnoses the dark link end by end: gpu3 alone
    is replaced, no spare is rejected, the ring stays 8 ranks, one restart."""
    from photonic_testbed.hil.agent.sqlite_journal import SqliteJournal
    with _rig_on_bus(tmp_path, "lumion", "chip", ideal_chip=True) as (emu, rig, path):
        host = emu.rack
        journal = tmp_path / "journal.db"
        agent = _start_agent(path, journal)
        try:
            with ServiceClient(rig.agent_endpoints()[0], timeout=30) as c:
                c.call("ping")
            host.start_job("dp", 10**9, checkpoint_every=5, restart_s=0.02)
            _until(lambda: host.job.step >= 2, timeout=60, what="the job's first steps")
            step = host.job.step
            rx = host.rack.layout.gpus["gpu3"][0].rx
            host.rack.faults.cut_fibre("chip", rx)
            got = _until(lambda: _running_without(host, "gpu3", step), timeout=60,
                         what="the job running again without gpu3")
            assert len(got) == 8
            assert set(got.values()) - {f"gpu{i}" for i in range(8)} in ({"spare0"},
                                                                          {"spare1"})
            time.sleep(1.0)                      # nothing more happens after
            assert dict(host.job.rank_map) == got and host.job.restarts == 1
            with SqliteJournal(journal) as j:
                assert not [e for e in j.entries(kinds=("alarm",)) if "rejected" in e.cause]
                diagnosis = j.entries(kinds=("diagnosis",))
                assert diagnosis and diagnosis[0].details.loopback["gpu3"] is False
        finally:
            if host.job is not None:
                host.job.close()
            _stop(agent)


PHASE_KILLS = int(os.environ.get("PTB_FAULT_PHASE_KILLS", "50"))


def _named_phase(rig, job: str) -> tuple[str, int]:
    """The phase the agent names for `job` (its published state, as a job or the GUI reads
    it)."""
    with ServiceClient(rig.agent_endpoints()[0], timeout=60) as c:
        mine = c.call("snapshot")["state"]["jobs"][job]
    return mine["phase"], int(mine["round"])


def test_a_restarted_agent_names_the_phase_the_job_was_last_granted(tmp_path):
    """The agent (`ptb agent`) killed with SIGKILL at random points of 50 phase switches, over
    the bus on the opus rig's OCS, and started again on its journal: it names the job's phase
    as the job last was granted it (the job's own record of its grants is the truth). The
    pipeline's circuits are all in the ring's: a restarted agent that guessed the phase from
    the circuits on the switches named the pipeline for a ring it had granted."""
    from concurrent.futures import ThreadPoolExecutor

    from photonic_testbed.common.jobplan import JobPlan, PhaseSpec
    from photonic_testbed.hil.job.fabric_client import Fabric

    rnd = random.Random(11)
    plan = JobPlan("pp-dp", 8, (PhaseSpec("pp", "chain"), PhaseSpec("dp", "ring")))
    keys = plan.sequence()
    with _rig_on_bus(tmp_path, "opus", "ocs", switching_s=0.0) as (emu, rig, path):
        journal = tmp_path / "journal.db"
        agent = _start_agent(path, journal)
        fabric = Fabric(*rig.agent_endpoints(), timeout=60, job="pp-dp")
        asking = ThreadPoolExecutor(max_workers=1, thread_name_prefix="job")
        try:
            fabric.admit(plan)
            took = []
            for k in range(20):                 # how long a phase switch takes here
                t = time.perf_counter()
                fabric.phase(*keys[k % 2])
                took.append(time.perf_counter() - t)
            typical = sorted(took)[len(took) // 2]
            granted = keys[1]
            wrong = []
            for k in range(PHASE_KILLS):
                asked = keys[k % 2]
                if rnd.random() < 0.75:
                    # as the job has its grant: what the agent does after it is cut short
                    got = fabric.phase(*asked)
                    time.sleep(rnd.uniform(0.0, 0.0003))
                    agent.send_signal(signal.SIGKILL)
                    agent.communicate(timeout=10)
                    agent = _start_agent(path, journal)
                else:
                    # before, during or just after the switch: up to twice its typical time
                    pending = asking.submit(fabric.phase, *asked)
                    time.sleep(rnd.uniform(0.0, 2 * typical))
                    agent.send_signal(signal.SIGKILL)
                    agent.communicate(timeout=10)
                    agent = _start_agent(path, journal)
                    got = pending.result(timeout=120)   # the old agent's answer, or the new one's
                assert got["granted"], got
                granted = (got["phase"], got["round"])
                named = _until(lambda: _named_phase(rig, "pp-dp"), timeout=60,
                               what=f"kill {k}: the restarted agent's state")
                if named != granted:
                    wrong.append(f"kill {k}: granted {granted}, named {named}")
            assert wrong == []
            assert granted == keys[(PHASE_KILLS - 1) % 2]
        finally:
            asking.shutdown(wait=False)
            fabric.close()
            _stop(agent)
