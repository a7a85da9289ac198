"""The agent's journal: durable across kill -9, intended state, filters, bad files."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from photonic_testbed.hil.journal import Journal, JournalError

WRITER = """
import sys
from photonic_testbed.hil.journal import Journal
j = Journal(sys.argv[1])
for k in range(100000):
    seq = j.record("note", cause="test", k=k)
    print(seq, flush=True)
"""


def acknowledged_then_killed(script: str, path, count: int) -> list[int]:
    """Run a writer process, collect the sequence numbers it reports, then kill -9 it."""
    proc = subprocess.Popen([sys.executable, "-c", script, str(path)], stdout=subprocess.PIPE,
                            text=True)
    acknowledged = []
    deadline = time.monotonic() + 20
    while len(acknowledged) < count and time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        acknowledged.append(int(line))
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=10)
    proc.stdout.close()
    assert len(acknowledged) >= count
    return acknowledged


def test_entries_reported_written_survive_kill_9(tmp_path):
    path = tmp_path / "journal.db"
    acknowledged = acknowledged_then_killed(WRITER, path, 200)
    with Journal(path) as j:
        stored = {e.seq for e in j.entries()}
    assert set(acknowledged) <= stored


def test_intended_circuits_round_trip_and_are_journalled(tmp_path):
    with Journal(tmp_path / "j.db") as j:
        j.set_intended("chip", [(3, 7), (1, 2)], cause="spare swap gpu3 -> spare0")
        j.set_intended("ocs", [(1, 33)], cause="phase tp")
        j.set_intended("chip", [(1, 2)], cause="phase dp")
    with Journal(tmp_path / "j.db") as j:
        assert j.intended() == {"chip": [(1, 2)], "ocs": [(1, 33)]}
        decisions = j.entries(kinds=("decision",))
        assert [d.details["switch"] for d in decisions] == ["chip", "ocs", "chip"]
        assert decisions[0].details["circuits"] == [[1, 2], [3, 7]]
        j.set_intended("ocs", [(2, 34)], cause="phase dp", event=False)   # a phase switch
        assert j.intended()["ocs"] == [(2, 34)] and len(j.entries()) == 3


DEFERRING = """
import sys
from photonic_testbed.hil.journal import Journal
j = Journal(sys.argv[1])
for k in range(100000):
    j.record("detected", cause="test", k=k, defer=True)
    j.record("decision", cause="test", k=k, defer=True)
    print(j.set_intended("chip", [(1, 17 + k % 16)], cause="test"), flush=True)
    j.record("applied", cause="test", k=k, defer=True)
"""


def test_deferred_entries_are_durable_with_the_next_durable_one(tmp_path):
    path = tmp_path / "journal.db"
    with Journal(path) as j, Journal(path) as other:
        first = j.record("detected", cause="gpu3", defer=True)
        j.record("decision", cause="swap", defer=True)
        assert other.entries() == []                   # written, not yet committed
        assert [e.seq for e in j.entries()] == [first, first + 1]    # a read commits
        assert len(other.entries()) == 2
        j.record("applied", cause="swap", defer=True)
        j.set_intended("chip", [(1, 17)], cause="swap")
        assert [e.kind for e in other.entries(since=first + 1)] == ["applied", "decision"]
        j.record("verified", cause="swap", defer=True)
        j.record("restart", cause="swap")
        assert [e.kind for e in other.entries(since=first + 3)] == ["verified", "restart"]
        j.record("phase", cause="tp", defer=True)
    with Journal(path) as j:                           # close committed the last one
        assert j.entries()[-1].kind == "phase"
    # kill -9: everything before an acknowledged durable write is there, in order
    acknowledged = acknowledged_then_killed(DEFERRING, tmp_path / "k.db", 100)
    with Journal(tmp_path / "k.db") as j:
        kinds = {e.seq: e.kind for e in j.entries()}
        assert j.intended()["chip"]
    for seq in acknowledged:
        assert [kinds.get(seq - 2), kinds.get(seq - 1), kinds.get(seq)] == \
            ["detected", "decision", "decision"]


def test_filters_and_lines(tmp_path):
    with Journal(tmp_path / "j.db") as j:
        j.record("failure", cause="xid 79", gpu=3)
        j.record("applied", cause="swap", latency_s=0.0042, switch="chip")
        j.record("alarm", cause="no spare left")
        assert [e.kind for e in j.entries(kinds=("failure", "alarm"))] == ["failure", "alarm"]
        assert [e.kind for e in j.entries(since=1)] == ["applied", "alarm"]
        line = j.entries(kinds=("applied",))[0].line()
        assert "applied" in line and "[4.2 ms]" in line and '"switch": "chip"' in line
        with pytest.raises(ValueError, match="unknown journal kind"):
            j.record("oops")


def test_a_file_that_is_not_a_journal_is_refused(tmp_path):
    bad = tmp_path / "bad.db"
    bad.write_bytes(b"this is not sqlite" * 100)
    with pytest.raises(JournalError, match="not a usable journal"):
        Journal(bad)
