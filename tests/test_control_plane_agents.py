"""Replicated agents on a real 3-member etcd cluster, through the real processes: two `ptb agent`
replicas of one group on the opus rig (its OCS served on the bus, the job's fabric client finding
the leader among the rig's [replicas]). The leader killed (kill -9) in the middle of a swap, or
paused (SIGSTOP) past its lease: the job runs again on the spare with the other replica leading,
the switch holds the intended circuits, no circuit is moved twice, and a paused leader resumed
moves nothing."""
from __future__ import annotations

import contextlib
import dataclasses
import json
import signal
import time

import pytest

from photonic_testbed.common.jobplan import dp_ring
from photonic_testbed.hil import rig as rigfile
from photonic_testbed.hil.agent.entries import Swap
from photonic_testbed.hil.agent.etcd_journal import EtcdJournal
from photonic_testbed.hil.agent.leadership import Leadership
from photonic_testbed.hil.bus.client import NotLeader, ServiceClient
from photonic_testbed.hil.etcd.client import Etcd
from photonic_testbed.hil.etcd.cluster import LocalCluster
from photonic_testbed.hil.job.fabric_client import Fabric
from tests.test_agent_bus import _ptb, _rig_on_bus, _stop, _until

GROUP = "opus"


@contextlib.contextmanager
def _group(tmp_path, names=("a", "b")):
    """etcd (3 members), the opus rig on the bus with [replicas] for `names`, and a replica
    process each; yields (emu, rig, etcd cluster, start(name) -> process, processes)."""
    with LocalCluster(3, tmp_path / "etcd") as etcd, \
            _rig_on_bus(tmp_path, "opus", "ocs", switching_s=0.0) as (emu, rig, path):
        ports = rigfile.free_ports(2 * len(names))
        replicas = {n: (f"tcp://127.0.0.1:{ports[2 * i]}", f"tcp://127.0.0.1:{ports[2 * i + 1]}")
                    for i, n in enumerate(names)}
        rig = dataclasses.replace(rig, replicas=replicas)
        rigfile.write(path, rig)
        emu.rack.agent_replicas = rig.agent_replicas()
        url = f"etcd://{etcd.endpoints}/{GROUP}"
        procs: dict = {}

        def start(name):
            procs[name] = _ptb("agent", "--rig", str(path), "--journal", url, "--replica", name,
                               "--quarantine", "0")
            return procs[name]
        try:
            for n in names:
                start(n)
            yield emu, rig, etcd, start, procs
        finally:
            for p in procs.values():
                _stop(p)


def _leader(etcd) -> dict | None:
    kv = Etcd(etcd.endpoints).get(f"/ptb/{GROUP}/leader")
    return json.loads(kv.value) if kv else None


def _journal(etcd) -> EtcdJournal:
    """The group's journal, to read (a Leadership that never campaigns)."""
    e = Etcd(etcd.endpoints, timeout=5)
    return EtcdJournal(e, Leadership(e, GROUP, {"name": "reader"}))


def _refusal(rig, replica: str) -> str:
    """What replica `replica` answers an operator's swap: a standby's NotLeader."""
    with ServiceClient(rig.agent_replicas()[replica][0], timeout=10) as c:
        with pytest.raises(NotLeader) as refused:
            c.call("swap", gpu="server1")
    return str(refused.value)


def _admitted(emu, rig):
    fabric = Fabric(*rig.agent_endpoints(), replicas=rig.agent_replicas(), timeout=10)
    rank_map = fabric.admit(dp_ring(8))
    assert fabric.phase("dp")["granted"]
    ring = [(rank_map[r], rank_map[(r + 1) % 8]) for r in range(8)]
    assert all(t is not None and t.up for t in emu.rack.rack.link_map(ring).values())
    return fabric, rank_map


def test_the_leader_killed_mid_swap_a_standby_finishes_it_once(tmp_path):
    with _group(tmp_path) as (emu, rig, etcd, start, procs):
        physics = emu.optics.physics
        first = _until(lambda: _leader(etcd), timeout=30, what="a leader")
        assert first["term"] == 1
        standby = next(n for n in procs if n != first["name"])
        _until(lambda: f"replica '{first['name']}' leads" in _refusal(rig, standby),
               what="the standby naming the leader")
        fabric, rank_map = _admitted(emu, rig)
        try:
            physics.switching_s = 1.5                   # a slow move: the kill lands inside it
            emu.rack.rack.faults.fail_gpu("server5")
            journal = _journal(etcd)
            swap = _until(lambda: [e for e in journal.entries(kinds=("decision",))
                                   if isinstance(e.details, Swap)], what="the swap decided")
            time.sleep(0.3)
            killed_at = time.monotonic()
            procs[first["name"]].send_signal(signal.SIGKILL)
            procs[first["name"]].communicate(timeout=10)
            _until(lambda: not physics._dark_until or
                   max(physics._dark_until.values()) < time.monotonic(), what="OCS settled")
            moves = physics.moves
            assert not journal.entries(since=swap[0].seq, kinds=("rank_map",))  # not announced
            order = fabric.wait_restart(timeout=30)
            took = time.monotonic() - killed_at
            assert order is not None, "no restart order from the new leader"
            new_map, cause = order
            assert new_map == {**rank_map, 5: "spare0"} and cause.startswith("resume")
            now = _leader(etcd)
            assert now["name"] == standby and now["term"] == 2
            start(first["name"])                        # back, as a standby
            assert physics.moves == moves               # nothing moved twice
            ring = [(new_map[r], new_map[(r + 1) % 8]) for r in range(8)]
            assert all(t is not None and t.up for t in emu.rack.rack.link_map(ring).values())
            truth = physics.truth()         # the switch holds what the journal intends
            assert truth["actual"] == truth["commanded"] == dict(journal.intended()["ocs"])
            reconciled = [e for e in journal.entries(kinds=("reconcile",))
                          if e.details.moves is not None]
            assert reconciled[-1].details.moves == {"ocs": 0}
            with ServiceClient(rig.endpoints()["ocs"][0], timeout=5) as c:
                assert c.call("ping")["term"] == 2      # the device fenced at the new term
            _until(lambda: f"replica '{standby}' leads" in _refusal(rig, first["name"]),
                   what="the restarted replica, a standby, naming the new leader")
            print(f"leader killed mid swap: restart order {took:.2f} s after the kill")
        finally:
            fabric.close()


def test_a_leader_paused_past_its_lease_moves_nothing_when_it_resumes(tmp_path):
    with _group(tmp_path) as (emu, rig, etcd, start, procs):
        physics = emu.optics.physics
        first = _until(lambda: _leader(etcd), timeout=30, what="a leader")
        fabric, rank_map = _admitted(emu, rig)
        try:
            paused = procs[first["name"]]
            paused.send_signal(signal.SIGSTOP)
            try:
                now = _until(lambda: (lambda w: w if w and w["name"] != first["name"] else None)(
                    _leader(etcd)), timeout=15, what="another replica leading")
                assert now["term"] == first["term"] + 1
                emu.rack.rack.faults.fail_gpu("server3")    # the paused leader hears it later
                order = fabric.wait_restart(timeout=30)
                assert order is not None and order[0] == {**rank_map, 3: "spare0"}
                moves = physics.moves
            finally:
                paused.send_signal(signal.SIGCONT)
            time.sleep(2.0)               # the resumed replica acts on what it heard, if at all
            assert physics.moves == moves, "the deposed leader moved a switch"
            assert _leader(etcd)["name"] == now["name"]
            with ServiceClient(rig.endpoints()["ocs"][0], timeout=5) as c:
                assert c.call("ping")["term"] == now["term"]
            assert fabric.wait_restart(timeout=0.5) is None      # no order from the old one
        finally:
            fabric.close()
        out = _stop(paused)
        assert "lost the lead" in out or "no longer leads" in out, out
