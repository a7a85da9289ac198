"""Swap: a GPU failure -> the first completed training step on the spare, with a real PyTorch
job in the loop; in place (hil.job.worker) against torchrun's restart-all, in the same run.

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

Also measured: training throughput before the first and after the last failure, and the
fabric hooks' cost per step with no failure (the seconds the ranks spent in phase requests and
their barriers, over the step time).
"""
from __future__ import annotations

import os
import statistics
import tempfile
import time

from photonic_testbed.hil.agent.sqlite_journal import SqliteJournal
from photonic_testbed.hil.job import torch_job
from photonic_testbed.hil.lab.control_client import request
from photonic_testbed.ptb.bench.measure import agent_stack, percentile
from photonic_testbed.ptb.cli import CommandFailed
from photonic_testbed.ptb.stack import Stack

NAME = "swap"
HELP = ("GPU failure -> first training step on the spare: in-place swap vs torchrun "
        "restart-all (PyTorch job, lumion, 8 ranks)")
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
    p.add_argument("--window", type=float, default=10.0, metavar="S",
                   help="seconds of training for the throughput before and after (default 10)")


JOB_STOP_S = 60.0           # for a controller to stop its ranks and itself


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


def _journal_after(path, t: float) -> list:
    with SqliteJournal(path, read_only=True) as j:
        return [e for e in j.entries() if e.ts >= t]


def _throughput(job: _Job, t0: float, t1: float) -> tuple[float, float, float]:
    """(steps/s, mean step seconds, hook share of the step time) in [t0, t1)."""
    ev = job.events()
    steps = [e for e in ev if e["kind"] == "step" and t0 <= e["t"] < t1]
    rate = torch_job.steps_per_s(ev, t0, t1)
    if not steps:
        return rate, 0.0, 0.0
    step_s = statistics.mean(e["seconds"] for e in steps)
    hook = sum(e["hook_s"] for e in steps) / sum(e["seconds"] for e in steps)
    return rate, step_s, hook


def _in_place(stack: Stack, args, workdir: str) -> dict:
    name = _launch(stack, "in-place-job", workdir, "--standbys", "2")
    job = _Job(workdir)
    parts: dict[str, list[float]] = {k: [] for k in STAGES}
    try:
        stack.wait("20 steps with warm standbys",
                   lambda: job.steps_done() >= 20 and _free_gpus_ready(job, stack), 180, log=name)
        t = time.time()
        time.sleep(args.window)
        before = _throughput(job, t, time.time())
        for _ in range(args.runs):
            victim = job.order()["rank_map"]["3"]
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
            request(stack.control, {"cmd": "heal_gpu", "gpu": victim})
            stack.wait(f"a warm standby on {victim}", lambda: _free_gpus_ready(job, stack), 180,
                       log=name)
            n = job.steps_done()
            stack.wait("3 more steps", lambda: job.steps_done() >= n + 3,  # noqa: B023 (at once)
                       180, log=name)
        t = time.time()
        time.sleep(args.window)
        after = _throughput(job, t, time.time())
    finally:
        stack.stop(name, JOB_STOP_S)
    return {"parts": parts, "before": before, "after": after}


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


def run(args) -> dict:
    if args.runs < 1 or args.torchrun_runs < 1:
        raise CommandFailed("--runs and --torchrun-runs must be >= 1")
    load0 = os.getloadavg()
    stack = agent_stack("lumion", quarantine_s=0.0)
    try:
        with tempfile.TemporaryDirectory(prefix="ptb-swap-") as tmp:
            work = args.workdir or tmp
            ip = _in_place(stack, args, os.path.join(work, "inplace"))
            tr = _torchrun(stack, args, os.path.join(work, "torchrun"))
    finally:
        stack.close()
    load1 = os.getloadavg()
    rows = []
    for k, xs in ip["parts"].items():
        rows.append({"path": "in place", "stage": k, "runs": len(xs),
                     "p50_ms": f"{1e3 * statistics.median(xs):.1f}",
                     "p99_ms": f"{1e3 * percentile(xs, 0.99):.1f}",
                     "max_ms": f"{1e3 * max(xs):.1f}"})
    for k in ("first_step", "back_at_step"):
        xs = tr[k]
        rows.append({"path": "torchrun", "stage": k.replace("_", " "), "runs": len(xs),
                     "p50_ms": f"{1e3 * statistics.median(xs):.1f}",
                     "p99_ms": f"{1e3 * percentile(xs, 0.99):.1f}",
                     "max_ms": f"{1e3 * max(xs):.1f}"})
    p50 = statistics.median(ip["parts"]["total"])
    p50_tr = statistics.median(tr["first_step"])
    (r0, s0, h0), (r1, s1, _) = ip["before"], ip["after"]
    notes = [
        f"in place: failure -> first step on the spare p50 {1e3 * p50:.0f} ms (goal <= 300 ms:"
        f" {'met' if p50 <= 0.3 else 'NOT met'}; LUMION reports about {LUMION_S:g} s)",
        f"torchrun restart-all: p50 {p50_tr:.2f} s to the first step, "
        f"{statistics.median(tr['back_at_step']):.2f} s back at the step reached "
        f"({statistics.median(tr['steps_redone']):.0f} steps redone); in place is "
        f"{p50_tr / p50:.0f}x faster (goal >= 10x: {'met' if p50_tr / p50 >= 10 else 'NOT met'})",
        f"throughput {r0:.2f} steps/s before the first failure, {r1:.2f} after the last "
        f"(step {1e3 * s0:.0f} / {1e3 * s1:.0f} ms)",
        f"fabric hooks with no failure: {100 * h0:.3f} % of the step time",
        f"load average {load0[0]:.1f} at the start, {load1[0]:.1f} at the end "
        f"({os.cpu_count()} CPUs)",
    ]
    return {"rows": rows, "notes": notes,
            "samples_ms": {k: [round(1e3 * x, 2) for x in v] for k, v in ip["parts"].items()},
            "torchrun_s": {k: [round(x, 3) for x in v] for k, v in tr.items()},
            "throughput": {"before_steps_s": r0, "after_steps_s": r1, "step_s_before": s0,
                           "step_s_after": s1, "hook_share": h0},
            "load": [load0, load1]}
