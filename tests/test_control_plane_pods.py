"""One agent group per pod on a datacenter rig (`ptb emulate --groups pods`): each group's
replicas elect their leader on a journal of their own on one real 3-member etcd cluster, and
each group alone manages its pod's rail OCSes and spares. A pod whose agents are all killed
holds its circuits (fail static) while the other pod's job switches phases and its leader's
term stays; the pod's replica started again leads, fences only its pod's switches and finishes
the failover that came meanwhile. A job is admitted by its pod's leader; one that spans pods is
refused, saying why."""
from __future__ import annotations

import contextlib
import json
import signal
import threading

import pytest

from photonic_testbed.emulator.control import request
from photonic_testbed.emulator.rig import EmulatedRig
from photonic_testbed.hil import rig as rigfile
from photonic_testbed.hil.agent.etcd_journal import EtcdJournal
from photonic_testbed.hil.agent.leadership import Leadership
from photonic_testbed.hil.bus.client import ServiceClient
from photonic_testbed.hil.devices.service import DeviceService
from photonic_testbed.hil.etcd.client import Etcd
from photonic_testbed.hil.etcd.cluster import LocalCluster
from photonic_testbed.hil.job.fabric_client import Fabric
from photonic_testbed.hil.rig import RigFileError, rig_spec
from photonic_testbed.ptb.emulate import with_replicas
from tests.test_agent_bus import _ptb, _stop, _until
from tests.test_datacenter_rig import SMALL
from tests.test_datacenter_tenants import TIMEOUT_S, on_the_switches, ports_of, rail_plan


def _spec(tmp_path):
    desc = tmp_path / "small.toml"
    desc.write_text(SMALL)
    return rig_spec(str(desc))


def _pod_rig(tmp_path, spec, endpoints):
    """The rig file of `spec`'s instruments at `endpoints`, one agent group per pod (2
    replicas each), as `ptb emulate --replicas 2 --groups pods` writes it."""
    lay = spec.rack_layout()
    rig = with_replicas(rigfile.for_emulator(spec, endpoints, gpus=tuple(
        rigfile.GpuConfig(g, atts[0].switch, atts[0].tx, g in lay.spares,
                          server=lay.servers[g]) for g, atts in lay.gpus.items())), 2, True)
    path = tmp_path / "rig.toml"
    rigfile.write(path, rig)
    return rig, path


@contextlib.contextmanager
def _pods(tmp_path):
    """SMALL (2 pods of 8 servers, 16 OCSes) served in this process, its rig file with one
    agent group per pod (2 replicas each), and a 3-member etcd; yields (rig, control endpoint,
    etcd cluster, start(replica) -> process)."""
    spec = _spec(tmp_path)
    stop = threading.Event()
    services, threads, procs = [], [], {}
    with LocalCluster(3, tmp_path / "etcd") as etcd, EmulatedRig(spec, switching_s=0.0) as emu:
        rig, path = _pod_rig(tmp_path, spec, emu.endpoints)
        emu.start_rack(rig.gpus_endpoints(), None)

        def start(replica, lease=1):
            group = replica.partition("-")[0]
            procs[replica] = _ptb("agent", "--rig", str(path), "--replica", replica,
                                  "--journal", f"etcd://{etcd.endpoints}/{group}",
                                  "--quarantine", "0", "--lease", str(lease))
            return procs[replica]
        try:
            for s in rig.service_specs():
                services.append(DeviceService(s))
                services[-1].bind()
                threads.append(threading.Thread(target=services[-1].serve, args=(stop,),
                                                daemon=True))
                threads[-1].start()
            yield rigfile.load(path), emu.endpoints["control"], etcd, start
        finally:
            for p in procs.values():
                _stop(p)
            stop.set()
            for t in threads:
                t.join(5)
            for service in services:
                service.close()


def _leader(etcd, group: str) -> dict | None:
    kv = Etcd(etcd.endpoints).get(f"/ptb/{group}/leader")
    return json.loads(kv.value) if kv else None


def _fabric(rig, group: str, job: str) -> Fabric:
    """A job's client of its pod's agent group (it follows whichever replica leads)."""
    view = rig.group_view(group)
    return Fabric(*view.agent_endpoints(), replicas=view.agent_replicas(), job=job,
                  timeout=TIMEOUT_S)


def _terms(rig, switches) -> dict[str, int]:
    out = {}
    for name in switches:
        with ServiceClient(rig.endpoints()[name][0], timeout=TIMEOUT_S) as c:
            out[name] = int(c.call("ping")["term"])
    return out


def test_a_pod_without_agents_holds_its_circuits_and_touches_no_other_pod(tmp_path):
    with _pods(tmp_path) as (rig, control, etcd, start):
        assert set(rig.groups) == {"pod0", "pod1"}
        assert rig.groups["pod1"].devices == tuple(f"rail{k}-pod1" for k in range(8))
        first = start("pod0-r0")
        # pod 1 must lead at term 1 throughout: a lease long enough that a loaded machine
        # does not let it lapse (pod 0's, short: its replica takes over within the test)
        start("pod1-r0", lease=10)
        for group in ("pod0", "pod1"):
            _until(lambda g=group: _leader(etcd, g), timeout=TIMEOUT_S, what=f"{group} led")
        a, b = _fabric(rig, "pod0", "a"), _fabric(rig, "pod1", "b")
        try:
            map_a = a.admit(rail_plan("a", 2))          # by pod 0's leader: its servers
            map_b = b.admit(rail_plan("b", 2))          # by pod 1's leader: its servers
            assert {rig.group_of(map_a.values()), rig.group_of(map_b.values())} == \
                {"pod0", "pod1"} and rig.group_of(map_a.values()) == "pod0"
            for phase in ("tp", "pp", "dp"):
                assert a.phase(phase)["granted"] and b.phase(phase)["granted"]
            with pytest.raises(RigFileError, match="s0g0, s0g1, s0g2 ... by pod0; s8g0 by"):
                rig.group_of([*(f"s0g{k}" for k in range(8)), "s8g0"])
            # every agent of pod 0 dies; a GPU of job a fails while none leads there
            pod0 = ports_of(rig, map_a.values())
            held = on_the_switches(control, pod0)
            first.send_signal(signal.SIGKILL)
            first.communicate(timeout=10)
            request(control, {"cmd": "fail_gpu", "gpu": map_a[9]})          # s1g1
            pod1 = ports_of(rig, map_b.values())
            before = on_the_switches(control, pod1)
            for _ in range(5):                          # pod 1's job runs on, phase by phase
                for phase in ("pp", "dp"):
                    assert b.phase(phase)["granted"]
            after = on_the_switches(control, pod1)
            assert all(after[s][0] == before[s][0] for s in pod1)       # its circuits, again
            assert on_the_switches(control, pod0) == held               # pod 0's: held
            assert _leader(etcd, "pod1")["term"] == 1
            # pod 0's other replica starts, leads, fences pod 0's switches and swaps
            start("pod0-r1", lease=10)      # (it leads at term 2 throughout: a long lease)
            order = a.wait_restart(TIMEOUT_S)
            assert order is not None, "pod 0's new leader gave no restart order"
            new_map, _ = order
            assert new_map[9] != map_a[9] and rig.group_of(new_map.values()) == "pod0"
            assert _leader(etcd, "pod0") == {**_leader(etcd, "pod0"), "name": "pod0-r1",
                                             "term": 2}
            assert set(_terms(rig, rig.groups["pod0"].devices).values()) == {2}
            assert set(_terms(rig, rig.groups["pod1"].devices).values()) == {1}
            assert b.phase("dp")["granted"] and a.phase("dp")["granted"]
            # pod 1's journal never heard of pod 0's GPU
            e = Etcd(etcd.endpoints, timeout=TIMEOUT_S)
            words = [x.line() for x in EtcdJournal(e, Leadership(e, "pod1", {"name": "r"}))
                     .entries()]
            assert words and not [w for w in words if "s1g1" in w]
        finally:
            a.close()
            b.close()


def test_a_replica_runs_only_in_its_groups_journal(tmp_path):
    """A replica given another group's journal, or none named on a grouped rig, says so; the
    rig file's groups are checked."""
    spec = _spec(tmp_path)
    rig, path = _pod_rig(tmp_path, spec, {s: f"TCPIP::127.0.0.1::{1000 + i}::SOCKET" for i, s
                                          in enumerate(spec.rack_layout().switches)})
    assert rigfile.load(path).groups == rig.groups
    wrong = _ptb("agent", "--rig", str(path), "--replica", "pod0-r0",
                 "--journal", "etcd://127.0.0.1:9/pod1")
    out = wrong.communicate(timeout=TIMEOUT_S)[0]
    assert wrong.returncode == 1 and "the journal of agent group 'pod1', but this replica is " \
        "of group 'pod0'" in out, out
    none = _ptb("agent", "--rig", str(path), "--journal", str(tmp_path / "j.db"))
    out = none.communicate(timeout=TIMEOUT_S)[0]
    assert none.returncode == 1 and "has agent groups (pod0, pod1): name the replica" in out, out
    text = path.read_text()
    for change, why in (
            (('"rail0-pod1", ', '"rail0-pod1", "rail0-pod0", '), "devices of no other group "
             "(rail0-pod0 is in group pod0)"),
            (('"rail0-pod1", ', '"ocs9", '), "names from [devices]"),
            (('replicas = ["pod1-r0", "pod1-r1"]', 'replicas = ["pod1-r0"]'),
             "replicas.pod1-r1: expected a replica of one of the [groups]"),
            (('replicas = ["pod1-r0", "pod1-r1"]', 'replicas = []'), "at least one replica"),
            (("[groups.pod1]", '[groups.""]'), "a group name of letters"),
            (("[groups.pod1]", '[groups."a/b"]'), "a group name of letters")):
        bad = tmp_path / "bad.toml"
        bad.write_text(text.replace(*change))
        with pytest.raises(RigFileError, match=why.replace("[", "\\[").replace("(", "\\(")
                           .replace(")", "\\)")):
            rigfile.load(bad)
