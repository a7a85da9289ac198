"""The PyTorch job's controller and its records, without torch (hil.job.worker has the ranks).

The controller is the job's part that no GPU failure takes down (torchrun's agent plays this
role for torchrun): it hosts the job's store, admits the plan with the agent, starts one
process per GPU of the rank map and a warm standby per spare, and turns each restart order of
the agent into a *generation* of the job on its store (`gen/<g>` = the rank map, `gen/latest`).
A rank process that dies is reported to the agent (`Fabric.failure`); the GPU's failure seen by
its health monitor usually got there first. Without a rig (`--standalone`), the controller
orders the swaps itself: a lost rank's place goes to the first warm standby; with none left the
job shrinks where its plan allows, or stops.

Every process writes its events, one JSON object a line, to `<workdir>/events/`; the
controller's are in `controller.jsonl`. `read_events` and `swap_timeline` read them back.

    python -m photonic_testbed.hil.job.torch_job launch --workdir DIR --rig RIG.toml --control EP
    python -m photonic_testbed.hil.job.torch_job launch --workdir DIR --standalone --world 4
    python -m photonic_testbed.hil.job.torch_job launch ... --torchrun --checkpoint-every 10

Exit codes: 0 the job completed its steps; 3 it stopped cleanly (the message says why); 1 an
error of the controller.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import pathlib
import queue
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from photonic_testbed.common import nesting
from photonic_testbed.common.jobplan import JobPlan, PlanError, dp_ring, dp_tp
from photonic_testbed.hil.job.handover import Handovers
from photonic_testbed.hil.lab import control_client
from photonic_testbed.hil.lab.control_client import ControlError, ControlTimeout

log = logging.getLogger(__name__)

POLL_S = 0.005
READ_S = 0.02               # the ranks' event files are read this often
STANDBY_STARTS = 3          # a GPU whose standby failed to start this often gets no more
DONE, STOPPED, SWAPPED_OUT, LOST_STATE = 0, 3, 4, 5      # the rank processes' exit codes
PLANS = ("dp", "dp-tp")


class JobSpecError(ValueError):
    """The job's description is unusable, or a rank cannot take part (no rank map...)."""


def plan_named(name: str, world: int) -> JobPlan:
    """`dp`: one data-parallel ring over every rank (may shrink); `dp-tp`: tensor-parallel
    pairs inside data-parallel rings of world/2 (cannot shrink)."""
    if name == "dp":
        return dp_ring(world, name="torch-dp")
    if name == "dp-tp":
        return dp_tp(world, tp=2, name="torch-dp-tp")
    raise PlanError(f"no plan {name!r} for the torch job; known: {', '.join(PLANS)}")


@dataclass
class JobSpec:
    """What every process of the job is told (written to `<workdir>/job.json`)."""
    plan: dict
    workdir: str
    steps: int = 200
    batch: int = 8                   # sequences per data-parallel rank per step
    block: int = 64                  # characters per sequence
    width: int = 128
    layers: int = 2
    heads: int = 4
    lr: float = 3e-3
    seed: int = 0
    store: tuple[str, int] = ("127.0.0.1", 0)
    rig: str | None = None           # rig file: the agent's endpoints and keys
    control: str | None = None       # emulator control endpoint: register PIDs, audit links
    audit: bool = False
    restart_timeout_s: float = 30.0
    collective_timeout_s: float = 120.0
    agent_timeout_s: float = 10.0
    checkpoint_every: int = 10       # torchrun baseline only

    def __post_init__(self) -> None:
        for name in ("steps", "batch", "block", "width", "layers", "heads", "checkpoint_every"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise JobSpecError(f"{name} must be a whole number >= 1, not {v!r}")
        for name in ("lr", "restart_timeout_s", "collective_timeout_s", "agent_timeout_s"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or not v > 0:
                raise JobSpecError(f"{name} must be > 0, not {v!r}")
        try:
            JobPlan.from_dict(self.plan)
        except PlanError as e:
            raise JobSpecError(str(e)) from None
        self.store = (str(self.store[0]), int(self.store[1]))

    @property
    def out_dir(self) -> str:
        return self.workdir

    def events_path(self, gpu: str, pid: int) -> pathlib.Path:
        return pathlib.Path(self.workdir) / "events" / f"{gpu}-{pid}.jsonl"

    def save(self, path: str | os.PathLike) -> None:
        tmp = pathlib.Path(str(path) + ".tmp")
        tmp.write_text(json.dumps(dataclasses.asdict(self), indent=1))
        os.replace(tmp, path)

    @classmethod
    def load(cls, path: str | os.PathLike) -> JobSpec:
        try:
            d = nesting.loads_json(pathlib.Path(path).read_text(encoding="utf-8"), str(path))
            return cls(**d)
        except (OSError, ValueError, TypeError) as e:       # (a NestingError is a ValueError)
            raise JobSpecError(f"cannot read the job spec {path}: {e}") from None


class EventLog:
    """One JSON object a line, each flushed as written (a process killed -9 loses nothing it
    wrote)."""

    def __init__(self, path: str | os.PathLike, **fixed: Any):
        path = pathlib.Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        self._f = open(path, "a", buffering=1, encoding="utf-8")
        self.fixed = fixed
        self._lock = threading.Lock()

    def write(self, kind: str, **fields: Any) -> None:
        line = json.dumps({"t": time.time(), "kind": kind, **self.fixed, **fields})
        with self._lock:
            self._f.write(line + "\n")

    def close(self) -> None:
        self._f.close()


def read_events(workdir: str | os.PathLike) -> list[dict]:
    """Every event of the job's processes and controller, in time order (a line cut short by a
    kill is skipped)."""
    out = []
    for path in sorted((pathlib.Path(workdir) / "events").glob("*.jsonl")):
        for line in path.read_text(encoding="utf-8").splitlines():
            try:
                out.append(json.loads(line))
            except ValueError:
                continue
    return sorted(out, key=lambda e: e["t"])


class EventTail:
    """The job's event files read from where the last read left them: a read costs what was
    written since (a line still being written is left for the next)."""

    def __init__(self, folder: pathlib.Path):
        self.folder = folder
        self._offsets: dict[pathlib.Path, int] = {}

    def new(self) -> list[dict]:
        out = []
        for path in sorted(self.folder.glob("*.jsonl")):
            at = self._offsets.get(path, 0)
            try:
                with open(path, "rb") as f:
                    f.seek(at)
                    chunk = f.read()
            except OSError:
                continue
            whole = chunk[:chunk.rfind(b"\n") + 1]
            self._offsets[path] = at + len(whole)
            for line in whole.decode("utf-8", "replace").splitlines():
                try:
                    out.append(json.loads(line))
                except ValueError:
                    continue
        return out


class Progress:
    """What the job is doing, on the launcher's standard output while it runs: a line when rank
    processes come up, at each new generation (a swap), and every `every_s` the step, the loss
    (mean over the ranks' latest) and the steps a second. It reads the processes' event files
    from where it left them, so a line costs what was written since the last."""

    def __init__(self, workdir: pathlib.Path, every_s: float, clock=time.monotonic):
        self.tail = EventTail(workdir / "events")
        self.every_s = every_s
        self.clock = clock
        self.also: list = []          # more readers of the new events (Handovers.absorb)
        self._read = float("-inf")
        self._loss: dict[int, float] = {}        # rank -> its latest step's loss
        self._ready: set[str] = set()
        self.step = 0
        self._last: tuple[float, int] | None = None   # (when the last line was, the step then)
        self.started = clock()

    def tick(self, say=print) -> None:
        if self.every_s <= 0 and not self.also:
            return                  # (nobody reads the events)
        now = self.clock()
        if now - self._read < READ_S:
            return
        self._read = now
        self._absorb(say)
        if self.every_s <= 0:
            return
        now = self.clock()
        if self._last is None:
            if self._loss:
                say(f"torch job: first step done {now - self.started:.0f} s after the start",
                    flush=True)
                self._last = (now, self.step)
            return
        t0, step0 = self._last
        if now - t0 >= self.every_s and self._loss:      # (none yet under a new rank map)
            self._line(now, t0, step0, say)

    def _absorb(self, say) -> None:
        fresh = self.tail.new()
        for f in self.also:
            f(fresh)
        if self.every_s <= 0:
            return
        for e in fresh:
            if e["kind"] == "step":
                self.step = max(self.step, int(e["step"]))
                self._loss[int(e["rank"])] = float(e["loss"])
            elif e["kind"] == "ready" and e.get("gpu") not in self._ready:
                self._ready.add(e.get("gpu", "?"))
                say(f"torch job: process on {e.get('gpu', '?')} ready "
                    f"({len(self._ready)} up, {self.clock() - self.started:.0f} s)", flush=True)

    def _line(self, now: float, t0: float, step0: int, say) -> None:
        rate = (self.step - step0) / (now - t0) if now > t0 else 0.0
        loss = sum(self._loss.values()) / len(self._loss)
        say(f"torch job: step {self.step}, loss {loss:.3f}, {rate:.1f} steps/s on "
            f"{len(self._loss)} ranks", flush=True)
        self._last = (now, self.step)

    def final(self, what: str = "", say=print) -> None:
        """The last lines: where the job got to, and (`what`) how it ended."""
        self._absorb(say)
        if self.every_s <= 0:
            return
        if self._loss and self._last is not None:
            self._line(self.clock(), *self._last, say)
        if what:
            say(f"torch job: {what}", flush=True)

    def order(self, gen: int, rank_map: dict[int, str], cause: str, say=print) -> None:
        if self.every_s > 0:
            self._loss.clear()                   # ranks are counted again under the new map
            say(f"torch job: generation {gen}, ranks on {', '.join(rank_map.values())} "
                f"({cause})", flush=True)


def emulator_request(endpoint: str, msg: dict, timeout_s: float = 5.0) -> Any:
    """One request on the emulator's control endpoint (hil.lab.control_client); the result, or
    JobSpecError with the emulator's refusal."""
    try:
        return control_client.request(endpoint, msg, timeout_s)
    except ControlTimeout as e:
        raise JobSpecError(f"the emulator did not answer: {e}") from None
    except ControlError as e:
        raise JobSpecError(f"the emulator refused {msg.get('cmd')!r}: {e}") from None


# --- the controller -------------------------------------------------------------------------
@dataclass
class Options:
    standalone: bool = False         # no rig: the controller orders the swaps itself
    standbys: int = 2                # warm standby processes (standalone: spare0..)
    torchrun: bool = False           # the restart-all baseline
    max_restarts: int = 100
    progress_s: float = 5.0          # a line of progress this often on stdout (0: none)
    python: str = sys.executable
    extra_env: dict = field(default_factory=dict)


class Controller:
    def __init__(self, spec: JobSpec, options: Options):
        self.spec = spec
        self.opt = options
        self.plan = JobPlan.from_dict(spec.plan)
        self.workdir = pathlib.Path(spec.workdir)
        self.events = EventLog(self.workdir / "events" / "controller.jsonl", role="controller")
        self.procs: dict[str, subprocess.Popen] = {}     # GPU -> its live process
        self.rank_map: dict[int, str] = {}
        self.gen = -1
        self.done: set[str] = set()
        self.lost: list[str] = []
        self.lost_at: float | None = None
        self.failed_starts: dict[str, int] = {}
        self.orders: queue.Queue = queue.Queue()
        self.fabric: Any = None             # the job's Fabric client, once admitted
        self.agent_state: Any = None        # a SubscriberThread on the agent's state
        self.stopped: str | None = None
        self.interrupted = threading.Event()   # SIGTERM/SIGINT: stop the job cleanly
        self.progress = Progress(self.workdir, options.progress_s)
        self.lock = threading.Lock()
        self.handovers: Handovers | None = None     # with the agent: planned swaps
        self._logs: list = []

    # --- generations ------------------------------------------------------------------------
    def _publish(self, rank_map: dict[int, str], cause: str) -> None:
        self.gen += 1
        self.rank_map = dict(rank_map)
        self.store.set(f"gen/{self.gen}", json.dumps(
            {"rank_map": {str(r): g for r, g in rank_map.items()}, "cause": cause}))
        self.store.set("gen/latest", str(self.gen))
        if self.gen:                # the last generation's hold watchers end (no hold: -1)
            self.store.set(f"pg{self.gen - 1}/hold", "-1")
        self.events.write("order", gen=self.gen, cause=cause,
                          rank_map={str(r): g for r, g in rank_map.items()})
        log.info("generation %d: %s (%s)", self.gen, rank_map, cause)
        self.progress.order(self.gen, rank_map, cause)
        if self.handovers is not None:
            self.handovers.ordered(self.gen, rank_map)

    def _publish_stop(self, reason: str) -> None:
        self.gen += 1
        self.store.set(f"gen/{self.gen}", json.dumps({"stop": reason}))
        self.store.set("gen/latest", str(self.gen))

    # --- processes --------------------------------------------------------------------------
    def _spawn(self, gpu: str, why: str) -> None:
        cmd = [self.opt.python, "-m", "photonic_testbed.hil.job.worker", "worker",
               "--job", str(self.workdir / "job.json"), "--gpu", gpu]
        err = open(self.workdir / "logs" / f"{gpu}-{len(self._logs)}.log", "w")
        self._logs.append(err)
        env = dict(os.environ, **self.opt.extra_env)
        proc = subprocess.Popen(cmd, stdout=err, stderr=subprocess.STDOUT, env=env,
                                cwd=self.workdir)
        self.procs[gpu] = proc
        self.events.write("spawned", gpu=gpu, pid=proc.pid, why=why)

    def _standby_gpus(self) -> list[str]:
        """Where warm standbys should run: standalone, spare0..; with the agent, its healthy
        GPUs that hold no rank, its spares first."""
        if self.opt.standalone:
            return [f"spare{i}" for i in range(self.opt.standbys)]
        state = self.agent_state.states().get("agent", {}) if self.agent_state else {}
        may = set(state.get("spares") or ())     # (not one held out: swapped out for slowness)
        free = [g for g in state.get("rack", ())
                if g.get("rank") is None and g.get("health") == "ok" and g.get("name") in may]
        free.sort(key=lambda g: g.get("role") != "spare")
        return [g["name"] for g in free][:self.opt.standbys]

    def warm_standbys(self) -> list[str]:
        """The GPUs where a standby process runs now and has said it is ready (no rank: its
        model built, ready to take one)."""
        ranked = set(self.rank_map.values())
        ready = self.handovers.ready if self.handovers is not None else set()
        return [g for g, p in list(self.procs.items())
                if g not in ranked and p.poll() is None and p.pid in ready]

    def _ensure(self) -> None:
        for gpu in self.rank_map.values():
            if gpu not in self.procs and gpu not in self.done and gpu not in self.lost:
                self._spawn(gpu, "rank without a process (cold start)")
        for gpu in self._standby_gpus():
            if gpu not in self.procs and gpu not in self.rank_map.values() \
                    and self.failed_starts.get(gpu, 0) < STANDBY_STARTS:
                self._spawn(gpu, "warm standby")

    def _reap(self) -> None:
        for gpu, proc in list(self.procs.items()):
            code = proc.poll()
            if code is None:
                continue
            del self.procs[gpu]
            ranked = gpu in self.rank_map.values()
            self.events.write("exit", gpu=gpu, pid=proc.pid, code=code, rank=ranked)
            if not ranked:
                if code > 0:        # it failed by itself (a signal is its GPU's failure)
                    self.failed_starts[gpu] = self.failed_starts.get(gpu, 0) + 1
                    log.warning("the standby on %s exited (%s); see logs/%s-*.log", gpu, code,
                                gpu)
                continue
            if code == DONE:
                self.done.add(gpu)
            elif code in (STOPPED, LOST_STATE):
                self.stopped = self.stopped or f"the rank on {gpu} stopped the job (exit " \
                    f"{code}; its reason is in its events)"
            elif code != SWAPPED_OUT:
                self._lost(gpu, code)

    def _lost(self, gpu: str, code: int) -> None:
        self.lost.append(gpu)
        self.lost_at = self.lost_at or time.monotonic()
        rank = next(r for r, g in self.rank_map.items() if g == gpu)
        reason = f"rank {rank} on {gpu} lost (exit {code})"
        self.events.write("lost", gpu=gpu, rank=rank, code=code)
        log.warning("%s", reason)
        if self.fabric is not None:
            from photonic_testbed.hil.bus.client import BusError

            def report():
                try:
                    self.fabric.failure(reason, gpus=[gpu])
                except BusError as e:        # the health monitor's report remains
                    log.warning("could not report %s to the agent: %s", gpu, e)
            threading.Thread(target=report, name="report-failure", daemon=True).start()

    def _standalone_orders(self) -> None:
        """Without an agent: each lost rank's place to a live standby, else shrink or stop."""
        if not self.lost:
            return
        new = dict(self.rank_map)
        free = [g for g in self._standby_gpus() if g in self.procs]
        gone = []
        for gpu in self.lost:
            rank = next(r for r, g in new.items() if g == gpu)
            if free:
                new[rank] = free.pop(0)
            else:
                gone.append(gpu)
        if gone:
            keep = [g for _, g in sorted(new.items()) if g not in gone]
            if not self.plan.allows(len(keep)):
                self.stopped = (f"no standby left for {', '.join(gone)} and plan "
                                f"{self.plan.name!r} cannot run on {len(keep)} ranks")
                return
            new = dict(enumerate(keep))
        cause = f"lost {', '.join(self.lost)}"
        self.lost, self.lost_at = [], None
        self._publish(new, cause)

    def _agent_orders(self) -> None:
        while True:
            try:
                rank_map, cause = self.orders.get_nowait()
            except queue.Empty:
                return
            self._publish(rank_map, cause)
            self.lost = [g for g in self.lost if g in rank_map.values()]
            if not self.lost:
                self.lost_at = None

    def _alarms(self) -> list[str]:
        if self.agent_state is None:
            return []
        return list(self.agent_state.states().get("agent", {}).get("alarms", ()))

    # --- the run ----------------------------------------------------------------------------
    def run(self) -> int:
        from photonic_testbed.hil.job import worker  # torch: imported here only
        (self.workdir / "logs").mkdir(parents=True, exist_ok=True)
        self.store, port = worker.serve_store()
        self.spec.store = ("127.0.0.1", port)
        self.spec.save(self.workdir / "job.json")
        try:
            rank_map = self._admit()
            alarms_before = len(self._alarms())
            self._publish(rank_map, f"job {self.plan.name} admitted")
            if self.opt.torchrun:
                return self._run_torchrun()
            if self.fabric is not None:
                self.handovers = Handovers(self)
                self.progress.also.append(self.handovers.absorb)
                self.handovers.start()
            self._ensure()
            while True:
                self._reap()
                if self.opt.standalone:
                    self._standalone_orders()
                else:
                    self._agent_orders()
                if self.handovers is not None:
                    self.handovers.poll()
                if self.rank_map and all(g in self.done for g in self.rank_map.values()):
                    self._finish("job done")
                    self.events.write("done", gen=self.gen)
                    self.progress.final("done")
                    return DONE
                if self.lost_at is not None and \
                        time.monotonic() - self.lost_at > self.spec.restart_timeout_s:
                    alarms = self._alarms()[alarms_before:]
                    self.stopped = (f"{', '.join(self.lost)} lost and no restart order "
                                    f"within {self.spec.restart_timeout_s:g} s"
                                    + (f"; the agent's alarm: {alarms[-1]}" if alarms else ""))
                if self.interrupted.is_set():
                    self.stopped = self.stopped or "stopped by a signal to the controller"
                if self.stopped:
                    return self._stop(self.stopped)
                self._ensure()
                self.progress.tick()
                time.sleep(POLL_S)
        finally:
            self._close()

    def _admit(self) -> dict[int, str]:
        if self.opt.standalone:
            return {r: f"gpu{r}" for r in range(self.plan.world)}
        from photonic_testbed.hil import rig as rigfile
        from photonic_testbed.hil.bus.mirror import SubscriberThread
        from photonic_testbed.hil.job.fabric_client import Fabric
        if not self.spec.rig:
            raise JobSpecError("a job on the fabric needs the rig file (--rig)")
        rig = rigfile.load(self.spec.rig)
        self.agent_state = SubscriberThread({"agent": rig.agent_endpoints()},
                                            keys=rig.client_keys(), telemetry=False).start()
        fabric = self.fabric = Fabric(*rig.agent_endpoints(), keys=rig.client_keys(),
                                      timeout=self.spec.agent_timeout_s,
                                      on_restart=lambda m, cause: self.orders.put((m, cause)))
        return fabric.admit(self.plan)

    def _finish(self, reason: str) -> None:
        self._publish_stop(reason)
        deadline = time.monotonic() + 20.0
        while self.procs and time.monotonic() < deadline:
            self._reap()
            time.sleep(0.02)
        for proc in list(self.procs.values()):
            proc.kill()
            proc.wait(5)

    def _stop(self, reason: str) -> int:
        log.error("job stopped: %s", reason)
        self.progress.final()
        print(f"torch job stopped: {reason}", file=sys.stderr, flush=True)
        self.events.write("stopped", gen=self.gen, reason=reason)
        self._finish(reason)
        return STOPPED

    def _close(self) -> None:
        if self.handovers is not None:
            self.handovers.close()
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait(5)
        if self.fabric is not None:
            self.fabric.close()
        if self.agent_state is not None:
            self.agent_state.close()
        for f in self._logs:
            f.close()
        self.events.close()

    # --- the restart-all baseline -----------------------------------------------------------
    def _run_torchrun(self) -> int:
        """torchrun restarts every worker after a loss; each restart's workers wait for the
        order of that restart (generation = restart count)."""
        cmd = [self.opt.python, "-m", "torch.distributed.run", "--standalone", "--nnodes", "1",
               "--nproc-per-node", str(self.plan.world), "--max-restarts",
               str(self.opt.max_restarts), "--monitor-interval", "0.1",
               "-m", "photonic_testbed.hil.job.worker", "torchrun-worker",
               "--job", str(self.workdir / "job.json")]
        err = open(self.workdir / "logs" / "torchrun.log", "w")
        self._logs.append(err)
        proc = subprocess.Popen(cmd, stdout=err, stderr=subprocess.STDOUT, cwd=self.workdir,
                                env=dict(os.environ, **self.opt.extra_env))
        self.events.write("spawned", gpu="torchrun", pid=proc.pid, why="torchrun")
        if self.opt.standalone:
            # no agent: every restart runs on the same GPUs, ordered up front
            for _ in range(self.opt.max_restarts):
                self._publish(self.rank_map, "no agent: torchrun restarts on the same GPUs")
        try:
            while proc.poll() is None:
                if self.interrupted.is_set():
                    proc.terminate()         # torchrun stops its workers
                    proc.wait(30)
                    break
                if not self.opt.standalone:
                    self._agent_orders()
                time.sleep(0.02)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(5)
        code = proc.returncode
        self.events.write("done" if code == 0 else "stopped", gen=self.gen, code=code)
        return DONE if code == 0 else STOPPED


# --- reading a run back ---------------------------------------------------------------------
def losses(events: list[dict], t0: float = float("-inf"), t1: float = float("inf")
           ) -> list[float]:
    return [e["loss"] for e in events if e["kind"] == "step" and t0 <= e["t"] < t1]


def steps_per_s(events: list[dict], t0: float, t1: float) -> float:
    """Completed steps of the job per second in [t0, t1) (a step counts when its last rank
    completes it; a redone step counts again)."""
    last: dict[tuple[int, int], float] = {}
    for e in events:
        if e["kind"] == "step":
            key = (e["gen"], e["step"])
            last[key] = max(last.get(key, 0.0), e["t"])
    n = sum(1 for t in last.values() if t0 <= t < t1)
    return n / (t1 - t0) if t1 > t0 else 0.0


def swap_timeline(events: list[dict], t_fail: float, failed_gpu: str) -> dict[str, Any]:
    """What the job's processes did after the failure at `t_fail` of `failed_gpu`: the order
    (generation) that replaced it, when the survivors abandoned their collective, the new
    rank's groups, state transfer and first completed step. Times are Unix seconds (None when
    it did not happen)."""
    after = [e for e in events if e["t"] >= t_fail]
    order = next((e for e in after if e["kind"] == "order"
                  and failed_gpu not in e["rank_map"].values()), None)
    out: dict[str, Any] = {"order": order, "aborted": None, "rebuilt": None,
                           "transferred": None, "first_step": None, "spare": None}
    aborted = [e for e in after if e["kind"] == "aborted"]
    out["aborted"] = aborted[0]["t"] if aborted else None
    if order is None:
        return out
    g = order["gen"]
    old = next((e for e in reversed(events) if e["kind"] == "order" and e["gen"] < g), None)
    new_gpus = set(order["rank_map"].values()) - set(old["rank_map"].values() if old else ())
    out["spare"] = sorted(new_gpus)[0] if new_gpus else None
    who = out["spare"]
    mine = [e for e in after if e.get("gen") == g and (who is None or e.get("gpu") == who)]

    def first(kind):
        return next((e for e in mine if e["kind"] == kind), None)
    for kind in ("rebuilt", "transferred"):
        e = first(kind)
        out[kind] = e["t"] if e else None
    step = first("step")
    out["first_step"] = step["t"] if step else None
    out["first_step_no"] = step["step"] if step else None
    tr = first("transferred")
    out["bytes"] = tr["bytes_received"] if tr else 0
    out["target_step"] = tr["step"] if tr else None
    return out


# --- command line ---------------------------------------------------------------------------
def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--workdir", required=True, help="events, logs and results go here")
    p.add_argument("--rig", help="the rig file (the agent's endpoints): the job on the fabric")
    p.add_argument("--control", help="the emulator's control endpoint: rank processes register "
                   "their PID with their GPU (a failed GPU takes its process down)")
    p.add_argument("--standalone", action="store_true",
                   help="no agent: the controller orders the swaps itself (GPU labels only)")
    p.add_argument("--plan", default="dp", choices=PLANS)
    p.add_argument("--world", type=int, default=8)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--standbys", type=int, default=2, help="warm standby processes (default 2)")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--block", type=int, default=64)
    p.add_argument("--width", type=int, default=128)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--audit", action="store_true",
                   help="record the physics' state of each collective's links (emulator)")
    p.add_argument("--restart-timeout", type=float, default=30.0, metavar="S",
                   help="a lost rank with no restart order for S seconds stops the job")
    p.add_argument("--torchrun", action="store_true",
                   help="the baseline: torchrun restarts every worker from a checkpoint")
    p.add_argument("--checkpoint-every", type=int, default=10, metavar="K")
    p.add_argument("--max-restarts", type=int, default=100)
    p.add_argument("--progress", type=float, default=5.0, metavar="S",
                   help="print the step, loss and steps/s every S seconds, and each process "
                   "up and each new rank map as it comes (0: quiet; default %(default)g)")


def spec_from_args(args: argparse.Namespace) -> tuple[JobSpec, Options]:
    if not args.standalone and not args.rig:
        raise JobSpecError("give the rig (--rig FILE) or run --standalone")
    try:
        plan = plan_named(args.plan, args.world)
    except PlanError as e:
        raise JobSpecError(str(e)) from None
    spec = JobSpec(plan=plan.to_dict(), workdir=str(pathlib.Path(args.workdir).resolve()),
                   steps=args.steps, batch=args.batch, block=args.block, width=args.width,
                   layers=args.layers, lr=args.lr, seed=args.seed,
                   rig=str(pathlib.Path(args.rig).resolve()) if args.rig else None,
                   control=args.control, audit=args.audit,
                   restart_timeout_s=args.restart_timeout,
                   checkpoint_every=args.checkpoint_every)
    if args.standbys < 0 or args.max_restarts < 0 or args.progress < 0:
        raise JobSpecError("--standbys, --max-restarts and --progress cannot be negative")
    return spec, Options(standalone=args.standalone, standbys=args.standbys,
                         torchrun=args.torchrun, max_restarts=args.max_restarts,
                         progress_s=args.progress)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m photonic_testbed.hil.job.torch_job",
                                description="Run the PyTorch training job on the fabric.")
    sub = p.add_subparsers(dest="cmd", required=True)
    add_arguments(sub.add_parser("launch", help="start the job and keep it alive"))
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        spec, options = spec_from_args(args)
        pathlib.Path(spec.workdir).mkdir(parents=True, exist_ok=True)
        controller = Controller(spec, options)
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: controller.interrupted.set())
        return controller.run()
    except JobSpecError as e:
        print(f"torch job: {e}", file=sys.stderr)
        return STOPPED


if __name__ == "__main__":
    sys.exit(main())
