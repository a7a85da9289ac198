"""A rig's processes, brought up as a lab brings them up: `ptb emulate`, `ptb calibrate`,
`ptb serve`, `ptb agent` and the training job, each a child process of this one, started in
that order, each waited for until it is ready. `ptb demo`, the benches and tests bring up their
stacks with it.

    with Stack(workdir, say=print) as stack:
        stack.emulate("lumion", "--seed", "0")      # rig.toml, emulator.json
        stack.calibrate()                           # calibration.json, named in rig.toml
        stack.serve()                               # services.json
        stack.agent()                               # journal.db
        ...                                         # stack.rig, stack.control, stack.journal

What it promises:
- Every wait is bounded and says what it waited for when it runs out; a process of the stack
  that stops while another is awaited is named at once, with the end of its log.
- Each stage says when it starts (`say`); the calibration's own progress lines are passed on
  as they come. Every process writes its output to `<name>.log` in the stack's folder, and the
  files the stages write stay there: the folder is removed at the end only when the stack made
  it (no `workdir` given).
- Nothing outlives the stack: `close()` (the end of the `with`, an exception, Ctrl-C, or a
  SIGTERM or SIGHUP to this process, which the stack turns into an exit while it is open) stops
  the emulator's training job while the agent still answers it, asks each process to stop
  (SIGTERM), newest first, then kills what is left of each one's process group: every child
  starts a group of its own, so its own children (a job's ranks, a supervisor's services) go
  with it, and a Ctrl-C at the terminal reaches this process alone, which stops the others.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from types import FrameType
from typing import IO, Any, TypeVar

from photonic_testbed.hil import rig as rigfile
from photonic_testbed.ptb.cli import CommandFailed

READY_S = 300.0            # for a process to come up (imports alone take a minute on a busy VM)
CALIBRATE_S = 600.0        # for `ptb calibrate` to finish (under a minute on an idle machine)
STOP_S = 15.0              # for the stack's processes to stop by themselves before they are killed
PEER_TIMEOUT_S = 10.0      # for the agent's answer to a ping: only a busy machine waits long
JOB_STOP_S = 5.0           # for the emulator to stop its training job at the end
POLL_S = 0.05
TAIL_LINES = 15

T = TypeVar("T")


@dataclasses.dataclass
class _Child:
    proc: subprocess.Popen
    log: pathlib.Path
    lasting: bool                         # meant to run until the stack stops it
    reader: threading.Thread | None = None  # passes a shown process's output on


class Stack:
    """The processes of one rig, in `workdir` (made if need be; a temporary folder, removed at
    the end, when none is given); `say` hears what each stage is doing. Use as a context
    manager."""

    def __init__(self, workdir: str | os.PathLike | None = None, *,
                 say: Callable[[str], None] | None = None, ready_s: float = READY_S,
                 stop_s: float = STOP_S):
        self._own_dir = workdir is None
        self.workdir = pathlib.Path(tempfile.mkdtemp(prefix="ptb-stack-") if workdir is None
                                    else workdir).resolve()
        try:
            self.workdir.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise CommandFailed(f"cannot make {self.workdir}: {e.strerror or e}") from None
        self.say = say or (lambda text: None)
        self.ready_s = ready_s
        self.stop_s = stop_s
        self._rig: rigfile.Rig | None = None     # `rig`, once the emulator has written it
        self.rig_path = self.workdir / "rig.toml"
        self.control = ""                  # the emulator's control endpoint
        self.journal = self.workdir / "journal.db"
        self.started: dict[str, float] = {}    # stage -> seconds from launch to ready
        self._children: dict[str, _Child] = {}
        self._handlers: dict[int, Any] = {}
        self._closed = False

    def __enter__(self) -> Stack:
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGHUP):
                self._handlers[sig] = signal.signal(sig, _exit_on_signal)
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- the stages ----------------------------------------------------------------------

    def emulate(self, rig: str, *options: str) -> rigfile.Rig:
        """`ptb emulate --rig RIG OPTIONS`; ready once its rig file and endpoints are written
        (each written whole: a temporary file renamed)."""
        endpoints = self.workdir / "emulator.json"
        for stale in (self.rig_path, endpoints):
            stale.unlink(missing_ok=True)      # a folder used before: wait for this run's
        self._stage("emulator", f"the emulated rig {rig}", "emulate", "--rig", rig, *options,
                    "--write-rig", str(self.rig_path), "--endpoints", str(endpoints),
                    ready=lambda: self.rig_path.exists() and endpoints.exists())
        loaded = self._rig = self._load_rig()
        self.control = json.loads(endpoints.read_text())["control"]
        devices, gpus = list(loaded.devices), loaded.gpus
        switches = sorted({g.switch for g in gpus})
        self.say(f"emulated rig {rig}: {_few(devices, 'devices')} on their wires"
                 + (f"; {len(gpus)} GPUs ({sum(g.spare for g in gpus)} spares) on "
                    f"{_few(switches, 'switches')}" if gpus else ""))
        return loaded

    def calibrate(self, *options: str) -> rigfile.Rig:
        """`ptb calibrate` of the emulated chip through the rig's instruments, its progress
        passed on; the calibration file (`calibration.json`) is then named in the rig file, so
        that the chip's service drives the chip with it."""
        rig = self._need_rig("calibrate")
        if rig.chip is None:
            raise CommandFailed(f"rig {rig.name} has no chip to calibrate")
        out = self.workdir / "calibration.json"
        self.say("calibrating the chip (ptb calibrate: fringes, crosstalk, refinement; its "
                 "progress follows)")
        t = time.monotonic()
        proc = self.ptb("calibrate", "calibrate", "--rig", str(self.rig_path), "--out",
                        str(out), *options, show=True, lasting=False)
        self.wait("the calibration", lambda: proc.poll() is not None, CALIBRATE_S,
                  log="calibrate")
        reader = self._children["calibrate"].reader
        if reader is not None:
            reader.join(self.stop_s)               # its last lines said
        if proc.returncode != 0:
            raise CommandFailed(f"the calibration failed (exit {proc.returncode}); "
                                f"{self._log_end('calibrate')}")
        self.started["calibration"] = time.monotonic() - t
        chip = dataclasses.replace(rig.chip, calibration=str(out))
        rigfile.write(self.rig_path, dataclasses.replace(rig, chip=chip))
        calibrated = self._rig = self._load_rig()
        self.say(f"calibration written to {out}")
        return calibrated

    def serve(self, *options: str) -> dict[str, Any]:
        """`ptb serve` of every device of the rig file; ready once every service is bound
        (its endpoints file written). The services' endpoints, by device."""
        self._need_rig("serve")
        served = self.workdir / "services.json"
        served.unlink(missing_ok=True)
        self._stage("services", "the device services", "serve", "--rig", str(self.rig_path),
                    "--endpoints", str(served), *options, ready=served.exists)
        services = json.loads(served.read_text())
        self.say(f"bus services up: {', '.join(services)}")
        return services

    def agent(self, *options: str) -> None:
        """`ptb agent` with its journal in the stack's folder; ready once it answers a ping."""
        from photonic_testbed.hil.bus.client import BusError, ServiceClient
        rig = self._need_rig("agent")
        with ServiceClient(rig.agent_endpoints()[0], timeout=PEER_TIMEOUT_S,
                           keys=rig.client_keys()) as agent:
            def answers() -> Any:
                try:
                    return agent.call("ping", timeout=PEER_TIMEOUT_S / 2)
                except BusError:
                    return None
            self._stage("agent", "the agent", "agent", "--rig", str(self.rig_path),
                        "--journal", str(self.journal), *options, ready=answers)
        self.say(f"agent up, journal {self.journal}")

    def etcd(self, members: int = 3) -> str:
        """`ptb etcd` (a local etcd cluster, its data in the stack's folder); ready once every
        member is healthy. The --journal URL of the rig's agent group on it."""
        rig = self._need_rig("etcd")
        written = self.workdir / "etcd.json"
        written.unlink(missing_ok=True)
        self._stage("etcd", f"an etcd cluster of {members}", "etcd", "--members",
                    str(members), "--dir", str(self.workdir / "etcd"), "--group", rig.name,
                    "--endpoints", str(written), ready=written.exists)
        url = str(json.loads(written.read_text())["journal"])
        self.say(f"etcd up: {url}")
        return url

    def replicas(self, journal: str, *options: str, group: str | None = None
                 ) -> dict[str, Any]:
        """`ptb agent --journal JOURNAL --replica NAME` for each of the rig's [replicas] (as
        processes `agent-NAME`), or of agent group `group`'s (on its own journal: JOURNAL's
        members, the group's name); ready once one leads. What the leader key says of it."""
        from photonic_testbed.hil.agent.etcd_journal import parse_url
        from photonic_testbed.hil.agent.leadership import group_prefix
        from photonic_testbed.hil.etcd.client import Etcd, EtcdError
        rig = self._need_rig("replicas")
        if group is not None:
            rig = rig.group_view(group)
        if not rig.replicas:
            raise CommandFailed(f"rig {rig.name} names no [replicas] of the agent")
        members, named = parse_url(journal)
        group = group or named
        journal = f"etcd://{members}/{group}"
        etcd = Etcd(members, timeout=2.0)
        for name in rig.replicas:
            self.start_replica(name, journal, *options)

        def leads() -> Any:
            """The leader key's word, once the replica it names answers as the leader."""
            from photonic_testbed.hil.bus.client import BusError, ServiceClient
            try:
                kv = etcd.get(group_prefix(group) + "leader")
            except EtcdError:
                return None
            if kv is None:
                return None
            leader = json.loads(kv.value)
            with ServiceClient(leader["request"], timeout=PEER_TIMEOUT_S,
                               keys=rig.client_keys()) as c:
                try:
                    state = c.call("snapshot", timeout=1.0)["state"]
                except BusError:
                    return None
            return leader if state.get("role") == "leader" else None
        t = time.monotonic()
        leader = self.wait("a replica of the agent leading", leads)
        self.started["replicas"] = time.monotonic() - t
        of = f" of group {group}" if rig.group else ""
        self.say(f"agent replicas{of} up: {leader['name']} leads (term {leader['term']}), "
                 f"{', '.join(n for n in rig.replicas if n != leader['name'])} stand by")
        return dict(leader)

    def start_replica(self, name: str, journal: str, *options: str) -> subprocess.Popen:
        """One replica of the agent (process `agent-NAME`), not waited for."""
        return self.ptb(f"agent-{name}", "agent", "--rig", str(self.rig_path), "--journal",
                        journal, "--replica", name, *options)

    def job(self, *arguments: str, name: str = "job") -> subprocess.Popen:
        """The PyTorch job's controller (`python -m photonic_testbed.hil.job.torch_job launch
        ARGUMENTS`): it starts its ranks and standbys itself; its events tell when it is up."""
        self.say(f"starting the PyTorch job (torch_job launch; its log: {name}.log)")
        return self.start(name, [sys.executable, "-m", "photonic_testbed.hil.job.torch_job",
                                 "launch", *arguments])

    # ---- any process ---------------------------------------------------------------------

    def ptb(self, name: str, *arguments: str, show: bool = False,
            lasting: bool = True) -> subprocess.Popen:
        """`ptb ARGUMENTS` as the stack's process `name` (see `start`)."""
        return self.start(name, [sys.executable, "-m", "photonic_testbed.ptb", *arguments],
                          show=show, lasting=lasting)

    def start(self, name: str, argv: list[str], *, show: bool = False,
              lasting: bool = True) -> subprocess.Popen:
        """Start `argv` in the stack's folder, in a process group of its own, its output in
        `<name>.log` (and, with `show`, passed on to `say` line by line). A `lasting` process
        is meant to run until the stack stops it: `check` and every wait fail once it stops.
        A name is free again once its process has ended."""
        if self._closed:
            raise CommandFailed(f"cannot start {name}: the stack is stopped")
        old = self._children.get(name)
        if old is not None and old.proc.poll() is None:
            raise ValueError(f"{name} is running already")
        self._children.pop(name, None)
        log_path = self.workdir / f"{name}.log"
        try:
            log = open(log_path, "w")
        except OSError as e:
            raise CommandFailed(f"cannot write {log_path}: {e.strerror or e}") from None
        env = dict(os.environ, PYTHONUNBUFFERED="1") if show else None
        try:
            proc = subprocess.Popen(argv, stdout=subprocess.PIPE if show else log,
                                    stderr=subprocess.STDOUT, cwd=self.workdir, env=env,
                                    process_group=0, text=show)
        except OSError as e:
            log.close()
            raise CommandFailed(f"cannot start {name} ({argv[0]}): {e.strerror or e}") from None
        child = _Child(proc, log_path, lasting)
        if show:
            child.reader = threading.Thread(target=self._pass_on, args=(name, proc, log),
                                            name=f"stack-{name}", daemon=True)
            child.reader.start()
        else:
            log.close()                      # the child has its own copy
        self._children[name] = child
        return proc

    @property
    def processes(self) -> dict[str, subprocess.Popen]:
        return {name: child.proc for name, child in self._children.items()}

    def wait(self, what: str, cond: Callable[[], T | None], timeout: float | None = None, *,
             log: str | None = None) -> T:
        """Poll `cond` until it gives a true value (returned), checking meanwhile that every
        lasting process still runs; at most `timeout` s (the stack's `ready_s` by default).
        Running out names `what`, and the end of the log of `log` (the newest process, by
        default)."""
        timeout = self.ready_s if timeout is None else timeout
        deadline = time.monotonic() + timeout
        while True:
            self.check()
            got = cond()
            if got:
                return got
            if time.monotonic() > deadline:
                name = log or next(reversed(self._children), None)
                raise CommandFailed(f"{what} did not happen within {timeout:g} s"
                                    + (f"; {self._log_end(name)}" if name else ""))
            time.sleep(POLL_S)

    def check(self) -> None:
        """A lasting process that stopped: CommandFailed naming it, with the end of its log."""
        for name, child in self._children.items():
            code = child.proc.poll()
            if child.lasting and code is not None:
                raise CommandFailed(f"{name} stopped (exit {code}); {self._log_end(name)}")

    def tail(self, name: str, lines: int = TAIL_LINES) -> str:
        """The last lines of a process's log ("" before it wrote any)."""
        child = self._children.get(name)
        path = child.log if child is not None else self.workdir / f"{name}.log"
        text = path.read_text(errors="replace") if path.exists() else ""
        return "\n".join(text.splitlines()[-lines:])

    def stop(self, name: str, timeout: float | None = None) -> int:
        """Stop one process (SIGTERM, then its group killed after `timeout` s, the stack's
        `stop_s` by default); its exit code (negative: the signal that ended it)."""
        child = self._children[name]
        child.lasting = False               # its end is no failure of the stack's
        _stop([child], self.stop_s if timeout is None else timeout)
        return child.proc.returncode

    def kill(self, name: str) -> None:
        """kill -9 one process and its group (a fault the stack itself injects: not a failure
        of the stack); its name is free again for `start`."""
        child = self._children[name]
        child.lasting = False
        with contextlib.suppress(ProcessLookupError):
            os.killpg(child.proc.pid, signal.SIGKILL)
        child.proc.wait()

    def close(self) -> None:
        """Stop every process (newest first), then free the folder if the stack made it."""
        if self._closed:
            return
        self._closed = True
        try:
            self._stop_emulated_job()
            _stop(list(reversed(self._children.values())), self.stop_s)
        finally:
            for sig, handler in self._handlers.items():
                signal.signal(sig, handler)
            self._handlers.clear()
            if self._own_dir:
                shutil.rmtree(self.workdir, ignore_errors=True)

    # ---- inside --------------------------------------------------------------------------

    def _stage(self, key: str, what: str, command: str, *arguments: str,
               ready: Callable[[], Any]) -> None:
        self.say(f"starting {what} (ptb {command}; its log: {command}.log)")
        t = time.monotonic()
        self.ptb(command, command, *arguments)
        self.wait(what, ready, log=command)
        self.started[key] = time.monotonic() - t

    def _stop_emulated_job(self) -> None:
        """The emulator's training job first, while the agent still answers its phase
        requests: stopped after the agent, the emulator waits out the request in flight."""
        emulator = self._children.get("emulate")
        if not self.control or emulator is None or emulator.proc.poll() is not None:
            return
        from photonic_testbed.hil.lab.control_client import ControlError, request
        with contextlib.suppress(ControlError):
            request(self.control, {"cmd": "job_stop"}, timeout_s=JOB_STOP_S)

    @property
    def rig(self) -> rigfile.Rig:
        """The rig as its rig file says, once `emulate` has written it."""
        return self._need_rig("the stack")

    def _need_rig(self, stage: str) -> rigfile.Rig:
        if self._rig is None:
            raise CommandFailed(f"{stage} needs the rig: start the emulator first")
        return self._rig

    def _load_rig(self) -> rigfile.Rig:
        try:
            return rigfile.load(self.rig_path)
        except rigfile.RigFileError as e:
            raise CommandFailed(f"the rig file the emulator wrote does not load: {e}") from None

    def _log_end(self, name: str) -> str:
        said = self.tail(name)
        where = self.workdir / f"{name}.log"
        return f"its log ({where}) ends:\n{said}" if said else f"its log ({where}) is empty"

    def _pass_on(self, name: str, proc: subprocess.Popen, log: IO[str]) -> None:
        with log:
            assert proc.stdout is not None
            for line in proc.stdout:
                log.write(line)
                log.flush()
                if line.strip():
                    self.say(f"  {name}: {line.rstrip()}")


def _stop(children: list[_Child], timeout: float) -> None:
    """SIGTERM to each process still running, a shared `timeout` for all of them to end, then
    SIGKILL to what is left of each one's group (its own children included), whatever
    interrupts the wait (a second Ctrl-C)."""
    for child in children:
        if child.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                child.proc.terminate()
    deadline = time.monotonic() + timeout
    try:
        for child in children:
            with contextlib.suppress(subprocess.TimeoutExpired):
                child.proc.wait(max(0.1, deadline - time.monotonic()))
    finally:
        for child in children:
            # the group outlives its leader while a member lives; an empty one is gone
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(child.proc.pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                child.proc.wait(5)
            if child.reader is not None:
                child.reader.join(5)


def _few(names: list[str], what: str, most: int = 8) -> str:
    """The names, or how many there are when they are too many to read."""
    return ", ".join(names) if len(names) <= most else f"{len(names)} {what}"


def _exit_on_signal(signum: int, frame: FrameType | None) -> None:
    raise SystemExit(128 + signum)      # unwinds through the stack's close()
