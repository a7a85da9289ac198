"""`ptb demo --ha`: the control plane survives its leader. Three etcd members and two agent
replicas (docs/control-plane.md); a GPU fails, the leading replica is killed (kill -9) in the
middle of the swap, the standby takes the lead and finishes it, and the timeline shows it with a
check that no circuit was applied twice."""
from __future__ import annotations

import time
from typing import Any

from photonic_testbed.ptb.cli import CommandFailed
from photonic_testbed.ptb.stack import Stack

RESUME_TIMEOUT_S = 120.0


def demo(args: Any, plan: str, gpu: str, stack: Stack, t0: float,
         say: Any) -> int:
    from photonic_testbed.hil.agent.entries import Applied, Reconcile, Start, Swap
    from photonic_testbed.hil.agent.etcd_journal import EtcdJournal, parse_url
    from photonic_testbed.hil.agent.leadership import Leadership
    from photonic_testbed.hil.etcd.client import Etcd
    from photonic_testbed.hil.lab.control_client import ControlError, request
    from photonic_testbed.ptb.bench.ha import added_twice
    from photonic_testbed.ptb.demo import _restart_after, print_timeline

    url = stack.etcd(3)
    first = stack.replicas(url, "--quarantine", "0", "--lease", "1")
    members, group = parse_url(url)
    etcd = Etcd(members, timeout=5.0)
    journal = EtcdJournal(etcd, Leadership(etcd, group, {"name": "demo (reads only)"}))
    control = stack.control
    try:
        got = request(control, {"cmd": "job_start", "plan": plan, "steps": 1_000_000})
    except ControlError as e:
        raise CommandFailed(f"the job did not start: {e}") from None
    ranks_on = list(got["rank_map"].values())
    say(f"job {got['plan']} admitted by replica {first['name']}: ranks on "
        f"{', '.join(ranks_on)}")
    if gpu not in ranks_on:
        raise CommandFailed(f"the job runs on {', '.join(ranks_on)}, not on {gpu}")
    time.sleep(args.seconds)
    stack.check()
    before = request(control, {"cmd": "job_status"})
    say(f"job running: {before['step']} steps done")
    seq = max((e.seq for e in journal.entries()), default=0)
    t_fail = time.time()
    request(control, {"cmd": "fail_gpu", "gpu": gpu, "mode": "hard"})
    say(f"failure injected: {gpu} goes dark")
    # the leader is killed as soon as its swap decision is in the journal (asked every 2 ms)
    deadline = time.monotonic() + 60
    while (swap := next((e for e in journal.entries(since=seq, kinds=("decision",))
                         if isinstance(e.details, Swap)), None)) is None:
        if time.monotonic() > deadline:
            raise CommandFailed(f"no swap decided within 60 s; "
                                f"{stack.tail('agent-' + first['name'])}")
        time.sleep(0.002)
    stack.kill(f"agent-{first['name']}")
    t_kill = time.time()
    say(f"leader {first['name']} killed (kill -9) right after it decided the swap "
        f"({', '.join(f'{a} -> {b}' for a, b in swap.details.swaps.items())})"
        if isinstance(swap.details, Swap) else "")

    def resumed() -> Any:
        s = request(control, {"cmd": "job_status"})
        if s["state"] == "aborted":
            raise CommandFailed(f"the job aborted: {s['events'][-3:]}")
        return _restart_after(s, t_fail)
    restarted = stack.wait("the job's resumption under the new leader", resumed,
                           RESUME_TIMEOUT_S, log="agent-" + next(
                               n for n in stack.rig.replicas if n != first["name"]))
    stack.start_replica(first["name"], url, "--quarantine", "0", "--lease", "1")  # a standby
    status = request(control, {"cmd": "job_status"})
    entries = journal.entries(since=seq)
    leader_now = Leadership(etcd, group, {}).leader() or {}

    start = next((e for e in entries if isinstance(e.details, Start)), None)
    term = start.details.term if start is not None and isinstance(start.details, Start) else None
    rows = [("failure injected", t_fail, f"{gpu} dark"),
            ("swap decided", swap.ts, f"by {first['name']}, term {first['term']}"),
            ("leader killed", t_kill, f"{first['name']}, kill -9")]
    done = next((e for e in entries if isinstance(e.details, Reconcile)
                 and e.details.moves is not None and start is not None and e.ts >= start.ts),
                None)
    moved = sum(done.details.moves.values()) if done is not None and isinstance(
        done.details, Reconcile) and done.details.moves else 0
    if start is not None:
        rows.append(("new leader took over", start.ts,
                     f"{leader_now.get('name')}, term {term}: devices fenced, switches "
                     "reconciled (" + (f"{moved} circuits the dead leader had journaled but "
                                       "not applied" if moved else
                                       "nothing to repair: what the dead leader applied is "
                                       "not applied again") + ")"))
    added = {(entry.details.switch, int(a), int(b))
             for entry in entries if isinstance(entry.details, Applied)
             for a, b in entry.details.added}
    restart = next((e for e in entries if e.kind == "restart"), None)
    if restart is not None:
        rows.append(("restart ordered", restart.ts, "by the new leader" if restart.ts >= t_kill
                     else f"by {first['name']}, before it was killed"))
    rows.append(("job resumed (first step)", restarted["resumed_t"],
                 f"step {restarted['resumed_step']}"))
    print_timeline(rows, t_fail)
    twice = added_twice(entries)
    print()
    print(f"circuits added since the failure: {len(added)}, applied twice: {len(twice)}"
          + (f" ({', '.join(f'{s} {a}->{b}' for s, a, b in twice)})" if twice else ""))
    rank_map = status["rank_map"]
    ok = (not twice and gpu not in rank_map.values()
          and len(rank_map) == len(before["rank_map"])
          and leader_now.get("name") != first["name"])
    print(f"ranks now on {', '.join(rank_map.values())}; leader {leader_now.get('name')} "
          f"(term {leader_now.get('term')}); {first['name']} back as a standby")
    print("demo succeeded" if ok else "demo FAILED: see the timeline above")
    return 0 if ok else 1
