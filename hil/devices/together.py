"""Device services served from one thread (`serve_together`, what `ptb serve --one-process`
runs), and `apply_circuits_together` under way (`Batch`).

The loop takes every service's requests in, answers them and publishes their state; each
device's driver calls go through its `DeviceCalls` (hil.devices.calls): one at a time in arrival
order (its one writer), on the device's own thread or, for a change whose answer can be awaited
on the device's socket, sent from the loop's thread and read there when it comes. A service
cooperates with the loop through its public side: `attach`/`detach`, `tick` (health checks and
telemetry), `calls`, and its `server`.
"""
from __future__ import annotations

import collections
import logging
import math
import os
import threading
import time
import uuid
from collections.abc import Sequence
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

import zmq

from photonic_testbed.hil.bus.errors import StaleState, to_wire
from photonic_testbed.hil.bus.server import Answer
from photonic_testbed.hil.devices.calls import DeviceCalls

if TYPE_CHECKING:
    from photonic_testbed.hil.devices.service import DeviceService

log = logging.getLogger(__name__)

STOP_NOTICED_S = 0.1          # how soon the loop notices `stop`
DEVICE_THREAD_END_S = 2.0     # how long a closing loop waits for a device's call under way


class Batch:
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


class Loop:
    """What the services served together share: the poller, the wake-ups, the switches that
    one `apply_circuits_together` may name and the batches under way."""

    def __init__(self, services: Sequence[DeviceService]):
        self.id = uuid.uuid4().hex[:12]
        self.switches = {s.name: s for s in services if s.is_switch}
        self.batches: list[Batch] = []       # apply_circuits_together under way
        self.poller = zmq.Poller()
        self.ready: collections.deque[DeviceCalls] = collections.deque()   # a call ended
        self.owner: dict[Any, DeviceService] = {}     # router or socket number -> service
        self.served: dict[DeviceCalls, DeviceService] = {}
        self.timers: dict[DeviceCalls, float] = {}
        self.wake_r, self.wake_w = os.pipe()
        os.set_blocking(self.wake_r, False)
        os.set_blocking(self.wake_w, False)
        self.poller.register(self.wake_r, zmq.POLLIN)
        for service in services:
            self.poller.register(service.server.router, zmq.POLLIN)
            self.owner[service.server.router] = service

    def add_batch(self, batch: Batch) -> None:
        self.batches.append(batch)

    # ---- CallLoop (hil.devices.calls) ---------------------------------------------------------

    def wake(self, calls: DeviceCalls) -> None:
        """Called by a device's thread after each call."""
        self.ready.append(calls)
        try:
            os.write(self.wake_w, b"\0")
        except OSError:          # the pipe is full (the loop is awake anyway), or closed
            pass

    def watch(self, sock: Any, calls: DeviceCalls) -> None:
        """Wake for a device's socket (a native one: the poller names it by its number)."""
        self.poller.register(sock, zmq.POLLIN)
        self.owner[sock.fileno()] = self.served[calls]

    def unwatch(self, sock: Any) -> None:
        if self.owner.pop(sock.fileno(), None) is not None:
            self.poller.unregister(sock)

    def later(self, calls: DeviceCalls, seconds: float) -> None:
        self.timers[calls] = time.monotonic() + seconds

    def close(self) -> None:
        os.close(self.wake_r)
        os.close(self.wake_w)


def serve_together(services: Sequence[DeviceService], stop: threading.Event) -> None:
    """Serve bound services from this one thread until `stop` is set.

    This thread takes every service's requests in, answers them and publishes their state;
    it never waits for a device, so `ping`, `describe` and `snapshot` are answered at once.
    Each device's driver calls run one at a time in arrival order (its one writer): a change
    whose answer can be awaited on the device's socket (a switch's new circuits:
    `DeviceKind.begins`) is sent from here and its answer read here when it comes; every
    other call (and anything that may block: a refusal's error queue, a dropped session, a
    turn of a telemetry pass) runs on the device's own thread. Requests to 64 switches at
    once are then 64 lines sent and 64 answers read by one thread, not 64 threads that each
    decode, write, wait, answer and publish while contending for the interpreter
    (BENCHMARKS.md, "datacenter"); a slow or silent device holds up only its own requests."""
    loop = Loop(services)
    for service in services:
        service.attach(loop)
        if service.calls is not None:
            loop.served[service.calls] = service
    # When each service next has work of its own (a tick, a queued request or heartbeat, an
    # awaited answer's deadline): worked out again only for the services handled or due, since
    # nothing else changes it; -inf: to be worked out.
    wake: dict[DeviceService, float] = {service: -math.inf for service in services}
    try:
        while not stop.is_set():
            _turn(loop, wake)
    finally:
        ended = time.monotonic() + DEVICE_THREAD_END_S
        for service in services:
            service.stop_calls()
        for service in services:
            if not service.detach(ended - time.monotonic()):
                log.warning("%s: a device call did not end within %.0f s", service.name,
                            DEVICE_THREAD_END_S)
        loop.close()


def _deadline(service: DeviceService) -> float:
    return service.calls.deadline if service.calls is not None else math.inf


def _turn(loop: Loop, wake: dict[DeviceService, float]) -> None:
    """One wait for work and the work it found."""
    now = time.monotonic()
    for service in [s for s, when in wake.items() if when <= now]:
        wake[service] = min(service.tick(now), service.server.due, _deadline(service))
    due = min(now + STOP_NOTICED_S, min(wake.values()))
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
        owner = loop.owner.get(sock)
        if owner is None:
            continue
        if isinstance(sock, int) and owner.calls is not None:     # an awaited answer
            owner.calls.on_readable()
            touched[owner] = None
            if not owner.server.answering:
                continue        # (a part of a request to another service)
        todo[owner] = None
    while loop.ready:
        calls = loop.ready.popleft()
        calls.call_done()
        service = loop.served[calls]
        touched[service] = None
        if service.server.answering:
            todo[service] = None
    now = time.monotonic()
    for calls, when in list(loop.timers.items()):
        if when <= now:
            del loop.timers[calls]
            calls.look_again()
            todo[loop.served[calls]] = None
    for batch in [b for b in loop.batches if b.ready()]:
        loop.batches.remove(batch)
        batch.future.set_result(batch.answer())
        todo[batch.receiver] = None
    for service in [s for s, when in wake.items() if when <= now]:
        if service.server.due <= now:
            todo[service] = None
        elif service.calls is not None and service.calls.deadline <= now:
            service.calls.on_deadline()
            todo[service] = None
    for service in todo:
        service.server.poll(0)
        wake[service] = -math.inf
    for service in touched:
        wake[service] = -math.inf
