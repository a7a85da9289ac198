"""Replaying a session (hil.lab.session), either side.

`replay(session, wires)` plays the recorded client side against devices (the emulator, another
board, the lab's own) and reports every answer that differs from the recording. Exchanges are
played in the order they were recorded, each sent once the previous one's answer is in, as fast
as the device answers (`pace=True` keeps the client's recorded gaps instead). An answer is
complete when as many lines (`\\n`) have come as the recording has, or after the timeout; bytes
a device sends before the next exchange is sent count towards the previous one, so an extra
line is named where it belongs.

`ScriptedDevices(session)` plays the recorded device side for a client under test: each device
listens where a client expects it (a pty link for serial devices, a loopback socket for the
others), checks that the client sends what the recording has it send, byte for byte however
it is split into writes, and answers with the recorded answer. It stops answering on a
connection at the first difference (closing it, for a socket) and reports it.

Both give a `ReplayReport`: `ok`, `first` (the first differing exchange), `describe()`.
"""
from __future__ import annotations

import fcntl
import logging
import os
import pathlib
import select
import shutil
import socket
import struct
import tempfile
import termios
import threading
import time
from dataclasses import dataclass, field

from photonic_testbed.hil.lab.client_side import ListenError, listen_tcp, serial_link
from photonic_testbed.hil.lab.recorder import RecorderError, open_serial
from photonic_testbed.hil.lab.session import Comparison, Exchange, Session, Wire, show

log = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 2.0
LATE_FACTOR = 3.0              # an answer may take this many times its recorded time...
LATE_MAX_S = 60.0              # ...but no longer than this (or --timeout-s, if that is longer)
END_GRACE_S = 0.05             # how long the end of a connection is watched for extra answers
MISMATCH_READ_S = 0.2          # how long a differing client line is read on, for the report
EXACT = Comparison()           # byte for byte
SILENT_AFTER = 3               # exchanges in a row with no byte of answer: the device is silent


class ReplayError(Exception):
    """A session cannot be replayed: a device it needs is not given or does not answer."""


@dataclass(frozen=True)
class Difference:
    exchange: Exchange
    got: bytes | None          # what the device answered (side "device") or the client sent
    side: str = "device"       # "device": an answer differs; "client": what a client sent
    note: str = ""

    def describe(self) -> str:
        x = self.exchange
        if self.side == "device":
            text = (f"{x.name()}: sent {show(x.sent)}; recorded answer {show(x.answer)}, "
                    f"got {show(self.got)}")
        else:
            text = (f"{x.name()}: the recording has the client send {show(x.sent)}, "
                    f"the client sent {show(self.got)}")
        return text + (f" ({self.note})" if self.note else "")

    def to_dict(self) -> dict:
        x = self.exchange
        return {"exchange": x.index, "device": x.device, "conn": x.conn, "line": x.line,
                "t": x.t, "side": self.side, "sent": x.sent.decode("latin-1"),
                "recorded": x.answer.decode("latin-1"),
                "got": None if self.got is None else self.got.decode("latin-1"),
                "note": self.note}


@dataclass
class ReplayReport:
    session: str
    mode: str                  # "client" (we played the client) or "device"
    exchanges: int             # in the session
    played: int = 0            # exchanges played
    differences: list[Difference] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.differences and self.played == self.exchanges

    @property
    def first(self) -> Difference | None:
        return min(self.differences, key=lambda d: d.exchange.index, default=None)

    def describe(self) -> str:
        what = "answers" if self.mode == "client" else "client's requests"
        if self.ok:
            return (f"{self.session}: {self.played} exchanges replayed, every one of the "
                    f"{what} as recorded")
        diffs = sorted(self.differences, key=lambda d: d.exchange.index)
        out = [f"{self.session}: {len(diffs)} of {self.exchanges} exchanges differ from the "
               f"recording ({self.played} played)"]
        if diffs:
            out.append(f"first difference: {diffs[0].describe()}")
            out += [f"  {d.describe()}" for d in diffs[1:]]
        return "\n".join(out)

    def to_dict(self) -> dict:
        return {"session": self.session, "mode": self.mode, "exchanges": self.exchanges,
                "played": self.played, "ok": self.ok,
                "first": None if self.first is None else self.first.exchange.index,
                "differences": [d.to_dict() for d in sorted(self.differences,
                                                            key=lambda d: d.exchange.index)]}


# ---- our end of a device's wire ------------------------------------------------------------------

class _Link:
    """A connection to a device (a serial port or a socket) with its unread bytes."""

    def __init__(self, wire: Wire, timeout_s: float):
        self.wire = wire
        self.buf = bytearray()
        self.closed = False
        self._sock: socket.socket | None = None
        self._port = None
        if wire.kind == "serial":
            try:
                self._port = open_serial(wire.path)
            except RecorderError as e:
                raise ReplayError(str(e)) from None
            self.fd = self._port.fileno()
        else:
            try:
                self._sock = socket.create_connection((wire.host, wire.port), timeout=timeout_s)
            except (OSError, UnicodeError) as e:     # (UnicodeError: not a host name)
                raise ReplayError(f"cannot connect to {wire.address}: "
                                  f"{getattr(e, 'strerror', None) or e}") \
                    from None
            self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._sock.setblocking(False)
            self.fd = self._sock.fileno()

    def send(self, data: bytes) -> None:
        view = memoryview(data)
        while view:
            select.select([], [self.fd], [], 1.0)
            try:
                n = self._sock.send(view) if self._sock is not None else os.write(self.fd, view)
            except BlockingIOError:
                continue
            view = view[n:]

    def _read(self, timeout: float) -> bool:
        """Read what comes within `timeout`; False once the device closed the connection."""
        if self.closed:
            return False
        ready, _, _ = select.select([self.fd], [], [], max(timeout, 0.0))
        if not ready:
            return True
        try:
            data = self._sock.recv(65536) if self._sock is not None else os.read(self.fd, 65536)
        except (BlockingIOError, InterruptedError):
            return True
        except OSError as e:
            log.info("%s: %s", self.wire.address, e)
            data = b""
        if not data:
            self.closed = True
            return False
        self.buf += data
        return True

    def drain_now(self) -> bytes:
        """Whatever the device has sent that is not taken yet."""
        while self._read(0.0) and not self.closed:
            ready, _, _ = select.select([self.fd], [], [], 0)
            if not ready:
                break
        out = bytes(self.buf)
        self.buf.clear()
        return out

    def take(self, expected: bytes, comparison: Comparison, timeout_s: float
             ) -> tuple[bytes, str]:
        """The answer to what was just sent: as many kept lines as `expected` has (and its
        unfinished last line, if any), or what came before the timeout (with a note)."""
        kept = comparison.kept(expected)
        want = sum(1 for ln in kept if ln.endswith(b"\n"))
        tail = len(kept[-1]) if kept and not kept[-1].endswith(b"\n") else 0
        if not want and not tail:
            return b"", ""
        deadline = time.monotonic() + timeout_s
        while True:
            cut = self._cut(want, tail, comparison)
            if cut is not None:
                out = bytes(self.buf[:cut])
                del self.buf[:cut]
                return out, ""
            left = deadline - time.monotonic()
            if left <= 0 or not self._read(min(left, 0.5)):
                out = bytes(self.buf)
                self.buf.clear()
                why = ("the device closed the connection" if self.closed else
                       f"no complete answer within {timeout_s:.3g} s")
                return out, why

    def _cut(self, want: int, tail: int, comparison: Comparison) -> int | None:
        count, pos = 0, 0
        data = bytes(self.buf)
        while count < want:
            nl = data.find(b"\n", pos)
            if nl < 0:
                return None
            if comparison.kept(data[pos:nl + 1]):
                count += 1
            pos = nl + 1
        if tail:
            if len(data) - pos < tail:
                return None
            pos += tail
        return pos

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
        if self._port is not None:
            self._port.close()


# ---- playing the client --------------------------------------------------------------------------

def replay(session: Session, wires: dict[str, Wire], *, comparison: Comparison = EXACT,
           timeout_s: float = DEFAULT_TIMEOUT_S, pace: bool = False) -> ReplayReport:
    """Play the session's client side against the devices at `wires` (device name -> Wire)."""
    missing = [d for d in session.used if d not in wires]
    if missing:
        raise ReplayError(f"no address for {', '.join(missing)} (the devices the session "
                          f"used: {', '.join(session.used)})")
    exchanges = session.exchanges()
    report = ReplayReport(session.where, "client", len(exchanges))
    links: dict[tuple[str, int], _Link] = {}
    last: dict[tuple[str, int], tuple[Exchange, bytes, str]] = {}
    failed: set[tuple[str, int]] = set()
    unanswered: dict[tuple[str, int], int] = {}      # exchanges in a row without a byte back
    opened_once: set[str] = set()
    t_first = exchanges[0].t if exchanges else 0.0
    start = time.monotonic()

    def settle(key) -> None:
        """Judge the last exchange on a link, with anything the device sent after it."""
        if key not in last:
            return
        x, got, note = last.pop(key)
        link = links.get(key)
        if link is not None and not link.closed:
            got += link.drain_now()
        if note or not comparison.same(x.answer, got):
            if note == "" and len(comparison.kept(got)) > len(comparison.kept(x.answer)):
                note = "more than the recorded answer"
            report.differences.append(Difference(x, got, "device", note))

    def open_link(key) -> None:
        device = key[0]
        try:
            links[key] = _Link(wires[device], timeout_s)
        except ReplayError:
            if device not in opened_once:
                raise                # the device is not there at all: nothing to compare
            failed.add(key)
            return
        opened_once.add(device)

    try:
        for what, item in session.script():
            if isinstance(item, tuple):              # open or close
                if item[0] not in session.used:
                    continue                         # a device nothing was said to
                if what == "open":
                    open_link(item)
                    continue
                settle(item)
                closing = links.pop(item, None)
                if closing is not None:
                    if not closing.closed:
                        closing.drain_now()
                    closing.close()
                continue
            x = item
            key = (x.device, x.conn)
            if key not in links and key not in failed:
                open_link(key)            # a session cut short of its open line
            if key in failed:
                report.differences.append(Difference(
                    x, None, "device", f"cannot connect to {wires[x.device].address}"))
                continue
            link = links[key]
            settle(key)
            if unanswered.get(key, 0) >= SILENT_AFTER and x.answer:
                # not waited for again: a silent device would hold every exchange its timeout
                report.differences.append(Difference(
                    x, None, "device", f"not played: the device answered none of the last "
                    f"{SILENT_AFTER} exchanges on this connection"))
                continue
            if pace:
                time.sleep(max(0.0, start + (x.t - t_first) - time.monotonic()))
            got, note = b"", ""
            if x.sent:
                if link.closed:
                    note = "the device closed the connection"
                else:
                    try:
                        link.send(x.sent)
                    except OSError as e:
                        note = f"cannot send: {e}"
            if not note:
                got, note = link.take(x.answer, comparison,
                                      max(timeout_s, min(LATE_FACTOR * x.latency_s,
                                                         LATE_MAX_S)))
            report.played += 1
            last[key] = (x, got, note)
            if x.answer:
                unanswered[key] = 0 if got else unanswered.get(key, 0) + 1
        if last:
            time.sleep(END_GRACE_S)
        for key in list(last):
            settle(key)
    finally:
        for link in links.values():
            link.close()
    return report


# ---- playing the devices -------------------------------------------------------------------------

class _Script:
    """One recorded connection of one device, as the device plays it."""

    def __init__(self, device: str, conn: int, exchanges: list[Exchange]):
        self.device = device
        self.conn = conn
        self.exchanges = exchanges
        self.done = 0                # exchanges answered
        self.stopped = False         # ended at a difference
        self.opened = False


class ScriptedDevices:
    """The session's devices, each answering as recorded (module docstring)."""

    def __init__(self, session: Session, *, listen: str = "127.0.0.1",
                 ports: dict[str, int] | None = None,
                 link_dir: str | os.PathLike | None = None):
        self.session = session
        self.listen = listen
        self.ports = dict(ports or {})
        self._own_dir = link_dir is None
        self._link_dir = pathlib.Path(link_dir) if link_dir else None
        self.addresses: dict[str, str] = {}
        self.report = ReplayReport(session.where, "device", len(session.exchanges()))
        self._scripts: dict[str, list[_Script]] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._closers: list = []
        self._slaves: list[int] = []         # the serial devices' pty ends the clients read
        for device in session.devices:
            conns = sorted({x.conn for x in session.exchanges() if x.device == device} |
                           {e.conn for e in session.events if e.device == device})
            self._scripts[device] = [
                _Script(device, c, [x for x in session.exchanges()
                                    if x.device == device and x.conn == c]) for c in conns]

    def start(self) -> dict[str, str]:
        link_dir = self._link_dir
        if link_dir is None:
            link_dir = self._link_dir = pathlib.Path(tempfile.mkdtemp(prefix="ptb-scripted-"))
        try:
            for device in self.session.devices:
                wire = self.session.wire(device)
                if wire.kind == "serial":
                    self.addresses[device] = self._start_serial(device, link_dir)
                else:
                    self.addresses[device] = self._start_tcp(device)
        except BaseException:
            self.close()
            raise
        return dict(self.addresses)

    def finished(self) -> bool:
        """Whether every recorded exchange has been answered, or a difference ended a script."""
        with self._lock:
            return all(s.stopped or s.done == len(s.exchanges)
                       for scripts in self._scripts.values() for s in scripts)

    def taken(self, timeout_s: float = 5.0) -> bool:
        """Wait until the serial clients have read every byte played to them (at most
        `timeout_s`): closing a pty drops what its client has not read yet."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                unread = sum(struct.unpack("i", fcntl.ioctl(fd, termios.FIONREAD, b"\0" * 4))[0]
                             for fd in self._slaves)
            except OSError:
                return True
            if not unread:
                return True
            if time.monotonic() > deadline:
                return False
            time.sleep(0.01)

    def wait(self, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while not self.finished():
            if time.monotonic() > deadline:
                return False
            time.sleep(0.02)
        return True

    def close(self) -> ReplayReport:
        """Stop serving; the report, with every exchange the client never reached."""
        self._stop.set()
        for closer in self._closers:
            closer()
        self._closers.clear()
        for t in self._threads:
            t.join(5.0)
        self._threads.clear()
        if self._link_dir is not None and self._own_dir:
            shutil.rmtree(self._link_dir, ignore_errors=True)
        with self._lock:
            played = sum(s.done for scripts in self._scripts.values() for s in scripts)
            self.report.played = played
            for scripts in self._scripts.values():
                for s in scripts:
                    if not s.stopped and s.done < len(s.exchanges):
                        x = s.exchanges[s.done]
                        s.stopped = True
                        self.report.differences.append(Difference(
                            x, None, "client", "the client never sent it" +
                            ("" if s.opened else f" (it never opened connection {s.conn})")))
        return self.report

    def __enter__(self) -> ScriptedDevices:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- serving -------------------------------------------------------------------------

    def _start_serial(self, device: str, link_dir: pathlib.Path) -> str:
        try:
            master, slave, link = serial_link(link_dir, device)
        except ListenError as e:
            raise ReplayError(str(e)) from None
        self._slaves.append(slave)

        def close() -> None:
            if slave in self._slaves:
                self._slaves.remove(slave)
            for fd in (master, slave):
                try:
                    os.close(fd)
                except OSError:
                    pass
            link.remove()
        scripts = self._scripts[device]
        t = threading.Thread(target=self._serve_fd, args=(scripts[0] if scripts else None,
                                                          master, None),
                             name=f"scripted-{device}", daemon=True)
        self._threads.append(t)
        t.start()
        self._closers.append(close)
        return str(link)

    def _start_tcp(self, device: str) -> str:
        try:
            s, address = listen_tcp(self.listen, self.ports.get(device, 0), device)
        except ListenError as e:
            raise ReplayError(str(e)) from None
        s.settimeout(0.2)
        self._closers.append(s.close)
        t = threading.Thread(target=self._accept, args=(device, s), name=f"scripted-{device}",
                             daemon=True)
        self._threads.append(t)
        t.start()
        return address

    def _accept(self, device: str, listener: socket.socket) -> None:
        scripts = iter(self._scripts[device])
        while not self._stop.is_set():
            try:
                conn, _ = listener.accept()
            except (TimeoutError, BlockingIOError):
                continue
            except OSError:
                return
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn.setblocking(False)
            script = next(scripts, None)
            t = threading.Thread(target=self._serve_fd, args=(script, conn.fileno(), conn),
                                 name=f"scripted-{device}-conn", daemon=True)
            self._threads.append(t)
            t.start()

    def _serve_fd(self, script: _Script | None, fd: int, sock: socket.socket | None) -> None:
        try:
            self._serve(script, fd, sock)
        except OSError as e:
            if not self._stop.is_set():
                log.info("scripted %s: %s", script.device if script else "device", e)
        finally:
            if sock is not None:
                sock.close()

    def _serve(self, script: _Script | None, fd: int, sock: socket.socket | None) -> None:
        def read(timeout: float) -> bytes | None:
            ready, _, _ = select.select([fd], [], [], timeout)
            if not ready:
                return b""
            try:
                data = sock.recv(65536) if sock is not None else os.read(fd, 65536)
            except (BlockingIOError, InterruptedError):
                return b""
            return data or None           # None: the client closed

        def write(data: bytes) -> None:
            view = memoryview(data)
            while view and not self._stop.is_set():
                select.select([], [fd], [], 0.2)
                try:
                    n = sock.send(view) if sock is not None else os.write(fd, view)
                except BlockingIOError:
                    continue
                view = view[n:]

        if script is None:
            log.warning("a client opened a connection the recording does not have")
            return
        with self._lock:
            script.opened = True
        buf = bytearray()
        for x in script.exchanges:
            need = x.sent
            while len(buf) < len(need) and bytes(buf) == need[:len(buf)]:
                if self._stop.is_set():
                    return
                data = read(0.2)
                if data is None:
                    return                 # the client left; close() reports what is missing
                buf += data
            if bytes(buf[:len(need)]) != need:
                deadline = time.monotonic() + MISMATCH_READ_S
                while b"\n" not in buf[len(need) // 2:] and time.monotonic() < deadline:
                    data = read(0.05)
                    if data is None:
                        break
                    buf += data
                with self._lock:
                    script.stopped = True
                    self.report.differences.append(Difference(x, bytes(buf), "client"))
                return
            del buf[:len(need)]
            if x.answer:
                write(x.answer)
            with self._lock:
                script.done += 1
        # the script is played out: anything more the client sends is a difference
        while not self._stop.is_set():
            if buf:
                with self._lock:
                    self.report.differences.append(Difference(
                        script.exchanges[-1] if script.exchanges else Exchange(
                            0, script.device, script.conn, 0, 0.0), bytes(buf), "client",
                        "sent after the last recorded exchange"))
                return
            data = read(0.2)
            if data is None:
                return
            buf += data
