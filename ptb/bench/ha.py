"""The control plane replicated on etcd: a GPU fails and the leading agent replica is killed
(kill -9) at a random point of the swap; how long until the job runs again on the spare.

The stack runs as processes: the lumion emulator (ideal chip, zero switching delay) with two
agent replicas named in its rig file, the device services, a local etcd cluster of 3 members
(`ptb etcd`) and both replicas (`ptb agent --journal etcd://...`). Each run fails a random GPU of
the emulated job, waits a random 0-100 ms (the swap takes about 50: before its decision, within
it, or just after), kills the replica that leads, and measures from the failure to the job's
first step on its new rank map (the job's own restart record). The killed replica is started
again and stands by, and another has taken the lead, before the next run. The
same failures without a kill, in the same run, are the baseline. Every run's journal entries are
checked: no circuit added twice on a switch.

Then (`--pauses`) the leading replica is paused (SIGSTOP) past its lease: another takes the lead,
a GPU fails and is swapped by the new leader, and the paused one is resumed (SIGCONT) with the
failure and the new leader's changes waiting for it: the changes the switch's service takes
after that (its state version) are counted; a deposed leader must make none.

Then (`--partitions`, ptb/bench/partition.py) the leading replica, on a host of its own (a
network namespace), is cut off while it runs; another takes the lead and swaps; with the link
back, the moves and circuit changes the OCS makes after are counted (goal 0). Needs root.

Then (`--pods`, on opus2048 with an agent group per pod) pod 0's leader is killed again and
again while a job in pod 1 switches phases: its switches while pod 0 has no leader against the
rest, and pod 1's term.

Then (`--takeovers`, on opus2048 with a heavy job) the leader is killed and the standby's
takeover timed, with its work ahead (hil.agent.warm) and without, alternated.

Then (`--phases`, on the opus rig: a DP/TP job on its OCS, one replica) phase switches with the
etcd cluster whole, with one member of three killed (the cluster's leader among them, as chance
has it), and with two killed: no phase is granted (nothing moves) until a member is back; the
grant then comes once, and no circuit is added twice.
"""
from __future__ import annotations

import functools
import pathlib
import random
import signal
import time
from typing import Any

from photonic_testbed.hil.agent.entries import Applied
from photonic_testbed.hil.agent.leadership import Leadership
from photonic_testbed.hil.bus.client import BusError, ServiceClient
from photonic_testbed.hil.lab.control_client import request
from photonic_testbed.ptb.bench import SEED, integer
from photonic_testbed.ptb.bench.measure import etcd_journal_reader, percentile
from photonic_testbed.ptb.cli import CommandFailed
from photonic_testbed.ptb.stack import Stack

NAME = "ha"
HELP = "agent leader killed (kill -9) mid swap: failure -> job running (lumion, etcd)"
RESUME_S = 60.0


def add_arguments(p) -> None:
    p.add_argument("--runs", type=integer(1, 10_000), default=30,
                   help="failures with the leader killed (default %(default)s)")
    p.add_argument("--baseline", type=integer(0, 10_000), default=10,
                   help="failures with no kill, in the same run (default %(default)s)")
    p.add_argument("--seed", type=SEED, default=1, help="of the victims and the kill points")
    p.add_argument("--pauses", type=integer(0, 10_000), default=20,
                   help="trials with the leader paused past its lease (default %(default)s)")
    p.add_argument("--phases", type=integer(0, 100_000), default=200,
                   help="phase switches timed with etcd whole and with a member down "
                   "(default %(default)s; 0: skip)")
    p.add_argument("--partitions", type=integer(0, 10_000), default=20,
                   help="trials with the leader cut off in its own network namespace (needs "
                   "root and iproute2; default %(default)s)")
    p.add_argument("--pods", type=integer(0, 1000), default=5,
                   help="on opus2048 with an agent group per pod: pod 0's leader killed while "
                   "pod 1's job switches phases (default %(default)s; 0: skip)")
    p.add_argument("--takeovers", type=integer(0, 1000), default=10,
                   help="on opus2048 with its heavy job: the leader killed, a standby taking "
                   "over with its work ahead and without, alternated (default %(default)s; "
                   "0: skip)")


def _resumed_after(control: str, t: float) -> dict | None:
    s = request(control, {"cmd": "job_status"})
    if s["state"] == "aborted":
        raise CommandFailed(f"the job aborted: {s['events'][-3:]}")
    return next((r for r in s.get("restart_records", ())
                 if r["t"] >= t and r["resumed_t"] is not None), None)


def run(args) -> dict:
    rnd = random.Random(args.seed)
    with Stack() as stack:
        stack.emulate("lumion", "--ideal-chip", "--switching-ms", "0", "--replicas", "2")
        stack.serve()
        url = stack.etcd(3)
        stack.replicas(url, "--quarantine", "0", "--lease", "1")
        reader = etcd_journal_reader(url)
        leadership = reader.leadership
        control = stack.control
        request(control, {"cmd": "job_start", "plan": "dp", "steps": 10 ** 9,
                          "checkpoint_every": 5, "restart_s": 0.02})
        stack.wait("the job's first steps",
                   lambda: request(control, {"cmd": "job_status"})["step"] >= 2, 60)
        kinds = ["kill"] * args.runs + ["none"] * args.baseline
        rnd.shuffle(kinds)
        samples: dict[str, list[float]] = {"kill": [], "none": []}
        twice = 0
        terms = []
        for k, kind in enumerate(kinds):
            status = request(control, {"cmd": "job_status"})
            victim = rnd.choice(list(status["rank_map"].values()))
            leader = stack.wait("a leader", leadership.leader, 30)
            seq = max((e.seq for e in reader.entries()), default=0)
            t_fail = time.time()
            request(control, {"cmd": "fail_gpu", "gpu": victim, "mode": "hard"})
            if kind == "kill":
                time.sleep(rnd.uniform(0.0, 0.1))
                stack.kill(f"agent-{leader['name']}")
            got = stack.wait(f"run {k}: the job running again without {victim}",
                             functools.partial(_resumed_after, control, t_fail), RESUME_S)
            samples[kind].append(got["resumed_t"] - t_fail)
            if kind == "kill":
                stack.start_replica(leader["name"], url, "--quarantine", "0", "--lease", "1")
                _standing_by(stack, leader["name"])
                now = stack.wait("a new leader",
                                 functools.partial(_newer, leadership, leader["term"]), 30)
                terms.append(int(now["term"]))
            twice += len(added_twice(reader.entries(since=seq)))
            request(control, {"cmd": "heal_gpu", "gpu": victim})
        paused = [_paused_leader(stack, leadership, control, rnd)
                  for _ in range(args.pauses)]
    rows = []
    for kind, what in (("kill", "leader killed mid swap"), ("none", "no kill (baseline)")):
        xs = samples[kind]
        if xs:
            rows.append({"what": f"failure -> job running, {what}", "runs": len(xs),
                         "p50_s": round(percentile(xs, 0.5), 3),
                         "p99_s": round(percentile(xs, 0.99), 3),
                         "max_s": round(max(xs), 3)})
    rows.append({"what": "circuits added twice on a switch (all runs)",
                 "runs": len(kinds), "p50_s": twice, "p99_s": "", "max_s": ""})
    if paused:
        rows.append({"what": "leader paused past its lease, resumed: the switch's changes after",
                     "runs": len(paused), "p50_s": sum(paused), "p99_s": "", "max_s": ""})
    cuts = _partitions(args.partitions, rnd) if args.partitions else {}
    rows += cuts.pop("rows", [])
    quorum = _quorum(args.phases) if args.phases else {}
    rows += quorum.pop("rows", [])
    pods = _pods(args.pods) if args.pods else {}
    rows += pods.pop("rows", [])
    takeovers = _takeovers(args.takeovers) if args.takeovers else {}
    rows += takeovers.pop("rows", [])
    return {"rows": rows, "samples_s": samples, "terms": terms, "quorum": quorum,
            "takeovers": takeovers, "partitions": cuts, "pods": pods,
            "setup": "lumion, ideal chip, 0 ms switching; 3 etcd members; 2 replicas, "
                     "lease 1 s"}


def _quorum(phases: int) -> dict:
    """Phase switches on opus with etcd whole, one member down, then two (module text)."""
    from photonic_testbed.common.jobplan import dp_tp
    from photonic_testbed.hil.etcd.cluster import LocalCluster
    from photonic_testbed.hil.job.fabric_client import Fabric
    with Stack() as stack, LocalCluster(3, stack.workdir / "etcd") as cluster:
        stack.emulate("opus", "--ideal-chip", "--switching-ms", "0", "--replicas", "1")
        stack.serve()
        url = f"etcd://{cluster.endpoints}/{stack.rig.name}"
        stack.replicas(url, "--quarantine", "0")
        reader = etcd_journal_reader(url)
        fabric = Fabric(*stack.rig.agent_endpoints(), replicas=stack.rig.agent_replicas(),
                        timeout=10)
        try:
            plan = dp_tp(8)
            fabric.admit(plan)
            keys = plan.sequence()
            k = 0

            def switch() -> float:
                nonlocal k
                name, rnd = keys[k % len(keys)]
                k += 1
                t = time.perf_counter()
                fabric.phase(name, rnd)
                return time.perf_counter() - t
            for _ in range(len(keys)):
                switch()                                    # warm
            whole = [switch() for _ in range(phases)]
            cluster.kill(2)
            one_down = [switch() for _ in range(phases)]
            seq = max((e.seq for e in reader.entries()), default=0)
            cluster.kill(1)
            t_lost = time.monotonic()
            held = []
            for _ in range(3):          # no quorum: no grant; the agent waits it out
                try:
                    fabric.phase(*keys[k % len(keys)], timeout=1.0)
                    held.append("granted")
                except BusError as e:
                    held.append(type(e).__name__)
            cluster.restart(1)
            t = time.perf_counter()
            granted = switch()
            back = time.perf_counter() - t
            twice_after = added_twice(reader.entries(since=seq))
        finally:
            fabric.close()
    rows = [{"what": f"phase switch (opus OCS), etcd {case}", "runs": len(xs),
             "p50_s": round(percentile(xs, 0.5), 4), "p99_s": round(percentile(xs, 0.99), 4),
             "max_s": round(max(xs), 4)}
            for case, xs in (("whole", whole), ("one member of 3 down", one_down))]
    rows.append({"what": "two members down: phase requests (1 s each) granted", "runs": 3,
                 "p50_s": sum(h == "granted" for h in held), "p99_s": "", "max_s": ""})
    rows.append({"what": "quorum back: the next grant, s after the restart; circuits added twice",
                 "runs": 1, "p50_s": round(back, 3),
                 "p99_s": len(twice_after), "max_s": ""})
    return {"rows": rows, "whole_s": whole, "one_down_s": one_down, "held": held,
            "lost_for_s": round(time.monotonic() - t_lost, 3), "granted_s": granted}


def _partitions(runs: int, rnd: random.Random) -> dict:
    """`runs` trials of ptb/bench/partition.py: the leading replica cut off (its network
    namespace's link down) while it runs; the other leads and swaps a failed GPU's spare in; the
    link back, what the OCS does after (a deposed leader must move nothing)."""
    import tempfile

    from photonic_testbed.ptb.bench import partition
    trials = []
    with tempfile.TemporaryDirectory(prefix="ptb-cut-") as folder:
        try:
            with partition.cut_off(pathlib.Path(folder)) as setup:
                fabric = partition.admitted(setup)
                try:
                    for _ in range(runs):
                        trials.append(partition.cut_trial(setup, fabric, rnd))
                finally:
                    fabric.close()
        except partition.Unavailable as e:
            return {"rows": [{"what": f"leader cut off: not run ({e})", "runs": 0,
                              "p50_s": "", "p99_s": "", "max_s": ""}]}
    bad = [t for t in trials if t.moves_after or t.circuits_changed or t.order is None
           or t.ocs_term != int(t.new["term"])]
    return {"rows": [{"what": "leader cut off (own netns), another leads and swaps, link back: "
                              "bad trials (a move after, no order, OCS not at the new term)",
                      "runs": len(trials), "p50_s": len(bad), "p99_s": "", "max_s": ""}],
            "moves_after": [t.moves_after for t in trials],
            "terms": [[t.cut["term"], t.new["term"], t.ocs_term] for t in trials]}


def _pods(runs: int) -> dict:
    """opus2048 as processes with one agent group per pod (`ptb emulate --groups pods`), the
    groups of pods 0 and 1 running (2 replicas each, lease 1 s; the other pods unmanaged), a
    job on 8 servers of pod 1 switching phases (TP, DP ring, all-to-all; 5 ms apart) all along.
    Pod 0's leader is killed `runs` times (its standby takes over, the killed one is started
    again): pod 1's phase switches while pod 0 had no leader against the others, and pod 1's
    term (a pod's leader loss must touch no other pod)."""
    import threading

    from photonic_testbed.common.jobplan import JobPlan, PhaseSpec
    from photonic_testbed.hil.job.fabric_client import Fabric
    options = ("--quarantine", "0", "--lease", "1")
    with Stack() as stack:
        stack.emulate("opus2048", "--switching-ms", "0", "--replicas", "2", "--groups", "pods")
        stack.serve("--one-process")
        url = stack.etcd(3)
        leaders = {g: stack.replicas(url, *options, group=g) for g in ("pod0", "pod1")}
        members = url.rpartition("/")[0]
        pod0 = etcd_journal_reader(f"{members}/pod0").leadership
        pod1 = etcd_journal_reader(f"{members}/pod1").leadership
        view = stack.rig.group_view("pod1")
        servers = sorted({g.server for g in view.gpus if not g.spare},
                         key=lambda s: int(s[1:]))[:8]
        gpus = [g.name for s in servers for g in view.gpus if g.server == s]
        plan = JobPlan("pod1-job", len(gpus), (
            PhaseSpec("tp", "ring", group=8, stride=1),
            PhaseSpec("dp", "ring", group=len(servers), stride=8),
            PhaseSpec("ep", "all_to_all", group=len(servers), stride=8)))
        fabric = Fabric(*view.agent_endpoints(), replicas=view.agent_replicas(), timeout=30)
        grants: list[tuple[float, float]] = []          # (asked at, seconds to the grant)
        refused: list[str] = []
        stop = threading.Event()

        def switching() -> None:
            keys = plan.sequence()
            k = 0
            while not stop.is_set():
                t = time.perf_counter()
                try:
                    fabric.phase(*keys[k % len(keys)])
                    grants.append((t, time.perf_counter() - t))
                except BusError as e:
                    refused.append(str(e))
                k += 1
                time.sleep(0.005)
        windows: list[tuple[float, float]] = []
        try:
            fabric.admit(plan, dict(enumerate(gpus)))
            thread = threading.Thread(target=switching, name="pod1-job", daemon=True)
            thread.start()
            time.sleep(3.0)
            leader = leaders["pod0"]
            for _ in range(runs):
                standby = next(n for n in stack.rig.groups["pod0"].replicas
                               if n != leader["name"])
                stack.kill(f"agent-{leader['name']}")
                t = time.perf_counter()
                windows.append((t, _leading_answer(stack, standby)))
                now = stack.wait("pod 0's new leader", functools.partial(
                    _newer, pod0, int(leader["term"])), 30)
                stack.start_replica(leader["name"], f"{members}/pod0", *options)
                _standing_by(stack, leader["name"])
                leader = now
                time.sleep(2.0)
            stop.set()
            thread.join(30)
            term1 = int((pod1.leader() or {}).get("term", 0))
        finally:
            stop.set()
            fabric.close()
    during = [x for t, x in grants if any(a <= t <= b for a, b in windows)]
    other = [x for t, x in grants if not any(a <= t <= b for a, b in windows)]
    rows = [{"what": f"opus2048, a group per pod: pod 1's phase switch (64 ranks) {what}",
             "runs": len(xs), "p50_s": round(percentile(xs, 0.5), 4),
             "p99_s": round(percentile(xs, 0.99), 4), "max_s": round(max(xs), 4)}
            for what, xs in (("while pod 0 had no leader", during),
                             ("the rest of the time", other)) if xs]
    rows.append({"what": "pod 0's leader killed: pod 1's requests refused; pod 1's term after "
                         "(was 1)", "runs": runs, "p50_s": len(refused), "p99_s": term1,
                 "max_s": ""})
    return {"rows": rows, "windows_s": [b - a for a, b in windows],
            "during_s": during, "other_s": other, "refused": refused[:5]}


def _takeovers(runs: int) -> dict:
    """opus2048 (64 OCSes) as processes, one agent group of 2 replicas on etcd (lease 1 s), the
    heavy job admitted (1,024 ranks, 960 (phase, round)s on every OCS: 0.6 s of CPU to work its
    circuits out). The leader is killed (kill -9) `runs` times; timed from the kill to the new
    leader answering as leader (its takeover done: fenced, reconciled, the jobs read back).
    Which replica stands by with its work ahead (`--work-ahead`) and which without alternates:
    the killed one is started again in the other mode, and stands by 5 s (its reading ahead
    done) before the next kill."""
    from photonic_testbed.hil.job.fabric_client import Fabric
    from photonic_testbed.hil.rig import rig_spec
    from photonic_testbed.ptb.bench.datacenter import heavy_admission
    modes = ("--work-ahead", "--no-work-ahead")
    samples: dict[str, list[float]] = {m: [] for m in modes}
    with Stack() as stack:
        stack.emulate("opus2048", "--switching-ms", "0", "--replicas", "2")
        stack.serve("--one-process")
        url = stack.etcd(3)
        options = ("--quarantine", "0", "--lease", "1")
        names = list(stack.rig.replicas)
        stack.start_replica(names[0], url, *options)
        reader = etcd_journal_reader(url)
        leadership = reader.leadership
        first = stack.wait("a leader", leadership.leader, 120)
        stack.start_replica(names[1], url, *options, modes[0])
        _standing_by(stack, names[1])
        fabric = Fabric(*stack.rig.agent_endpoints(), replicas=stack.rig.agent_replicas(),
                        timeout=120)
        try:
            plan, rank_map = heavy_admission(rig_spec("opus2048"))
            fabric.admit(plan, rank_map)
        finally:
            fabric.close()
        leader = first
        seq = 0
        after: dict[str, list[float]] = {m: [] for m in modes}  # from its start entry
        rnd = random.Random(runs)
        for k in range(runs):
            # the standby's reading ahead done; the kill at a random point of the lease's
            # refresh and of etcd's expiry check (both periodic: a fixed wait would favour one
            # mode)
            time.sleep(5.0 + rnd.uniform(0.0, 1.0))
            standby = next(n for n in names if n != leader["name"])
            stack.kill(f"agent-{leader['name']}")
            t, wall = time.perf_counter(), time.time()
            got = _leading_answer(stack, standby)
            samples[modes[k % 2]].append(got - t)
            now = stack.wait("the new leader", functools.partial(_newer, leadership,
                                                                 int(leader["term"])), 30)
            start = reader.entries(since=seq, kinds=("start",))[-1]
            seq = start.seq
            after[modes[k % 2]].append(got - t - (start.ts - wall))
            stack.start_replica(leader["name"], url, *options, modes[(k + 1) % 2])
            _standing_by(stack, leader["name"])
            leader = now
    rows = [{"what": f"opus2048, heavy job: leader killed -> new leader answering, "
                     f"{'work ahead' if m == modes[0] else 'no work ahead'}",
             "runs": len(xs), "p50_s": round(percentile(xs, 0.5), 3),
             "p99_s": round(percentile(xs, 0.99), 3), "max_s": round(max(xs), 3)}
            for m, xs in samples.items() if xs]
    rows += [{"what": f"... of which from the new leader's start entry (fenced) to answering, "
                      f"{'work ahead' if m == modes[0] else 'no work ahead'}",
              "runs": len(xs), "p50_s": round(percentile(xs, 0.5), 3),
              "p99_s": round(percentile(xs, 0.99), 3), "max_s": round(max(xs), 3)}
             for m, xs in after.items() if xs]
    return {"rows": rows, "samples_s": samples, "from_start_entry_s": after}


def _leading_answer(stack: Stack, name: str) -> float:
    """When replica `name` first answers as the leader (perf_counter): asked again and again,
    each request waited for (one sent while it takes over is answered once it has)."""
    deadline = time.monotonic() + 60
    with ServiceClient(stack.rig.replicas[name][0], timeout=30.0) as c:
        while time.monotonic() < deadline:
            try:
                if c.call("snapshot")["state"].get("role") == "leader":
                    return time.perf_counter()
            except BusError:
                pass
            time.sleep(0.005)
    raise CommandFailed(f"replica {name} did not take the lead within 60 s")


def added_twice(entries: list) -> dict[tuple[str, int, int], int]:
    """The circuits (switch, input, output) the journal's `applied` entries added more than
    once, and how often."""
    added: dict[tuple[str, int, int], int] = {}
    for entry in entries:
        if isinstance(entry.details, Applied):
            for c in entry.details.added:
                key = (entry.details.switch, int(c[0]), int(c[1]))
                added[key] = added.get(key, 0) + 1
    return {k: n for k, n in added.items() if n > 1}


def _changes(stack: Stack) -> int:
    """How many changes the lumion chip's service has taken (its state version's count)."""
    with ServiceClient(stack.rig.endpoints()["chip"][0], timeout=5.0) as c:
        return int(str(c.call("ping")["version"]).rsplit(":", 1)[1])


def _paused_leader(stack: Stack, leadership: Leadership, control: str,
                   rnd: random.Random) -> int:
    """One trial (module text): the changes the switch took after the paused leader resumed."""
    leader = stack.wait("a leader", leadership.leader, 30)
    proc = stack.processes[f"agent-{leader['name']}"]
    proc.send_signal(signal.SIGSTOP)
    try:
        stack.wait("another replica leading",
                   functools.partial(_newer, leadership, leader["term"]), 30)
        status = request(control, {"cmd": "job_status"})
        victim = rnd.choice(list(status["rank_map"].values()))
        t_fail = time.time()
        request(control, {"cmd": "fail_gpu", "gpu": victim, "mode": "hard"})
        stack.wait(f"the job running again without {victim}",
                   functools.partial(_resumed_after, control, t_fail), RESUME_S)
        before = _changes(stack)
    finally:
        proc.send_signal(signal.SIGCONT)
    time.sleep(2.0)              # what the resumed replica would still do, it has done by now
    after = _changes(stack)
    request(control, {"cmd": "heal_gpu", "gpu": victim})
    return after - before


def _newer(leadership: Leadership, term: int) -> dict | None:
    """Who leads, once it is a leader of a term after `term`."""
    who = leadership.leader()
    return who if who and int(who.get("term", 0)) > term else None


def _standing_by(stack: Stack, name: str) -> None:
    """Until replica `name` answers on its endpoints (as a standby)."""
    endpoint = stack.rig.replicas[name][0]

    def answers() -> Any:
        with ServiceClient(endpoint, timeout=2.0) as c:
            try:
                return c.call("ping")
            except BusError:
                return None
    stack.wait(f"replica {name} standing by", answers, 60, log=f"agent-{name}")


