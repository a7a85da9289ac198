"""A small SCPI server: a command table, IEEE 488.2 error queue, raw TCP on loopback.

Each emulated instrument (OCS, power meter, laser) is an `Instrument` with a command table, served
by `SCPIServer` on a raw socket exactly as a lab instrument serves port 5025.

Serving: one thread per client, so several clients are served concurrently (as on a real LAN
instrument, where a second socket session is allowed). Sessions are a bounded resource that silent
clients must not hold: a session that completes no line for `IDLE_TIMEOUT_S` is dropped, and when
every slot is taken a newcomer takes the slot of the session idle longest (one in the middle of a
command is never cut); only when every session is busy is a newcomer refused. Each client's
lines run in the order they arrive; every program message unit runs while holding the
instrument's lock, so units from different clients interleave whole, never half-applied.
`*OPC?` waits for pending operations without holding the lock. Each client session has its
own error queue (what that client got wrong is reported to that client).

Input handling: a line ends at `\\n` (`\\r\\n` accepted); a line longer than `MAX_LINE` bytes is
refused (-363 Input buffer overrun) and the input is skipped up to the next newline; bytes
outside printable ASCII are a command error; a client that vanishes mid-command is simply
dropped. Every refusal is logged. Replies end in `\\r\\n`; replies of several queries on one
line are joined with `;` (IEEE 488.2).
"""
from __future__ import annotations

import logging
import math
import re
import socket
import struct
import threading
import time
from dataclasses import dataclass
from typing import Callable

log = logging.getLogger(__name__)

MAX_LINE = 64 * 1024        # bytes in one program message (a full 32x32 ONLY is ~200 bytes)
ERROR_QUEUE_LEN = 30
MAX_CLIENTS = 16            # sessions served at once (threads); see SCPIServer._admit
SEND_TIMEOUT_S = 5.0        # a client that reads nothing for this long is dropped
IDLE_TIMEOUT_S = 300.0      # a session that completes no line for this long is dropped
FOUND_KEPT = 1024            # headers whose lookup an instrument remembers
IDLE_POLL_S = 0.05          # how often a client thread notices that the server is closing

ERROR_TEXT = {
    0: "No error",
    -100: "Command error",
    -101: "Invalid character",
    -102: "Syntax error",
    -104: "Data type error",
    -108: "Parameter not allowed",
    -109: "Missing parameter",
    -113: "Undefined header",
    -114: "Header suffix out of range",
    -131: "Invalid suffix",
    -200: "Execution error",
    -220: "Parameter error",
    -221: "Settings conflict",
    -222: "Data out of range",
    -224: "Illegal parameter value",
    -240: "Hardware error",
    -300: "Device-specific error",
    -350: "Queue overflow",
    -363: "Input buffer overrun",
    -410: "Query INTERRUPTED",
}


class SCPIError(Exception):
    """Raised by a command handler: goes to the session's error queue as `code,"text; detail"`."""

    def __init__(self, code: int, detail: str = ""):
        self.code = code
        self.detail = detail
        super().__init__(self.entry())

    def entry(self) -> str:
        text = ERROR_TEXT.get(self.code, "Error")
        if self.detail:
            text = f"{text}; {self.detail}"
        return f'{self.code},"{text}"'


# ---- header patterns ------------------------------------------------------------------------

def _node_regex(word: str, suffix: bool) -> str:
    short = "".join(c for c in word if c.isupper() or c == "*")
    longf = word.upper()
    alts = sorted({short, longf}, key=len, reverse=True)
    body = "(?:" + "|".join(re.escape(a) for a in alts) + ")"
    if suffix:
        body += r"(\d*)"
    return body


def compile_header(pattern: str) -> re.Pattern:
    """`:SENSe#[:CHANnel#]:POWer:WAVelength?` -> a regex for an uppercased header.

    Uppercase letters are the short form; a node matches its short or its long form. `#` is an
    optional numeric suffix (captured); `[...]` is an optional node.
    """
    query = pattern.endswith("?")
    body = pattern[:-1] if query else pattern
    parts = re.findall(r"\[:[A-Za-z]+#?\]|:?[A-Za-z*]+#?", body)
    if "".join(parts).replace("[", "").replace("]", "").lstrip(":") != body.replace(
            "[", "").replace("]", "").lstrip(":"):
        raise ValueError(f"bad header pattern {pattern!r}")
    rx = ""
    for i, part in enumerate(parts):
        optional = part.startswith("[")
        word = part.strip("[]:")
        suffix = word.endswith("#")
        word = word.rstrip("#")
        node = _node_regex(word, suffix)
        sep = ":" if i else ":?"
        rx += f"(?:{sep}{node})?" if optional else f"{sep}{node}"
    rx += r"\?" if query else ""
    return re.compile(rx)


@dataclass
class Command:
    pattern: str
    handler: Callable[["Session", tuple, str], str | None]
    locked: bool = True          # run holding the instrument lock (False for *OPC?-like waits)
    regex: re.Pattern | None = None


class Session:
    """One client connection: its error queue and where it is talking from."""

    def __init__(self, peer: str):
        self.peer = peer
        self.errors: list[str] = []
        self.dropped = False          # cut (fault, idle, or to make room): serve nothing more
        self.busy = False             # running a line or sending its reply: never cut for room
        self.last_active = time.monotonic()   # when its last line was done (or it connected)

    def push_error(self, entry: str) -> None:
        if len(self.errors) >= ERROR_QUEUE_LEN:
            self.errors[-1] = f'-350,"{ERROR_TEXT[-350]}"'
            return
        self.errors.append(entry)

    def pop_error(self, no_error: str = f'0,"{ERROR_TEXT[0]}"') -> str:
        return self.errors.pop(0) if self.errors else no_error


_SPECIAL = re.compile(r"[;()\"']")


def split_units(line: str) -> list[str]:
    """Split a program message into units at `;` outside parentheses and quotes.

    A unit that starts with `(` continues the previous unit's parameter, which is how the
    `(@1),(@33);(@2),(@34)` channel-list form survives the split.
    """
    units: list[str] = []
    depth, quote, start = 0, "", 0
    for m in _SPECIAL.finditer(line):         # only the characters that matter
        i, c = m.start(), m.group()
        if quote:
            if c == quote:
                quote = ""
        elif c in "\"'":
            quote = c
        elif c == "(":
            depth += 1
        elif c == ")":
            depth = max(0, depth - 1)
        elif c == ";" and depth == 0:
            units.append(line[start:i])
            start = i + 1
    units.append(line[start:])
    merged: list[str] = []
    for u in units:
        if merged and u.strip().startswith("("):
            merged[-1] += ";" + u
        else:
            merged.append(u)
    return [u.strip() for u in merged if u.strip()]


_HEADER = re.compile(r"^[:*]?[A-Za-z][A-Za-z0-9]*(?::[A-Za-z][A-Za-z0-9]*)*\??$")


class Instrument:
    """An instrument's command table and state; subclasses add commands with `command()`."""

    idn = "Emulated,Instrument,0,1.0"
    no_error = f'0,"{ERROR_TEXT[0]}"'       # Keysight instruments answer +0,"No error"

    def __init__(self):
        self.lock = threading.RLock()
        self.commands: list[Command] = []
        self._found: dict[str, tuple[Command, tuple] | None] = {}   # header -> lookup's answer
        self.lines_in = 0
        self.command("*IDN?", lambda s, sfx, arg: self.idn)
        self.command("*RST", lambda s, sfx, arg: self.reset())
        self.command("*CLS", lambda s, sfx, arg: s.errors.clear())
        self.command("*OPC?", self._opc, locked=False)
        self.command("*OPC", lambda s, sfx, arg: None)
        self.command("*WAI", lambda s, sfx, arg: self._opc(s, sfx, arg) and None, locked=False)
        self.command(":SYSTem:ERRor[:NEXT]?", lambda s, sfx, arg: s.pop_error(self.no_error))
        self.command(":SYSTem:ERRor:ALL?", self._err_all)

    # ---- table ------------------------------------------------------------------------------

    def command(self, pattern: str, handler, locked: bool = True) -> None:
        self.commands.append(Command(pattern, handler, locked, compile_header(pattern)))
        self._found.clear()

    def lookup(self, header: str) -> tuple[Command, tuple] | None:
        try:
            return self._found[header]
        except KeyError:
            pass
        h = header.upper()
        found = None
        for cmd in self.commands:
            m = cmd.regex.fullmatch(h)
            if m:
                found = cmd, tuple(int(g) if g else None for g in m.groups())
                break
        if len(self._found) < FOUND_KEPT:      # a client sending endless new headers
            self._found[header] = found         # is answered, just not remembered
        return found

    # ---- overridable behaviour ---------------------------------------------------------------

    def reset(self) -> None:
        """*RST: back to the default settings."""

    def pending_until(self) -> float:
        """time.monotonic() at which every operation started so far has completed."""
        return 0.0

    def _opc(self, session, sfx, arg) -> str:
        wait = self.pending_until() - time.monotonic()
        if wait > 0:
            time.sleep(wait)
        return "1"

    def _err_all(self, session, sfx, arg) -> str:
        out = []
        while session.errors:
            out.append(session.pop_error())
        return ",".join(out) if out else self.no_error

    # ---- executing a line ---------------------------------------------------------------------

    def execute(self, session: Session, line: str) -> str | None:
        """Run one program message (a line without its terminator); the reply, or None."""
        self.lines_in += 1
        if not (line.isascii() and line.replace("\t", " ").isprintable()):
            session.push_error(SCPIError(-101, "non-ASCII or control bytes").entry())
            log.warning("%s: refused line with non-printable bytes: %r", session.peer, line[:80])
            return None
        replies: list[str] = []
        path = ""
        for unit in split_units(line):
            header, _, arg = unit.partition(" ")
            if "\t" in header:
                header, _, rest = header.partition("\t")
                arg = rest + (" " + arg if arg else "")
            arg = arg.strip()
            found = None
            full = header
            if _HEADER.match(header):
                if path and header[0] not in ":*":
                    found = self.lookup(path + header)
                    full = path + header
                if found is None:
                    found, full = self.lookup(header), header
            if found is None:
                code = -113 if _HEADER.match(header) else -102
                session.push_error(SCPIError(code, header[:40]).entry())
                log.warning("%s: refused %r: %s", session.peer, unit[:80], ERROR_TEXT[code])
                continue
            if full[0] != "*":
                # SCPI: a following header without a leading colon is relative to this path
                path = full[:full.rfind(":") + 1]
            cmd, sfx = found
            try:
                if cmd.locked:
                    with self.lock:
                        reply = cmd.handler(session, sfx, arg)
                else:
                    reply = cmd.handler(session, sfx, arg)
            except SCPIError as e:
                session.push_error(e.entry())
                log.warning("%s: refused %r: %s", session.peer, unit[:80], e.entry())
                continue
            except Exception:   # a handler bug must not take the instrument down
                session.push_error(SCPIError(-300, "internal fault").entry())
                log.exception("%s: %r failed inside the instrument", session.peer, unit[:80])
                continue
            if reply is not None:
                replies.append(str(reply))
        return ";".join(replies) if replies else None


# ---- parameter helpers ----------------------------------------------------------------------

_NUMBER = re.compile(r"^\s*([+-]?(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?)\s*([A-Za-z]*)\s*$")


def number(arg: str, units: dict[str, float] | None = None, default_scale: float = 1.0) -> float:
    """A decimal numeric parameter with an optional unit suffix (`1550nm`, `0.5 MS`)."""
    m = _NUMBER.match(arg)
    if not m:
        if not arg.strip():
            raise SCPIError(-109, "a number is needed")
        raise SCPIError(-104, f"not a number: {arg[:30]!r}")
    value = float(m.group(1))
    if not math.isfinite(value):
        raise SCPIError(-222, f"{m.group(1)[:30]} is not a finite number")
    unit = m.group(2).upper()
    if not unit:
        return value * default_scale
    if not units or unit not in units:
        raise SCPIError(-131, f"unit {m.group(2)!r} not allowed here")
    return value * units[unit]


def boolean(arg: str) -> bool:
    a = arg.strip().upper()
    if a in ("1", "ON"):
        return True
    if a in ("0", "OFF"):
        return False
    if not a:
        raise SCPIError(-109, "0, 1, ON or OFF is needed")
    raise SCPIError(-224, f"not 0, 1, ON or OFF: {arg[:30]!r}")


def no_arg(arg: str) -> None:
    if arg:
        raise SCPIError(-108, f"unexpected {arg[:30]!r}")


# ---- the socket server ----------------------------------------------------------------------

class SCPIServer:
    """Serves an `Instrument` on a loopback TCP port (0 = an ephemeral port)."""

    def __init__(self, instrument: Instrument, host: str = "127.0.0.1", port: int = 0,
                 name: str = "scpi", idle_timeout_s: float = IDLE_TIMEOUT_S):
        if not idle_timeout_s > 0:
            raise ValueError(f"idle_timeout_s must be > 0, not {idle_timeout_s!r}")
        self.instrument = instrument
        self.idle_timeout_s = idle_timeout_s
        self.name = name
        self.host = host
        self._want_port = port
        self.port = 0
        self._listener: socket.socket | None = None
        self._stop = threading.Event()
        self._accept_thread: threading.Thread | None = None
        self._clients: dict[socket.socket, Session] = {}
        self._clients_lock = threading.Lock()
        self._threads: list[threading.Thread] = []
        # (header regex, "before" | "after"): drop the client whose line matches, once.
        self._drop_rules: list[tuple[re.Pattern, str]] = []
        self.bytes_in = 0
        self.bytes_out = 0

    @property
    def resource(self) -> str:
        return f"TCPIP::{self.host}::{self.port}::SOCKET"

    def start(self) -> str:
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        listener = socket.socket(family, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            listener.bind((self.host, self._want_port))
        except OSError:
            listener.close()
            raise
        listener.listen(8)
        listener.settimeout(IDLE_POLL_S)
        self._listener = listener
        self.port = listener.getsockname()[1]
        self._accept_thread = threading.Thread(target=self._accept, name=f"{self.name}-accept",
                                               daemon=True)
        self._accept_thread.start()
        log.info("%s listening on %s", self.name, self.resource)
        return self.resource

    def close(self) -> None:
        self._stop.set()
        if self._accept_thread is not None:
            self._accept_thread.join(timeout=2)
            self._accept_thread = None
        if self._listener is not None:
            self._listener.close()
            self._listener = None
        self.drop_clients()
        for t in list(self._threads):
            t.join(timeout=2)
        self._threads.clear()

    def __enter__(self) -> "SCPIServer":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def clients(self) -> int:
        """Sessions being served (not counting ones already cut and closing)."""
        with self._clients_lock:
            return sum(not s.dropped for s in self._clients.values())

    @property
    def busy_clients(self) -> int:
        """Sessions in the middle of a command."""
        with self._clients_lock:
            return sum(s.busy and not s.dropped for s in self._clients.values())

    def drop_clients(self) -> int:
        """Cut every client's TCP connection now (a reset, as when a cable or a switch fails)."""
        with self._clients_lock:
            clients = list(self._clients.items())
        for s, session in clients:
            session.dropped = True
            self._abort(s)
        return len(clients)

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

    @staticmethod
    def _abort(s: socket.socket) -> None:
        """Make the socket's close a reset (RST), and wake its serving thread, which closes it:
        the client's next read fails at once, as when a link or the instrument goes away."""
        try:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            s.shutdown(socket.SHUT_RD)
        except OSError:
            pass

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                conn, addr = self._listener.accept()
            except socket.timeout:
                continue
            except OSError:
                if not self._stop.is_set():
                    log.exception("%s: accept failed", self.name)
                return
            session = Session(f"{self.name} {addr[0]}:{addr[1]}")
            if not self._admit(conn, session):
                log.warning("%s: refused a connection from %s:%s: all %d sessions are busy",
                            self.name, addr[0], addr[1], MAX_CLIENTS)
                conn.close()
                continue
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn.settimeout(IDLE_POLL_S)
            t = threading.Thread(target=self._serve, args=(conn, session),
                                 name=f"{self.name}-client", daemon=True)
            self._threads = [x for x in self._threads if x.is_alive()] + [t]
            t.start()
            log.info("%s: client connected", session.peer)

    def _admit(self, conn: socket.socket, session: Session) -> bool:
        """Give the newcomer a session slot; when all are taken, cut the session idle longest
        (so silent clients can never lock others out); refuse only if every session is busy."""
        with self._clients_lock:
            live = [(s, c) for c, s in self._clients.items() if not s.dropped]
            victim = None
            if len(live) >= MAX_CLIENTS:
                idle = [(s, c) for s, c in live if not s.busy]
                if not idle:
                    return False
                victim = min(idle, key=lambda sc: sc[0].last_active)
                victim[0].dropped = True        # under the lock: it cannot turn busy now
            self._clients[conn] = session
        if victim is not None:
            log.warning("%s: cut (idle %.1f s) to make room for a new connection",
                        victim[0].peer, time.monotonic() - victim[0].last_active)
            self._abort(victim[1])
        return True

    def _start_line(self, session: Session) -> bool:
        """Mark the session busy unless it has been cut; False if it has."""
        with self._clients_lock:
            if session.dropped:
                return False
            session.busy = True
            return True

    def _end_line(self, session: Session) -> None:
        with self._clients_lock:
            session.busy = False
            session.last_active = time.monotonic()

    def _idle_too_long(self, session: Session) -> bool:
        """True (and the session marked cut) once it has completed no line for the timeout."""
        with self._clients_lock:
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

    def _serve(self, conn: socket.socket, session: Session) -> None:
        buf = bytearray()
        skipping = False
        try:
            while not self._stop.is_set() and not session.dropped:
                if self._idle_too_long(session):
                    log.info("%s: dropped after %g s without a complete line", session.peer,
                             self.idle_timeout_s)
                    break
                try:
                    data = conn.recv(65536)
                except socket.timeout:
                    continue
                except OSError:
                    break
                if not data or session.dropped:
                    break
                self.bytes_in += len(data)
                buf += data
                while True:
                    nl = buf.find(b"\n")
                    if nl < 0:
                        if len(buf) > MAX_LINE:
                            if not skipping:
                                session.push_error(SCPIError(-363, "line too long").entry())
                                log.warning("%s: refused a line over %d bytes; skipping to the "
                                            "next newline", session.peer, MAX_LINE)
                            skipping = True
                            buf.clear()
                        break
                    raw = bytes(buf[:nl])
                    del buf[:nl + 1]
                    if skipping:
                        skipping = False
                        continue
                    if len(raw) > MAX_LINE:
                        session.push_error(SCPIError(-363, "line too long").entry())
                        log.warning("%s: refused a line over %d bytes", session.peer, MAX_LINE)
                        continue
                    line = raw.rstrip(b"\r").decode("latin-1").strip()
                    if not line:
                        continue
                    if not self._start_line(session):
                        return
                    try:
                        if not self._run_line(conn, session, line):
                            return
                    finally:
                        self._end_line(session)
        except Exception:
            log.exception("%s: unexpected failure serving this client; dropping it", session.peer)
        finally:
            with self._clients_lock:
                session.dropped = True
                self._clients.pop(conn, None)
            try:
                conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            except OSError:
                pass
            conn.close()
            log.info("%s: client disconnected", session.peer)

    def _run_line(self, conn: socket.socket, session: Session, line: str) -> bool:
        """Run one line and send its reply; False when the connection is to be closed."""
        if self._drop_rules and self._take_drop_rule(line, "before"):
            log.info("%s: connection cut before %r (fault injected)", session.peer, line[:60])
            return False
        reply = self.instrument.execute(session, line)
        if self._drop_rules and self._take_drop_rule(line, "after"):
            log.info("%s: connection cut after %r (fault injected)", session.peer, line[:60])
            return False
        if reply is not None:
            out = reply.encode("ascii", "replace") + b"\r\n"
            try:
                conn.settimeout(SEND_TIMEOUT_S)
                conn.sendall(out)
                conn.settimeout(IDLE_POLL_S)
            except OSError:
                log.info("%s: client vanished (or stopped reading) before its reply",
                         session.peer)
                return False
            self.bytes_out += len(out)
        return True
