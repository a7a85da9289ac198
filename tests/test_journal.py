"""The agent's journal: durable across kill -9, intended state, filters, bad files."""
from __future__ import annotations

import os
import pathlib
import shutil
import signal
import subprocess
import sys
import time

import orjson
import pytest

from photonic_testbed.hil.agent.entries import (
    Alarm,
    Applied,
    Intent,
    JobFailure,
    Note,
    PhaseSwitched,
    RankMapAnnounced,
    RestartOrder,
    SwitchReport,
    Unread,
    builtins,
)
from photonic_testbed.hil.agent.journal import JournalError
from photonic_testbed.hil.agent.sqlite_file import event_seal
from photonic_testbed.hil.agent.sqlite_journal import SqliteJournal

WRITER = """
import sys
from photonic_testbed.hil.agent.sqlite_journal import SqliteJournal
j = SqliteJournal(sys.argv[1])
for k in range(100000):
    seq = j.record_stored("note", cause="test", k=k)
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
    with SqliteJournal(path) as j:
        stored = {e.seq for e in j.stored_entries()}
    assert set(acknowledged) <= stored


def test_the_log_is_checkpointed_off_the_writers_path(tmp_path, monkeypatch):
    """No commit checkpoints (SQLite's own would, every 1,000 pages: 10-20 ms inside a
    decision); the journal's thread does, so the log does not grow with the entries."""
    import photonic_testbed.hil.agent.sqlite_journal as journal_module
    monkeypatch.setattr(journal_module, "CHECKPOINT_S", 0.05)
    path = tmp_path / "j.db"
    wal = pathlib.Path(str(path) + "-wal")
    j = SqliteJournal(path, "NORMAL")
    try:
        assert j._db.execute("PRAGMA wal_autocheckpoint").fetchone()[0] == 0
        sizes = []
        for _ in range(4):
            for k in range(500):
                j.record_stored("decision", "bench", details_of_a_size="x" * 200, k=k)
            sizes.append(wal.stat().st_size)
            time.sleep(1.0)                  # 20 of the thread's rounds: the log copied
        assert max(sizes) < 2 * sizes[0], f"the log grew with the entries: {sizes}"
        assert len(j.stored_entries()) == 2000
    finally:
        j.close()
    assert not wal.exists() or wal.stat().st_size == 0


def test_intended_circuits_round_trip_and_are_journalled(tmp_path):
    with SqliteJournal(tmp_path / "j.db") as j:
        j.set_intended("chip", [(3, 7), (1, 2)], cause="spare swap gpu3 -> spare0")
        j.set_intended("ocs", [(1, 33)], cause="phase tp")
        j.set_intended("chip", [(1, 2)], cause="phase dp")
    with SqliteJournal(tmp_path / "j.db") as j:
        assert j.intended() == {"chip": [(1, 2)], "ocs": [(1, 33)]}
        decisions = j.stored_entries(kinds=("decision",))
        assert [d.details["switch"] for d in decisions] == ["chip", "ocs", "chip"]
        assert decisions[0].details["circuits"] == [[1, 2], [3, 7]]
        j.set_intended("ocs", [(2, 34)], cause="phase dp", event=False)   # a phase switch
        assert j.intended()["ocs"] == [(2, 34)] and len(j.stored_entries()) == 3


DEFERRING = """
import sys
from photonic_testbed.hil.agent.sqlite_journal import SqliteJournal
j = SqliteJournal(sys.argv[1])
for k in range(100000):
    j.record_stored("detected", cause="test", k=k, defer=True)
    j.record_stored("decision", cause="test", k=k, defer=True)
    print(j.set_intended("chip", [(1, 17 + k % 16)], cause="test"), flush=True)
    j.record_stored("applied", cause="test", k=k, defer=True)
"""


def test_deferred_entries_are_durable_with_the_next_durable_one(tmp_path):
    path = tmp_path / "journal.db"
    with SqliteJournal(path) as j, SqliteJournal(path) as other:
        first = j.record_stored("detected", cause="gpu3", defer=True)
        j.record_stored("decision", cause="swap", defer=True)
        assert other.stored_entries() == []                   # written, not yet committed
        assert [e.seq for e in j.stored_entries()] == [first, first + 1]    # a read commits
        assert len(other.stored_entries()) == 2
        j.record_stored("applied", cause="swap", defer=True)
        j.set_intended("chip", [(1, 17)], cause="swap")
        assert [e.kind for e in other.stored_entries(since=first + 1)] == ["applied", "decision"]
        j.record_stored("verified", cause="swap", defer=True)
        j.record_stored("restart", cause="swap")
        assert [e.kind for e in other.stored_entries(since=first + 3)] == ["verified", "restart"]
        j.record_stored("phase", cause="tp", defer=True)
    with SqliteJournal(path) as j:                           # close committed the last one
        assert j.stored_entries()[-1].kind == "phase"
    # kill -9: everything before an acknowledged durable write is there, in order
    acknowledged = acknowledged_then_killed(DEFERRING, tmp_path / "k.db", 100)
    with SqliteJournal(tmp_path / "k.db") as j:
        kinds = {e.seq: e.kind for e in j.stored_entries()}
        assert j.intended()["chip"]
    for seq in acknowledged:
        assert [kinds.get(seq - 2), kinds.get(seq - 1), kinds.get(seq)] == \
            ["detected", "decision", "decision"]


def test_filters_and_lines(tmp_path):
    with SqliteJournal(tmp_path / "j.db") as j:
        j.record(JobFailure(gpus=["gpu3"]), cause="xid 79")
        j.record(Applied(switch="chip", added=[(1, 18), (2, 17)]), cause="swap", latency_s=0.0042)
        j.record(Alarm(), cause="no spare left")
        assert [e.kind for e in j.entries(kinds=("failure", "alarm"))] == ["failure", "alarm"]
        assert [e.kind for e in j.entries(since=1)] == ["applied", "alarm"]
        line = j.entries(kinds=("applied",))[0].line()
        assert line.endswith(" applied       (swap) [4.2 ms]  switch: chip; added: 1 → 18, 2 → 17")
        assert j.entries()[-1].line().endswith(" alarm         (no spare left)")
        with pytest.raises(ValueError, match="unknown journal kind"):
            j.record_stored("oops")
        with pytest.raises(ValueError, match="Unread is not a kind of journal entry"):
            j.record(Unread(fields={"x": 1}))


def test_a_file_that_is_not_a_journal_is_refused(tmp_path):
    bad = tmp_path / "bad.db"
    bad.write_bytes(b"this is not sqlite" * 100)
    with pytest.raises(JournalError, match="not a usable journal"):
        SqliteJournal(bad)


# ---- damaged journals (issue 15, item 6) ----------------------------------------------------

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _journal_with_entries(path, n=300) -> None:
    """A real journal spanning several pages."""
    with SqliteJournal(path) as j:
        for k in range(n):
            j.record_stored("note", cause="filler", k=k, text="x" * 40)
        j.set_intended("ocs", [(1, 33)], cause="test")


def _page_size(path) -> int:
    return int.from_bytes(pathlib.Path(path).read_bytes()[16:18], "big")


def _zero_page(path, page: int) -> None:
    size = _page_size(path)
    with open(path, "r+b") as f:
        f.seek(page * size)
        f.write(b"\0" * size)


def _truncate(path):
    open(path, "wb").close()


def _zero_first_page(path):
    _zero_page(path, 0)


def _zero_last_page(path):
    _zero_page(path, os.path.getsize(path) // _page_size(path) - 1)


def _zero_middle_pages(path):
    pages = os.path.getsize(path) // _page_size(path)
    for p in range(1, pages):
        _zero_page(path, p)


def _garbage(path):
    import random
    rng = random.Random(7)
    pathlib.Path(path).write_bytes(bytes(rng.randrange(256) for _ in range(20000)))


def _garbage_after_header(path):
    import random
    rng = random.Random(8)
    data = bytearray(pathlib.Path(path).read_bytes())
    data[100:] = bytes(rng.randrange(256) for _ in range(len(data) - 100))
    pathlib.Path(path).write_bytes(bytes(data))


def _directory(path):
    os.unlink(path)
    os.mkdir(path)


def _other_sqlite_file(path):
    import sqlite3
    os.unlink(path)
    db = sqlite3.connect(path)
    db.execute("CREATE TABLE songs (title TEXT)")
    db.commit()
    db.close()


DAMAGE = {"truncated to 0 bytes": (_truncate, "empty"),
          "first page zeroed": (_zero_first_page, "no SQLite header"),
          "last page zeroed": (_zero_last_page, "damaged"),
          "every page but the first zeroed": (_zero_middle_pages, "damaged"),
          "random garbage": (_garbage, "no SQLite header"),
          "garbage after a good header": (_garbage_after_header, "damaged"),
          "a directory in its place": (_directory, "is a directory"),
          "another program's SQLite file": (_other_sqlite_file, "without the journal's tables")}


def _damaged(tmp_path, name):
    path = tmp_path / "journal.db"
    _journal_with_entries(path)
    DAMAGE[name][0](path)
    return path


@pytest.mark.parametrize("name", list(DAMAGE))
def test_an_empty_or_damaged_journal_is_refused_never_recreated(tmp_path, name):
    path = _damaged(tmp_path, name)
    before = sorted(p.name for p in tmp_path.iterdir())
    size = os.path.getsize(path) if path.is_file() else None
    with pytest.raises(JournalError, match=DAMAGE[name][1]) as err:
        j = SqliteJournal(path)
        # what the agent does at start: every read must fail the same way if open did not
        j.stored_entries(kinds=("restart",))
        j.intended()
    assert str(path) in str(err.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == before      # nothing made beside it
    if size is not None:
        assert os.path.getsize(path) == size                          # nor rewritten


def test_an_unreadable_journal_is_refused():
    """Checked in child processes; as root (which reads any file) they run as nobody, in a
    folder they may enter, so that it is the file's (or its folder's) permissions that stop
    them. A journal in a folder that cannot be entered is refused too, not taken as absent."""
    import tempfile
    as_nobody = []
    if os.geteuid() == 0:
        if not shutil.which("setpriv"):
            pytest.skip("root reads any file, and setpriv is missing to run as nobody")
        as_nobody = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    # a folder every user may enter (pytest's own are its owner's only)
    with tempfile.TemporaryDirectory() as folder:
        os.chmod(folder, 0o755)
        path = pathlib.Path(folder) / "journal.db"
        _journal_with_entries(path, 3)
        os.chmod(path, 0)
        locked = pathlib.Path(folder) / "locked"
        locked.mkdir(mode=0)
        try:
            for journal in (path, locked / "journal.db"):
                for args in (["-c", "from photonic_testbed.hil.agent.sqlite_journal import "
                                    "SqliteJournal; import sys; SqliteJournal(sys.argv[1])",
                              str(journal)],
                             ["-m", "photonic_testbed.ptb", "journal", str(journal)]):
                    out = subprocess.run([*as_nobody, sys.executable, *args], cwd=ROOT,
                                         env=env, capture_output=True, text=True, timeout=120)
                    assert out.returncode == 1, out
                    assert "permission denied" in out.stderr, out.stderr
                assert "Traceback" not in out.stderr          # ptb journal: the message only
        finally:
            os.chmod(path, 0o600)
            os.chmod(locked, 0o700)
        assert os.listdir(locked) == []


def test_a_new_journal_only_where_no_file_exists(tmp_path):
    path = tmp_path / "fresh.db"
    with SqliteJournal(path) as j:
        assert j.stored_entries() == [] and j.intended() == {}
        j.record_stored("note", cause="first")
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith("fresh.db-")) \
        == ["fresh.db"]
    with SqliteJournal(path) as j:
        assert [e.cause for e in j.stored_entries()] == ["first"]
    with pytest.raises(JournalError, match="no folder"):
        SqliteJournal(tmp_path / "missing" / "j.db")


def _run_ptb(*args):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, "-m", "photonic_testbed.ptb", *args], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("name", ["truncated to 0 bytes", "last page zeroed", "random garbage",
                                  "a directory in its place"])
def test_ptb_journal_refuses_a_damaged_journal(tmp_path, name):
    path = _damaged(tmp_path, name)
    out = _run_ptb("journal", str(path))
    assert out.returncode == 1, out
    assert "Traceback" not in out.stderr + out.stdout
    assert out.stdout == ""
    assert out.stderr.startswith("ptb journal: ") and DAMAGE[name][1] in out.stderr


@pytest.mark.parametrize("name", ["truncated to 0 bytes", "every page but the first zeroed"])
def test_ptb_agent_refuses_a_damaged_journal(tmp_path, name):
    from photonic_testbed.hil import rig as rigfile
    path = _damaged(tmp_path, name)
    size = os.path.getsize(path)
    rig = rigfile.for_emulator("opus", {"ocs": "TCPIP::127.0.0.1::1::SOCKET"},
                               gpus=(rigfile.GpuConfig("gpu0", "ocs", 1, False),))
    rigfile.write(tmp_path / "rig.toml", rig)
    out = _run_ptb("agent", "--rig", str(tmp_path / "rig.toml"), "--journal", str(path))
    assert out.returncode == 1, out
    assert "Traceback" not in out.stderr + out.stdout
    assert out.stderr.startswith("ptb agent: ") and DAMAGE[name][1] in out.stderr
    assert os.path.getsize(path) == size                  # left as found, for a person


def test_listeners_hear_every_entry_written_as_it_is_stored(tmp_path):
    """`listen`: each entry once, in order, in the type it is read back in and with the text
    the journal keeps; entries of a rolled-back change are not heard; a listener that fails
    does not stop the writer."""
    import orjson
    heard = []
    with SqliteJournal(tmp_path / "j.db") as j:
        j.record(Note(), "before anyone listens")
        j.listen(lambda e, text: heard.append((e, text)))
        j.listen(lambda e, text: 1 / 0)                        # logged, not raised
        j.record(RankMapAnnounced(job="a", world=2, changed={0: "gpu0", 1: "gpu1"}),
                 "deferred", defer=True)
        j.set_intended_many({"ocs-a": [(1, 33)], "ocs-b": [(2, 34), (1, 40)]}, "phase dp")
        with pytest.raises(TypeError):          # the second cannot be stored: neither is
            j.set_intended_many({"ocs-a": [(1, 33)], "ocs-c": [(1, object())]}, "bad")
        j.set_intended_many({"ocs-a": [(3, 35)]}, "quiet", event=False)
        typed, stored = j.entries(), j.stored_entries()
    assert [e.seq for e, _ in heard] == [e.seq for e in typed[1:]]
    for (e, text), t, s in zip(heard, typed[1:], stored[1:], strict=True):
        assert (e.ts, e.kind, e.cause, e.latency_s) == (t.ts, t.kind, t.cause, t.latency_s)
        assert e.details == t.details           # what is written is what is read back
        assert orjson.loads(text) == s.details
    assert [t.details for t in typed[2:]] == [Intent(switch="ocs-a", circuits=[(1, 33)]),
                                              Intent(switch="ocs-b",
                                                     circuits=[(1, 40), (2, 34)])]


def test_a_bulky_entry_is_published_alike_from_the_writer_or_the_file(tmp_path):
    """The agent publishes an entry from the writer's own Struct as a restarted agent does
    from the journal's file: shortened alike, and said to be (`brief`)."""
    from photonic_testbed.hil.agent.bus import EVENT_DETAILS_BYTES, published_event
    phase = PhaseSwitched(phase="dp", job="a", prestaged=[f"rail{k}" for k in range(12)],
                          applied={f"rail{k}": SwitchReport(seconds=0.001 * k, added=[
                              (i, 32 + i) for i in range(1, 33)]) for k in range(16)})
    order = RestartOrder(job="a", rank_map={r: f"s{r // 8}g{r % 8}" for r in range(256)})
    small = Note(job="a", gpus=["gpu3"])
    heard = []
    with SqliteJournal(tmp_path / "j.db") as j:
        j.listen(lambda e, text: heard.append(published_event(e, text)))
        for details in (phase, order, small):
            j.record(details, "c")
        from_file = [published_event(e) for e in j.entries()]
    assert heard == from_file
    assert [e.get("brief", False) for e in from_file] == [True, True, False]
    assert len(orjson.dumps(builtins(phase))) > EVENT_DETAILS_BYTES
    assert from_file[0]["details"]["prestaged"] == {"items": 12}
    assert from_file[0]["details"]["applied"] == {"switches": 16, "added": 512, "removed": 0,
                                                  "seconds_max": 0.015}
    assert from_file[1]["details"] == {"job": "a", "rank_map": {"items": 256}}
    assert from_file[2]["details"] == {"job": "a", "gpus": ["gpu3"]}


def _phase_details(phase: int, switches: int = 64) -> dict:
    """A phase switch's entry on `switches` OCSes of 32 x 32: each switch's circuits added and
    removed (phase 0 and 1 alternate, as a job's phases do)."""
    def circuits(p: int) -> list[list[int]]:
        return [[i, 33 + (i * (3 + 2 * p)) % 32] for i in range(1, 33)]
    return {"phase": "dp" if phase % 2 else "pp", "round": 0, "job": "a", "prestaged": [],
            "applied": {f"rail{k % 8}-pod{k // 8}": {
                "seconds": 0.001 * (k + phase), "added": circuits(phase % 2),
                "removed": circuits(1 - phase % 2)} for k in range(switches)}}


def _stored_bytes(path) -> tuple[int, int]:
    import sqlite3
    db = sqlite3.connect(str(path))
    try:
        events = db.execute("SELECT SUM(LENGTH(details)) FROM events").fetchone()[0]
        shared = db.execute("SELECT COALESCE(SUM(LENGTH(value)), 0) FROM shared_values"
                            ).fetchone()[0]
    finally:
        db.close()
    return events, shared


def test_long_lists_are_kept_once_and_read_back_whole(tmp_path):
    """A 64-OCS phase switch's entry names the same circuit lists round after round: they are
    stored once, and every entry reads back with its details whole."""
    import orjson
    path = tmp_path / "j.db"
    heard = []
    with SqliteJournal(path) as j:
        j.listen(lambda e, text: heard.append(text))
        for k in range(40):
            j.record_stored("phase", f"phase {k}", 0.01, defer=k % 3 != 0, **_phase_details(k))
        j.record_stored("note", "small", pairs=[[1, 33]] * 20)           # under SHARE_ABOVE: whole
        got = j.stored_entries(kinds=("phase",))
    assert [e.details for e in got] == [_phase_details(k) for k in range(40)]
    assert [orjson.loads(t) for t in heard[:40]] == [_phase_details(k) for k in range(40)]
    whole = sum(len(orjson.dumps(_phase_details(k))) for k in range(40))
    events, shared = _stored_bytes(path)
    assert shared < 2 * len(orjson.dumps(_phase_details(0)))     # two phases' lists, once
    assert events + shared < whole / 3, (events, shared, whole)     # 35 KB -> 9 KB an entry
    with SqliteJournal(path) as j:                                     # a new writer: the same
        j.record_stored("phase", "again", **_phase_details(1))
        assert j.stored_entries()[-1].details == _phase_details(1)
    assert _stored_bytes(path)[1] == shared


def test_a_schema_1_journal_is_brought_to_3_with_its_entries(tmp_path):
    import sqlite3
    path = tmp_path / "old.db"
    _schema_1_journal(path)                  # (one note: 'old')
    db = sqlite3.connect(str(path), isolation_level=None)
    import orjson
    old = _phase_details(0, switches=8)
    db.execute("INSERT INTO events (ts, kind, cause, details) VALUES (1.0, 'phase', 'p', ?)",
               (orjson.dumps(old).decode(),))
    db.execute("INSERT INTO intended VALUES ('rail0-pod0', '[[1,33]]', 1)")
    db.close()
    with SqliteJournal(path) as j:
        assert j._db.execute("SELECT value FROM meta WHERE key='schema'").fetchone()[0] == "3"
        j.record_stored("phase", "q", **_phase_details(1))
        assert [e.details for e in j.stored_entries()] == [{}, old, _phase_details(1)]
        assert j.intended() == {"rail0-pod0": [(1, 33)]}
    with SqliteJournal(path) as j:                                     # opened again: as it was
        assert [e.details for e in j.stored_entries()] == [{}, old, _phase_details(1)]
        typed = [e.details for e in j.entries()]                       # and in their types
    assert _stored_bytes(path)[1] > 0
    assert typed[0] == Note() and isinstance(typed[1], PhaseSwitched)
    assert (typed[1].phase, typed[1].job, len(typed[1].applied)) == ("pp", "a", 8)
    assert typed[1].applied["rail0-pod0"].added == [tuple(p) for p in old["applied"][
        "rail0-pod0"]["added"]]


def test_a_lost_or_damaged_shared_value_is_a_clear_error(tmp_path):
    import sqlite3
    path = tmp_path / "j.db"
    with SqliteJournal(path) as j:
        j.record_stored("note", "small")
        seq = j.record_stored("phase", "p", **_phase_details(0))
    db = sqlite3.connect(str(path), isolation_level=None)
    digest = db.execute("SELECT digest FROM shared_values").fetchone()[0]
    db.execute("UPDATE shared_values SET value='[[1,' WHERE digest=?", (digest,))
    db.close()
    with SqliteJournal(path) as j:
        with pytest.raises(JournalError, match=f"entry {seq} refers to does not match its "
                                               f"digest"):
            j.stored_entries()
        assert [e.cause for e in j.stored_entries(limit=1)] == ["small"]    # the others read
    db = sqlite3.connect(str(path), isolation_level=None)
    db.execute("DELETE FROM shared_values WHERE digest=?", (digest,))
    db.close()
    with SqliteJournal(path) as j:
        with pytest.raises(JournalError, match=f"damaged: entry {seq} refers to 1 shared "
                                               f"value.*{digest}"):
            j.stored_entries()


def test_details_that_hold_the_reference_key_are_stored_whole(tmp_path):
    odd = {**_phase_details(0), "note": {"$shared": "not a reference"}}
    with SqliteJournal(tmp_path / "j.db") as j:
        j.record_stored("note", "odd", **odd)
        assert j.stored_entries()[-1].details == odd
    assert _stored_bytes(tmp_path / "j.db")[1] == 0


SHARING_WRITER = """
import sys
from photonic_testbed.hil.agent.sqlite_journal import SqliteJournal
j = SqliteJournal(sys.argv[1])
for k in range(100000):
    circuits = [[i, 33 + (i * (3 + 2 * (k % 5))) % 32] for i in range(1, 33)]
    fresh = [[i, 33 + (i * k) % 32] for i in range(1, 33)]     # a list never seen before
    seq = j.record_stored("phase", f"phase {k}", k=k, applied={
        f"ocs{s}": {"added": circuits, "removed": fresh if s == 0 else circuits}
        for s in range(16)})
    print(seq, flush=True)
"""


def test_entries_with_shared_lists_reported_written_survive_kill_9(tmp_path):
    path = tmp_path / "journal.db"
    acknowledged = acknowledged_then_killed(SHARING_WRITER, path, 150)
    with SqliteJournal(path) as j:
        got = {e.seq: e.details for e in j.stored_entries()}
    assert set(acknowledged) <= set(got)
    for seq in acknowledged:
        k = got[seq]["k"]
        assert got[seq]["applied"]["ocs0"]["removed"] == \
            [[i, 33 + (i * k) % 32] for i in range(1, 33)]
        assert got[seq]["applied"]["ocs15"]["added"] == \
            [[i, 33 + (i * (3 + 2 * (k % 5))) % 32] for i in range(1, 33)]
    assert _stored_bytes(path)[1] > 0


def _schema_1_journal(path) -> None:
    import sqlite3
    db = sqlite3.connect(str(path), isolation_level=None)
    db.execute("PRAGMA journal_mode=WAL")
    db.executescript("""BEGIN;
        CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
        CREATE TABLE events (seq INTEGER PRIMARY KEY AUTOINCREMENT, ts REAL NOT NULL,
            kind TEXT NOT NULL, cause TEXT NOT NULL DEFAULT '', latency_s REAL,
            details TEXT NOT NULL DEFAULT '{}');
        CREATE TABLE intended (switch TEXT PRIMARY KEY, circuits TEXT NOT NULL,
            seq INTEGER NOT NULL);
        INSERT INTO meta VALUES ('schema', '1');
        INSERT INTO events (ts, kind, cause) VALUES (1.0, 'note', 'old');
        COMMIT;""")
    db.close()


def test_a_journal_opened_to_be_read_is_never_written(tmp_path):
    """`ptb journal` reads a journal of schema 1 as it is, and a read-only journal refuses
    every write with a JournalError."""
    path = tmp_path / "old.db"
    _schema_1_journal(path)
    before = path.read_bytes()
    with SqliteJournal(path, read_only=True) as j:
        assert [e.cause for e in j.stored_entries()] == ["old"]
        for write in (lambda: j.record_stored("note", "new"),
                      lambda: j.set_intended("ocs", [(1, 33)], "x")):
            with pytest.raises(JournalError, match="opened to be read, not written"):
                write()
    out = subprocess.run([sys.executable, "-m", "photonic_testbed.ptb", "journal", str(path)],
                         cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)),
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "note" in out.stdout and "(old)" in out.stdout, out
    assert path.read_bytes() == before
    with pytest.raises(JournalError, match="no journal at"):
        SqliteJournal(tmp_path / "absent.db", read_only=True)


def test_a_journal_on_a_read_only_medium_is_read_and_not_written(tmp_path):
    """On a read-only mount (a namespace of the test's own): `ptb journal` prints it; the
    agent's journal is refused with the reason, not called damaged."""
    if not shutil.which("unshare"):
        pytest.skip("unshare is missing")
    folder, mounted = tmp_path / "disk", tmp_path / "ro"
    folder.mkdir()
    mounted.mkdir()
    with SqliteJournal(folder / "j.db") as j:
        j.record_stored("note", "kept")
        j.record_stored("phase", "p", **_phase_details(0))
    script = f"""
set -e
mount --bind {folder} {mounted}
mount -o remount,bind,ro {mounted}
{sys.executable} -m photonic_testbed.ptb journal {mounted}/j.db
echo ---
{sys.executable} -c "from photonic_testbed.hil.agent.sqlite_journal import SqliteJournal as J; \\
J('{mounted}/j.db')" \\
    2>&1 || true
"""
    probe = subprocess.run(["unshare", "--mount", "--map-root-user", "true"],
                           capture_output=True, timeout=30)
    if probe.returncode != 0:
        pytest.skip(f"cannot make a mount namespace here: {probe.stderr.decode()[:80]}")
    out = subprocess.run(["unshare", "--mount", "--map-root-user", "sh", "-c", script],
                         cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)),
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out
    printed, _, refused = out.stdout.partition("---")
    assert "(kept)" in printed and "rail0-pod0: {seconds: 0, added: 1 → 36" in printed, printed
    assert "cannot write the journal: its folder is on a read-only medium" in refused, refused
    assert "damaged" not in refused


def test_an_entry_whose_details_are_not_json_is_named(tmp_path):
    import sqlite3
    path = tmp_path / "j.db"
    with SqliteJournal(path) as j:
        j.record_stored("note", "fine")
        seq = j.record_stored("note", "hurt", k=1)
    db = sqlite3.connect(str(path), isolation_level=None)
    # written so by a faulty writer: the row's checksum is of what it holds
    row = db.execute("SELECT seq, ts, kind, cause, latency_s, '{\"k\": ', shares FROM events "
                     "WHERE seq=?", (seq,)).fetchone()
    db.execute("UPDATE events SET details=?, checksum=? WHERE seq=?",
               (row[5], event_seal(*row), seq))
    db.close()
    with SqliteJournal(path, read_only=True) as j:
        with pytest.raises(JournalError, match=f"damaged: the details of entry {seq} are not "
                                               f"JSON"):
            j.stored_entries()
        assert [e.cause for e in j.stored_entries(limit=1)] == ["fine"]
