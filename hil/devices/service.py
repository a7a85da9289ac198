"""A device service: one driver behind the bus's request server (hil.bus.server: requests on
a ROUTER socket, state, telemetry and heartbeats on a PUB socket).

The service is the device's one writer: the server runs one request at a time, in the order
they arrived, so two clients never interleave commands on the wire (several services served
together from one thread, `serve_together`: each device's calls queued and run one at a time,
in arrival order). A changing request may name
the state version it was computed from (`expect`); if the device moved on since, it is refused
with `StaleState` and nothing is sent to the hardware (compare-and-set). A changing request runs
at most once per request id (a retry gets the first answer).

What a service offers depends on its device kind (hil.devices.kinds): the driver class to
open, the operations, the state it starts from, and optional telemetry. Every service also
answers `ping`, `describe` and `snapshot`.
"""
from __future__ import annotations

import collections
import logging
import math
import os
import queue
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import zmq

from photonic_testbed.common import heap
from photonic_testbed.hil.bus import schema
from photonic_testbed.hil.bus.errors import BadRequest, DeadlineExceeded, StaleState, to_wire
from photonic_testbed.hil.bus.security import server_keys
from photonic_testbed.hil.bus.server import Answer, Server
from photonic_testbed.hil.devices.kinds import KINDS, Op, ServiceError, open_driver

log = logging.getLogger(__name__)

log = logging.getLogger(__name__)


# ---- the service ------------------------------------------------------------------------------

@dataclass
class ServiceSpec:
    """Everything a service needs to run (picklable: it crosses into a child process)."""
    name: str
    kind: str
    address: str
    request: str = "tcp://127.0.0.1:0"
    publish: str = "tcp://127.0.0.1:0"
    driver: str = ""
    options: dict = field(default_factory=dict)
    heartbeat: float = 0.5
    health: float = 2.0
    telemetry_hz: float | None = None
    curve_secret: str | None = None           # server certificate (.key_secret)
    curve_authorized: str | None = None       # folder of authorised client .key files


class _Worker:
    """A device's own thread, for its driver calls that block (served together): one at a
    time, and `done()` after each (from this thread)."""

    def __init__(self, name: str, done: Callable[[], None]):
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._done = done
        self._thread = threading.Thread(target=self._run, name=f"{name}-device", daemon=True)
        self._thread.start()

    def run(self, fn: Callable[[], Any], future: Future) -> None:
        self._jobs.put((future, fn))

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            future, fn = job
            try:
                future.set_result(fn())
            except Exception as e:
                future.set_exception(e)
            self._done()

    def stop(self) -> None:
        """End once the calls handed over are done (`join` waits for it)."""
        self._jobs.put(None)

    def join(self, timeout: float) -> bool:
        """Wait at most `timeout` for the thread to end (a driver stuck past it is left to its
        daemon thread); returns whether it ended."""
        self._thread.join(max(0.0, timeout))
        return not self._thread.is_alive()


@dataclass
class _Job:
    """One driver call of a device served together, in the device's queue."""
    future: Future
    run: Callable[[], Any]                        # the call, on the device's thread
    begin: Callable[[], Any] | None = None        # or sent now (DeviceKind.begins)
    name: str = ""                                # the operation
    deadline: float | None = None                 # not started past this (time.monotonic())


class DeviceService:
    """One device on the bus. `bind()`, then `serve(stop)` until `stop` is set; `close()`.
    Several from one thread: `serve_together`."""

    def __init__(self, spec: ServiceSpec, driver: Any = None,
                 context: zmq.Context | None = None):
        if spec.kind not in KINDS:
            raise ServiceError(f"unknown device kind {spec.kind!r}; known: "
                               f"{', '.join(sorted(KINDS))}")
        self.spec = spec
        self.kind = KINDS[spec.kind]
        self.name = spec.name
        self.driver = driver
        self._context = context
        self.server: Server | None = None
        self._telemetry_seq = 0
        # served together (serve_together): the device's thread, its queue of driver calls,
        # the one under way, and a change sent whose answer is awaited on the device's socket
        self._worker: _Worker | None = None
        self._jobs: collections.deque[_Job] = collections.deque()
        self._current: _Job | None = None
        self._awaited: tuple[Any, Callable[[Any], Any], Any] | None = None  # change, finish, sock
        self._loop: _Loop | None = None
        self._background: tuple[str, Future] | None = None   # a health check or telemetry read
        hz = self.kind.telemetry_hz if spec.telemetry_hz is None else spec.telemetry_hz
        self._period = 1.0 / hz if hz and self.kind.telemetry else math.inf
        now = time.monotonic()
        self._next_health, self._next_telemetry = now + spec.health, now + self._period

    # ---- lifecycle ------------------------------------------------------------------------

    def bind(self) -> tuple[str, str]:
        """Open the driver and bind both sockets; returns the bound (request, publish)."""
        spec = self.spec
        try:
            keys = (server_keys(spec.curve_secret, spec.curve_authorized or "")
                    if spec.curve_secret else None)
            if self.driver is None:
                self.driver = open_driver(self.kind, spec.driver, spec.address, spec.options)
            handlers = {op: self._handler(op, fn) for op, fn in self.kind.ops.items()}
            if "apply_circuits" in handlers:
                handlers["apply_circuits_together"] = self._apply_together
            self.server = Server(
                self.name, {"kind": spec.kind, "online": True, **self.kind.state(self.driver)},
                kind=spec.kind, request=spec.request, publish=spec.publish, keys=keys,
                heartbeat=spec.heartbeat, handlers=handlers, describe=self._describe,
                publish_version=True, context=self._context)
            request, publish = self.server.bind()
        except Exception:
            self.close()
            raise
        log.info("service %s (%s) on %s, publishing on %s", self.name, spec.kind, request,
                 publish)
        return request, publish

    def _describe(self) -> dict:
        out = {"device": self.kind.describe(self.driver)}
        if "apply_circuits" in self.kind.ops:
            # which switches one apply_circuits_together sent here may name
            out["together"] = {"group": self._loop.id if self._loop else self.server.incarnation,
                               "switches": sorted(self._peers())}
        return out

    def _handler(self, name: str, fn: Op) -> Callable[[dict], Any]:
        def run(args: dict):
            got = self._submit(name, args, self.server.request_deadline)
            # done already (an answer that was waiting): answered now, not at the next poll
            return got.result() if isinstance(got, Future) and got.done() else got
        return run

    def _submit(self, name: str, args: dict, deadline: float | None) -> Answer | Future:
        """Operation `name` on the driver: its Answer (the changes published once the reply
        has gone), or, served together with device threads, the Future of it (queued behind
        the device's calls before it)."""
        fn = self.kind.ops[name]
        if self._worker is None:
            return Answer(*fn(self.driver, args))
        begin = self.kind.begins.get(name)
        return self._queue(lambda: _worked_out(*fn(self.driver, args)),
                           None if begin is None else lambda: begin(self.driver, args),
                           name, deadline)

    def _peers(self) -> dict[str, "DeviceService"]:
        """The switches served together with this one (itself included), by name."""
        if self._loop is None:
            return {self.name: self}
        return self._loop.switches

    def _apply_together(self, args: dict) -> Answer | Future:
        """`apply_circuits_together`: each named switch served together with this one gets
        its `apply_circuits`, queued behind its own calls (its one writer) and checked against
        its own `expect`; the answer, once every switch is done, has one entry per switch, in
        the order asked: its result or its error, and its state version. A name not served
        here (or named twice) refuses the whole request before anything runs."""
        changes = args["changes"]
        peers = self._peers()
        counts = collections.Counter(c.switch for c in changes)
        twice = sorted(n for n, k in counts.items() if k > 1)
        if twice:
            raise BadRequest(f"apply_circuits_together names {', '.join(twice)} more than "
                             "once: one change per switch")
        strangers = [c.switch for c in changes if c.switch not in peers]
        if strangers:
            raise BadRequest(
                f"{', '.join(strangers)} not served together with {self.name} (here: "
                f"{', '.join(sorted(peers))}): send each its own apply_circuits")
        deadline = self.server.request_deadline
        parts: list[tuple[DeviceService, Any]] = []
        for change in changes:
            peer = peers[change.switch]
            try:
                peer.server.claim_change(change.expect)
                got: Any = peer._submit("apply_circuits", {"circuits": change.circuits},
                                        deadline)
            except Exception as e:
                got = e
            parts.append((peer, got))
        batch = _Batch(self, parts)
        if batch.ready():
            return batch.answer()
        self._loop.batches.append(batch)
        return batch.future

    # ---- the device's calls, served together --------------------------------------------------

    def _queue(self, run: Callable[[], Any], begin: Callable[[], Any] | None = None,
               name: str = "", deadline: float | None = None) -> Future:
        """A driver call, after those queued before it: the device's one writer. One whose
        turn comes past `deadline` (its request's ttl_ms) is not run."""
        job = _Job(Future(), run, begin, name, deadline)
        self._jobs.append(job)
        self._next()
        return job.future

    def _next(self) -> None:
        """Start queued calls while the device is free: one that can be sent now is sent
        from this thread and its answer awaited on the device's socket; any other runs on the
        device's thread."""
        while self._current is None and self._jobs:
            job = self._jobs.popleft()
            if job.deadline is not None and time.monotonic() > job.deadline:
                job.future.set_exception(DeadlineExceeded(
                    f"{job.name} waited longer than its deadline behind other requests to "
                    f"{self.name} and was not run"))
                continue
            started = None
            if job.begin is not None:
                try:
                    started = job.begin()
                except Exception as e:
                    job.future.set_exception(e)
                    continue
            if isinstance(started, Answer):
                job.future.set_result(started)             # nothing to wait for
                continue
            self._current = job
            if started is None:
                self._worker.run(job.run, job.future)
                return
            change, finish = started
            sock = self.driver.session_socket()
            self._awaited = (change, finish, sock)
            self._loop.watch(sock, self)
            self._answer_arrived()                          # (it may be there already)
            if self._current is not None:
                return

    def _answer_arrived(self, readable: bool = False) -> None:
        """The awaited change's socket is readable, or its deadline passed: finish it here
        when its answer is a clean one (the device is then free: the caller starts what is
        queued, `_next`); hand what may block (a refusal's error queue, a dropped or silent
        session) to the device's thread."""
        change, finish, sock = self._awaited
        job = self._current
        state = change.state()
        if state == "wait":
            if readable:                  # part of a line: look again shortly, not at once
                self._loop.unwatch(sock)
                self._loop.later(self, 0.001)
            return
        self._loop.unwatch(sock)
        self._awaited = None
        if state == "line":
            try:
                reply = change.take()
            except Exception as e:           # (a line was there: not expected)
                change.lost = e
            else:
                if change.clean(reply):
                    try:
                        job.future.set_result(finish(change.conclude(reply)))
                    except Exception as e:
                        job.future.set_exception(e)
                    self._current = None
                    return
                self._worker.run(lambda: finish(change.conclude(reply)), job.future)
                return
        self._worker.run(lambda: finish(change.recover()), job.future)

    def _look_again(self) -> None:
        if self._awaited is not None:
            self._loop.watch(self._awaited[2], self)
            self._answer_arrived()
            self._next()

    def _done(self) -> None:
        """After the device's thread (or this one) finished a call: the next may start."""
        if self._current is not None and self._awaited is None and self._current.future.done():
            self._current = None
            self._next()

    def _deadline(self) -> float:
        return self._awaited[0].deadline if self._awaited is not None else math.inf

    def close(self) -> None:
        if self.server is not None:
            self.server.close()
            self.server = None
        if self.driver is not None and callable(getattr(self.driver, "close", None)):
            try:
                self.driver.close()
            except Exception as e:        # closing must not hide why we stopped
                log.warning("%s: closing the driver failed: %s", self.name, e)
        self.driver = None

    @property
    def version(self) -> str:
        return self.server.version

    @property
    def online(self) -> bool:
        return self.server.online

    def handle(self, frame: bytes, arrived: float | None = None) -> dict:
        """One request frame -> the answer message (in-process use and tests)."""
        return self.server.handle(frame, arrived)

    # ---- the loop ------------------------------------------------------------------------------

    def serve(self, stop: threading.Event) -> None:
        """Serve until `stop` is set, the driver called from this thread."""
        serve_together([self], stop, device_threads=False)

    def _tick(self, now: float) -> float:
        """Start a health check or a telemetry read that is due (on the device's thread when
        it has one) and publish one that is done; returns when the next falls due."""
        if self._background is not None:
            if not self._background[1].done():
                return math.inf                  # its end wakes the loop
            what, future = self._background
            self._background = None
            (self._apply_health if what == "health" else self._send_telemetry)(future)
        if now >= self._next_health:
            self._next_health = now + self.spec.health
            self._start_background("health", self._read_health)
        elif now >= self._next_telemetry:
            self._next_telemetry = now + self._period
            self._start_background("telemetry", self._read_telemetry)
        if self._background is not None:
            return math.inf
        return min(self._next_health, self._next_telemetry)

    def _start_background(self, what: str, fn: Callable[[], Any]) -> None:
        if self._worker is not None:
            self._background = (what, self._queue(fn))
            return
        future: Future = Future()
        future.set_result(fn())                  # (both read functions catch what fails)
        (self._apply_health if what == "health" else self._send_telemetry)(future)

    def _read_health(self) -> bool | None:
        """Whether the device answers its driver's `ping` (None: the driver has none)."""
        ping = getattr(self.driver, "ping", None)
        if not callable(ping):
            return None
        try:
            ping()
            return True
        except Exception as e:
            log.warning("%s: device does not answer: %s: %s", self.name, type(e).__name__, e)
            return False

    def _apply_health(self, future: Future) -> None:
        online = future.result()
        if online is not None and online != self.server.online:
            self.server.online = online
            self.server.update({"online": online})

    def _read_telemetry(self) -> dict:
        try:
            return self.kind.telemetry(self.driver)
        except Exception as e:
            log.debug("%s: telemetry read failed: %s", self.name, e)
            return {}

    def _send_telemetry(self, future: Future) -> None:
        values = future.result()
        if not values:
            return                          # this driver has nothing to report
        self._telemetry_seq += 1
        self.server.pub.send(schema.telemetry(self.name, self._telemetry_seq, time.time(),
                                              values))


class _Batch:
    """An `apply_circuits_together` under way: each switch's part (an Answer, the Future of
    one, or the error that stopped it) and the Future its server answers from."""

    def __init__(self, receiver: DeviceService, parts: list[tuple[DeviceService, Any]]):
        self.receiver = receiver
        self.parts = parts
        self.future: Future = Future()
        futures = [got for _, got in parts if isinstance(got, Future)]
        self._waiting = len(futures)
        # one item per part ended, appended by the thread ending it; the callback holds
        # neither the future nor the batch (a cycle through them would leave every part's
        # answer to the collector)
        ended: collections.deque = collections.deque()
        self._ended = ended
        for future in futures:
            future.add_done_callback(lambda _: ended.append(None))

    def ready(self) -> bool:
        return len(self._ended) == self._waiting

    def answer(self) -> Answer:
        """Once every part is done, on the thread serving the switches: one entry per part;
        each switch's state (and version) goes out on its own publisher after the reply."""
        out, others = [], {}
        for peer, got in self.parts:
            if isinstance(got, Future):
                try:
                    got = got.result()
                except Exception as e:
                    got = e
            entry: dict[str, Any] = {"switch": peer.name}
            if isinstance(got, Answer):
                entry["result"] = got.result
                peer.server.defer(got.state)
            else:
                if not isinstance(got, StaleState):      # (refused: nothing was sent)
                    peer.server.defer({})                 # the new version, all the same
                    log.info("%s: apply_circuits (sent with %s) failed: %s: %s", peer.name,
                             self.receiver.name, type(got).__name__, got)
                entry["error"], entry["message"] = to_wire(got)
            entry["version"] = peer.server.version
            out.append(entry)
            if peer is not self.receiver:
                others[peer.name] = peer.server

        def publish() -> None:
            for server in others.values():
                server.publish_deferred()
        return Answer({"changes": out}, after=publish)


def _worked_out(result: Any, changes: dict) -> Answer:
    """An operation's answer with the state it changed worked out on the device's thread (a
    value that is a function is called there, not on the thread serving every device)."""
    return Answer(result, {k: v() if callable(v) else v for k, v in changes.items()})


class _Loop:
    """What the services served together share: the poller and the wake-ups."""

    def __init__(self, services: Sequence[DeviceService]):
        self.id = uuid.uuid4().hex[:12]
        self.switches = {s.name: s for s in services if "apply_circuits" in s.kind.ops}
        self.batches: list[_Batch] = []       # apply_circuits_together under way
        self.poller = zmq.Poller()
        self.ready: collections.deque = collections.deque()   # services with a call done
        self.owner: dict[Any, DeviceService] = {}
        self.timers: dict[DeviceService, float] = {}
        self.wake_r, self.wake_w = os.pipe()
        os.set_blocking(self.wake_r, False)
        os.set_blocking(self.wake_w, False)
        self.poller.register(self.wake_r, zmq.POLLIN)
        for service in services:
            self.poller.register(service.server.router, zmq.POLLIN)
            self.owner[service.server.router] = service

    def done_by(self, service: DeviceService) -> Callable[[], None]:
        """Called by a device's thread after each call."""
        def done() -> None:
            self.ready.append(service)
            try:
                os.write(self.wake_w, b"\0")
            except OSError:          # the pipe is full (the loop is awake anyway), or closed
                pass
        return done

    def watch(self, sock: Any, service: DeviceService) -> None:
        """Wake for a device's socket (a native one: the poller names it by its number)."""
        self.poller.register(sock, zmq.POLLIN)
        self.owner[sock.fileno()] = service

    def unwatch(self, sock: Any) -> None:
        if self.owner.pop(sock.fileno(), None) is not None:
            self.poller.unregister(sock)

    def later(self, service: DeviceService, seconds: float) -> None:
        self.timers[service] = time.monotonic() + seconds

    def close(self) -> None:
        os.close(self.wake_r)
        os.close(self.wake_w)


def serve_together(services: Sequence[DeviceService], stop: threading.Event, *,
                   device_threads: bool = True) -> None:
    """Serve bound services from this one thread until `stop` is set.

    This thread takes every service's requests in, answers them and publishes their state.
    With `device_threads` each device's driver calls run one at a time in arrival order (its
    one writer): a change whose answer can be awaited on the device's socket (a switch's new
    circuits: `DeviceKind.begins`) is sent from here and its answer read here when it comes;
    every other call (and anything that may block: a refusal's error queue, a dropped
    session) runs on the device's own thread. Requests to 64 switches at once are then 64
    lines sent and 64 answers read by one thread, not 64 threads that each decode, write,
    wait, answer and publish while contending for the interpreter (BENCHMARKS.md,
    "datacenter"); a slow or silent device still holds up only its own requests. Without
    `device_threads` the driver is called from this thread (one service: no hand-over)."""
    loop = _Loop(services)
    for service in services:
        service._loop = loop
        if device_threads:
            service._worker = _Worker(service.name, loop.done_by(service))
    # When each service next has work of its own (a tick, a queued request or heartbeat, an
    # awaited answer's deadline): worked out again only for the services handled or due, since
    # nothing else changes it; -inf: to be worked out.
    wake: dict[DeviceService, float] = {service: -math.inf for service in services}
    try:
        while not stop.is_set():
            now = time.monotonic()
            for service in [s for s, when in wake.items() if when <= now]:
                wake[service] = min(service._tick(now), service.server.due,
                                    service._deadline())
            due = min(now + 0.1, min(wake.values()))    # (0.1: how soon `stop` is noticed)
            if loop.timers:
                due = min(due, min(loop.timers.values()))
            if any(b.ready() for b in loop.batches):
                due = now          # a part done in the last round's polls: answer it now
            events = loop.poller.poll(math.ceil(max(0.0, due - time.monotonic()) * 1e3))
            todo: dict[DeviceService, None] = {}        # to poll: requests, answers to send
            touched: dict[DeviceService, None] = {}     # when next it has work: to work out
            for sock, _ in events:
                if sock == loop.wake_r:
                    try:
                        os.read(loop.wake_r, 4096)
                    except BlockingIOError:
                        pass
                    continue
                service = loop.owner.get(sock)
                if service is None:
                    continue
                if isinstance(sock, int):                      # an awaited answer
                    service._answer_arrived(readable=True)
                    service._next()
                    touched[service] = None
                    if not service.server.answering:
                        continue        # (a part of a request to another service)
                todo[service] = None
            while loop.ready:
                service = loop.ready.popleft()
                service._done()
                touched[service] = None
                if service.server.answering:
                    todo[service] = None
            now = time.monotonic()
            for service, when in list(loop.timers.items()):
                if when <= now:
                    del loop.timers[service]
                    service._look_again()
                    todo[service] = None
            for batch in [b for b in loop.batches if b.ready()]:
                loop.batches.remove(batch)
                batch.future.set_result(batch.answer())
                todo[batch.receiver] = None
            for service in [s for s, when in wake.items() if when <= now]:
                if service.server.due <= now:
                    todo[service] = None
                elif service._deadline() <= now:
                    service._answer_arrived()
                    service._next()
                    todo[service] = None
            for service in todo:
                service.server.poll(0)
                wake[service] = -math.inf
            for service in touched:
                wake[service] = -math.inf
    finally:
        workers = [(s, s._worker) for s in services if s._worker is not None]
        for _, worker in workers:
            worker.stop()
        deadline = time.monotonic() + 2.0
        for service, worker in workers:
            if not worker.join(deadline - time.monotonic()):
                log.warning("%s: a device call did not end within 2 s", service.name)
            service._worker = None
        for service in services:
            service._loop = None
        loop.close()


def run_service(spec: ServiceSpec, ready=None, stop: threading.Event | None = None) -> None:
    """Run one service until `stop` is set or SIGTERM (process entry point). `ready`, a
    multiprocessing Connection, receives the bound endpoints (or the error text)."""
    import signal
    stop = stop or threading.Event()
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, lambda *_: stop.set())
        signal.signal(signal.SIGINT, lambda *_: stop.set())
    service = DeviceService(spec)
    try:
        endpoints = service.bind()
    except Exception as e:
        if ready is None:
            raise
        ready.send(("error", f"{type(e).__name__}: {e}"))     # the parent says it, once
        return
    if ready is not None:
        ready.send(("ready", endpoints))
    if threading.current_thread() is threading.main_thread():
        heap.settle("start-up")         # (the process's own: not a test's thread)
    try:
        service.serve(stop)
    finally:
        service.close()
