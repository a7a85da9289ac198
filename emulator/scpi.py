"""A small SCPI server: a command table, IEEE 488.2 error queue, raw TCP on loopback.

Each emulated instrument (OCS, power meter, laser) is an `Instrument` with a command table, served
by `SCPIServer` on a raw socket exactly as a lab instrument serves port 5025.

Serving: one thread (an `SCPILoop`, a selector over the sockets) serves every session of a server,
or of many servers (a datacenter rig's 64 switches share one); a server given no loop has its own.
Several clients are served concurrently, as on a real LAN instrument where a second socket
session is allowed: a command that waits (`*OPC?` for a move, a power reading's averaging time)
is a handler that yields the time to resume it at, so a session waiting holds no thread and
never holds up another; a reply the client does not read is sent as its socket takes it. Sessions
are a bounded resource that silent clients must not hold: a session that completes no line for
`IDLE_TIMEOUT_S` is dropped, and when every slot is taken a newcomer takes the slot of the session
idle longest (one in the middle of a command is never cut); only when every session is busy is a
newcomer refused. Each client's lines run in the order they arrive, one line after the other's
reply; every program message unit runs while holding the instrument's lock (the emulator's
control plane takes it too), so units from different clients interleave whole, never
half-applied. Each client session has its own error queue (what that client got wrong is
reported to that client).

Input handling: a line ends at `\\n` (`\\r\\n` accepted); a line longer than `MAX_LINE` bytes is
refused (-363 Input buffer overrun) and the input is skipped up to the next newline; bytes
outside printable ASCII are a command error; a client that vanishes mid-command is simply
dropped, and one that reads nothing of its reply for `SEND_TIMEOUT_S` is dropped. Every refusal
is logged. Replies end in `\\r\\n`; replies of several queries on one line are joined with `;`
(IEEE 488.2).
"""
from __future__ import annotations

import collections
import functools
import heapq
import itertools
import logging
import math
import re
import selectors
import socket
import struct
import threading
import time
import types
from collections.abc import Callable, Generator
from dataclasses import dataclass
from typing import Any

log = logging.getLogger(__name__)

MAX_LINE = 64 * 1024        # bytes in one program message (a full 32x32 ONLY is ~200 bytes)
ERROR_QUEUE_LEN = 30
MAX_CLIENTS = 16            # sessions served at once; see SCPIServer._admit
SEND_TIMEOUT_S = 5.0        # a client that reads nothing for this long is dropped
IDLE_TIMEOUT_S = 300.0      # a session that completes no line for this long is dropped
CANCELLED_KEPT = 64         # cancelled timers left in a loop's heap before it is cleaned
FOUND_KEPT = 1024            # headers whose lookup an instrument remembers
LINES_PER_TURN = 16         # lines of one session run before other sockets get their turn
ACCEPTS_PER_TURN = 16       # connections taken at once from a listening socket

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


# A handler's answer: the reply (or None), or, for a command that waits, a generator that yields
# the time.monotonic() to resume it at (as often as it needs) and returns the reply. A handler
# never blocks: whoever runs the line sleeps (`Instrument.execute`) or serves others meanwhile
# (`SCPIServer`).
Reply = str | None
Waiting = Generator[float, None, Reply]


def is_time(value: object) -> bool:
    """A time.monotonic() a wait may end at: a finite int or float (not a bool)."""
    return (isinstance(value, (int, float)) and not isinstance(value, bool)
            and math.isfinite(value))


def next_wait(run: Waiting) -> float:
    """When `run` (a line running) is to be resumed; StopIteration with its reply when it is
    done. A handler that yields anything but a time gets an internal fault (-300) thrown in
    where it yielded, as if it had raised it."""
    until = next(run)
    while not is_time(until):
        log.error("a command waited until %r, not a time: internal fault", until)
        until = run.throw(SCPIError(-300, f"internal fault: waited until {until!r:.40}"))
    return until


@dataclass
class Command:
    pattern: str
    handler: Callable[[Session, tuple, str], Any]
    locked: bool = True          # run holding the instrument lock (False for commands that wait;
    regex: re.Pattern | None = None     # they take the lock themselves between their waits)


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
        self.command("*WAI", self._wai, locked=False)
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

    def reboot(self) -> None:
        """Power cycle: back to the power-on state (an instrument whose *RST keeps some state
        says what a power cycle loses)."""
        with self.lock:
            self.reset()

    def pending_until(self) -> float:
        """time.monotonic() at which every operation started so far has completed."""
        return 0.0

    def _opc(self, session, sfx, arg) -> Waiting:
        """Once every operation started so far has completed."""
        until = self.pending_until()
        if until > time.monotonic():
            yield until
        return "1"

    def _wai(self, session, sfx, arg) -> Waiting:
        yield from self._opc(session, sfx, arg)
        return None

    def _err_all(self, session, sfx, arg) -> str:
        out = []
        while session.errors:
            out.append(session.pop_error())
        return ",".join(out) if out else self.no_error

    # ---- executing a line ---------------------------------------------------------------------

    def execute(self, session: Session, line: str) -> str | None:
        """Run one program message (a line without its terminator), sleeping through its
        waits; the reply, or None."""
        run = self.run(session, line)
        try:
            while True:
                time.sleep(max(0.0, next_wait(run) - time.monotonic()))
        except StopIteration as done:
            return done.value

    def run(self, session: Session, line: str) -> Waiting:
        """Run one program message as a generator: it yields the time.monotonic() to resume
        it at whenever a command waits, and returns the reply (or None)."""
        self.lines_in += 1
        if not (line.isascii() and line.replace("\t", " ").isprintable()):
            session.push_error(SCPIError(-101, "non-ASCII or control bytes").entry())
            log.warning("%s: refused line with non-printable bytes: %r", session.peer, line[:80])
            return None
        replies: list[str] = []
        path = ""
        for unit in split_units(line):
            if session.dropped:        # cut while the line ran (it waited): nothing more runs
                return None
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
                    if isinstance(reply, types.GeneratorType):
                        reply = yield from reply
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

class SCPILoop:
    """One thread serving the sockets of any number of `SCPIServer`s: a selector over their
    listening and session sockets, timers (a command's wait, a session's idle and send
    deadlines) and calls posted from other threads. It runs while a server started on it is
    open (`acquire` / `release`)."""

    def __init__(self, name: str = "scpi"):
        self.name = name
        self._lock = threading.Lock()
        self._users = 0
        self._thread: threading.Thread | None = None
        self._sel: selectors.BaseSelector | None = None
        self._wake_r: socket.socket | None = None
        self._wake_w: socket.socket | None = None
        self._calls: collections.deque[Callable[[], None]] = collections.deque()
        self._timers: list[list] = []         # heap of [when, seq, fn]; fn None: cancelled
        self._cancelled = 0                    # cancelled entries still in the heap
        self._seq = itertools.count()
        self._stop = threading.Event()         # this run's: set by the last `release`

    # ---- life -----------------------------------------------------------------------------

    def acquire(self) -> None:
        """A server starts on this loop: the thread runs from the first one."""
        with self._lock:
            self._users += 1
            if self._thread is not None:
                return
            self._sel = selectors.DefaultSelector()
            self._wake_r, self._wake_w = socket.socketpair()
            for s in (self._wake_r, self._wake_w):
                s.setblocking(False)
            self._sel.register(self._wake_r, selectors.EVENT_READ, None)
            self._stop = threading.Event()
            self._calls, self._timers = collections.deque(), []     # this run's
            self._cancelled = 0
            self._thread = threading.Thread(target=self._run, args=(self._stop,),
                                            name=f"{self.name}-loop", daemon=True)
            self._thread.start()

    def release(self) -> None:
        """A server on this loop closed: the thread ends with the last one."""
        with self._lock:
            self._users -= 1
            if self._users > 0 or self._thread is None:
                return
            thread, self._thread = self._thread, None
            stop, wake = self._stop, self._wake_w
        stop.set()
        if wake is not None:
            try:
                wake.send(b"\0")
            except OSError:        # full (it is awake anyway) or closed (it has ended)
                pass
        if thread is not threading.current_thread():
            thread.join(timeout=5)

    @property
    def on_loop(self) -> bool:
        return threading.current_thread() is self._thread

    # ---- what the loop runs -----------------------------------------------------------------

    def call(self, fn: Callable[[], None]) -> None:
        """Run fn on the loop's thread soon (from any thread; returns at once)."""
        self._calls.append(fn)
        w = self._wake_w
        if w is not None:
            try:
                w.send(b"\0")
            except OSError:      # its buffer is full (a wake is pending anyway), or closed
                pass

    def call_wait(self, fn: Callable[[], Any], timeout: float = 10.0) -> Any:
        """Run fn on the loop's thread and return what it returns (raises what it raises)."""
        if self.on_loop or self._thread is None:
            return fn()
        done = threading.Event()
        out: dict[str, Any] = {}

        def run() -> None:
            try:
                out["value"] = fn()
            except BaseException as e:     # handed to the caller
                out["error"] = e
            finally:
                done.set()
        self.call(run)
        if not done.wait(timeout):
            raise TimeoutError(f"{self.name}: the serving thread did not answer in {timeout} s")
        if "error" in out:
            raise out["error"]
        return out.get("value")

    def at(self, when: float, fn: Callable[[], None]) -> list:
        """Run fn on the loop's thread at time.monotonic() `when` (call it on the loop);
        returns the timer, for `cancel`."""
        if not is_time(when):
            raise ValueError(f"a timer is due at a finite time.monotonic(), not {when!r}")
        timer = [when, next(self._seq), fn]
        heapq.heappush(self._timers, timer)
        return timer

    def cancel(self, timer: list | None) -> None:
        """A timer of `at` that is no longer wanted (one that ran or was cancelled: nothing
        happens), on the loop. What it would have run is let go at once; cancelled timers are
        taken out of the heap once they are half of it (a closed session's idle timer would
        otherwise stay for the idle timeout: a client reconnecting in a loop piled them up)."""
        if timer is None or timer[2] is None:
            return
        timer[2] = None
        self._cancelled += 1
        timers = self._timers
        if self._cancelled > CANCELLED_KEPT and 2 * self._cancelled > len(timers):
            timers[:] = [t for t in timers if t[2] is not None]
            heapq.heapify(timers)
            self._cancelled = 0

    def register(self, sock: socket.socket, events: int, on_event: Callable[[int], None]
                 ) -> None:
        assert self._sel is not None
        self._sel.register(sock, events, on_event)

    def modify(self, sock: socket.socket, events: int, on_event: Callable[[int], None]) -> None:
        assert self._sel is not None
        self._sel.modify(sock, events, on_event)

    def unregister(self, sock: socket.socket) -> None:
        if self._sel is not None:
            try:
                self._sel.unregister(sock)
            except (KeyError, ValueError):
                pass

    def _run(self, stop: threading.Event) -> None:
        sel, wake, wake_w = self._sel, self._wake_r, self._wake_w
        calls, timers = self._calls, self._timers       # this run's (a later run has its own)
        assert sel is not None and wake is not None and wake_w is not None
        try:
            while not stop.is_set():
                try:
                    self._turn(sel, wake, calls, timers)
                except Exception:      # never seen; the thread serves every instrument on it
                    log.exception("%s: unexpected failure in the serving loop", self.name)
                    time.sleep(0.01)
        finally:
            with self._lock:
                if self._wake_w is wake_w:       # not already started again
                    self._wake_w = self._sel = self._wake_r = None
            timers.clear()
            calls.clear()
            sel.close()
            wake.close()
            wake_w.close()

    def _turn(self, sel: selectors.BaseSelector, wake: socket.socket,
              calls: collections.deque, timers: list) -> None:
        """Wait for a socket, a timer or a call, then run what is ready."""
        timeout = None
        if calls:
            timeout = 0.0
        elif timers:
            timeout = max(0.0, timers[0][0] - time.monotonic())
        for key, mask in sel.select(timeout):
            if key.data is None:
                try:
                    while wake.recv(4096):
                        pass
                except OSError:
                    pass
                continue
            self._guarded(key.data, mask)
        now = time.monotonic()
        while timers and timers[0][0] <= now:
            timer = heapq.heappop(timers)
            fn, timer[2] = timer[2], None                # ran: `cancel` does nothing now
            if fn is None:
                self._cancelled = max(0, self._cancelled - 1)
            else:
                self._guarded(fn)
        for _ in range(len(calls)):
            self._guarded(calls.popleft())

    def _guarded(self, fn: Callable[..., None], *args: Any) -> None:
        try:
            fn(*args)
        except BaseException:
            # one session's fault (even a handler's sys.exit) must not stop every instrument
            # this thread serves
            log.exception("%s: unexpected failure on the serving thread", self.name)


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
