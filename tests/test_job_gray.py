"""A GPU of the emulated job that goes slow (the emulator's slow_gpu): each rank's step timings
go to the agent (emulator.job_gray), which finds the GPU the others wait for and decides a planned
swap; the job hands it over at a step boundary and goes on from the step it reached, the spare in
its place, no step redone. Through real parts: the lumion rig on the bus, the agent in this
process on its own loop, the emulated job talking to it through the Fabric client."""
from __future__ import annotations

from test_agent_bus import _rig_on_bus, agent_on_thread

from photonic_testbed.hil.agent.entries import Slow
from photonic_testbed.hil.agent.sqlite_journal import SqliteJournal
from photonic_testbed.hil.lab.control_client import request
from tests.timeouts import wait_until

TIMEOUT_S = 10.0
WAIT_S = 60.0


def slow_entries(journal) -> list[Slow]:
    with SqliteJournal(journal, read_only=True) as j:
        return [e.details for e in j.entries(kinds=("slow",))]


def test_a_slow_gpu_of_the_emulated_job_is_swapped_at_a_step_boundary_with_no_step_lost(tmp_path):
    with _rig_on_bus(tmp_path, "lumion", "chip", ideal_chip=True) as (emu, rig, _):
        journal = tmp_path / "journal.db"
        with agent_on_thread(rig, journal, TIMEOUT_S):
            host, control = emu.rack, emu.endpoints["control"]
            rank_map = host.start_job("dp", 10**6, checkpoint_every=1000)["rank_map"]
            job = host.job
            wait_until(lambda: job.steps_done >= 100, "healthy steps", WAIT_S)
            assert slow_entries(journal) == []                # healthy: nobody suspected
            slow_rank = next(r for r, g in rank_map.items() if g == "gpu3")
            request(control, {"cmd": "slow_gpu", "gpu": "gpu3", "factor": 2.0})
            wait_until(lambda: job.restarts >= 1, "the planned swap", WAIT_S)
            rec = job.restart_records[-1]
            assert rec.lost_steps == 0 and rec.from_step > 100       # on from where it was
            new = {str(r): g for r, g in rec.rank_map.items()}
            assert new[slow_rank].startswith("spare")
            assert {r: g for r, g in new.items() if r != slow_rank} == \
                {r: g for r, g in rank_map.items() if r != slow_rank}
            said = slow_entries(journal)
            assert [(s.gpu, s.action) for s in said][:2] == [("gpu3", "suspect"),
                                                              ("gpu3", "swap")]
            at = job.steps_done
            wait_until(lambda: job.steps_done >= at + 20 and host.timings.stalls,
                       "steps after the swap", WAIT_S)
            assert job.restarts == 1 and job.state == "running"
            assert 0 <= host.timings.stalls[0] < WAIT_S
            assert request(control, {"cmd": "slowdowns"})["gpu3"]["factor"] == 2.0
