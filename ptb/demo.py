"""`ptb demo`: the stack's main job, end to end on the built-in emulator.

Starts, each as its own process, exactly what a lab runs: the emulated rig with its rack of
GPUs (`ptb emulate`), the device services (`ptb serve`), the agent (`ptb agent`) and, when a
display is there (or `--gui`), the GUI (`ptb gui --rig FILE`). Then it starts the training
job through the emulator's control endpoint, lets it run, fails one GPU the way hardware fails
(the GPU goes dark; the rack's health monitor says so on the bus) and prints the timeline:
failure injected, detected by the agent, circuits applied, verified by light, restart ordered,
job resumed, with each interval, and the job's throughput before, during and after. Every
process is stopped at the end; the exit code is 0 when the job resumed on a healthy spare.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time
from typing import TYPE_CHECKING

from photonic_testbed.ptb.cli import CommandFailed

if TYPE_CHECKING:
    from photonic_testbed.hil.agent.journal import Entry

# Which GPU fails and which job runs, per rig.
# opus has no spare server: its DP ring shrinks to 7 ranks (the agent raises an alarm).
RIG_JOBS = {"lumion": ("dp", "gpu3"), "opus": ("dp", "server5")}
WINDOW_S = 2.0          # throughput windows before and after the failure


CALIBRATION_TIMEOUT_S = 300
PEER_TIMEOUT_S = 10.0   # a generous wait for a reply: a busy machine must not fail the demo
READY_TIMEOUT_S = 300.0  # for a process to come up (imports alone take a minute on a busy VM)
RESUME_TIMEOUT_S = 120.0  # for the job to resume after the failure (about 0.3 s when idle)


def add_parser(sub) -> None:
    p = sub.add_parser("demo", help="run the stack's main job on the built-in emulator",
                       description="Emulated rig, services, agent (and GUI), a training job, "
                       "one GPU failure, and the timeline of the recovery.")
    p.add_argument("--rig", default="lumion", choices=sorted(RIG_JOBS),
                   help="emulated rig (default lumion)")
    p.add_argument("--seconds", type=float, default=4.0, metavar="N",
                   help="seconds the job runs before the failure (and at least as long after; "
                   "default 4)")
    p.add_argument("--gpu", help="the GPU to fail (default: lumion gpu3, opus server5)")
    show = p.add_mutually_exclusive_group()
    show.add_argument("--headless", action="store_true", help="never open the GUI")
    show.add_argument("--gui", action="store_true",
                      help="open the GUI even without a detected display")
    p.add_argument("--seed", type=int, default=0, help="seed of the hidden physical truth")
    p.add_argument("--ideal-chip", action="store_true",
                   help="a chip without fabrication errors, used uncalibrated (default: the "
                   "seeded, imperfect chip, calibrated first with ptb calibrate)")
    p.add_argument("--workdir", help="keep the rig file, journal and logs here")
    p.add_argument("--keep-open", action="store_true",
                   help="keep the GUI (and the rig under it) running after the demo, until "
                   "its window is closed")
    p.add_argument("--job", choices=("emulated", "torch"), default="emulated",
                   help="the training job: our emulated step loop (default), or a real "
                   "PyTorch job whose failed rank a spare replaces in place (needs torch; "
                   "ptb/demo_torch.py)")
    p.set_defaults(func=run)


def say(t0: float, text: str) -> None:
    print(f"[{time.monotonic() - t0:7.3f} s] {text}", flush=True)


def has_display() -> bool:
    return bool(os.environ.get("DISPLAY") or os.environ.get("WAYLAND_DISPLAY")) and \
        os.environ.get("CI", "").lower() not in ("1", "true", "yes")


class Processes:
    """The demo's child processes: started with logs in the work dir, all stopped at close."""

    def __init__(self, workdir: pathlib.Path):
        self.workdir = workdir
        self.procs: list[tuple[str, subprocess.Popen]] = []
        self._logs: list = []

    def start(self, name: str, *args: str) -> subprocess.Popen:
        log = open(self.workdir / f"{name}.log", "w")
        self._logs.append(log)
        proc = subprocess.Popen([sys.executable, "-m", "photonic_testbed.ptb", *args],
                                stdout=log, stderr=subprocess.STDOUT, cwd=self.workdir)
        self.procs.append((name, proc))
        return proc

    def check(self) -> None:
        for name, proc in self.procs:
            if name != "gui" and proc.poll() is not None:
                raise CommandFailed(f"{name} stopped (exit {proc.returncode}); its log:\n"
                                    + self.tail(name))

    def tail(self, name: str, lines: int = 15) -> str:
        path = self.workdir / f"{name}.log"
        text = path.read_text(errors="replace") if path.exists() else ""
        return "\n".join(text.splitlines()[-lines:])

    def close(self) -> None:
        for _, proc in reversed(self.procs):
            if proc.poll() is None:
                proc.terminate()
        deadline = time.monotonic() + 10
        for _, proc in reversed(self.procs):
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)
        for log in self._logs:
            log.close()


def _wait(what: str, cond, procs: Processes, timeout: float = READY_TIMEOUT_S):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        procs.check()
        got = cond()
        if got:
            return got
        time.sleep(0.05)
    raise CommandFailed(f"{what} did not happen within {timeout:g} s")


def _gpu_to_fail(rig: str, gpu: str | None) -> str:
    """The GPU the demo fails: one the job runs on (a worker of the rig's rack, not a spare),
    checked before anything starts."""
    from photonic_testbed.common.rack_layout import layout
    workers = layout(rig).workers
    gpu = RIG_JOBS[rig][1] if gpu is None else gpu
    if gpu not in workers:
        spares = layout(rig).spares
        why = "is a spare, which the job does not run on" if gpu in spares \
            else f"is not in the {rig} rack"
        raise CommandFailed(f"--gpu {gpu!r} {why}; the job runs on {', '.join(workers)}"
                            + (f" (spares: {', '.join(spares)})" if spares else ""))
    return gpu


def run(args) -> int:
    if not 0 < args.seconds <= 600:          # also refuses nan
        raise CommandFailed(f"--seconds must be in (0, 600], not {args.seconds:g}")
    if args.keep_open and args.headless:
        raise CommandFailed("--keep-open keeps the GUI open: it cannot go with --headless")
    if args.seed < 0:
        raise CommandFailed(f"--seed must be >= 0, not {args.seed}")
    plan = RIG_JOBS[args.rig][0]
    gpu = _gpu_to_fail(args.rig, args.gpu)
    if args.workdir and os.path.exists(args.workdir) and not os.path.isdir(args.workdir):
        raise CommandFailed(f"--workdir {args.workdir} is not a folder")
    with contextlib.ExitStack() as stack:
        if args.workdir:
            workdir = pathlib.Path(args.workdir).resolve()
            try:
                workdir.mkdir(parents=True, exist_ok=True)
            except OSError as e:
                raise CommandFailed(f"cannot make --workdir {args.workdir}: "
                                    f"{e.strerror or e}") from None
        else:
            workdir = pathlib.Path(stack.enter_context(tempfile.TemporaryDirectory(
                prefix="ptb-demo-")))
        procs = Processes(workdir)
        stack.callback(procs.close)
        if args.job == "torch":
            from photonic_testbed.ptb import demo_torch
            return demo_torch.demo(args, gpu, workdir, procs)
        return _demo(args, plan, gpu, workdir, procs)
    return 1


def _demo(args, plan: str, gpu: str, workdir: pathlib.Path, procs: Processes) -> int:
    from photonic_testbed.hil import rig as rigfile
    from photonic_testbed.hil.agent.sqlite_journal import SqliteJournal
    from photonic_testbed.hil.bus.client import BusError, ServiceClient
    from photonic_testbed.hil.lab.control_client import ControlError, request

    t0 = time.monotonic()
    rig_path, eps_path = workdir / "rig.toml", workdir / "emulator.json"
    journal = workdir / "journal.db"
    for stale in (rig_path, eps_path, workdir / "services.json"):
        stale.unlink(missing_ok=True)       # a reused --workdir: wait for this run's files
    procs.start("emulate", "emulate", "--rig", args.rig, "--seed", str(args.seed),
                *(["--ideal-chip"] if args.ideal_chip else []),
                "--write-rig", str(rig_path), "--endpoints", str(eps_path))
    _wait("the emulator", lambda: rig_path.exists() and eps_path.exists(), procs)
    rig = rigfile.load(rig_path)
    if rig.chip is not None and not args.ideal_chip:
        rig = _calibrate(t0, rig, rig_path, workdir, procs)
    control = json.loads(eps_path.read_text())["control"]
    say(t0, f"emulated rig {args.rig}: {', '.join(rig.devices)} on their wires; "
            f"{len(rig.gpus)} GPUs ({sum(g.spare for g in rig.gpus)} spares) on "
            f"{', '.join(sorted({g.switch for g in rig.gpus}))}")
    served = workdir / "services.json"
    procs.start("serve", "serve", "--rig", str(rig_path), "--endpoints", str(served))
    _wait("the device services", served.exists, procs)
    say(t0, f"bus services up: {', '.join(json.loads(served.read_text()))}")
    procs.start("agent", "agent", "--rig", str(rig_path), "--journal", str(journal))
    agent = ServiceClient(rig.agent_endpoints()[0], timeout=PEER_TIMEOUT_S)

    def agent_up():
        try:
            return agent.call("ping", timeout=PEER_TIMEOUT_S / 2)
        except BusError:
            return None
    try:
        _wait("the agent", agent_up, procs)
        say(t0, f"agent up, journal {journal.name}")
        gui = None
        if args.gui or (not args.headless and has_display()):
            from photonic_testbed.ptb.gui import DemoGui
            gui = DemoGui(procs, rig_path, lambda text: say(t0, text))
        try:
            got = request(control, {"cmd": "job_start", "plan": plan, "steps": 1_000_000})
        except ControlError as e:
            raise CommandFailed(f"the job did not start: {e}") from None
        ranks_on = list(got["rank_map"].values())
        say(t0, f"job {got['plan']} admitted: ranks on {', '.join(ranks_on)}")
        if gpu not in ranks_on:
            raise CommandFailed(f"the job runs on {', '.join(ranks_on)}, not on {gpu}: "
                                f"failing it would not touch the job")
        time.sleep(args.seconds)
        procs.check()
        before = request(control, {"cmd": "job_status"})
        if before["step"] == 0:
            raise CommandFailed(f"the job made no step in {args.seconds:g} s "
                                f"({before['state']}); agent log:\n{procs.tail('agent')}")
        say(t0, f"job running: {before['step']} steps done")
        with SqliteJournal(journal, read_only=True) as j:    # where the agent's entries start
            seq = max((e.seq for e in j.entries()), default=0)
        t_fail = time.time()
        request(control, {"cmd": "fail_gpu", "gpu": gpu, "mode": "hard"})
        say(t0, f"failure injected: {gpu} goes dark (Xid 79, fallen off the bus)")

        def resumed():
            s = request(control, {"cmd": "job_status"})
            if s["state"] == "aborted":
                raise CommandFailed("the job aborted: " + json.dumps(s["events"][-3:]))
            return _restart_after(s, t_fail)
        _wait("the job's resumption", resumed, procs, timeout=RESUME_TIMEOUT_S)
        time.sleep(max(args.seconds, WINDOW_S))
        status = request(control, {"cmd": "job_status"})
        state = agent.call("snapshot")["state"]
        with SqliteJournal(journal, read_only=True) as j:     # the agent's own record of it
            entries = j.entries(since=seq)
    finally:
        agent.close()
    code = _report(t0, t_fail, gpu, before, status, entries, state)
    if gui is not None:
        gui.finish(keep_open=args.keep_open)
    elif args.keep_open:
        say(t0, "--keep-open: no GUI was opened (no display; --gui opens one)")
    return code


def _restart_after(status: dict, t: float) -> dict | None:
    """The job's own record of the first restart taken after `t` that has resumed (its first
    step done), or None."""
    return next((r for r in status.get("restart_records", ())
                 if r["t"] >= t and r["resumed_t"] is not None), None)


def _calibrate(t0: float, rig, rig_path: pathlib.Path, workdir: pathlib.Path,
               procs: Processes):
    """Calibrate the seeded chip through the rig's instruments (ptb calibrate), then name the
    calibration file in the rig file, so the chip service drives the chip with it."""
    from photonic_testbed.hil import rig as rigfile
    out = workdir / "calibration.json"
    say(t0, "calibrating the chip (ptb calibrate: fringes, crosstalk, refinement)")
    proc = procs.start("calibrate", "calibrate", "--rig", str(rig_path), "--out", str(out))
    try:
        proc.wait(CALIBRATION_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise CommandFailed(f"calibration took over {CALIBRATION_TIMEOUT_S} s; its log:\n"
                            + procs.tail("calibrate")) from None
    if proc.returncode != 0:
        raise CommandFailed("calibration failed; its log:\n" + procs.tail("calibrate"))
    procs.procs = [(name, p) for name, p in procs.procs if p is not proc]   # done, not dead
    summary = [line for line in procs.tail("calibrate", 40).splitlines()
               if line.startswith("calibration of")]
    say(t0, summary[-1] if summary else f"calibration written to {out.name}")
    rig = dataclasses.replace(rig, chip=dataclasses.replace(rig.chip, calibration=str(out)))
    rigfile.write(rig_path, rig)
    return rigfile.load(rig_path)


def _report(t0: float, t_fail: float, gpu: str, before: dict, status: dict,
            events: list[Entry], agent: dict) -> int:
    """The timeline and throughput, from the agent's journal entries since the failure
    (`events`), the job's own restart record and its running totals (`before`: the job's status
    just before the failure; `status`: at the end)."""
    from photonic_testbed.hil.agent.entries import Applied, RestartOrder, Swap, Verified

    def first(kind: str, after: float = t_fail) -> Entry | None:
        return next((e for e in events if e.kind == kind and e.ts >= after), None)
    detected = first("detected")
    applied = first("applied", detected.ts if detected else t_fail)
    verified = first("verified", detected.ts if detected else t_fail)
    restart = first("restart", detected.ts if detected else t_fail)
    restarted = _restart_after(status, t_fail)
    print()
    print("timeline (from the failure; each line: time since the failure, since the line "
          "before)")
    last = t_fail
    rows = [("failure injected", t_fail, f"{gpu} dark")]
    if restarted and restarted["failed_t"] is not None:
        rows.append(("job saw it fail", restarted["failed_t"], restarted["failure"]))
    if detected:
        rows.append(("detected by the agent", detected.ts, detected.cause))
    for e in events:
        if isinstance(e.details, Swap):
            sw = ", ".join(f"{a} -> {b}" for a, b in e.details.swaps.items())
            rows.append(("spare chosen", e.ts, sw or "no spare"))
            break
    if applied and isinstance(applied.details, Applied):
        d = applied.details
        rows.append(("circuits applied", applied.ts,
                     f"{d.switch}: +{len(d.added)} -{len(d.removed)} circuits in "
                     f"{1e3 * (applied.latency_s or 0):.1f} ms"))
    if verified and isinstance(verified.details, Verified):
        dbm = verified.details.dbm
        rows.append(("verified by light", verified.ts,
                     f"{len(dbm)} receivers, min {min(dbm.values()):.1f} dBm" if dbm
                     else "no new circuit to a spare to read"))
    if restart and isinstance(restart.details, RestartOrder):
        rows.append(("restart ordered", restart.ts,
                     "new rank map published" if restart.details.rank_map else ""))
    if restarted:
        rows.append(("job restarted", restarted["t"],
                     f"from the checkpoint at step {restarted['from_step']}, "
                     f"{restarted['lost_steps']} steps redone"))
        rows.append(("job resumed (first step)", restarted["resumed_t"],
                     f"step {restarted['resumed_step']}"))
    rows.sort(key=lambda r: r[1])
    for name, ts, what in rows:
        print(f"  {name:<26} +{1e3 * (ts - t_fail):8.1f} ms  (+{1e3 * (ts - last):7.1f} ms)  "
              f"{what or ''}")
        last = ts
    for e in agent["alarms"]:
        print(f"  alarm: {e}")

    # steps/s: before, from the last steps the job reported just before the failure; during
    # and after, from its running count of steps done and its restart record
    n_before = sum(1 for s in before["steps"] if t_fail - WINDOW_S <= s[3] < t_fail)
    resume = restarted["resumed_t"] if restarted else t_fail
    t_end = status["steps"][-1][3] if status["steps"] else resume
    during = after = 0.0
    if restarted:
        done_in_outage = restarted["resumed_steps_done"] - 1 - before["steps_done"]
        during = max(0, done_in_outage) / (resume - t_fail) if resume > t_fail else 0.0
        if t_end > resume:
            after = (status["steps_done"] - restarted["resumed_steps_done"]) / (t_end - resume)
    print()
    print("job throughput (steps/s)")
    print(f"  before  {n_before / WINDOW_S:7.1f}   ({WINDOW_S:g} s before the failure)")
    print(f"  during  {during:7.1f}   ({1e3 * (resume - t_fail):.0f} ms outage)")
    print(f"  after   {after:7.1f}   ({t_end - resume:.1f} s after)")
    rank_map = status["rank_map"]
    phases = [e for e in agent["events"] if e["kind"] == "phase" and e["latency_s"] is not None]
    if phases:
        lat = sorted(1e3 * e["latency_s"] for e in phases)
        print(f"phase switches in the last {len(agent['events'])} journal entries: "
              f"{len(lat)}, median {lat[len(lat) // 2]:.2f} ms, max {lat[-1]:.2f} ms")
    ok = bool(restarted) and gpu not in rank_map.values()
    print()
    print(f"ranks now on {', '.join(rank_map.values())}; communications over a down link: "
          f"{status['down_communications']}")
    print("demo " + ("succeeded" if ok else "FAILED: the job did not resume without the "
                     "failed GPU"))
    return 0 if ok else 1
