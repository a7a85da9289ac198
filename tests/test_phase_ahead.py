"""Hiding the switch from the job (Opus): the job says when it is done with a phase's links
(`Fabric.done`), the agent sets the next phase's circuits up while the job computes, and
`Fabric.phase` returns at once when its state says they are up. Over the real bus, on the
opus rig's OCS with its mirrors taking 25 ms to move."""
from __future__ import annotations

import time

from photonic_testbed.common.jobplan import dp_tp
from photonic_testbed.hil.agent.bus import AgentProcess
from photonic_testbed.hil.job.fabric_client import Fabric
from tests.test_agent_bus import _rig_on_bus, _until
from tests.test_bus_at_most_once import serving


def test_the_next_phase_is_set_up_while_the_job_computes(tmp_path):
    with _rig_on_bus(tmp_path, "opus", "ocs", switching_s=0.025) as (emu, rig, path):
        agent = AgentProcess(rig, str(tmp_path / "journal.db"))
        agent.start()
        fabric = Fabric(*rig.agent_endpoints(), timeout=20)
        try:
            with serving(agent.run):
                rank_map = fabric.admit(dp_tp(8))
                keys = list(agent.agent.job().circuits.targets)
                assert len(keys) == 2                          # tp, then dp
                rack = emu.rack.rack
                asked = 0
                for step in range(6):
                    for phase, rnd in keys:
                        fabric.phase(phase, rnd)
                        asked += 1
                        # the phase's links are up by the rack's physics when it communicates
                        links = agent.agent.job().plan.links()[(phase, rnd)]
                        pairs = [(rank_map[a], rank_map[b]) for a, b in links]
                        state = rack.link_map(pairs)
                        assert all(t is not None and t.up for t in state.values()), \
                            (step, phase, [p for p, t in state.items() if not t or not t.up])
                        fabric.done(phase, rnd)
                        # compute, longer than the mirrors' move; until the next is staged
                        nxt = keys[(keys.index((phase, rnd)) + 1) % len(keys)]
                        _until(lambda nxt=nxt: fabric._ready == nxt, timeout=20,
                               what=f"phase {nxt} set up ahead")
                # after the first phase every one was found set up ahead
                assert fabric.ahead == asked - 1
            ahead = [e for e in agent.journal.entries(kinds=("phase",))
                     if e.details.ahead]
            assert len(ahead) >= asked - 1
        finally:
            fabric.close()
            agent.close()


def test_a_phase_asked_before_it_was_set_up_is_granted_the_usual_way(tmp_path):
    """The job asks for its next phase before the agent has staged it (no compute between):
    the request path switches and grants; the late `phase_done` changes nothing."""
    with _rig_on_bus(tmp_path, "opus", "ocs", switching_s=0.0) as (emu, rig, path):
        agent = AgentProcess(rig, str(tmp_path / "journal.db"))
        agent.start()
        fabric = Fabric(*rig.agent_endpoints(), timeout=20)
        try:
            with serving(agent.run):
                fabric.admit(dp_tp(8))
                keys = list(agent.agent.job().circuits.targets)
                for phase, rnd in keys * 3:
                    got = fabric.phase(phase, rnd)
                    assert got["granted"]
                    fabric.done(phase, rnd)
                time.sleep(0.2)
                assert agent.agent.job().phase in keys
        finally:
            fabric.close()
            agent.close()
