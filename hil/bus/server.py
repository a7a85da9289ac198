"""The one request/reply server of the bus: every endpoint that answers requests (a device
service, the agent, a GPU monitor) is a `Server` with its operations and its published state.

    server = Server("agent", {"phase": None}, kind="agent",
                    handlers={"phase": on_phase, "admit": on_admit})
    server.bind()
    while running:
        server.poll(0.05)              # answers requests, sends heartbeats
        server.update({"phase": "dp"}) # one delta to every subscriber

The contract (docs/bus.md "Requests"):

- Every operation is declared once in `schema.OPERATIONS` (its arguments, whether it only
  reads, and the roles that may call it); a server offers `ping`, `describe`, `snapshot` and the
  operations it has handlers for. Anything else is refused with `UnknownOperation`; a caller
  whose key's role may not call the operation (or whose key is no longer authorised) with
  `Unauthorized`, naming the key and the operation; arguments that do not fit their
  declaration with `BadRequest`; all before the handler runs. With CURVE the caller is the key
  its connection authenticated with (hil.bus.security: the ZAP User-Id of the request's frame,
  looked up in the authorised keys as they are now); without, every caller is trusted with
  every role. A handler that needs to know who asks (the agent: whose job) reads `caller`.
- A changing operation (not read-only) runs at most once per request id: the server keeps the
  answers of recent changing requests, so a client's retry with the same id (after a timeout,
  on a fresh socket) gets the first answer and the handler never runs twice. A retry that comes
  while the first is still being answered (a handler that returned a Future) is answered with it.
- A changing request that carries an agent's term (`term`) runs only if no higher term was
  seen (a fence: `StaleTerm`); a higher one is kept as the highest (`on_term` first, which a
  device service writes to a file). One that names a state version (`expect`) runs only at that
  version (compare-and-set, `StaleState` otherwise). The version is `INCARNATION:N`, N counting
  the changing requests this process ran.
- A changing operation that changes the devices served with this one (`apply_circuits_together`,
  declared not `counted`) moves each such device's version, not this server's; each device's
  part names its own expected version and is fenced by that device's term (`claim_change`).
- When a key is taken out of the authorised folder (or its role changes), the PUB socket is
  bound afresh, so that every subscriber reconnects and authenticates again: the revoked one
  cannot; the others miss what was published meanwhile, see the gap and fetch a snapshot.
- A request that waited in the queue longer than its `ttl_ms` is not run (`DeadlineExceeded`).
- One request at a time, in arrival order: a device's one writer.

A handler takes the checked arguments (the operation's Struct from `schema.OPERATIONS`, defaults
filled in; `schema.NO_ARGS` for an operation without arguments) and returns the result, or a
`concurrent.futures.Future` of it when the answer takes time (a slow instrument): the loop goes
on (heartbeats, other requests) and the answer goes out at the first `poll` after it is done.
A handler (or its Future) that changed state returns `Answer(result, state)`: `state` is
published after the reply has gone (for a Future, once it is done: the state and the version
then move together).
"""
from __future__ import annotations

import collections
import heapq
import logging
import math
import time
import uuid
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import zmq

from photonic_testbed.hil.bus import schema
from photonic_testbed.hil.bus.errors import (
    BadFrame,
    BadRequest,
    DeadlineExceeded,
    RemoteError,
    StaleState,
    StaleTerm,
    Unauthorized,
    UnencodableResult,
    UnknownOperation,
    UnknownType,
    to_wire,
)
from photonic_testbed.hil.bus.mirror import StatePublisher
from photonic_testbed.hil.bus.security import (
    TRUSTED,
    Authenticator,
    Identity,
    KeyTable,
    ServerKeys,
    make_server,
    start_authenticator,
    user_name,
)
from photonic_testbed.hil.bus.state import StateOp

log = logging.getLogger(__name__)

QUEUE_LIMIT = 1000              # requests taken off the socket ahead of the one being run
HARD_FRAME_LIMIT = 16 * schema.MAX_FRAME   # above this ZeroMQ drops the peer's connection
DONE_KEPT = 4096                # answers of changing requests kept for retries...
DONE_BYTES = 16 << 20           # ...at most this many bytes of them...
DONE_AGE_S = 600.0              # ...for at most this long (a request without a ttl_ms)...
DONE_GRACE_S = 5.0              # ...or this long past the request's ttl_ms, when it has one
READ_KEPT_S = 30.0              # a read's answer serves its own retries for this long
READ_BYTES = 4 << 20            # ...within this many bytes of reads' answers
RETRY_GRACE_S = 0.1             # well inside the client's first wait (hil.bus.client)
REBIND_S = 2.0                  # for the PUB socket's port to be free again after its close

# (the operation's checked arguments, a `schema.Args` Struct of its own type) -> its result
Handler = Callable[[Any], Any]
BUILTIN = ("ping", "describe", "snapshot")


class Publisher:
    """A PUB socket sending schema messages under their topics."""

    def __init__(self, ctx: zmq.Context, endpoint: str, keys: ServerKeys | None,
                 sndhwm: int = 100_000):
        self._ctx, self._keys, self._sndhwm = ctx, keys, sndhwm
        self.sock = self._socket(endpoint)
        try:
            self.sock.bind(endpoint)
        except zmq.ZMQError:
            self.sock.close(linger=0)
            raise
        self.endpoint = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self.bound = True
        self._topics: dict[tuple[str, str], bytes] = {}

    def _socket(self, endpoint: str) -> zmq.Socket:
        sock = self._ctx.socket(zmq.PUB)
        sock.linger = 0
        sock.ipv6 = "[" in endpoint      # an IPv6 literal, tcp://[::1]:port
        sock.sndhwm = self._sndhwm
        make_server(sock, self._keys)
        return sock

    def rebind(self) -> None:
        """Close the socket and bind a new one at the same endpoint: every subscriber's
        connection drops, and each must connect (and authenticate) again. The port is freed
        by ZeroMQ's I/O thread shortly after the close: tried for up to REBIND_S; ZMQError
        when it is still taken (the new socket, unbound, publishes to no one until a later
        `bind_again`)."""
        self.sock.close(linger=0)
        self.sock = self._socket(self.endpoint)
        self.bound = False
        deadline = time.monotonic() + REBIND_S
        while True:
            try:
                self.bind_again()
                return
            except zmq.ZMQError as e:
                if e.errno != zmq.EADDRINUSE or time.monotonic() > deadline:
                    raise
                time.sleep(0.005)

    def bind_again(self) -> None:
        """One try at binding the socket a failed `rebind` left unbound."""
        self.sock.bind(self.endpoint)
        self.bound = True

    def send(self, msg: dict) -> None:
        key = (msg["type"], msg["device"])
        topic = self._topics.get(key)
        if topic is None:
            kind = schema.STATE if msg["type"] in ("snapshot", "delta") else msg["type"]
            topic = self._topics[key] = schema.topic(kind, msg["device"])
        # Two plain sends: pyzmq's send_multipart costs several times more per message.
        self.sock.send(topic, zmq.SNDMORE)
        self.sock.send(schema.encode(msg))

    def close(self) -> None:
        self.sock.close(linger=0)


@dataclass(frozen=True)
class Answer:
    """A handler's result with the state it changed: the reply carries `result`; `state`
    (top-level keys; a value may be a function of nothing, called then: work nobody waits
    for) is published after the reply has gone, and `after` (a function of nothing: another
    server's publication, say) is called then. The state's values are handed over: the
    published state keeps them as they are (build them for the answer; keep no reference)."""
    result: Any
    state: Mapping = field(default_factory=dict)
    after: Callable[[], None] | None = None


@dataclass
class _Pending:
    """A changing request whose handler returned a Future: who waits for its answer."""
    op: schema.Operation
    future: Future
    envelopes: list[list[bytes]] = field(default_factory=list)
    ttl_ms: float | None = None                     # the request's: how long retries may come


class Server:
    """Requests on a ROUTER socket, state and heartbeats on a PUB socket (docs/bus.md)."""

    def __init__(self, name: str, state: dict, *, kind: str = "",
                 request: str = "tcp://127.0.0.1:0", publish: str = "tcp://127.0.0.1:0",
                 keys: ServerKeys | None = None, heartbeat: float = 0.5,
                 handlers: Mapping[str, Handler] | None = None,
                 operations: Iterable[schema.Operation] = (),
                 describe: Callable[[], dict] | None = None,
                 publish_version: bool = False, context: zmq.Context | None = None,
                 settle: Callable[[], None] | None = None):
        """`handlers` maps operation names to functions; each name must be declared in
        `schema.OPERATIONS` or in `operations` (a server's own). `describe` adds to the
        `describe` answer. With `publish_version` the state carries `version`. `settle` brings
        the state up to date with every change already answered, for an owner that publishes
        later than it answers; it is called before a `snapshot` is answered, so that a read
        sees what the requests answered before it did."""
        self.name = name
        self.kind = kind or name
        self._initial = state
        self._endpoints = (request, publish)
        self.keys = keys
        self.heartbeat = heartbeat
        self._describe = describe
        self._settle = settle
        self._publish_version = publish_version
        declared = {**schema.OPERATIONS, **{op.name: op for op in operations}}
        self._ops: dict[str, tuple[schema.Operation, Handler]] = {
            "ping": (declared["ping"], self._ping),
            "describe": (declared["describe"], self._describe_op),
            "snapshot": (declared["snapshot"], self._snapshot)}
        for op_name, fn in (handlers or {}).items():
            self.register(declared[op_name] if op_name in declared else op_name, fn)
        self._own_ctx = context is None
        self.ctx = context or zmq.Context()
        self.auth: Authenticator | None = None
        # with CURVE: the authorised keys as they are now (shared with the context's ZAP
        # handler), and its revocations already acted on (the PUB socket bound afresh)
        self._table: KeyTable | None = None
        self._revocations = 0
        # the caller of the request being run (its key's name and role; TRUSTED without CURVE)
        self.caller: Identity = TRUSTED
        # the highest agent term a change came with (a change of a lower one is refused), and
        # what to do before a higher one is kept (a device service writes it to a file)
        self.term = 0
        self.on_term: Callable[[int], None] | None = None
        # the request being run's term (`apply_circuits_together` fences each device with it)
        self.request_term: int | None = None
        # bound by `bind` (None before it and after `close`): reached through `router`, `pub`
        # and `state`, which say so when they are not there
        self._router: zmq.Socket | None = None
        self._pub: Publisher | None = None
        self._state: StatePublisher | None = None
        self.incarnation = uuid.uuid4().hex[:12]
        self.online = True
        # False: no heartbeats (the owner cannot stand behind them: its device is stuck), so
        # that a supervisor takes the silence for a hang
        self.beating = True
        self.changes = 0                      # changing requests run: the version's N
        self.requests = 0
        # what was asked and refused, for metrics (hil.devices.metrics): requests run by
        # operation, refused by (operation, the key's role), failed by error type
        self.served: collections.Counter[str] = collections.Counter()
        self.refused: collections.Counter[tuple[str, str]] = collections.Counter()
        self.failures: collections.Counter[str] = collections.Counter()
        self._queue: collections.deque = collections.deque()
        self._seen_empty = time.monotonic()   # when the request socket was last seen empty
        self._next_beat = 0.0
        self._unpublished: dict = {}          # state changes to publish after the reply
        self._after: list[Callable[[], None]] = []   # ...and what to call then (Answer.after)
        self._done: collections.OrderedDict[str, tuple[str, bytes, float]] = \
            collections.OrderedDict()         # request id -> (op, answer frame, kept until)
        self._reads: collections.OrderedDict[str, tuple[str, bytes, float]] = \
            collections.OrderedDict()         # the same, for read-only requests
        self._bytes = {False: 0, True: 0}     # bytes kept, changes and reads
        self._expiry: dict[bool, list[tuple[float, str]]] = {False: [], True: []}  # heaps
        self._running: dict[str, _Pending] = {}         # request id -> unanswered yet
        # the request being run: past this (time.monotonic()) its client has given up on it
        # (its ttl_ms); a handler that runs it later (a Future) must not run it after
        self.request_deadline: float | None = None

    # ---- operations ----------------------------------------------------------------------------

    def register(self, op: schema.Operation | str, handler: Handler) -> None:
        if isinstance(op, str):
            raise ValueError(f"{self.name}: operation {op!r} is not declared: add it to "
                             "hil.bus.schema.OPERATIONS (or pass its Operation)")
        if op.name in BUILTIN and op.name != "describe":
            raise ValueError(f"{self.name}: {op.name!r} is every server's own")
        if op.name == "describe":         # the server's own description, added to the answer
            self._describe = lambda: handler(schema.NO_ARGS)
            return
        self._ops[op.name] = (op, handler)

    @property
    def operations(self) -> list[str]:
        return sorted(self._ops)

    @property
    def version(self) -> str:
        return f"{self.incarnation}:{self.changes}"

    @property
    def router(self) -> zmq.Socket:
        """The request socket (once bound)."""
        if self._router is None:
            raise self._unbound()
        return self._router

    @property
    def pub(self) -> Publisher:
        """The publishing socket (once bound)."""
        if self._pub is None:
            raise self._unbound()
        return self._pub

    @property
    def state(self) -> StatePublisher:
        """The published state (once bound)."""
        if self._state is None:
            raise self._unbound()
        return self._state

    def _unbound(self) -> RuntimeError:
        return RuntimeError(f"{self.name}: the server is not bound (bind() it first) or is "
                            "closed")

    def _ping(self, args: schema.Args) -> dict:
        return {"device": self.name, "kind": self.kind, "online": self.online,
                "incarnation": self.incarnation, "seq": self.state.seq,
                "version": self.version, "term": self.term}

    def _describe_op(self, args: schema.Args) -> dict:
        out = {"name": self.name, "kind": self.kind, "operations": self.operations,
               "changing": sorted(n for n, (op, _) in self._ops.items() if not op.read_only)}
        if self._describe is not None:
            out.update(self._describe())
        return out

    # ---- lifecycle ------------------------------------------------------------------------------

    def bind(self) -> tuple[str, str]:
        """Bind both sockets (CURVE with `keys`); returns the bound (request, publish)."""
        try:
            if self.keys is not None:
                self.auth = start_authenticator(self.ctx, self.keys)
                self._table = self.auth.table
                self._revocations = self._table.revocations
            router = self._router = self.ctx.socket(zmq.ROUTER)
            request, publish = self._endpoints
            router.linger = 0
            router.ipv6 = "[" in request         # an IPv6 literal, tcp://[::1]:port
            router.maxmsgsize = HARD_FRAME_LIMIT
            router.router_mandatory = False
            make_server(router, self.keys)
            router.bind(request)
            pub = self._pub = Publisher(self.ctx, publish, self.keys)
            state = dict(self._initial)
            if self._publish_version:
                state["version"] = self.version
            self._state = StatePublisher(self.name, state, pub.send, self.incarnation)
        except Exception:
            self.close()
            raise
        return router.getsockopt_string(zmq.LAST_ENDPOINT), pub.endpoint

    def close(self) -> None:
        if self._router is not None:
            self._router.close(linger=0)
        if self._pub is not None:
            self._pub.close()
        if self.auth is not None:
            self.auth.stop()
        self._router = self._pub = self.auth = self._table = None
        if self._own_ctx and not self.ctx.closed:
            self.ctx.term()

    def __enter__(self) -> Server:
        self.bind()
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- state ----------------------------------------------------------------------------------

    def update(self, values: Mapping) -> dict | None:
        """Publish these top-level keys now (one delta, only what differs)."""
        return self.state.update(values)

    @property
    def settled(self) -> bool:
        """Whether every change counted in the version has been published (none under way,
        none answered and waiting for its publication): what the device holds is then what
        the state says, unless it changed behind the service."""
        return not self._publish_version or self.state.state.get("version") == self.version

    def noticed(self, values: Mapping) -> dict | None:
        """The device changed by itself (a power cycle, a front panel): the top-level keys of
        `values` that differ from the published state are counted as a change (the version
        moves: a compare-and-set made on the old state is refused) and published now."""
        differ = {k: v for k, v in values.items() if self.state.state.get(k) != v}
        if not differ:
            return None
        self.changes += 1
        if self._publish_version:
            differ["version"] = self.version
        return self.state.update(differ)

    def change(self, ops: list[StateOp]) -> dict | None:
        """Publish this change now (one delta)."""
        return self.state.change(ops)

    def defer(self, state: Mapping) -> None:
        """Publish these top-level keys (and the version, with `publish_version`) at the next
        deferred publication: after the reply being answered has gone. The values are handed
        over, as an Answer's state is."""
        self._unpublished.update(state)
        if self._publish_version:
            self._unpublished["version"] = self.version

    def _snapshot(self, args: schema.Args) -> dict:
        self.publish_deferred()
        if self._settle is not None:
            self._settle()
        return self.state.snapshot()

    def publish_deferred(self) -> None:
        if self._after:
            after, self._after = self._after, []
            for fn in after:
                try:
                    fn()
                except Exception:              # (a bug: logged; the state still goes out)
                    log.exception("%s: work after a reply failed", self.name)
        if not self._unpublished:
            return
        updates, self._unpublished = self._unpublished, {}
        for k, v in list(updates.items()):
            if callable(v):
                try:
                    updates[k] = v()
                except Exception as e:       # the rest (and the version) still goes out
                    log.error("%s: state %r could not be worked out: %s: %s", self.name, k,
                              type(e).__name__, e)
                    del updates[k]
        self.state.update(updates, owned=True)

    def send_heartbeat(self) -> None:
        """A heartbeat now (none while not `beating`); the next one heartbeat later."""
        if self.beating:
            self.pub.send(schema.make("heartbeat", device=self.name,
                                      incarnation=self.incarnation, seq=self.state.seq,
                                      t=time.time(), online=self.online,
                                      interval=self.heartbeat))
        self._next_beat = time.monotonic() + self.heartbeat

    # ---- the loop -------------------------------------------------------------------------------

    @property
    def answering(self) -> bool:
        """Whether requests wait for a Future's answer (`poll` sends it once done)."""
        return bool(self._running)

    @property
    def due(self) -> float:
        """When `poll` next has work without a new request (`time.monotonic()`): a heartbeat,
        or now when requests wait in its queue."""
        return -math.inf if self._queue else self._next_beat

    def poll(self, timeout: float = 0.0) -> int:
        """Answer waiting requests (waiting at most `timeout` for the first) and send a
        heartbeat when one is due; returns the number of requests answered."""
        now = time.monotonic()
        if self._table is not None:
            self._check_keys(now)
        if now >= self._next_beat:
            self.send_heartbeat()
        answered = self._send_later()
        router = self.router
        if not self._queue and not router.poll(0):
            wait = min(timeout, max(0.0, self._next_beat - now))
            if self._running:
                wait = min(wait, 0.005)             # an answer may be ready soon: look again
            # Nothing waiting now: whatever arrives during this wait arrives "now".
            self._seen_empty = time.monotonic()
            if not router.poll(max(0, int(wait * 1e3))):
                return answered + self._send_later()
            self._seen_empty = time.monotonic()
        self._drain()
        # one at a time, each reply followed by its state delta; a heartbeat that falls due
        # ends the round (the rest wait in the queue for the next poll)
        while self._queue:
            envelope, frame, arrived, user = self._queue.popleft()
            if self._answer(envelope, frame, arrived, user=user):
                answered += 1
            self.publish_deferred()
            if time.monotonic() >= self._next_beat:
                break
        return answered

    def _check_keys(self, now: float) -> None:
        """The authorised keys read again when they changed (at most every CHECK_S); after a
        revocation the PUB socket is bound afresh, so that a revoked subscriber's connection
        goes and it cannot make another (docs/bus.md, "Security")."""
        table, pub = self._table, self._pub
        assert table is not None and pub is not None
        table.check(now)
        try:
            if table.revocations != self._revocations:
                self._revocations = table.revocations
                log.info("%s: a key was revoked: its subscribers are made to authenticate "
                         "again", self.name)
                pub.rebind()
            elif not pub.bound:
                pub.bind_again()
        except zmq.ZMQError as e:        # (tried again at the next look at the keys)
            log.error("%s: cannot bind the publishing socket %s again: %s", self.name,
                      pub.endpoint, e)

    def _drain(self) -> None:
        """Take waiting requests off the socket, stamped with the last moment the socket was
        seen empty: no later than their arrival, so a deadline counts (at least) the time a
        request waited behind a slow call, without a second thread on the fast path. With
        CURVE, each with its connection's User-Id (the key it authenticated with)."""
        router, more = self.router, zmq.RCVMORE
        arrived = self._seen_empty
        curve = self._table is not None
        user: str | None = None
        while len(self._queue) < QUEUE_LIMIT:
            try:
                if curve:       # the envelope's frame as a Frame: it carries the User-Id
                    first = router.recv(zmq.NOBLOCK, copy=False)
                    user = _user_id(first)
                    frames = [first.bytes]
                else:
                    frames = [router.recv(zmq.NOBLOCK)]     # cheaper than recv_multipart
            except zmq.Again:
                self._seen_empty = time.monotonic()
                return
            while router.getsockopt(more):
                frames.append(router.recv())
            if len(frames) < 2 or len(frames) > 3:
                self._send(frames[:1], self._error_frame(None, BadFrame(
                    f"a request is one frame after the envelope, not {len(frames) - 1}")))
                continue
            self._queue.append((frames[:-1], frames[-1], arrived, user))

    def handle(self, frame: bytes, arrived: float | None = None) -> dict:
        """One request frame -> the answer message (for tests and in-process use; a Future's
        answer is waited for)."""
        sent: list[bytes] = []
        self._answer(None, frame, arrived, sent.append)
        if not sent:
            for pending in list(self._running.values()):
                pending.future.exception()       # waits; the answer carries any error
            self._send_later(sent.append)
        self.publish_deferred()
        return schema.decode(sent[-1])

    def _answer(self, envelope, frame: bytes, arrived: float | None, send=None,
                user: str | None = None) -> bool:
        """Run one request and send its answer (or keep it for when its Future is done).
        Returns whether an answer went out. `user`: the User-Id of the request's connection
        (None: a trusted caller, in this process or on a bus without CURVE)."""
        send = send or (lambda f: self._send(envelope, f))
        self.requests += 1
        rid = None
        try:
            req = schema.decode_message(frame)
            if not isinstance(req, schema.Request):
                raise UnknownType(f"a server takes requests, not {req.__struct_config__.tag!r}")
            rid = req.id
            entry = self._ops.get(req.op)
            if entry is None:
                raise UnknownOperation(f"{self.name} ({self.kind}) does not offer {req.op!r}; "
                                       f"it offers: {', '.join(self.operations)}")
            op, handler = entry
            self.caller = self._authorise(op, user)
            self.served[op.name] += 1
            # A retry (the same id, on the client's new socket) gets the first answer: a change
            # is never run twice, and a slow read is not run again for each retry its client
            # sent while it ran (which would answer, each time, a socket already given up).
            done = (self._reads if op.read_only else self._done).get(rid)
            if done is not None and time.monotonic() < done[2]:
                if done[0] != op.name:
                    raise BadRequest(f"request id {rid} was used for {done[0]}, not "
                                     f"{op.name}")
                send(done[1])
                return True
            pending = self._running.get(rid)
            if pending is not None:                  # a retry while the first is running
                pending.envelopes.append(envelope)
                return False
            self.request_deadline = None
            self.request_term = req.term
            if req.ttl_ms is not None and arrived is not None:
                self.request_deadline = arrived + req.ttl_ms / 1e3
                if time.monotonic() > self.request_deadline:
                    raise DeadlineExceeded(f"{op.name} waited longer than its {req.ttl_ms:.0f} "
                                           "ms deadline behind other requests and was not run")
            if op.args is not schema.Args:
                args = schema.check_args(op, req.args)
            elif req.args:
                raise BadRequest(f"{op.name} takes no arguments, not {', '.join(req.args)}")
            else:
                args = schema.NO_ARGS
            if op.read_only:
                result = handler(args)
            else:
                if not op.counted and req.expect is not None:
                    raise BadRequest(f"{op.name} changes other devices, each with its own "
                                     "expected version in its arguments; the request's "
                                     "`expect` is not for it")
                if op.counted:
                    self.check_term(req.term)     # (not counted: each device checks its own)
                self._check_expect(req.expect)
                try:
                    result = self._run_change(op, handler, args)
                except Exception as e:
                    # it may have changed something half way: answered the same on a retry
                    self._log_failure(rid, e)
                    self._remember(rid, op, self._error_frame(rid, e), req.ttl_ms)
                    send(self._done[rid][1])
                    return True
            if isinstance(result, Future):
                self._running[rid] = _Pending(op, result, [envelope], req.ttl_ms)
                return False
            if isinstance(result, Answer):
                result = self._unpack(result)
            reply = self._reply_frame(rid, result)
            # a read answered within RETRY_GRACE_S of its arrival cannot have a retry on its
            # way (the client resends after FIRST_ATTEMPT_S): only slower ones are kept
            if not op.read_only or arrived is None or \
                    time.monotonic() - arrived > RETRY_GRACE_S:
                self._remember(rid, op, reply, req.ttl_ms)
            send(reply)
            return True
        except Exception as e:
            self._log_failure(rid, e)
            send(self._error_frame(rid, e))
            return True

    def _unpack(self, answer: Answer) -> Any:
        """An Answer's result; its state and `after` kept for after the reply."""
        self._unpublished.update(answer.state)
        if answer.after is not None:
            self._after.append(answer.after)
        return answer.result

    def claim_change(self, expect: str | None, term: int | None = None) -> None:
        """A change of this server's device asked for in its own process (another server's
        request that changes several devices served together): refused with StaleTerm below
        the highest term this server has seen, and with StaleState unless the state is at
        `expect` (when given); counted in the version, as a changing request is. The caller
        publishes the new version with the change's state."""
        self.check_term(term)
        self._check_expect(expect)
        self.changes += 1

    def check_term(self, term: int | None) -> None:
        """A change that comes with an agent's term: refused (StaleTerm) below the highest
        term seen; a higher one becomes the highest (`on_term` first: a term is kept before
        anything of it runs). A change without a term is not fenced (a script that owns the
        rig; with CURVE only the agent's role changes a device)."""
        if term is None or term == self.term:
            return
        if term < self.term:
            raise StaleTerm(f"{self.name} has taken changes of agent term {self.term}; this one "
                            f"comes with term {term}, from an agent that no longer leads: "
                            "refused, nothing changed")
        if self.on_term is not None:
            self.on_term(term)
        log.info("%s: agent term %d (was %d)", self.name, term, self.term)
        self.term = term

    def _authorise(self, op: schema.Operation, user: str | None) -> Identity:
        """Who sends the request, refused (Unauthorized, naming the key and the operation)
        when its key may not call `op`, or is no longer authorised."""
        if user is None or self._table is None:
            return TRUSTED
        who = self._table.identity(user)
        if who is None:
            raise Unauthorized(f"key {user_name(user)!r} is no longer authorised on "
                               f"{self.name} (taken out of {self._table.folder}, or listed "
                               f"there with another public key): {op.name} refused")
        if not who.may(op.roles):
            self.refused[(op.name, who.role or "trusted")] += 1
            raise Unauthorized(f"{who} may not call {op.name} on {self.name}: it is for "
                               f"{' and '.join(sorted(op.roles))} keys")
        return who

    def _check_expect(self, expect: str | None) -> None:
        if expect is not None and expect != self.version:
            raise StaleState(f"{self.name} is at state version {self.version}, not {expect}: "
                             "it changed since you read it; re-read the state and decide again")

    def _run_change(self, op: schema.Operation, handler: Handler, args: schema.Args) -> Any:
        if not op.counted:
            return handler(args)
        result = None
        try:
            result = handler(args)
            return result
        finally:
            # The hardware may have changed even if the call failed half way: a new version
            # (published with the change's state: for a Future, once it is done).
            self.changes += 1
            if self._publish_version and not isinstance(result, Future):
                self._unpublished["version"] = self.version

    def _log_failure(self, rid: str | None, e: Exception) -> None:
        self.failures[type(e).__name__] += 1
        if not isinstance(e, RemoteError):
            log.info("%s: request %s failed: %s: %s", self.name, rid, type(e).__name__, e)

    def _remember(self, rid: str, op: schema.Operation, frame: bytes,
                  ttl_ms: float | None = None) -> None:
        """Keep an answer for the request's retries. A client retries with the same id until
        the deadline its `ttl_ms` gives, never after: a change's answer is kept that long and
        DONE_GRACE_S more (DONE_AGE_S for a request without a ttl_ms), a read's READ_KEPT_S;
        each kind within its count and bytes, the oldest dropped first."""
        now = time.monotonic()
        if op.read_only:
            cache, keep, limit = self._reads, READ_KEPT_S, READ_BYTES
        else:
            cache, limit = self._done, DONE_BYTES
            keep = DONE_AGE_S if ttl_ms is None else min(DONE_AGE_S, ttl_ms / 1e3 + DONE_GRACE_S)
        cache[rid] = (op.name, frame, now + keep)
        self._bytes[op.read_only] += len(frame)
        expiry = self._expiry[op.read_only]
        heapq.heappush(expiry, (now + keep, rid))
        while expiry and expiry[0][0] < now:             # past their deadlines, in any order
            until, old_rid = heapq.heappop(expiry)
            kept = cache.get(old_rid)
            if kept is not None and kept[2] == until:
                del cache[old_rid]
                self._bytes[op.read_only] -= len(kept[1])
        while cache and (len(cache) > DONE_KEPT or self._bytes[op.read_only] > limit):
            _, (_, old, _) = cache.popitem(last=False)  # over the bounds: the oldest first
            self._bytes[op.read_only] -= len(old)
        if len(expiry) > 2 * len(cache) + 64:            # entries of answers dropped above
            expiry[:] = [(v[2], r) for r, v in cache.items()]
            heapq.heapify(expiry)

    def _send_later(self, send=None) -> int:
        """Send the answers whose futures are done, each followed by the state it changed;
        returns how many went out."""
        sent = 0
        for rid in [r for r, p in self._running.items() if p.future.done()]:
            pending = self._running.pop(rid)
            frame = self._future_frame(rid, pending.future)
            if self._publish_version and pending.op.counted and not pending.op.read_only:
                self._unpublished["version"] = self.version
            self._remember(rid, pending.op, frame, pending.ttl_ms)
            for envelope in pending.envelopes:
                (send or (lambda f, e=envelope: self._send(e, f)))(frame)
                sent += 1
            self.publish_deferred()
        return sent

    def _future_frame(self, rid: str, future: Future) -> bytes:
        try:
            result = future.result()
            if isinstance(result, Answer):
                result = self._unpack(result)
            return self._reply_frame(rid, result)
        except Exception as e:
            self._log_failure(rid, e)
            return self._error_frame(rid, e)

    def _reply_frame(self, rid: str, result) -> bytes:
        try:
            # built here from a checked request's id and our own version: no `make` needed
            return schema.encode({"v": schema.VERSION, "type": "reply", "id": rid,
                                  "result": result, "version": self.version})
        except (TypeError, ValueError) as e:     # a result JSON cannot carry (NaN, bytes...)
            return self._error_frame(rid, UnencodableResult(
                f"the result of the request cannot be sent as JSON: {e}"))

    def _error_frame(self, rid: str | None, exc: BaseException) -> bytes:
        kind, message = to_wire(exc)
        return schema.encode(schema.make("error", id=rid, error=kind, message=message,
                                         version=self.version))

    def _send(self, envelope: list[bytes] | None, frame: bytes) -> None:
        if envelope is None:
            return
        router = self.router
        try:
            for part in envelope:
                router.send(part, zmq.NOBLOCK | zmq.SNDMORE)
            router.send(frame, zmq.NOBLOCK)
        except zmq.ZMQError as e:     # the client went away; its loss
            log.debug("%s: answer not delivered: %s", self.name, e)


def _user_id(frame: zmq.Frame) -> str | None:
    """The User-Id ZAP gave the frame's connection (None: none given)."""
    try:
        user = frame.get("User-Id")
    except zmq.ZMQError:
        return None
    return user if isinstance(user, str) else None
