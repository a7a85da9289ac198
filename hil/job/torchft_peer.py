"""TorchFT, the in-place swap's software peer: the same training under TorchFT's per-step
quorum, where a replica that fails is restarted and takes the live state from a healthy peer.

With hil.job.model and hil.job.worker the only modules that import torch (and the only one that
imports torchft). It runs what the in-place job runs (hil.job.model: the character-level
transformer, its text, batch and Adam), data-parallel over N replica groups of one process each
(gloo on the CPU), so that `ptb bench swap` measures both recoveries on the same model, data and
failure. The in-place job needs the fabric for nothing here: TorchFT knows no circuits.

How TorchFT recovers (torchft 0.2's `Manager`): every step starts with a quorum, asked of the
lighthouse (run by the launcher on 127.0.0.1); the replicas in it rebuild their process group
when it changed, a replica behind the others' step receives their state from a healthy peer
(`PGTransport`: over the same gloo group, no checkpoint read), the gradients are averaged with
the manager's all-reduce, and the optimizer steps only where `should_commit` says every replica
group completed the step. A replica killed mid-step costs the survivors that step (not
committed: redone) and a wait until the lighthouse forms a quorum without it, which it does when
the dead replica's heartbeat times out, or when the survivors and the restarted replica have
waited for it for the join timeout. The launcher's lighthouse settings (`Options`) are tuned for
a job on one host, far below TorchFT's defaults, so that the comparison is with TorchFT at its
fastest, not with its defaults.

The launcher starts the lighthouse and N replica processes; each replica builds its model and
waits to be told its index, so that all of them join the first quorum together. It can kill a
replica (SIGKILL, as a GPU's failure takes its process down) when the job reaches the steps of
`--fail-at`, and restarts it at once: by default a warm process (torch imported, model built)
waiting beside the job, as the in-place job's standbys do; `--cold-restart` starts a new one.
Every process writes its events, one JSON object a line (torch_job.EventLog), to
`<workdir>/events/`; `recoveries` reads each failure back: failure -> first step completed by
the job and by the restarted replica, steps the job had completed and lost (none: the state
comes from a peer) and step attempts not committed. The launcher writes them with every
replica's final weights' digest to `<workdir>/summary.json`.

Loopback only (the lighthouse, stores, gloo and TorchFT's manager servers on 127.0.0.1: torchft
0.2 binds a manager server to every interface with no way to choose, so the peer gives it the
loopback address instead, `_manager_server_on_loopback`), every wait bounded: a dead
lighthouse or replica ends the run with a message, never a hang; a replica whose launcher is
gone exits.

    python -m photonic_testbed.hil.job.torchft_peer launch --workdir DIR --replicas 2 --steps 60
    python -m photonic_testbed.hil.job.torchft_peer launch ... --fail-at 20 40 --victim 1
    python -m photonic_testbed.hil.job.torchft_peer replica --spec DIR/peer.json   (the launcher's)

Exit codes: 0 the job completed its steps (and every failure asked for happened); 3 it stopped
(the message says why).
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import logging
import math
import os
import pathlib
import select
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from typing import IO, Any

import torch
import torch.nn.functional as F
import torchft.manager
from torch.distributed import TCPStore
from torchft import Manager, ProcessGroupGloo
from torchft.checkpointing.pg_transport import PGTransport

from photonic_testbed.common import nesting
from photonic_testbed.hil.job.model import (
    CharText,
    ModelConfig,
    build_model,
    digest,
    flatten,
    gradients,
    new_optimizer,
    unflatten_into,
)
from photonic_testbed.hil.job.torch_job import EventLog, EventTail, JobSpec

log = logging.getLogger(__name__)

DONE, STOPPED = 0, 3
HOST = "127.0.0.1"
POLL_S = 0.002              # the launcher's look at the events (it times the failures)
PARENT_CHECK_S = 0.5        # a replica looks this often whether its launcher is still there


class PeerError(RuntimeError):
    """The run cannot go on: a replica or the lighthouse is gone, a wait ran out, a bad spec."""


@dataclass
class PeerSpec:
    """What every replica is told (`<workdir>/peer.json`): the in-place job's model, data, batch
    and optimizer (their defaults are torch_job.JobSpec's), and TorchFT's timeouts."""
    workdir: str
    steps: int = JobSpec.steps
    batch: int = JobSpec.batch       # sequences per replica per step
    block: int = JobSpec.block
    width: int = JobSpec.width
    layers: int = JobSpec.layers
    heads: int = JobSpec.heads
    lr: float = JobSpec.lr
    seed: int = JobSpec.seed
    timeout_s: float = 30.0          # a collective, should_commit, the state's transfer
    quorum_timeout_s: float = 60.0   # a quorum's forming
    connect_timeout_s: float = 10.0  # to the lighthouse and the managers
    max_retries: int = 20            # steps in a row not committed before a replica gives up

    def __post_init__(self) -> None:
        for name in ("steps", "batch", "block", "width", "layers", "heads", "max_retries"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise PeerError(f"{name} must be a whole number >= 1, not {v!r}")
        for name in ("lr", "timeout_s", "quorum_timeout_s", "connect_timeout_s"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
                raise PeerError(f"{name} must be > 0, not {v!r}")

    def save(self, path: pathlib.Path) -> None:
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(dataclasses.asdict(self), indent=1))
        os.replace(tmp, path)

    @classmethod
    def load(cls, path: str | os.PathLike) -> PeerSpec:
        try:
            d = nesting.loads_json(pathlib.Path(path).read_text(encoding="utf-8"), str(path))
            return cls(**d)
        except (OSError, ValueError, TypeError) as e:
            raise PeerError(f"cannot read the spec {path}: {e}") from None


def replica_env() -> dict[str, str]:
    """A replica's environment: gloo on the loopback interface (Linux names it `lo`), TorchFT's
    Rust servers quiet but for warnings (each quorum is logged at INFO otherwise)."""
    env = dict(os.environ)
    if sys.platform.startswith("linux"):
        env.setdefault("GLOO_SOCKET_IFNAME", "lo")
    env.setdefault("RUST_LOG", "warn")
    return env


# --- a replica ------------------------------------------------------------------------------
class _Gloo(ProcessGroupGloo):
    """TorchFT's reconfigurable gloo group, noting the quorum it was last configured for (the
    job's generation, in the in-place job's words)."""

    def __init__(self, timeout: datetime.timedelta):
        super().__init__(timeout=timeout)
        self.quorum: int = -1

    def configure(self, store_addr: str, replica_id: str, rank: int, world_size: int,
                  quorum_id: int | None = None, group_rank: int | None = None,
                  group_world_size: int | None = None,
                  global_ranks: list[int] | None = None) -> None:
        super().configure(store_addr, replica_id, rank, world_size, quorum_id, group_rank,
                          group_world_size, global_ranks)
        self.quorum = -1 if quorum_id is None else int(quorum_id)


class Replica:
    """One replica group of one process. Built warm (torch imported, model and data ready, its
    group's store up), then told its index and the lighthouse on standard input (`replica I
    http://127.0.0.1:PORT`), then `go`."""

    def __init__(self, spec: PeerSpec, stdin: IO[str]):
        self.spec = spec
        self.stdin = stdin
        self.events = EventLog(pathlib.Path(spec.workdir) / "events" / f"peer-{os.getpid()}.jsonl",
                               pid=os.getpid())
        self.index = -1
        self.lighthouse = ""
        self._quorum_t = 0.0             # when the current step asked for its quorum

    def _line(self, expected: str) -> str:
        """The launcher's next word (it closes our standard input to stop us)."""
        line = self.stdin.readline()
        if not line:
            raise PeerError(f"the launcher closed standard input before {expected!r}")
        if not line.startswith(expected):
            raise PeerError(f"expected {expected!r} from the launcher, got {line.strip()!r}")
        return line.strip()

    def _setup(self) -> None:
        spec = self.spec
        torch.set_num_threads(1)
        self.data = CharText.shipped(spec.block, spec.seed)
        self.cfg = ModelConfig(self.data.vocab, spec.block, spec.width, spec.layers, spec.heads)
        self.model = build_model(self.cfg, 0, spec.seed)
        self.opt = new_optimizer(self.model, spec.lr)
        self.params = list(self.model.parameters())
        # The group's own store (TorchFT's Manager dials it; the group is this process alone).
        self.store = TCPStore(HOST, 0, None, True,
                              datetime.timedelta(seconds=spec.connect_timeout_s),
                              wait_for_workers=False)

    def _state(self) -> dict[str, Any]:
        return {"model": self.model.state_dict(), "opt": self.opt.tensors()}

    def _load(self, state: dict[str, Any]) -> None:
        """A healthy peer's state, received by TorchFT when this replica was behind."""
        self.model.load_state_dict(state["model"])
        with torch.no_grad():
            for t, got in zip(self.opt.tensors(), state["opt"], strict=True):
                t.copy_(got)
        self.events.write("healed", step=self.manager.current_step(),
                          seconds=time.time() - self._quorum_t)

    def _join(self) -> None:
        _manager_server_on_loopback()
        spec = self.spec
        timeout = datetime.timedelta(seconds=spec.timeout_s)
        self.pg = _Gloo(timeout)
        self.manager = Manager(
            pg=self.pg, load_state_dict=self._load, state_dict=self._state,
            min_replica_size=1,
            use_async_quorum=False,          # the quorum (and any healing) before the step: a
                                             # restarted replica's first step is a full one
            timeout=timeout,
            quorum_timeout=datetime.timedelta(seconds=spec.quorum_timeout_s),
            connect_timeout=datetime.timedelta(seconds=spec.connect_timeout_s),
            rank=0, world_size=1, store_addr=HOST, store_port=self.store.port,
            lighthouse_addr=self.lighthouse, replica_id=f"replica{self.index}", hostname=HOST,
            checkpoint_transport=PGTransport(self.pg, timeout=timeout,
                                             device=torch.device("cpu")),
            init_sync=False,                 # every replica draws the same weights from the seed
            max_retries=spec.max_retries)

    def _step(self, last_quorum: int) -> int:
        t0 = time.perf_counter()
        self._quorum_t = time.time()
        m = self.manager
        m.start_quorum()                     # raises when no quorum comes (lighthouse gone)
        q = self.pg.quorum
        step = m.current_step()
        dp_index = m.participating_rank()
        n = m.num_participants()
        if q != last_quorum:
            self.events.write("quorum", gen=q, step=step, participants=n, dp_index=dp_index,
                              seconds=time.perf_counter() - t0)
        x, y = self.data.batch(step, dp_index or 0, self.spec.batch)
        for p in self.params:
            p.grad = None
        logits = self.model(x)
        loss = F.cross_entropy(logits.reshape(-1, self.cfg.vocab), y.reshape(-1))
        loss.backward()
        grads = gradients(self.params)
        flat = flatten(grads)
        m.allreduce(flat).wait()             # the average over the quorum; errors go to m
        unflatten_into(flat, grads)
        if m.should_commit():
            self.opt.step()
            self.events.write("step", gen=q, rank=self.index, step=m.current_step(),
                              loss=round(loss.item(), 5), seconds=time.perf_counter() - t0,
                              participants=n)
        else:
            err = m.errored()
            self.events.write("discarded", gen=q, rank=self.index, step=step + 1,
                              reason=str(err).splitlines()[0][:200] if err else "not committed")
        return q

    def run(self) -> int:
        self.events.write("started")
        threading.Thread(target=_watch_parent, args=(os.getppid(), self.events),
                         name="parent", daemon=True).start()
        try:
            self._setup()
            self.events.write("ready")
            _, index, self.lighthouse = self._line("replica").split()
            self.index = int(index)
            self.events.fixed["replica"] = self.index
            self._join()
            self.events.write("joined")
            self._line("go")
            q = -1
            while self.manager.current_step() < self.spec.steps:
                q = self._step(q)
        except (PeerError, ValueError) as e:
            self.events.write("stopped", reason=str(e))
            print(f"torchft replica: {e}", file=sys.stderr)
            return STOPPED
        except Exception as e:               # TorchFT's (a quorum, a transfer): say which
            reason = f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
            self.events.write("stopped", reason=reason)
            print(f"torchft replica {self.index}: {reason}", file=sys.stderr)
            return STOPPED
        self.events.write("done", gen=self.pg.quorum, rank=self.index,
                          step=self.manager.current_step(),
                          digest=digest([p.data for p in self.params]))
        self.manager.shutdown(wait=False)
        return DONE


def _watch_parent(parent: int, events: EventLog) -> None:
    """Exit when the launcher is gone (its lighthouse with it: no quorum would ever come)."""
    while True:
        time.sleep(PARENT_CHECK_S)
        if os.getppid() != parent:
            events.write("stopped", reason="the launcher is gone")
            os._exit(STOPPED)


# --- the launcher ---------------------------------------------------------------------------
@dataclass
class Options:
    """The launcher's choices: how many replicas, which fails when, and the lighthouse."""
    replicas: int = 2
    fail_at: tuple[int, ...] = ()        # kill the victim when the job has completed these steps
    victim: int = 1
    cold_restart: bool = False           # a new process for the failed replica, not a warm one
    timeout_s: float = 600.0             # the whole run
    start_timeout_s: float = 300.0       # every replica imported, built and joined
    heartbeat_timeout_ms: int = 1000     # the lighthouse's: a replica silent this long is dead
    join_timeout_ms: int = 1000          # the lighthouse's wait for a heartbeating straggler
    quorum_tick_ms: int = 10
    python: str = sys.executable

    def __post_init__(self) -> None:
        if self.replicas < 1:
            raise PeerError("--replicas must be >= 1")
        if self.fail_at and not 0 <= self.victim < self.replicas:
            raise PeerError(f"--victim {self.victim} is not a replica (0..{self.replicas - 1})")
        if self.fail_at and self.replicas < 2:
            raise PeerError("a failure needs a second replica to recover from")
        if any(s < 1 for s in self.fail_at) or list(self.fail_at) != sorted(set(self.fail_at)):
            raise PeerError("--fail-at takes increasing steps >= 1")
        for name in ("timeout_s", "start_timeout_s", "heartbeat_timeout_ms", "join_timeout_ms",
                     "quorum_tick_ms"):
            if not getattr(self, name) > 0:
                raise PeerError(f"{name} must be > 0")


def _tail(path: str | os.PathLike, lines: int = 3) -> str:
    """A process's last words, from its log."""
    try:
        text = pathlib.Path(path).read_text(errors="replace").strip().splitlines()
    except OSError:
        return "no log"
    return " | ".join(text[-lines:]) or "its log is empty"


class _Proc:
    """A replica process: its Popen, its standard input (the launcher's words) and log."""

    def __init__(self, popen: subprocess.Popen, log_file: IO[str]):
        self.popen = popen
        self.log_file = log_file
        self.log_path = pathlib.Path(log_file.name)
        self.index: int | None = None
        self.killed = False

    @property
    def pid(self) -> int:
        return self.popen.pid

    def tell(self, line: str) -> None:
        assert self.popen.stdin is not None
        try:
            self.popen.stdin.write(line + "\n")
            self.popen.stdin.flush()
        except (BrokenPipeError, ValueError):
            raise PeerError(f"replica process {self.pid} is gone ({self.tail()})") from None

    def tail(self) -> str:
        return _tail(self.log_path)

    def close(self) -> None:
        if self.popen.poll() is None:
            self.popen.kill()
        try:
            self.popen.wait(10)
        except subprocess.TimeoutExpired:
            log.error("replica process %d did not exit after SIGKILL", self.pid)
        for pipe in (self.popen.stdin, self.popen.stdout):
            if pipe is not None:
                try:
                    pipe.close()
                except BrokenPipeError:
                    pass
        self.log_file.close()


class _Events:
    """The job's events read as they are written: each file from where it was left."""

    def __init__(self, folder: pathlib.Path):
        self.tail = EventTail(folder)
        self.all: list[dict] = []
        self.by_pid: dict[int, set[str]] = {}        # the kinds each process has written
        self.steps_by_pid: dict[int, int] = {}       # each process's latest completed step
        self.done: dict[int, dict] = {}
        self.stopped: dict[int, str] = {}

    def read(self) -> list[dict]:
        new = self.tail.new()
        for e in new:
            pid = e.get("pid")
            if pid is None:
                continue
            self.by_pid.setdefault(pid, set()).add(e["kind"])
            if e["kind"] == "step":
                self.steps_by_pid[pid] = max(self.steps_by_pid.get(pid, 0), e["step"])
            elif e["kind"] == "done":
                self.done[pid] = e
            elif e["kind"] == "stopped":
                self.stopped[pid] = e.get("reason", "")
        self.all += new
        return new

    def has(self, pid: int, kind: str) -> bool:
        return kind in self.by_pid.get(pid, ())

    def reached(self) -> int:
        return max(self.steps_by_pid.values(), default=0)


class Launcher:
    def __init__(self, spec: PeerSpec, options: Options):
        self.spec = spec
        self.opt = options
        self.workdir = pathlib.Path(spec.workdir)
        self.events = EventLog(self.workdir / "events" / "launcher.jsonl", role="launcher")
        self.seen = _Events(self.workdir / "events")
        self.procs: list[_Proc] = []
        self.active: dict[int, _Proc] = {}           # replica index -> its live process
        self.spare: _Proc | None = None
        self.interrupted = threading.Event()
        self._deadline = 0.0
        self._lighthouse: _Proc | None = None
        self.lighthouse = ""                         # its address

    # --- processes ------------------------------------------------------------------------
    def _spawn(self, why: str) -> _Proc:
        n = len(self.procs)
        log_file = open(self.workdir / "logs" / f"peer-{n}.log", "w")
        popen = subprocess.Popen(
            [self.opt.python, "-m", "photonic_testbed.hil.job.torchft_peer", "replica",
             "--spec", str(self.workdir / "peer.json")],
            stdin=subprocess.PIPE, stdout=log_file, stderr=subprocess.STDOUT, text=True,
            env=replica_env(), cwd=self.workdir)
        proc = _Proc(popen, log_file)
        self.procs.append(proc)
        self.events.write("spawned", peer=proc.pid, why=why)
        return proc

    def _assign(self, proc: _Proc, index: int, go: bool) -> None:
        proc.index = index
        self.active[index] = proc
        assert self.lighthouse
        proc.tell(f"replica {index} {self.lighthouse}")
        if go:
            proc.tell("go")

    def _check(self, what: str) -> None:
        """Raise when the run cannot go on: a process of the job exited that was not killed
        on purpose, the deadline passed, or a signal asked the launcher to stop."""
        if self.interrupted.is_set():
            raise PeerError(f"stopped by a signal during {what}")
        if time.monotonic() > self._deadline:
            raise PeerError(f"{what}: the run's {self.opt.timeout_s:g} s are over")
        lh = self._lighthouse
        if lh is not None and lh.popen.poll() is not None:
            raise PeerError(f"the lighthouse (pid {lh.pid}) exited with code "
                            f"{lh.popen.returncode} during {what}: {lh.tail()}")
        for proc in [*self.active.values(), *([self.spare] if self.spare else [])]:
            code = proc.popen.poll()
            if code is None or (code == DONE and proc.pid in self.seen.done):
                continue
            who = f"replica {proc.index}" if proc.index is not None else "the warm replica"
            reason = self.seen.stopped.get(proc.pid) or proc.tail()
            raise PeerError(f"{who} (pid {proc.pid}) exited with code {code} during {what}: "
                            f"{reason}")

    def _wait(self, what: str, cond, timeout_s: float) -> None:
        limit = time.monotonic() + timeout_s
        while True:
            self.seen.read()
            if cond():
                return
            self._check(what)
            if time.monotonic() > limit:
                raise PeerError(f"{what} did not happen within {timeout_s:g} s")
            time.sleep(POLL_S)

    # --- the run --------------------------------------------------------------------------
    def _spawn_lighthouse(self) -> None:
        """The lighthouse, a process of its own (as TorchFT runs it), on 127.0.0.1."""
        opt = self.opt
        log_file = open(self.workdir / "logs" / "lighthouse.log", "w")
        popen = subprocess.Popen(
            [opt.python, "-m", "photonic_testbed.hil.job.torchft_peer", "lighthouse",
             "--heartbeat-timeout-ms", str(opt.heartbeat_timeout_ms),
             "--join-timeout-ms", str(opt.join_timeout_ms),
             "--quorum-tick-ms", str(opt.quorum_tick_ms)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log_file, text=True,
            env=replica_env(), cwd=self.workdir)
        self._lighthouse = _Proc(popen, log_file)

    def _lighthouse_address(self) -> None:
        """The lighthouse's first line: its address (it prints nothing else there)."""
        lh, opt = self._lighthouse, self.opt
        assert lh is not None
        out = lh.popen.stdout
        assert out is not None
        limit = time.monotonic() + min(opt.start_timeout_s, opt.timeout_s)
        while not select.select([out], [], [], 0.1)[0]:
            if lh.popen.poll() is not None or time.monotonic() > limit:
                raise PeerError(f"the lighthouse did not start: {lh.tail()}")
        address = out.readline().strip()
        if not address.startswith("http://"):
            raise PeerError(f"the lighthouse did not start: {lh.tail()}")
        self.lighthouse = address
        self.events.write("lighthouse", address=address, peer=lh.pid,
                          heartbeat_timeout_ms=opt.heartbeat_timeout_ms,
                          join_timeout_ms=opt.join_timeout_ms,
                          quorum_tick_ms=opt.quorum_tick_ms)

    def run(self) -> dict[str, Any]:
        self._deadline = time.monotonic() + self.opt.timeout_s
        try:
            self.spec.save(self.workdir / "peer.json")
            self._spawn_lighthouse()
            return self._run()
        finally:
            self._close()

    def _run(self) -> dict[str, Any]:
        opt = self.opt
        first = [self._spawn("replica") for _ in range(opt.replicas)]
        warm = bool(opt.fail_at) and not opt.cold_restart
        if warm:
            self.spare = self._spawn("warm replica")
        start = min(opt.start_timeout_s, opt.timeout_s)
        self._lighthouse_address()
        warm_too = [self.spare] if self.spare else []      # ready before the job starts, as
        self._wait("every replica ready", lambda: all(     # the in-place job's standbys
            self.seen.has(p.pid, "ready") for p in first + warm_too), start)
        for i, proc in enumerate(first):
            self._assign(proc, i, go=False)
        self._wait("every replica joined", lambda: all(
            self.seen.has(p.pid, "joined") for p in first), start)
        for proc in first:
            proc.tell("go")
        self.events.write("go", replicas=opt.replicas)
        pending = list(opt.fail_at)
        replacement: _Proc | None = None
        while True:
            self.seen.read()
            live = list(self.active.values())
            if all(p.pid in self.seen.done for p in live):
                break
            if pending and self._ready_to_fail(pending[0], replacement, warm):
                pending.pop(0)
                replacement = self._fail_and_restart(warm, spare_after=bool(pending))
            self._check("training")
            time.sleep(POLL_S)
        if pending:
            raise PeerError(f"the job completed its {self.spec.steps} steps before the failures "
                            f"at steps {pending}: give it more --steps")
        self.events.write("done", steps=self.spec.steps)
        return self.summary()

    def _ready_to_fail(self, at: int, replacement: _Proc | None, warm: bool) -> bool:
        """At the step asked, once the last restarted replica completed a step (recovered) and
        a warm one waits, if warm restarts are asked: one failure measured at a time."""
        victim = self.active[self.opt.victim]
        return (self.seen.reached() >= at
                and self.seen.has(victim.pid, "step")
                and (replacement is None or self.seen.has(replacement.pid, "step"))
                and (not warm or (self.spare is not None
                                  and self.seen.has(self.spare.pid, "ready"))))

    def _fail_and_restart(self, warm: bool, spare_after: bool) -> _Proc:
        i = self.opt.victim
        victim = self.active[i]
        reached = self.seen.reached()
        t = time.time()
        os.kill(victim.pid, signal.SIGKILL)
        victim.killed = True
        self.events.write("failure", replica=i, peer=victim.pid, step=reached, t_fail=t)
        victim.popen.wait(10)
        if warm:
            assert self.spare is not None
            proc, self.spare = self.spare, None
        else:
            proc = self._spawn("cold restart")
        self._assign(proc, i, go=True)
        self.events.write("restarted", replica=i, peer=proc.pid, warm=warm)
        if warm and spare_after:             # warm for the next failure
            self.spare = self._spawn("warm replica")
        return proc

    def summary(self) -> dict[str, Any]:
        done = {str(p.index): self.seen.done[p.pid]["digest"] for p in self.active.values()}
        return {"replicas": self.opt.replicas, "steps": self.spec.steps,
                "victim": self.opt.victim, "warm_restart": not self.opt.cold_restart,
                "lighthouse": {"heartbeat_timeout_ms": self.opt.heartbeat_timeout_ms,
                               "join_timeout_ms": self.opt.join_timeout_ms,
                               "quorum_tick_ms": self.opt.quorum_tick_ms},
                "digests": done, "digests_equal": len(set(done.values())) == 1,
                "recoveries": recoveries(self.seen.all)}

    def _close(self) -> None:
        for proc in self.procs:
            proc.close()
        if self._lighthouse is not None:
            self._lighthouse.close()
        self.events.close()


# --- reading a run back ---------------------------------------------------------------------
def recoveries(events: list[dict]) -> list[dict[str, Any]]:
    """Each failure of the run (the launcher's `failure` events, with the `restarted` that
    follows): seconds from the kill to the first step the job completed without the killed
    process (in a newer quorum) and to the restarted replica's first step; the steps the job
    had completed and lost (completed again after); the step attempts not committed between the
    failure and the restarted replica's first step (one for each replica that made one).
    Seconds are None where it did not happen."""
    events = sorted(events, key=lambda e: e["t"])
    out = []
    for f in (e for e in events if e["kind"] == "failure"):
        t = f["t_fail"]
        restarted = next((e for e in events if e["kind"] == "restarted" and e["t"] >= f["t"]),
                         None)
        new_pid = restarted["peer"] if restarted else None
        before = [e for e in events if e["kind"] == "step" and e["t"] <= t]
        reached = max((e["step"] for e in before), default=0)
        quorum = max((e["gen"] for e in before), default=-1)
        job = next((e for e in events if e["kind"] == "step" and e["t"] > t
                    and e["gen"] > quorum), None)
        mine = next((e for e in events if e["kind"] == "step" and e["t"] > t
                     and e.get("pid") == new_pid), None)
        healed = next((e for e in events if e["kind"] == "healed" and e["t"] > t
                       and e.get("pid") == new_pid), None)
        until = mine["t"] if mine else math.inf
        discarded = sum(1 for e in events if e["kind"] == "discarded" and t < e["t"] <= until)
        out.append({
            "replica": f["replica"], "t_fail": t, "reached": reached,
            "job_first_step_s": job["t"] - t if job else None,
            "replica_first_step_s": mine["t"] - t if mine else None,
            "first_step": job["step"] if job else None,
            "steps_lost": max(0, reached - (job["step"] - 1)) if job else None,
            "discarded": discarded,
            "healed_at_step": healed["step"] if healed else None,
            "heal_s": healed["seconds"] if healed else None,
        })
    return out


def _manager_server_on_loopback() -> None:
    """torchft 0.2's Manager makes its ManagerServer on `[::]:PORT` (every interface), with no
    argument to choose: the name it calls is bound here to one that listens on HOST alone."""
    made = torchft.manager.ManagerServer
    if getattr(made, "on_loopback", False):
        return

    def on_loopback(*, bind: str, **kwargs: Any) -> Any:
        return made(bind=f"{HOST}:{bind.rsplit(':', 1)[1]}", **kwargs)
    on_loopback.on_loopback = True          # type: ignore[attr-defined]
    torchft.manager.ManagerServer = on_loopback     # type: ignore[misc,assignment]


# --- command line ---------------------------------------------------------------------------
def lighthouse(heartbeat_timeout_ms: int, join_timeout_ms: int, quorum_tick_ms: int) -> int:
    """TorchFT's lighthouse on a free port of 127.0.0.1: its address on standard output, then
    served until standard input closes (the launcher ends, whichever way)."""
    from torchft.coordination import LighthouseServer
    server = LighthouseServer(bind=f"{HOST}:0", min_replicas=1,
                              join_timeout_ms=join_timeout_ms, quorum_tick_ms=quorum_tick_ms,
                              heartbeat_timeout_ms=heartbeat_timeout_ms)
    # address() names the host by its hostname: the loopback address is the one to dial
    port = int(server.address().rsplit(":", 1)[1])
    print(f"http://{HOST}:{port}", flush=True)
    sys.stdin.read()
    server.shutdown()
    return DONE


def add_arguments(p: argparse.ArgumentParser) -> None:
    spec, opt = PeerSpec, Options
    p.add_argument("--workdir", required=True, help="events, logs and the summary go here")
    p.add_argument("--replicas", type=int, default=opt.replicas,
                   help="replica groups of one process each (default %(default)s)")
    p.add_argument("--steps", type=int, default=spec.steps)
    p.add_argument("--batch", type=int, default=spec.batch)
    p.add_argument("--block", type=int, default=spec.block)
    p.add_argument("--width", type=int, default=spec.width)
    p.add_argument("--layers", type=int, default=spec.layers)
    p.add_argument("--lr", type=float, default=spec.lr)
    p.add_argument("--seed", type=int, default=spec.seed)
    p.add_argument("--fail-at", type=int, nargs="*", default=[], metavar="STEP",
                   help="kill the victim (SIGKILL) when the job has completed each of these "
                   "steps, and restart it")
    p.add_argument("--victim", type=int, default=opt.victim, help="the replica killed")
    p.add_argument("--cold-restart", action="store_true",
                   help="restart in a new process (default: a warm one, torch imported and "
                   "the model built, waits beside the job)")
    p.add_argument("--heartbeat-timeout-ms", type=int, default=opt.heartbeat_timeout_ms,
                   help="the lighthouse's: a replica silent this long is dead "
                   "(default %(default)s)")
    p.add_argument("--join-timeout-ms", type=int, default=opt.join_timeout_ms,
                   help="the lighthouse's wait for heartbeating stragglers (default "
                   "%(default)s)")
    p.add_argument("--quorum-tick-ms", type=int, default=opt.quorum_tick_ms)
    p.add_argument("--collective-timeout", type=float, default=spec.timeout_s, metavar="S",
                   help="TorchFT's timeout of a collective, commit or state transfer")
    p.add_argument("--connect-timeout", type=float, default=spec.connect_timeout_s, metavar="S")
    p.add_argument("--timeout", type=float, default=opt.timeout_s, metavar="S",
                   help="the whole run (default %(default)g)")


def from_args(args: argparse.Namespace) -> tuple[PeerSpec, Options]:
    spec = PeerSpec(workdir=str(pathlib.Path(args.workdir).resolve()),
                    steps=args.steps, batch=args.batch, block=args.block, width=args.width,
                    layers=args.layers, lr=args.lr, seed=args.seed,
                    timeout_s=args.collective_timeout, connect_timeout_s=args.connect_timeout)
    opt = Options(replicas=args.replicas, fail_at=tuple(args.fail_at), victim=args.victim,
                  cold_restart=args.cold_restart, timeout_s=args.timeout,
                  heartbeat_timeout_ms=args.heartbeat_timeout_ms,
                  join_timeout_ms=args.join_timeout_ms, quorum_tick_ms=args.quorum_tick_ms)
    return spec, opt


def _say(summary: dict[str, Any]) -> None:
    for r in summary["recoveries"]:
        def s(x):
            return "never" if x is None else f"{x:.3f} s"
        print(f"torchft peer: replica {r['replica']} killed at step {r['reached']}: the job's "
              f"first step after {s(r['job_first_step_s'])}, the restarted replica's after "
              f"{s(r['replica_first_step_s'])}; steps lost {r['steps_lost']}, attempts not "
              f"committed {r['discarded']}", flush=True)
    print(f"torchft peer: {summary['steps']} steps on {summary['replicas']} replicas; final "
          f"weights {'equal' if summary['digests_equal'] else 'DIFFERENT'} on every replica",
          flush=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m photonic_testbed.hil.job.torchft_peer",
                                description="The training job under TorchFT (the in-place "
                                "swap's software peer).")
    sub = p.add_subparsers(dest="cmd", required=True)
    add_arguments(sub.add_parser("launch", help="the lighthouse and the replicas, to the end"))
    r = sub.add_parser("replica", help="one replica (started by the launcher)")
    r.add_argument("--spec", required=True)
    h = sub.add_parser("lighthouse", help="TorchFT's lighthouse on 127.0.0.1 (started by the "
                       "launcher): prints its address, serves until standard input closes")
    for name in ("heartbeat_timeout_ms", "join_timeout_ms", "quorum_tick_ms"):
        h.add_argument("--" + name.replace("_", "-"), type=int,
                       default=getattr(Options, name))
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.cmd == "lighthouse":
        return lighthouse(args.heartbeat_timeout_ms, args.join_timeout_ms, args.quorum_tick_ms)
    if args.cmd == "replica":
        try:
            code = Replica(PeerSpec.load(args.spec), sys.stdin).run()
        except PeerError as e:
            print(f"torchft replica: {e}", file=sys.stderr)
            code = STOPPED
        sys.stdout.flush()
        sys.stderr.flush()
        # TorchFT's servers and gloo's threads may still be in a call: nothing left to write
        os._exit(code)
    try:
        spec, opt = from_args(args)
        for sub_dir in ("events", "logs"):
            (pathlib.Path(spec.workdir) / sub_dir).mkdir(parents=True, exist_ok=True)
        launcher = Launcher(spec, opt)
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: launcher.interrupted.set())
        summary = launcher.run()
    except PeerError as e:
        print(f"torchft peer stopped: {e}", file=sys.stderr, flush=True)
        return STOPPED
    out = pathlib.Path(spec.workdir) / "summary.json"
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text(json.dumps(summary, indent=1))
    os.replace(tmp, out)
    _say(summary)
    return DONE


if __name__ == "__main__":
    sys.exit(main())
