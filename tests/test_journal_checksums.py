"""Files that cannot lie: every row of the journal is checked when it is read (schema 3), so a
byte changed anywhere in a journal reads back exactly as written or is a JournalError that names
the row (or, for damage to SQLite's own structure, says what SQLite said), never a different
value. The flip test failed on the journal of schema 2: a first entry whose number became 0 was
passed over, and a port's digit changed in a row read back as another circuit."""
from __future__ import annotations

import os
import pathlib
import re
import shutil
import sqlite3

import pytest
from test_agent import connect, make_world

from photonic_testbed.common.jobplan import dp_tp, round_robin_matchings
from photonic_testbed.common.rack_layout import lumion
from photonic_testbed.hil.agent.entries import Note
from photonic_testbed.hil.agent.journal import JournalError
from photonic_testbed.hil.agent.recovery import read_jobs
from photonic_testbed.hil.agent.sqlite_file import seal
from photonic_testbed.hil.agent.sqlite_journal import SqliteJournal

JOURNAL_0_2 = pathlib.Path(__file__).parent / "data" / "journal-0.2.db"

# What a refusal may say: the row it names, or what SQLite (or the file's first check) said.
NAMED = re.compile(
    r"entry \d+ does not match its checksum"
    r"|the intended circuits of switch .+ \(row \d+\)"
    r"|shared value"
    r"|details of entry \d+"
    r"|entry \d+ does not read as"
    r"|not a usable journal: "
    r"|has journal schema "
    r"|(cannot open the journal|failed): .+")


def _small_journal(tmp_path) -> bytes:
    """A journal of every kind the agent writes on the lumion rack (an admission, phases, one
    set up ahead, a swap, a long entry with a shared list), rewritten with 512-byte pages
    (VACUUM: the same rows, tables and indexes) so that each of its bytes can be flipped within
    seconds."""
    w = make_world(tmp_path, lumion())
    w.agent.start()
    connect(w, dp_tp(8))
    w.agent.on_phase("dp", 0)
    w.agent.on_phase_done("dp", 0)
    w.agent.on_phase("tp", 0)
    w.rack.faults.fail_gpu("gpu3")
    w.agent.on_health(w.rack.gpu_health("gpu3"))
    w.journal.record(Note(gpus=[f"gpu{i}" for i in range(300)]), "a long list, kept once")
    w.agent.on_phase("dp", 0)
    w.agent.close()
    w.journal.close()
    path = tmp_path / "j.db"
    db = sqlite3.connect(path, isolation_level=None)
    try:
        for pragma in ("journal_mode=DELETE", "page_size=512"):
            db.execute(f"PRAGMA {pragma}")
        db.execute("VACUUM")
        db.execute("PRAGMA journal_mode=WAL")
    finally:
        db.close()
    return path.read_bytes()


def _read_whole(path) -> tuple:
    """Everything the agent reads of a journal: its entries, the intended circuits, and the
    jobs recovery takes up from it (opened to be read: the same reads, nothing written)."""
    with SqliteJournal(path, read_only=True) as j:
        entries = j.entries()
        intended = j.intended()
        jobs = [(r.job.name, r.job.rank_map, r.job.phase, r.job.ready,
                 r.unfinished) for r in read_jobs(j, lumion(), round_robin_matchings)]
    return entries, intended, jobs


def test_every_flipped_byte_reads_back_as_written_or_is_refused_by_name(tmp_path):
    data = _small_journal(tmp_path)
    assert len(data) <= 16 * 1024
    want = _read_whole(tmp_path / "j.db")
    entries, intended, jobs = want
    assert len(entries) > 15 and intended["chip"] and jobs
    assert {e.kind for e in entries} >= {"decision", "applied", "phase", "rank_map", "restart",
                                         "detected", "verified", "note", "reconcile", "start"}
    copy = tmp_path / "flipped.db"
    shutil.copyfile(tmp_path / "j.db", copy)
    fd = os.open(copy, os.O_RDWR)
    same, refused, wrong = 0, 0, []
    try:
        for flip in (0xFF, 0x01):              # every bit of the byte, and its lowest alone
            for at in range(len(data)):
                os.pwrite(fd, bytes([data[at] ^ flip]), at)
                try:
                    got = _read_whole(copy)
                except JournalError as e:
                    refused += 1
                    said = str(e)
                    if "\n" in said or not said.startswith(str(copy)) or not NAMED.search(said):
                        wrong.append(f"byte {at} ^ {flip:#x}: refused as {said!r}")
                except Exception as e:          # (a traceback is a wrong answer too)
                    wrong.append(f"byte {at} ^ {flip:#x}: {type(e).__name__}: {e}")
                else:
                    if got == want:
                        same += 1
                    else:
                        wrong.append(f"byte {at} ^ {flip:#x}: read back different values")
                finally:
                    os.pwrite(fd, data[at:at + 1], at)
    finally:
        os.close(fd)
    assert wrong == [], f"{len(wrong)} flips: " + "; ".join(wrong[:5])
    # both outcomes occur: a flip in unused space changes nothing, one in a row is refused
    assert same > 1000 and refused > 1000, (same, refused)


def test_a_port_changed_in_the_intended_circuits_is_refused_by_its_switch(tmp_path):
    """The issue's case: one changed byte in the intended circuits, still JSON and still
    circuits ([2, 89] for [2, 25]), is refused, naming the switch."""
    path = tmp_path / "j.db"
    with SqliteJournal(path) as j:
        j.set_intended("chip", [(1, 18), (2, 25)], "test")
    db = sqlite3.connect(path, isolation_level=None)
    db.execute("UPDATE intended SET circuits=replace(circuits, '25', '89')")
    db.close()
    for read_only in (True, False):
        with SqliteJournal(path, read_only=read_only) as j:
            with pytest.raises(JournalError, match=r"intended circuits of switch 'chip' "
                                                   r"\(row 1\) do not match their checksum"):
                j.intended()


def test_an_entry_moved_to_another_number_is_refused(tmp_path):
    """A row's number is part of what its checksum covers: entry 1 renumbered 0 (still in
    order, SQLite's check sees nothing) is refused, not passed over."""
    path = tmp_path / "j.db"
    with SqliteJournal(path) as j:
        j.record(Note(), "first")
        j.record(Note(), "second")
    db = sqlite3.connect(path, isolation_level=None)
    db.execute("UPDATE events SET seq=0 WHERE seq=1")
    db.close()
    with SqliteJournal(path, read_only=True) as j:
        with pytest.raises(JournalError, match="entry 0 does not match its checksum"):
            j.entries()
        assert [e.cause for e in j.entries(since=1)] == ["second"]


def test_a_0_2_journal_is_read_as_it_is_and_sealed_when_a_writer_opens_it(tmp_path):
    """A journal of schema 2 (written by 0.2) read only is read as it is, checked as far as it
    can be, and left unchanged; opened by a writer it is brought to schema 3, every row sealed
    as it is then, and from then on a change to an old row is refused by name."""
    path = tmp_path / "j.db"
    shutil.copyfile(JOURNAL_0_2, path)
    before = path.read_bytes()
    with SqliteJournal(path, read_only=True) as j:
        old = j.entries()
        old_intended = j.intended()
    assert path.read_bytes() == before
    with SqliteJournal(path) as j:
        assert j.entries() == old and j.intended() == old_intended
    db = sqlite3.connect(path, isolation_level=None)
    try:
        assert db.execute("SELECT value FROM meta WHERE key='schema'").fetchone() == ("3",)
        assert db.execute("SELECT COUNT(*) FROM events WHERE checksum=''").fetchone() == (0,)
        assert db.execute("SELECT name FROM sqlite_master WHERE name='events_kind'"
                          ).fetchall() == []
        seq = old[3].seq
        db.execute("UPDATE events SET cause=cause || '!' WHERE seq=?", (seq,))
    finally:
        db.close()
    with SqliteJournal(path, read_only=True) as j:
        with pytest.raises(JournalError, match=f"entry {seq} does not match its checksum"):
            j.entries()


def test_a_schema_3_journal_whose_version_reads_2_is_refused(tmp_path):
    """A version changed by damage would read a sealed journal unchecked: the tables' columns
    must be the version's."""
    path = tmp_path / "j.db"
    with SqliteJournal(path) as j:
        j.record(Note(), "x")
    db = sqlite3.connect(path, isolation_level=None)
    db.execute("UPDATE meta SET value='2' WHERE key='schema'")
    db.close()
    for read_only in (True, False):
        with pytest.raises(JournalError, match="damaged \\(schema 2, but table events has "
                                               "columns .*checksum"):
            SqliteJournal(path, read_only=read_only)


def test_the_checksum_tells_types_apart():
    assert seal(1, 1.0, "1", None) == seal(1, 1.0, "1", None)
    assert len({seal(1), seal(1.0), seal("1"), seal(None), seal(b"1"), seal("", "1"),
                seal("1", "")}) == 7
