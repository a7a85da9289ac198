"""Links that fade or flap: a waveguide of the chip that loses light (emulator.link_fade), found
by the agent from the receivers' power (hil.agent.linkwatch) and the circuit moved to other
cells of the chip (drivers.mesh `Mesh.move`) while the job runs, no rank changed. Through real
parts: the emulated lumion rig with its GPUs on alternate ports, the chip service on a thread,
the agent in this process on its own loop, the emulated job on the rack's optics."""
from __future__ import annotations

import contextlib
import dataclasses
import random

import pytest
from test_agent_bus import _rig_on_bus, agent_on_thread

from photonic_testbed.common.rack_layout import layout
from photonic_testbed.common.topology import build
from photonic_testbed.drivers.circuit_switch import SwitchError
from photonic_testbed.drivers.heater_dac import HeaterDAC
from photonic_testbed.drivers.mesh import Mesh
from photonic_testbed.drivers.routing import (
    avoiding,
    benes_cell_states,
    circuits_to_permutation,
    trace_path,
    trace_states,
)
from photonic_testbed.emulator.chip import ChipError
from photonic_testbed.emulator.mesh_chip import make_chip
from photonic_testbed.emulator.rig import EmulatedRig
from photonic_testbed.hil.agent.config import AgentConfig
from photonic_testbed.hil.agent.entries import LinkFade, Swap
from photonic_testbed.hil.agent.linkwatch import LinkWatch
from photonic_testbed.hil.agent.sqlite_journal import SqliteJournal
from photonic_testbed.hil.bus.client import ServiceClient
from photonic_testbed.hil.lab.control_client import ControlError, request
from photonic_testbed.hil.rig import rig_spec
from tests.timeouts import DEVICE_S, wait_until

TIMEOUT_S = 10.0
WAIT_S = 60.0            # bounded waits on a loaded machine (a move takes a few seconds)
ALTERNATE = dataclasses.replace(rig_spec("lumion"), cabling="alternate")


def ring(lay) -> dict[int, int]:
    """The circuits of an 8-GPU ring on a rack's chip: gpu k -> gpu k + 1."""
    gpus = [f"gpu{k}" for k in range(8)]
    return {lay.gpus[gpus[k]][0].tx: lay.gpus[gpus[(k + 1) % 8]][0].rx for k in range(8)}


# ---- routing: where a moved circuit can go ---------------------------------------------------

@pytest.mark.parametrize("cabling, avoidable", [("consecutive", False), ("alternate", True)])
def test_only_gpus_on_alternate_ports_leave_a_benes_chip_other_waveguides(cabling, avoidable):
    """With the GPUs on the first ports, every routing lights the same waveguides (each first-
    and last-stage cell carries two circuits, and so on inwards): a move would hand the loss to
    another circuit. On alternate ports every inner waveguide of a circuit can be left dark."""
    topo = build("benes", 16)
    circuits = ring(layout("lumion") if cabling == "consecutive" else ALTERNATE.rack_layout())
    perm = circuits_to_permutation(circuits, 16)
    states = benes_cell_states(perm)
    for seed in range(20):          # every drawn routing makes the same permutation
        assert trace_states(topo, benes_cell_states(perm, random.Random(seed))) == perm
    free = 0
    for i in circuits:
        path, out = trace_path(topo, states, i)
        assert out == circuits[i]
        _, _, crossings = avoiding(topo, perm, circuits, path[1:-1], moved=[i])
        free += crossings == 0
    assert free == (len(circuits) if avoidable else 0)


# ---- the chip: a waveguide that fades or flaps ------------------------------------------------

def test_a_fading_waveguide_loses_light_at_its_rate_up_to_its_bound_and_a_flap_comes_and_goes():
    now = [100.0]
    topo = build("benes", 16).describe()
    chip = make_chip(topo, ideal=True, clock=lambda: now[0])
    chip.set_voltages({})
    lit = chip.transfer({3: 1.0})
    out = max(lit, key=lit.__getitem__)
    cell, arm = chip.path(3)[3]
    fd = chip.fade(cell, arm, db_per_s=0.5, max_db=6.0)
    assert fd.loss_db(now[0]) == 0
    now[0] += 4.0
    assert chip.transfer({3: 1.0})[out] == pytest.approx(lit[out] * 10 ** -0.2, rel=1e-3)
    now[0] += 100.0
    assert chip.transfer({3: 1.0})[out] == pytest.approx(lit[out] * 10 ** -0.6, rel=1e-3)
    assert chip.fades()[0]["loss_db"] == 6.0
    chip.clear_fades()
    chip.fade(cell, arm, max_db=30.0, period_s=2.0)
    dark = chip.transfer({3: 1.0})[out]
    now[0] += 2.5
    light = chip.transfer({3: 1.0})[out]
    assert dark == pytest.approx(lit[out] * 1e-3, rel=1e-3) and light == pytest.approx(lit[out])
    for bad, match in (({"cell": "s9r9", "arm": 2, "max_db": 3}, "no cell"),
                       ({"cell": cell, "arm": 0, "max_db": 3}, "output arm 2 or 3"),
                       ({"cell": cell, "arm": 2, "max_db": 0}, "above 0 dB"),
                       ({"cell": cell, "arm": 2, "max_db": 3, "db_per_s": -1}, "db_per_s"),
                       ({"cell": cell, "arm": 2, "max_db": float("nan")}, "max_db")):
        with pytest.raises(ChipError, match=match):
            chip.fade(**bad)
    hexagonal = make_chip(build("hexagonal", 4).describe(), ideal=True)
    with pytest.raises(ChipError, match="feed-forward"):
        hexagonal.fade("e0", 2, max_db=3)


# ---- the driver: moving a circuit, remembered -------------------------------------------------

def test_a_moved_circuit_keeps_off_its_waveguides_across_a_restart_until_forgotten(tmp_path):
    with EmulatedRig(ALTERNATE, ideal_chip=True) as emu:
        dac = HeaterDAC(emu.endpoints["dac"], timeout=DEVICE_S)
        dac.open()
        memory = tmp_path / "chip.memory"
        mesh = Mesh("benes16", dac, own_dac=False, memory=memory)
        circuits = ring(ALTERNATE.rack_layout())
        mesh.apply(circuits)
        before = emu.chip.path(3)
        got = mesh.move([3])
        assert mesh.circuits() == circuits                    # the same circuits...
        after = emu.chip.path(3)
        assert set(before[:-1]).isdisjoint(after[:-1])        # ...by other cells
        assert set(got["off"]) == set(before[:-1]) == mesh.avoid
        mesh.apply({**circuits})                              # a later routing keeps off them
        assert emu.chip.path(3) == after
        with pytest.raises(SwitchError, match=r"no circuit asked from input\(s\) \[2\]"):
            mesh.move([2])
        mesh.close()
        again = Mesh("benes16", dac, own_dac=False, memory=memory)
        assert again.avoid == mesh.avoid and again.circuits() == circuits
        assert again.forget() == len(got["off"]) and again.avoid == frozenset()
        again.close()
        assert Mesh("benes16", dac, own_dac=False, memory=memory).avoid == frozenset()
        dac.close()


def test_a_move_that_would_hand_the_loss_to_another_circuit_is_refused(tmp_path):
    with EmulatedRig(rig_spec("lumion"), ideal_chip=True) as emu:
        dac = HeaterDAC(emu.endpoints["dac"], timeout=DEVICE_S)
        dac.open()
        mesh = Mesh("benes16", dac, own_dac=False)
        mesh.apply(ring(layout("lumion")))
        volts = list(dac.commanded)
        with pytest.raises(SwitchError, match="alternate ports"):
            mesh.move([3])
        assert list(dac.commanded) == volts and mesh.avoid == frozenset()
        dac.close()


# ---- the agent's watch, on readings it is given ----------------------------------------------

class _Switch:
    def __init__(self):
        self.moves: list[tuple[list[int], list[int]]] = []

    def move(self, inputs, healthy=()):
        self.moves.append((list(inputs), list(healthy)))
        return {"off": [("s3r2", 2)]}


class _Journal:
    def __init__(self):
        self.said: list[tuple[LinkFade, str]] = []

    def record(self, details, cause):
        self.said.append((details, cause))


def _watch(power, circuits=lambda t: {3: 21, 5: 23}):
    """A LinkWatch over chip circuits (3 -> 21 and 5 -> 23 by default): the power of 3 -> 21 at
    time t, after n moves, is power(t, n); the other's is -2 dBm."""
    now = [0.0]
    sw, journal = _Switch(), _Journal()
    agent = type("A", (), {})()
    agent.config = AgentConfig()
    agent.switches = {"chip": sw}
    agent.writer = type("W", (), {"current": staticmethod(lambda s: circuits(now[0]))})()
    agent.journal = journal
    agent.layout = ALTERNATE.rack_layout()
    agent.diagnosis = type("D", (), {"on_moved": None})()     # (told of the failure path's)

    def read(s, o):
        return power(now[0], len(sw.moves)) if o == 21 else -2.0
    watch = LinkWatch(agent, read, clock=lambda: now[0])

    def run(seconds):              # (the watch reads when it is due: about every second)
        for _ in range(int(seconds * 10)):
            now[0] += 0.1
            watch.tick()
    return run, sw, journal


def test_noise_steps_a_steady_weak_link_and_unanswered_reads_are_not_moved():
    rng = random.Random(7)
    cases = {"DDM's noise, an hour": (lambda t, n: -2.0 + rng.gauss(0, 0.15), 3600),
             "weak, steady": (lambda t, n: -10.5 + rng.gauss(0, 0.1), 600),
             "at the threshold": (lambda t, n: -12.0 + rng.gauss(0, 0.3), 600),
             "a 0.8 dB step": (lambda t, n: -5.0 - 0.8 * (t > 60) + rng.gauss(0, 0.1), 300),
             "a 4 dB step": (lambda t, n: -2.0 - 4.0 * (t > 60) + rng.gauss(0, 0.1), 300),
             "no answer now and then": (lambda t, n: None if int(t) % 7 == 0 else -2.0, 600),
             "nonsense read": (lambda t, n: 1e308 if int(t) == 50 else -2.0, 120)}
    for what, (power, seconds) in cases.items():
        run, sw, journal = _watch(power)
        run(seconds)
        assert sw.moves == [] and journal.said == [], what


@pytest.mark.parametrize("rate", [0.01, 0.1, 1.0])
def test_a_fade_slow_or_fast_is_moved_before_the_link_loses_rate(rate):
    rng = random.Random(3)
    run, sw, journal = _watch(lambda t, n: -2.0 - rate * max(0.0, t - 20) * (n == 0)
                              + rng.gauss(0, 0.1))
    run(20 + 8 / rate)
    assert [m for m, _ in sw.moves] == [[3]]
    assert sw.moves[0][1] == [5]                  # the healthy circuit's waveguides: cleared
    entry, text = journal.said[0]
    assert entry.action == "moved" and entry.circuit == (3, 21) and entry.src == "gpu1"
    assert entry.db_per_s == pytest.approx(-rate, rel=0.3) and entry.dbm > -9.0
    assert "fading" in text and "no rank changed" in text
    run(120)
    assert len(sw.moves) == 1 and len(journal.said) == 1      # it helped: nothing more said


@pytest.mark.parametrize("period", [0.5, 2.0])
def test_a_flap_is_moved_whatever_its_period(period):
    run, sw, journal = _watch(lambda t, n: -3.0 if n or int(t // period) % 2 else -40.0)
    run(60)
    assert [m for m, _ in sw.moves] == [[3]] and journal.said[0][0].flaps >= 3


def test_a_second_fade_after_a_move_that_helped_is_moved_again_even_as_phases_change():
    def power(t, n):           # fades from 10 s, and again from 200 s once moved
        return -2.0 - 0.3 * max(0.0, t - (10 if n == 0 else 200)) if n < 2 else -2.0
    run, sw, journal = _watch(power, circuits=lambda t: {3: 21} if int(t) % 2 else {3: 21, 5: 23})
    run(300)
    assert len(sw.moves) == 2 and [e.action for e, _ in journal.said] == ["moved", "moved"]


def test_a_move_that_does_not_bring_the_light_back_is_said_once_and_left_to_the_fail_path():
    run, sw, journal = _watch(lambda t, n: -2.0 - 0.2 * t)        # a fibre: no routing helps
    run(120)
    assert len(sw.moves) == 1
    assert [e.action for e, _ in journal.said] == ["moved", "still fading"]
    assert "not on the switch's path" in journal.said[1][1]


def test_a_refused_move_is_said_and_a_watch_that_fails_does_not_stop_the_agent():
    run, sw, journal = _watch(lambda t, n: -2.0 - 0.5 * t)

    def refuse(inputs, healthy=()):
        raise SwitchError("chip: no routing found")
    sw.move = refuse
    run(60)
    assert [e.action for e, _ in journal.said] == ["not moved"]
    assert "no routing found" in journal.said[0][1]
    run, sw, journal = _watch(lambda t, n: 1 / 0)                  # a reader that raises
    run(10)
    assert journal.said == []


# ---- the whole loop: a job on the chip, a link fading and flapping ---------------------------

@contextlib.contextmanager
def watched(tmp_path):
    """The lumion rig on alternate ports, on the bus; the agent on a thread of this process."""
    with _rig_on_bus(tmp_path, "lumion", "chip", spec=ALTERNATE, ideal_chip=True) as \
            (emu, rig, _):
        journal = tmp_path / "journal.db"
        with agent_on_thread(rig, journal, TIMEOUT_S):
            yield emu, rig, journal


def entries(journal, *kinds):
    with SqliteJournal(journal, read_only=True) as j:
        return j.entries(kinds=kinds)


@pytest.mark.parametrize("fault", ["fade", "flap"])
def test_a_fading_or_flapping_link_is_moved_while_the_job_runs_with_no_rank_changed(
        tmp_path, fault):
    with watched(tmp_path) as (emu, rig, journal):
        host = emu.rack
        control = emu.endpoints["control"]
        rank_map = host.start_job("dp", 100_000, checkpoint_every=1000)["rank_map"]
        wait_until(lambda: host.job.steps_done >= 5, "the job's first steps", WAIT_S)
        with ServiceClient(rig.endpoints()["chip"][0], timeout=TIMEOUT_S) as chip:
            chip.call("move_circuits", forget=True)     # the chip's version moves: the agent's
            #                                             move is sent on an older one, once
        cmd = ({"cmd": "fade_link", "db_per_s": 0.7, "max_db": 20.0} if fault == "fade" else
               {"cmd": "flap_link", "period_s": 1.5, "db": 30.0})
        where = request(control, {**cmd, "src": "gpu2", "dst": "gpu3"})
        moved = wait_until(lambda: entries(journal, "link"), "the move journaled", WAIT_S)
        e = moved[0].details
        assert (e.action, e.src, e.dst, e.switch) == ("moved", "gpu2", "gpu3", "chip")
        assert tuple(where[k] for k in ("cell", "arm")) in e.avoided
        if fault == "fade":
            assert e.db_per_s < 0 and e.dbm > -9.0      # moved before the link lost any rate
        else:
            assert e.flaps >= 3
        at = host.job.steps_done
        wait_until(lambda: host.job.steps_done >= at + 5, "the job's steps after", WAIT_S)
        if fault == "fade":       # the old path would have the link at half rate by now
            wait_until(lambda: request(control, {"cmd": "link_fades"})["chip"][0]["loss_db"]
                       >= 9.5, "the waveguide left behind faded", WAIT_S, step=0.2)
        link = host.rack.link("gpu2", "gpu3")
        assert link.up and link.rate_gbps == 400.0 and link.power_dbm > -1.0
        status = host.job_status()
        assert status["state"] == "running" and status["restarts"] == 0
        assert status["rank_map"] == rank_map
        assert entries(journal, "link")[0].seq == moved[0].seq      # one move, nothing more
        assert not [x for x in entries(journal, "decision") if isinstance(x.details, Swap)]
        if fault == "fade":       # the job never ran over a slowed link
            assert not [c for c in host.job.communications if c.slow or c.down]
        request(control, {"cmd": "clear_faults"})
        assert request(control, {"cmd": "link_fades"}) == {"chip": []}


def test_a_link_dark_longer_than_the_job_waits_is_moved_by_the_failure_path(tmp_path):
    """A flap of 4 s: dark longer than the job's timeout, so the job fails before the watch has
    seen it flap. Both ends hear themselves in the loopback test: the chip's path is at fault,
    and the circuit is moved off it; the job restarts on the same GPUs, nobody swapped."""
    with watched(tmp_path) as (emu, rig, journal):
        host = emu.rack
        control = emu.endpoints["control"]
        rank_map = host.start_job("dp", 100_000, checkpoint_every=1000)["rank_map"]
        wait_until(lambda: host.job.steps_done >= 5, "the job's first steps", WAIT_S)
        request(control, {"cmd": "flap_link", "period_s": 4.0, "db": 30.0, "src": "gpu2",
                          "dst": "gpu3"})
        wait_until(lambda: host.job_status()["restarts"] >= 1, "the job's restart", WAIT_S)
        at = host.job.steps_done
        wait_until(lambda: host.job.steps_done >= at + 20, "steps after it", WAIT_S)
        moved = entries(journal, "link")
        assert [(e.details.action, e.details.src, e.details.dst) for e in moved][:1] == [
            ("moved", "gpu2", "gpu3")] and moved[0].cause.startswith("job failure")
        status = host.job_status()
        assert status["state"] == "running" and status["rank_map"] == rank_map
        assert not [x for x in entries(journal, "decision") if isinstance(x.details, Swap)]
        assert not entries(journal, "alarm")
        assert host.rack.link("gpu2", "gpu3").up
        request(control, {"cmd": "clear_faults"})


def test_fading_commands_say_what_is_wrong(tmp_path):
    with _rig_on_bus(tmp_path, "opus", "ocs") as (emu, _, _):
        with pytest.raises(ControlError, match="cut_fibre"):
            request(emu.endpoints["control"], {"cmd": "fade_link", "src": "server0",
                                               "dst": "server1"})
    with _rig_on_bus(tmp_path, "lumion", "chip", spec=ALTERNATE, ideal_chip=True) as \
            (emu, _, _):
        control = emu.endpoints["control"]
        for cmd, match in (({"src": "gpu0", "dst": "gpu9"}, "two GPUs"),
                           ({"src": "gpu0", "dst": "gpu1"}, "no circuit"),
                           ({"cell": "s3r0", "arm": 4}, "arm 2 or 3"),
                           ({"cell": "s3r0", "arm": 2, "db_per_s": 99}, "db_per_s")):
            with pytest.raises(ControlError, match=match):
                request(control, {"cmd": "fade_link", **cmd})
        with pytest.raises(ControlError, match="period_s"):
            request(control, {"cmd": "flap_link", "cell": "s3r0", "arm": 2, "period_s": 0})
        assert request(control, {"cmd": "link_fades"}) == {"chip": []}
