"""Swap: a GPU failure -> the first completed training step on the spare, with a real PyTorch
job in the loop; in place (hil.job.worker) against TorchFT's live recovery from a peer and
torchrun's restart-all, in the same run.

The stack runs as processes (emulator with its rack, services, agent; quarantine 0, so a healed
GPU is a spare again), then the job's controller and its 8 rank processes (data-parallel ring
on lumion) with warm standbys on the free GPUs. Each run fails the GPU holding rank 3 through
the emulator's control endpoint (which kills the process on it) and follows the failure
through the agent's journal (detected, circuits applied, verified) and the job's events (the
controller's order, the spare's communicator rebuilt, state transferred, first step). The
failed GPU is healed after each run and gets a warm standby before the next.

Then the same job under torchrun (--max-restarts, a checkpoint every K steps): the same
failures; torchrun restarts every worker, which reload the checkpoint on the rank map the
agent ordered. Its figure is the failure -> first completed step of the restarted job on the
spare, and the time until the job is back at the step it had reached (the work redone).

Then the same model, data and failure under TorchFT (hil.job.torchft_peer: a replica group
per rank, gloo, its lighthouse on loopback; no fabric): the replica holding rank 3's place is
killed -9 and restarted warm, as the in-place job's standbys are warm, and takes the live state
from a healthy peer. Its figures are the failure -> first step the job completed after it, and
the restarted replica's first step. For every path, the steps lost: steps the job had completed
before the failure and completed again after it.

Also measured: training throughput before the first and after the last failure, each once the
job is warm (every standby ready, then `--warmup` seconds more), over sub-windows whose
steps/s give the spread; and the fabric hooks' cost per step with no failure (the seconds the
ranks spent in phase requests and their barriers, over the step time).
"""
from __future__ import annotations

import importlib.util
import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time

from photonic_testbed.hil.agent.sqlite_journal import SqliteJournal
from photonic_testbed.hil.job import torch_job
from photonic_testbed.hil.lab.control_client import request
from photonic_testbed.ptb.bench.measure import agent_stack, percentile
from photonic_testbed.ptb.cli import CommandFailed
from photonic_testbed.ptb.stack import Stack

NAME = "swap"
HELP = ("GPU failure -> first training step on the spare: in-place swap vs TorchFT vs "
        "torchrun restart-all (PyTorch job, lumion, 8 ranks)")
LUMION_S = 1.0
MODEL = ("--width", "64", "--layers", "2", "--batch", "4", "--block", "32")
STAGES = ("detect", "circuits", "verified", "ordered", "communicator rebuilt",
          "state transferred", "step redone", "total")


def add_arguments(p) -> None:
    p.add_argument("--runs", type=int, default=30, help="in-place swaps (default 30)")
    p.add_argument("--torchrun-runs", type=int, default=5,
                   help="torchrun restart-all recoveries (default 5: each restarts 8 "
                   "processes)")
    p.add_argument("--checkpoint-every", type=int, default=10, metavar="K",
                   help="torchrun's checkpoint period in steps (default 10)")
    p.add_argument("--workdir", help="keep the jobs' events and logs here (default: a "
                   "temporary folder, removed)")
    p.add_argument("--torchft-runs", type=int, default=3,
                   help="TorchFT recoveries (default 3; 0: none): a replica killed and "
                   "restarted warm, its state from a healthy peer")
    p.add_argument("--torchft-every", type=int, default=200, metavar="STEPS",
                   help="steps between TorchFT's failures (default 200: room for the next warm "
                   "replica to start)")
    p.add_argument("--window", type=float, default=10.0, metavar="S",
                   help="seconds of training for the throughput before and after (default 10)")
    p.add_argument("--warmup", type=float, default=5.0, metavar="S",
                   help="seconds the job runs warm (every standby ready) before each "
                   "throughput window (default 5)")
    p.add_argument("--subwindows", type=int, default=5, metavar="N",
                   help="throughput sub-windows whose steps/s give the spread (default 5)")


JOB_STOP_S = 60.0           # for a controller to stop its ranks and itself
TORCHFT_RANKS = 8           # replica groups: as many as the in-place job's data-parallel ranks
TORCHFT_VICTIM = 3          # as the in-place runs fail the GPU of rank 3
TORCHFT_TIMEOUT_S = 900.0


def _launch(stack: Stack, name: str, workdir: str, *extra: str) -> str:
    """The job's controller as the stack's process `name` (its events in `workdir`)."""
    stack.job("--workdir", workdir, "--rig", str(stack.rig_path), "--control", stack.control,
              "--plan", "dp", "--world", "8", "--steps", "1000000", "--restart-timeout", "120",
              *MODEL, *extra, name=name)
    return name


class _Job:
    """The events of a running job, read incrementally."""

    def __init__(self, workdir: str):
        self.workdir = workdir

    def events(self) -> list[dict]:
        return torch_job.read_events(self.workdir)

    def latest_order(self) -> dict | None:
        return next((e for e in reversed(self.events()) if e["kind"] == "order"), None)

    def order(self) -> dict:
        """The latest rank order, once the job is running (it writes one before any step)."""
        got = self.latest_order()
        if got is None:
            raise CommandFailed(f"the job in {self.workdir} has written no rank order")
        return got

    def steps_done(self) -> int:
        return max((e["step"] for e in self.events() if e["kind"] == "step"), default=0)


def _free_gpus_ready(job: _Job, stack: Stack) -> bool:
    """A warm standby is ready on every healthy GPU that holds no rank."""
    order = job.latest_order()
    if order is None:
        return False
    healthy = {h["gpu"] for h in request(stack.control, {"cmd": "health"})
               if h["state"] == "ok"}
    free = healthy - set(order["rank_map"].values())
    ev = job.events()
    live = {}
    for e in ev:
        if e["kind"] == "ready":
            live[e["gpu"]] = e["pid"]
        elif e["kind"] == "exit" and live.get(e["gpu"]) == e["pid"]:
            del live[e["gpu"]]
    return free <= set(live)


def _warm(job: _Job, stack: Stack) -> bool:
    """Every process the controller started has reported ready (or exited), and a standby is
    ready on every free GPU: no process of the job is starting (torch imports are CPU-bound,
    and would be counted as the job's throughput)."""
    if not _free_gpus_ready(job, stack):
        return False
    spawned, settled = set(), set()
    for e in job.events():
        if e["kind"] == "spawned":
            spawned.add(e["pid"])
        elif e["kind"] in ("ready", "exit", "stopped"):
            settled.add(e.get("pid"))
    return spawned <= settled


def _journal_after(path, t: float) -> list:
    with SqliteJournal(path, read_only=True) as j:
        return [e for e in j.entries() if e.ts >= t]


def _throughput(stack: Stack, job: _Job, args, name: str) -> dict:
    """Once the job is warm, `args.warmup` seconds more, then a window of `args.window`
    seconds: steps/s over it and over each of `args.subwindows` equal parts (their min, median
    and max: the spread), mean step seconds and the hook share of the step time."""
    stack.wait("the job warm (no process starting)", lambda: _warm(job, stack), 180, log=name)
    time.sleep(args.warmup)
    t0 = time.time()
    time.sleep(args.window)
    t1 = time.time()
    ev = job.events()
    steps = [e for e in ev if e["kind"] == "step" and t0 <= e["t"] < t1]
    n = args.subwindows
    edges = [t0 + (t1 - t0) * i / n for i in range(n + 1)]
    parts = [torch_job.steps_per_s(ev, a, b) for a, b in zip(edges, edges[1:], strict=False)]
    seconds = sum(e["seconds"] for e in steps)
    return {"steps_s": torch_job.steps_per_s(ev, t0, t1),
            "spread": [min(parts), statistics.median(parts), max(parts)],
            "step_s": statistics.mean(e["seconds"] for e in steps) if steps else 0.0,
            "hook_share": sum(e["hook_s"] for e in steps) / seconds if seconds else 0.0}


def _in_place(stack: Stack, args, workdir: str) -> dict:
    name = _launch(stack, "in-place-job", workdir, "--standbys", "2")
    job = _Job(workdir)
    parts: dict[str, list[float]] = {k: [] for k in STAGES}
    lost = []
    try:
        stack.wait("20 steps with warm standbys",
                   lambda: job.steps_done() >= 20 and _free_gpus_ready(job, stack), 180, log=name)
        before = _throughput(stack, job, args, name)
        for _ in range(args.runs):
            victim = job.order()["rank_map"]["3"]
            reached = job.steps_done()
            t_fail = time.time()
            request(stack.control, {"cmd": "fail_gpu", "gpu": victim})

            def swapped(t_fail: float = t_fail, victim: str = victim) -> dict | None:
                tl = torch_job.swap_timeline(job.events(), t_fail, victim)
                return tl if tl["first_step"] else None
            tl = stack.wait(f"the first step after {victim} failed", swapped, 180, log=name)
            j = _journal_after(stack.journal, t_fail)
            first: dict[str, float] = {}
            for e in j:
                first.setdefault(e.kind, e.ts)
            marks = [t_fail, first.get("detected"), first.get("applied"),
                     first.get("verified"), tl["order"]["t"], tl["rebuilt"],
                     tl["transferred"], tl["first_step"]]
            if None in marks:
                raise CommandFailed(f"run after {victim}: missing a stage {marks}")
            for stage, a, b in zip(STAGES, marks, marks[1:], strict=False):  # (total: below)
                parts[stage].append(b - a)
            parts["total"].append(tl["first_step"] - t_fail)
            reached = max([reached] + [e["step"] for e in job.events()
                                       if e["kind"] == "step" and e["t"] <= t_fail])
            lost.append(max(0, reached - (tl["first_step_no"] - 1)))
            request(stack.control, {"cmd": "heal_gpu", "gpu": victim})
            stack.wait(f"a warm standby on {victim}", lambda: _free_gpus_ready(job, stack), 180,
                       log=name)
            n = job.steps_done()
            stack.wait("3 more steps", lambda: job.steps_done() >= n + 3,  # noqa: B023 (at once)
                       180, log=name)
        after = _throughput(stack, job, args, name)
    finally:
        stack.stop(name, JOB_STOP_S)
    return {"parts": parts, "steps_lost": lost, "before": before, "after": after}


def _torchrun(stack: Stack, args, workdir: str) -> dict:
    name = _launch(stack, "torchrun-job", workdir, "--torchrun", "--checkpoint-every",
                   str(args.checkpoint_every), "--max-restarts", str(args.torchrun_runs + 5))
    job = _Job(workdir)
    totals, back, redone = [], [], []
    try:
        stack.wait("20 steps under torchrun", lambda: job.steps_done() >= 20, 300, log=name)
        k = args.checkpoint_every
        for _ in range(args.torchrun_runs):
            # fail half-way between checkpoints: the redone work of a failure at a random time
            n = job.steps_done()
            target = (n // k + 1) * k + k // 2
            stack.wait(f"step {target}", lambda: job.steps_done() >= target,  # noqa: B023
                       300, log=name)
            order = job.order()
            gen, victim = order["gen"], order["rank_map"]["3"]
            reached = job.steps_done()
            t_fail = time.time()
            request(stack.control, {"cmd": "fail_gpu", "gpu": victim})

            def first_step(gen: int = gen) -> dict | None:
                ev = job.events()
                spare = next((e["rank_map"]["3"] for e in ev if e["kind"] == "order"
                              and e["gen"] == gen + 1), None)
                return next((e for e in ev if e["kind"] == "step" and e["gen"] == gen + 1
                             and e["gpu"] == spare), None)
            step = stack.wait("the restarted job's first step", first_step, 600, log=name)
            totals.append(step["t"] - t_fail)
            caught_up = stack.wait(
                "the restarted job back at its step",
                lambda: next((e for e in job.events() if e["kind"] == "step"
                              and e["gen"] == gen + 1  # noqa: B023 (waited for at once)
                              and e["step"] >= reached), None),  # noqa: B023
                600, log=name)
            back.append(caught_up["t"] - t_fail)
            redone.append(reached - (step["step"] - 1))
            request(stack.control, {"cmd": "heal_gpu", "gpu": victim})
            time.sleep(1.0)
    finally:
        stack.stop(name, JOB_STOP_S)
    return {"first_step": totals, "back_at_step": back, "steps_redone": redone}


def _torchft(args, workdir: str) -> dict:
    """The TorchFT peer's run (hil.job.torchft_peer launch, a process of its own): the same
    model, batch and ranks, `args.torchft_runs` failures `args.torchft_every` steps apart; its
    summary (the failures read back, the replicas' final digests)."""
    every = args.torchft_every
    fail_at = [every * (i + 1) for i in range(args.torchft_runs)]
    cmd = [sys.executable, "-m", "photonic_testbed.hil.job.torchft_peer", "launch",
           "--workdir", workdir, "--replicas", str(TORCHFT_RANKS),
           "--steps", str(fail_at[-1] + every), "--fail-at", *map(str, fail_at),
           "--victim", str(TORCHFT_VICTIM), "--timeout", str(TORCHFT_TIMEOUT_S), *MODEL]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True,
                              timeout=TORCHFT_TIMEOUT_S + 60)
    except subprocess.TimeoutExpired:
        raise CommandFailed(f"the TorchFT run in {workdir} did not end within "
                            f"{TORCHFT_TIMEOUT_S + 60:g} s") from None
    if done.returncode != 0:
        raise CommandFailed(f"the TorchFT run failed (exit {done.returncode}): "
                            f"{done.stderr.strip()[-1500:]} (its logs: {workdir}/logs)")
    summary = json.loads((pathlib.Path(workdir) / "summary.json").read_text())
    got = summary["recoveries"]
    if len(got) != args.torchft_runs or any(r["job_first_step_s"] is None
                                            or r["replica_first_step_s"] is None for r in got):
        raise CommandFailed(f"the TorchFT run in {workdir} did not recover from each of its "
                            f"{args.torchft_runs} failures: {got}")
    if not summary["digests_equal"]:
        raise CommandFailed(f"the TorchFT replicas ended with different weights: "
                            f"{summary['digests']}")
    # its throughput with no failure: from its 20th step (every process warm before its
    # first) to the first failure
    ev = torch_job.read_events(workdir)
    t0 = min(e["t"] for e in ev if e["kind"] == "step" and e["step"] == 20)
    summary["steps_s_before"] = torch_job.steps_per_s(ev, t0, got[0]["t_fail"])
    return summary


def _row(path: str, stage: str, xs: list[float], lost: int | str = "") -> dict:
    return {"path": path, "stage": stage, "runs": len(xs),
            "p50_ms": f"{1e3 * statistics.median(xs):.1f}",
            "p99_ms": f"{1e3 * percentile(xs, 0.99):.1f}",
            "max_ms": f"{1e3 * max(xs):.1f}", "steps_lost": lost}


def _spread(t: dict) -> str:
    lo, mid, hi = t["spread"]
    return f"{t['steps_s']:.2f} (sub-windows {lo:.1f} / {mid:.1f} / {hi:.1f})"


def run(args) -> dict:
    if args.runs < 1 or args.torchrun_runs < 1:
        raise CommandFailed("--runs and --torchrun-runs must be >= 1")
    if args.torchft_runs < 0 or args.torchft_every < 20 or args.subwindows < 1 \
            or args.window <= 0 or args.warmup < 0:
        raise CommandFailed("--torchft-runs must be >= 0, --torchft-every >= 20, --subwindows "
                            ">= 1, --window > 0 and --warmup >= 0")
    if args.torchft_runs and importlib.util.find_spec("torchft") is None:
        raise CommandFailed("TorchFT is not installed (pip install 'photonic-testbed[torchft]'"
                            "), or run with --torchft-runs 0")
    load0 = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="ptb-swap-") as tmp:
        work = args.workdir or tmp
        stack = agent_stack("lumion", quarantine_s=0.0)
        try:
            ip = _in_place(stack, args, os.path.join(work, "inplace"))
            tr = _torchrun(stack, args, os.path.join(work, "torchrun"))
        finally:
            stack.close()
        # after the stack: TorchFT needs no fabric, and its processes run on a quiet machine
        ft = _torchft(args, os.path.join(work, "torchft")) if args.torchft_runs else None
    load1 = os.getloadavg()
    lost_ip = sum(ip["steps_lost"])
    rows = [_row("in place", k, xs, lost_ip if k == "total" else "")
            for k, xs in ip["parts"].items()]
    rec = ft["recoveries"] if ft else []
    if ft:
        rows.append(_row("torchft", "first step (job)", [r["job_first_step_s"] for r in rec],
                         sum(r["steps_lost"] for r in rec)))
        rows.append(_row("torchft", "first step (restarted replica)",
                         [r["replica_first_step_s"] for r in rec]))
    rows.append(_row("torchrun", "first step", tr["first_step"], sum(tr["steps_redone"])))
    rows.append(_row("torchrun", "back at step", tr["back_at_step"]))
    p50 = statistics.median(ip["parts"]["total"])
    p50_tr = statistics.median(tr["first_step"])
    before, after = ip["before"], ip["after"]
    notes = [
        f"in place: failure -> first step on the spare p50 {1e3 * p50:.0f} ms (goal <= 300 ms:"
        f" {'met' if p50 <= 0.3 else 'NOT met'}; LUMION reports about {LUMION_S:g} s); "
        f"steps lost {lost_ip} in {len(ip['steps_lost'])} runs",
    ]
    if ft:
        job = statistics.median(r["job_first_step_s"] for r in rec)
        mine = statistics.median(r["replica_first_step_s"] for r in rec)
        lh = ft["lighthouse"]
        ratio = job / p50
        met = ratio >= 3 and lost_ip == 0
        notes.append(
            f"TorchFT ({ft['replicas']} replicas, warm restart, lighthouse heartbeat timeout "
            f"{lh['heartbeat_timeout_ms']} ms, join timeout {lh['join_timeout_ms']} ms): "
            f"p50 {job:.2f} s to the job's first step, {mine:.2f} s to the restarted replica's; "
            f"steps lost {sum(r['steps_lost'] for r in rec)}, step attempts not committed "
            f"{sum(r['discarded'] for r in rec)}; in place is {ratio:.1f}x faster than TorchFT "
            f"in this run (goal >= 3x and no step lost: {'met' if met else 'NOT met'}); "
            f"{ft['steps_s_before']:.2f} steps/s before its first failure (a quorum a step)")
    notes += [
        f"torchrun restart-all: p50 {p50_tr:.2f} s to the first step, "
        f"{statistics.median(tr['back_at_step']):.2f} s back at the step reached "
        f"({statistics.median(tr['steps_redone']):.0f} steps redone); in place is "
        f"{p50_tr / p50:.0f}x faster (goal >= 10x: {'met' if p50_tr / p50 >= 10 else 'NOT met'})",
        f"throughput once warm, steps/s (sub-windows of {args.window / args.subwindows:g} s: "
        f"min / median / max): before the first failure {_spread(before)}, after the last "
        f"{_spread(after)} (step {1e3 * before['step_s']:.0f} / {1e3 * after['step_s']:.0f} ms)",
        f"fabric hooks with no failure: {100 * before['hook_share']:.3f} % of the step time",
        f"load average {load0[0]:.1f} at the start, {load1[0]:.1f} at the end "
        f"({os.cpu_count()} CPUs)",
    ]
    return {"rows": rows, "notes": notes,
            "samples_ms": {k: [round(1e3 * x, 2) for x in v] for k, v in ip["parts"].items()},
            "steps_lost": {"in_place": ip["steps_lost"], "torchrun": tr["steps_redone"],
                           "torchft": [r["steps_lost"] for r in rec]},
            "torchrun_s": {k: [round(x, 3) for x in v] for k, v in tr.items()},
            "torchft": ft,
            "throughput": {"before": before, "after": after},
            "load": [load0, load1]}
