"""Several jobs on a datacenter rig over the bus: the emulated rail OCSes on their sockets,
their services (as `ptb serve --one-process` runs them), the agent and one `Fabric` per job.
Phase switches and failovers of one job never change another job's circuits, checked on the
emulator's switches themselves (their circuits and the moves on each port, not what the agent
believes); a failure with no spare left degrades only the job it hits."""
from __future__ import annotations

import threading

import orjson
import pytest

from photonic_testbed.common.jobplan import JobPlan, PhaseSpec
from photonic_testbed.emulator.control import request
from photonic_testbed.emulator.rig import EmulatedRig
from photonic_testbed.hil import rig as rigfile
from photonic_testbed.hil.agent.bus import AgentProcess, published_event
from photonic_testbed.hil.bus.client import ServiceClient
from photonic_testbed.hil.devices.service import DeviceService
from photonic_testbed.hil.job.fabric_client import Fabric
from photonic_testbed.hil.rig import rig_spec
from tests.test_agent_bus import _until
from tests.test_bus_at_most_once import serving
from tests.test_datacenter_rig import SMALL

TIMEOUT_S = 60.0             # a busy 2-core machine; met in well under a second when idle


def rail_plan(name: str, servers: int) -> JobPlan:
    """TP inside each server; across servers (on each rail) a pipeline and a DP ring."""
    return JobPlan(name, 8 * servers, (PhaseSpec("tp", "ring", group=8, stride=1),
                                       PhaseSpec("pp", "chain", group=servers, stride=8),
                                       PhaseSpec("dp", "ring", group=servers, stride=8)))


@pytest.fixture
def datacenter(tmp_path):
    """2 pods of 8 servers (the last a spare) on 16 OCSes, all in this process but on their
    real sockets; yields (rig, control endpoint, agent process)."""
    desc = tmp_path / "small.toml"
    desc.write_text(SMALL)
    spec = rig_spec(str(desc))
    lay = spec.rack_layout()
    stop = threading.Event()
    services, threads = [], []
    with EmulatedRig(spec, switching_s=0.0) as emu:
        rig = rigfile.for_emulator(spec, emu.endpoints, gpus=tuple(
            rigfile.GpuConfig(g, atts[0].switch, atts[0].tx, g in lay.spares,
                              server=lay.servers[g]) for g, atts in lay.gpus.items()))
        emu.start_rack(rig.gpus_endpoints(), None)
        agent = None
        try:
            for s in rig.service_specs():
                services.append(DeviceService(s))
                services[-1].bind()
            for service in services:
                threads.append(threading.Thread(target=service.serve, args=(stop,),
                                                daemon=True))
                threads[-1].start()
            agent = AgentProcess(rig, str(tmp_path / "journal.db"), timeout=TIMEOUT_S)
            agent.start()
            with serving(agent.run):
                yield rig, emu.endpoints["control"], agent
        finally:
            stop.set()
            for t in threads:
                t.join(5)
            if agent is not None:
                agent.close()
            for service in services:
                service.close()


def ports_of(rig, gpus) -> dict[str, set[int]]:
    """{switch: the ports (ingress and egress) the GPUs are cabled to}."""
    by_name = {g.name: g for g in rig.gpus}
    out: dict[str, set[int]] = {}
    for name in gpus:
        g = by_name[name]
        n = 8                                   # the rig's OCSes are 8 x 8
        out.setdefault(g.switch, set()).update((g.port, n + g.port))
    return out


def on_the_switches(control, ports: dict[str, set[int]]) -> dict:
    """What the emulator's OCSes hold on those ports: their circuits and the moves each port
    has seen."""
    got = request(control, {"cmd": "switch_circuits", "switches": sorted(ports)}, 30.0)
    return {s: ([c for c in got[s]["commanded"] if c[0] in p or c[1] in p],
                {port: n for port, n in got[s]["port_moves"] if port in p})
            for s, p in ports.items()}


def assert_published_events_are_the_journal(rig, agent) -> None:
    """The agent publishes each journal entry as it is written (the writer's objects, not
    read back): what a subscriber gets is what `ptb journal` shows, a bulky entry briefed."""
    with ServiceClient(rig.agent_endpoints()[0], timeout=TIMEOUT_S) as c:
        events = c.call("snapshot")["state"]["events"]
    entries = agent.journal.entries()[-len(events):]
    assert len(events) > 20 and [e["seq"] for e in events] == [e.seq for e in entries]

    def wire(x):
        return orjson.loads(orjson.dumps(x, option=orjson.OPT_NON_STR_KEYS))
    for ev, e in zip(events, entries, strict=True):
        assert ev == wire(published_event(e)), e.kind


def test_jobs_never_move_each_others_circuits_and_a_failure_degrades_only_its_job(datacenter):
    rig, control, agent = datacenter
    a = Fabric(*rig.agent_endpoints(), job="a", timeout=TIMEOUT_S)
    b = Fabric(*rig.agent_endpoints(), job="b", timeout=TIMEOUT_S)
    c = Fabric(*rig.agent_endpoints(), job="c", timeout=TIMEOUT_S)
    try:
        map_a = a.admit(rail_plan("a", 4))          # best fit: pod 0, servers s0..s3
        map_b = b.admit(rail_plan("b", 2))          # pod 0 again (the fuller): s4, s5
        assert {g[:2] for g in map_a.values()} == {"s0", "s1", "s2", "s3"}
        assert {g[:2] for g in map_b.values()} == {"s4", "s5"}
        # c: a DP ring on rail 0 of pod 1, every GPU of that rail (its spare's included),
        # that may shrink: no spare can take a place on that switch
        ring = JobPlan("c", 8, (PhaseSpec("dp", "ring"),), min_world=2)
        map_c = c.admit(ring, {r: f"s{8 + r}g0" for r in range(8)})
        for fabric, phase in ((a, "pp"), (b, "dp"), (c, "dp")):
            assert fabric.phase(phase)["granted"]

        others = ports_of(rig, [*map_b.values(), *map_c.values()])
        before = on_the_switches(control, others)
        assert any(circuits for circuits, _ in before.values())
        mine = ports_of(rig, map_a.values())
        mine_before = on_the_switches(control, mine)
        # job a switches phases (one set up ahead while it computes) and loses a GPU
        a.phase("dp")
        a.done("dp")
        _until(lambda: a._ready == ("tp", 0), TIMEOUT_S, "job a's next phase set up ahead")
        assert a.phase("tp").get("ahead")
        a.phase("pp")
        request(control, {"cmd": "fail_gpu", "gpu": map_a[9]})          # s1g1
        order = a.wait_restart(TIMEOUT_S)
        assert order is not None
        map_a = order[0]
        assert {g[:2] for g in map_a.values()} == {"s0", "s6", "s2", "s3"}   # s1 moved whole
        a.phase("dp")
        assert on_the_switches(control, others) == before
        assert on_the_switches(control, mine) != mine_before        # a's own ports did move

        # c loses a GPU: nobody can take its place on rail 0 of pod 1; c shrinks to 7 ranks,
        # a and b keep their circuits
        others = ports_of(rig, [*map_a.values(), *map_b.values()])
        before = on_the_switches(control, others)
        request(control, {"cmd": "fail_gpu", "gpu": map_c[3]})          # s11g0
        order = c.wait_restart(TIMEOUT_S)
        assert order is not None and len(order[0]) == 7 and "s11g0" not in order[0].values()
        assert c.phase("dp")["granted"]
        assert on_the_switches(control, others) == before

        # a loses two more: the pod's spare server takes the first; for the second no server
        # of its pod is left: a is stopped (it cannot run on 31 ranks), b is untouched
        others = ports_of(rig, [*map_b.values(), *order[0].values()])
        before = on_the_switches(control, others)
        request(control, {"cmd": "fail_gpu", "gpu": map_a[17]})         # s2g1
        second = a.wait_restart(TIMEOUT_S)
        assert second is not None and {g[:2] for g in second[0].values()} >= {"s7"}
        request(control, {"cmd": "fail_gpu", "gpu": second[0][25]})     # s3g1
        _until(lambda: any("job 'a'" in e.cause and "stopped" in e.cause
                           for e in agent.journal.entries(kinds=("alarm",))),
               TIMEOUT_S, "job a stopped for want of a spare")
        assert a.wait_restart(1.0) is None
        assert on_the_switches(control, others) == before
        assert b.phase("pp")["granted"] and b.phase("dp")["granted"]
        assert agent.agent.jobs["b"].rank_map == map_b
        assert_published_events_are_the_journal(rig, agent)
    finally:
        for fabric in (a, b, c):
            fabric.close()
