"""Driver for the heater DAC board (Qontrol-compatible ASCII dialect over USB serial).

Our own typed driver over pyserial. It discovers the daisy chain, writes only the channels
whose value changed, packs them into as few lines as the board allows, bounds every wait,
raises typed exceptions carrying the board's error code and channel, and reopens the port
by itself when the USB link drops, restoring limits and the last commanded voltages.

With a board that speaks our firmware's `VHEX` extension the driver sends 16-bit codes, four
hex digits per channel, one line per contiguous run of changed channels; with a stock
Qontrol board it falls back to one `VVEC` line per module, as the vendor's client does.
"""
from __future__ import annotations

import errno
import logging
import re
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import serial

log = logging.getLogger(__name__)

BAUD = 115200
CODE_FULL = 65535
ERROR_LINE = re.compile(r"^[A-Za-z]{1,3}(\d+):(\d+)$")
MODULE_LINE = re.compile(r"^\s*([^:\s]+)\s*:\s*(\d+)\s*$")
VALUE_LINE = re.compile(r"^([+-]?\d+(?:\.\d*)?)\s*(V|mA|mW|uA)?$")
# A gap of this many unchanged channels costs more bytes as a new line than resent in place
# (the lines of one change go back to back, so a line costs its bytes, not a turnaround).
MERGE_GAP = 2
LINE_LIMIT = 256        # bytes before the newline the firmware accepts (E14 beyond)
# Set lines sent back to back before their replies are read (the protocol allows several lines
# in one write; every line gets exactly one reply): a swap's scattered heaters cost one
# turnaround, not one per line. Bounded by one line buffer, whatever the board's USB FIFO.
PIPELINE_BYTES = 256


class DACError(Exception):
    """Anything that went wrong talking to the board."""


class DACTimeout(DACError):
    """The board did not answer within the deadline."""


class DACDisconnected(DACError):
    """The serial link is gone and did not come back within the reconnect deadline."""


class PortInUse(DACError):
    """Another program holds the board's serial port (its exclusive lock): one writer per
    board, so this one does not open it."""


class ProtocolError(DACError):
    """The board answered something this driver does not understand."""


class BoardError(DACError):
    """The board refused a command with `E<code>:<ch>`."""

    code = 0
    meaning = "unknown error"

    def __init__(self, code: int, channel: int, command: str):
        self.code = code
        self.channel = channel
        self.command = command
        super().__init__(f"board refused {command!r}: E{code:02d} {self.meaning} "
                         f"(channel {channel})")


def _board_error(code: int, meaning: str) -> type[BoardError]:
    return type(meaning.title().replace(" ", ""), (BoardError,),
                {"code": code, "meaning": meaning, "__doc__": f"E{code:02d}: {meaning}."})


OverVoltage = _board_error(1, "over voltage")
OverCurrent = _board_error(2, "over current")
PowerBudgetExceeded = _board_error(3, "power budget exceeded")
UnknownCommand = _board_error(10, "unrecognised command")
BadParameter = _board_error(11, "unrecognised parameter")
BadChannel = _board_error(12, "unrecognised channel")
Forbidden = _board_error(13, "operation forbidden")
BufferOverflow = _board_error(14, "serial buffer overflow")
SerialCommError = _board_error(15, "serial communication error")
FirmwareTrap = _board_error(31, "firmware trap")
BOARD_ERRORS = {cls.code: cls for cls in (OverVoltage, OverCurrent, PowerBudgetExceeded,
                                          UnknownCommand, BadParameter, BadChannel, Forbidden,
                                          BufferOverflow, SerialCommError, FirmwareTrap)}
POWERED_UP = 90


def board_error(code: int, channel: int, command: str) -> BoardError:
    cls = BOARD_ERRORS.get(code)
    if cls is None:
        cls = _board_error(code, "error")
    return cls(code, channel, command)


@dataclass(frozen=True)
class Module:
    ident: str          # e.g. "Q8iv-0001"
    kind: str           # e.g. "Q8iv"
    index: int          # position in the daisy chain, 0 nearest the host
    first_channel: int
    channels: int


@dataclass(frozen=True)
class BoardInfo:
    ident: str
    firmware: str
    modules: tuple[Module, ...]
    channels: int
    vfull: float        # volts
    ifull: float        # mA
    compact: bool       # speaks the VHEX extension (learnt by asking VHEX? on open)


def _open_pyserial(port: str, timeout: float):
    # exclusive: an advisory lock (flock) on POSIX, so a second program that opens the board
    # (the chip service and a calibration at once) is refused instead of interleaving its
    # lines with ours; Windows opens serial ports exclusively anyway.
    return serial.serial_for_url(port, baudrate=BAUD, timeout=timeout, write_timeout=timeout,
                                 exclusive=True)


def _in_use(e: Exception) -> bool:
    """Whether opening a port failed on its exclusive lock (another program holds it)."""
    return getattr(e, "errno", None) in (errno.EAGAIN, errno.EWOULDBLOCK)


class HeaterDAC:
    """A chain of heater DAC modules on one serial port.

    `open_serial(port, timeout)` returns a pyserial-like object; tests pass a scripted fake.
    """

    def __init__(self, port: str, *, timeout: float = 1.0, reconnect_timeout: float = 5.0,
                 open_serial: Callable[[str, float], object] = _open_pyserial):
        self.port = port
        self.timeout = timeout
        self.reconnect_timeout = reconnect_timeout
        self._open_serial = open_serial
        self._ser: Any = None                # what open_serial returned, while open
        self._rx = bytearray()
        self.info: BoardInfo | None = None
        self._codes: list[int] = []          # what the board holds, as far as we know
        self._commanded: list[int] = []      # what the user asked for last
        self._limits: dict[tuple[str, int], float] = {}
        self._watchdog_ms: int | None = None
        self._power_budget_mw: float | None = None
        self._board_reset = False
        self._out_of_step = False            # a reply may still be on its way (a timeout)
        self.bytes_sent = 0
        self.bytes_received = 0
        self.reconnects = 0

    # ---- connection -------------------------------------------------------------------------

    def open(self) -> BoardInfo:
        self._connect()
        return self._require_info()

    def close(self) -> None:
        if self._ser is not None:
            try:
                self._ser.close()
            except (OSError, serial.SerialException):
                pass
            self._ser = None

    def __enter__(self) -> HeaterDAC:
        if self._ser is None:
            self.open()
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def channels(self) -> int:
        return self._require_info().channels

    def _require_info(self) -> BoardInfo:
        if self.info is None:
            raise DACError("the board is not open: call open() first")
        return self.info

    def _connect(self) -> None:
        self.close()
        try:
            self._ser = self._open_serial(self.port, self.timeout)
        except (OSError, serial.SerialException) as e:
            if _in_use(e):
                raise PortInUse(f"{self.port} is in use: another program holds it (the chip "
                                "or heater DAC service, or another ptb command?); stop it "
                                "first: one program at a time writes to the board") from None
            raise DACDisconnected(f"cannot open {self.port}: {e}") from e
        self._rx.clear()
        self._drain()
        self._board_reset = False
        self._out_of_step = False
        previous = self.info
        info = self._identify()
        if previous is not None and (previous.ident, previous.channels) != (info.ident,
                                                                             info.channels):
            self.close()
            raise DACError(f"{self.port} now answers as {info.ident} with {info.channels} "
                           f"channels, not {previous.ident} with {previous.channels}: "
                           "refusing to drive a different board with this one's voltages")
        self.info = info
        try:
            self._codes = self._read_codes()
        except UnknownCommand:  # a stock Qontrol board: no VHEX extension
            self.info = replace(info, compact=False)
            self._codes = self._read_codes()
        if len(self._commanded) != info.channels:
            self._commanded = list(self._codes)

    def _identify(self) -> BoardInfo:
        ident = self._query("id?")[0]
        self._command("nup=0")
        nchan = int(self._query("nchan?")[0])
        # nupall? answers one line per module; read until the modules cover every channel.
        self._write("nupall?")
        deadline = time.monotonic() + self.timeout
        modules = []
        first = 0
        while first < nchan:
            line = self._readline(deadline, "nupall?")
            m = MODULE_LINE.match(line)
            if m is None:
                raise ProtocolError(f"nupall? answered {line!r}, expected 'ID : index'")
            module_id, index = m.group(1), int(m.group(2))
            kind = module_id.split("-", 1)[0]
            digits = re.search(r"(\d+)", kind)
            if digits is None or int(digits.group(1)) == 0:
                raise ProtocolError(f"cannot tell the channel count of module {module_id!r}")
            count = int(digits.group(1))
            modules.append(Module(module_id, kind, index, first, count))
            first += count
        if first != nchan:
            raise ProtocolError(f"nchan? says {nchan} channels, the chain lists {first}")
        vfull = self._parse_value(self._query("vfull?")[0], "V")
        ifull = self._parse_value(self._query("ifull?")[0], "mA")
        firmware = self._query("firmware?")[0]
        info = BoardInfo(ident, firmware, tuple(modules), nchan, vfull, ifull, compact=True)
        log.info("heater DAC %s on %s: %d modules, %d channels, firmware %s", ident, self.port,
                 len(modules), nchan, firmware)
        return info

    def _reconnect(self, cause: Exception) -> None:
        """Reopen the port after the link dropped, then restore what the board should hold."""
        log.warning("heater DAC on %s: link lost (%s); reopening", self.port, cause)
        deadline = time.monotonic() + self.reconnect_timeout
        delay = 0.01
        while True:
            try:
                self._connect()
                break
            except (DACDisconnected, DACTimeout, OSError, serial.SerialException) as e:
                if time.monotonic() + delay > deadline:
                    self.close()
                    raise DACDisconnected(
                        f"{self.port} did not come back within {self.reconnect_timeout} s: {e}"
                    ) from cause
                time.sleep(delay)
                delay = min(delay * 2, 0.25)
        self.reconnects += 1
        self._restore()
        log.info("heater DAC on %s: reconnected and restored", self.port)

    def _restore(self) -> None:
        """Limits first (safety), then the watchdog and budget, then the commanded outputs."""
        self._board_reset = False
        for (name, ch), value in sorted(self._limits.items()):
            self._command(f"{name}{ch}={value:.4f}")
        if self._watchdog_ms is not None:
            self._command(f"wdt={self._watchdog_ms}")
        if self._power_budget_mw is not None:
            self._command(f"pmax={self._power_budget_mw:.0f}")
        self._codes = self._read_codes()
        self._write_codes(dict(enumerate(self._commanded)))

    def _call(self, fn, *args):
        """Run one operation; reopen and retry once if the link dropped under it. After a
        timeout the link is first brought back in step (`_resync`)."""
        self._require_info()
        try:
            if self._ser is None:
                raise serial.SerialException("port closed after an earlier failure")
            if self._out_of_step:
                self._resync()
            result = fn(*args)
        except (OSError, serial.SerialException) as e:
            self._reconnect(e)
            result = fn(*args)
        except DACTimeout:
            self._out_of_step = True
            raise
        if self._board_reset:
            log.warning("heater DAC on %s reported a power-up: restoring outputs", self.port)
            self._restore()
        return result

    def _resync(self) -> None:
        """After a timeout, replies to lines sent before may still come: ask `nchan?` and drop
        every line until its answer, then read back what the board holds (`vhex?`/`vall?`),
        since the lines whose replies were lost may or may not have been applied."""
        want = str(self._require_info().channels)
        self._drain()
        self._write("nchan?")
        deadline = time.monotonic() + self.timeout
        while (line := self._readline(deadline, "nchan?")) != want:
            self._note_unsolicited(line)        # a power-up notice is not lost
        self._codes = self._read_codes()
        self._out_of_step = False
        log.info("heater DAC on %s: back in step after a timeout", self.port)

    # ---- line I/O ------------------------------------------------------------------------

    def _write(self, line: str) -> None:
        data = (line + "\n").encode("ascii")
        self._ser.write(data)
        self.bytes_sent += len(data)

    def _drain(self) -> None:
        """Consume whatever the board said unprompted (a power-up notice, stale replies)."""
        waiting = self._ser.in_waiting
        if waiting:
            self._rx += self._ser.read(waiting)
        while b"\n" in self._rx:
            line = self._take_line()
            self._note_unsolicited(line)
        self._rx.clear()

    def _note_unsolicited(self, line: str) -> None:
        m = ERROR_LINE.match(line)
        if m and int(m.group(1)) == POWERED_UP:
            self._board_reset = True
        elif line:
            log.debug("heater DAC: discarding stale line %r", line)

    def _take_line(self) -> str:
        end = self._rx.index(b"\n")
        raw = bytes(self._rx[:end])
        del self._rx[:end + 1]
        try:
            return raw.decode("ascii").strip()
        except UnicodeDecodeError:
            raise ProtocolError(f"non-ASCII bytes from the board: {raw!r}") from None

    def _readline(self, deadline: float, command: str) -> str:
        while b"\n" not in self._rx:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise DACTimeout(f"no answer to {command!r} within {self.timeout} s")
            # Changing a port's timeout reconfigures the tty (two system calls): only when the
            # one set would overrun the deadline, or is far shorter than what is left.
            current = self._ser.timeout
            if current is None or current > remaining or current < remaining / 2:
                self._ser.timeout = remaining
            chunk = self._ser.read(max(1, self._ser.in_waiting))
            self.bytes_received += len(chunk)
            self._rx += chunk
        return self._take_line()

    def _reply_lines(self, command: str, want: int | None) -> list[str]:
        """Read until `want` data lines (or OK when want is None); raise on an error line."""
        deadline = time.monotonic() + self.timeout
        lines: list[str] = []
        while want is None or len(lines) < want:
            line = self._readline(deadline, command)
            m = ERROR_LINE.match(line)
            if m:
                code, channel = int(m.group(1)), int(m.group(2))
                if code == POWERED_UP:
                    self._board_reset = True
                    continue
                raise board_error(code, channel, command)
            if want is None and line == "OK":
                return lines
            if line:
                lines.append(line)
        return lines

    def _command(self, line: str) -> None:
        self._write(line)
        self._reply_lines(line, None)

    def _query(self, line: str, count: int = 1) -> list[str]:
        self._write(line)
        return self._reply_lines(line, count)

    @staticmethod
    def _parse_value(line: str, unit: str) -> float:
        m = VALUE_LINE.match(line)
        if m is None or (m.group(2) and m.group(2) != unit):
            raise ProtocolError(f"expected a value in {unit}, got {line!r}")
        return float(m.group(1))

    # ---- codes and voltages ----------------------------------------------------------------

    def _code(self, ch: int, volts: float) -> int:
        info = self._require_info()
        if not 0 <= ch < info.channels:
            raise ValueError(f"channel {ch} does not exist (0..{info.channels - 1})")
        if not 0.0 <= volts <= info.vfull:
            raise ValueError(f"{volts!r} V on channel {ch} is outside the board's "
                             f"0..{info.vfull:g} V range")
        return int(volts / info.vfull * CODE_FULL + 0.5)  # half up, as the firmware rounds

    def _volts(self, code: int) -> float:
        return round(code * self._require_info().vfull / CODE_FULL, 4)

    def _read_codes(self) -> list[int]:
        info = self._require_info()
        if info.compact:
            line = self._query("vhex?")[0]
            if len(line) != 4 * info.channels:
                raise ProtocolError(f"vhex? answered {len(line)} digits for {info.channels} "
                                    "channels")
            return [int(line[4 * c:4 * c + 4], 16) for c in range(info.channels)]
        lines = self._query("vall?", info.channels)
        return [round(self._parse_value(s, "V") / info.vfull * CODE_FULL) for s in lines]

    def _runs(self, changed: Iterable[int]) -> list[tuple[int, int]]:
        """Group changed channels into [first, last] runs, bridging small gaps, each short
        enough for one `vhex` line."""
        runs: list[list[int]] = []
        for ch in sorted(changed):
            if runs and ch - runs[-1][1] <= MERGE_GAP + 1 and \
                    len(f"vhex{runs[-1][0]}=") + 4 * (ch - runs[-1][0] + 1) <= LINE_LIMIT:
                runs[-1][1] = ch
            else:
                runs.append([ch, ch])
        return [(a, b) for a, b in runs]

    def _write_codes(self, targets: Mapping[int, int]) -> int:
        """Send the targets that differ from the board; returns the number of lines sent."""
        changed = [ch for ch, code in targets.items() if self._codes[ch] != code]
        for ch, code in targets.items():
            if self._codes[ch] == code:
                self._commanded[ch] = code
        if not changed:
            return 0
        want = list(self._codes)
        for ch in changed:
            want[ch] = targets[ch]
        info = self._require_info()
        if info.compact:
            batch = [(f"vhex{first}=" + "".join(f"{want[c]:04X}" for c in range(first, last + 1)),
                      first, last) for first, last in self._runs(changed)]
        else:
            batch = []
            for module in info.modules:
                span = range(module.first_channel, module.first_channel + module.channels)
                if any(c in span for c in changed):
                    values = ",".join(f"{self._volts(want[c]):.4f}" for c in span)
                    batch.append((f"vvec{module.first_channel}={values}", span.start,
                                  span.stop - 1))
        self._send_sets(batch, want)
        return len(batch)

    def _send_sets(self, batch: list[tuple[str, int, int]], want: list[int]) -> None:
        """Send set lines, several per write (at most PIPELINE_BYTES in flight), and read their
        replies in order; each line the board takes updates what this driver knows of the
        outputs. The first refusal is raised once every reply of its write has been read, so
        the link stays in step; nothing after that write is sent."""
        i = 0
        while i < len(batch):
            window = [batch[i]]
            size = len(batch[i][0]) + 1
            i += 1
            while i < len(batch) and size + len(batch[i][0]) + 1 <= PIPELINE_BYTES:
                window.append(batch[i])
                size += len(batch[i][0]) + 1
                i += 1
            data = "".join(line + "\n" for line, _, _ in window).encode("ascii")
            self._ser.write(data)
            self.bytes_sent += len(data)
            refused: BoardError | None = None
            for line, first, last in window:
                try:
                    self._reply_lines(line, None)
                except BoardError as e:
                    refused = refused or e
                    continue
                self._codes[first:last + 1] = want[first:last + 1]
                self._commanded[first:last + 1] = want[first:last + 1]
            if refused is not None:
                raise refused

    # ---- public API -----------------------------------------------------------------------------

    def set_voltage(self, ch: int, volts: float) -> None:
        """Set one heater's voltage (volts). Refused by the board above its VMAX or IMAX."""
        self.set_voltages({ch: volts})

    def set_voltages(self, values: Mapping[int, float] | Sequence[float]) -> int:
        """Set many heaters at once; only changed channels go on the wire.

        Returns the number of serial lines sent. On a refusal nothing in that line changed.
        """
        if not isinstance(values, Mapping):
            values = dict(enumerate(values))
        targets = {ch: self._code(ch, float(v)) for ch, v in values.items()}
        return self._call(self._write_codes, targets)

    def voltage(self, ch: int) -> float:
        self._code(ch, 0.0)
        return self._call(lambda: self._parse_value(self._query(f"v{ch}?")[0], "V"))

    def voltages(self) -> list[float]:
        return self._call(lambda: [self._volts(c) for c in self._read_codes()])

    @property
    def commanded(self) -> list[float]:
        """The voltages last asked for, per channel (restored after a reconnect)."""
        vfull = self._require_info().vfull          # (`_volts`, inline: read at every change)
        return [round(code * vfull / CODE_FULL, 4) for code in self._commanded]

    def current(self, ch: int) -> float:
        """Measured heater current, mA."""
        self._code(ch, 0.0)
        return self._call(lambda: self._parse_value(self._query(f"i{ch}?")[0], "mA"))

    def currents(self) -> list[float]:
        n = self.channels
        return self._call(lambda: [self._parse_value(s, "mA") for s in self._query("iall?", n)])

    def photocurrent(self, ch: int) -> float:
        """Monitor photodiode current beside heater channel ch, in uA (our PD extension;
        Forbidden when the board has no photodiode inputs)."""
        self._code(ch, 0.0)  # refuses a channel the chain does not have
        return self._call(lambda: self._parse_value(self._query(f"pd{ch}?")[0], "uA"))

    def photocurrents(self) -> list[float]:
        """Every monitor photodiode of the chain in one query (PDALL?), in uA."""
        n = self.channels
        return self._call(lambda: [self._parse_value(s, "uA") for s in self._query("pdall?", n)])

    def set_vmax(self, ch: int, volts: float) -> None:
        self._code(ch, volts)
        self._call(self._command, f"vmax{ch}={volts:.4f}")
        self._limits[("vmax", ch)] = volts

    def vmax(self, ch: int) -> float:
        self._code(ch, 0.0)
        return self._call(lambda: self._parse_value(self._query(f"vmax{ch}?")[0], "V"))

    def set_imax(self, ch: int, milliamps: float) -> None:
        self._code(ch, 0.0)
        ifull = self._require_info().ifull
        if not 0.0 <= milliamps <= ifull:
            raise ValueError(f"{milliamps!r} mA is outside 0..{ifull:g} mA")
        self._call(self._command, f"imax{ch}={milliamps:.4f}")
        self._limits[("imax", ch)] = milliamps

    def imax(self, ch: int) -> float:
        self._code(ch, 0.0)
        return self._call(lambda: self._parse_value(self._query(f"imax{ch}?")[0], "mA"))

    def set_watchdog(self, milliseconds: int) -> None:
        """Outputs ramp to 0 V when the host is silent this long; 0 turns it off."""
        self._call(self._command, f"wdt={int(milliseconds)}")
        self._watchdog_ms = int(milliseconds)

    def set_power_budget(self, milliwatts: float) -> None:
        self._call(self._command, f"pmax={milliwatts:.0f}")
        self._power_budget_mw = milliwatts

    def power_budget(self) -> float:
        return self._call(lambda: self._parse_value(self._query("pmax?")[0], "mW"))

    def total_power(self) -> float:
        """Power delivered to all heaters now, mW."""
        return self._call(lambda: self._parse_value(self._query("ptot?")[0], "mW"))

    def ping(self) -> str:
        return self._call(lambda: self._query("id?")[0])
