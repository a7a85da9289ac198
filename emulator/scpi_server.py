"""An emulated instrument on a raw TCP socket, as a lab instrument serves port 5025.

`SCPIServer(instrument)` serves an `scpi.Instrument` on loopback; `start_servers` starts a
rig's set of them (none stays open if one cannot start).

Serving: one thread (an `scpi_loop.SCPILoop`) serves every session of a server, or of many
servers. Several clients are served concurrently, as on a real LAN instrument where a second
socket session is allowed: a command that waits holds no thread and never holds up another
session; a reply the client does not read is sent as its socket takes it. Sessions are a
bounded resource that silent clients must not hold: a session that completes no line for
`IDLE_TIMEOUT_S` is dropped, and when every slot is taken a newcomer takes the slot of the
session idle longest (one in the middle of a command is never cut); only when every session is
busy is a newcomer refused. Each client's lines run in the order they arrive, one line after
the other's reply. Each client session has its own error queue (what that client got wrong is
reported to that client).

Input handling: a line ends at `\\n` (`\\r\\n` accepted); a line longer than `MAX_LINE` bytes is
refused (-363 Input buffer overrun) and the input is skipped up to the next newline; a client
that vanishes mid-command is simply dropped, and one that reads nothing of its reply for
`SEND_TIMEOUT_S` is dropped. Every refusal is logged. Replies end in `\\r\\n`.
"""
from __future__ import annotations

import functools
import logging
import re
import selectors
import socket
import struct
import threading
import time

from photonic_testbed.emulator.scpi import (
    Instrument,
    SCPIError,
    Session,
    Waiting,
    next_wait,
)
from photonic_testbed.emulator.scpi_loop import SCPILoop

log = logging.getLogger(__name__)

MAX_LINE = 64 * 1024        # bytes in one program message (a full 32x32 ONLY is ~200 bytes)
MAX_CLIENTS = 16            # sessions served at once; see SCPIServer._admit
SEND_TIMEOUT_S = 5.0        # a client that reads nothing for this long is dropped
IDLE_TIMEOUT_S = 300.0      # a session that completes no line for this long is dropped
LINES_PER_TURN = 16         # lines of one session run before other sockets get their turn
ACCEPTS_PER_TURN = 16       # connections taken at once from a listening socket


class _Conn:
    """One client session's socket on the loop: its input, the line it runs, its reply."""

    def __init__(self, server: SCPIServer, loop: SCPILoop, sock: socket.socket,
                 session: Session):
        self.server = server
        self.loop = loop
        self.sock = sock
        self.session = session
        self.buf = bytearray()
        self.skipping = False          # dropping input up to the next newline (-363)
        self.line = ""                 # the line running, while it runs
        self.running: Waiting | None = None    # its generator, while a command waits
        self.out: bytes | memoryview = b""     # what is left to send of its reply
        self.sent_at = 0.0             # when the reply last made progress
        self.events = 0                # what the selector watches for
        self.eof = False               # the client sent all it will (it may still read)
        self.closed = False
        self.looked = False            # its socket looked at while the command waits
        self._timers: dict[str, list] = {}   # its pending timers: "idle", "wait", "send"

    # ---- the selector's events --------------------------------------------------------------

    def on_event(self, mask: int) -> None:
        if self.closed:
            return
        if mask & selectors.EVENT_WRITE:
            self._flush()
        elif mask & selectors.EVENT_READ:
            if self.running is not None:
                self._look_while_waiting()
                return
            try:
                data = self.sock.recv(65536)
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                self.close()
                return
            self.server.bytes_in += len(data)
            if self.session.dropped:
                self.close()
                return
            if data:
                self.buf += data
            else:        # a half-close: its complete lines are still run and answered
                self.eof = True
        self.pump()

    def pump(self) -> None:
        """Run the complete lines received, one after the other's reply; yields the thread
        after `LINES_PER_TURN` of them."""
        for _ in range(LINES_PER_TURN):
            if self.closed or self.running is not None or self.out:
                break
            if self.session.dropped:
                self.close()
                return
            line = self._next_line()
            if line is None:
                if self.eof:         # every line it sent is answered: close, gracefully
                    self.close(reset=False)
                    return
                break
            self._begin(line)
        else:
            self.loop.call(self.pump)
        if not self.closed:
            self._watch()

    def _look_while_waiting(self) -> None:
        """The socket of a session whose command waits became readable: a reset means the
        client is gone (the session is closed now, freeing its slot, and the command with it;
        what the instrument started goes on); a byte or the end of its input (a half-close, or
        a client gone without a reset: they look the same) stays unread in the kernel until
        the command is done."""
        try:
            self.sock.recv(1, socket.MSG_PEEK)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            log.info("%s: client vanished while its command waited", self.session.peer)
            self.close()
            return
        self.looked = True
        self._watch()

    def _watch(self) -> None:
        """Read while idle, write while a reply waits for the client; while a command waits,
        look once for the client having gone (`_look_while_waiting`), else nothing: its input
        stays in the kernel's buffer, which throttles the client."""
        if self.running is not None:
            want = 0 if self.looked or self.eof else selectors.EVENT_READ
        else:
            self.looked = False
            want = (selectors.EVENT_WRITE if self.out else 0 if self.eof
                    else selectors.EVENT_READ)
        if want == self.events:
            return
        if not want:
            self.loop.unregister(self.sock)
        elif not self.events:
            self.loop.register(self.sock, want, self.on_event)
        else:
            self.loop.modify(self.sock, want, self.on_event)
        self.events = want

    def _next_line(self) -> str | None:
        buf, session = self.buf, self.session
        while True:
            nl = buf.find(b"\n")
            if nl < 0:
                if len(buf) > MAX_LINE:
                    if not self.skipping:
                        session.push_error(SCPIError(-363, "line too long").entry())
                        log.warning("%s: refused a line over %d bytes; skipping to the next "
                                    "newline", session.peer, MAX_LINE)
                    self.skipping = True
                    buf.clear()
                return None
            raw = bytes(buf[:nl])
            del buf[:nl + 1]
            if self.skipping:
                self.skipping = False
                continue
            if len(raw) > MAX_LINE:
                session.push_error(SCPIError(-363, "line too long").entry())
                log.warning("%s: refused a line over %d bytes", session.peer, MAX_LINE)
                continue
            line = raw.rstrip(b"\r").decode("latin-1").strip()
            if line:
                return line

    # ---- one line ---------------------------------------------------------------------------

    def _begin(self, line: str) -> None:
        server = self.server
        if not server._start_line(self.session):
            self.close()
            return
        if server._drop_rules and server._take_drop_rule(line, "before"):
            log.info("%s: connection cut before %r (fault injected)", self.session.peer, line[:60])
            self.close()
            return
        self.line = line
        self.running = server.instrument.run(self.session, line)
        self._step()

    def _step(self) -> None:
        assert self.running is not None
        try:
            until = next_wait(self.running)
        except StopIteration as done:
            self.running = None
            self._reply(done.value)
            return
        except Exception:
            log.exception("%s: unexpected failure running %r; dropping this client",
                          self.session.peer, self.line[:60])
            self.close()
            return
        self._timers["wait"] = self.loop.at(until, self._resume)

    def _resume(self) -> None:
        if self.closed or self.running is None:
            return
        self._step()
        self.pump()

    def _reply(self, reply: str | None) -> None:
        server, session = self.server, self.session
        if session.dropped:            # cut while its line ran
            self.close()
            return
        if server._drop_rules and server._take_drop_rule(self.line, "after"):
            log.info("%s: connection cut after %r (fault injected)", session.peer,
                     self.line[:60])
            self.close()
            return
        if reply is None:
            server._end_line(session)
            return
        self.out = reply.encode("ascii", "replace") + b"\r\n"
        self._flush()
        if self.out:
            self._timers["send"] = self.loop.at(self.sent_at + SEND_TIMEOUT_S,
                                                self._send_overdue)

    def _flush(self) -> None:
        try:
            n = self.sock.send(self.out)
        except (BlockingIOError, InterruptedError):
            n = 0
        except OSError:
            log.info("%s: client vanished before its reply", self.session.peer)
            self.close()
            return
        self.server.bytes_out += n
        if n == len(self.out):
            self.out, self.sent_at = b"", 0.0
            self.server._end_line(self.session)
            return
        self.out = memoryview(self.out)[n:]     # the rest as the client's socket takes it
        if n or not self.sent_at:
            self.sent_at = time.monotonic()

    def _send_overdue(self) -> None:
        if self.closed or not self.out:
            return
        due = self.sent_at + SEND_TIMEOUT_S
        if time.monotonic() < due:
            self._timers["send"] = self.loop.at(due, self._send_overdue)
            return
        log.info("%s: dropped: it read nothing of its reply for %g s", self.session.peer,
                 SEND_TIMEOUT_S)
        self.close()

    def idle_check(self) -> None:
        """Cut the session once it has completed no line for the server's idle timeout."""
        if self.closed:
            return
        server = self.server
        if server._idle_too_long(self.session):
            log.info("%s: dropped after %g s without a complete line", self.session.peer,
                     server.idle_timeout_s)
            self.close()
            return
        self.watch_idle(max(self.session.last_active,
                            time.monotonic() if self.session.busy else 0.0))

    def watch_idle(self, since: float) -> None:
        """Look for the session idle past the server's timeout, counted from `since`."""
        self._timers["idle"] = self.loop.at(since + self.server.idle_timeout_s, self.idle_check)

    def close(self, reset: bool = True) -> None:
        """Close the session's socket: with a reset (RST), as when a link or the instrument
        goes away (the client's next read fails at once), or, once a half-closed client has
        every reply, gracefully. A command still waiting is closed, and nothing more of its
        line runs (the session is cut first)."""
        if self.closed:
            return
        self.closed = True
        self.server._forget(self)              # session.dropped: its line runs nothing more
        if self.events:
            self.loop.unregister(self.sock)
            self.events = 0
        running, self.running = self.running, None
        self.buf, self.out = bytearray(), b""
        for timer in self._timers.values():     # (this session's: let go now, not when due)
            self.loop.cancel(timer)
        self._timers.clear()
        try:
            if reset:
                self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER,
                                     struct.pack("ii", 1, 0))
        except OSError:
            pass
        finally:
            self.sock.close()
        log.info("%s: client disconnected", self.session.peer)
        if running is not None:
            try:
                running.close()
            except Exception:   # a handler's cleanup that failed (or that is running now)
                log.exception("%s: a waiting command did not stop cleanly", self.session.peer)


class SCPIServer:
    """Serves an `Instrument` on a loopback TCP port (0 = an ephemeral port), on `loop` (one of
    its own when none is given)."""

    def __init__(self, instrument: Instrument, host: str = "127.0.0.1", port: int = 0,
                 name: str = "scpi", idle_timeout_s: float = IDLE_TIMEOUT_S,
                 loop: SCPILoop | None = None):
        if not idle_timeout_s > 0:
            raise ValueError(f"idle_timeout_s must be > 0, not {idle_timeout_s!r}")
        self.instrument = instrument
        self.idle_timeout_s = idle_timeout_s
        self.name = name
        self.host = host
        self._want_port = port
        self.port = 0
        self._given_loop = loop
        self._loop: SCPILoop | None = None
        self._life = threading.Lock()     # start and close, one at a time
        self._listener: socket.socket | None = None
        self._conns: dict[socket.socket, _Conn] = {}
        self._clients_lock = threading.Lock()
        # (header regex, "before" | "after"): drop the client whose line matches, once.
        self._drop_rules: list[tuple[re.Pattern, str]] = []
        self.bytes_in = 0
        self.bytes_out = 0

    @property
    def resource(self) -> str:
        return f"TCPIP::{self.host}::{self.port}::SOCKET"

    def start(self) -> str:
        with self._life:
            return self._start()

    def _start(self) -> str:
        if self._loop is not None:
            return self.resource
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        listener = socket.socket(family, socket.SOCK_STREAM)
        try:
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            listener.bind((self.host, self._want_port))
            listener.listen(8)
            listener.setblocking(False)
        except OSError:
            listener.close()
            raise
        self._listener = listener
        self.port = listener.getsockname()[1]
        loop = self._loop = self._given_loop or SCPILoop(self.name)
        loop.acquire()
        try:
            loop.call_wait(lambda: loop.register(listener, selectors.EVENT_READ,
                                                 functools.partial(self._on_accept, loop)))
        except BaseException:
            self._close()
            raise
        log.info("%s listening on %s", self.name, self.resource)
        return self.resource

    def close(self) -> None:
        with self._life:
            self._close()

    def _close(self) -> None:
        loop, self._loop = self._loop, None
        if loop is None:
            return
        try:
            loop.call_wait(functools.partial(self._shut, loop))
        except TimeoutError:
            log.error("%s: the serving thread did not close the server in time", self.name)
        finally:
            loop.release()

    def _shut(self, loop: SCPILoop) -> None:
        listener, self._listener = self._listener, None
        if listener is not None:
            loop.unregister(listener)
            listener.close()
        with self._clients_lock:
            conns = list(self._conns.values())
        for c in conns:
            c.close()

    def __enter__(self) -> SCPIServer:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def clients(self) -> int:
        """Sessions being served (not counting ones already cut and closing)."""
        with self._clients_lock:
            return sum(not c.session.dropped for c in self._conns.values())

    @property
    def busy_clients(self) -> int:
        """Sessions in the middle of a command."""
        with self._clients_lock:
            return sum(c.session.busy and not c.session.dropped for c in self._conns.values())

    def drop_clients(self) -> int:
        """Cut every client's TCP connection now (a reset, as when a cable or a switch fails).
        Safe from any thread, holding the instrument's lock or not: the sessions are marked cut
        at once (they run nothing more) and their sockets closed by the serving thread."""
        with self._clients_lock:
            conns = list(self._conns.values())
            for c in conns:
                c.session.dropped = True
        loop = self._loop
        if loop is not None:
            loop.call(self._reap)
        return len(conns)

    def _reap(self) -> None:
        with self._clients_lock:
            cut = [c for c in self._conns.values() if c.session.dropped]
        for c in cut:
            try:
                c.close()
            except Exception:        # (close guards itself; the others are cut regardless)
                log.exception("%s: closing a cut session failed", c.session.peer)

    def drop_on(self, header: str, when: str = "after") -> None:
        """Cut the connection of the next client that sends a line containing `header`
        (a regex, case-insensitive), `before` or `after` the line runs."""
        if when not in ("before", "after"):
            raise ValueError("when must be 'before' or 'after'")
        try:
            rule = re.compile(header, re.I)
        except (re.error, TypeError) as e:
            raise ValueError(f"header {header!r} is not a regular expression: {e}") from None
        self._drop_rules.append((rule, when))

    def _on_accept(self, loop: SCPILoop, mask: int) -> None:
        for _ in range(ACCEPTS_PER_TURN):
            listener = self._listener
            if listener is None or self._loop is not loop:
                return
            try:
                sock, addr = listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                log.exception("%s: accept failed", self.name)
                return
            session = Session(f"{self.name} {addr[0]}:{addr[1]}")
            conn = _Conn(self, loop, sock, session)
            if not self._admit(conn):
                log.warning("%s: refused a connection from %s:%s: all %d sessions are busy",
                            self.name, addr[0], addr[1], MAX_CLIENTS)
                sock.close()
                continue
            try:
                sock.setblocking(False)
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            except OSError:            # gone already
                conn.close()
                continue
            conn.pump()                # watches for its input
            conn.watch_idle(session.last_active)
            log.info("%s: client connected", session.peer)

    def _admit(self, conn: _Conn) -> bool:
        """Give the newcomer a session slot; when all are taken, cut the session idle longest
        (so silent clients can never lock others out); refuse only if every session is busy."""
        with self._clients_lock:
            live = [c for c in self._conns.values() if not c.session.dropped]
            victim = None
            if len(live) >= MAX_CLIENTS:
                idle = [c for c in live if not c.session.busy]
                if not idle:
                    return False
                victim = min(idle, key=lambda c: c.session.last_active)
                victim.session.dropped = True
            self._conns[conn.sock] = conn
        if victim is not None:
            log.warning("%s: cut (idle %.1f s) to make room for a new connection",
                        victim.session.peer, time.monotonic() - victim.session.last_active)
            victim.close()
        return True

    def _forget(self, conn: _Conn) -> None:
        with self._clients_lock:
            conn.session.dropped = True
            if self._conns.get(conn.sock) is conn:
                del self._conns[conn.sock]

    # A session's `busy` and `last_active` change on the serving thread alone (which also
    # admits newcomers and so picks whom to cut): no lock. Another thread may set `dropped`
    # at any time (`drop_clients`); a line already started then runs, and its reply is not sent.

    @staticmethod
    def _start_line(session: Session) -> bool:
        """Mark the session busy unless it has been cut; False if it has."""
        if session.dropped:
            return False
        session.busy = True
        return True

    @staticmethod
    def _end_line(session: Session) -> None:
        session.busy = False
        session.last_active = time.monotonic()

    def _idle_too_long(self, session: Session) -> bool:
        """True (and the session marked cut) once it has completed no line for the timeout."""
        if session.busy or session.dropped:
            return False
        if time.monotonic() - session.last_active > self.idle_timeout_s:
            session.dropped = True
            return True
        return False

    def _take_drop_rule(self, line: str, when: str) -> bool:
        for i, (rx, w) in enumerate(self._drop_rules):
            if w == when and rx.search(line):
                del self._drop_rules[i]
                return True
        return False


def start_servers(servers: dict[str, SCPIServer]) -> dict[str, str]:
    """Start every server: {name: its VISA resource}; if one cannot start, none stays open."""
    endpoints = {}
    try:
        for name, server in servers.items():
            endpoints[name] = server.start()
    except BaseException:
        close_servers(servers)
        raise
    return endpoints


def close_servers(servers: dict[str, SCPIServer]) -> None:
    for server in servers.values():
        server.close()
