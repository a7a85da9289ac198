"""The PyTorch job on the emulated rigs with the agent: the stack as processes (`ptb emulate`,
`ptb serve`, `ptb agent`), the job's controller and its rank processes; GPUs fail through the
emulator's control endpoint, which kills the process on the failed GPU.

- lumion, data-parallel on 8 ranks, 2 warm standbys: a failure (spare0 takes the rank in
  place), a second failure whose spare (spare1) fails during the swap, and then no spare left:
  the job goes on with 7 ranks, as its plan allows.
- opus, tensor-parallel pairs in data-parallel rings (2 x 4): the phases switch the OCS's
  rails every step; a failure with no spare stops the job cleanly (a 7-rank world cannot hold
  the 2-D plan).
In every case: the rank map of the job is the agent's, and no collective was started over a
link the physics said was down, except by a rank whose peer had just failed, and then that
collective never completed."""
from __future__ import annotations

import pytest

pytest.importorskip("torch")

from test_torch_job import events_of, finish, launch  # noqa: E402

from photonic_testbed.emulator.control import request  # noqa: E402
from photonic_testbed.hil.agent.entries import Slow  # noqa: E402
from photonic_testbed.hil.bus.client import ServiceClient  # noqa: E402
from photonic_testbed.hil.job import torch_job  # noqa: E402
from photonic_testbed.ptb.bench.measure import agent_stack, journal_reader  # noqa: E402

SMALL = ("--width", "32", "--batch", "2", "--block", "16", "--layers", "1")
TIMEOUT_S = 600


def wait_event(proc, workdir, cond, what, timeout=TIMEOUT_S):
    import time
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"the job ended before {what}: {finish(proc, 5)}")
        for e in events_of(workdir):
            if cond(e):
                return e
        time.sleep(0.05)
    raise AssertionError(f"{what} did not happen within {timeout} s")


def _until(cond, what, timeout=TIMEOUT_S):
    import time
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"no {what} within {timeout} s"
        time.sleep(0.05)


def fail(stack, gpu):
    import time
    t = time.time()
    got = request(stack.control, {"cmd": "fail_gpu", "gpu": gpu})
    assert got["killed"], f"no process was registered on {gpu}"
    return t


def check_audits(events, failures: dict[str, float]):
    """Every down link a rank saw before a collective touches a GPU that had failed by then,
    and that rank did not complete that step in that generation."""
    audits = [e for e in events if e["kind"] == "audit"]
    assert audits
    completed = {(e["gpu"], e["gen"], e["step"]) for e in events if e["kind"] == "step"}
    for a in audits:
        for src, dst in a["down"]:
            culprits = {g for g in (src, dst) if g in failures and failures[g] <= a["t"]}
            assert culprits, f"{a['gpu']} saw {src}->{dst} down with no failed GPU: {a}"
            assert (a["gpu"], a["gen"], a["step"] + 1) not in completed, a


def agent_rank_map(stack):
    with ServiceClient(stack.rig.agent_endpoints()[0], timeout=5) as c:
        return c.call("snapshot")["state"]["rank_map"]


def test_lumion_swap_second_failure_spare_lost_mid_swap_then_seven_ranks(tmp_path):
    stack = agent_stack("lumion", quarantine_s=60.0)
    proc = None
    try:
        work = tmp_path / "job"
        proc = launch(work, "--rig", str(stack.workdir / "rig.toml"), "--control",
                      stack.control, "--plan", "dp", "--world", "8", "--steps", "80",
                      "--standbys", "2", "--audit", "--restart-timeout", "60", *SMALL)
        failures = {}
        wait_event(proc, work, lambda e: e["kind"] == "step" and e["step"] >= 8,
                   "step 8")
        wait_event(proc, work, lambda e: e["kind"] == "ready" and e["gpu"] == "spare1",
                   "a warm standby on spare1")
        failures["gpu3"] = fail(stack, "gpu3")
        wait_event(proc, work, lambda e: e["kind"] == "step" and e["gpu"] == "spare0",
                   "spare0's first step")
        wait_event(proc, work, lambda e: e["kind"] == "step" and e["gen"] == 1
                   and e["step"] >= 16, "step 16 after the swap")
        failures["gpu5"] = fail(stack, "gpu5")
        wait_event(proc, work, lambda e: e["kind"] == "order" and e["gen"] == 2,
                   "the order that puts spare1 in gpu5's place")
        failures["spare1"] = fail(stack, "spare1")       # during the swap
        out = finish(proc)
        assert proc.returncode == 0, out
        ev = events_of(work)
        orders = [e["rank_map"] for e in ev if e["kind"] == "order"]
        base = {str(r): f"gpu{r}" for r in range(8)}
        assert orders[1] == {**base, "3": "spare0"}
        assert orders[2] == {**base, "3": "spare0", "5": "spare1"}
        last = orders[-1]
        assert len(orders) == 4 and sorted(last.values()) == sorted(
            ["gpu0", "gpu1", "gpu2", "spare0", "gpu4", "gpu6", "gpu7"])
        assert agent_rank_map(stack) == last
        # spare0 got the state in place; the 7 survivors finished with one model
        got = [e for e in ev if e["kind"] == "transferred" and e["gpu"] == "spare0"
               and e["gen"] == 1]
        assert got and got[0]["received"] and got[0]["bytes_received"] > 0
        done = {e["gpu"]: e for e in ev if e["kind"] == "done" and "digest" in e}
        assert set(done) == set(last.values())
        assert len({e["digest"] for e in done.values()}) == 1
        assert {e["step"] for e in done.values()} == {80}
        check_audits(ev, failures)
        loss = [e["loss"] for e in ev if e["kind"] == "step" and e["gpu"] == "gpu0"]
        assert sum(loss[-5:]) / 5 < sum(loss[:5]) / 5 - 0.3, loss
        # no GPU was slow: the ranks' timings (sent all along, on a machine the suite keeps
        # busy) made the agent suspect none
        assert any(e["kind"] == "step" for e in ev)
        with journal_reader(stack) as j:
            assert [e for e in j.entries() if isinstance(e.details, Slow)] == []
    finally:
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.communicate()
        stack.close()


def test_opus_tensor_and_data_parallel_phases_then_clean_stop(tmp_path):
    stack = agent_stack("opus")
    proc = None
    try:
        work = tmp_path / "job"
        proc = launch(work, "--rig", str(stack.workdir / "rig.toml"), "--control",
                      stack.control, "--plan", "dp-tp", "--world", "8", "--steps", "1000",
                      "--audit", "--restart-timeout", "5", *SMALL)
        wait_event(proc, work, lambda e: e["kind"] == "step" and e["step"] >= 6, "step 6")
        # the rig's two spares fail first (their standbys die with them): none is left
        for spare in ("spare0", "spare1"):
            fail(stack, spare)
        with ServiceClient(stack.rig.agent_endpoints()[0], timeout=5) as c:
            _until(lambda: {g["name"]: g["health"] for g in c.call("snapshot")["state"]["rack"]
                            if g["name"].startswith("spare")} == {"spare0": "failed",
                                                                   "spare1": "failed"},
                   "the agent sees both spares failed")
        t = fail(stack, "server5")
        out = finish(proc)
        assert proc.returncode == torch_job.STOPPED, out
        assert "cannot run on 7 ranks" in out and "server5" in out
        ev = events_of(work)
        stops = [e for e in ev if e.get("role") == "controller" and e["kind"] == "stopped"]
        assert len(stops) == 1 and "cannot run on 7 ranks" in stops[0]["reason"]
        # every rank process is gone, each with the stop's reason
        exits = {e["gpu"]: e["code"] for e in ev if e["kind"] == "exit"
                 and e["gpu"].startswith("server")}
        assert set(exits) == {f"server{i}" for i in range(8)}
        assert exits.pop("server5") == -9 and set(exits.values()) == {torch_job.STOPPED}
        # both phases ran: tensor-parallel all-reduces and the gradient all-reduce, each
        # after its circuits were granted (the agent journaled the rail switches)
        phases = {(e["phase"], e["what"]) for e in ev if e["kind"] == "audit"}
        assert phases == {("tp", "tensor-parallel all-reduce"), ("dp", "gradient all-reduce")}
        check_audits(ev, {"server5": t})
        with ServiceClient(stack.rig.agent_endpoints()[0], timeout=5) as c:
            state = c.call("snapshot")["state"]
        switched = [e for e in state["events"] if e["kind"] == "phase"]
        assert {e["details"]["phase"] for e in switched} == {"tp", "dp"}
        assert any("cannot run on 7 ranks" in a for a in state["alarms"])
        assert state["rank_map"] == {str(r): f"server{r}" for r in range(8)}
    finally:
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.communicate()
        stack.close()


def test_torchrun_baseline_restarts_on_the_agents_new_rank_map(tmp_path):
    """The baseline with the agent: gpu1 fails, torchrun restarts both workers, and the one
    with rank 1 runs on the GPU the agent ordered in gpu1's place, from the checkpoint."""
    stack = agent_stack("lumion", quarantine_s=60.0)
    proc = None
    try:
        work = tmp_path / "torchrun"
        proc = launch(work, "--rig", str(stack.workdir / "rig.toml"), "--control",
                      stack.control, "--plan", "dp", "--world", "2", "--steps", "60",
                      "--torchrun", "--checkpoint-every", "5", *SMALL)   # the failure mid-run
        wait_event(proc, work, lambda e: e["kind"] == "step" and e["step"] >= 8, "step 8")
        fail(stack, "gpu1")
        out = finish(proc)
        assert proc.returncode == 0, out
        ev = events_of(work)
        orders = [e["rank_map"] for e in ev if e["kind"] == "order"]
        assert orders[0] == {"0": "gpu0", "1": "gpu1"} and len(orders) == 2
        spare = orders[1]["1"]
        assert spare not in ("gpu0", "gpu1") and agent_rank_map(stack) == orders[1]
        ready = {e["gpu"]: e for e in ev if e["kind"] == "ready" and e["restart"] == 1}
        assert set(ready) == {"gpu0", spare}
        assert ready[spare]["checkpoint"] % 5 == 0 and ready[spare]["checkpoint"] >= 5
        done = {e["gpu"] for e in ev if e["kind"] == "done" and "digest" in e}
        assert done == {"gpu0", spare}
    finally:
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.communicate()
        stack.close()
