"""A fabric that notices change: the agent compares every switch's published circuits with
what it intends and puts back what differs, whoever changed them (a request sent straight to
the switch's service, an OCS power cycled, which its service sees when it reads the circuits
back at each telemetry pass); a phase is not granted on circuits the agent knows differ from
what it made (a change not yet seen, within a read-back's half second, cannot be known).
Through real sockets: the emulated opus rig's OCS served on a thread, the agent in this
process on its own loop, checked on the emulator's own switch truth."""
from __future__ import annotations

import contextlib
import time

import pytest
from test_agent_bus import _rig_on_bus, agent_on_thread

from photonic_testbed.common.jobplan import dp_tp
from photonic_testbed.hil.agent.sqlite_journal import SqliteJournal
from photonic_testbed.hil.bus.client import RemoteError, ServiceClient
from photonic_testbed.hil.lab.control_client import request as control
from tests.timeouts import wait_until

WAIT_S = 30.0          # a bounded wait on a loaded machine (the repair takes well under 1 s)
TIMEOUT_S = 10.0


@contextlib.contextmanager
def watched(tmp_path):
    """The opus rig on the bus, its agent running on a thread; yields (emulator, rig, agent
    process, the journal's path)."""
    with _rig_on_bus(tmp_path, "opus", "ocs") as (emu, rig, _):
        journal = tmp_path / "journal.db"
        with agent_on_thread(rig, journal, TIMEOUT_S) as agent:
            yield emu, rig, agent, journal


def truth(emu) -> dict[int, int]:
    """The circuits the emulated OCS's mirrors make."""
    return dict(emu.optics.physics.truth()["actual"])


def intended(journal) -> dict[int, int]:
    with SqliteJournal(journal, read_only=True) as j:
        return dict(j.intended()["ocs"])


def entries(journal, kind: str):
    with SqliteJournal(journal, read_only=True) as j:
        return j.entries(kinds=(kind,))


def until(cond, what: str):
    return wait_until(cond, what, WAIT_S)


def _admitted(rig) -> ServiceClient:
    c = ServiceClient(rig.agent_endpoints()[0], timeout=TIMEOUT_S)
    c.call("admit", plan=dp_tp(8).to_dict(), job="j")
    assert c.call("phase", phase="dp", job="j")["granted"]
    return c


@pytest.mark.parametrize("change", ["apply_circuits []", "power cycle"])
def test_a_switch_changed_behind_the_agent_is_put_back(tmp_path, change):
    with watched(tmp_path) as (emu, rig, agent, journal):
        with _admitted(rig) as job:
            want = intended(journal)
            assert want and truth(emu) == want
            if change == "power cycle":
                control(emu.endpoints["control"], {"cmd": "reboot", "device": "ocs"})
            else:
                with ServiceClient(rig.endpoints()["ocs"][0], timeout=TIMEOUT_S) as rogue:
                    rogue.call("apply_circuits", circuits=[])
            # the change is made once the call (or the reboot) has answered; the agent may put
            # it back before a poll here could see it, so it is its journal entry that says the
            # change was seen and repaired
            def repaired():
                return [e for e in entries(journal, "reconcile")
                        if "changed behind the agent" in e.cause]
            until(repaired, "the repair journaled")       # (written once the switch answered)
            until(lambda: truth(emu) == want, "the circuits put back")
            repaired = repaired()
            assert len(repaired) == 1 and repaired[0].details.switch == "ocs"
            assert sorted(map(tuple, repaired[0].details.added)) == sorted(want.items())
            assert intended(journal) == want           # what is intended never moved
            assert job.call("phase", phase="dp", job="j")["granted"]
            assert truth(emu) == want


def test_no_phase_is_granted_while_a_circuit_it_needs_cannot_be_put_back(tmp_path):
    """A client of a higher term than the agent's empties the switch: the switch now refuses
    the agent (StaleTerm), so what was lost cannot be put back: an alarm says so, and the
    job's phase, asked again, is refused rather than granted on missing circuits."""
    with watched(tmp_path) as (emu, rig, agent, journal):
        with _admitted(rig) as job:
            with ServiceClient(rig.endpoints()["ocs"][0], timeout=TIMEOUT_S,
                               term=agent.term + 5) as newer:
                newer.call("apply_circuits", circuits=[])
            def alarms():
                return [e for e in entries(journal, "alarm")
                        if "changed behind the agent" in e.cause
                        and "cannot be put back" in e.cause]
            until(alarms, "the alarm")
            # the refused repair moves the switch's version, not its circuits: not tried again
            time.sleep(1.0)
            assert len(alarms()) == 1
            assert truth(emu) == {}
            with pytest.raises(RemoteError, match="StaleTerm|refused"):
                job.call("phase", phase="dp", job="j")
            assert truth(emu) == {}


def test_a_switch_the_agent_intends_nothing_of_is_left_as_it_is(tmp_path):
    """Before any job, the agent holds no part of the switch: a circuit set there by someone
    else is believed, not taken down."""
    with watched(tmp_path) as (emu, rig, agent, journal):
        with ServiceClient(rig.endpoints()["ocs"][0], timeout=TIMEOUT_S) as other:
            other.call("apply_circuits", circuits=[[5, 40]])
        time.sleep(1.0)        # two of the service's read-backs; nothing may move meanwhile
        assert truth(emu) == {5: 40}
        assert not [e for e in entries(journal, "reconcile")
                    if "changed behind the agent" in e.cause]
