"""The control plane on etcd: a real 3-member etcd cluster (hil.etcd.cluster), the journal on it
(hil.agent.etcd_journal), and the election of an agent group's leader (hil.agent.leadership)."""
from __future__ import annotations

import threading
import time

import pytest

from photonic_testbed.hil.agent.entries import Alarm, Note, Start
from photonic_testbed.hil.agent.etcd_journal import EtcdJournal, parse_url
from photonic_testbed.hil.agent.journal import JournalError
from photonic_testbed.hil.agent.leadership import Leadership, NotLeading
from photonic_testbed.hil.etcd.client import Etcd, EtcdUnavailable, parse_endpoints
from photonic_testbed.hil.etcd.cluster import LocalCluster


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    with LocalCluster(3, tmp_path_factory.mktemp("etcd")) as c:
        yield c


_groups = iter(range(10**6))


def _replica(cluster, group: str, name: str, ttl_s: int = 2, follow: bool = False
             ) -> tuple[Leadership, EtcdJournal]:
    etcd = Etcd(cluster.endpoints, timeout=3.0)
    lead = Leadership(etcd, group, {"name": name, "request": f"tcp://127.0.0.1:1/{name}"},
                      ttl_s=ttl_s)
    return lead, EtcdJournal(etcd, lead, follow=follow)


def test_one_leader_terms_rise_and_a_deposed_leader_writes_nothing(cluster):
    group = f"g{next(_groups)}"
    a, ja = _replica(cluster, group, "a")
    b, jb = _replica(cluster, group, "b", follow=True)     # (it reads from its copy)
    stop = threading.Event()
    assert a.campaign(stop) == 1 and a.leading()
    seen = []
    waiting = threading.Thread(target=lambda: seen.append(b.campaign(stop, on_standby=seen.append)),
                               daemon=True)
    waiting.start()
    try:
        _standby_takes_over(a, ja, b, jb, seen, waiting)
    finally:
        stop.set()
        waiting.join(5)
        jb.close()


def _standby_takes_over(a, ja, b, jb, seen, waiting):
    time.sleep(0.3)
    assert b.leading() is False and b.leader()["name"] == "a"
    assert seen and seen[0]["name"] == "a" and seen[0]["term"] == 1

    # the leader's journal: deferred entries written with the next durable one, in order
    told = []
    ja.listen(lambda e, text: told.append(e.seq))
    s1 = ja.record(Note(job="deferred"), defer=True)
    assert told == []
    s2 = ja.set_intended_many({"ocs": [(1, 18), (2, 17)]}, cause="test")
    assert told == [s1, s2] and s2 == s1 + 1
    s3 = ja.record(Start(term=1))
    got = jb.entries()                         # a standby reads what the leader wrote
    assert [e.seq for e in got] == [s1, s2, s3]
    assert got[0].details == Note(job="deferred") and got[2].details == Start(term=1)
    assert jb.intended() == {"ocs": [(1, 18), (2, 17)]}
    assert [e.seq for e in jb.entries(since=s1, kinds=("start",))] == [s3]
    with pytest.raises(NotLeading):            # a standby cannot write
        jb.record(Note(job="from a standby"))

    a.resign()                                 # the standby takes over at once, term 2
    waiting.join(5)
    assert seen[-1] == 2 and b.leading() and b.term == 2
    with pytest.raises(NotLeading):
        ja.record(Alarm(), cause="a deposed leader")
    jb.record(Note(job="the new leader"))
    assert [e.details.job for e in jb.entries(kinds=("note",))] == ["deferred", "the new leader"]
    b.resign()


def test_a_leader_whose_lease_lapsed_stops_by_its_own_clock(cluster):
    """A leader that could not refresh its lease (paused, cut off) takes itself as deposed once
    the lease has surely lapsed, even before it hears so from etcd; its writes are refused by
    etcd as well (the transaction holds only under its lease)."""
    group = f"g{next(_groups)}"
    a, ja = _replica(cluster, group, "a")
    stop = threading.Event()
    assert a.campaign(stop) == 1
    a._stop.set()                   # its keeper stops refreshing, as a paused process's does
    a._keeper.join(5)
    a._stop.clear()
    deadline = time.monotonic() + 10
    while a.leading() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not a.leading()
    with pytest.raises(NotLeading):
        ja.record(Note(job="too late"))
    b, jb = _replica(cluster, group, "b")
    assert b.campaign(stop) == 2            # once etcd expired a's lease
    a._alive_until = time.monotonic() + 60  # a clock that lies: etcd still refuses its write
    with pytest.raises(NotLeading):
        ja.record(Note(job="still too late"))
    assert [e.kind for e in jb.entries()] == []
    b.resign()


def test_quorum_lost_then_back(cluster, tmp_path):
    """Two members of three down: a write fails (EtcdUnavailable) within the client's timeout,
    not a hang; with one back, writes resume."""
    with LocalCluster(3, tmp_path / "q") as q:
        etcd = Etcd(q.endpoints, timeout=1.5)
        etcd.put("k", "1")
        q.kill(1)
        q.kill(2)
        t0 = time.monotonic()
        with pytest.raises(EtcdUnavailable, match="no etcd member answered"):
            etcd.put("k", "2")
        assert time.monotonic() - t0 < 5.0
        q.restart(1)
        deadline = time.monotonic() + 20
        while True:
            try:
                etcd.put("k", "3", timeout=2.0)
                break
            except EtcdUnavailable:
                assert time.monotonic() < deadline, "writes did not resume with quorum back"
        assert etcd.get("k").value == b"3"


def test_urls_and_member_lists_are_checked():
    assert parse_url("etcd://127.0.0.1:2379,127.0.0.1:2380/lumion") == (
        "127.0.0.1:2379,127.0.0.1:2380", "lumion")
    assert parse_endpoints("http://[::1]:2379") == [("::1", 2379)]
    for bad in ("etcd://127.0.0.1:2379", "etcd://h:1/a/b", "file:///x", "etcd:///g"):
        with pytest.raises(ValueError):
            m, _ = parse_url(bad)
            parse_endpoints(m)
    for bad in ("", "host", "host:port", "h:0", "https://h:2379"):
        with pytest.raises(ValueError):
            parse_endpoints(bad)


def test_an_unreachable_cluster_is_a_clear_journal_error():
    etcd = Etcd("127.0.0.1:9", timeout=0.3)
    lead = Leadership(etcd, "nowhere", {"name": "a"})
    with pytest.raises(JournalError, match="no etcd member answered"):
        EtcdJournal(etcd, lead).intended()


def test_a_request_asked_again_of_the_same_replica_runs_once():
    """The job's client, given up on a slow leader and refused by the standby, asks the leader
    again with the same request id: the leader runs the admission once and answers it."""
    from concurrent.futures import Future

    from photonic_testbed.hil.bus.errors import NotLeader
    from photonic_testbed.hil.bus.server import Server
    from photonic_testbed.hil.job.fabric_client import Fabric
    runs = []

    def slow_admit(args):                   # answered later, the loop serving meanwhile
        runs.append(time.monotonic())
        done = Future()
        threading.Timer(1.2, done.set_result,
                        ({"job": "j", "rank_map": {"0": "gpu0"}, "restart_seq": 0},)).start()
        return done

    def refuse(args):
        raise NotLeader("a standby")
    leader = Server("agent@r0", {"role": "leader", "term": 1, "jobs": {}}, kind="agent",
                    handlers={"admit": slow_admit})
    standby = Server("agent@r1", {"role": "standby"}, kind="agent",
                     handlers={"admit": refuse})
    eps = [leader.bind(), standby.bind()]
    stop = threading.Event()

    def serve(s):
        while not stop.is_set():
            s.poll(0.02)
    threads = [threading.Thread(target=serve, args=(s,), daemon=True) for s in (leader, standby)]
    for t in threads:
        t.start()
    fabric = Fabric(*eps[0], timeout=1.0, job="j", replicas={"r0": eps[0], "r1": eps[1]})
    try:
        assert fabric.admit({"name": "j", "world": 1}) == {0: "gpu0"}
        assert len(runs) == 1
    finally:
        fabric.close()
        stop.set()
        for t in threads:
            t.join(2)
        leader.close()
        standby.close()


def test_a_write_whose_outcome_is_unknown_steps_the_leader_down(cluster):
    """etcd unreachable in the middle of a leader's write: it may have been written, so the
    replica steps down (the next leader reads what was), never carries on as leader."""
    group = f"g{next(_groups)}"
    a, ja = _replica(cluster, group, "a")
    assert a.campaign(threading.Event()) == 1
    ja.record(Note(job="before"))
    ja.etcd.close()
    ja.etcd.members = [("127.0.0.1", 9)]          # every member unreachable from here on
    ja.etcd.timeout = 0.3
    with pytest.raises(NotLeading, match="may or may not have been written"):
        ja.record(Note(job="unknown"))
    assert not a.leading() and "outcome is unknown" in a.lost_because
    with pytest.raises(NotLeading):
        a.fence(0)                                 # etcd would take lease 0 as "no key"
    b, jb = _replica(cluster, group, "b")
    assert b.campaign(threading.Event()) == 2
    assert [e.details.job for e in jb.entries()] == ["before"]
    b.raise_term(7)                                # (devices that took a higher term)
    b.resign()
    c, _ = _replica(cluster, group, "c")
    assert c.campaign(threading.Event()) == 8
    c.resign()


def test_long_lists_are_kept_once_and_checked(cluster):
    """A long entry's lists, and a switch's intended circuits, are written to etcd once and
    referred to by digest (a phase switch's lists come back round after round); read back
    whole; a shared value changed behind the journal's back is refused, never read."""
    from photonic_testbed.hil.agent.entries import Intent
    from photonic_testbed.hil.etcd.client import put_op
    group = f"g{next(_groups)}"
    a, ja = _replica(cluster, group, "a")
    assert a.campaign(threading.Event()) == 1
    long = Intent(switch="ocs", circuits=[(i, 1000 + i) for i in range(300)])
    circuits = [(i, 100 + i) for i in range(40)]
    for _ in range(3):
        ja.record(long, cause="round")
        ja.set_intended_many({"ocs": circuits}, cause="round", event=False)
    shared, _ = ja.etcd.prefix(f"/ptb/{group}/journal/shared/")
    assert len(shared) == 2                     # the entry's list and the intended circuits
    _, fresh = _replica(cluster, group, "reader")
    assert [e.details for e in fresh.entries()] == [long] * 3
    assert fresh.intended() == {"ocs": circuits}
    ja.etcd.txn([], [put_op(shared[0].key, b"[[1, 2]]")])     # damage, behind its back
    _, damaged = _replica(cluster, group, "reader")
    with pytest.raises(JournalError, match="does not match its digest"):
        damaged.entries()
    a.resign()


def test_a_write_etcd_refuses_is_no_step_down(cluster):
    """A write etcd refuses (past its request size: a thousand times a phase switch's lists)
    was not written, and says so; the replica still leads and writes what fits. A term counter
    someone else overwrote with text stops no replica with a traceback: it is an error that
    names the key."""
    from photonic_testbed.hil.agent.entries import Intent
    from photonic_testbed.hil.etcd.client import EtcdError
    group = f"g{next(_groups)}"
    a, ja = _replica(cluster, group, "a")
    assert a.campaign(threading.Event()) == 1
    huge = Intent(switch="ocs", circuits=[(i, i + 1) for i in range(1_200_000)])
    with pytest.raises(JournalError, match="etcd refused a write of 1 entries"):
        ja.record(huge)
    assert a.leading()
    ja.record(Note(job="after"))
    assert [e.details for e in ja.entries()] == [Note(job="after")]
    a.resign()
    ja.etcd.put(f"/ptb/{group}/term", "seven")
    b, _ = _replica(cluster, group, "b")
    with pytest.raises(EtcdError, match="not a number"):
        b._try()


def test_a_followed_journal_is_read_from_its_copy_across_a_lost_member_and_compaction(tmp_path):
    """A replica's copy of the journal (kept by watch) reads what etcd holds, entry for entry:
    after the member its watch was on is killed (another member's watch takes up where it
    was) and after etcd compacted the revisions it had not seen (read whole again)."""
    with LocalCluster(3, tmp_path / "m") as q:
        writer, jw = _replica(q, "mirror", "w")
        reader = EtcdJournal(Etcd(q.endpoints, timeout=3.0), Leadership(
            Etcd(q.endpoints), "mirror", {"name": "r"}))          # reads etcd each time
        _, jf = _replica(q, "mirror", "f", follow=True)
        assert writer.campaign(threading.Event()) == 1
        try:
            def same() -> bool:
                got = jf.entries()
                assert [e.line() for e in got] == [e.line() for e in reader.entries()]
                assert jf.intended() == reader.intended()
                return bool(got)
            long = [(i, 200 - i) for i in range(1, 100)]      # a shared value
            for k in range(20):
                jw.record(Note(job=f"n{k}"), defer=k % 2 == 0)
                jw.set_intended_many({"ocs": long[: 40 + k]}, cause="test")
            assert same() and jf.mirror.entries_from(b"") is not None   # from the copy
            assert len(jf.entries(since=10, kinds=("note",), limit=3)) == 3
            watched = jf.mirror._watch.member
            q.kill(next(i for i, m in enumerate(q.nodes) if m.client_port == watched[1]))
            for k in range(5):
                jw.record(Note(job=f"after the kill {k}"))
            _until(same, "the copy caught up through another member")
            assert jf.mirror._watch.member != watched and jf.mirror.entries_from(b"")
            assert jf.entries()[-1].details == Note(job="after the kill 4")
            # compaction of every revision the copy has not seen: it reads the keys whole again
            jf.mirror._stop.set()           # (its watch stopped, as if cut off a while)
            jf.mirror._watch.close()
            jf.mirror._thread.join(10)
            assert jf.mirror._from > 1
            for k in range(5):
                jw.record(Note(job=f"compacted {k}"))
            head = jw.etcd.put("/other", "x")
            jw.etcd.call("kv/compaction", {"revision": str(head), "physical": True})
            jf.mirror._stop.clear()
            jf.mirror._thread = threading.Thread(target=jf.mirror._follow, daemon=True)
            jf.mirror._thread.start()
            _until(lambda: jf.mirror.resyncs == 1, "the copy read whole again")
            assert same() and jf.entries()[-1].details == Note(job="compacted 4")
            assert jf.mirror.entries_from(b"")
        finally:
            writer.resign()
            jf.close()


def _until(cond, what: str, timeout: float = 30.0):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"{what}: not within {timeout} s"
        time.sleep(0.05)


def test_a_standby_works_the_jobs_circuits_out_ahead_and_the_takeover_takes_them(
        cluster, tmp_path):
    """Two replicas in this process on the opus rig: the standby works the admitted job's
    circuits out as the journal changes (a swap's new rank map too); the replica taking the lead
    takes them, and its job is the one a replica working them out anew has (work_ahead off)."""
    import dataclasses

    from photonic_testbed.common.jobplan import dp_tp
    from photonic_testbed.hil.agent.bus import AgentProcess
    from photonic_testbed.hil.job.fabric_client import Fabric
    from photonic_testbed.hil.rig import free_ports
    from tests.test_agent_bus import _rig_on_bus
    from tests.test_bus_at_most_once import serving

    with _rig_on_bus(tmp_path, "opus", "ocs", switching_s=0.0) as (emu, rig, _):
        ports = iter(free_ports(6))
        rig = dataclasses.replace(rig, replicas={
            n: (f"tcp://127.0.0.1:{next(ports)}", f"tcp://127.0.0.1:{next(ports)}")
            for n in "abc"}, devices={"ocs": rig.devices["ocs"]})
        url = f"etcd://{cluster.endpoints}/ahead{next(_groups)}"
        a = AgentProcess(rig, url, replica="a", timeout=10)
        b = AgentProcess(rig, url, replica="b", timeout=10)
        won = []
        standing = threading.Thread(target=lambda: won.append(b.campaign(threading.Event())))
        try:
            assert a.campaign(threading.Event())
            a.start()
            standing.start()
            with serving(a.run):
                fabric = Fabric(*rig.replicas["a"], replicas=rig.replicas, timeout=10)
                try:
                    fabric.admit(dp_tp(8))
                    emu.rack.rack.faults.fail_gpu("server2")        # a swap: a new rank map
                    new_map, _ = fabric.wait_restart(timeout=30)
                finally:
                    fabric.close()
                _until(lambda: [dict(k[2]) for k in b.warm.ahead._kept] == [new_map],
                       "the standby's circuits of the swapped job (only)")
            a.close()
            standing.join(30)
            assert won == [True]
            b.start()
            assert b.warm.ahead.taken == 1 and b.agent.jobs["dp-tp"].rank_map == new_map
            assert b.journal.mirror is None     # (leading, it reads etcd: no copy kept)
            assert b.warm.journal.mirror.entries_from(b"") is None  # (its reader's: stopped)
            b.close()
            cold = AgentProcess(rig, url, replica="c", timeout=10,
                                config=dataclasses.replace(rig.agent, work_ahead=False))
            assert cold.warm is None and cold.campaign(threading.Event())
            cold.start()
            mine, theirs = cold.agent.jobs["dp-tp"], b.agent.jobs["dp-tp"]
            assert mine.circuits.targets == theirs.circuits.targets
            assert (mine.phase, mine.rank_map) == (theirs.phase, theirs.rank_map)
            cold.close()
        finally:
            for p in (a, b):
                p.close()


def test_a_copy_behind_or_on_a_hung_member_is_not_read(tmp_path, monkeypatch):
    """The copy is read only when it holds the journal's head as etcd has it: a journal wiped
    while the copy's watch was stopped is read from etcd (empty), not from the copy; a member
    stopped (SIGSTOP) under the copy's watch is left for another, the reads going on meanwhile;
    an idle journal's silent watch is asked again from the store's revision, so a compaction of
    other keys' history sends it to no whole read."""
    import signal

    from photonic_testbed.hil.agent import journal_mirror
    from photonic_testbed.hil.etcd.client import delete_op, prefix_end
    monkeypatch.setattr(journal_mirror, "SILENT_S", 1.0)
    with LocalCluster(3, tmp_path / "h") as q:
        writer, jw = _replica(q, "hung", "w")
        _, jf = _replica(q, "hung", "f", follow=True)
        assert writer.campaign(threading.Event()) == 1
        stopped = None
        try:
            for k in range(5):
                jw.record(Note(job=f"n{k}"))
            assert len(jf.entries()) == 5 and jf.mirror.entries_from(b"") is not None
            # idle: the silent watch is asked again from the store's revision, not compacted
            before = jf.mirror._from
            head = jw.etcd.put("/elsewhere", "x")
            for k in range(3):
                head = jw.etcd.put("/elsewhere", str(k))
            _until(lambda: jf.mirror._from > head, "the idle copy moved to the store's revision")
            jw.etcd.call("kv/compaction", {"revision": str(head), "physical": True})
            time.sleep(2.5)                          # (silent twice more)
            assert jf.mirror.resyncs == 0 and jf.mirror._from > before
            # a member stopped under the watch: reads go on, the watch moves
            watched = jf.mirror._watch.member
            stopped = next(m for m in q.nodes if m.client_port == watched[1])
            stopped.proc.send_signal(signal.SIGSTOP)
            jw.etcd._preferred = next(i for i, m in enumerate(q.nodes) if m is not stopped)
            jw.record(Note(job="with a member stopped"))
            t = time.monotonic()
            assert jf.entries()[-1].details == Note(job="with a member stopped")
            assert time.monotonic() - t < 10
            _until(lambda: jf.mirror._watch is not None and jf.mirror._watch.member != watched
                   and jf.mirror.entries_from(b"") is not None, "the watch on another member")
            stopped.proc.send_signal(signal.SIGCONT)
            stopped = None
            # wiped while the copy's watch is stopped: etcd's word, not the copy's
            jf.mirror._stop.set()
            jf.mirror._watch.close()
            jf.mirror._thread.join(10)
            assert not jf.mirror._thread.is_alive()
            base = "/ptb/hung/journal/"
            jw.etcd.txn([], [delete_op(base, prefix_end(base))])
            assert jw.etcd.prefix(base)[0] == []
            assert jf.entries() == [] and jf.intended() == {}
            time.sleep(1.0)             # (a write the stopped member held: it never applies)
            assert jw.etcd.prefix(base)[0] == []
        finally:
            if stopped is not None:
                stopped.proc.send_signal(signal.SIGCONT)
            writer.resign()
            jf.close()


def test_circuits_that_failed_ahead_are_worked_out_again():
    """A failure while a standby worked a job's circuits out is not kept: the next reading and
    the takeover work them out again."""
    from photonic_testbed.common.jobplan import dp_ring
    from photonic_testbed.common.rack_layout import layout
    from photonic_testbed.hil.agent import policies, recovery
    from photonic_testbed.hil.agent.entries import Admit
    from photonic_testbed.hil.agent.failover import round_robin_matchings

    lay = layout("opus")
    plan = dp_ring(8)
    rank_map = dict(enumerate(sorted(g for g in lay.gpus if g not in lay.spares)[:8]))
    admit = Admit(plan=plan.to_dict(), rank_map=rank_map)
    ahead = recovery.CircuitsAhead()
    real = policies.JobCircuits
    calls = []

    def flaky(*args):
        calls.append(1)
        if len(calls) == 1:
            raise MemoryError("for a moment")
        return real(*args)
    ahead.reading(lay)
    recovery.policies.JobCircuits = flaky
    try:
        with pytest.raises(MemoryError):
            ahead.circuits("dp", admit, rank_map, lay, round_robin_matchings)
        got = ahead.circuits("dp", admit, rank_map, lay, round_robin_matchings)  # again
        mine = ahead.circuits("dp", admit, rank_map, lay, round_robin_matchings, mine=True)
    finally:
        recovery.policies.JobCircuits = real
    assert len(calls) == 2 and mine is got and ahead.taken == 1


def test_a_journal_write_applies_once_or_never(cluster):
    """A write's transaction sent again (asked of another member after a timeout, whose first
    attempt had committed) is taken as written, not refused; one sent late (a member stopped
    with it, resumed after later writes) changes nothing."""
    group = f"g{next(_groups)}"
    lead, journal = _replica(cluster, group, "a")
    assert lead.campaign(threading.Event())
    etcd = journal.etcd
    real = etcd.txn
    sent = []

    def twice(compare, success, failure=(), **kw):
        sent.append((list(compare), list(success)))
        real(compare, success, failure, **kw)            # the first attempt commits ...
        return real(compare, success, failure, **kw)     # ... its answer lost: asked again
    try:
        journal.record(Note(job="one"))
        etcd.txn = twice
        journal.set_intended_many({"ocs": [(1, 18)]}, cause="written once")
        etcd.txn = real
        assert lead.leading()                           # (not refused: it was written)
        journal.set_intended_many({"ocs": [(2, 17)]}, cause="later")
        late, _ = real(*sent[0])                        # the first, sent late
        assert not late
        assert journal.intended() == {"ocs": [(2, 17)]}
        assert [e.cause for e in journal.entries()] == ["", "written once", "later"]
    finally:
        etcd.txn = real
        lead.resign()
