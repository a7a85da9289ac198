"""Recording a session: relays between clients and devices that write down every byte.

For a serial device the recorder opens the real port (115200 8N1, exclusively, as our driver
does) and makes a pseudo-terminal for the client, published as a link (a path that behaves like
`/dev/serial/by-id/...`); for a socket device it listens on a loopback port and, for each client
connection, opens one to the device. Bytes pass through unchanged and at once (TCP_NODELAY on
both sides); each chunk is timestamped when read and queued to the session file's writer
thread, so the relay never waits for the disk. One thread relays every device (a selector).

    with Recorder("session.jsonl", {"dac": parse_address("/dev/ttyACM0"),
                                    "ocs": parse_address("TCPIP::10.0.0.9::5025::SOCKET")}) as r:
        r.addresses     # {"dac": "/tmp/.../dac", "ocs": "TCPIP::127.0.0.1::40123::SOCKET"}
"""
from __future__ import annotations

import errno
import logging
import os
import pathlib
import queue
import selectors
import shutil
import socket
import tempfile
import threading
import time

from photonic_testbed.hil.lab.client_side import (
    ListenError,
    SerialLink,
    listen_tcp,
    serial_link,
)
from photonic_testbed.hil.lab.session import SERIAL_BAUD, SessionWriter, Wire

log = logging.getLogger(__name__)

CHUNK = 65536
CONNECT_TIMEOUT_S = 5.0
MAX_PENDING = 1 << 20          # bytes held for a side that does not read, before it is dropped
CLOSE_FLUSH_S = 5.0            # at a close, what the other side still has to take, this long


class RecorderError(Exception):
    """A device could not be opened, or a relay could not be set up."""


def open_serial(path: str, baud: int = SERIAL_BAUD):
    """A device's serial port, 8N1, non-blocking reads, with the exclusive lock our driver takes
    (a program holding the board keeps us out, and we keep others out while relaying)."""
    import serial
    try:
        return serial.Serial(path, baud, bytesize=8, parity="N", stopbits=1, timeout=0,
                             exclusive=True)
    except (serial.SerialException, OSError) as e:
        raise RecorderError(f"cannot open the serial port {path}: {e}") from None


class _Side:
    """One end of a relay: an fd we read from and write to, with what it still has to take."""

    def __init__(self, fd: int, name: str, sock: socket.socket | None = None):
        self.fd = fd
        self.name = name
        self.sock = sock
        self.pending = bytearray()

    def send(self, data: bytes) -> None:
        if self.pending:
            self.pending += data
        else:
            try:
                n = self.sock.send(data) if self.sock is not None else os.write(self.fd, data)
            except BlockingIOError:
                n = 0
            if n < len(data):
                self.pending += data[n:]
        if len(self.pending) > MAX_PENDING:
            raise OSError(errno.ENOBUFS, f"{self.name} reads nothing: "
                          f"{len(self.pending)} bytes held")

    def flush(self) -> None:
        try:
            n = self.sock.send(self.pending) if self.sock is not None else \
                os.write(self.fd, self.pending)
        except BlockingIOError:
            return
        del self.pending[:n]

    def drain(self, deadline: float) -> None:
        """Give this side what it still has to take (its peer closed), until `deadline`."""
        while self.pending and time.monotonic() < deadline:
            try:
                self.flush()
            except OSError:
                return                       # it went away too
            if self.pending:
                time.sleep(0.001)

    def read(self) -> bytes:
        """What is there to read ([] = nothing now); b"" means the other side closed."""
        if self.sock is not None:
            return self.sock.recv(CHUNK)
        return os.read(self.fd, CHUNK)


class _Relay:
    """A client side and a device side, one connection of one device."""

    def __init__(self, device: str, conn: int, client: _Side, dev: _Side):
        self.device = device
        self.conn = conn
        self.client = client
        self.dev = dev


class Recorder:
    """Relays every device in `devices` (name -> Wire) and writes the session to `path`.
    `start()` returns where clients reach each device; `close()` stops and finishes the file."""

    def __init__(self, path: str | os.PathLike, devices: dict[str, Wire], *,
                 listen: str = "127.0.0.1", ports: dict[str, int] | None = None,
                 link_dir: str | os.PathLike | None = None):
        if not devices:
            raise RecorderError("nothing to record: name at least one device")
        self.path = pathlib.Path(path)
        self.devices = dict(devices)
        self.listen = listen
        self.ports = dict(ports or {})
        self._own_dir = link_dir is None
        self._link_dir = pathlib.Path(link_dir) if link_dir else None
        self.addresses: dict[str, str] = {}
        self.writer: SessionWriter | None = None
        self._sel = selectors.DefaultSelector()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._serials: list = []             # pyserial ports held
        self._fds: list[int] = []            # pty fds held
        self._links: list[SerialLink] = []   # the pty links made
        self._listeners: dict[str, socket.socket] = {}
        self._relays: list[_Relay] = []
        self._conns: dict[str, int] = {}
        self._wake_r, self._wake_w = os.pipe()
        self._connected: queue.SimpleQueue = queue.SimpleQueue()   # (device, client, socket)
        self.exchanges_relayed = 0

    # ---- lifecycle -----------------------------------------------------------------------

    def start(self) -> dict[str, str]:
        try:
            link_dir = self._link_dir
            if link_dir is None:
                link_dir = self._link_dir = pathlib.Path(tempfile.mkdtemp(prefix="ptb-record-"))
            self.writer = SessionWriter(self.path, self.devices)
            for name, wire in self.devices.items():
                if wire.kind == "serial":
                    self.addresses[name] = self._start_serial(name, wire, link_dir)
                else:
                    self.addresses[name] = self._start_tcp(name, wire)
        except BaseException:
            self.close()
            raise
        os.set_blocking(self._wake_r, False)
        self._sel.register(self._wake_r, selectors.EVENT_READ, ("wake", None))
        self._thread = threading.Thread(target=self._loop, name="recorder", daemon=True)
        self._thread.start()
        return dict(self.addresses)

    def close(self) -> None:
        """Stop relaying, close every port and socket, and finish the session file."""
        self._stop.set()
        try:
            os.write(self._wake_w, b"x")
        except OSError:
            pass
        if self._thread is not None:
            self._thread.join(5.0)
            self._thread = None
        for relay in list(self._relays):
            self._close_relay(relay, "recorder")
        while not self._connected.empty():
            _, client, dev = self._connected.get()
            client.close()
            dev.close()
        for s in self._listeners.values():
            s.close()
        self._listeners.clear()
        for port in self._serials:
            port.close()
        self._serials.clear()
        for fd in self._fds:
            os.close(fd)
        self._fds.clear()
        for fd in (self._wake_r, self._wake_w):
            try:
                os.close(fd)
            except OSError:
                pass
        self._wake_r = self._wake_w = -1
        try:
            if self.writer is not None:
                self.writer.close()          # raises SessionError after a write error
        finally:
            for link in self._links:
                link.remove()                # ours only: never what was there before
            self._links.clear()
            if self._link_dir is not None and self._own_dir:
                shutil.rmtree(self._link_dir, ignore_errors=True)

    def __enter__(self) -> Recorder:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- set-up --------------------------------------------------------------------------

    def _session(self) -> SessionWriter:
        """The session file's writer (from `start` on)."""
        if self.writer is None:
            raise RecorderError("the recorder is not started: start() it first")
        return self.writer

    def _start_serial(self, name: str, wire: Wire, link_dir: pathlib.Path) -> str:
        port = open_serial(wire.path)
        self._serials.append(port)
        try:
            master, slave, link = serial_link(link_dir, name)
        except ListenError as e:
            raise RecorderError(str(e)) from None
        self._links.append(link)
        self._fds += [master, slave]
        os.set_blocking(master, False)
        relay = _Relay(name, 1, _Side(master, f"the client of {name}"),
                       _Side(port.fileno(), f"{name} ({wire.path})"))
        self._add_relay(relay)
        return str(link)

    def _start_tcp(self, name: str, wire: Wire) -> str:
        try:
            s, address = listen_tcp(self.listen, self.ports.get(name, 0), name)
        except ListenError as e:
            raise RecorderError(str(e)) from None
        s.setblocking(False)
        self._listeners[name] = s
        self._sel.register(s, selectors.EVENT_READ, ("accept", name))
        return address

    def _add_relay(self, relay: _Relay) -> None:
        self._relays.append(relay)
        writer = self._session()
        writer.event(relay.device, relay.conn, "open", writer.now())
        self._sel.register(relay.client.fd, selectors.EVENT_READ, ("client", relay))
        self._sel.register(relay.dev.fd, selectors.EVENT_READ, ("device", relay))

    def _accept(self, name: str) -> None:
        try:
            client, _ = self._listeners[name].accept()
        except BlockingIOError:
            return
        # The device is connected to on a thread of its own: one that does not answer must
        # not hold up the relaying of the others (the client's first bytes wait in its socket).
        threading.Thread(target=self._connect, args=(name, client), name=f"recorder-{name}",
                         daemon=True).start()

    def _connect(self, name: str, client: socket.socket) -> None:
        wire = self.devices[name]
        try:
            dev = socket.create_connection((wire.host, wire.port), timeout=CONNECT_TIMEOUT_S)
        except (OSError, UnicodeError) as e:         # (UnicodeError: not a host name)
            log.warning("%s: a client connected but the device at %s does not answer: %s",
                        name, wire.address, e)
            client.close()
            return
        for s in (client, dev):
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            s.setblocking(False)
        self._connected.put((name, client, dev))
        try:
            os.write(self._wake_w, b"c")
        except OSError:                  # closing: close() will not see this relay
            client.close()
            dev.close()

    def _add_connected(self) -> None:
        while not self._connected.empty():
            name, client, dev = self._connected.get()
            self._conns[name] = self._conns.get(name, 0) + 1
            self._add_relay(_Relay(name, self._conns[name],
                                   _Side(client.fileno(), "client", client),
                                   _Side(dev.fileno(), name, dev)))

    # ---- the relay -----------------------------------------------------------------------

    def _loop(self) -> None:
        writer = self._session()
        while not self._stop.is_set():
            if writer.failed.is_set():
                # nothing said from now on could be written: relay nothing more
                log.error("session %s: %s: recording stopped", self.path, writer.error)
                for stopped in list(self._relays):
                    self._close_relay(stopped, "recorder")
                return
            # A device's answer that is ready was asked for before any client bytes that are
            # ready with it: write it down first.
            ready = sorted(self._sel.select(0.5), key=lambda km: km[0].data[0] != "device")
            for key, mask in ready:
                what, obj = key.data
                if what == "wake":
                    try:
                        os.read(self._wake_r, 4096)
                    except BlockingIOError:
                        pass
                    self._add_connected()
                    continue
                if what == "accept":
                    self._accept(obj)
                    continue
                relay: _Relay = obj
                if relay not in self._relays:
                    continue
                here, there = (relay.client, relay.dev) if what == "client" else \
                    (relay.dev, relay.client)
                try:
                    if mask & selectors.EVENT_WRITE:
                        here.flush()
                        if not here.pending:
                            self._sel.modify(here.fd, selectors.EVENT_READ, key.data)
                    if mask & selectors.EVENT_READ:
                        t = writer.now()
                        data = here.read()
                        if not data:
                            self._close_relay(relay, what)
                            continue
                        there.send(data)
                        writer.data(relay.device, relay.conn, what, data, t)
                        if there.pending:
                            other = "device" if what == "client" else "client"
                            self._sel.modify(there.fd, selectors.EVENT_READ |
                                             selectors.EVENT_WRITE, (other, relay))
                except (BlockingIOError, InterruptedError):
                    continue
                except OSError as e:
                    if relay.dev.sock is None and what == "client" and e.errno == errno.EIO:
                        continue         # the pty's client went away; the pty stays
                    log.warning("%s connection %d: %s", relay.device, relay.conn, e)
                    self._close_relay(relay, what)

    def _close_relay(self, relay: _Relay, by: str) -> None:
        if relay not in self._relays:
            return
        self._relays.remove(relay)
        deadline = time.monotonic() + CLOSE_FLUSH_S
        for side in (relay.client, relay.dev):
            try:
                self._sel.unregister(side.fd)
            except (KeyError, ValueError):
                pass
            side.drain(deadline)             # what was relayed reaches it before the close
            if side.sock is not None:
                side.sock.close()
        if self.writer is not None:
            self.writer.event(relay.device, relay.conn, "close", self.writer.now(), by)
