"""Switch services written together (`BusSwitch.apply_together`, the agent's path for a phase
switch on many OCSes): every request sent before any answer is awaited, each answer matched to
its switch; a switch changed under the agent is read again and written; a switch that refuses fails
alone, the others are written."""
from __future__ import annotations

import threading

import pytest

from photonic_testbed.drivers.circuit_switch import ApplyReport, CircuitConflict, SwitchError
from photonic_testbed.emulator.rig import EmulatedRig
from photonic_testbed.hil import rig as rigfile
from photonic_testbed.hil.agent.bus_switch import BusSwitch
from photonic_testbed.hil.bus.client import ServiceClient
from photonic_testbed.hil.devices.service import DeviceService
from photonic_testbed.hil.rig import rig_spec
from tests.test_datacenter_rig import SMALL


@pytest.fixture
def three_switches(tmp_path):
    """Three OCS services (8 x 8: inputs 1..8, outputs 9..16) of a small rail rig on their
    sockets, each on its own thread with its own stop; yields (rig, [(service, stop, thread,
    request endpoint)], the emulator)."""
    desc = tmp_path / "small.toml"
    desc.write_text(SMALL)
    spec = rig_spec(str(desc))
    with EmulatedRig(spec, switching_s=0.0) as emu:
        rig = rigfile.for_emulator(spec, emu.endpoints)
        served = []
        try:
            for s in rig.service_specs()[:3]:
                service = DeviceService(s)
                request, _ = service.bind()
                stop = threading.Event()
                t = threading.Thread(target=service.serve, args=(stop,), daemon=True)
                t.start()
                served.append((service, stop, t, request))
            yield rig, served, emu
        finally:
            for service, stop, t, _ in served:
                stop.set()
                t.join(5)
                service.close()


def _switches(served, timeout=60.0) -> list[BusSwitch]:
    return [BusSwitch(service.name, ServiceClient(request, timeout=timeout))
            for service, _, _, request in served]


def _read(served) -> list[dict[int, int]]:
    """Each switch's circuits as its own service reads them from the emulated OCS."""
    out = []
    for _, _, _, request in served:
        with ServiceClient(request, timeout=10) as c:
            out.append({int(i): int(o) for i, o in c.call("read_circuits")["circuits"]})
    return out


def test_every_switch_written_and_each_report_is_its_own(three_switches):
    rig, served, emu = three_switches
    switches = _switches(served)
    want = [{1: 9, 2: 10}, {3: 11}, {}]
    got = BusSwitch.apply_together(list(zip(switches, want, strict=True)))
    assert all(isinstance(r, ApplyReport) for r in got), got
    assert [r.added for r in got] == want
    assert _read(served) == want
    # again with a change on one: the others report nothing added or removed
    want2 = [{1: 9, 2: 10}, {3: 12}, {}]
    got = BusSwitch.apply_together(list(zip(switches, want2, strict=True)))
    assert [(r.added, r.removed) for r in got] == [({}, {}), ({3: 12}, {3: 11}), ({}, {})]
    assert _read(served) == want2
    for sw in switches:
        sw.close()


def test_a_switch_changed_under_the_agent_is_reread_and_written(three_switches):
    rig, served, emu = three_switches
    switches = _switches(served)
    BusSwitch.apply_together([(sw, {1: 9}) for sw in switches])
    with ServiceClient(served[1][3], timeout=10) as other:      # another client moves one
        other.call("apply_circuits", circuits=[[5, 14]])
    want = [{2: 10}, {2: 10}, {2: 10}]
    got = BusSwitch.apply_together(list(zip(switches, want, strict=True)))
    assert all(isinstance(r, ApplyReport) for r in got), got
    assert got[1].removed == {5: 14}                 # what the other client had set
    assert _read(served) == want
    for sw in switches:
        sw.close()


def test_a_refusal_or_impossible_circuits_fail_alone(three_switches):
    """One switch's service refuses its circuits (the agent believed it larger than it is),
    another's circuits fail the agent's own check before anything is sent: each fails alone,
    the third is written; no answer is waited for past what comes back."""
    rig, served, emu = three_switches
    switches = _switches(served)
    switches[2]._ports = 16                          # a belief the switch (8 x 8) refutes
    got = BusSwitch.apply_together([(switches[0], {1: 9}), (switches[1], {1: 9, 2: 9}),
                                    (switches[2], {1: 20})])
    assert isinstance(got[0], ApplyReport) and got[0].added == {1: 9}
    assert isinstance(got[1], CircuitConflict) and "port 9 is in two circuits" in str(got[1])
    assert isinstance(got[2], SwitchError) and "port 20 does not exist" in str(got[2])
    assert _read(served) == [{1: 9}, {}, {}]
    with pytest.raises(SwitchError, match="port 20 does not exist"):
        switches[2].apply({1: 20})                   # one switch: the same path
    for sw in switches:
        sw.close()
