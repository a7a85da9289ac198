"""`ptb demo`: the stack's main job, end to end on the built-in emulator.

Starts, each as its own process, exactly what a lab runs: the emulated rig with its rack of
GPUs (`ptb emulate`), the device services (`ptb serve`), the agent (`ptb agent`) and, when a
display is there (or `--gui`), the GUI (`ptb gui --rig FILE`). Then it starts the training
job through the emulator's control endpoint, lets it run, fails one GPU the way hardware fails
(the GPU goes dark; the rack's health monitor says so on the bus) and prints the timeline:
failure injected, detected by the agent, circuits applied, verified by light, restart ordered,
job resumed, with each interval, and the job's throughput before, during and after. Every
process is stopped at the end; the exit code is 0 when the job resumed on a healthy spare.

With `--secure` the bus runs CurveZMQ with roles: `ptb keys` makes the demo's keys (the
agent's, the job's tenant's, the GUI's operator's and an observer's, in WORKDIR/keys), every
process runs with its own, and the demo shows a change asked with the wrong role refused.
"""
from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import shutil
import tempfile
import time
from typing import TYPE_CHECKING, Any

from photonic_testbed.ptb.cli import CommandFailed
from photonic_testbed.ptb.stack import Stack

if TYPE_CHECKING:
    from photonic_testbed.hil.agent.journal import Entry

# Which GPU fails and which job runs, per rig.
# opus has no spare server: its DP ring shrinks to 7 ranks (the agent raises an alarm).
RIG_JOBS = {"lumion": ("dp", "gpu3"), "opus": ("dp", "server5")}
WINDOW_S = 2.0          # throughput windows before and after the failure
CACHE_FOLDER = "photonic-testbed"     # under the user's cache folder: each run's own folder
PEER_TIMEOUT_S = 10.0   # a generous wait for a reply: a busy machine must not fail the demo
RESUME_TIMEOUT_S = 120.0  # for the job to resume after the failure (about 0.3 s when idle)
# --secure: each process's key and its role (`ptb keys --role`); the tenant's job is the plan's
ROLE_KEYS = (("agent", "agent"), ("tenant", "tenant"), ("operator", "operator"),
             ("observer", "observer"))


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
    p.add_argument("--workdir", help="keep the rig file, calibration, journal and logs here "
                   "(default: a new folder under ~/.cache/photonic-testbed/, named in the "
                   "output)")
    p.add_argument("--keep-open", action="store_true",
                   help="keep the GUI (and the rig under it) running after the demo, until "
                   "its window is closed")
    p.add_argument("--job", choices=("emulated", "torch"), default="emulated",
                   help="the training job: our emulated step loop (default), or a real "
                   "PyTorch job whose failed rank a spare replaces in place (needs torch; "
                   "ptb/demo_torch.py)")
    p.add_argument("--slow", metavar="GPU[:FACTOR]",
                   help="with --job torch on lumion: the GPU goes FACTOR times slower (default "
                   "4) instead of failing; the agent finds it from the ranks' timings and "
                   "swaps it for a spare at a step boundary (a planned swap)")
    p.add_argument("--secure", action="store_true",
                   help="CurveZMQ on the bus with roles: keys for the agent, the job's tenant, "
                   "the GUI's operator and an observer (WORKDIR/keys, made anew), each process "
                   "with its own; a change asked with the wrong role is shown refused")
    p.add_argument("--ha", action="store_true",
                   help="the control plane replicated: 3 etcd members and 2 agent replicas; "
                   "the leader is killed (kill -9) in the middle of the swap and the standby "
                   "finishes it (docs/control-plane.md; the emulated job, no GUI)")
    p.set_defaults(func=run)


def say(t0: float, text: str) -> None:
    print(f"[{time.monotonic() - t0:7.3f} s] {text}", flush=True)


def has_display() -> bool:
    return bool(os.environ.get("DISPLAY") or os.environ.get("WAYLAND_DISPLAY")) and \
        os.environ.get("CI", "").lower() not in ("1", "true", "yes")


def demo_folder(given: str | None) -> pathlib.Path:
    """The folder that keeps the demo's files (rig file, calibration, journal, logs) after it
    ends: `--workdir`, or a new one under the user's cache folder."""
    if given:
        path = pathlib.Path(given).resolve()
        if path.exists() and not path.is_dir():
            raise CommandFailed(f"--workdir {given} is not a folder")
        try:
            path.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise CommandFailed(f"cannot make --workdir {given}: {e.strerror or e}") from None
        return path
    cache = pathlib.Path(os.environ.get("XDG_CACHE_HOME") or pathlib.Path.home() / ".cache")
    try:
        (cache / CACHE_FOLDER).mkdir(parents=True, exist_ok=True)
        return pathlib.Path(tempfile.mkdtemp(prefix=time.strftime("demo-%Y%m%d-%H%M%S-"),
                                             dir=cache / CACHE_FOLDER))
    except OSError as e:
        raise CommandFailed(f"cannot make a folder for the demo's files in "
                            f"{cache / CACHE_FOLDER}: {e.strerror or e}; name one with "
                            f"--workdir") from None


def _gpu_to_fail(rig: str, gpu: str | None, flag: str = "--gpu") -> str:
    """The GPU the demo fails (or slows: `flag` names the option that gave it): one the job
    runs on (a worker of the rig's rack, not a spare), checked before anything starts."""
    from photonic_testbed.common.rack_layout import layout
    workers = layout(rig).workers
    gpu = RIG_JOBS[rig][1] if gpu is None else gpu
    if gpu not in workers:
        spares = layout(rig).spares
        why = "is a spare, which the job does not run on" if gpu in spares \
            else f"is not in the {rig} rack"
        raise CommandFailed(f"{flag} {gpu!r} {why}; the job runs on {', '.join(workers)}"
                            + (f" (spares: {', '.join(spares)})" if spares else ""))
    return gpu


def slow_argument(text: str) -> tuple[str, float]:
    """`--slow GPU[:FACTOR]`: the GPU and the factor (4 when left out), checked."""
    gpu, _, factor = text.partition(":")
    try:
        value = float(factor) if factor else 4.0
    except ValueError:
        raise CommandFailed(f"--slow {text!r}: the factor after ':' is a number, as in "
                            "gpu3:2.5") from None
    if not 1.0 < value <= 10.0:
        raise CommandFailed(f"--slow {text!r}: the factor must be in (1, 10], not {value:g}")
    return gpu, value


def run(args) -> int:
    if not 0 < args.seconds <= 600:          # also refuses nan
        raise CommandFailed(f"--seconds must be in (0, 600], not {args.seconds:g}")
    if args.keep_open and args.headless:
        raise CommandFailed("--keep-open keeps the GUI open: it cannot go with --headless")
    if args.seed < 0:
        raise CommandFailed(f"--seed must be >= 0, not {args.seed}")
    if args.secure and args.job == "torch":
        raise CommandFailed("--secure runs the emulated job, whose tenant key the emulator "
                            "holds; --job torch runs without it")
    if args.ha and (args.secure or args.job == "torch" or args.gui or args.keep_open):
        raise CommandFailed("--ha runs the emulated job, headless, without --secure")
    plan = RIG_JOBS[args.rig][0]
    if args.slow is not None:
        if args.job != "torch" or args.rig != "lumion" or args.gpu:
            raise CommandFailed("--slow GPU[:FACTOR] goes with --job torch on --rig lumion "
                                "(its spares take a slow GPU's place), without --gpu")
        args.gpu, args.slow = slow_argument(args.slow)
    gpu = _gpu_to_fail(args.rig, args.gpu, "--gpu" if args.slow is None else "--slow")
    if args.job == "torch":
        from photonic_testbed.ptb import demo_torch
        demo_torch.check_torch()
    workdir = demo_folder(args.workdir)
    t0 = time.monotonic()
    say(t0, f"this run's files (rig file, calibration, journal, logs) are kept in {workdir}")
    keys = _make_keys(workdir / "keys", plan) if args.secure else None
    if keys is not None:
        say(t0, f"CURVE on, with roles: the agent's, the job's tenant's (job {plan}), the "
            f"GUI's operator's and an observer's keys in {keys}")
    try:
        with Stack(workdir, say=lambda text: say(t0, text)) as stack:
            stack.emulate(args.rig, "--seed", str(args.seed),
                          *(["--ideal-chip"] if args.ideal_chip else []),
                          *(["--keys", str(keys)] if keys is not None else []),
                          *(["--replicas", "2"] if args.ha else []))
            if stack.rig.chip is not None and not args.ideal_chip:
                stack.calibrate()
            stack.serve()
            if args.ha:
                from photonic_testbed.ptb import demo_ha
                return demo_ha.demo(args, plan, gpu, stack, t0, lambda text: say(t0, text))
            stack.agent()
            if args.job == "torch":
                return demo_torch.demo(args, gpu, stack, t0)
            return _demo(args, plan, gpu, stack, t0, keys)
    finally:
        say(t0, f"every process of the demo stopped; its files are in {workdir}")


def _make_keys(folder: pathlib.Path, job: str) -> pathlib.Path:
    """The demo's keys (ROLE_KEYS, the tenant's for `job`), each client's listed with its role
    in FOLDER/authorized, made anew (`ptb keys --role ... --authorize`)."""
    from photonic_testbed.hil.bus.security import KeyFileError, authorize, generate
    try:
        if folder.exists():
            shutil.rmtree(folder)            # (the demo's own, from an earlier run)
        generate(folder, "server")
        for name, role in ROLE_KEYS:
            public, _ = generate(folder, name, role, [job] if role == "tenant" else [])
            authorize(public, folder / "authorized")
    except (KeyFileError, OSError) as e:
        raise CommandFailed(f"cannot make the demo's keys in {folder}: {e}") from None
    return folder


def _role_rig(stack: Stack, keys: pathlib.Path, name: str) -> pathlib.Path:
    """The rig file as the process of key `name` reads it: the same rig, its own client key."""
    from photonic_testbed.hil import rig as rigfile
    rig = stack.rig
    path = stack.workdir / f"rig-{name}.toml"
    rigfile.write(path, dataclasses.replace(rig, bus=dataclasses.replace(
        rig.bus, client_key=str(keys / f"{name}.key_secret"))))
    return path


def _client_keys(keys: pathlib.Path, name: str) -> Any:
    from photonic_testbed.hil.bus.security import client_keys
    return client_keys(keys / f"{name}.key_secret", keys / "server.key")


def _show_roles(stack: Stack, keys: pathlib.Path, plan: str, t0: float) -> None:
    """Changes asked with the wrong role, each refused before anything moves (the demo fails
    if one is not): the observer's on the switch, the tenant's swap and another job's phase."""
    from photonic_testbed.hil.bus.client import ServiceClient, Unauthorized
    switch = stack.rig.gpus[0].switch
    agent = stack.rig.agent_endpoints()[0]
    asks: list[tuple[str, str, str, str, dict[str, Any]]] = [
        ("observer", stack.rig.devices[switch].request, switch, "apply_circuits",
         {"circuits": []}),
        ("tenant", agent, "agent", "swap", {"gpu": stack.rig.gpus[0].name}),
        ("tenant", agent, "agent", "phase", {"phase": "dp", "job": f"not-{plan}"})]
    for key, endpoint, where, op, args in asks:
        with ServiceClient(endpoint, keys=_client_keys(keys, key),
                           timeout=PEER_TIMEOUT_S) as client:
            try:
                client.call(op, **args)
            except Unauthorized as e:
                say(t0, f"roles: {op} asked of {where} with the {key}'s key: refused "
                    f"({e.remote_message})")
                continue
        raise CommandFailed(f"--secure: {op} asked of {where} with the {key}'s key was "
                            "not refused")


def _demo(args, plan: str, gpu: str, stack: Stack, t0: float,
          keys: pathlib.Path | None = None) -> int:
    from photonic_testbed.hil.agent.sqlite_journal import SqliteJournal
    from photonic_testbed.hil.bus.client import ServiceClient
    from photonic_testbed.hil.lab.control_client import ControlError, request

    control, journal = stack.control, stack.journal
    # (with --secure the demo reads the agent's state with the observer's key)
    agent = ServiceClient(stack.rig.agent_endpoints()[0], timeout=PEER_TIMEOUT_S,
                          keys=None if keys is None else _client_keys(keys, "observer"))
    try:
        gui = None
        if args.gui or (not args.headless and has_display()):
            from photonic_testbed.ptb.gui import DemoGui
            gui = DemoGui(stack, stack.rig_path if keys is None else
                          _role_rig(stack, keys, "operator"), lambda text: say(t0, text))
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
        stack.check()
        before = request(control, {"cmd": "job_status"})
        if before["step"] == 0:
            raise CommandFailed(f"the job made no step in {args.seconds:g} s "
                                f"({before['state']}); agent log:\n{stack.tail('agent')}")
        say(t0, f"job running: {before['step']} steps done")
        if keys is not None:
            _show_roles(stack, keys, plan, t0)
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
        stack.wait("the job's resumption", resumed, RESUME_TIMEOUT_S, log="agent")
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


def print_timeline(rows: list[tuple[str, float, str]], t_fail: float,
                   start: str = "the failure") -> None:
    """A demo's timeline: (what, when, detail) rows in time order, each with its time since the
    failure (`start`) and since the row before."""
    width = max((len(name) for name, _, _ in rows), default=0) + 2
    print()
    print(f"timeline (from {start}; each line: time since {start}, since the line before)")
    last = t_fail
    for name, ts, what in sorted(rows, key=lambda r: r[1]):
        print(f"  {name:<{width}} +{1e3 * (ts - t_fail):8.1f} ms  (+{1e3 * (ts - last):7.1f} "
              f"ms)  {what or ''}")
        last = ts


def _restart_after(status: dict, t: float) -> dict | None:
    """The job's own record of the first restart taken after `t` that has resumed (its first
    step done), or None."""
    return next((r for r in status.get("restart_records", ())
                 if r["t"] >= t and r["resumed_t"] is not None), None)


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
    print_timeline(rows, t_fail)
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
    world = len(before["rank_map"])
    degraded = len(rank_map) < world
    ok = bool(restarted) and gpu not in rank_map.values() and not degraded
    print()
    print(f"ranks now on {', '.join(rank_map.values())}; communications over a down link: "
          f"{status['down_communications']}")
    if ok:
        print("demo succeeded")
    elif degraded and restarted:
        print(f"demo FAILED: no healthy spare took {gpu}'s place: the job runs degraded on "
              f"{len(rank_map)} of its {world} ranks")
    else:
        print("demo FAILED: the job did not resume without the failed GPU")
    return 0 if ok else 1
