"""Admission off the hot path: a job's plan read and its circuits for every (phase, round)
worked out (`policies.JobCircuits`) in a worker process beside the agent, so that the agent
answers other jobs' grants and failovers meanwhile (a thread would still hold the interpreter's
lock; the worker runs at the lowest priority, nice 19: the agent and the devices come first, and
on a machine busy with other work the admission is slower, never starved as at SCHED_IDLE).

`Admissions.submit(plan, max_world, run)` queues an admission and returns a Future; one is
worked out at a time, on the admissions' own thread: the worker reads the plan and counts its
rank links (without listing an all-to-all's), then `run(plan, links, circuits)` decides with
the agent (its GPUs, under the agent's lock) and calls `circuits(rank_map)`, which has the
worker work them out and send them back as a few arrays (the rank index, every phase's circuits
packed: `policies.PackedTargets`), read by the kernel straight into their buffers, so that the
agent's interpreter is not held while they arrive (a Python object per circuit, unpickled, held
it for tens of milliseconds).

Every admission is bounded, and a plan past a bound is refused with the figure that passed it:
its time (`seconds` of the worker's own CPU time, from the plan read to its circuits back, so
that a busy machine makes an admission slow, not refused; or as long with the worker neither
running nor waiting to run: stopped, or stuck; the worker is killed and a fresh one started for
the next), the worker's memory (`memory_mb` more than it
takes to start, an address-space limit: the plan is refused when working it out needs more),
its size (`job_links` rank links over all its phases, counted before anything is listed), and
the admissions waiting (`waiting`). The agent bounds the rank links of all its jobs together
(`ALL_LINKS`): the circuits it keeps cost about 200 bytes a link.

The worker is `serve`, in a Python process of its own; it speaks pickled messages over its
standard input and output, to its parent only.
"""
from __future__ import annotations

import collections
import logging
import os
import pickle
import resource
import select
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import Future
from typing import IO, Any, BinaryIO, TypeVar

from photonic_testbed.common.jobplan import JobPlan, PlanError
from photonic_testbed.common.rack_layout import RackLayout
from photonic_testbed.hil.agent import policies
from photonic_testbed.hil.agent.jobs import AgentError
from photonic_testbed.hil.agent.policies import RankMap

log = logging.getLogger(__name__)

ADMISSION_S = 60.0          # an admission's plan read and circuits worked out within this
                            # much of the worker's CPU time
NICE = 19                   # the worker's priority (the agent's and the devices' come first)
MEMORY_MB = 2048            # the worker's memory, past what it takes to start
JOB_LINKS = 1 << 22         # a job's rank links over all its phases (a 2,048-rank all-to-all:
                            # 2,047 rounds of 2,048 links, 4.19 million) ...
ALL_LINKS = 1 << 23         # ... and all the agent's jobs' together
WAITING = 16                # admissions waiting to be worked out, at most

T = TypeVar("T")
Matchings = Callable[[int], list[list[tuple[int, int]]]]
Circuits = Callable[[RankMap], policies.JobCircuits]
_LENGTH = 8                 # bytes of a message's length, before it
_TICKS = os.sysconf("SC_CLK_TCK")
# The worker dies with the agent's thread that started it (Linux's parent-death signal, set
# before anything else, then the parent checked: it may have gone already), so that it never
# outlives the agent nor holds its output open (a niced worker on a busy machine would take its
# time to see its input closed).
_WORKER = ("import ctypes, os, sys\n"
           "try:\n"
           "    ctypes.CDLL(None, use_errno=True).prctl(1, 9)   # PR_SET_PDEATHSIG, SIGKILL\n"
           "except (OSError, AttributeError):\n"
           "    pass\n"
           "if os.getppid() != int(sys.argv[1]):\n"
           "    sys.exit(0)\n"
           "from photonic_testbed.hil.agent.admission import serve\n"
           "serve(sys.stdin.buffer, sys.stdout.buffer)\n")


def plan_size(plan: JobPlan, matchings: Matchings) -> tuple[int, int]:
    """(phase, round)s and rank links of a plan on its world, counted without listing an
    all-to-all's links (a round is a matching of each group's members, both ways)."""
    keys = links = 0
    for phase in plan.phases:
        if phase.pattern == "all_to_all":
            groups = phase.groups(plan.world)
            schedule = phase.schedule(len(groups[0]), matchings)
            keys += len(schedule)
            links += 2 * len(groups) * sum(len(matching) for matching in schedule)
        else:
            keys += 1
            links += len(phase.rounds(plan.world, matchings)[0])
    return keys, links


class Admissions:
    """The admissions waiting, the thread that works them out one at a time, and the worker
    process (started at the first, started again after one it had to give up)."""

    def __init__(self, layout: RackLayout, matchings: Matchings, *,
                 seconds: float = ADMISSION_S, memory_mb: int = MEMORY_MB,
                 job_links: int = JOB_LINKS, waiting: int = WAITING, nice: int = NICE):
        self.layout = layout
        self.nice = nice                # the worker's (tests of the admissions' logic: 0)
        self.matchings = matchings
        self.seconds = seconds
        self.memory_mb = memory_mb
        self.job_links = job_links
        self.waiting = waiting
        self._queue: collections.deque[tuple[Future, Mapping[str, Any], int, Callable]] = \
            collections.deque()
        self._cond = threading.Condition()
        self._closing = False
        self._thread: threading.Thread | None = None
        self._worker: _Worker | None = None

    def submit(self, plan: Mapping[str, Any], max_world: int,
               run: Callable[[JobPlan, int, Circuits], T]) -> Future[T]:
        """Queue the admission of `plan` (its dict, read by the worker, at most `max_world`
        ranks); `run(plan, its rank links, circuits)` is called on the admissions' thread once
        it is read, and its result (or its error) is the Future's."""
        out: Future[T] = Future()
        with self._cond:
            if self._closing:
                raise AgentError("the agent is closing: no admission is taken")
            if len(self._queue) >= self.waiting:
                raise AgentError(f"{len(self._queue)} admissions are waiting to be worked out "
                                 f"(at most {self.waiting}): try again later")
            self._queue.append((out, plan, max_world, run))
            if self._thread is None:
                self._thread = threading.Thread(target=self._serve, name="admissions",
                                                 daemon=True)
                self._thread.start()
            self._cond.notify()
        return out

    def wait(self, taken: Future[T]) -> T:
        """`taken`'s result, waited for on the admissions' thread (a job taken on by another
        thread), unless the admissions close meanwhile."""
        while True:
            try:
                return taken.result(timeout=0.1)
            except TimeoutError:
                if self._closing:
                    raise AgentError("the agent is closing: the job was not admitted") from None

    def close(self) -> None:
        with self._cond:
            self._closing = True
            self._cond.notify()
            waiting = list(self._queue)
            self._queue.clear()
        for fut, *_ in waiting:
            fut.cancel()
        if self._worker is not None:
            self._worker.kill()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(10.0)

    def _serve(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._closing:
                    self._cond.wait()
                if self._closing:
                    return
                fut, plan, max_world, run = self._queue.popleft()
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                fut.set_result(self._admit(plan, max_world, run))
            except BaseException as e:          # (the Future's: the caller hears it)
                fut.set_exception(e)

    def _admit(self, plan: Mapping[str, Any], max_world: int,
               run: Callable[[JobPlan, int, Circuits], T]) -> T:
        budget = _Budget(self.seconds)
        name = str(plan.get("name", "")) if isinstance(plan, Mapping) else ""
        got = self._ask(("plan", dict(plan), max_world, self.job_links), budget, name)
        _, read, links = next(got)
        return run(read, links, lambda ranks: self._circuits(read, ranks, budget))

    def _circuits(self, plan: JobPlan, rank_map: RankMap, budget: _Budget
                  ) -> policies.JobCircuits:
        _, by_rank, targets, size = next(self._ask(("circuits", dict(rank_map)), budget,
                                                   plan.name))
        return policies.JobCircuits.assembled(plan, self.layout, rank_map, by_rank, targets,
                                              size)

    def _ask(self, message: tuple, budget: _Budget, name: str) -> Iterator[tuple]:
        """Send `message` to the worker (started if need be) and yield its answers; a
        refusal, the time spent or the worker gone is an AgentError naming the job."""
        worker = self._worker
        if worker is None or not worker.alive():
            worker = self._worker = _Worker(self.layout, self.matchings, self.memory_mb,
                                            self.nice)
        try:
            worker.send(message)
            budget.given()
            while True:
                answer = worker.receive(budget)
                if answer[0] == "refused":
                    if answer[2]:                   # (its memory ran out: a fresh one next)
                        worker.kill()
                    raise AgentError(answer[1])
                yield answer
        except TimeoutError as e:
            worker.kill()
            why = f" {e}" if str(e) else ""
            raise AgentError(f"job {name!r}: its circuits were not worked out within "
                             f"{self.seconds:g} s{why}: refused") from None
        except EOFError:
            code = worker.kill()
            raise AgentError(f"job {name!r}: the admission's worker ended (exit {code}) while "
                             f"working out its circuits (its memory is bounded to "
                             f"{self.memory_mb} MB past its start): refused") from None


class _Budget:
    """An admission's time: `seconds` of the worker's CPU time, or as long with the worker
    neither running nor waiting to run (stopped, or asleep: stuck); wall time alone where the
    worker's CPU time is unknown. A worker whose CPU time grew since it was last looked at has
    run meanwhile, whatever state it is in when looked at (a look is an instant: a worker that
    computes is now and then caught asleep on a page or its pipe)."""

    LOOK_S = 0.25           # how often the worker is looked at while waited for

    def __init__(self, seconds: float, clock: Callable[[], float] = time.monotonic):
        self.seconds, self.clock = seconds, clock
        self.began = self.idle_since = clock()
        self.cpu0: float | None = None          # the worker's CPU time when first looked at
        self.cpu_last: float | None = None      # ... when last looked at

    def given(self) -> None:
        """The worker was just given work: it is not idle from before (the agent may have held
        it between two parts of the admission)."""
        self.idle_since = self.clock()

    def left(self, cpu: float | None, runnable: bool) -> float:
        """How long to wait for the worker before looking again, given its CPU time so far
        and whether it runs or waits to run; TimeoutError (saying why) once the time is
        spent."""
        now = self.clock()
        if cpu is None:
            if now - self.began >= self.seconds:
                raise TimeoutError("")
            return min(self.LOOK_S, self.began + self.seconds - now)
        if self.cpu0 is None:
            self.cpu0 = cpu
        if cpu - self.cpu0 >= self.seconds:
            raise TimeoutError("of its worker's time")
        ran = self.cpu_last is not None and cpu > self.cpu_last
        self.cpu_last = cpu
        if runnable or ran:
            self.idle_since = now
        elif now - self.idle_since >= self.seconds:
            raise TimeoutError("without its worker running")
        return min(self.LOOK_S, self.seconds - (cpu - self.cpu0))


class _Worker:
    """The worker process: started with the rack's layout and matchings, then asked."""

    def __init__(self, layout: RackLayout, matchings: Matchings, memory_mb: int, nice: int):
        env = dict(os.environ, OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1",
                   MKL_NUM_THREADS="1")
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _WORKER, str(os.getpid())],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, close_fds=True)
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self._out: IO[bytes] = self.proc.stdin
        self._in = self.proc.stdout.fileno()
        self.send((layout, matchings, memory_mb, nice))

    def alive(self) -> bool:
        return self.proc.poll() is None

    def send(self, message: Any) -> None:
        try:
            _write_message(self._out, message)
        except (BrokenPipeError, ValueError):
            raise EOFError from None

    def looked(self) -> tuple[float | None, bool]:
        """The worker's CPU time so far (user and system) and whether it runs or waits to run
        (its state R), from /proc; (None, True) where /proc does not say."""
        try:
            with open(f"/proc/{self.proc.pid}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
            return (int(fields[11]) + int(fields[12])) / _TICKS, fields[0] == b"R"
        except (OSError, IndexError, ValueError):
            return None, True

    def receive(self, budget: _Budget) -> tuple:
        """The worker's next message. Its arrays' bytes are read by the kernel straight into
        their buffers (the interpreter's lock is not held while they come), then taken as
        they are by the arrays unpickled (no copy)."""
        head = self._read(2 * _LENGTH, budget)
        size, count = (int.from_bytes(head[k:k + _LENGTH], "little") for k in (0, _LENGTH))
        body = self._read(size, budget)
        buffers = []
        for _ in range(count):
            buffers.append(self._read(int.from_bytes(self._read(_LENGTH, budget), "little"),
                                      budget))
        return pickle.loads(body, buffers=buffers)

    def _read(self, n: int, budget: _Budget) -> bytearray:
        """`n` bytes from the worker, waiting and reading without the interpreter's lock."""
        got = bytearray(n)
        view, done = memoryview(got), 0
        while done < n:
            if not select.select([self._in], [], [], budget.left(*self.looked()))[0]:
                continue
            k = os.readv(self._in, [view[done:]])
            if not k:
                raise EOFError
            done += k
        return got

    def kill(self) -> int | None:
        """End the worker now; its exit status."""
        if self.proc.poll() is None:
            self.proc.kill()
        try:
            code = self.proc.wait(10.0)
        except subprocess.TimeoutExpired:
            code = None
        for pipe in (self.proc.stdin, self.proc.stdout):
            if pipe is not None:
                try:
                    pipe.close()
                except OSError:
                    pass
        return code


# --- the worker's side ------------------------------------------------------------------------

def _read_message(stream: BinaryIO) -> Any:
    """A message as `_write_message` writes it."""
    def exactly(n: int) -> bytes:
        got = stream.read(n)
        if len(got) < n:
            raise EOFError
        return got
    head = exactly(2 * _LENGTH)
    size, count = (int.from_bytes(head[k:k + _LENGTH], "little") for k in (0, _LENGTH))
    body = exactly(size)
    buffers = [exactly(int.from_bytes(exactly(_LENGTH), "little")) for _ in range(count)]
    return pickle.loads(body, buffers=buffers)


def _write_message(stream: IO[bytes], message: Any) -> None:
    """A message: its pickle's length and how many buffers follow it, the pickle, then each
    buffer (an array's bytes, out of the pickle: protocol 5) after its length."""
    buffers: list[pickle.PickleBuffer] = []
    body = pickle.dumps(message, protocol=5, buffer_callback=buffers.append)
    stream.write(len(body).to_bytes(_LENGTH, "little") + len(buffers).to_bytes(_LENGTH, "little"))
    stream.write(body)
    for buffer in buffers:
        raw = buffer.raw()
        stream.write(raw.nbytes.to_bytes(_LENGTH, "little"))
        stream.write(raw)
    stream.flush()


def _bound(memory_mb: int, nice: int) -> None:
    """A low priority (`nice`: the agent and the devices come first), and an address space
    `memory_mb` past what the worker holds now."""
    os.nice(nice)
    with open("/proc/self/statm") as f:
        pages = int(f.read().split()[0])
    limit = pages * os.sysconf("SC_PAGE_SIZE") + memory_mb * (1 << 20)
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))


def serve(inp: BinaryIO, out: IO[bytes]) -> None:
    """The worker: its set-up, then a plan to read, then the circuits of a rank map, and so
    on, each answered; a refusal says why (with `True` when its memory ran out, and the worker
    ends). It ends too when its parent is gone (its input closed, or its output)."""
    plan: JobPlan | None = None
    memory_mb = 0
    try:
        layout, matchings, memory_mb, nice = _read_message(inp)
        _bound(memory_mb, nice)
        while True:
            plan, refusal = _answer(_read_message(inp), plan, layout, matchings, out)
            if refusal is not None:
                _write_message(out, ("refused", refusal, False))
    except MemoryError:
        name = plan.name if plan is not None else "?"
        _write_message(out, ("refused", f"job {name!r}: working out its circuits needs more "
                                        f"than the {memory_mb} MB an admission may take: "
                                        "refused", True))
    except (EOFError, BrokenPipeError):
        return


def _answer(message: tuple, plan: JobPlan | None, layout: RackLayout, matchings: Matchings,
            out: IO[bytes]) -> tuple[JobPlan | None, str | None]:
    """Answer one message; (the plan read last, the refusal to send, if any)."""
    try:
        if message[0] == "plan":
            _, data, max_world, job_links = message
            try:
                plan = JobPlan.from_dict(data, max_world=max_world)
            except PlanError as e:
                return None, f"admit needs a job plan: {e}"
            keys, links = plan_size(plan, matchings)
            if links > job_links:
                return plan, (f"job {plan.name!r}: its plan has {links:,} rank links over "
                              f"{keys:,} (phase, round)s, more than the {job_links:,} one "
                              "admission may work out: refused")
            _write_message(out, ("plan", plan, links))
        elif message[0] == "circuits" and plan is not None:
            try:
                circuits = policies.JobCircuits(plan, layout, message[1], matchings)
            except (policies.PolicyError, PlanError) as e:
                return plan, f"job {plan.name!r} does not fit rack {layout.name!r}: {e}"
            _write_message(out, ("circuits", circuits.by_rank, policies.PackedTargets(
                list(layout.switches), circuits.targets), circuits.size))
        else:
            return plan, f"the admission's worker was asked {message[0]!r} out of turn"
    except (MemoryError, BrokenPipeError):
        raise
    except Exception as e:          # (a bug: said in the refusal, the worker goes on)
        log.exception("the admission's worker failed")
        return plan, f"the admission's worker failed: {type(e).__name__}: {e}"
    return plan, None
