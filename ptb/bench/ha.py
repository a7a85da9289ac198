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

Then (`--phases`, on the opus rig: a DP/TP job on its OCS, one replica) phase switches with the
etcd cluster whole, with one member of three killed (the cluster's leader among them, as chance
has it), and with two killed: no phase is granted (nothing moves) until a member is back; the
grant then comes once, and no circuit is added twice.
"""
from __future__ import annotations

import functools
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
    quorum = _quorum(args.phases) if args.phases else {}
    rows += quorum.pop("rows", [])
    return {"rows": rows, "samples_s": samples, "terms": terms, "quorum": quorum,
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


