"""The agent as a bus process: `ptb agent` against emulated switches, GPU health on the bus,
the job side through hil.job.fabric_client.Fabric; and `ptb demo` end to end."""
from __future__ import annotations

import contextlib
import os
import pathlib
import signal
import subprocess
import sys
import threading
import time

import pytest
import zmq

from photonic_testbed.common.jobplan import dp_ring, dp_tp
from photonic_testbed.common.rack_layout import layout
from photonic_testbed.emulator.rig import EmulatedRig
from photonic_testbed.hil import rig as rigfile
from photonic_testbed.hil.agent.entries import Swap
from photonic_testbed.hil.agent.sqlite_journal import SqliteJournal
from photonic_testbed.hil.bus.client import RemoteError, ServiceClient
from photonic_testbed.hil.devices.service import DeviceService
from photonic_testbed.hil.job.fabric_client import Fabric
from photonic_testbed.hil.rig import rig_spec

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _ptb(*args, **kw):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.Popen([sys.executable, "-m", "photonic_testbed.ptb", *args], cwd=ROOT,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            **kw)


def _until(cond, timeout=20.0, what="condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = cond()
        if got:
            return got
        time.sleep(0.02)
    raise AssertionError(f"{what} not reached within {timeout} s")


def _stop(proc):
    if proc is not None and proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            return proc.communicate(timeout=10)[0]
        except subprocess.TimeoutExpired:
            proc.kill()
            return proc.communicate()[0]
    return proc.communicate()[0] if proc is not None else ""


def _on_the_bus(emu, name: str, device: str, path):
    """Rig file, rack and the switch's service for an emulated rig. Endpoints are free ports
    picked before binding (as `ptb emulate --write-rig` does): another process on the machine
    may take one first, so a failed bind picks new ones (at most 3 tries)."""
    lay = emu.spec.rack_layout() or layout(name)
    gpus = tuple(rigfile.GpuConfig(g, a[0].switch, a[0].tx, g in lay.spares)
                 for g, a in lay.gpus.items())
    for attempt in range(3):
        bus = rigfile.for_emulator(name, emu.endpoints, gpus=gpus)
        service = DeviceService(bus.service_specs([device])[0])
        try:
            if emu.rack is None:
                emu.start_rack(bus.gpus_endpoints(), bus.agent_endpoints())
            service.bind()
        except zmq.ZMQError:
            service.close()
            if emu.rack is not None:
                emu.rack.close()
                emu.rack = None
            if attempt == 2:
                raise
            continue
        rigfile.write(path, bus)
        return service


@contextlib.contextmanager
def agent_on_thread(rig, journal, timeout: float = 10.0):
    """The rig's agent (an AgentProcess of this process) running its loop on a thread."""
    from photonic_testbed.hil.agent.bus import AgentProcess
    agent = AgentProcess(rig, str(journal), timeout=timeout)
    agent.start()
    stop = threading.Event()
    thread = threading.Thread(target=agent.run, args=(stop,), daemon=True)
    thread.start()
    try:
        yield agent
    finally:
        stop.set()
        thread.join(10)
        agent.close()


def _serve(service):
    stop = threading.Event()
    t = threading.Thread(target=service.serve, args=(stop,), daemon=True)
    t.start()

    def close():
        stop.set()
        t.join(5)
        service.close()
    return close


@contextlib.contextmanager
def _rig_on_bus(tmp_path, name, device, spec=None, **options):
    """An emulated rig (instruments + rack in this process) with its switch `device` served on
    a thread; yields (rig, rig file, its path). `spec`: the rig's RigSpec (named `name`), if
    not the named one."""
    rig = EmulatedRig(spec or rig_spec(name), **options)
    rig.start()
    path = tmp_path / "rig.toml"
    try:
        close = _serve(_on_the_bus(rig, name, device, path))
    except BaseException:
        rig.close()
        raise
    try:
        yield rig, rigfile.load(path), path
    finally:
        close()
        rig.close()


@pytest.fixture
def opus_bus(tmp_path):
    """The opus rig: emulated OCS + rack in this process, the OCS service on a thread."""
    with _rig_on_bus(tmp_path, "opus", "ocs", switching_s=0.0) as bus:
        yield bus


def _agent(path, journal):
    proc = _ptb("agent", "--rig", str(path), "--journal", str(journal))
    rig = rigfile.load(path)
    with ServiceClient(rig.agent_endpoints()[0], timeout=20) as c:
        try:
            c.call("ping")
        except Exception as e:
            raise AssertionError(f"agent did not answer:\n{_stop(proc)}") from e
    return proc


def test_agent_killed_mid_swap_over_the_bus_finishes_without_extra_moves(opus_bus, tmp_path):
    emu, rig, path = opus_bus
    journal = tmp_path / "journal.db"
    physics = emu.optics.physics
    agent = _agent(path, journal)
    fabric = None
    try:
        fabric = Fabric(*rig.agent_endpoints(), timeout=10)
        rank_map = fabric.admit(dp_ring(8))
        assert fabric.phase("dp")["granted"]
        ring = [(rank_map[r], rank_map[(r + 1) % 8]) for r in range(8)]
        assert all(t is not None and t.up for t in emu.rack.rack.link_map(ring).values())
        with ServiceClient(rig.agent_endpoints()[0], timeout=5) as c:
            with pytest.raises(RemoteError, match="no GPU 'gpu99'"):
                c.call("swap", gpu="gpu99")
            state = c.call("snapshot")["state"]
        assert [g["role"] for g in state["rack"]] == ["active"] * 8 + ["spare"] * 2
        assert state["rank_map"] == {str(r): g for r, g in rank_map.items()}

        physics.switching_s = 1.5               # a slow move: the kill lands inside it
        emu.rack.rack.faults.fail_gpu("server5")
        with SqliteJournal(journal) as j:
            swap = _until(lambda: [e for e in j.entries(kinds=("decision",))
                                   if isinstance(e.details, Swap)], what="swap decision")
        swap_seq = swap[0].seq
        time.sleep(0.3)
        agent.kill()                            # SIGKILL mid-apply
        agent.communicate(timeout=10)
        _until(lambda: not physics._dark_until or
               max(physics._dark_until.values()) < time.monotonic(), what="OCS settled")
        moves = physics.moves
        with SqliteJournal(journal) as j:
            assert not j.entries(since=swap_seq, kinds=("rank_map",))   # never announced

        agent = _agent(path, journal)
        order = fabric.wait_restart(timeout=20)
        assert order is not None, "no restart order after the agent came back"
        new_map, cause = order
        assert new_map == {**rank_map, 5: "spare0"}       # server5's rank on the first spare
        assert cause.startswith("resume")
        assert physics.moves == moves                     # no extra switch moves
        ring = [(new_map[r], new_map[(r + 1) % 8]) for r in range(8)]
        assert all(t is not None and t.up for t in emu.rack.rack.link_map(ring).values())
        with SqliteJournal(journal) as j:
            rec = [e for e in j.entries(kinds=("reconcile",)) if e.details.moves is not None]
            assert rec[-1].details.moves == {"ocs": 0}
    finally:
        if fabric is not None:
            fabric.close()
        _stop(agent)


def test_a_snapshot_sees_every_change_answered_before_it(opus_bus, tmp_path):
    """An admission is answered once its circuits are worked out beside the agent: a snapshot
    queued right behind it is answered meanwhile, without the job (no request answered before
    it had admitted it); one sent once the admit is answered shows the job, although the agent
    publishes once no request waits. Both first requests are sent before either is answered."""
    emu, rig, path = opus_bus
    agent = _agent(path, tmp_path / "journal.db")
    try:
        with ServiceClient(rig.agent_endpoints()[0], timeout=10) as c:
            deadline = time.monotonic() + 10
            admit = c.send("admit", {"plan": dp_ring(8).to_dict(), "job": "pipelined"}, wait=5)
            snap = c.send("snapshot")
            before = c.receive(snap, deadline)["state"]
            rank_map = c.receive(admit, deadline)["rank_map"]
            state = c.call("snapshot")["state"]
        assert before["jobs"] == {}
        assert len(rank_map) == 8
        assert state["rank_map"] == rank_map
        assert list(state["jobs"]) == ["pipelined"]
    finally:
        _stop(agent)


def test_demo_end_to_end_one_gpu_failure(tmp_path):
    """`ptb demo --headless`: emulator, the seeded chip calibrated, services, agent as
    processes; gpu6 fails; the job resumes on a spare, never communicating over a down link."""
    proc = _ptb("demo", "--headless", "--seconds", "0.5", "--gpu", "gpu6",
                "--workdir", str(tmp_path))
    try:
        out = proc.communicate(timeout=400)[0]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, out
    assert (tmp_path / "calibration.json").exists()
    for line in ("calibration of 56 heaters", "failure injected", "detected by the agent",
                 "circuits applied",
                 "verified by light", "job resumed", "demo succeeded"):
        assert line in out, out
    assert "gpu6 -> spare0" in out
    assert "communications over a down link: 0" in out
    assert "gpu6" not in out.split("ranks now on")[1].split(";")[0]


@pytest.fixture
def lumion_bus(tmp_path):
    """The lumion rig (ideal chip): instruments + rack in this process, the chip service (the
    mesh owning the DAC) on a thread."""
    with _rig_on_bus(tmp_path, "lumion", "chip", ideal_chip=True) as bus:
        yield bus


def _ring_up(rack, rank_map):
    n = len(rank_map)
    ring = [(rank_map[r], rank_map[(r + 1) % n]) for r in range(n)]
    return all(t is not None and t.up for t in rack.link_map(ring).values())


def test_lumion_two_failures_at_once_then_spares_exhausted_over_the_bus(lumion_bus, tmp_path):
    emu, rig, path = lumion_bus
    rack = emu.rack.rack
    agent = _agent(path, tmp_path / "journal.db")
    fabric = None
    try:
        fabric = Fabric(*rig.agent_endpoints(), timeout=10)
        rank_map = fabric.admit(dp_ring(8))
        fabric.phase("dp")
        assert _ring_up(rack, rank_map)          # the chip's physics carries the ring

        rack.faults.fail_gpu("gpu1")             # two at once: one health delta, one swap
        rack.faults.fail_gpu("gpu6")
        got = fabric.wait_restart(timeout=20)
        assert got is not None
        new_map, _ = got
        if {"gpu1", "gpu6"} & set(new_map.values()):      # the two came as two events
            got = fabric.wait_restart(timeout=20)
            assert got is not None
            new_map, _ = got
        assert sorted(g for g in new_map.values() if g.startswith("spare")) == \
            ["spare0", "spare1"]
        assert {new_map[1], new_map[6]} == {"spare0", "spare1"}
        assert _ring_up(rack, new_map)

        rack.faults.fail_gpu("gpu3")             # no spare left: the DP ring shrinks
        got = fabric.wait_restart(timeout=20)
        assert got is not None
        small, _ = got
        assert len(small) == 7 and "gpu3" not in small.values()
        assert _ring_up(rack, small)
        with ServiceClient(rig.agent_endpoints()[0], timeout=5) as c:
            state = _until(lambda: (s := c.call("snapshot")["state"])["alarms"] and s,
                           what="alarm published")
        assert any("no healthy spare for gpu3" in a for a in state["alarms"])
        roles = {g["name"]: (g["role"], g["health"]) for g in state["rack"]}
        assert roles["spare0"] == ("in_use_spare", "ok")
        assert roles["gpu3"] == ("active", "failed")
    finally:
        if fabric is not None:
            fabric.close()
        _stop(agent)


def test_received_powers_in_one_transfer_equal_the_sum_per_transmitter():
    """What the GPU monitor's rx_power reports (one transfer with every live TX lit) is the
    per-transmitter sum the rack's link model uses, faults included."""
    from photonic_testbed.emulator.rack import EmulatedRack
    with EmulatedRig(rig_spec("lumion"), ideal_chip=True) as emu:
        rack = EmulatedRack(layout("lumion"), {"chip": emu.chip})
        rack.faults.fail_gpu("gpu2")
        rack.faults.cut_fibre("chip", 20)
        rack.faults.fail_transceiver("gpu5", side="tx")
        ports = list(range(17, 33))
        once = rack.port_powers_dbm("chip", ports)
        for p in ports:
            assert once[p] == pytest.approx(rack.port_power_dbm("chip", p), abs=1e-9)
        assert once[20] < -90
        with pytest.raises(ValueError):
            rack.port_powers_dbm("chip", [40])


def test_a_subscribers_mirror_follows_phases_swaps_and_releases_from_small_deltas(opus_bus,
                                                                                   tmp_path):
    """The agent publishes a job's changed fields alone: a phase switch's delta carries the
    job's phase and round, not its rank map; a mirror built from deltas equals a snapshot after
    phase switches, a swap (a new rank map) and the job's release."""
    from photonic_testbed.hil.bus.mirror import StateSubscriber
    emu, rig, path = opus_bus
    agent = _agent(path, tmp_path / "journal.db")
    deltas: list = []
    sub = StateSubscriber({"agent": rig.agent_endpoints()}, telemetry=False,
                          on_state=lambda d, s, ops: deltas.append(ops))
    try:
        with ServiceClient(rig.agent_endpoints()[0], timeout=10) as c:
            _until(lambda: (sub.poll(0.05), sub.state("agent") is not None)[1],
                   what="the agent's snapshot")
            rank_map = c.call("admit", plan=dp_tp(4).to_dict(), job="j")["rank_map"]

            def caught_up() -> bool:
                sub.poll(0.05)
                return sub.state("agent") == c.call("snapshot")["state"]
            _until(caught_up, what="the mirror equal to a snapshot after the admission")
            deltas.clear()
            for phase in ("dp", "tp", "dp"):      # from tp (the first) to dp
                c.call("phase", phase=phase, round=0, job="j")
            _until(caught_up, what="the mirror equal to a snapshot after the phases")
            paths = [op.path for ops in deltas if ops for op in ops]
            assert ["jobs", "j", "phase"] in paths, paths
            assert not any(p[0] == "rank_map" or p[-1] == "rank_map" or p[-1] in ("jobs", "j")
                           for p in paths), paths
            assert sub.state("agent")["jobs"]["j"]["rank_map"] == rank_map
            assert c.call("swap", gpu=rank_map["3"])["swaps"] == {rank_map["3"]: "server4"}
            _until(caught_up, what="the mirror equal to a snapshot after the swap")
            moved = sub.state("agent")["jobs"]["j"]["rank_map"]
            assert moved != rank_map and sub.state("agent")["rank_map"] == moved
            c.call("release", job="j")
            _until(caught_up, what="the mirror equal to a snapshot after the release")
            assert sub.state("agent")["jobs"] == {} and sub.state("agent")["rank_map"] == {}
    finally:
        sub.close()
        _stop(agent)
