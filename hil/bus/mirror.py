"""State mirroring: a snapshot, then ordered deltas with sequence numbers, and gap recovery.

The owner of a state (a device service, the agent) holds a `StatePublisher`: every change is a
list of operations on the state (a JSON object; hil.bus.state: `Set(path, value)`,
`Delete(path)`) and goes out as one `delta` with the next sequence number. Everyone else holds
a `Mirror` per device: it applies deltas in order and, when one is missing (a lagging
subscriber whose queue overflowed, a late joiner, a restarted service with a new incarnation, a
heartbeat announcing a sequence number it never saw), it asks the owner for a fresh `snapshot`
over the request socket and resumes from there.

`StateSubscriber` is the receiving end for several devices. It never blocks unless asked to:
  - polling: call `poll(0)` from your own loop (a Qt `QTimer`, or a `QSocketNotifier` on
    `subscriber.fd`, which is readable when messages may be waiting; always drain with
    `poll(0)` since ZeroMQ's descriptor is edge-triggered);
  - a thread: `SubscriberThread(...)` runs the loop and calls your callbacks on its own thread
    (in Qt, emit a signal from the callback; Qt queues it to the GUI thread).
Callbacks: `on_state(device, state, ops)` (ops, the delta's `Set`/`Delete` operations, is None
after a snapshot), `on_telemetry(device, msg)`, `on_online(device, alive)` (heartbeats seen or
lost).
"""
from __future__ import annotations

import copy
import logging
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import zmq

from photonic_testbed.hil.bus import schema
from photonic_testbed.hil.bus.security import ClientKeys, make_client
from photonic_testbed.hil.bus.state import Set, StateError, StateOp, apply, changes

log = logging.getLogger(__name__)

MAX_BUFFERED = 10_000       # deltas held while a snapshot is on its way


class MirrorError(Exception):
    """A subscriber that cannot start."""


_ATOMS = (str, int, float, bool, type(None))


def clone(value):
    """A copy of a JSON-like value (dicts, lists, tuples, strings, numbers): what
    `copy.deepcopy` gives, several times faster for the states the bus carries (a chip's 56
    cells: 40 us instead of 600 us); anything else goes to `copy.deepcopy`."""
    t = type(value)
    if t in _ATOMS:
        return value
    if t is dict:
        return {k: v if type(v) in _ATOMS else clone(v) for k, v in value.items()}
    if t is list:
        return [v if type(v) in _ATOMS else clone(v) for v in value]
    if t is tuple:
        return tuple(clone(v) for v in value)
    return copy.deepcopy(value)


class StatePublisher:
    """The owner's side: the state, its sequence number, and the messages to publish."""

    def __init__(self, device: str, state: dict, publish: Callable[[dict], None],
                 incarnation: str | None = None):
        self.device = device
        self.incarnation = incarnation or uuid.uuid4().hex[:12]
        self.seq = 0
        self.state = clone(state)
        self._publish = publish

    def snapshot(self) -> dict:
        return schema.make("snapshot", device=self.device, incarnation=self.incarnation,
                           seq=self.seq, state=clone(self.state))

    def change(self, ops: list[StateOp]) -> dict | None:
        """Apply and publish one delta; nothing is sent for an empty change."""
        if not ops:
            return None
        apply(self.state, ops)
        self.seq += 1
        msg = schema.make("delta", device=self.device, incarnation=self.incarnation,
                          seq=self.seq, ops=ops)
        self._publish(msg)
        return msg

    def set(self, path: list, value: Any) -> dict | None:
        return self.change([Set(list(path), clone(value))])

    def update(self, values: Mapping, *, owned: bool = False) -> dict | None:
        """Set several top-level keys in one delta, only those whose value differs
        (`state.changes`: a few changed items of a list or members of an object go alone).
        The values are copied, unless `owned`: handed over, nothing else keeps or changes them
        (a request's answer built for it), they are kept as they are."""
        return self.change(changes(self.state, values, None if owned else clone))


class Mirror:
    """One device's state as seen by a subscriber. Feed it every message on `state.<device>`
    (and heartbeats); when `needs_snapshot` is set, fetch one and give it to `load`."""

    def __init__(self, device: str):
        self.device = device
        self.state: dict | None = None
        self.seq = -1
        self.incarnation: str | None = None
        self.needs_snapshot = True
        self.resyncs = 0
        self.gaps = 0
        self._buffer: list[dict] = []

    @property
    def version(self) -> str | None:
        """The device's state version (what compare-and-set requests `expect`)."""
        return None if self.state is None else self.state.get("version")

    def held(self) -> dict:
        """The state, once a snapshot is loaded (a delta changes it, never before)."""
        if self.state is None:
            raise StateError(f"{self.device}: no snapshot loaded yet")
        return self.state

    def load(self, snap: Mapping) -> bool:
        """Take a snapshot, then the buffered deltas after it. True when in sync."""
        self.state = clone(snap["state"])
        self.seq = snap["seq"]
        self.incarnation = snap["incarnation"]
        self.needs_snapshot = False
        self.resyncs += 1
        buffered, self._buffer = self._buffer, []
        for msg in sorted(buffered, key=lambda m: m["seq"]):
            if msg["incarnation"] == self.incarnation and msg["seq"] > self.seq:
                if not self._apply(msg):
                    return False
        return True

    def feed(self, msg: Mapping) -> list[StateOp] | None:
        """A published message; returns the delta's ops when it changed the mirror."""
        if msg["type"] == "heartbeat":
            if self.state is not None and (msg["incarnation"] != self.incarnation
                                           or msg["seq"] > self.seq):
                self._gap(f"heartbeat says {msg['incarnation']}#{msg['seq']}, "
                          f"we hold {self.incarnation}#{self.seq}")
            return None
        if msg["type"] == "snapshot":
            if not self.needs_snapshot and msg["incarnation"] == self.incarnation \
                    and msg["seq"] <= self.seq:
                return None
            self.load(msg)
            return None
        if msg["type"] != "delta":
            return None
        if self.needs_snapshot:
            if len(self._buffer) < MAX_BUFFERED:
                self._buffer.append(dict(msg))
            return None
        if msg["incarnation"] != self.incarnation:
            self._gap(f"the service restarted (incarnation {msg['incarnation']})")
            self._buffer.append(dict(msg))
            return None
        if msg["seq"] <= self.seq:
            return None                      # already had it (from a snapshot)
        return msg["ops"] if self._apply(msg) else None

    def _apply(self, msg: Mapping) -> bool:
        if msg["seq"] != self.seq + 1:
            self._gap(f"expected seq {self.seq + 1}, got {msg['seq']}")
            self._buffer.append(dict(msg))
            return False
        try:
            apply(self.held(), msg["ops"])
        except StateError as e:
            self._gap(f"delta {msg['seq']} does not apply: {e}")
            return False
        self.seq = msg["seq"]
        return True

    def _gap(self, why: str) -> None:
        if not self.needs_snapshot:
            log.info("mirror of %s out of sync (%s): asking for a snapshot", self.device, why)
            self.gaps += 1
        self.needs_snapshot = True


@dataclass
class _Device:
    name: str
    request: str
    mirror: Mirror
    dealer: zmq.Socket | None = None
    pending: str | None = None           # id of the snapshot request in flight
    asked_at: float = 0.0
    last_heartbeat: float = 0.0          # the last heartbeat or snapshot reply
    interval: float | None = None        # from its heartbeats (None: none seen yet)
    alive: bool = False


class StateSubscriber:
    """Mirrors of several devices' state, fed from their PUB sockets, without blocking.

    `devices` maps a device name to its (request endpoint, publish endpoint).
    """

    SNAPSHOT_RETRY_S = 0.5
    MISSED_HEARTBEATS = 3
    # A device seen alive by its snapshot reply alone (it has sent no heartbeat yet, so its
    # interval is unknown) is taken as lost after this long without one.
    FIRST_HEARTBEAT_S = 5.0

    def __init__(self, devices: Mapping[str, tuple[str, str]], *,
                 on_state: Callable[[str, dict, list | None], None] | None = None,
                 on_telemetry: Callable[[str, dict], None] | None = None,
                 on_online: Callable[[str, bool], None] | None = None,
                 telemetry: bool = True, keys: ClientKeys | None = None,
                 context: zmq.Context | None = None, rcvhwm: int = 100_000):
        self._ctx = context or zmq.Context.instance()
        self.keys = keys
        self.on_state, self.on_telemetry, self.on_online = on_state, on_telemetry, on_online
        self.sub = self._ctx.socket(zmq.SUB)
        self.sub.linger = 0
        self.sub.ipv6 = any("[" in pub for _, pub in devices.values())   # IPv6 literals
        self.sub.rcvhwm = rcvhwm
        self.sub.reconnect_ivl = 20
        self.sub.reconnect_ivl_max = 500
        make_client(self.sub, keys)
        self.devices: dict[str, _Device] = {}
        self.received = 0
        for name, (request, publish) in devices.items():
            for kind in (schema.STATE, schema.HEARTBEAT) + ((schema.TELEMETRY,) if telemetry
                                                            else ()):
                self.sub.subscribe(schema.topic(kind, name))
            self.sub.connect(publish)
            self.devices[name] = _Device(name, request, Mirror(name))
        for dev in self.devices.values():
            self._ask_snapshot(dev)

    @property
    def fd(self) -> int:
        """The SUB socket's file descriptor, for a QSocketNotifier or select()."""
        return self.sub.getsockopt(zmq.FD)

    def mirror(self, device: str) -> Mirror:
        return self.devices[device].mirror

    def state(self, device: str) -> dict | None:
        return self.devices[device].mirror.state

    def close(self) -> None:
        for dev in self.devices.values():
            if dev.dealer is not None:
                dev.dealer.close(linger=0)
                dev.dealer = None
        self.sub.close(linger=0)

    def __enter__(self) -> StateSubscriber:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- the loop ---------------------------------------------------------------------------

    def poll(self, timeout: float = 0.0, max_messages: int = 10_000) -> int:
        """Handle what has arrived, waiting at most `timeout` seconds for the first message.
        Returns the number of messages handled."""
        handled = 0
        if timeout > 0:
            poller = zmq.Poller()
            poller.register(self.sub, zmq.POLLIN)
            for dev in self.devices.values():
                if dev.dealer is not None and dev.pending is not None:
                    poller.register(dev.dealer, zmq.POLLIN)
            poller.poll(int(timeout * 1e3))
        sub = self.sub
        more = zmq.RCVMORE
        while handled < max_messages:
            try:
                frames = [sub.recv(zmq.NOBLOCK)]      # cheaper than recv_multipart
            except zmq.Again:
                break
            while sub.getsockopt(more):
                frames.append(sub.recv())
            self._on_published(frames)
            handled += 1
        for dev in self.devices.values():
            if dev.dealer is not None and dev.pending is not None:
                while dev.dealer is not None and dev.dealer.poll(0):
                    self._on_snapshot_reply(dev, dev.dealer.recv())
                    handled += 1
        self._housekeeping()
        return handled

    def wait_synced(self, timeout: float) -> bool:
        """Poll until every mirror holds a state (or `timeout` passes)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.poll(0.02)
            if all(not d.mirror.needs_snapshot for d in self.devices.values()):
                return True
        return False

    def _on_published(self, frames: list[bytes]) -> None:
        if len(frames) != 2:
            return
        try:
            msg = schema.decode(frames[1])
        except schema.SchemaError as e:
            log.warning("dropping a published frame: %s", e)
            return
        self.received += 1
        dev = self.devices.get(msg["device"]) if "device" in msg else None
        if dev is None:
            return
        if msg["type"] == "telemetry":
            if self.on_telemetry:
                self.on_telemetry(dev.name, msg)
            return
        if msg["type"] == "heartbeat":
            dev.last_heartbeat = time.monotonic()
            dev.interval = float(msg["interval"])
            self._set_alive(dev, True)
        was_synced = not dev.mirror.needs_snapshot
        ops = dev.mirror.feed(msg)
        if ops is not None and self.on_state:
            self.on_state(dev.name, dev.mirror.held(), ops)
        if dev.mirror.needs_snapshot and (was_synced or dev.pending is None):
            self._ask_snapshot(dev)

    def _ask_snapshot(self, dev: _Device) -> None:
        if dev.dealer is not None:
            dev.dealer.close(linger=0)
        dev.dealer = self._ctx.socket(zmq.DEALER)
        dev.dealer.linger = 0
        dev.dealer.ipv6 = "[" in dev.request
        make_client(dev.dealer, self.keys)
        dev.dealer.connect(dev.request)
        dev.pending = uuid.uuid4().hex
        dev.asked_at = time.monotonic()
        msg = schema.make("request", id=dev.pending, op="snapshot", args={},
                          ttl_ms=self.SNAPSHOT_RETRY_S * 1e3)
        dev.dealer.send(schema.encode(msg))

    def _on_snapshot_reply(self, dev: _Device, frame: bytes) -> None:
        try:
            msg = schema.decode(frame)
        except schema.SchemaError as e:
            log.warning("%s: undecodable snapshot reply: %s", dev.name, e)
            return
        if msg.get("id") != dev.pending:
            return
        dev.pending = None
        if msg["type"] != "reply":
            log.warning("%s refused a snapshot: %s", dev.name, msg.get("message"))
            return
        try:
            snap = schema.decode(schema.encode(msg["result"]))
        except schema.SchemaError as e:
            log.warning("%s: bad snapshot: %s", dev.name, e)
            return
        if dev.mirror.load(snap) and self.on_state:
            self.on_state(dev.name, dev.mirror.held(), None)
        dev.last_heartbeat = time.monotonic()         # the reply is a sign of life too
        self._set_alive(dev, True)

    def _housekeeping(self) -> None:
        now = time.monotonic()
        for dev in self.devices.values():
            if dev.mirror.needs_snapshot and (dev.pending is None or
                                              now - dev.asked_at > self.SNAPSHOT_RETRY_S):
                self._ask_snapshot(dev)
            silence = self.FIRST_HEARTBEAT_S if dev.interval is None \
                else self.MISSED_HEARTBEATS * dev.interval
            if dev.alive and dev.last_heartbeat and now - dev.last_heartbeat > silence:
                self._set_alive(dev, False)

    def _set_alive(self, dev: _Device, alive: bool) -> None:
        if dev.alive != alive:
            dev.alive = alive
            if self.on_online:
                self.on_online(dev.name, alive)


class SubscriberThread:
    """A `StateSubscriber` run on its own thread; callbacks are called on that thread."""

    def __init__(self, devices: Mapping[str, tuple[str, str]], **kwargs):
        self._args = (dict(devices), kwargs)
        self._stop = threading.Event()
        self._ready = threading.Event()
        self.error: BaseException | None = None
        self._lock = threading.Lock()
        self._states: dict[str, dict] = {}
        self._thread = threading.Thread(target=self._run, name="bus-subscriber", daemon=True)

    def start(self) -> SubscriberThread:
        self._thread.start()
        if not self._ready.wait(5.0):
            raise MirrorError("the subscriber thread did not start within 5 s")
        if self.error is not None:
            raise MirrorError(f"the subscriber could not start: {self.error}") from self.error
        return self

    def states(self) -> dict[str, dict]:
        """A copy of every mirror's latest state (safe from any thread)."""
        with self._lock:
            return clone(self._states)

    def _run(self) -> None:
        devices, kwargs = self._args
        user_on_state = kwargs.pop("on_state", None)

        def on_state(device, state, ops):
            with self._lock:
                self._states[device] = clone(state)
            if user_on_state:
                user_on_state(device, state, ops)
        try:
            sub = StateSubscriber(devices, on_state=on_state, **kwargs)
        except BaseException as e:       # reported to the owner through .error
            self.error = e
            self._ready.set()
            return
        self._ready.set()
        try:
            while not self._stop.is_set():
                sub.poll(0.05)
        except Exception as e:
            log.exception("bus subscriber thread stopped")
            self.error = e
        finally:
            sub.close()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2.0)

    def __enter__(self) -> SubscriberThread:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()
