"""A session: what clients and devices said to each other on their wires, timed, in one file.

`ptb record` (hil.lab.recorder) writes one while it relays a client's bytes to a device;
`ptb replay` (hil.lab.replayer) plays its client side against a device and compares the answers, or
plays its device side for a client under test. docs/lab.md describes the file; in short, JSON
lines (version 1):

    {"format": "ptb-session", "version": 1, "started": "2026-11-24T09:00:00.000Z",
     "clock": "seconds since started (monotonic)",
     "devices": {"dac": {"wire": "serial", "address": "/dev/ttyACM0", "baud": 115200},
                 "ocs": {"wire": "tcp", "address": "TCPIP::10.0.0.9::5025::SOCKET"}}}
    {"t": 0.000412, "device": "dac", "conn": 1, "event": "open"}
    {"t": 0.013050, "device": "dac", "conn": 1, "from": "client", "data": "id?\\n"}
    {"t": 0.013391, "device": "dac", "conn": 1, "from": "device", "data": "Q8iv-0001\\n"}
    {"t": 2.500000, "device": "dac", "conn": 1, "event": "close", "by": "recorder"}
    {"t": 2.500100, "event": "end"}

`data` holds the bytes exactly as they passed, one character per byte (code points 0..255,
i.e. the bytes read as Latin-1; JSON escapes the control characters: `\\r`, `\\n`, `\\u00ff`).
A serial device has one connection (the recorder holds the port open throughout); a socket
device has one per TCP connection a client made, numbered 1, 2, ... in the order they opened.

An *exchange* is what a client sent on one connection and everything the device answered
before the client sent again; bytes a device sends before a client sent anything (a power-up
notice) make an exchange with nothing sent. Exchanges are numbered 1, 2, ... across the whole
session in the order they began.
"""
from __future__ import annotations

import datetime
import json
import logging
import math
import os
import pathlib
import queue
import re
import threading
import time
from dataclasses import dataclass, field

from photonic_testbed.common import nesting
from photonic_testbed.hil import files

log = logging.getLogger(__name__)

SESSION_FORMAT = "ptb-session"
SESSION_VERSION = 1
SERIAL_BAUD = 115200          # the heater DAC's wire: 115200 8N1
SCPI_PORT = 5025              # the raw-socket SCPI port instruments listen on by default
MAX_SESSION_BYTES = 1 << 30


DEVICE_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.\-]*")
MAX_T = 1e7                    # seconds: a session of four months, at most

class SessionError(ValueError):
    """A session file that cannot be read as written, or an address that names no wire."""


# ---- wires ---------------------------------------------------------------------------------------

_VISA_SOCKET = re.compile(r"^TCPIP\d*::([^:]+|\[[0-9A-Fa-f:.]+\])::(\d{1,5})::SOCKET$", re.I)
_VISA_SERIAL = re.compile(r"^ASRL(.+)::INSTR$", re.I)
_HOST_PORT = re.compile(r"^(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9_.\-]+)(?::(\d{1,5}))?$")


@dataclass(frozen=True)
class Wire:
    """Where a device is: a serial port (`path`) or a raw TCP socket (`host`, `port`)."""
    kind: str                  # "serial" or "tcp"
    path: str = ""
    host: str = ""
    port: int = 0

    @property
    def address(self) -> str:
        """The address as a rig file writes it: the port's path, or a VISA socket resource."""
        if self.kind == "serial":
            return self.path
        return f"TCPIP::{self.host}::{self.port}::SOCKET"

    def __str__(self) -> str:
        return self.address


def parse_address(text: str, default_port: int | None = None) -> Wire:
    """A device's address: a serial port path (`/dev/ttyACM0`, `COM3`, `ASRL/dev/ttyUSB0::INSTR`),
    a VISA raw socket (`TCPIP::host::5025::SOCKET`) or, with `default_port`, `host[:port]`."""
    text = str(text).strip()
    m = _VISA_SOCKET.match(text)
    if m:
        return Wire("tcp", host=_host(m.group(1).strip("[]"), text), port=_port(m.group(2), text))
    m = _VISA_SERIAL.match(text)
    if m:
        return Wire("serial", path=m.group(1))
    if text.startswith(("/", "./", "../")) or re.fullmatch(r"COM\d+", text, re.I):
        return Wire("serial", path=text)
    if "::" in text:
        raise SessionError(f"{text!r}: only serial ports and raw sockets "
                           "(TCPIP::HOST::PORT::SOCKET) are relayed and replayed")
    if default_port is not None:
        m = _HOST_PORT.match(text)
        if m:
            port = m.group(2)
            return Wire("tcp", host=_host(m.group(1).strip("[]"), text),
                        port=_port(port, text) if port else default_port)
    raise SessionError(f"{text!r} is not a device address: give a serial port's path "
                       "(/dev/ttyACM0) or a raw socket (TCPIP::HOST::PORT::SOCKET or HOST:PORT)")


def _host(host: str, where: str) -> str:
    """A host name or address as a socket takes it (labels of 1..63 characters)."""
    try:
        host.encode("idna")
    except UnicodeError:
        raise SessionError(f"{where!r}: {host!r} is not a host name") from None
    return host


def _port(text: str, where: str) -> int:
    port = int(text)
    if not 1 <= port <= 65535:
        raise SessionError(f"{where!r}: port {port} is not in 1..65535")
    return port


def utc_now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%S.%f")[:-3] + "Z"


# ---- the session's content -----------------------------------------------------------------------

@dataclass(frozen=True)
class Event:
    line: int                  # the line of the session file it was read from (1-based)
    t: float                   # seconds since the session started
    device: str
    conn: int
    kind: str                  # "data", "open" or "close"
    source: str = ""           # data: "client" or "device"; close: who closed it
    data: bytes = b""


@dataclass
class Exchange:
    """What a client sent on one connection and what the device answered before its next send."""
    index: int                 # 1, 2, ... across the session
    device: str
    conn: int
    line: int                  # the session line of its first byte sent (of the answer if none)
    t: float                   # when it was sent (recorded)
    sent: bytes = b""
    answer: bytes = b""
    t_answer: float | None = None   # when the answer's last byte came (recorded)

    @property
    def latency_s(self) -> float:
        """How long the recorded answer took to complete (0 without an answer)."""
        return 0.0 if self.t_answer is None else max(0.0, self.t_answer - self.t)

    def name(self) -> str:
        return (f"exchange {self.index} ({self.device}, connection {self.conn}; session line "
                f"{self.line}, t = {self.t:.6f} s)")


@dataclass
class Session:
    devices: dict[str, dict]
    events: list[Event]
    started: str = ""
    where: str = "session"
    complete: bool = True      # the file ends with its "end" line (the recorder stopped cleanly)
    cut_line: int | None = None  # a last line cut short (no end line), left out
    _exchanges: list[Exchange] | None = field(default=None, repr=False)

    @classmethod
    def load(cls, path: str | os.PathLike) -> Session:
        path = pathlib.Path(path)
        try:
            size = path.stat().st_size
            if size > MAX_SESSION_BYTES:
                raise SessionError(f"session {path} is {size} bytes: more than "
                                   f"{MAX_SESSION_BYTES} is not a session this reader takes")
            text = path.read_bytes().decode("utf-8")
        except OSError as e:
            raise SessionError(f"cannot read the session {path}: {e.strerror or e}") from None
        except UnicodeDecodeError as e:
            raise SessionError(f"session {path} is not UTF-8 text (byte {e.start})") from None
        return cls.parse(text, str(path))

    @classmethod
    def parse(cls, text: str, where: str = "session") -> Session:
        lines = text.splitlines()
        if not lines:
            raise SessionError(f"{where}: empty: a session starts with its header line")
        header = _json_line(lines[0], where, 1)
        if header.get("format") != SESSION_FORMAT:
            raise SessionError(f"{where}:1: not a {SESSION_FORMAT} file (its first line has "
                               f"format {header.get('format')!r})")
        version = header.get("version")
        if isinstance(version, bool) or version != SESSION_VERSION:
            raise SessionError(f"{where}:1: session format version {header.get('version')!r}; "
                               f"this reader knows version {SESSION_VERSION}")
        devices = header.get("devices")
        if not isinstance(devices, dict) or not devices:
            raise SessionError(f"{where}:1: expected \"devices\": an object naming each device "
                               "and its wire")
        for name, d in devices.items():
            if not DEVICE_NAME.fullmatch(name) or name in (".", ".."):
                raise SessionError(f"{where}:1: device name {name!r}: letters, digits, '_', "
                                   "'-' and '.' (a pty link is made under it)")
            if not isinstance(d, dict) or d.get("wire") not in ("serial", "tcp") or \
                    not isinstance(d.get("address"), str):
                raise SessionError(f"{where}:1: device {name!r}: expected {{\"wire\": "
                                   "\"serial\" or \"tcp\", \"address\": ...}")
        events: list[Event] = []
        complete = False
        last_t = 0.0
        cut = None                     # a last line cut short (a recorder killed mid-write)
        for n, raw in enumerate(lines[1:], start=2):
            if not raw.strip():
                continue
            if complete:
                raise SessionError(f"{where}:{n}: a line after the session's end line")
            if n == len(lines) and not text.endswith("\n"):
                try:
                    nesting.loads_json(raw, f"{where}:{n}")
                except nesting.NestingError as e:
                    raise SessionError(str(e)) from None
                except ValueError:
                    cut = n
                    break
            d = _json_line(raw, where, n)
            t = d.get("t")
            if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) \
                    or t < 0:
                raise SessionError(f"{where}:{n}: expected \"t\": seconds >= 0, got {t!r}")
            if t < last_t - 1e-6:
                raise SessionError(f"{where}:{n}: t = {t} goes back in time (the line before "
                                   f"has {last_t})")
            last_t = max(last_t, float(t))
            if d.get("event") == "end":
                complete = True
                continue
            if t > MAX_T:
                raise SessionError(f"{where}:{n}: t = {t} s is past a session's {MAX_T:g} s")
            events.append(_event(d, n, where, devices))
        return cls(devices, events, str(header.get("started", "")), where, complete, cut_line=cut)

    def exchanges(self) -> list[Exchange]:
        """The session's exchanges, in the order they began."""
        if self._exchanges is None:
            self._exchanges = _exchanges(self.events)
        return self._exchanges

    def script(self) -> list[tuple[str, Exchange | tuple[str, int]]]:
        """The client's side in order: ("open", (device, conn)), ("exchange", Exchange),
        ("close", (device, conn)); each exchange where its first byte was."""
        by_start = {(x.device, x.conn, x.line): x for x in self.exchanges()}
        out: list[tuple[str, Exchange | tuple[str, int]]] = []
        for ev in self.events:
            if ev.kind in ("open", "close"):
                out.append((ev.kind, (ev.device, ev.conn)))
            elif (ev.device, ev.conn, ev.line) in by_start:
                out.append(("exchange", by_start[(ev.device, ev.conn, ev.line)]))
        return out

    @property
    def used(self) -> list[str]:
        """The devices something was said to or by (in the header's order)."""
        said = {e.device for e in self.events if e.kind == "data"}
        return [d for d in self.devices if d in said]

    def wire(self, device: str) -> Wire:
        d = self.devices[device]
        return parse_address(d["address"], SCPI_PORT)


def _json_line(raw: str, where: str, n: int) -> dict:
    try:
        d = nesting.loads_json(raw, f"{where}:{n}")
    except nesting.NestingError as e:
        raise SessionError(str(e)) from None
    except ValueError as e:
        raise SessionError(f"{where}:{n}: not JSON: {e}") from None
    if not isinstance(d, dict):
        raise SessionError(f"{where}:{n}: expected a JSON object, got {type(d).__name__}")
    return d


def _event(d: dict, n: int, where: str, devices: dict) -> Event:
    device, conn = d.get("device"), d.get("conn")
    if not isinstance(device, str) or device not in devices:
        raise SessionError(f"{where}:{n}: device {device!r} is not one the header names "
                           f"({', '.join(devices)})")
    if isinstance(conn, bool) or not isinstance(conn, int) or conn < 1:
        raise SessionError(f"{where}:{n}: expected \"conn\": a connection number >= 1, "
                           f"got {conn!r}")
    t = float(d["t"])
    if "event" in d:
        kind = d["event"]
        if kind not in ("open", "close"):
            raise SessionError(f"{where}:{n}: event {kind!r} is not open, close or end")
        return Event(n, t, device, conn, kind, str(d.get("by", "")))
    source, data = d.get("from"), d.get("data")
    if source not in ("client", "device"):
        raise SessionError(f"{where}:{n}: expected \"from\": \"client\" or \"device\", "
                           f"got {source!r}")
    if not isinstance(data, str) or not data:
        raise SessionError(f"{where}:{n}: expected \"data\": the bytes as a non-empty string")
    try:
        raw = data.encode("latin-1")
    except UnicodeEncodeError as e:
        raise SessionError(f"{where}:{n}: data holds {data[e.start]!r}, not a byte (code "
                           "points 0..255 only)") from None
    return Event(n, t, device, conn, "data", source, raw)


def _exchanges(events: list[Event]) -> list[Exchange]:
    out: list[Exchange] = []
    current: dict[tuple[str, int], Exchange] = {}
    for ev in events:
        key = (ev.device, ev.conn)
        if ev.kind == "open":
            current.pop(key, None)
        elif ev.kind == "close":
            current.pop(key, None)
        elif ev.source == "client":
            x = current.get(key)
            if x is None or x.answer:
                x = Exchange(len(out) + 1, ev.device, ev.conn, ev.line, ev.t)
                out.append(x)
                current[key] = x
            x.sent += ev.data
        else:
            x = current.get(key)
            if x is None:                       # spoken before the client said anything
                x = Exchange(len(out) + 1, ev.device, ev.conn, ev.line, ev.t)
                out.append(x)
                current[key] = x
            x.answer += ev.data
            x.t_answer = ev.t
    return out


# ---- writing -------------------------------------------------------------------------------------

class SessionWriter:
    """Writes a session file as events come, from any thread: `event()` only queues (the relay
    that calls it must not wait for the disk); a writer thread encodes and writes them, and
    flushes whenever the queue runs dry, so a reader sees the file grow."""

    def __init__(self, path: str | os.PathLike, devices: dict[str, Wire]):
        self.path = pathlib.Path(path)
        self.t0 = time.monotonic()
        header = {"format": SESSION_FORMAT, "version": SESSION_VERSION, "started": utc_now(),
                  "clock": "seconds since started (monotonic)",
                  "devices": {name: ({"wire": "serial", "address": w.path, "baud": SERIAL_BAUD}
                                     if w.kind == "serial" else
                                     {"wire": "tcp", "address": w.address})
                              for name, w in devices.items()}}
        self._file = open(self.path, "w", encoding="utf-8")
        self._file.write(json.dumps(header) + "\n")
        self._file.flush()
        self._good = self._file.tell()     # the file up to here ends on a whole line, on disk
        self.error: OSError | None = None  # the write that failed: nothing more is written
        self.failed = threading.Event()
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self.counts = {"client": 0, "device": 0}
        self._thread = threading.Thread(target=self._write, name="session-writer", daemon=True)
        self._thread.start()

    def now(self) -> float:
        return time.monotonic() - self.t0

    def data(self, device: str, conn: int, source: str, data: bytes, t: float) -> None:
        self._queue.put((t, device, conn, source, data))

    def event(self, device: str, conn: int, kind: str, t: float, by: str = "") -> None:
        self._queue.put((t, device, conn, kind, by))

    def close(self) -> None:
        """Write the end line, flush and close (idempotent). After a write error the file
        keeps its whole lines (no end line: a replay reads it as cut short) and the error is
        raised as a SessionError."""
        if self._file.closed:
            return
        self._queue.put(None)
        self._thread.join()
        if self.error is None:
            try:
                self._file.write(json.dumps({"t": round(self.now(), 6), "event": "end"}) + "\n")
                self._file.flush()
            except OSError as e:
                self._fail(e)
        try:
            self._file.close()
        except OSError:
            pass                             # what it could not write was cut off above
        if self.error is not None:
            raise SessionError(f"cannot write the session {self.path}: "
                               f"{self.error.strerror or self.error}; it holds what was "
                               "recorded until then") from None

    def _fail(self, e: OSError) -> None:
        """A write failed (disk full, quota, file size limit): keep the whole lines written
        before it, write nothing more."""
        if self.error is None:
            self.error = e
            try:
                os.truncate(self.path, self._good)
            except OSError:
                pass
            self.failed.set()

    def _write(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                if self.error is None:
                    try:
                        self._file.flush()
                    except OSError as e:
                        self._fail(e)
                return
            if self.error is not None:
                continue                     # drained, not kept: the recorder stops
            try:
                self._write_one(item)
            except OSError as e:
                self._fail(e)

    def _write_one(self, item: tuple) -> None:
        t, device, conn, what, payload = item
        if isinstance(payload, bytes):
            self.counts[what] += len(payload)
            line = {"t": round(t, 6), "device": device, "conn": conn, "from": what,
                    "data": payload.decode("latin-1")}
        else:
            line = {"t": round(t, 6), "device": device, "conn": conn, "event": what}
            if payload:
                line["by"] = payload
        self._file.write(json.dumps(line) + "\n")
        if self._queue.empty():
            self._file.flush()
            self._good = self._file.tell()


# ---- comparing answers ---------------------------------------------------------------------------

_NUMBER = re.compile(rb"[+-]?(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?")


def lines_of(data: bytes) -> list[bytes]:
    """Lines with their `\\n` (a last one without it, if the data ends mid-line)."""
    parts = data.split(b"\n")
    out = [p + b"\n" for p in parts[:-1]]
    if parts[-1]:
        out.append(parts[-1])
    return out


@dataclass(frozen=True)
class Comparison:
    """How answers are compared: byte for byte, except lines matching `ignore` (regular
    expressions, searched in each line without its line ending) left out on both sides, and
    numbers within `rel_tol` of each other taken as equal (`rel_tol` 0: exact)."""
    ignore: tuple[str, ...] = ()
    rel_tol: float = 0.0

    def __post_init__(self):
        if not 0.0 <= self.rel_tol < 1.0:
            raise SessionError(f"a relative tolerance is in 0..1, not {self.rel_tol}")
        for pattern in self.ignore:
            try:
                re.compile(pattern.encode("latin-1"))     # as it is used: on the bytes
            except UnicodeEncodeError:
                raise SessionError(f"--ignore {pattern!r}: a session's bytes are compared; "
                                   "give a pattern in Latin-1 characters") from None
            except re.error as e:
                raise SessionError(f"--ignore {pattern!r} is not a regular expression on "
                                   f"bytes: {e}") from None

    def kept(self, data: bytes) -> list[bytes]:
        """The lines of `data` that are compared."""
        if not self.ignore:
            return lines_of(data)
        pats = [re.compile(p.encode("latin-1")) for p in self.ignore]
        return [ln for ln in lines_of(data)
                if not any(p.search(ln.rstrip(b"\r\n")) for p in pats)]

    def same(self, expected: bytes, got: bytes) -> bool:
        a, b = self.kept(expected), self.kept(got)
        if len(a) != len(b):
            return False
        return all(x == y or self._close(x, y) for x, y in zip(a, b, strict=True))

    def _close(self, x: bytes, y: bytes) -> bool:
        if not self.rel_tol:
            return False
        if _NUMBER.sub(b"#", x) != _NUMBER.sub(b"#", y):
            return False
        for p, q in zip(_NUMBER.findall(x), _NUMBER.findall(y), strict=True):
            a, b = float(p), float(q)
            if not (math.isfinite(a) and math.isfinite(b)):
                if p != q:                   # beyond a float: equal only as the same text
                    return False
                continue
            if abs(a - b) > self.rel_tol * max(abs(a), abs(b)):
                return False
        return True


def show(data: bytes | None, limit: int = 120) -> str:
    """Bytes for a report: as Python writes a bytes literal's content, cut at `limit`."""
    if data is None:
        return "nothing"
    text = repr(bytes(data))[2:-1]
    return f"'{text}'" if len(text) <= limit else f"'{text[:limit]}...' ({len(data)} bytes)"


# ---- where the devices are -----------------------------------------------------------------------

# The keys of an emulator's endpoints file (`ptb emulate --endpoints`) that are instruments.
ENDPOINT_DEVICES = ("dac", "ocs", "powermeter", "laser")


def read_endpoints(path: str | os.PathLike, wait_s: float = 0.0) -> dict:
    """An endpoints file (`ptb emulate --endpoints`): device -> address; with `wait_s`, waiting
    that long for it to be written (hil.files)."""
    try:
        path = files.wait_for(path, wait_s, "endpoints file")
        data = nesting.loads_json(path.read_text(encoding="utf-8"), str(path))
    except files.FileNotWritten as e:
        raise SessionError(str(e)) from None
    except OSError as e:
        raise SessionError(f"cannot read the endpoints file {path}: {e.strerror or e}") from None
    except nesting.NestingError as e:
        raise SessionError(str(e)) from None
    except (ValueError, UnicodeDecodeError) as e:
        raise SessionError(f"{path}: not a JSON endpoints file: {e}") from None
    if not isinstance(data, dict) or not all(isinstance(v, str) for v in data.values()):
        raise SessionError(f"{path}: expected an object of device -> address strings, as "
                           "`ptb emulate --endpoints` writes")
    return data


def device_wires(endpoints: str | os.PathLike | None = None,
                 rig: str | os.PathLike | None = None,
                 named: list[str] | tuple[str, ...] = (),
                 wait_s: float = 0.0) -> tuple[dict[str, Wire], list[str]]:
    """Devices by name and their wires, from an emulator's endpoints file (its instruments),
    a rig file (its devices on a serial port or a raw socket) and `NAME=ADDRESS` words (which
    win); either file waited for up to `wait_s` (hil.files). Also the notes on devices left out
    (a VISA resource that is neither)."""
    wires: dict[str, Wire] = {}
    notes: list[str] = []
    if endpoints is not None:
        for key, address in read_endpoints(endpoints, wait_s).items():
            if key in ENDPOINT_DEVICES:
                wires[key] = parse_address(address, SCPI_PORT)
    if rig is not None:
        from photonic_testbed.hil.rig import RigFileError, load
        try:
            loaded = load(rig, wait_s)
        except RigFileError as e:
            raise SessionError(str(e)) from None
        for d in loaded.devices.values():
            try:
                wires[d.name] = parse_address(d.address)
            except SessionError as e:
                notes.append(f"{d.name} left out: {e}")
    given: dict[str, str] = {}
    for word in named:
        name, sep, address = word.partition("=")
        if not sep or not DEVICE_NAME.fullmatch(name):
            raise SessionError(f"{word!r}: expected DEVICE=ADDRESS, e.g. dac=/dev/ttyACM0 or "
                               "ocs=TCPIP::10.0.0.9::5025::SOCKET")
        if name in given:
            raise SessionError(f"device {name!r} is named twice ({given[name]} and "
                               f"{address}): which one is meant?")
        given[name] = address
        wires[name] = parse_address(address, SCPI_PORT)
    return wires, notes
