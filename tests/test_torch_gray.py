"""A GPU that goes slow under the PyTorch job, found and swapped by a planned swap (issue 33):
the stack as processes on lumion, the job on 4 ranks with one warm standby; the emulator paces
the processes on gpu2 (`slow_gpu`: SIGSTOP/SIGCONT, no help from the job's code); the agent
finds gpu2 from the ranks' timings and decides the swap once the slowness has cost what a swap
costs; the job streams the state to the spare's standby and holds its ranks at a step
boundary; the agent swaps, and the spare takes the rank from the held step on. The final
weights are those of a run that was never slowed nor swapped (a standalone run beside it), bit
for bit."""
from __future__ import annotations

import pytest

pytest.importorskip("torch")

from test_torch_job import digests, events_of, finish, launch  # noqa: E402
from test_torch_on_the_fabric import wait_event  # noqa: E402

from photonic_testbed.emulator.control import request  # noqa: E402
from photonic_testbed.hil.agent.entries import Detected, RestartOrder, Slow  # noqa: E402
from photonic_testbed.ptb.bench.measure import agent_stack, journal_reader  # noqa: E402

MODEL = ("--width", "96", "--batch", "8", "--block", "48", "--layers", "2")
STEPS = 150


def test_a_slow_gpu_is_swapped_at_a_step_boundary_and_nothing_is_lost(tmp_path):
    stack = agent_stack("lumion", quarantine_s=600.0)
    run = ref = None
    try:
        args = ("--world", "4", "--steps", str(STEPS), "--standbys", "1", *MODEL)
        ref = launch(tmp_path / "reference", "--standalone", "--standbys", "0", *args)
        work = tmp_path / "job"
        run = launch(work, "--rig", str(stack.workdir / "rig.toml"), "--control",
                     stack.control, "--plan", "dp", "--restart-timeout", "120", *args)
        wait_event(run, work, lambda e: e["kind"] == "ready" and e["gpu"] == "spare0",
                   "a warm standby on spare0")
        wait_event(run, work, lambda e: e["kind"] == "step" and e["step"] >= 8, "step 8")
        got = request(stack.control, {"cmd": "slow_gpu", "gpu": "gpu2", "factor": 8.0,
                                      "period_s": 0.02})
        assert got["gpu2"]["factor"] == 8.0
        out = finish(run)
        assert run.returncode == 0, out
        assert finish(ref) is not None and ref.returncode == 0
        ev = events_of(work)
        orders = [e["rank_map"] for e in ev if e["kind"] == "order"]
        assert orders == [{"0": "gpu0", "1": "gpu1", "2": "gpu2", "3": "gpu3"},
                          {"0": "gpu0", "1": "gpu1", "2": "spare0", "3": "gpu3"}], orders
        # every rank held at the same step boundary, the new generation started there
        hold = next(e for e in ev if e["kind"] == "hold")
        held = [e for e in ev if e["kind"] == "held"]
        assert hold["gpu"] == "gpu2" and "not the job" in hold["why"]
        assert {e["gpu"] for e in held} == {"gpu0", "gpu1", "gpu2", "gpu3"}
        assert {e["step"] for e in held} == {hold["step"]}
        moved = [e for e in ev if e["kind"] == "transferred" and e["gen"] == 1]
        assert {e["step"] for e in moved} == {hold["step"]}            # no step redone
        # the spare's state came ahead, streamed while the job trained: at the swap it was at
        # the held step already and received nothing more
        streamed = next(e for e in ev if e["kind"] == "streamed" and e["gpu"] == "spare0")
        assert streamed["step"] == hold["step"] and streamed["bytes_received"] > 0
        # (its last gradient may be applied just after the order: the spare waits for it)
        spare = next(e for e in moved if e["gpu"] == "spare0")
        assert not spare["received"] and spare["bytes_received"] == 0
        first = next(e for e in ev if e["kind"] == "step" and e["gpu"] == "spare0")
        assert first["step"] == hold["step"] + 1
        assert any(e["kind"] == "swapped_out" and e["gpu"] == "gpu2" for e in ev)
        over = next(e for e in ev if e["kind"] == "handed_over")
        assert over["gpu"] == "gpu2" and over["step"] == hold["step"] and over["stall_s"] >= 0
        # the slow GPU is not made a standby again (the agent holds it out)
        assert not [e for e in ev if e["kind"] == "spawned" and e["gpu"] == "gpu2"
                    and e["t"] > over["t"]]
        # nothing lost: the weights are the unslowed, unswapped run's, bit for bit
        run_d, ref_d = digests(ev), digests(events_of(tmp_path / "reference"))
        assert set(run_d) == {"gpu0", "gpu1", "spare0", "gpu3"}
        assert len(set(ref_d.values())) == 1 and set(run_d.values()) == set(ref_d.values())
        # the agent said why, in order: the suspect, the decision, the swap, the order
        with journal_reader(stack) as j:
            entries = j.entries()
        slow = [e.details for e in entries if isinstance(e.details, Slow)]
        assert [(d.action, d.gpu) for d in slow] == [("suspect", "gpu2"), ("swap", "gpu2")]
        assert slow[1].lost_s >= slow[1].price_s > 0 and slow[1].ratio >= 1.1
        kinds = [type(e.details) for e in entries]
        i = kinds.index(Slow)
        assert Detected in kinds[i:] and RestartOrder in kinds[i:]
    finally:
        for p in (run, ref):
            if p is not None and p.poll() is None:
                p.kill()
                p.communicate()
        stack.close()
