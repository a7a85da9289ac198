"""Publishing a state that is not a device's (the agent's view of the fabric, a job's phase)
with the same mirror protocol as the device services, from the owner's own loop.

    server = StateServer("agent", {"circuits": {}, "spares": []},
                         request="tcp://127.0.0.1:5690", publish="tcp://127.0.0.1:5691")
    server.bind()
    while running:
        server.poll(0.05)                    # answers snapshot/ping, sends heartbeats
        server.update({"spares": ["gpu7"]})  # one delta to every subscriber

Subscribers use `StateSubscriber` exactly as for a device. Extra read-only requests can be
offered with `handlers` ({op: fn(args) -> result}); nothing here changes hardware, so nothing
here is compare-and-set. A handler whose answer takes time (a slow instrument) returns a
`concurrent.futures.Future` instead of the result: the loop goes on (events, heartbeats, other
requests) and the answer is sent by the first `poll` after the future is done.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Future

import zmq

from photonic_testbed.hil.bus import schema
from photonic_testbed.hil.bus.mirror import StatePublisher
from photonic_testbed.hil.bus.security import ServerKeys, start_authenticator
from photonic_testbed.hil.bus.service import Publisher, UnknownOperation, bind_sockets, \
    close_sockets

log = logging.getLogger(__name__)


class StateServer:
    def __init__(self, name: str, state: dict, *, request: str = "tcp://127.0.0.1:0",
                 publish: str = "tcp://127.0.0.1:0", keys: ServerKeys | None = None,
                 heartbeat: float = 0.5,
                 handlers: Mapping[str, Callable[[dict], object]] | None = None):
        self.name = name
        self._initial = state
        self._endpoints = (request, publish)
        self.keys = keys
        self.heartbeat = heartbeat
        self.handlers = dict(handlers or {})
        self.ctx = zmq.Context()
        self.auth = None
        self.router: zmq.Socket | None = None
        self.pub: Publisher | None = None
        self.state: StatePublisher | None = None
        self._next_beat = 0.0
        self._later: list[tuple[list[bytes], str, Future]] = []   # answers a future will give

    def bind(self) -> tuple[str, str]:
        try:
            if self.keys is not None:
                self.auth = start_authenticator(self.ctx, self.keys)
            self.router, self.pub = bind_sockets(self.ctx, self.keys, *self._endpoints)
            self.state = StatePublisher(self.name, self._initial, self.pub.send)
        except Exception:
            self.close()
            raise
        return self.router.last_endpoint.decode(), self.pub.endpoint

    def update(self, values: Mapping) -> dict | None:
        return self.state.update(values)

    def change(self, ops: list) -> dict | None:
        return self.state.change(ops)

    def poll(self, timeout: float = 0.0) -> int:
        """Answer waiting requests (waiting at most `timeout` for the first) and send a
        heartbeat when one is due. Returns the number of requests answered."""
        now = time.monotonic()
        if now >= self._next_beat:
            self.pub.send(schema.make("heartbeat", device=self.name,
                                      incarnation=self.state.incarnation, seq=self.state.seq,
                                      t=time.time(), online=True, interval=self.heartbeat))
            self._next_beat = now + self.heartbeat
        answered = self._send_later()
        wait = min(timeout, max(0.0, self._next_beat - now))
        if self._later:
            wait = min(wait, 0.005)             # an answer may be ready soon: look again
        if not self.router.poll(int(wait * 1e3)):
            return answered + self._send_later()
        while True:
            try:
                frames = self.router.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return answered
            reply = self._answer(frames)
            if reply is not None:
                self._send(reply)
                answered += 1

    def _send(self, reply: list[bytes]) -> None:
        try:
            self.router.send_multipart(reply, zmq.NOBLOCK)
        except zmq.ZMQError as e:
            log.debug("%s: reply not delivered: %s", self.name, e)

    def _send_later(self) -> int:
        """Send the answers whose futures are done; returns how many."""
        done = [x for x in self._later if x[2].done()]
        if not done:
            return 0
        self._later = [x for x in self._later if not x[2].done()]
        for envelope, rid, future in done:
            try:
                frame = self._reply_frame(rid, future.result())
            except Exception as e:
                frame = self._error_frame(rid, e)
            self._send([*envelope, frame])
        return len(done)

    def _reply_frame(self, rid: str, result) -> bytes:
        return schema.encode(schema.make("reply", id=rid, result=result,
                                         version=f"{self.state.incarnation}:{self.state.seq}"))

    @staticmethod
    def _error_frame(rid: str | None, e: BaseException) -> bytes:
        return schema.encode(schema.make("error", id=rid, error=type(e).__name__,
                                         message=str(e) or type(e).__name__))

    def _answer(self, frames: list[bytes]) -> list[bytes] | None:
        rid = None
        try:
            if not 2 <= len(frames) <= 3:
                raise schema.BadFrame(f"a request is one frame after the envelope, not "
                                      f"{len(frames) - 1}")
            msg = schema.decode(frames[-1])
            if msg["type"] != "request":
                raise schema.UnknownType(f"this end takes requests, not {msg['type']!r}")
            rid, op = msg["id"], msg["op"]
            if op == "snapshot":
                result = self.state.snapshot()
            elif op == "ping":
                result = {"device": self.name, "incarnation": self.state.incarnation,
                          "seq": self.state.seq}
            elif op in self.handlers:
                result = self.handlers[op](msg.get("args", {}))
                if isinstance(result, Future):
                    self._later.append((frames[:-1], rid, result))
                    return None
            else:
                raise UnknownOperation(f"{self.name} offers ping, snapshot"
                                       + "".join(f", {k}" for k in sorted(self.handlers)))
            frame = self._reply_frame(rid, result)
        except Exception as e:
            frame = self._error_frame(rid, e)
        return [*frames[:-1], frame]

    def close(self) -> None:
        close_sockets(self.router, self.pub, self.auth)
        self.router = self.pub = self.auth = None
        if not self.ctx.closed:
            self.ctx.term()

    def __enter__(self) -> "StateServer":
        self.bind()
        return self

    def __exit__(self, *exc) -> None:
        self.close()
