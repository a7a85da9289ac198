"""Calling a device service: request ids, deadlines, typed errors, reconnection by itself.

    with ServiceClient("tcp://127.0.0.1:5601") as heaters:
        heaters.call("set_heaters", volts=[0.0, 1.5, 2.0], expect=version)
        heaters.call("read_heaters")

`call` sends one request carrying a fresh id and the time it may take (`ttl_ms`), waits at most
that long, and returns the result or raises: a `RemoteError` named after the exception the
service or its driver raised (`StaleState`, `DACTimeout`, ...), or `ServiceUnavailable` when no
answer came in time. After a timeout the socket is replaced (nothing queued for a dead peer is
delivered later to its successor), and read-only operations are retried until the deadline, so
a client rides through a service restart by itself. Changing operations are not retried: the
caller re-reads the state and decides (compare-and-set makes that safe).

Not thread-safe (ZeroMQ sockets are not): one client per thread.
"""
from __future__ import annotations

import itertools
import logging
import os
import time

import zmq

from photonic_testbed.hil.bus import schema
from photonic_testbed.hil.bus.security import ClientKeys, make_client

log = logging.getLogger(__name__)


class BusError(Exception):
    """Anything that went wrong on the bus."""


class ServiceUnavailable(BusError):
    """No answer from the service within the deadline (down, restarting, or refusing our key)."""


class RemoteError(BusError):
    """The service refused or failed a request; `kind` is the exception's class name there."""

    kind = "RemoteError"

    def __init__(self, kind: str, message: str, version: str | None = None):
        self.kind = kind
        self.version = version
        super().__init__(f"{kind}: {message}")
        self.remote_message = message


class StaleState(RemoteError):
    """Compare-and-set failed: the device changed since the state version the caller named."""


class DeadlineExceeded(RemoteError):
    """The request waited past its deadline in the service's queue and was not run."""


class BadRequest(RemoteError):
    """The service could not decode the request, or its arguments are wrong."""


class UnknownOperation(RemoteError):
    """The device does not offer this operation."""


_KNOWN = {cls.__name__: cls for cls in (StaleState, DeadlineExceeded, BadRequest,
                                        UnknownOperation)}
for _name in ("SchemaError", "FrameTooLarge", "BadFrame", "UnknownVersion", "UnknownType",
              "MissingField", "WrongType"):
    _KNOWN[_name] = BadRequest


def remote_error(kind: str, message: str, version: str | None = None) -> RemoteError:
    return _KNOWN.get(kind, RemoteError)(kind, message, version)


_ids = itertools.count(1)


class ServiceClient:
    """Requests to one device service (its ROUTER endpoint)."""

    def __init__(self, endpoint: str, *, timeout: float = 2.0, keys: ClientKeys | None = None,
                 context: zmq.Context | None = None):
        self.endpoint = endpoint
        self.timeout = timeout
        self.keys = keys
        self._ctx = context or zmq.Context.instance()
        self._sock: zmq.Socket | None = None
        self._prefix = f"{os.getpid():x}-{id(self):x}-"
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

    def _reset(self) -> None:
        if self._sock is not None:
            self._sock.close(linger=0)
        self.reconnects += 1
        self._connect()

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close(linger=0)
            self._sock = None

    def __enter__(self) -> "ServiceClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- requests ---------------------------------------------------------------------------

    def send(self, op: str, args: dict | None = None, *, ttl: float | None = None,
             expect: str | None = None, wait: float = 0.0) -> str:
        """Send one request, waiting at most `wait` seconds for a connection (a request is
        never queued for a peer that is not connected); returns its id (for `receive`)."""
        if self._sock is None:
            raise BusError("the client is closed")
        rid = self._prefix + str(next(_ids))
        ttl = self.timeout if ttl is None else ttl
        msg = schema.make("request", id=rid, op=op, args=args or {}, ttl_ms=ttl * 1e3,
                          expect=expect)
        frame = schema.encode(msg)
        try:
            self._sock.send(frame, zmq.NOBLOCK)
        except zmq.Again:
            # Not connected (yet): wait for the connection, else the caller's wait times out
            # and it retries on a fresh socket.
            if wait > 0 and self._sock.poll(max(1, int(wait * 1e3)), zmq.POLLOUT):
                try:
                    self._sock.send(frame, zmq.NOBLOCK)
                except zmq.Again:
                    pass
        return rid

    def receive(self, rid: str, deadline: float):
        """Wait until `deadline` (time.monotonic) for the answer to request `rid`."""
        while True:
            left = deadline - time.monotonic()
            # past the deadline, an answer already waiting is still taken (poll(0))
            if not self._sock.poll(max(1, int(left * 1e3)) if left > 0 else 0):
                if time.monotonic() >= deadline:
                    raise ServiceUnavailable(f"no answer from {self.endpoint} in time")
                continue
            frame = self._sock.recv()
            try:
                msg = schema.decode(frame)
            except schema.SchemaError as e:
                log.warning("%s answered an undecodable frame: %s", self.endpoint, e)
                continue
            if msg.get("id") != rid:
                continue        # a late answer to an earlier request that we gave up on
            if msg["type"] == "reply":
                self.version = msg["version"]
                return msg["result"]
            if msg["type"] == "error":
                if msg.get("version"):
                    self.version = msg["version"]
                raise remote_error(msg["error"], msg["message"], msg.get("version"))
            log.warning("%s answered a %s message to a request", self.endpoint, msg["type"])

    def call(self, op: str, *, timeout: float | None = None, expect: str | None = None,
             **args):
        """Run `op` on the service and return its result (see the module doc)."""
        timeout = self.timeout if timeout is None else timeout
        if op not in schema.CHANGING:            # read-only: retried until the deadline
            got = call_many([(self, op, args)], timeout)[0]
            if isinstance(got, BusError):
                raise got
            return got
        deadline = time.monotonic() + timeout
        rid = self.send(op, args, ttl=timeout, expect=expect, wait=timeout)
        try:
            return self.receive(rid, deadline)
        except ServiceUnavailable:
            self._reset()
            raise ServiceUnavailable(
                f"{op}: no answer from {self.endpoint} within {timeout:g} s") from None


def call_many(requests: list[tuple[ServiceClient, str, dict]], timeout: float) -> list:
    """Read-only requests to several services at once: sent together, answered as they come,
    so the wait is the slowest answer, not the sum. Returns, in order, each result or the
    BusError it got. As `call` does, a service silent for an attempt (0.25 s, doubling) gets
    its request again on a fresh socket, until `timeout`; then ServiceUnavailable."""
    for _, op, _ in requests:
        if op in schema.CHANGING:
            raise ValueError(f"call_many is for read-only operations, not {op!r}")
    deadline = time.monotonic() + timeout
    results: list = [None] * len(requests)
    waiting = set(range(len(requests)))
    attempt = min(timeout, 0.25)
    while waiting:
        until = min(deadline, time.monotonic() + attempt)
        rids = {}
        for i in sorted(waiting):
            client, op, args = requests[i]
            rids[i] = client.send(op, args, ttl=max(deadline - time.monotonic(), 0.001),
                                  wait=max(0.0, until - time.monotonic()))
        for i, rid in rids.items():
            try:
                results[i] = requests[i][0].receive(rid, until)
            except ServiceUnavailable:
                continue
            except BusError as e:
                results[i] = e
            waiting.discard(i)
        if not waiting or time.monotonic() >= deadline:
            break
        for i in waiting:
            requests[i][0]._reset()
        attempt = min(attempt * 2, 0.5)
    for i in waiting:
        client, op, _ = requests[i]
        results[i] = ServiceUnavailable(f"{op}: no answer from {client.endpoint} within "
                                        f"{timeout:g} s")
    return results
