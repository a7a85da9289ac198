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

Changes come from the agent (with CURVE, only a key of the agent role may call them: declared in
`schema.OPERATIONS`), each stamped with the agent's term: a change of a term lower than the
highest the device has taken is refused (`StaleTerm`), so that an agent that no longer leads
cannot move it. The highest term is kept in a small file per device in the state folder
(`ServiceSpec.state_dir`, `ptb serve --state-dir`), written whole before a change of a new term
runs, and read when the service starts: the fence holds across the service's restarts.
"""
from __future__ import annotations

import collections
import json
import logging
import math
import pathlib
import threading
import time
from collections.abc import Callable, Generator
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
from photonic_testbed.hil.files import write_atomic

log = logging.getLogger(__name__)

# At most this share of a device's time goes to its telemetry: after a pass that took t s, the
# next begins t * (1 - share) / share s later at the earliest (never back to back; a pass that
# costs more than the rig's rate allows is read less often), and never sooner than the rate.
TELEMETRY_SHARE = 0.5


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
    # a driver call running longer than this is stuck (every blocking call has a shorter
    # deadline): the service's heartbeats stop, so that its supervisor restarts it afresh
    stuck_s: float = 15.0
    curve_secret: str | None = None           # server certificate (.key_secret)
    curve_authorized: str | None = None       # folder of authorised client .key files
    # where the device's highest agent term is kept across restarts (NAME.term); None: in
    # memory only (a service in a test, or run in-process)
    state_dir: str | None = None
    # "HOST:PORT" where the service's Prometheus metrics are served (hil.devices.metrics);
    # "": none
    metrics: str = ""


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
        self._server: Server | None = None      # from `bind` to `close` (`server`)
        self._telemetry_seq = 0
        # served from a loop (serve_together): its group, and the device's calls (on a thread
        # of its own); neither when the service answers in-process (`handle`)
        self.calls: DeviceCalls | None = None
        self._group: Loop | None = None
        self._facts: dict = {}                   # read from the device when opened (describe)
        self.telemetry: dict = {}                # the last telemetry pass's values
        # a health check or a turn of a telemetry pass, on the device's thread
        self._background: tuple[str, Future] | None = None
        self._pass: Generator[None, None, dict] | None = None    # (the device's thread's)
        self._pass_began = 0.0
        # the device's state read back at a pass's start (`DeviceKind.observe`), and the
        # version published when it was read: believed only while no change came meanwhile
        self._observed: tuple[str, dict] | None = None
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
            # (read before the device is opened: a damaged file stops the service first)
            term = read_term(self.term_file) if self.term_file is not None else 0
            if self.driver is None:
                self.driver = open_driver(self.kind, spec.driver, spec.address, spec.options)
            self._facts = self.kind.facts(self.driver)
            handlers: dict[str, Handler] = {op: self._handler(op, fn)
                                            for op, fn in self.kind.ops.items()}
            if self.is_switch:
                handlers["apply_circuits_together"] = self._apply_together
            handlers["fence"] = self._fence
            self._server = Server(
                self.name, {"kind": spec.kind, "online": True, **self.kind.state(self.driver)},
                kind=spec.kind, request=spec.request, publish=spec.publish, keys=keys,
                heartbeat=spec.heartbeat, handlers=handlers, describe=self._describe,
                publish_version=True, context=self._context)
            self._server.term = term
            self._server.on_term = self._keep_term
            request, publish = self._server.bind()
        except Exception:
            self.close()
            raise
        log.info("service %s (%s) on %s, publishing on %s", self.name, spec.kind, request,
                 publish)
        return request, publish

    def _fence(self, args: schema.Args) -> dict:
        """The request's agent term made this device's highest (kept first, as for any change
        of a new term); a lower one is refused (StaleTerm). Nothing else changes."""
        self.server.check_term(self.server.request_term)
        return {"device": self.name, "term": self.server.term}

    @property
    def term_file(self) -> pathlib.Path | None:
        """The file that keeps the highest agent term this device has taken (None: kept in
        memory only)."""
        if not self.spec.state_dir:
            return None
        return pathlib.Path(self.spec.state_dir) / f"{self.name}.term"

    def _keep_term(self, term: int) -> None:
        """A higher agent term, written whole before anything of it runs (a service that
        cannot keep it refuses the change: ServiceError)."""
        path = self.term_file
        if path is None:
            return
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            write_atomic(path, json.dumps({"device": self.name, "term": term}) + "\n")
        except OSError as e:
            raise ServiceError(f"{self.name}: cannot keep agent term {term} in {path}: "
                               f"{e.strerror or e}; the change is refused") from None

    @property
    def server(self) -> Server:
        """The device's request server (from `bind` to `close`)."""
        if self._server is None:
            raise ServiceError(f"service {self.name} is not bound (bind() it first) or is "
                               "closed")
        return self._server

    @property
    def facts(self) -> dict:
        """What was read from the device when it opened (its power budget, ...)."""
        return self._facts

    @property
    def is_switch(self) -> bool:
        """Whether the device is a switch (it offers `apply_circuits`)."""
        return "apply_circuits" in self.kind.ops

    def _describe(self) -> dict:
        """What the device is, without device I/O: answered at once, never behind it."""
        out = {"device": self.kind.describe(self.driver, self._facts)}
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
        deadline, term = self.server.request_deadline, self.server.request_term
        parts: list[tuple[DeviceService, Any]] = []
        for change in changes:
            peer = peers[change.switch]
            try:
                peer.server.claim_change(change.expect, term)
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
        if self._server is not None:
            self._server.close()
            self._server = None
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
        """Serve until `stop` is set: requests answered from this thread, the driver called
        from the device's own."""
        serve_together([self], stop)

    def attach(self, loop: Loop) -> None:
        """Served from `loop` (with the switches served with it): the driver is called from a
        thread of the device's own, one call at a time, so that the loop never waits for the
        device (`ping`, `describe` and `snapshot` are answered at once)."""
        self._group = loop
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
        """(Served from a loop) start a health check or a telemetry pass that is due, each a
        call in the device's queue, and publish one that is done; a pass in turns goes on with
        its next turn, queued behind the requests that came during the last. Returns when to
        look again: a check due, or the call under way turning stuck (while a check or a turn
        is under way, its end wakes the loop)."""
        self._background_step(now)
        look = self._watch_stuck(now)
        if self._background is not None:
            return look
        return min(self._next_health, self._next_telemetry, look)

    def _background_step(self, now: float) -> None:
        if self._background is not None:
            what, future = self._background
            if not future.done():
                return
            self._background = None
            if what == "health":
                self._apply_health(future)
            elif future.result() is None:                # more of the pass to read
                self._start_background("telemetry", lambda: self._telemetry_turn(False))
                return
            else:
                self._take_observed()
                self._send_telemetry(future.result(), now)
        if now >= self._next_health:
            self._next_health = now + self.spec.health
            self._start_background("health", self._read_health)
        elif now >= self._next_telemetry:
            self._next_telemetry, self._pass_began = math.inf, now
            # (a read-back while a change is under way or unpublished is not compared)
            version = self.server.version if self.server.settled else ""
            self._start_background("telemetry", lambda: self._telemetry_turn(True, version))

    def _take_observed(self) -> None:
        """What the pass read back of the device's state, published where it differs: unless
        a change was counted since it was read, or was still to be published when it was
        read or now (the change is then the newer word)."""
        if self._observed is None:
            return
        version, values = self._observed
        self._observed = None
        if version != self.server.version or not self.server.settled:
            return
        delta = self.server.noticed(values)
        if delta is not None:
            log.warning("%s: the device's %s changed behind its service (now version %s)",
                        self.name, " and ".join(sorted(values)), self.server.version)

    def _watch_stuck(self, now: float) -> float:
        """Heartbeats stop while a driver call runs past `spec.stuck_s` (the device or its
        driver hangs: the supervisor restarts the service with a fresh driver), and start
        again once it ends; returns when to look again."""
        began = self.calls.busy_since if self.calls is not None else None
        ran = None if began is None else now - began      # the call under way, so far
        stuck = ran is not None and ran >= self.spec.stuck_s
        server = self.server
        if stuck == server.beating:
            server.beating = not stuck
            server.online = not stuck        # (its next health check says more)
            server.update({"online": not stuck})
            if stuck:
                log.warning("%s: a device call has run for %.1f s: stuck; heartbeats stop",
                            self.name, ran)
            else:
                log.warning("%s: the stuck device call ended; heartbeats again", self.name)
        return began + self.spec.stuck_s if began is not None and not stuck else math.inf

    def _start_background(self, what: str, fn: Callable[[], Any]) -> None:
        assert self.calls is not None, "ticked without a loop"
        self._background = (what, self.calls.submit(fn))

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

    def _telemetry_turn(self, first: bool, version: str = "") -> dict | None:
        """(The device's thread) one turn of a telemetry pass: None while more are to come,
        then the pass's values ({} when it failed or has nothing to report). The first turn
        reads back the device's state too (`DeviceKind.observe`; `version`: the one published
        then)."""
        try:
            if first:
                if self.kind.observe is not None:
                    self._observed = (version, self.kind.observe(self.driver))
                telemetry = self.kind.telemetry
                if telemetry is None:               # (a kind without: nothing to report)
                    return {}
                got = telemetry(self.driver)
                if not isinstance(got, Generator):
                    return got
                self._pass = got
            elif self._pass is None:                # (the pass has ended: nothing more)
                return {}
            next(self._pass)
            return None
        except StopIteration as end:
            self._pass = None
            return end.value or {}
        except Exception as e:
            self._pass = None
            log.debug("%s: telemetry read failed: %s", self.name, e)
            return {}

    def _send_telemetry(self, values: dict, now: float) -> None:
        """A pass's values published; the next pass set no sooner than the rate allows, and
        late enough that telemetry takes at most TELEMETRY_SHARE of the device's time."""
        cost = now - self._pass_began
        self._next_telemetry = max(self._pass_began + self._period,
                                   now + cost * (1.0 - TELEMETRY_SHARE) / TELEMETRY_SHARE)
        if not values:
            return                          # this driver has nothing to report
        self._telemetry_seq += 1
        self.telemetry = values              # (the last pass's: read by the metrics)
        self.server.pub.send(schema.telemetry(self.name, self._telemetry_seq, time.time(),
                                              values))


def read_term(path: pathlib.Path) -> int:
    """The highest agent term kept in `path` (0 when there is no file yet); ServiceError for a
    file that does not say one: the fence is not guessed."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return 0
    except OSError as e:
        raise ServiceError(f"cannot read the agent term file {path}: {e.strerror or e}") \
            from None
    try:
        term = json.loads(text)["term"]
        if type(term) is not int or term < 0:
            raise ValueError(f"term {term!r} is not a whole number >= 0")
    except (ValueError, KeyError, TypeError) as e:
        raise ServiceError(f"the agent term file {path} is damaged ({e}): it holds the highest "
                           "term this device has taken; remove it only when no agent of an "
                           "older term can run") from None
    return term


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
        if ready is None:
            raise
        ready.send(("error", f"{type(e).__name__}: {e}"))     # the parent says it, once
        return
    if spec.metrics:
        try:
            from photonic_testbed.hil.devices.metrics import ServiceMetrics
            ServiceMetrics([service]).serve_at(spec.metrics)
        except (ImportError, OSError, ValueError) as e:
            service.close()
            if ready is None:
                raise
            ready.send(("error", f"its metrics on {spec.metrics}: {e}"))
            return
    if ready is not None:
        ready.send(("ready", endpoints))
    if threading.current_thread() is threading.main_thread():
        heap.settle("start-up")         # (the process's own: not a test's thread)
    try:
        service.serve(stop)
    finally:
        service.close()
