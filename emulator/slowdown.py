"""A GPU that goes slow without failing: the processes on it really run slower.

A fail-slow GPU (thermal or power throttling, a degraded HBM stack, a sick PCIe link) keeps
answering and computes at a fraction of its speed. The emulated rack has no GPU to throttle, so
the slowness is put on what runs on the GPU: the processes registered on it
(`register_process`) are paced with SIGSTOP and SIGCONT. For every second their busiest
thread was runnable (on a CPU, or waiting for one: the kernel's /proc/PID/task/*/schedstat)
they are then stopped for `factor - 1` seconds, so that their work takes `factor` times as long
whether the machine's CPUs are idle or shared with many (a process blocked waiting for its
peers is not runnable and is not paid for). The debt is paid in stops of `period_s` to
MAX_STOPS periods (a longer one would look like a failure, not slowness); time stopped beyond
the debt (a late wake-up of this thread) is credited. Where the kernel keeps no schedstat, the
processes are duty-cycled instead: run `period_s / factor` of every `period_s`. No cooperation
from the job's code is needed, and nothing in the job can tell this from a slow device but its
own timings (a rank's step against its peers').

    {"cmd": "slow_gpu", "gpu": "gpu3", "factor": 1.5}                 (period_s 0.02 by default)
    {"cmd": "slow_gpu", "gpu": "gpu3", "factor": 1}                   ends it
    {"cmd": "slowdowns"}                                              {"gpu3": {"factor": 1.5, ...}}

A stopped process is always continued: when its slowdown ends, when the GPU fails (its
processes are killed anyway), when the emulator closes, and when it dies without closing (a
watchdog process, started with the first slowdown, continues every process stopped so far once
the emulator's end of their pipe closes).
"""
from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Collection

log = logging.getLogger(__name__)

MAX_FACTOR = 10.0          # (a stop of MAX_STOPS periods after half a period's run: 11x)
MIN_PERIOD_S, MAX_PERIOD_S = 0.002, 10.0
MAX_STOPS = 5              # a stop lasts at most this many periods

# The watchdog: reads "PID START" lines (a process stopped at least once, and its start time,
# its identity); when the pipe closes it continues each one that is still that process.
WATCHDOG = """
import os, signal, sys
for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
    signal.signal(sig, signal.SIG_IGN)
seen = {}
for line in sys.stdin:
    pid, start = line.split()
    seen[int(pid)] = start
for pid, start in seen.items():
    try:
        with open(f"/proc/{pid}/stat") as f:
            if f.read().rsplit(")", 1)[1].split()[19] == start:
                os.kill(pid, signal.SIGCONT)
    except (OSError, IndexError, ValueError):
        pass
"""


class SlowdownError(ValueError):
    """A slowdown asked with values it cannot have."""


class _Cycle:
    def __init__(self, gpu: str, factor: float, period_s: float):
        self.gpu, self.factor, self.period_s = gpu, factor, period_s
        self.since = time.time()
        self.stop = threading.Event()
        self.thread: threading.Thread | None = None


class Slowdowns:
    """Each slowed GPU's duty cycle, on a thread of its own. `pids(gpu)` names the processes
    registered on a GPU now (asked at every cycle: a process that registers later is slowed
    too, one that exited is left alone)."""

    def __init__(self, gpus: Callable[[], Collection[str]], pids: Callable[[str], list[int]]):
        self._gpus = gpus
        self._pids = pids
        self._cycles: dict[str, _Cycle] = {}
        self._lock = threading.Lock()
        self._watchdog: subprocess.Popen | None = None
        self._told: set[tuple[int, str]] = set()      # (pid, start time) the watchdog knows

    def slow(self, gpu: str, factor: float = 2.0, period_s: float = 0.02) -> dict:
        """Make `gpu` `factor` times slower (1 ends it); returns every slowdown now."""
        if gpu not in self._gpus():
            raise SlowdownError(f"no GPU {gpu!r} in the rack")
        if isinstance(factor, bool) or not isinstance(factor, (int, float)) \
                or not 1.0 <= factor <= MAX_FACTOR:
            raise SlowdownError(f"factor must be a number from 1 (none) to {MAX_FACTOR:g}, "
                                f"not {factor!r}")
        if isinstance(period_s, bool) or not isinstance(period_s, (int, float)) \
                or not MIN_PERIOD_S <= period_s <= MAX_PERIOD_S:
            raise SlowdownError(f"period_s must be from {MIN_PERIOD_S:g} to {MAX_PERIOD_S:g} s, "
                                f"not {period_s!r}")
        self.end(gpu)
        if factor > 1.0:
            cycle = _Cycle(gpu, float(factor), float(period_s))
            cycle.thread = threading.Thread(target=self._run, args=(cycle,), daemon=True,
                                            name=f"slow-{gpu}")
            with self._lock:
                self._cycles[gpu] = cycle
            cycle.thread.start()
            log.info("fault: GPU %s runs %.2fx slower (duty cycle of %g s)", gpu, factor,
                     period_s)
        return self.active()

    def end(self, gpu: str) -> None:
        """The GPU's slowdown ends (its processes continued); nothing if it had none."""
        with self._lock:
            cycle = self._cycles.pop(gpu, None)
        if cycle is not None:
            cycle.stop.set()
            if cycle.thread is not None and cycle.thread is not threading.current_thread():
                cycle.thread.join(timeout=2.0)
            self._signal(gpu, signal.SIGCONT)

    def close(self) -> None:
        for gpu in list(self._cycles):
            self.end(gpu)
        with self._lock:
            dog, self._watchdog = self._watchdog, None
            self._told.clear()
        if dog is not None and dog.stdin is not None:
            dog.stdin.close()              # (it continues what it knows, and exits)
            try:
                dog.wait(5)
            except subprocess.TimeoutExpired:
                dog.kill()

    def active(self) -> dict[str, dict]:
        with self._lock:
            return {g: {"factor": c.factor, "period_s": c.period_s, "since": c.since}
                    for g, c in self._cycles.items()}

    def _signal(self, gpu: str, sig: int) -> None:
        for pid in self._pids(gpu):
            if sig == signal.SIGSTOP:
                self._watched(pid)
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
            except PermissionError as e:
                log.warning("slowdown of %s: cannot signal process %d: %s", gpu, pid, e)

    def _watched(self, pid: int) -> None:
        """The watchdog knows `pid` (this process: its start time too) before it is first
        stopped; a watchdog that died is started again, told every process so far."""
        try:
            with open(f"/proc/{pid}/stat") as f:
                start = f.read().rsplit(")", 1)[1].split()[19]
        except (OSError, IndexError) as e:
            log.warning("the slowdown's watchdog cannot tell process %d: %s", pid, e)
            return
        with self._lock:
            if (pid, start) in self._told and self._watchdog is not None \
                    and self._watchdog.poll() is None:
                return
            self._told.add((pid, start))
            try:
                if self._watchdog is None or self._watchdog.poll() is not None:
                    self._watchdog = subprocess.Popen(
                        [sys.executable, "-c", WATCHDOG], stdin=subprocess.PIPE, text=True,
                        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                        start_new_session=True)            # (a Ctrl-C to ours is not its)
                    told = self._told
                else:
                    told = {(pid, start)}
                assert self._watchdog.stdin is not None
                self._watchdog.stdin.write("".join(f"{p} {s}\n" for p, s in told))
                self._watchdog.stdin.flush()
            except OSError as e:
                log.warning("the slowdown's watchdog does not know process %d: %s", pid, e)

    def _runnable(self, gpu: str) -> dict[tuple[int, str], int] | None:
        """ns each thread of the GPU's processes was runnable so far (on a CPU and waiting
        for one); None where the kernel does not say."""
        out: dict[tuple[int, str], int] = {}
        pids = self._pids(gpu)
        for pid in pids:
            try:
                tasks = os.listdir(f"/proc/{pid}/task")
            except OSError:
                continue                              # (exited)
            for tid in tasks:
                try:
                    with open(f"/proc/{pid}/task/{tid}/schedstat", "rb") as f:
                        on_cpu, waiting = f.read().split()[:2]
                except (OSError, ValueError):
                    continue
                out[(pid, tid)] = int(on_cpu) + int(waiting)
        return out if out or not pids else None

    def _run(self, c: _Cycle) -> None:
        try:
            last = self._runnable(c.gpu)
            if last is None:
                self._duty_cycle(c)
                return
            debt = 0.0
            while not c.stop.wait(c.period_s / 2):
                now = self._runnable(c.gpu) or {}
                # the busiest thread's runnable time: the process's critical path
                ran = max((v - last.get(k, v) for k, v in now.items()), default=0) / 1e9
                debt += (c.factor - 1.0) * max(0.0, ran)
                last = now
                if debt >= c.period_s:
                    stop = min(debt, MAX_STOPS * c.period_s)
                    debt = min(debt, 2 * MAX_STOPS * c.period_s)    # (none left to pay later)
                    self._signal(c.gpu, signal.SIGSTOP)
                    t0 = time.monotonic()
                    c.stop.wait(stop)
                    self._signal(c.gpu, signal.SIGCONT)
                    debt -= time.monotonic() - t0           # (overslept: credited)
                    last = self._runnable(c.gpu) or last
        finally:
            self._signal(c.gpu, signal.SIGCONT)      # never leave a process stopped

    def _duty_cycle(self, c: _Cycle) -> None:
        run_s = c.period_s / c.factor
        while not c.stop.is_set():
            self._signal(c.gpu, signal.SIGCONT)
            if c.stop.wait(run_s):
                break
            self._signal(c.gpu, signal.SIGSTOP)
            c.stop.wait(c.period_s - run_s)
