"""The journal's entries in their types (hil/agent/entries.py): written and read back as the
same Struct, every kind; a journal written by version 0.2 (tests/data/journal-0.2.db, made by
tests/data/make_journal_0_2.py) read in today's types, and the agent taking up from it;
entries that do not read as their kind named, never skipped."""
from __future__ import annotations

import json
import pathlib
import shutil

import pytest

from photonic_testbed.common.jobplan import round_robin_matchings
from photonic_testbed.common.rack_layout import lumion
from photonic_testbed.gui.model import to_entry
from photonic_testbed.hil.agent.bus import published_event, restart_orders
from photonic_testbed.hil.agent.entries import (
    KINDS,
    Admit,
    Alarm,
    Applied,
    Detected,
    Intent,
    JobFailure,
    LinkFade,
    Loopback,
    Note,
    PhaseSwitched,
    RankMapAnnounced,
    Reconcile,
    Release,
    RestartOrder,
    Slow,
    Start,
    Swap,
    SwitchReport,
    Unread,
    Verified,
    VerifyFailed,
    decode,
    words,
)
from photonic_testbed.hil.agent.journal import Entry, JournalError
from photonic_testbed.hil.agent.recovery import read_jobs
from photonic_testbed.hil.agent.sqlite_journal import SqliteJournal
from photonic_testbed.ptb.cli import main

DATA = pathlib.Path(__file__).parent / "data"
RANKS = {r: f"gpu{r}" for r in range(8)}
AFTER = {**RANKS, 3: "spare0", 5: "spare1"}

ONE_OF_EACH = [
    Start(), JobFailure(gpus=["gpu3"], links=[("gpu2", "gpu3")], job="a"),
    Detected(gpu="gpu3", reasons=["fatal Xid 79"]),
    Admit(job="a", plan={"name": "a", "world": 8}, rank_map=RANKS),
    Swap(job="a", failed=["gpu3"], swaps={"gpu3": "spare0"}, rank_map=AFTER, phase=("dp", 0)),
    Release(job="a"), Applied(switch="ocs", job="a", seconds=0.01, added=[(1, 33)]),
    Verified(dbm={"ocs:33": -3.2}), VerifyFailed(dbm={"ocs:34": -40.0}, dark=[("ocs", 2, 34)]),
    RankMapAnnounced(job="a", world=8, changed={3: "spare0"}),
    RestartOrder(job="a", rank_map=AFTER),
    PhaseSwitched(phase="tp", round=1, job="a", ahead=True,
                  applied={"ocs": SwitchReport(seconds=0.02, removed=[(2, 34)])}),
    Alarm(switch="ocs", during="phase tp round 1"), Reconcile(moves={"ocs": 2}),
    Note(job="a", rejoin={"job": "a", "state": "failed", "restart_seq": 2}),
    Loopback(loopback={"gpu3": False, "spare0": True}),
    Slow(action="swap", job="a", gpu="gpu3", ratio=1.5, steps=30, lost_s=0.4, price_s=0.03),
    LinkFade(action="moved", switch="chip", circuit=(3, 21), src="gpu1", dst="gpu2", dbm=-6.5,
             db_per_s=-0.2, avoided=[("s3r2", 2), ("s4r2", 3)])]


def test_every_kind_is_written_and_read_back_as_the_same_struct(tmp_path):
    assert {type(d).kind for d in ONE_OF_EACH} == set(KINDS)
    with SqliteJournal(tmp_path / "j.db") as j:
        for k, details in enumerate(ONE_OF_EACH):
            j.record(details, f"c{k}", defer=k % 2 == 1)
        j.set_intended_many({"ocs": [(2, 34), (1, 33)]}, "phase tp")
    with SqliteJournal(tmp_path / "j.db", read_only=True) as j:
        got = j.entries()
    assert [e.details for e in got] == [*ONE_OF_EACH, Intent(switch="ocs",
                                                             circuits=[(1, 33), (2, 34)])]
    assert [e.kind for e in got] == [type(d).kind for d in ONE_OF_EACH] + ["decision"]


def test_an_entry_that_does_not_read_as_its_kind_is_named_not_skipped(tmp_path):
    with SqliteJournal(tmp_path / "j.db") as j:
        j.record(Start(), "agent started")
        seq = j.record_stored("decision", "odd", action="swap", rank_map="gpu3")
        with pytest.raises(JournalError, match=f"entry {seq} does not read as a 'decision' "
                                               r"entry: Expected `object`, got `str` - at "
                                               r"`\$.rank_map`"):
            j.entries()
        assert [e.kind for e in j.entries(kinds=("start",))] == ["start"]
        assert j.stored_entries()[-1].details == {"action": "swap", "rank_map": "gpu3"}
    with pytest.raises(ValueError, match="'paused' is not a kind of journal entry"):
        decode("paused", {})


def _journal_0_2(tmp_path) -> SqliteJournal:
    """A copy of the 0.2 journal (the file in tests/data is never opened, so never changed)."""
    shutil.copy(DATA / "journal-0.2.db", tmp_path / "j.db")
    return SqliteJournal(tmp_path / "j.db")


def test_a_journal_written_by_0_2_reads_in_todays_types(tmp_path):
    with _journal_0_2(tmp_path) as j:
        entries = {e.seq: e for e in j.entries()}
    # it has one of every kind 0.2 wrote (a slow GPU's and a fading link's came in 0.3)
    assert {e.kind for e in entries.values()} == set(KINDS) - {"slow", "link"}
    assert entries[1].details == Start() and entries[1].cause == "agent started"
    admit = entries[3].details
    assert isinstance(admit, Admit) and admit.name() == "dp-tp" and admit.rank_map == RANKS
    assert [p["name"] for p in admit.plan["phases"]] == ["tp", "dp"]
    assert entries[4].details == Intent(switch="chip", circuits=[
        (1, 18), (2, 17), (3, 20), (4, 19), (5, 22), (6, 21), (7, 24), (8, 23)])
    assert entries[6].details == RankMapAnnounced(job="dp-tp", world=8, changed=RANKS)
    phase = entries[8].details
    assert isinstance(phase, PhaseSwitched) and (phase.phase, phase.round) == ("dp", 0)
    assert phase.applied["chip"].added[0] == (1, 19) and not phase.ahead
    assert entries[10].details.ahead and entries[10].cause == "phase tp round 0 set up ahead"
    assert entries[11].details == Detected(reasons=["GPU is lost (fallen off the bus)",
                                                    "fatal Xid 79"])
    assert entries[12].details == Swap(job="dp-tp", failed=["gpu3"], swaps={"gpu3": "spare0"},
                                       rank_map={**RANKS, 3: "spare0"}, phase=("tp", 0))
    assert entries[14].details == Applied(switch="chip", job="dp-tp", added=[(3, 25), (9, 19)],
                                          removed=[(3, 20), (4, 19)])
    assert entries[15].details == Verified(dbm={"chip:25": -1.55, "chip:19": -1.69})
    assert entries[17].details == RestartOrder(job="dp-tp", rank_map={**RANKS, 3: "spare0"})
    assert entries[19].details == Note(reasons=["ecc"])
    assert entries[20].details == JobFailure(links=[("gpu4", "gpu5")])
    assert entries[22].details == Loopback(loopback={"gpu4": True, "gpu5": False,
                                                     "spare1": True})
    assert entries[23].details == Detected(reason="link down")
    assert entries[24].details.swaps == {"gpu5": "spare1"}
    assert entries[30].details.switch == "chip" and len(entries[30].details.added) == 8
    assert entries[31].details == Reconcile(moves={"chip": 8})
    assert entries[32].details.dark == [("chip", 2, 17)]
    assert isinstance(entries[32].details, VerifyFailed)
    assert entries[33].details == Alarm(phase="tp", round=0)
    assert entries[34].details == Release(job="dp-tp")
    assert entries[35].details == Intent(switch="chip", circuits=[])
    assert entries[39].details == Start() and max(entries) == 40


class AsItWas:
    """The 0.2 journal as it stood at entry `upto` (before its job was released): a Journal
    kept in memory, enough for reading the jobs back."""

    def __init__(self, journal: SqliteJournal, upto: int):
        self.kept = [e for e in journal.entries() if e.seq <= upto]
        self.circuits = next(e.details.circuits for e in reversed(self.kept)
                             if isinstance(e.details, Intent))

    def entries(self, since: int = 0, kinds: tuple[str, ...] | None = None,
                limit: int | None = None) -> list[Entry]:
        return [e for e in self.kept if e.seq > since and (kinds is None or e.kind in kinds)]

    def intended(self) -> dict[str, list[tuple[int, int]]]:
        return {"chip": list(self.circuits)}


def test_the_agent_takes_up_a_job_and_its_orders_from_a_0_2_journal(tmp_path):
    with _journal_0_2(tmp_path) as j:
        assert read_jobs(j, lumion(), round_robin_matchings) == []     # released at the end
        orders = restart_orders(j)
        assert isinstance(orders["dp-tp"].pop("t"), float)      # when it was journaled
        assert orders == {"dp-tp": {
            "seq": 2, "cause": "job failure: gpu5",
            "rank_map": {str(r): g for r, g in AFTER.items()}}}
        (job,) = read_jobs(AsItWas(j, 33), lumion(), round_robin_matchings)
    assert job.unfinished is None and job.job.name == "dp-tp"
    assert job.job.rank_map == AFTER and job.job.phase == ("tp", 0)
    assert job.job.plan.world == 8


def test_ptb_journal_prints_a_0_2_journal_in_words_and_as_stored(capsys, tmp_path):
    shutil.copy(DATA / "journal-0.2.db", tmp_path / "j.db")
    assert main(["journal", str(tmp_path / "j.db"), "--kind", "decision"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 8
    assert lines[2].split(" decision ", 1)[1] == (
        "     (GPU failure: gpu3) [0.0 ms]  action: swap; job: dp-tp; failed: gpu3; swaps: "
        "gpu3 → spare0; rank map: 0 → gpu0, 1 → gpu1, 2 → gpu2, 3 → spare0, 4 → gpu4, 5 → gpu5, "
        "6 → gpu6, 7 → gpu7; phase: tp, 0")
    assert main(["journal", str(tmp_path / "j.db"), "--json", "--since", "11",
                 "--kind", "decision"]) == 0
    first = json.loads(capsys.readouterr().out.splitlines()[0])
    assert first["seq"] == 12 and first["details"] == {
        "action": "swap", "job": "dp-tp", "failed": ["gpu3"], "swaps": {"gpu3": "spare0"},
        "rank_map": {str(r): g for r, g in {**RANKS, 3: "spare0"}.items()},
        "phase": ["tp", 0], "degraded": False}


def test_the_gui_reads_published_entries_in_their_types_and_brief_ones_as_they_came():
    swap = Swap(job="a", failed=["gpu3"], swaps={"gpu3": "spare0"}, rank_map=AFTER)
    whole = to_entry(published_event(Entry(7, 1.0, "decision", "c", 0.001, swap)))
    assert whole.details == swap and "swaps: gpu3 → spare0" in words(whole.details)
    big = RestartOrder(job="a", rank_map={r: f"gpu{r}" for r in range(512)})
    event = published_event(Entry(8, 2.0, "restart", "c", None, big))
    assert event["brief"] and event["details"]["rank_map"] == {"items": 512}
    brief = to_entry(event)
    assert brief.details == Unread(fields={"job": "a", "rank_map": {"items": 512}})
    assert words(brief.details) == "job: a; rank map: items → 512"
