"""The emulated rack inside the emulator process: GPUs on the rig's switch, their health on
the bus, faults and truth on the control endpoint, and the training job.

- The rack's GPUs sit on the chip's ports (`lumion`) or the OCS's rail ports (`opus`) as
  `common.rack_layout` says; a link's state comes from that switch's physics (`transfer`).
- A GPU health monitor publishes on the bus as the state of the device `gpus` (a
  `Server`): `{"gpus": {name: GpuHealth.to_dict()}}`, one delta whenever a GPU's state
  changes: the same values an NVML monitor on a real host publishes. Its request socket answers
  `rx_power` `{"switch": s, "ports": [p, ...]}` -> `{"dbm": {"p": dBm}}`: the received power
  that each transceiver on those output ports reports (DDM, as real optics do): what the agent
  reads to verify circuits.
- The control endpoint gets the rack's handlers (`fail_gpu`, `fail_transceiver`, `cut_fibre`,
  `rack_truth`, `health`, ...) and the job's (`job_start`, `job_status`, `job_stop`).
- The job (`emulator.job.TrainingJob`, wall clock) talks to the agent through
  `hil.job.fabric_client.Fabric` only: each phase round waits for `fabric.phase(...)`, failures
  go to `fabric.failure(...)`, restart orders come back from the agent's published state.
"""
from __future__ import annotations

import collections
import logging
import os
import pathlib
import random
import signal
import threading
import time
from dataclasses import dataclass
from typing import Any

import zmq

from photonic_testbed.common.jobplan import JobPlan, PlanError, dp_ring, dp_tp
from photonic_testbed.common.rack_layout import RackLayout
from photonic_testbed.emulator.clock import WallClock
from photonic_testbed.emulator.control import ControlError, ControlServer, Peer
from photonic_testbed.emulator.job import JobEvent, TrainingJob
from photonic_testbed.emulator.job_gray import JobTimings
from photonic_testbed.emulator.link_fade import LinkFaults
from photonic_testbed.emulator.rack import DARK_DBM, EmulatedRack, RackError
from photonic_testbed.emulator.slowdown import SlowdownError, Slowdowns
from photonic_testbed.hil.bus import schema
from photonic_testbed.hil.bus.client import BusError
from photonic_testbed.hil.bus.security import ClientKeys, ServerKeys
from photonic_testbed.hil.bus.server import Server
from photonic_testbed.hil.bus.state import Set
from photonic_testbed.hil.job.fabric_client import Fabric

log = logging.getLogger(__name__)

HEALTH_PERIOD_S = 0.01        # how often the monitor looks at the GPUs (flapping ones change
                               # by themselves); a fault injected wakes it at once
JOB_EVENTS_KEPT = 500         # job events job_status returns
STATUS_STEPS = 500            # steps job_status returns (at most ~50 steps/s: ~10 s of them)


def _process_start(pid: int) -> str | None:
    """The process's start time (field 22 of /proc/PID/stat): with the pid, its identity (a
    pid may be reused); None if no such process (or no /proc to tell)."""
    try:
        stat = pathlib.Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]


@dataclass(frozen=True)
class _Status:
    """What /proc/PID/status says of a process (or a thread: its Tgid is then another)."""
    tgid: int
    uid: int        # real
    ppid: int


def _status(pid: int) -> _Status | None:
    """/proc/PID/status's Tgid, Uid and PPid; None where there is no such process or thread."""
    try:
        fields = dict(line.split(":", 1) for line in
                      pathlib.Path(f"/proc/{pid}/status").read_text().splitlines() if ":" in line)
        return _Status(int(fields["Tgid"]), int(fields["Uid"].split()[0]), int(fields["PPid"]))
    except (OSError, KeyError, ValueError, IndexError):
        return None


def _ancestors() -> set[int]:
    """This process's parent, its parent's parent, ... (a shell, a supervisor, a test runner:
    never a GPU's process)."""
    out: set[int] = set()
    pid = os.getppid()
    while pid > 1 and pid not in out:
        out.add(pid)
        got = _status(pid)
        if got is None:
            break
        pid = got.ppid
    return out


def _why_not_killable(pid: int) -> str | None:
    """Why `fail_gpu` must never SIGKILL `pid` (None: it may): this emulator, a thread rather
    than a process, another user's process, or one this emulator runs under."""
    if pid == os.getpid():
        return f"process {pid} is this emulator"
    got = _status(pid)
    if got is None:
        return f"no process {pid}"
    if got.tgid != pid:
        return f"{pid} is a thread of process {got.tgid}, not a process"
    if got.uid != os.getuid():
        return f"process {pid} belongs to another user (uid {got.uid})"
    if pid in _ancestors():
        return f"process {pid} runs this emulator (its parent or an ancestor), not a job on a GPU"
    return None


def plan_named(name: str, world: int) -> JobPlan:
    """Built-in job plans: `dp` (one all-reduce ring) and `dp-tp` (TP pairs, then DP rings).
    Step time is about 20 ms of compute + the transfers at 400 Gb/s."""
    if name == "dp":
        return dp_ring(world, bytes=5e8, compute_s=0.01)
    if name == "dp-tp":
        return dp_tp(world, tp=2, tp_bytes=2e8, dp_bytes=5e8, compute_s=0.005)
    raise PlanError(f"no built-in job plan {name!r}; known: dp, dp-tp")


class RackHost:
    """The rack, its health monitor on the bus, and the job, for one emulated rig."""

    def __init__(self, layout: RackLayout, physics: dict[str, Any], *,
                 gpus_endpoints: tuple[str, str], agent_endpoints: tuple[str, str] | None = None,
                 heartbeat: float = 0.5, keys: ServerKeys | None = None,
                 job_keys: ClientKeys | None = None):
        self.layout = layout
        self.clock = WallClock()
        self.rack = EmulatedRack(layout, physics, self.clock)
        self.agent_endpoints = agent_endpoints
        # the received powers' spread, read to read (DDM), dB; 0: what the optics give exactly
        self.ddm_noise_db = 0.0
        self._ddm_rng = random.Random(0xDD)
        # every replica of a replicated agent (the rig's [replicas]): the job finds the leader
        self.agent_replicas: dict[str, tuple[str, str]] | None = None
        self.job_keys = job_keys              # the job's key on a bus with CURVE (a tenant's)
        self._offset = time.time() - time.monotonic()     # monotonic -> Unix time
        self.server = Server("gpus", {"gpus": {h.gpu: h.to_dict()
                                                    for h in self.rack.health()}},
                                  request=gpus_endpoints[0], publish=gpus_endpoints[1],
                                  heartbeat=heartbeat, handlers={"rx_power": self._rx_power},
                                  kind="gpu_monitor", keys=keys)
        self.endpoints: tuple[str, str] | None = None
        self.job: TrainingJob | None = None
        self.fabric: Fabric | None = None
        self.timings: JobTimings | None = None      # the job's step timings, to the agent
        self._reporter: tuple[threading.Event, threading.Thread] | None = None   # while reporting
        self.slowdowns: Slowdowns | None = None     # (with the control endpoint's handlers)
        self.job_events: collections.deque[dict] = collections.deque(maxlen=JOB_EVENTS_KEPT)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()            # one job start at a time
        self._events_lock = threading.Lock()
        self._wake_r, self._wake_w = os.pipe()   # a fault was injected: look now
        os.set_blocking(self._wake_w, False)
        self._wake_lock = threading.Lock()       # no write to the pipe while it is closed

    # --- lifecycle --------------------------------------------------------------------------
    def start(self) -> tuple[str, str]:
        self.endpoints = self.server.bind()
        self._thread = threading.Thread(target=self._monitor, name="gpu-health", daemon=True)
        self._thread.start()
        log.info("GPU health of rack %s on %s", self.layout.name, self.endpoints[1])
        return self.endpoints

    def close(self) -> None:
        self._stop_job()
        if self.slowdowns is not None:
            self.slowdowns.close()          # no process left stopped
        self._stop.set()
        stopped = True
        if self._thread is not None:
            self._thread.join(timeout=2.0)
            stopped = not self._thread.is_alive()
            self._thread = None
        self.server.close()
        self.rack.close()
        if stopped:         # else the monitor may still poll the pipe: leave it to the OS
            with self._wake_lock:
                fds, self._wake_r, self._wake_w = (self._wake_r, self._wake_w), -1, -1
            for fd in fds:
                if fd >= 0:
                    os.close(fd)

    def _monitor(self) -> None:
        """Health monitor loop: publish every GPU whose state changed; answer rx_power."""
        poller = zmq.Poller()
        poller.register(self.server.router, zmq.POLLIN)
        poller.register(self._wake_r, zmq.POLLIN)
        while not self._stop.is_set():
            ready = dict(poller.poll(round(HEALTH_PERIOD_S * 1e3)))
            if self._wake_r in ready:
                os.read(self._wake_r, 4096)
            self.server.poll(0)
            changed = self.rack.poll()
            if changed:
                self.server.change([Set(["gpus", h.gpu], h.to_dict()) for h in changed])

    def _wake(self) -> None:
        with self._wake_lock:
            if self._wake_w < 0:
                return
            try:
                os.write(self._wake_w, b"!")
            except BlockingIOError:             # already full of wake-ups
                pass

    def _rx_power(self, args: schema.RxPower) -> dict:
        switch, ports = args.switch, args.ports      # checked: a name, port numbers
        if switch not in self.layout.switches:
            raise RackError(f"rx_power takes a switch of {sorted(self.layout.switches)}, not "
                            f"{switch!r}")
        got = self.rack.port_powers_dbm(switch, ports)
        if self.ddm_noise_db > 0:       # a transceiver's report varies a little, read to read
            spread = self.ddm_noise_db
            got = {p: v if v <= DARK_DBM else round(v + self._ddm_rng.gauss(0, spread), 2)
                   for p, v in got.items()}
        return {"dbm": {str(p): v for p, v in got.items()}}

    # --- control endpoint -------------------------------------------------------------------
    def register(self, control: ControlServer) -> None:
        for name, fn in self.rack.control_handlers().items():
            # the optical bench already offers `truth` (of the instruments): the rack's links
            # are `rack_truth`; both names answer for rigs whose bench has no truth of its own
            wrapped = self._kwargs(fn)
            control.register("rack_truth" if name == "truth" else name, wrapped)
            if name == "truth" and "truth" not in control.handlers:
                control.register("truth", wrapped)
        self._register_processes(control)
        control.register("job_start", self._job_start)
        control.register("job_status", lambda req: self.job_status())
        control.register("job_stop", lambda req: self._stop_job())

    # --- processes on the GPUs (a GPU that falls off the bus takes its process down) -------
    def _register_processes(self, control: ControlServer) -> None:
        """`register_process` {gpu, pid}: that process runs on that GPU; `fail_gpu` then
        SIGKILLs it, as a GPU falling off the bus ends the process using it. A process registers
        itself, nothing else: the request must come from that pid (the kernel names the sender
        on the endpoint's Unix socket), so no process can aim `fail_gpu` at another."""
        self._processes: dict[str, list[tuple[int, str]]] = {}
        self._processes_lock = threading.Lock()
        fail, clear = control.handlers["fail_gpu"], control.handlers["clear_faults"]
        slow = self.slowdowns = Slowdowns(lambda: self.layout.gpus, self._live_pids)

        def fail_and_kill(req: dict) -> Any:
            got = fail(req)
            slow.end(str(req.get("gpu")))
            self._slow_job()
            killed = self._kill_processes(str(req.get("gpu")))
            return {**got, "killed": killed} if isinstance(got, dict) else got

        def slow_gpu(req: dict) -> dict:
            args = {k: v for k, v in req.items() if k != "cmd"}
            try:
                got = slow.slow(**args)
            except SlowdownError as e:
                raise ControlError(str(e)) from None
            self._slow_job()
            return got

        def clear_all(req: dict) -> Any:
            slow.close()
            self._slow_job()
            return clear(req)
        control.register("fail_gpu", fail_and_kill)
        control.register("slow_gpu", slow_gpu)
        control.register("slowdowns", lambda req: slow.active())
        control.register("clear_faults", clear_all)
        LinkFaults(self.rack).register(control, clear_all)
        control.register_with_peer("register_process", self._register_process)

    def _slowed(self) -> dict[str, float]:
        """GPU -> how many times slower it runs (`slow_gpu`), for the emulated job."""
        return {g: float(c["factor"]) for g, c in self.slowdowns.active().items()} \
            if self.slowdowns is not None else {}

    def _slow_job(self) -> None:
        """The emulated job's GPUs run as slow as `slow_gpu` says (its own processes, if any,
        are paced by the Slowdowns)."""
        job = self.job
        if job is not None:
            job.slowdown = self._slowed()

    def _live_pids(self, gpu: str) -> list[int]:
        """The processes registered on `gpu` that are still the ones registered."""
        with self._processes_lock:
            return [p for p, s in self._processes.get(gpu, ()) if _process_start(p) == s]

    def _register_process(self, req: dict, peer: Peer | None) -> dict:
        gpu, pid = req.get("gpu"), req.get("pid")
        if gpu not in self.layout.gpus:
            raise ControlError(f"no GPU {gpu!r} in rack {self.layout.name!r}")
        if isinstance(pid, bool) or not isinstance(pid, int) or pid <= 1:
            raise ControlError(f"pid must be another process's id, not {pid!r}")
        why = _why_not_killable(pid)
        if why is not None:
            raise ControlError(why)
        if peer is None:
            raise ControlError("register_process is taken from the process itself over the "
                               "control endpoint's ipc:// socket, which names the sender; this "
                               "request's sender is not known")
        if peer.pid != pid:
            raise ControlError(f"process {peer.pid} asked to register process {pid}: a process "
                               "registers itself only")
        if peer.uid != os.getuid():
            raise ControlError(f"process {pid} runs as another user (uid {peer.uid})")
        started = _process_start(pid)
        if started is None:
            raise ControlError(f"no process {pid}")
        with self._processes_lock:
            live = [(p, s) for p, s in self._processes.get(gpu, ()) if _process_start(p) == s]
            self._processes[gpu] = live + [(pid, started)]
            return {"gpu": gpu, "pids": [p for p, _ in self._processes[gpu]]}

    def _kill_processes(self, gpu: str) -> list[int]:
        """SIGKILL the processes registered on `gpu` that are still the ones registered (a
        reused pid is left alone) and still may be killed (looked at again now)."""
        with self._processes_lock:
            procs = self._processes.pop(gpu, [])
        killed = []
        for pid, started in procs:
            if _process_start(pid) != started:
                continue
            why = _why_not_killable(pid)
            if why is not None:
                log.warning("GPU %s failed: its process %d is not killed: %s", gpu, pid, why)
                continue
            try:
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)
            except ProcessLookupError:
                pass
        if killed:
            log.info("GPU %s failed: killed its process(es) %s", gpu, killed)
        return killed

    def _kwargs(self, fn):
        def handler(req: dict) -> Any:
            args = {k: v for k, v in req.items() if k != "cmd"}
            try:
                return fn(**args)
            except RackError as e:
                raise ControlError(str(e)) from None
            finally:
                self._wake()        # the monitor reports what changed without waiting
        return handler

    # --- the job ----------------------------------------------------------------------------
    def _job_start(self, req: dict) -> dict:
        return self.start_job(req.get("plan", "dp"), int(req.get("steps", 1000)),
                              checkpoint_every=int(req.get("checkpoint_every", 10)),
                              restart_s=float(req.get("restart_s", 0.2)))

    def start_job(self, plan: str | dict, steps: int, *, checkpoint_every: int = 10,
                  restart_s: float = 0.2) -> dict:
        if self.agent_endpoints is None:
            raise ControlError("this rack has no agent to run a job with")
        if steps < 1 or checkpoint_every < 1 or not restart_s >= 0:
            raise ControlError(f"steps and checkpoint_every are at least 1 and restart_s at "
                               f"least 0, not {steps}, {checkpoint_every}, {restart_s}")
        with self._lock:
            if self.job is not None and self.job.state in ("running", "failed", "restarting"):
                raise ControlError(f"a job is already {self.job.state}")
            self._stop_job()
            try:
                job_plan = (JobPlan.from_dict(plan, max_world=len(self.layout.workers))
                            if isinstance(plan, dict)
                            else plan_named(str(plan), len(self.layout.workers)))
            except PlanError as e:
                raise ControlError(str(e)) from None
            fabric = Fabric(*self.agent_endpoints, timeout=5.0, keys=self.job_keys,
                            replicas=self.agent_replicas)
            try:
                rank_map = fabric.admit(job_plan)
            except BusError as e:
                fabric.close()
                raise ControlError(f"the agent did not admit the job: {e}") from None
            job = TrainingJob(job_plan, rank_map, self.rack, self.clock,
                              checkpoint_every=checkpoint_every, restart_s=restart_s,
                              grant_timeout_s=5.0, link_timeout_s=2.0, restart_timeout_s=30.0)
            self.job_events = collections.deque(maxlen=JOB_EVENTS_KEPT)
            job.subscribe(lambda ev: self._on_event(ev, job, fabric))
            timings = self.timings = JobTimings(job, fabric)
            job.subscribe(timings.on_event)
            fabric.on_restart = lambda rmap, cause: job.restart(
                rmap, cause, planned=timings.planned(rmap))
            job.slowdown = self._slowed()
            self.job, self.fabric = job, fabric
            job.start(steps)
            self._start_reporter(job, fabric)
            timings.start()
        return {"plan": job_plan.name, "rank_map": {str(r): g for r, g in rank_map.items()},
                "steps": steps}

    def _on_event(self, ev: JobEvent, job: TrainingJob, fabric: Fabric) -> None:
        """The job's thread: phases go to the agent (and wait for the circuits), failures
        are reported; everything but phases is kept for job_status."""
        if ev.kind == "phase":
            try:
                fabric.phase(ev.phase, ev.round)
            except BusError as e:
                log.warning("phase %s/%d not granted: %s", ev.phase, ev.round, e)
                return
            job.grant(ev.phase, ev.round)
            return
        if ev.kind == "released":          # the next round's circuits go up meanwhile
            fabric.done(ev.phase, ev.round)
            return
        if ev.kind == "failure":
            try:
                fabric.failure(ev.details.get("reason", ""), ev.details.get("gpus", ()),
                               ev.details.get("links", ()))
            except BusError as e:
                log.warning("failure not reported to the agent: %s", e)
        with self._events_lock:
            self.job_events.append({"kind": ev.kind, "t": ev.t + self._offset, "step": ev.step,
                                    "details": dict(ev.details)})

    def job_status(self) -> dict:
        """The job's state, its running totals, its restart records (the job's own, bounded),
        its last steps ([step, world, t_start, t_end]) and events; times in Unix seconds."""
        job = self.job
        if job is None:
            return {"state": "none"}
        with self._events_lock:
            events = list(self.job_events)
        records = list(job.records)[-STATUS_STEPS:]        # list(): one atomic copy
        return {"state": job.state, "step": job.step, "restarts": job.restarts,
                "steps_done": job.steps_done,
                "rank_map": {str(r): g for r, g in job.rank_map.items()},
                "restart_records": [r.to_dict(self._offset) for r in list(job.restart_records)],
                "steps": [[r.step, r.world, r.t_start + self._offset, r.t_end + self._offset]
                          for r in records],
                "down_communications": job.down_communications,
                "slow_communications": job.slow_communications,
                "events": events}

    def _stop_job(self) -> dict:
        job, fabric = self.job, self.fabric
        if fabric is not None:
            fabric.cancel()          # the job's calls give up: an agent gone answers none
        if self.timings is not None:
            self.timings.close()
        if job is not None:
            job.close()
        self._stop_reporter()
        if fabric is not None:
            fabric.close()
        self.fabric = None
        return {"state": job.state if job is not None else "none"}

    # --- the job's own reports (the GUI's job view) ---------------------------------------
    def _start_reporter(self, job: TrainingJob, fabric: Fabric, period_s: float = 0.5,
                        window_s: float = 2.0) -> None:
        """The job tells the agent how it is doing (`Fabric.report`, which the agent
        publishes under `jobs.NAME.report`): every `period_s`, and at once when its state
        changes (a failure, a restart). Throughput: steps a second over the last `window_s`
        (redone steps after a restart count again, as the job does them)."""
        states = {"running": "running", "failed": "failed", "restarting": "restarting",
                  "stopped": "stopped", "done": "done", "aborted": "failed"}
        stop = threading.Event()

        def detail(state: str) -> str:
            if job.state == "aborted":
                return "aborted: no restart order came"
            if state in ("failed", "restarting"):
                with self._events_lock:
                    last = next((e for e in reversed(self.job_events)
                                 if e["kind"] in ("failure", "restarted")), None)
                if last is not None:
                    return str(last["details"].get("reason") or last["details"].get("cause")
                               or "")
            return f"{job.restarts} restart(s)" if job.restarts else ""

        def run() -> None:
            seen: list[tuple[float, int]] = []      # (time, step) over the window
            sent_state, sent_at = None, -1e9
            restarts = job.restarts
            while True:
                stopping = stop.wait(0.05)
                state = states.get(job.state)
                now = time.monotonic()
                if job.restarts != restarts and state == "running" and sent_state == "running":
                    # it failed and restarted between two looks (a busy machine can keep this
                    # thread away longer than a restart takes): the stop is said all the same
                    try:
                        fabric.report("restarting", job.step, 0.0, None, detail("restarting"))
                        sent_state = "restarting"
                    except BusError as e:
                        log.debug("job report not delivered: %s", e)
                restarts = job.restarts
                if seen and job.step < seen[-1][1]:
                    seen.clear()                    # restarted from its checkpoint
                seen.append((now, job.step))
                while now - seen[0][0] > window_s:
                    seen.pop(0)
                final = state in ("stopped", "done") or job.state == "aborted"
                due = state != sent_state or now - sent_at >= period_s
                if state is not None and due and not (final and state == sent_state):
                    span = now - seen[0][0]
                    rate = max(0, seen[-1][1] - seen[0][1]) / span if span > 0.2 else None
                    if state != "running":
                        rate = 0.0 if state != "done" else rate
                    try:
                        fabric.report(state, job.step, rate, None, detail(state))
                    except BusError as e:       # the agent is down: said again next period
                        log.debug("job report not delivered: %s", e)
                    sent_state, sent_at = state, time.monotonic()
                if stopping or (final and state == sent_state):
                    return

        thread = threading.Thread(target=run, name="job-report", daemon=True)
        self._reporter = (stop, thread)
        thread.start()

    def _stop_reporter(self) -> None:
        """Stop the reports (after the last one, of the state the job ended in)."""
        got = self._reporter
        if got is not None:
            stop, thread = got
            stop.set()
            thread.join(timeout=10.0)
            self._reporter = None
