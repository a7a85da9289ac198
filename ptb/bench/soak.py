"""Soak: the whole stack under repeated GPU failures for minutes; memory of every process.

The stack runs as `ptb demo` starts it (emulator with its rack, services, agent; lumion, ideal
chip). The emulated training job runs all along; every `--period` seconds the GPU holding rank
3 fails (hard), the agent swaps in a spare, the job restarts on it, and the GPU is healed (it
becomes a spare again: quarantine 0). Each process's resident memory (RSS, from /proc, the
process and its children) is sampled every `--sample` seconds. Reported per process: RSS once
the stack is up, after the warm-up (`--warmup`, by which the bounded histories are full), at
the end, and the change from warm-up to end: the goal is flat, within 5 MB, over 10 minutes.
"""
from __future__ import annotations

import os
import time

from photonic_testbed.hil.lab.control_client import ControlError, request
from photonic_testbed.ptb.bench import number
from photonic_testbed.ptb.bench.measure import agent_stack
from photonic_testbed.ptb.cli import CommandFailed

NAME = "soak"
HELP = "minutes of repeated GPU failures on the emulated rig; RSS of each process"
FLAT_MB = 5.0
RESTART_TIMEOUT_S = 60.0         # generous: the machine may be busy
CONTROL_TIMEOUT_S = 30.0         # for each request to the emulator's control endpoint


def add_arguments(p) -> None:
    p.add_argument("--minutes", type=number(0, 7 * 24 * 60, above=True), default=10.0,
                   help="how long the soak runs after the warm-up (default %(default)s)")
    p.add_argument("--period", type=number(0.5, 3600), default=5.0,
                   help="seconds between two GPU failures (default %(default)s)")
    p.add_argument("--warmup", type=number(0, 86400), default=60.0,
                   help="seconds of failures before the reference RSS is taken "
                   "(default %(default)s)")
    p.add_argument("--sample", type=number(0.5, 3600), default=10.0,
                   help="seconds between RSS samples (default %(default)s)")


def _children() -> dict[int, list[int]]:
    kids: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:                      # gone meanwhile
            continue
        ppid = int(stat[stat.rindex(")") + 2:].split()[1])
        kids.setdefault(ppid, []).append(int(entry))
    return kids


def _rss_kb(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def rss_mb(pid: int) -> float:
    """RSS of a process and all its descendants, MB (1e6 bytes)."""
    kids = _children()
    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        total += _rss_kb(p)
        todo += kids.get(p, [])
    return total * 1024 / 1e6


def _control(control: str, msg: dict):
    try:
        return request(control, msg, timeout_s=CONTROL_TIMEOUT_S)
    except ControlError as e:
        raise CommandFailed(f"the emulator's control endpoint, {msg['cmd']}: {e}") from None


def _job_restarts(control: str) -> tuple[int, dict]:
    status = _control(control, {"cmd": "job_status"})
    return int(status["restarts"]), status


def run(args) -> dict:
    if not os.path.isdir("/proc/self"):
        raise CommandFailed("the soak reads memory from /proc (Linux only)")
    stack = agent_stack("lumion", quarantine_s=0.0)
    samples: dict[str, list[tuple[float, float]]] = {}
    failures = restarts_seen = 0
    try:
        pids = {name: p.pid for name, p in stack.processes.items()}
        _control(stack.control, {"cmd": "job_start", "plan": "dp", "steps": 10 ** 9})
        t0 = time.monotonic()
        end = t0 + args.warmup + 60 * args.minutes
        next_sample = t0

        def sample(now: float) -> None:
            for name, pid in pids.items():
                samples.setdefault(name, []).append((round(now - t0, 1), round(rss_mb(pid), 2)))
        while True:
            now = time.monotonic()
            if now >= next_sample:
                sample(now)
                next_sample += args.sample
            if now >= end:
                break
            stack.check()
            before, status = _job_restarts(stack.control)
            if status.get("state") in ("aborted", "done", "stopped"):
                raise CommandFailed(f"the job {status['state']} after {failures} failures")
            victim = status["rank_map"]["3"]
            _control(stack.control, {"cmd": "fail_gpu", "gpu": victim, "mode": "hard"})
            failures += 1
            deadline = time.monotonic() + RESTART_TIMEOUT_S
            while _job_restarts(stack.control)[0] <= before and time.monotonic() < deadline:
                time.sleep(0.1)
            n, status = _job_restarts(stack.control)
            if n <= before:
                raise CommandFailed(f"the job did not restart within {RESTART_TIMEOUT_S:g} s "
                                    f"of failure {failures} ({status['state']})")
            restarts_seen += 1
            _control(stack.control, {"cmd": "heal_gpu", "gpu": victim})
            time.sleep(max(0.0, min(args.period, end - time.monotonic())))
        status = _control(stack.control, {"cmd": "job_status"})
    finally:
        stack.close()
    rows, notes = [], []
    warm_t = args.warmup
    for name, xs in samples.items():
        warm = next((mb for t, mb in xs if t >= warm_t), xs[-1][1])
        rows.append({"process": name, "rss_up_mb": f"{xs[0][1]:.1f}",
                     "rss_warm_mb": f"{warm:.1f}", "rss_end_mb": f"{xs[-1][1]:.1f}",
                     "end_minus_warm_mb": f"{xs[-1][1] - warm:+.1f}",
                     "max_mb": f"{max(mb for _, mb in xs):.1f}"})
        notes.append(f"{name}: {'flat' if abs(xs[-1][1] - warm) <= FLAT_MB else 'NOT flat'} "
                     f"within {FLAT_MB:g} MB from the warm-up ({warm_t:g} s) to the end")
    notes.append(f"{failures} GPU failures, {restarts_seen} job restarts in "
                 f"{args.warmup:g} s + {args.minutes:g} min; job at step {status.get('step')} "
                 f"({status.get('steps_done')} steps done in all), "
                 f"{status.get('restarts')} restarts")
    return {"rows": rows, "notes": notes, "samples_mb": samples, "failures": failures,
            "restarts": restarts_seen, "minutes": args.minutes, "warmup_s": args.warmup,
            "period_s": args.period}
