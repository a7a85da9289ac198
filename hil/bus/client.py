"""Calling a server on the bus: request ids, deadlines, typed errors, retries, reconnection.

    with ServiceClient("tcp://127.0.0.1:5601") as heaters:
        heaters.call("set_heaters", volts=[0.0, 1.5, 2.0], expect=version)
        heaters.call("read_heaters")

`call` sends one request carrying an id and the time it may take (`ttl_ms`), and returns the
result or raises: the error the server answered, as the class of that name in
`hil.bus.errors` (`StaleState`, `BadRequest`...; a driver's own error is a `RemoteError` with
its name in `kind`), or `ServiceUnavailable` when no answer came in time. A server silent for
an attempt (0.25 s, doubling to 1 s) gets the request again on a fresh socket (nothing queued
for a dead peer is delivered later to its successor), until the deadline: a client rides
through a service restart by itself. Every retry carries the request's first id, so a changing
operation still runs at most once: the server answers a retry of a change it already ran with
its first answer (hil.bus.server). A client of an agent carries its `term` in every request (a
change of a lower term than a server has seen is refused: `StaleTerm`).

Not thread-safe (ZeroMQ sockets are not): one client per thread.
"""
from __future__ import annotations

import itertools
import logging
import threading
import time
import uuid
from collections.abc import Callable, Sequence

import zmq

from photonic_testbed.hil.bus import schema
from photonic_testbed.hil.bus.errors import (  # noqa: F401  (re-exported for callers)
    BadRequest,
    BusError,
    Cancelled,
    DeadlineExceeded,
    NotLeader,
    RemoteError,
    ServiceUnavailable,
    StaleState,
    StaleTerm,
    Unauthorized,
    UnknownOperation,
    from_wire,
)
from photonic_testbed.hil.bus.security import ClientKeys, make_client

log = logging.getLogger(__name__)

FIRST_ATTEMPT_S = 0.25          # how long a server may stay silent before the request is resent
LAST_ATTEMPT_S = 1.0            # the longest wait between resends
CANCEL_CHECK_S = 0.05           # a cancellable wait looks at its event this often


_ids = itertools.count(1)


class ServiceClient:
    """Requests to one device service (its ROUTER endpoint)."""

    def __init__(self, endpoint: str, *, timeout: float = 2.0, keys: ClientKeys | None = None,
                 context: zmq.Context | None = None, cancel: threading.Event | None = None,
                 term: int | None = None, guard: Callable[[], object] | None = None):
        self.endpoint = endpoint
        # called before a change is sent (an agent's: it raises once the agent no longer
        # leads, so that a deposed leader sends nothing)
        self.guard = guard
        self.timeout = timeout
        # the agent's term, sent with every request (None: not an agent's client)
        self.term = term
        # set from any thread, it ends a wait for an answer within CANCEL_CHECK_S (Cancelled):
        # the owner of the client is closing and its calls must not hold it up
        self.cancel = cancel
        self.keys = keys
        self._ctx = context or zmq.Context.instance()
        self._sock: zmq.Socket | None = None
        self._prefix = f"{uuid.uuid4().hex[:12]}-"       # unique among every client's ids
        self.version: str | None = None     # the state version in the last reply
        self.reconnects = 0
        self._connect()

    def _connect(self) -> None:
        sock = self._ctx.socket(zmq.DEALER)
        sock.linger = 0
        sock.ipv6 = "[" in self.endpoint     # an IPv6 literal, tcp://[::1]:port
        sock.immediate = True               # queue nothing for a peer that is not connected
        sock.reconnect_ivl = 20
        sock.reconnect_ivl_max = 100        # find a restarted service quickly
        make_client(sock, self.keys)
        sock.connect(self.endpoint)
        self._sock = sock

    def reconnect(self) -> None:
        """A fresh socket: answers still on their way to the old one (a late answer to a
        request given up on) are never read as answers to a request sent from now on."""
        self._reset()

    def _reset(self) -> None:
        if self._sock is not None:
            self._sock.close(linger=0)
        self.reconnects += 1
        self._connect()

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close(linger=0)
            self._sock = None

    def _open(self) -> zmq.Socket:
        """The socket, while the client is not closed."""
        if self._sock is None:
            raise BusError(f"the client of {self.endpoint} is closed")
        return self._sock

    def __enter__(self) -> ServiceClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- requests ---------------------------------------------------------------------------

    def new_request_id(self) -> str:
        """A request id no other client's request has (for `call`'s `request_id`)."""
        return self._prefix + str(next(_ids))

    def send(self, op: str, args: dict | None = None, *, ttl: float | None = None,
             expect: str | None = None, wait: float = 0.0, rid: str | None = None) -> str:
        """Send one request (a retry when `rid` is given: the same id), waiting at most `wait`
        seconds for a connection (a request is never queued for a peer that is not connected);
        returns its id (for `receive`)."""
        sock = self._open()
        declared = schema.OPERATIONS.get(op)
        if self.guard is not None and (declared is None or not declared.read_only):
            self.guard()
        rid = rid or self._prefix + str(next(_ids))
        ttl = self.timeout if ttl is None else ttl
        msg = schema.make("request", id=rid, op=op, args=args or {}, ttl_ms=ttl * 1e3,
                          expect=expect, term=self.term)
        frame = schema.encode(msg)
        try:
            sock.send(frame, zmq.NOBLOCK)
        except zmq.Again:
            # Not connected (yet): wait for the connection, else the caller's wait times out
            # and it retries on a fresh socket.
            if wait > 0 and sock.poll(max(1, int(wait * 1e3)), zmq.POLLOUT):
                try:
                    sock.send(frame, zmq.NOBLOCK)
                except zmq.Again:
                    pass
        return rid

    def receive(self, rid: str, deadline: float):
        """Wait until `deadline` (time.monotonic) for the answer to request `rid`."""
        sock = self._open()
        while True:
            if self.cancel is not None and self.cancel.is_set():
                raise Cancelled(f"gave up waiting for {self.endpoint}: the client is closing")
            left = deadline - time.monotonic()
            if self.cancel is not None:
                left = min(left, CANCEL_CHECK_S)
            # past the deadline, an answer already waiting is still taken (poll(0))
            if not sock.poll(max(1, int(left * 1e3)) if left > 0 else 0):
                if time.monotonic() >= deadline:
                    raise ServiceUnavailable(f"no answer from {self.endpoint} in time")
                continue
            frame = sock.recv()
            try:
                msg = schema.decode_message(frame)
            except schema.SchemaError as e:
                log.warning("%s answered an undecodable frame: %s", self.endpoint, e)
                continue
            if isinstance(msg, schema.Reply):
                if msg.id != rid:
                    continue    # a late answer to an earlier request that we gave up on
                self.version = msg.version
                return msg.result
            if isinstance(msg, schema.Error):
                if msg.id != rid:
                    continue
                if msg.version:
                    self.version = msg.version
                raise from_wire(msg.error, msg.message, msg.version)
            log.warning("%s answered a %s message to a request", self.endpoint,
                        msg.__struct_config__.tag)

    def call(self, op: str, *, timeout: float | None = None, expect: str | None = None,
             request_id: str | None = None, **args):
        """Run `op` on the server and return its result (see the module doc). `request_id`:
        the request's id, for a caller that asks again after giving up on an answer (the
        server answers a repeat of an id it has run, never runs it twice)."""
        timeout = self.timeout if timeout is None else timeout
        got = call_many([(self, op, args)], timeout, expect=expect,
                        request_ids=[request_id])[0]
        if isinstance(got, BusError):
            raise got
        return got


def call_many(requests: Sequence[tuple[ServiceClient, str, dict] |
                                 tuple[ServiceClient, str, dict, str | None]],
              timeout: float, *, expect: str | None = None,
              request_ids: Sequence[str | None] = ()) -> list:
    """Requests to several servers at once: sent together, answered as they come, so the wait
    is the slowest answer, not the sum. Returns, in order, each result or the BusError it got.
    A server silent for an attempt (0.25 s, doubling to 1 s) gets its request again, with the
    same id, on a fresh socket, until `timeout`; then ServiceUnavailable. A request's fourth
    item, when given, is its own `expect` (the state version its change was computed from)."""
    deadline = time.monotonic() + timeout
    results: list = [None] * len(requests)
    waiting = set(range(len(requests)))
    rids: dict[int, str] = {i: r for i, r in enumerate(request_ids) if r}
    attempt = min(timeout, FIRST_ATTEMPT_S)
    while waiting:
        until = min(deadline, time.monotonic() + attempt)
        for i in sorted(waiting):
            client, op, args, *own = requests[i]
            rids[i] = client.send(op, args, ttl=max(deadline - time.monotonic(), 0.001),
                                  expect=own[0] if own else expect,
                                  wait=max(0.0, until - time.monotonic()), rid=rids.get(i))
        for i in sorted(waiting):
            try:
                results[i] = schema.read_result(requests[i][1],
                                                requests[i][0].receive(rids[i], until))
            except Cancelled as e:
                results[i] = e
            except ServiceUnavailable:
                continue
            except BusError as e:
                results[i] = e
            waiting.discard(i)
        if not waiting or time.monotonic() >= deadline:
            break
        for i in waiting:
            requests[i][0]._reset()
        attempt = min(attempt * 2, LAST_ATTEMPT_S)
    for i in waiting:
        client, op = requests[i][:2]
        results[i] = ServiceUnavailable(f"{op}: no answer from {client.endpoint} within "
                                        f"{timeout:g} s")
    return results
