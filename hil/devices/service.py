"""A device service: one driver behind the bus's request server (hil.bus.server: requests on
a ROUTER socket, state, telemetry and heartbeats on a PUB socket).

The service is the device's one writer: the server runs one request at a time, in the order
they arrived, so two clients never interleave commands on the wire (several services served
together from one thread, hil.devices.together: each device's calls queued and run one at a
time, in arrival order, hil.devices.calls). A changing request may name
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
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import zmq
from photonic_testbed.common import heap
from photonic_testbed.hil.bus import schema
from photonic_testbed.hil.bus.errors import BadRequest
from photonic_testbed.hil.bus.security import server_keys
from photonic_testbed.hil.bus.server import Answer, Handler, Server
from photonic_testbed.hil.devices.calls import DeviceCalls
from photonic_testbed.hil.devices.kinds import KINDS, Op, ServiceError, open_driver
from photonic_testbed.hil.devices.together import Batch, Loop, serve_together

log = logging.getLogger(__name__)


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


class DeviceService:
    """One device on the bus. `bind()`, then `serve(stop)` until `stop` is set; `close()`.
    Several from one thread: `serve_together` (hil.devices.together), which `attach`es each
    to its loop, calls `tick` when it falls due, and `detach`es it at the end."""

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
        # served from a loop (serve_together): its group, and the device's calls (on a thread
        # of its own); neither when the service answers in-process (`handle`)
        self.calls: DeviceCalls | None = None
        self._group: Loop | None = None
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
            handlers: dict[str, Handler] = {op: self._handler(op, fn)
                                            for op, fn in self.kind.ops.items()}
            if self.is_switch:
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

    @property
    def is_switch(self) -> bool:
        """Whether the device is a switch (it offers `apply_circuits`)."""
        return "apply_circuits" in self.kind.ops

    def _describe(self) -> dict:
        out = {"device": self.kind.describe(self.driver)}
        if self.is_switch:
            # which switches one apply_circuits_together sent here may name
            group = self._group.id if self._group else self.server.incarnation
            out["together"] = {"group": group, "switches": sorted(self.peers())}
        return out

    def _handler(self, name: str, fn: Op) -> Handler:
        def run(args: schema.Args) -> Any:
            got = self.submit(name, args, self.server.request_deadline)
            # done already (an answer that was waiting): answered now, not at the next poll
            return got.result() if isinstance(got, Future) and got.done() else got
        return run

    def submit(self, name: str, args: schema.Args, deadline: float | None) -> Answer | Future:
        """Operation `name` on the driver: its Answer (the changes published once the reply
        has gone), or, served with a device thread, the Future of it (queued behind the
        device's calls before it; not run past `deadline`)."""
        fn = self.kind.ops[name]
        if self.calls is None:
            return Answer(*fn(self.driver, args))
        begin = self.kind.begins.get(name)
        return self.calls.submit(lambda: _worked_out(*fn(self.driver, args)),
                                 None if begin is None else lambda: begin(self.driver, args),
                                 name, deadline)

    def peers(self) -> dict[str, DeviceService]:
        """The switches served together with this one (itself included), by name."""
        if self._group is None:
            return {self.name: self}
        return self._group.switches

    def _apply_together(self, args: schema.ApplyTogether) -> Answer | Future:
        """`apply_circuits_together`: each named switch served together with this one gets
        its `apply_circuits`, queued behind its own calls (its one writer) and checked against
        its own `expect`; the answer, once every switch is done, has one entry per switch, in
        the order asked: its result or its error, and its state version. A name not served
        here (or named twice) refuses the whole request before anything runs."""
        changes = args.changes
        peers = self.peers()
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
                got: Any = peer.submit("apply_circuits",
                                       schema.ApplyCircuits(circuits=change.circuits), deadline)
            except Exception as e:
                got = e
            parts.append((peer, got))
        batch = Batch(self, parts)
        if batch.ready() or self._group is None:
            return batch.answer()
        self._group.add_batch(batch)
        return batch.future

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

    # ---- served from a loop ----------------------------------------------------------------

    def serve(self, stop: threading.Event) -> None:
        """Serve until `stop` is set, the driver called from this thread."""
        serve_together([self], stop, device_threads=False)

    def attach(self, loop: Loop, *, device_thread: bool) -> None:
        """Served from `loop` (with the switches served with it); with `device_thread` the
        driver is called from a thread of the device's own, one call at a time."""
        self._group = loop
        if device_thread:
            self.calls = DeviceCalls(self.name, self.driver, loop)

    def stop_calls(self) -> None:
        """No more driver calls: the device's thread ends once those under way are done."""
        if self.calls is not None:
            self.calls.stop()

    def detach(self, timeout: float) -> bool:
        """No longer served from a loop; waits at most `timeout` for the device's thread to
        end (after `stop_calls`), and returns whether it did."""
        ended = True
        if self.calls is not None:
            self.calls.stop()
            ended = self.calls.join(timeout)
        self.calls = None
        self._group = None
        return ended

    def tick(self, now: float) -> float:
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
        if self.calls is not None:
            self._background = (what, self.calls.submit(fn))
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


def _worked_out(result: Any, changes: dict) -> Answer:
    """An operation's answer with the state it changed worked out on the device's thread (a
    value that is a function is called there, not on the thread serving every device)."""
    return Answer(result, {k: v() if callable(v) else v for k, v in changes.items()})


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
        if ready is not None:
            ready.send(("error", f"{type(e).__name__}: {e}"))
        raise
    if ready is not None:
        ready.send(("ready", endpoints))
    if threading.current_thread() is threading.main_thread():
        heap.settle("start-up")         # (the process's own: not a test's thread)
    try:
        service.serve(stop)
    finally:
        service.close()
