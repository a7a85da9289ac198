"""Admission off the hot path: a job's plan read and its circuits worked out in a worker process
beside the agent (`hil.agent.admission`), one at a time, bounded in time, memory and size, its
GPUs kept for it meanwhile; the agent grants other jobs' phases and runs their failovers while
it is worked out. The worker is frozen (SIGSTOP) to hold an admission open as long as a test
needs: nothing here depends on how fast the machine is."""
from __future__ import annotations

import contextlib
import os
import pathlib
import signal
import time

import pytest
from optics_doubles import PermutationSwitch

from photonic_testbed.common.jobplan import JobPlan, PhaseSpec, dp_ring, round_robin_matchings
from photonic_testbed.common.rack_layout import lumion, rail_rack
from photonic_testbed.hil.agent import Agent, AgentError, admission, policies
from photonic_testbed.hil.agent.admission import Admissions, plan_size
from photonic_testbed.hil.agent.sqlite_journal import SqliteJournal
from photonic_testbed.hil.bus.client import ServiceClient
from photonic_testbed.hil.job.fabric_client import Fabric
from tests.test_datacenter_tenants import TIMEOUT_S, datacenter, rail_plan  # noqa: F401
from tests.timeouts import wait_until

WAIT_S = 60.0                   # a bounded wait on a loaded machine (met in well under 1 s)


def worker_of(parent: int) -> int:
    """The pid of the admissions' worker that `parent` started."""
    for entry in pathlib.Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            status = (entry / "status").read_text()
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        ppid = next(int(line.split()[1]) for line in status.splitlines()
                    if line.startswith("PPid:"))
        if ppid == parent and b"photonic_testbed.hil.agent.admission" in cmdline:
            return int(entry.name)
    raise AssertionError(f"no admission worker started by {parent}")


@contextlib.contextmanager
def frozen(pid: int):
    """The worker stopped: whatever it was asked waits until the block ends."""
    os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)


def _agent(tmp_path, layout, **bounds) -> Agent:
    switches = {s: PermutationSwitch(s, n) for s, n in layout.switches.items()}
    agent = Agent(layout, switches, SqliteJournal(tmp_path / "j.db"), lambda s, p: 0.0)
    # (the worker at the agent's priority: these tests are of the admissions' logic, and must
    # not wait for a machine busy with other work to leave a niced worker its turn)
    agent.admissions.close()
    agent.admissions = Admissions(layout, round_robin_matchings, nice=0, **bounds)
    return agent


def _close(agent: Agent) -> None:
    agent.close()
    agent.journal.close()


def test_other_jobs_are_granted_while_an_admission_is_worked_out(datacenter):  # noqa: F811
    """Over the bus: job b's admission held open in the worker, job a's phases are granted;
    b is answered once its circuits are back."""
    rig, control, agent = datacenter
    a = Fabric(*rig.agent_endpoints(), job="a", timeout=TIMEOUT_S)
    try:
        a.admit(rail_plan("a", 2))
        with ServiceClient(rig.agent_endpoints()[0], timeout=TIMEOUT_S) as c:
            with frozen(worker_of(os.getpid())):
                pending = c.send("admit", {"plan": rail_plan("b", 2).to_dict(), "job": "b"},
                                 wait=5)
                for key in rail_plan("a", 2).sequence() * 3:
                    assert a.phase(*key)["granted"]
                assert set(agent.agent.jobs) == {"a"}
            got = c.receive(pending, time.monotonic() + WAIT_S)
        assert len(got["rank_map"]) == 16 and set(agent.agent.jobs) == {"a", "b"}
        assert a.phase("tp")["granted"]
    finally:
        a.close()


def _until(cond, what: str):
    return wait_until(cond, what, WAIT_S, 0.001)


def test_a_failover_meanwhile_does_not_take_the_gpus_kept_for_the_admission(tmp_path):
    """67 servers on 8 rails: job a is a ring of pairs of GPUs of servers s0 and s1 (each on
    its rail), job b (64 servers, s2..s65) is being admitted. s0g0 fails meanwhile: its
    spare is s66g0, the rack's spare, not s2g0 (the first free GPU of rail 0 in rack order,
    and as cheap a spare), which is kept for b."""
    agent = _agent(tmp_path, rail_rack("rails", 67))
    try:
        agent.admit(JobPlan("a", 16, (PhaseSpec("dp", "ring", group=2, stride=8),)))
        free = len(agent.spares())
        b = agent.admit_later(big_plan().to_dict())
        _until(lambda: len(agent.spares()) < free and "big" not in agent.jobs or b.done(),
               "b's GPUs kept while its circuits are worked out")
        with frozen(worker_of(os.getpid())):
            assert "big" not in agent.jobs, "b was worked out before the worker could be held"
            out = agent.on_health({"gpu": "s0g0", "state": "failed"})
            assert out is not None and out.swaps == {"s0g0": "s66g0"}
        name, ranks = b.result(WAIT_S)
        assert name == "big" and {g.split("g")[0] for g in ranks.values()} == \
            {f"s{k}" for k in range(2, 66)}
    finally:
        _close(agent)


def test_an_admission_past_its_time_is_refused_and_the_next_one_worked_out(tmp_path):
    agent = _agent(tmp_path, lumion(), seconds=1.0)
    try:
        agent.admit_later(dp_ring(4, name="warm").to_dict()).result(WAIT_S)
        with frozen(worker_of(os.getpid())):
            late = agent.admit_later(dp_ring(4, name="late").to_dict())
            with pytest.raises(AgentError, match="'late': its circuits were not worked out "
                                                 "within 1 s without its worker running: "
                                                 "refused"):
                late.result(WAIT_S)
        assert set(agent.jobs) == {"warm"} and len(agent.spares()) == 6   # nothing kept
        assert agent.admit_later(dp_ring(4, name="next").to_dict()).result(WAIT_S)[0] == "next"
    finally:
        _close(agent)


def big_plan() -> JobPlan:
    """512 ranks on 8 rails, 8 all-to-all phases over each rail's 64 servers: 504 (phase,
    round)s, 258,048 rank links."""
    return JobPlan("big", 512, tuple(PhaseSpec(f"a2a{k}", "all_to_all", group=64, stride=8)
                                     for k in range(8)))


def test_a_plan_past_the_size_bound_is_refused_with_its_figure_before_it_is_listed(tmp_path):
    assert plan_size(big_plan(), round_robin_matchings) == (504, 258_048)
    agent = _agent(tmp_path, rail_rack("rails", 65), job_links=100_000)
    try:
        with pytest.raises(AgentError, match=r"job 'big': its plan has 258,048 rank links over "
                                             r"504 \(phase, round\)s, more than the 100,000"):
            agent.admit_later(big_plan().to_dict()).result(WAIT_S)
    finally:
        _close(agent)


def test_a_plan_that_needs_more_memory_than_an_admission_may_take_is_refused(tmp_path):
    agent = _agent(tmp_path, rail_rack("rails", 65), memory_mb=16)
    try:
        with pytest.raises(AgentError, match="16 MB"):
            agent.admit_later(big_plan().to_dict()).result(WAIT_S)
        assert agent.jobs == {} and len(agent.spares()) == len(agent.layout.gpus)
        assert agent.admit_later(dp_ring(8, name="small").to_dict()).result(WAIT_S)[0] == \
            "small"                                   # a fresh worker, within the bound
    finally:
        _close(agent)


def test_the_rank_links_of_all_jobs_are_bounded(tmp_path, monkeypatch):
    monkeypatch.setattr(admission, "ALL_LINKS", 11)
    agent = _agent(tmp_path, lumion())
    try:
        agent.admit_later(dp_ring(4, name="a").to_dict()).result(WAIT_S)     # 4 links
        agent.admit_later(dp_ring(4, name="a").to_dict()).result(WAIT_S)     # again: its own
        with pytest.raises(AgentError, match="job 'b': its 8 rank links and the 4 of the jobs "
                                             "admitted would pass the 11 the agent keeps"):
            agent.admit_later(dp_ring(8, name="b").to_dict()).result(WAIT_S)
    finally:
        _close(agent)


@pytest.mark.parametrize("plan, says", [
    ({"name": "x"}, "admit needs a job plan"),
    ({"name": "x", "world": 3, "phases": [{"name": "p", "pattern": "ring", "group": 2}]},
     "admit needs a job plan: .*does not tile"),
    ({"name": "x", "world": 99, "phases": [{"name": "p"}]}, "wants 99 ranks; at most 10"),
    ({"name": "x", "world": 8, "phases": [{"name": "p", "pattern": "ring"}]} | {"world": 16},
     "at most 10"),
])
def test_a_plan_that_cannot_be_read_is_refused_in_one_line(tmp_path, plan, says):
    agent = _agent(tmp_path, lumion())
    try:
        with pytest.raises(AgentError, match=says) as refused:
            agent.admit_later(plan).result(WAIT_S)
        assert "\n" not in str(refused.value)
    finally:
        _close(agent)


def test_circuits_worked_out_beside_the_agent_are_those_worked_out_in_it(tmp_path):
    """The worker's circuits, packed and sent as arrays, read back as the agent's own: every
    (phase, round)'s circuits, each rank's links, the size; and a swap changes them alike."""
    layout = rail_rack("rails", 67)
    plan = JobPlan("mixed", 64, (PhaseSpec("pp", "chain", group=8, stride=8),
                                 PhaseSpec("ep", "all_to_all", group=8, stride=8)))
    agent = _agent(tmp_path, layout)
    try:
        name, ranks = agent.admit_later(plan.to_dict()).result(WAIT_S)
        beside = agent.jobs[name].circuits
        here = policies.JobCircuits(plan, layout, ranks)
        assert list(beside.targets) == list(here.targets)
        assert beside.size == here.size == 56 + 7 * 64          # the chain's, the rounds'
        assert all(beside.targets[k] == here.targets[k] for k in here.targets)
        for r in (0, 7, 9, 63):
            assert beside.by_rank.keys(r) == here.by_rank.keys(r)
            assert all(beside.by_rank.links(r, k) == here.by_rank.links(r, k)
                       for k in here.targets)
        swap = {ranks[9]: "s66g1"}
        now = ("ep", 3)
        assert beside.delta(swap) == here.delta(swap)
        beside.swap(swap, now)
        here.swap(swap, now)
        assert all(beside.refresh(k) == here.refresh(k) for k in here.targets)
    finally:
        _close(agent)


def test_an_admission_refused_as_it_is_taken_on_changes_nothing(tmp_path):
    """Who may admit a job of a name is asked again as it is taken on (a tenant's job of that
    name may have been admitted meanwhile): refused then, the job is not admitted, its GPUs
    are free, nothing is written to the switches or the journal, and the next is taken on."""
    agent = _agent(tmp_path, lumion())
    try:
        applies = {n: s.applies for n, s in agent.switches.items()}
        entries = len(agent.journal.entries())

        def refuse(name: str) -> None:
            raise AgentError(f"job {name!r} is another key's now")
        with pytest.raises(AgentError, match="job 'x' is another key's now"):
            agent.admit_later(dp_ring(4, name="x").to_dict(), approve=refuse).result(WAIT_S)
        assert agent.jobs == {} and len(agent.spares()) == len(agent.layout.gpus)
        assert {n: s.applies for n, s in agent.switches.items()} == applies
        assert len(agent.journal.entries()) == entries
        asked: list[str] = []
        assert agent.admit_later(dp_ring(4, name="y").to_dict(), owner="tenant-a",
                                 approve=asked.append).result(WAIT_S)[0] == "y"
        assert asked == ["y"]
        admit = [e for e in agent.journal.entries() if e.kind == "decision"][-2]
        assert admit.details.job == "y" and admit.details.owner == "tenant-a"
    finally:
        _close(agent)


def test_a_job_whose_first_circuits_a_switch_refuses_is_still_its_owners(tmp_path):
    """The admission is journaled (with its owner) before its circuits are written: a switch
    that refuses them leaves the job admitted, as recovery would take it up, and its owner's
    (its tenant may then release it or admit it again)."""
    from photonic_testbed.drivers.circuit_switch import SwitchError
    agent = _agent(tmp_path, lumion())
    try:
        def refuse(want) -> None:
            raise SwitchError("a mirror is stuck")
        for sw in agent.switches.values():
            sw.before_apply.append(refuse)
        with pytest.raises(AgentError, match="refused the circuits"):
            agent.admit_later(dp_ring(4, name="x").to_dict(), owner="tenant-a").result(WAIT_S)
        assert agent.jobs["x"].owner == "tenant-a"
    finally:
        _close(agent)


def test_an_admission_is_bounded_by_its_workers_time_not_the_machines_load(tmp_path):
    """The bound is the worker's CPU time: a plan that needs more is refused saying so."""
    agent = _agent(tmp_path, rail_rack("rails", 67), seconds=WAIT_S)
    try:
        agent.admit_later(dp_ring(4, name="warm").to_dict()).result(WAIT_S)   # (started)
        agent.admissions.seconds = 0.02
        with pytest.raises(AgentError, match="'big': its circuits were not worked out within "
                                             "0.02 s of its worker's time: refused"):
            agent.admit_later(big_plan().to_dict()).result(WAIT_S)
    finally:
        _close(agent)


def test_a_worker_waiting_for_the_cpu_is_given_its_time():
    """A worker held back (a machine busy with other work) runs a little at a time: however
    long that takes in wall time, it is refused only once it has used its CPU time, or once it
    stops running at all (stopped, or asleep) for as long."""
    from photonic_testbed.hil.agent.admission import _Budget
    now = [0.0]
    budget = _Budget(1.0, clock=lambda: now[0])
    for k in range(100):                          # 50 s of wall time, 0.5 s of CPU
        now[0] = k * 0.5
        assert budget.left(0.005 * k, runnable=True) > 0
    with pytest.raises(TimeoutError, match="of its worker's time"):
        now[0] += 0.5
        budget.left(1.2, runnable=True)
    stopped = _Budget(1.0, clock=lambda: now[0])
    stopped.left(3.0, runnable=False)
    now[0] += 0.9
    stopped.left(3.0, runnable=False)              # 0.9 s stopped: still within
    now[0] += 0.2
    with pytest.raises(TimeoutError, match="without its worker running"):
        stopped.left(3.0, runnable=False)
    waited = _Budget(1.0, clock=lambda: now[0])
    now[0] += 5.0                                  # the agent held the admission between parts
    waited.given()
    assert waited.left(0.0, runnable=False) > 0    # the worker has just been given its part


def test_the_worker_dies_with_the_agent(tmp_path):
    """An agent killed -9 takes its admission worker with it (the kernel's parent-death
    signal): no worker is left holding the agent's output or memory, however busy the machine
    (a niced worker would take its time to see its input closed)."""
    import subprocess
    import sys
    parent = subprocess.Popen(
        [sys.executable, "-c",
         "import time\n"
         "from photonic_testbed.common.jobplan import round_robin_matchings\n"
         "from photonic_testbed.common.rack_layout import lumion\n"
         "from photonic_testbed.common.jobplan import dp_ring\n"
         "from photonic_testbed.hil.agent.admission import _Budget, _Worker\n"
         "w = _Worker(lumion(), round_robin_matchings, 2048, 0)\n"
         "w.send(('plan', dp_ring(4).to_dict(), 10, 1 << 22))\n"
         "w.receive(_Budget(60.0))            # (the worker is set up and serving)\n"
         "print(w.proc.pid, flush=True)\n"
         "time.sleep(120)\n"],
        stdout=subprocess.PIPE, text=True)
    worker = int(parent.stdout.readline())
    try:
        os.kill(worker, signal.SIGSTOP)      # (it cannot see its input closed: only a signal)
        parent.kill()
        parent.wait(WAIT_S)
        _until(lambda: _state(worker) in (None, "Z"), "the worker gone with its parent")
    finally:
        parent.kill()
        parent.wait(WAIT_S)
        parent.stdout.close()
        if _state(worker) not in (None, "Z"):
            os.kill(worker, signal.SIGKILL)


def _state(pid: int) -> str | None:
    """A process's state letter (R, S, T, Z, ...), None once it is gone."""
    try:
        return pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None
