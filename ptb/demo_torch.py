"""`ptb demo --job torch`: the stack with a real PyTorch training job in the loop.

The same processes as `ptb demo` (emulated rig, services, agent, the GUI when there is a
display), then the job's controller (`python -m photonic_testbed.hil.job.torch_job launch`) with a
rank process on each GPU of the rank map and a warm standby on each spare. After `--seconds`
of training one GPU fails (the emulator takes its process down) and the timeline is printed:
the failure, the agent's detection, circuits applied and verified, the restart order, the
survivors abandoning their all-reduce, the new communicator, the state sent to the spare and
its first step; then the loss and throughput before and after.

- lumion: data-parallel over 8 ranks with 2 spares: the spare takes the rank in place.
- opus: tensor-parallel pairs inside data-parallel rings (the agent switches the OCS's rails
  between the two phases every step); opus has no spare and a 2-D job cannot run on 7 ranks:
  the job stops cleanly with the agent's reason.
"""
from __future__ import annotations

import importlib.util
import statistics
import subprocess
import time

from photonic_testbed.ptb.cli import CommandFailed
from photonic_testbed.ptb.demo import WINDOW_S, has_display, print_timeline, say
from photonic_testbed.ptb.stack import Stack

PLANS = {"lumion": "dp", "opus": "dp-tp"}
MODEL = ("--width", "64", "--layers", "2", "--batch", "4", "--block", "32")
# --slow: steps whose compute outweighs their all-reduce, as on GPUs (a slow GPU is late to
# the collective; with the small model a rank's time goes mostly to gloo's own work, where a
# slow rank holds up everyone alike)
SLOW_MODEL = ("--width", "128", "--layers", "2", "--batch", "8", "--block", "64")


def check_torch() -> None:
    """Before anything starts: the job needs PyTorch here."""
    if importlib.util.find_spec("torch") is None:
        raise CommandFailed("--job torch needs PyTorch: pip install 'photonic-testbed[torch]' "
                            "(torch==2.13.0, the CPU build: about 190 MB)")


def demo(args, gpu: str, stack: Stack, t0: float) -> int:
    from photonic_testbed.hil.bus.client import ServiceClient
    from photonic_testbed.hil.job import torch_job
    from photonic_testbed.hil.lab.control_client import ControlError, request

    rig, workdir, control = stack.rig, stack.workdir, stack.control
    agent = ServiceClient(rig.agent_endpoints()[0], timeout=2.0)
    try:
        gui = None
        if args.gui or (not args.headless and has_display()):
            from photonic_testbed.ptb.gui import DemoGui
            gui = DemoGui(stack, stack.rig_path, lambda text: say(t0, text))
        plan = PLANS[args.rig]
        job_dir = workdir / "torch-job"
        proc = stack.job("--workdir", str(job_dir), "--rig", str(stack.rig_path), "--control",
                         control, "--plan", plan, "--world", "8", "--steps", "1000000",
                         "--restart-timeout", "10",
                         *(MODEL if args.slow is None else SLOW_MODEL), name="torch-job")

        def events():
            return torch_job.read_events(job_dir) if (job_dir / "events").exists() else []

        def standbys_ready(ev):
            spares = {g.name for g in rig.gpus if g.spare}
            return spares <= {e["gpu"] for e in ev if e["kind"] == "ready"}
        stack.wait("the job's first steps", lambda: (lambda ev: any(
            e["kind"] == "step" for e in ev) and standbys_ready(ev))(events()), 300,
            log="torch-job")
        order = next(e for e in events() if e["kind"] == "order")
        spares = sorted(g.name for g in rig.gpus if g.spare)
        say(t0, f"PyTorch job ({plan}, 8 ranks) admitted: ranks on "
                f"{', '.join(order['rank_map'].values())}; "
                + (f"warm standbys ready on {', '.join(spares)}" if spares else
                   "no spare on this rig: no standby"))
        time.sleep(args.seconds)
        stack.check()
        if args.slow is not None:
            return _slow(args, gpu, stack, t0, events, agent, gui)
        t_fail = time.time()
        try:
            request(control, {"cmd": "fail_gpu", "gpu": gpu})
        except ControlError as e:
            raise CommandFailed(f"cannot fail {gpu}: {e}") from None
        say(t0, f"failure injected: {gpu} goes dark and its rank process dies")
        if plan == "dp":
            stack.wait("the spare's first step", lambda: torch_job.swap_timeline(
                events(), t_fail, gpu)["first_step"], 120, log="torch-job")
            time.sleep(max(args.seconds, WINDOW_S))
        else:
            _wait_exit(proc, 120)
        state = agent.call("snapshot")["state"]
    finally:
        agent.close()
    code = _report(t_fail, gpu, events(), state, proc, workdir)
    if gui is not None:
        gui.finish(keep_open=args.keep_open)
    return code


def _slow(args, gpu: str, stack: Stack, t0: float, events, agent, gui) -> int:
    """The GPU goes slow; the agent finds it and swaps it at a step boundary: the timeline,
    the agent's reasons, the stall and the throughput before, while slow and after."""
    from photonic_testbed.hil.job import torch_job
    from photonic_testbed.hil.lab.control_client import ControlError, request
    t_slow = time.time()
    try:
        request(stack.control, {"cmd": "slow_gpu", "gpu": gpu, "factor": args.slow,
                                "period_s": 0.02})
    except ControlError as e:
        raise CommandFailed(f"cannot slow {gpu}: {e}") from None
    say(t0, f"{gpu} goes {args.slow:g}x slower (its rank process stopped and continued by "
            "the emulator): it does not fail")
    stack.wait("the planned swap", lambda: any(e["kind"] == "handed_over"
                                               for e in events()), 300, log="torch-job")
    time.sleep(max(args.seconds, WINDOW_S))
    ev = events()
    state = agent.call("snapshot")["state"]
    journal = [e for e in state["events"] if e["ts"] >= t_slow]

    def first(kind, **match):
        return next((e for e in journal if e["kind"] == kind and all(
            e["details"].get(k) == v for k, v in match.items())), None)
    hold = next(e for e in ev if e["kind"] == "hold")
    over = next(e for e in ev if e["kind"] == "handed_over")
    order = next(e for e in ev if e["kind"] == "order" and e["gen"] == over["gen"])
    spare = next(g for g in order["rank_map"].values() if g != gpu and g not in next(
        o for o in ev if o["kind"] == "order")["rank_map"].values())
    rows = [("slowdown injected", t_slow, f"{gpu} {args.slow:g}x slower")]
    for entry, name in ((first("slow", action="suspect"), "suspected by the agent"),
                        (first("slow", action="swap"), "planned swap decided")):
        if entry:
            d = entry["details"]
            rows.append((name, entry["ts"], f"{d.get('ratio', 0):.2f}x, {d.get('steps')} "
                         f"steps, cost {d.get('lost_s', 0):.2f} s"))
    held = [e for e in ev if e["kind"] == "held" and e["gen"] == hold["gen"]]
    rows.append(("hold asked", hold["t"], f"every rank to stop after step {hold['step']}"))
    if held:
        rows.append(("every rank held", max(e["t"] for e in held), f"{len(held)} ranks at "
                     f"step {hold['step']}, nothing in flight"))
    for kind, name in (("applied", "circuits applied"), ("verified", "verified by light")):
        entry = first(kind)
        if entry:
            rows.append((name, entry["ts"], ""))
    rows.append(("job's new generation", order["t"], f"generation {order['gen']}: {gpu} -> "
                 f"{spare}"))
    step1 = next((e for e in ev if e["kind"] == "step" and e.get("gpu") == spare), None)
    if step1:
        rows.append(("first step on the spare", step1["t"], f"step {step1['step']} (none "
                     "redone)"))
    print_timeline(rows, t_slow, "the slowdown")
    why = first("slow", action="swap")
    if why:
        print(f"  why: {why['cause']}")
    print()
    steps = [e for e in ev if e["kind"] == "step"]
    t_first = min(e["t"] for e in steps)
    t_end = max(e["t"] for e in steps)
    before = torch_job.steps_per_s(ev, max(t_first, t_slow - WINDOW_S), t_slow)
    during = torch_job.steps_per_s(ev, t_slow, hold["t"])
    after = torch_job.steps_per_s(ev, step1["t"] if step1 else t_end, t_end)
    print(f"throughput: {before:.2f} steps/s before, {during:.2f} while {gpu} was slow, "
          f"{after:.2f} after the swap")
    print(f"stall the job saw at the swap: {1e3 * over['stall_s']:.0f} ms beyond a step "
          f"({1e3 * over['step_s']:.0f} ms)")
    ok = gpu not in state["rank_map"].values() and spare in state["rank_map"].values()
    print("demo " + (f"succeeded: {gpu} was found slow and {spare} took its rank at a step "
                     "boundary" if ok else "FAILED: the slow GPU was not swapped"))
    if gui is not None:
        gui.finish(keep_open=args.keep_open)
    return 0 if ok else 1


def _wait_exit(proc: subprocess.Popen, timeout: float) -> None:
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        raise CommandFailed(f"the job did not stop within {timeout:g} s") from None


def _report(t_fail: float, gpu: str, ev: list[dict], agent: dict, proc, workdir) -> int:
    from photonic_testbed.hil.job import torch_job
    journal = [e for e in agent["events"] if e["ts"] >= t_fail]

    def first(kind):
        return next((e for e in journal if e["kind"] == kind), None)
    tl = torch_job.swap_timeline(ev, t_fail, gpu)
    rows = [("failure injected", t_fail, f"{gpu} dark, its process killed")]
    for kind, name in (("detected", "detected by the agent"), ("applied", "circuits applied"),
                       ("verified", "verified by light"), ("restart", "restart ordered")):
        e = first(kind)
        if e:
            what = {"detected": e["cause"], "restart": "new rank map published"}.get(kind, "")
            if kind == "verified":
                dbm = e["details"].get("dbm", {})
                what = (f"{len(dbm)} receivers, min {min(dbm.values()):.1f} dBm" if dbm
                        else "")
            if kind == "applied":
                d = e["details"]
                what = (f"{d.get('switch')}: +{len(d.get('added', []))} "
                        f"-{len(d.get('removed', []))} circuits")
            rows.append((name, e["ts"], what))
    if tl["aborted"]:
        rows.append(("survivors abandon all-reduce", tl["aborted"], "no collective timeout"))
    if tl["order"]:
        rows.append(("job's new generation", tl["order"]["t"],
                     f"generation {tl['order']['gen']}: {gpu} -> {tl['spare']}"))
    if tl["rebuilt"]:
        rows.append(("communicator rebuilt", tl["rebuilt"], "fresh store prefix"))
    if tl["transferred"]:
        rows.append(("state transferred", tl["transferred"],
                     f"{tl['bytes'] / 1e6:.2f} MB to {tl['spare']} from its ring peer "
                     f"(step {tl['target_step']})"))
    if tl["first_step"]:
        rows.append(("first step on the spare", tl["first_step"],
                     f"step {tl['first_step_no']} (the interrupted one, redone)"))
    print_timeline(rows, t_fail)
    for a in agent["alarms"]:
        print(f"  alarm: {a}")
    print()
    before = [e for e in ev if e["kind"] == "step" and e["t"] < t_fail]
    t_start = min((e["t"] for e in before), default=t_fail)
    w0 = max(t_start, t_fail - WINDOW_S)
    loss_before = [e["loss"] for e in before if e["t"] >= w0]
    print(f"loss: {statistics.mean(e['loss'] for e in before[:8]):.3f} at the start, "
          f"{statistics.mean(loss_before):.3f} just before the failure", end="")
    resumed = tl["first_step"]
    if resumed:
        after = [e for e in ev if e["kind"] == "step" and e["t"] >= resumed]
        t_end = max(e["t"] for e in after)
        print(f", {statistics.mean(e['loss'] for e in after):.3f} after "
              f"({len(after)} rank-steps)")
        print(f"throughput: {torch_job.steps_per_s(ev, w0, t_fail):.2f} steps/s before, "
              f"{torch_job.steps_per_s(ev, resumed, t_end):.2f} after")
        order = tl["order"]["rank_map"]
        ok = gpu not in order.values() and agent["rank_map"] == order
        print(f"ranks now on {', '.join(order.values())}")
        print("demo " + ("succeeded: the spare took the failed rank's place in place" if ok
                         else "FAILED: the job did not resume on a spare"))
        return 0 if ok else 1
    print()
    tp = sorted(1e3 * e["latency_s"] for e in agent["events"]
                if e["kind"] == "phase" and e["latency_s"] is not None)
    if tp:
        print(f"rail switches (tp <-> dp) in the agent's last entries: {len(tp)}, median "
              f"{tp[len(tp) // 2]:.2f} ms, max {tp[-1]:.2f} ms")
    hook = [e["hook_s"] / e["seconds"] for e in before if e["seconds"] > 0]
    if hook:
        print(f"phase barrier + grant per step: {100 * statistics.median(hook):.1f} % of the "
              f"step time (median; includes waiting for the slowest rank)")
    stop = next((e for e in ev if e.get("role") == "controller" and e["kind"] == "stopped"),
                None)
    if stop:
        print(f"job stopped cleanly: {stop['reason']}")
    print("demo FAILED: " + ("no spare took the failed rank's place: the job stopped (a 2-D "
                             "job cannot shrink)" if stop is not None else
                             f"the job ended with exit {proc.returncode}"))
    return 1
