"""SCPI as an emulated instrument speaks it: the command table, the error queue, the parsing.

Each emulated instrument (OCS, power meter, laser) is an `Instrument` with a command table
(`command(pattern, handler)`: `:SENSe#[:CHANnel#]:POWer:WAVelength?` matches its short and long
forms, `#` an optional numeric suffix); `scpi_server.SCPIServer` serves it on a raw socket
exactly as a lab instrument serves port 5025, on the thread of an `scpi_loop.SCPILoop`.

A program message (one line) is split into units at `;` outside parentheses and quotes, each
looked up (relative to the previous unit's path, as SCPI says) and run: a handler answers, or
raises `SCPIError` to put `code,"text"` in the session's IEEE 488.2 error queue; a handler's bug
is an internal fault (-300), never the instrument's end. A command that waits (`*OPC?` for a
move, a power reading's averaging time) is a handler that yields the time to resume it at, so
whoever runs the line decides how to spend the wait (`Instrument.execute` sleeps; the server
serves other sessions). Bytes outside printable ASCII are a command error. Every unit runs
while holding the instrument's lock (the emulator's control plane takes it too), so units from
different clients interleave whole, never half-applied. Replies of several queries on one line
are joined with `;` (IEEE 488.2).
"""
from __future__ import annotations

import logging
import math
import re
import threading
import time
import types
from collections.abc import Callable, Generator
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger(__name__)

ERROR_QUEUE_LEN = 30
FOUND_KEPT = 1024            # headers whose lookup an instrument remembers

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
    #                              they take the lock themselves between their waits)
    regex: re.Pattern = field(init=False)     # what an uppercased header must match

    def __post_init__(self) -> None:
        self.regex = compile_header(self.pattern)


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
        self.commands.append(Command(pattern, handler, locked))
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


def without_arg(answer: Callable[[], Reply]) -> Callable[[Session, tuple, str], Reply]:
    """A handler for a header that takes no parameter: one given is refused (-108) before
    `answer()` runs."""
    def handler(session: Session, suffixes: tuple, arg: str) -> Reply:
        no_arg(arg)
        return answer()
    return handler
