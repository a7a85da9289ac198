"""What every SCPI instrument driver shares: a pyvisa session on a raw socket, typed errors
from the instrument's error queue, bounded waits, and reopening the session when it drops.

Sessions are opened with pyvisa and the pyvisa-py backend (`@py`) by default; any VISA library
works (`visa_library="..."`), and tests pass `opener`, a callable returning a pyvisa-like object
(`write(str)`, `read() -> str`, `timeout` in ms, `close()`). Terminations are explicit: we write
`\\n` and read to `\\n`, dropping a trailing `\\r` (instruments answer `\\r\\n`); pyvisa's
defaults time out on raw sockets.

Every setting is sent together with `:SYST:ERR?` on the same line, so a refusal comes back in
the same round trip and is raised as a typed `SCPIError` (`DataOutOfRange` for -222 and so on),
after the rest of the queue has been drained into `errors`.
"""
from __future__ import annotations

import logging
import re
import socket
import time
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)

ERROR_ENTRY = re.compile(r'^\s*([+-]?\d+)\s*,\s*"(.*)"\s*$')
MAX_DRAIN = 64


class InstrumentError(Exception):
    """Anything that went wrong talking to an instrument."""


class InstrumentTimeout(InstrumentError):
    """The instrument did not answer within the deadline."""


class InstrumentDisconnected(InstrumentError):
    """The session dropped and could not be reopened within the reconnect deadline."""


class ProtocolError(InstrumentError):
    """The instrument answered something this driver does not understand."""


class SCPIError(InstrumentError):
    """The instrument refused a command: an entry of its IEEE 488.2 error queue."""

    def __init__(self, code: int, message: str, command: str = "",
                 errors: list[tuple[int, str]] | None = None):
        self.code = code
        self.message = message
        self.command = command
        self.errors = errors or [(code, message)]     # the whole drained queue
        more = f" (+{len(self.errors) - 1} more queued)" if len(self.errors) > 1 else ""
        super().__init__(f"{command[:80]!r} refused: {code},\"{message}\"{more}")


class CommandError(SCPIError):
    """-100..-199: the instrument could not parse the command."""


class UndefinedHeader(CommandError):
    """-113: no such command."""


class ExecutionError(SCPIError):
    """-200..-299: understood, but could not be carried out."""


class DataOutOfRange(ExecutionError):
    """-222: a value outside what the instrument accepts (a port, a wavelength...)."""


class IllegalParameterValue(ExecutionError):
    """-224: a value the instrument refuses in this state (e.g. a port already in use)."""


class DeviceSpecificError(SCPIError):
    """-300..-399: the instrument itself failed."""


class QueueOverflow(DeviceSpecificError):
    """-350: more errors happened than the queue holds."""


class QueryError(SCPIError):
    """-400..-499: a reply was lost or interrupted."""


_BY_CODE = {-113: UndefinedHeader, -222: DataOutOfRange, -224: IllegalParameterValue,
            -350: QueueOverflow}
_BY_CLASS = {-1: CommandError, -2: ExecutionError, -3: DeviceSpecificError, -4: QueryError}


def scpi_error(code: int, message: str, command: str = "",
               errors: list[tuple[int, str]] | None = None) -> SCPIError:
    """The most specific exception class for an error-queue entry."""
    cls = _BY_CODE.get(code) or _BY_CLASS.get(-((-code) // 100) if code < 0 else 0, SCPIError)
    return cls(code, message, command, errors)


def parse_error(entry: str) -> tuple[int, str]:
    m = ERROR_ENTRY.match(entry)
    if not m:
        raise ProtocolError(f"not an error-queue entry: {entry[:80]!r}")
    return int(m.group(1)), m.group(2)


VI_ERROR_TMO = -1073807339      # pyvisa's StatusCode.error_timeout


def reply_float(reply: str, what: str) -> float:
    """The number an instrument answered; anything else is a ProtocolError naming `what`."""
    try:
        return float(reply)
    except ValueError:
        raise ProtocolError(f"{what} answered {reply[:40]!r}") from None


class ConnectionLost(Exception):
    """Internal: the session broke (reset, closed, or silent past the timeout)."""

    def __init__(self, message: str, timeout: bool = False):
        super().__init__(message)
        self.timeout = timeout


_MANAGERS: dict[str, Any] = {}


def open_visa(resource: str, timeout_s: float, visa_library: str = "@py"):
    """A pyvisa session on a raw socket with explicit terminations."""
    import pyvisa

    rm = _MANAGERS.get(visa_library)
    if rm is None:
        rm = _MANAGERS[visa_library] = pyvisa.ResourceManager(visa_library)
    res = rm.open_resource(resource, read_termination="\n", write_termination="\n",
                           timeout=int(timeout_s * 1000), open_timeout=int(timeout_s * 1000))
    return res


def _lost_errors() -> tuple[type[BaseException], ...]:
    try:
        import pyvisa.errors
        return (OSError, pyvisa.errors.VisaIOError, pyvisa.errors.InvalidSession)
    except ImportError:
        return (OSError,)


def _peek(sock: socket.socket) -> bytes | None:
    """What waits unread on a socket, without taking it (b"": closed by the peer); None when
    nothing waits. OSError when the socket is broken."""
    try:
        return sock.recv(65536, socket.MSG_PEEK | socket.MSG_DONTWAIT)
    except (BlockingIOError, InterruptedError):
        return None


class SCPIInstrument:
    """A pyvisa session to one SCPI instrument that reopens itself when the link drops."""

    def __init__(self, resource: str, *, timeout_s: float = 2.0, reconnect_s: float = 5.0,
                 visa_library: str = "@py",
                 opener: Callable[[str, float], Any] | None = None):
        self.resource_name = resource
        self.timeout_s = timeout_s
        self.reconnect_s = reconnect_s
        self._opener = opener or (lambda name, t: open_visa(name, t, visa_library))
        self._lost = _lost_errors()
        self._res = None
        self.reconnects = 0
        self.bytes_sent = 0
        self.bytes_received = 0
        try:
            self._open()
        except ConnectionLost as e:
            raise InstrumentDisconnected(str(e)) from None
        self.identity = self.query("*IDN?")

    # ---- session --------------------------------------------------------------------------

    def _open(self) -> None:
        try:
            self._res = self._opener(self.resource_name, self.timeout_s)
        except self._lost as e:
            raise ConnectionLost(str(e)) from e
        except Exception as e:     # pyvisa-py raises a plain Exception when it cannot connect
            raise ConnectionLost(f"cannot open {self.resource_name}: {e}") from e

    def close(self) -> None:
        if self._res is not None:
            try:
                self._res.close()
            except self._lost as e:
                log.debug("closing %s: %s", self.resource_name, e)
            self._res = None

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _reconnect(self) -> None:
        """Reopen the session, retrying with back-off until `reconnect_s` has passed."""
        self.close()
        deadline = time.monotonic() + self.reconnect_s
        delay = 0.02
        last: Exception | None = None
        while True:
            try:
                self._open()
                self._res_io_write("*IDN?")
                self._res_io_read()
                self.reconnects += 1
                log.info("%s: session reopened", self.resource_name)
                self._on_reconnect()
                return
            except ConnectionLost as e:
                last = e
                self.close()
            if time.monotonic() + delay > deadline:
                raise InstrumentDisconnected(
                    f"{self.resource_name}: lost and not back within {self.reconnect_s:g} s "
                    f"({last})")
            time.sleep(delay)
            delay = min(delay * 2, 0.5)

    def _on_reconnect(self) -> None:
        """Subclasses forget what they cached about the instrument's state here."""

    # ---- raw I/O (raise ConnectionLost) ------------------------------------------------------

    def _res_io_write(self, line: str) -> None:
        if self._res is None:
            raise ConnectionLost("no session")
        try:
            self._res.write(line)
        except self._lost as e:
            raise ConnectionLost(str(e)) from e
        self.bytes_sent += len(line) + 1

    def _res_io_read(self, timeout_s: float | None = None) -> str:
        if self._res is None:
            raise ConnectionLost("no session")
        if timeout_s is not None:
            self._res.timeout = int(timeout_s * 1000)
        try:
            reply = self._res.read()
        except self._lost as e:
            raise ConnectionLost(str(e), getattr(e, "error_code", None) == VI_ERROR_TMO) from e
        finally:
            if timeout_s is not None and self._res is not None:
                self._res.timeout = int(self.timeout_s * 1000)
        self.bytes_received += len(reply) + 2
        return reply.rstrip("\r\n")

    def _exchange(self, line: str, timeout_s: float | None = None) -> str:
        """Send a query and read its reply line."""
        self._res_io_write(line)
        return self._res_io_read(timeout_s)

    # ---- a reply waited for elsewhere ----------------------------------------------------------

    def _session(self) -> Any:
        res: Any = self._res
        try:
            return res.visalib.sessions[res.session]
        except Exception:            # no session, another VISA library, a test double
            return None

    def session_socket(self) -> socket.socket | None:
        """The session's TCP socket where the VISA library lends one (pyvisa-py's raw-socket
        sessions), so that a caller can wait for several instruments' replies at once instead
        of one blocking read each (`reply_state`); None otherwise."""
        sock = getattr(self._session(), "interface", None)
        return sock if isinstance(sock, socket.socket) else None

    def reply_state(self) -> str:
        """Without reading: 'line' when a whole reply line waits on the session (a read
        returns it at once), 'lost' when the session is closed or broken, 'wait' otherwise."""
        session = self._session()
        sock = getattr(session, "interface", None)
        if not isinstance(sock, socket.socket):
            return "lost"
        if b"\n" in getattr(session, "_pending_buffer", b""):   # read ahead by pyvisa-py
            return "line"
        try:
            data = _peek(sock)
        except OSError:
            return "lost"
        if data is None:
            return "wait"
        if not data:
            return "lost"                       # the instrument closed the session
        return "line" if b"\n" in data else "wait"

    def take_waiting(self, timeout_s: float | None = None) -> str:
        """The reply line `reply_state` said waits: taken straight off the session's socket
        when the VISA library holds nothing read ahead (the whole line is in the socket: one
        `recv` of exactly its bytes), else read through the library."""
        session = self._session()
        sock = getattr(session, "interface", None)
        if isinstance(sock, socket.socket) and not getattr(session, "_pending_buffer", b"x"):
            try:
                end = (_peek(sock) or b"").find(b"\n")
                if end >= 0:
                    line = sock.recv(end + 1, socket.MSG_DONTWAIT)
                    if len(line) != end + 1:
                        raise ConnectionLost(f"a reply line was cut: {line[:80]!r}")
                    self.bytes_received += len(line)
                    return line.decode(getattr(self._res, "encoding", "ascii")).rstrip("\r\n")
            except OSError as e:
                raise ConnectionLost(str(e)) from e
        return self._res_io_read(timeout_s)

    # ---- public I/O --------------------------------------------------------------------------

    def query(self, line: str, timeout_s: float | None = None) -> str:
        """Send a query and return its reply; a read-only query is simply resent after a drop."""
        try:
            return self._exchange(line, timeout_s)
        except ConnectionLost as e:
            log.warning("%s: session lost during %r (%s); reopening", self.resource_name,
                        line[:60], e)
        self._reconnect()
        try:
            return self._exchange(line, timeout_s)
        except ConnectionLost as e:
            cls = InstrumentTimeout if e.timeout else InstrumentDisconnected
            raise cls(f"{self.resource_name}: no answer to {line[:60]!r} on a fresh session "
                      f"either: {e}") from e

    def query_float(self, line: str, what: str, timeout_s: float | None = None) -> float:
        """A query whose reply is a number (`what` names it in the error of any other)."""
        return reply_float(self.query(line, timeout_s), what)

    def query_power_unit(self, line: str) -> int:
        """The unit a Keysight-style source or sensor answers power in, asked by `line` (its
        `...:POW:UNIT?`): 0 for dBm, 1 for W."""
        reply = self.query(line)
        code = reply_float(reply, "unit")
        if code not in (0, 1):
            raise ProtocolError(f"unit query answered {reply[:40]!r}")
        return int(code)

    def write(self, line: str) -> None:
        """Send a line with no reply and no error check (for lab-script compatibility)."""
        try:
            self._res_io_write(line)
        except ConnectionLost:
            self._reconnect()
            self._res_io_write(line)

    def command(self, line: str) -> None:
        """Send a setting and confirm it in the same round trip (`line;:SYST:ERR?`); settings
        are idempotent, so after a drop the line is sent again on the new session."""
        reply = self.query(f"{line};:SYST:ERR?")
        self._raise_errors(reply, line)

    def errors(self) -> list[tuple[int, str]]:
        """Drain the error queue; [] when it was empty."""
        out = []
        for _ in range(MAX_DRAIN):
            code, msg = parse_error(self.query(":SYST:ERR?"))
            if code == 0:
                break
            out.append((code, msg))
        return out

    def _raise_errors(self, entry: str, command: str) -> None:
        code, msg = parse_error(entry)
        if code == 0:
            return
        queue = [(code, msg)] + self.errors()
        raise scpi_error(code, msg, command, queue)

    def wait(self, timeout_s: float | None = None) -> None:
        """Block until the instrument reports every operation complete (*OPC?)."""
        reply = self.query("*OPC?", timeout_s)
        if reply.strip() not in ("1", "+1"):
            raise ProtocolError(f"*OPC? answered {reply[:40]!r}")
