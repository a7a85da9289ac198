"""Command core of the heater DAC board: line framing, parser, channel state, limits, dispatch.

The same source runs on the board (MicroPython, RP2040 class) and on the host (CPython, behind
the emulator's pseudo-terminal). It therefore uses only what MicroPython has: plain classes,
dicts, lists and string methods; no dataclasses, typing, enum or floats in anything that is
answered on the wire. Every quantity is an integer in fixed units so that replies are the same
bytes on a single-precision microcontroller as on a desktop:

    voltages   in 1e-4 V   (120000 == 12 V)
    currents   in 1e-4 mA  (240000 == 24 mA)
    DAC codes  0..65535 over the module's full scale

The dialect is the Qontrol ASCII protocol, `[cmd][ch][=|?][value]\\n`, so the unmodified
`qontrol` client drives it; docs/firmware-protocol.md lists every command and our extensions.
The hardware is reached only through a HAL object with three methods:

    hal.write(ch, code)      set one DAC channel (global channel index across the chain)
    hal.read_current(ch)     measured heater current of that channel, in 1e-4 mA
    hal.ticks_ms()           a millisecond clock (wrap-around is handled with ticks_diff)

and optionally a fourth, on boards that carry the chip's monitor photodiodes:

    hal.read_photocurrent(ch)  photocurrent of the photodiode wired beside heater channel ch,
                               in 1e-4 uA, or None when the board has no photodiode inputs
"""

FIRMWARE_VERSION = "0.1.0"

# Error codes, as the Qontrol protocol numbers them.
E_UNKNOWN = 0
E_OVER_VOLTAGE = 1
E_OVER_CURRENT = 2
E_POWER = 3
E_UNKNOWN_COMMAND = 10
E_BAD_PARAMETER = 11
E_BAD_CHANNEL = 12
E_FORBIDDEN = 13
E_OVERFLOW = 14
E_SERIAL = 15
E_POWERED_UP = 90

MAX_LINE = 256          # bytes before the newline; longer lines are dropped with E14
CODE_FULL = 65535       # 16-bit DAC
UNITS = 10000           # fixed-point scale: 4 decimals
PROBE_UNITS = 5000      # 0.5 V: voltage used to measure a heater's resistance before first use
RAMP_MS = 100           # watchdog ramp-down duration
WDT_MIN_MS = 10
WDT_MAX_MS = 3600000
MAX_NUMBER_CHARS = 40
W11_PER_MW = 100000000  # power products of fixed-point volts and mA are in 1e-11 W
E_FIRMWARE_TRAP = 31

# Module types this firmware can present itself as: (volts full scale, mA full scale) in units.
MODULE_TYPES = {
    "Q8iv": (120000, 240000),
    "Q8a": (120000, 1000000),
    "Q8b": (120000, 833333),
    "Q8bi": (120000, 1000000),
}

HELP_TEXT = (
    "Commands ([cmd][ch][=|?][value], case-insensitive, one per line):",
    "V<ch>=<volts> V<ch>?  I<ch>=<mA> I<ch>?  VMAX<ch>=<volts> VMAX<ch>?  IMAX<ch>=<mA> IMAX<ch>?",
    "VALL? IALL? VMAXALL? IMAXALL?  VVEC<ch>=a,b,...  VHEX<ch>=hhhh...  VHEX?",
    "ID? NUP=0 NUP? NUPALL? NCHAN? VFULL? IFULL? FIRMWARE? HELP",
    "WDT=<ms> (0 = off) WDT?  PMAX=<mW> PMAX?  PTOT?  PD<ch>? PDALL? (monitor photodiodes)",
    "Errors: E<code>:<ch>  01 over voltage, 02 over current, 03 power budget, 10 command,",
    "11 parameter, 12 channel, 13 forbidden, 14 line too long, 15 serial, 90 powered up",
)


class CommandError(Exception):
    """A refused command: the code and channel of its `E<code>:<ch>` reply."""

    def __init__(self, code, ch=0):
        super().__init__(code, ch)
        self.code = code
        self.ch = ch


def error_line(code, ch=0):
    """`E<code>:<ch>` with two-digit fields; channels past 99 keep their last two digits."""
    return f"E{code % 100:02d}:{ch % 100:02d}\n"


def format_fixed(units, unit):
    """1e-4 fixed point to the board's reply form: `+1.5000 V`."""
    sign = "-" if units < 0 else "+"
    units = -units if units < 0 else units
    return f"{sign}{units // UNITS}.{units % UNITS:04d} {unit}"


def parse_fixed(text):
    """A decimal number (optional sign, fraction and exponent) to 1e-4 units, rounded half up.

    Integer arithmetic only, so that a single-precision board rounds exactly like the host.
    Raises ValueError for anything that is not such a number.
    """
    s = text.strip().lower()
    if not s or len(s) > MAX_NUMBER_CHARS:
        raise ValueError(text)
    negative = False
    if s[0] in "+-":
        negative = s[0] == "-"
        s = s[1:]
    exponent = 0
    epos = s.find("e")
    if epos >= 0:
        exp_text = s[epos + 1:]
        s = s[:epos]
        digits = exp_text[1:] if exp_text[:1] in ("+", "-") else exp_text
        if not is_digits(digits) or len(digits) > 3:
            raise ValueError(text)
        exponent = int(exp_text)
    dot = s.find(".")
    if dot >= 0:
        whole, frac = s[:dot], s[dot + 1:]
    else:
        whole, frac = s, ""
    if not whole and not frac:
        raise ValueError(text)
    if (whole and not is_digits(whole)) or (frac and not is_digits(frac)):
        raise ValueError(text)
    mantissa = int((whole or "0") + frac)
    # value = mantissa * 10**(exponent - len(frac)); we want value * 10**4
    shift = exponent - len(frac) + 4
    if shift >= 0:
        if shift > 12:
            raise ValueError(text)
        result = mantissa * 10 ** shift
    else:
        if shift < -60:
            result = 0
        else:
            den = 10 ** (-shift)
            result = (2 * mantissa + den) // (2 * den)
    return -result if negative else result


def is_digits(s):
    """True for a non-empty string of ASCII digits (str.isdigit also takes other scripts)."""
    if not s:
        return False
    for ch in s:
        if ch < "0" or ch > "9":
            return False
    return True


def ticks_diff(a, b):
    """a - b for millisecond clocks that may wrap at 2**30 (MicroPython's ticks_ms)."""
    d = a - b
    if d < -(1 << 29):
        d += 1 << 30
    elif d > (1 << 29):
        d -= 1 << 30
    return d


class Module:
    """One board of a daisy chain: its type, serial and channel range."""

    def __init__(self, kind, serial, first_channel, n_channels):
        if kind not in MODULE_TYPES:
            raise ValueError("unknown module type " + kind)
        self.kind = kind
        self.serial = serial
        self.first = first_channel
        self.n = n_channels
        self.vfull, self.ifull = MODULE_TYPES[kind]

    def ident(self):
        return f"{self.kind}-{self.serial:04X}"


def make_chain(kind, serials, channels_per_module=8):
    modules = []
    first = 0
    for serial in serials:
        modules.append(Module(kind, serial, first, channels_per_module))
        first += channels_per_module
    return modules


class LineFramer:
    """The host line's framing: bytes in, complete lines out. A line ends at a newline (a
    carriage return is dropped); a line holding a byte outside printable ASCII (tab allowed)
    is refused whole with E15 at its end; one over MAX_LINE bytes is refused with E14 at once
    and the rest of it skipped."""

    def __init__(self):
        self.rx = bytearray()
        self.dropping = False    # discarding the rest of an over-long line
        self.garbled = False     # current line held a non-ASCII byte

    def feed(self, data):
        """What `data` completes, in order: a line (str, without its newline) or the error
        code of a refused one."""
        out = []  # type: list[str | int]  # a comment: MicroPython has no typing
        for b in data:
            if b == 10:  # newline ends a line
                if self.dropping:
                    self.dropping = False
                elif self.garbled:
                    out.append(E_SERIAL)
                else:
                    out.append(self.rx.decode())
                self.rx = bytearray()
                self.garbled = False
                continue
            if self.dropping:
                continue
            if b == 13:
                continue
            if b >= 128 or (b < 32 and b != 9):
                self.garbled = True
                continue
            if len(self.rx) >= MAX_LINE:
                self.rx = bytearray()
                self.garbled = False
                self.dropping = True
                out.append(E_OVERFLOW)
                continue
            self.rx.append(b)
        return out


class Watchdog:
    """Silence on the host line for `ms` (0: off) ramps every live output down to 0 V over
    RAMP_MS, once per silence; a channel the host sets again leaves the ramp."""

    def __init__(self, now):
        self.ms = 0
        self.trips = 0
        self.last_rx = now
        self.ramp = {}           # channel -> code at ramp start
        self.ramp_start = 0

    def heard(self, now):
        self.last_rx = now

    def arm(self, ms, now):
        self.ms = ms
        self.last_rx = now

    def busy(self):
        """Armed or ramping: only then has `step` anything to do."""
        return bool(self.ms or self.ramp)

    def release(self, c):
        """The host has taken channel c over again."""
        if c in self.ramp:
            del self.ramp[c]

    def stop(self):
        self.ramp = {}

    def step(self, now, codes):
        """The outputs to lower now, as [(channel, code)], given every channel's code."""
        if self.ms and not self.ramp and ticks_diff(now, self.last_rx) > self.ms:
            live = {}
            for c in range(len(codes)):
                if codes[c]:
                    live[c] = codes[c]
            if live:
                self.ramp = live
                self.ramp_start = now
                self.trips += 1
            self.last_rx = now  # one trip per silence; re-arms on the next silence
        lower = []
        if self.ramp:
            elapsed = ticks_diff(now, self.ramp_start)
            done = elapsed >= RAMP_MS
            for c in self.ramp:
                code = 0 if done else self.ramp[c] * (RAMP_MS - elapsed) // RAMP_MS
                if code < codes[c]:
                    lower.append((c, code))
            if done:
                self.ramp = {}
        return lower


class Board:
    """The command core. Feed it bytes from the host; it answers bytes and drives the HAL."""

    def __init__(self, hal, modules, power_budget_mw=None):
        self.hal = hal
        self.modules = modules
        n = 0
        self.module_of = []
        for index, m in enumerate(modules):
            for _ in range(m.n):
                self.module_of.append(index)
            n += m.n
        self.n = n
        self.vfull = [modules[self.module_of[c]].vfull for c in range(n)]
        self.ifull = [modules[self.module_of[c]].ifull for c in range(n)]
        self.vmax = list(self.vfull)
        self.imax = list(self.ifull)
        # Default budget: a quarter of what all channels could draw at full scale, in mW.
        if power_budget_mw is None:
            total = 0
            for c in range(n):
                total += self.vfull[c] * self.ifull[c]
            power_budget_mw = total // (4 * W11_PER_MW)
        self.pmax_mw = power_budget_mw
        self.codes = [0] * n
        # Last resistance measurement per channel as (volts units, current units), None if none.
        self.load = [None] * n
        self.watchdog = Watchdog(hal.ticks_ms())
        self.framer = LineFramer()

    # ---- power and framing -------------------------------------------------------------

    def power_up(self):
        """Outputs to 0 V; answer the power-up notice the host sees after a reset."""
        for c in range(self.n):
            self.codes[c] = 0
            self.hal.write(c, 0)
        self.watchdog.stop()
        return error_line(E_POWERED_UP, 0).encode()

    def feed(self, data):
        """Bytes from the host in, reply bytes out. Never raises on any input."""
        self.watchdog.heard(self.hal.ticks_ms())
        out = []
        for line in self.framer.feed(data):
            out.append(self.execute(line) if isinstance(line, str) else error_line(line, 0))
        return "".join(out).encode()

    def tick(self):
        """Call often (every few ms): runs the watchdog and its ramp to 0 V."""
        for c, code in self.watchdog.step(self.hal.ticks_ms(), self.codes):
            self._output(c, code)

    # ---- dispatch ------------------------------------------------------------------------

    def execute(self, line):
        """One command line (without newline) to its reply text."""
        text = line.strip().lower()
        if not text:
            return ""
        try:
            return self._dispatch(text)
        except CommandError as e:
            return error_line(e.code, e.ch)
        except (ValueError, IndexError):
            return error_line(E_BAD_PARAMETER, 0)
        except Exception:  # a bug must not take the board down: report a firmware trap
            return error_line(E_FIRMWARE_TRAP, 0)

    def _dispatch(self, text):
        op_at = -1
        for i in range(len(text)):
            if text[i] == "=" or text[i] == "?":
                op_at = i
                break
        if op_at < 0:
            head, op, value = text, "?", ""
        else:
            head, op, value = text[:op_at].strip(), text[op_at], text[op_at + 1:].strip()
        i = 0
        while i < len(head) and head[i].isalpha():
            i += 1
        name, chan = head[:i], head[i:].strip()
        if not name:
            raise CommandError(E_UNKNOWN_COMMAND, 0)
        ch = None
        if chan:
            if not is_digits(chan) or len(chan) > 4:
                raise CommandError(E_UNKNOWN_COMMAND, 0)
            ch = int(chan)
        handler = self.COMMANDS.get((name, op))
        if handler is None:
            raise CommandError(E_UNKNOWN_COMMAND, ch or 0)
        if op == "?" and value:
            raise CommandError(E_BAD_PARAMETER, ch or 0)
        return handler(self, ch, value)

    def _channel(self, ch):
        if ch is None:
            raise CommandError(E_BAD_CHANNEL, 0)
        if ch >= self.n:
            raise CommandError(E_BAD_CHANNEL, ch % 100)
        return ch

    @staticmethod
    def _no_channel(ch):
        if ch is not None:
            raise CommandError(E_BAD_CHANNEL, ch % 100)

    # ---- outputs and limits ----------------------------------------------------------------

    def volts_of(self, c, code):
        full = self.vfull[c]
        return (code * full + CODE_FULL // 2) // CODE_FULL

    def code_of(self, c, units):
        full = self.vfull[c]
        return (units * CODE_FULL + full // 2) // full

    def _output(self, c, code):
        """Write one channel; returns the measured current (0 at 0 V) in 1e-4 mA."""
        self.codes[c] = code
        self.hal.write(c, code)
        if not code:
            return 0
        i = self.hal.read_current(c)
        if i > 0:
            self.load[c] = (self.volts_of(c, code), i)
        return i

    def _measured_power(self):
        """Total power of every live channel from measured currents, in 1e-11 W."""
        total = 0
        for c in range(self.n):
            if self.codes[c]:
                total += self.volts_of(c, self.codes[c]) * self.hal.read_current(c)
        return total

    def _code_at_most(self, c, units):
        """The DAC code nearest to `units` volts whose quantised voltage is not above VMAX."""
        code = self.code_of(c, units)
        while code > 0 and self.volts_of(c, code) > self.vmax[c]:
            code -= 1
        return code

    def _predicted_current(self, c, units):
        """Current the heater will draw at `units` volts, from its last measurement (ohmic)."""
        if units == 0:
            return 0
        if self.load[c] is None:
            self._probe(c)
        if self.load[c] is None:
            return 0  # open circuit: no current flows
        v, i = self.load[c]
        return (units * i + v // 2) // v

    def _probe(self, c):
        """Measure a heater's resistance at a small voltage, then restore the output."""
        previous = self.codes[c]
        probe = self.code_of(c, min(PROBE_UNITS, self.vmax[c]))
        if probe == 0:
            return
        self.hal.write(c, probe)
        i = self.hal.read_current(c)
        self.hal.write(c, previous)
        if i > 0:
            self.load[c] = (self.volts_of(c, probe), i)

    def _check_and_set(self, targets):
        """Set several channels {ch: code} all-or-nothing, after every limit check.

        Channels are checked and written in channel order (not dict order, which differs
        between CPython and MicroPython), so the reply names the lowest offending channel.
        VMAX is compared on quantised voltages; IMAX and the power budget on currents
        predicted from each heater's last measurement, then verified after the write: a
        measured overshoot puts every target back and is refused like a predicted one.
        A set that does not raise the total power is never refused for the budget.
        """
        order = sorted(targets)
        currents = {}
        for c in order:
            units = self.volts_of(c, targets[c])
            if units > self.vmax[c]:
                raise CommandError(E_OVER_VOLTAGE, c)
            cur = self._predicted_current(c, units)
            if cur > self.imax[c]:
                raise CommandError(E_OVER_CURRENT, c)
            currents[c] = cur
        # Board-wide power budget over the whole chain; (1e-4 V)(1e-4 mA) = 1e-11 W.
        budget = self.pmax_mw * W11_PER_MW
        before = self._measured_power()
        total = before
        for c in order:
            if self.codes[c]:
                total -= self.volts_of(c, self.codes[c]) * self.hal.read_current(c)
            total += self.volts_of(c, targets[c]) * currents[c]
        if total > budget and total > before:
            raise CommandError(E_POWER, order[0])
        previous = {}
        refused = None
        for c in order:
            previous[c] = self.codes[c]
            if self._output(c, targets[c]) > self.imax[c] and refused is None:
                refused = CommandError(E_OVER_CURRENT, c)
        if refused is None:
            after = self._measured_power()
            if after > budget and after > before:
                refused = CommandError(E_POWER, order[0])
        if refused is not None:
            for c in order:
                self._output(c, previous[c])
            raise refused  # a channel in a watchdog ramp stays in it
        for c in order:
            self.watchdog.release(c)

    @staticmethod
    def _number(value, c):
        """Parse a value sent for channel c; a malformed one is E11 on that channel."""
        try:
            return parse_fixed(value)
        except ValueError:
            raise CommandError(E_BAD_PARAMETER, c % 100) from None

    def _volts_target(self, c, value):
        units = self._number(value, c)
        if units < 0:
            raise CommandError(E_BAD_PARAMETER, c % 100)
        if units > self.vmax[c]:
            raise CommandError(E_OVER_VOLTAGE, c % 100)
        return self._code_at_most(c, units)

    # ---- command handlers: (self, ch, value) -> reply text -------------------------------

    def cmd_set_v(self, ch, value):
        c = self._channel(ch)
        self._check_and_set({c: self._volts_target(c, value)})
        return "OK\n"

    def cmd_get_v(self, ch, value):
        c = self._channel(ch)
        return format_fixed(self.volts_of(c, self.codes[c]), "V") + "\n"

    def cmd_set_i(self, ch, value):
        c = self._channel(ch)
        target = self._number(value, c)
        if target < 0:
            raise CommandError(E_BAD_PARAMETER, c % 100)
        if target > self.imax[c]:
            raise CommandError(E_OVER_CURRENT, c % 100)
        if target == 0:
            self._check_and_set({c: 0})
            return "OK\n"
        if self.load[c] is None:
            self._probe(c)
        if self.load[c] is None:
            raise CommandError(E_FORBIDDEN, c % 100)  # open circuit: no voltage gives a current
        v, i = self.load[c]
        if (target * v + i // 2) // i > self.vmax[c]:
            raise CommandError(E_OVER_VOLTAGE, c % 100)
        # First step: aim a little low (one ADC step more current than measured), so that a
        # coarse measurement at the probe voltage never makes the output overshoot.
        lsb = (self.ifull[c] + CODE_FULL - 1) // CODE_FULL
        self._check_and_set({c: self._code_for_current(c, target, lsb)})
        # Second step: the measurement at the new voltage is finer; aim at the target itself.
        try:
            code = self._code_for_current(c, target, 0)
            if code != self.codes[c]:
                self._check_and_set({c: code})
        except CommandError:
            pass  # the first step stands: within every limit, a hair below the target
        return "OK\n"

    def _code_for_current(self, c, target, margin):
        """The code that draws `target` by the last measurement (its current + margin),
        never above VMAX nor predicted above IMAX."""
        v, i = self.load[c]
        i += margin
        code = self._code_at_most(c, (target * v + i // 2) // i)
        for _ in range(3):
            if code == 0 or self._predicted_current(c, self.volts_of(c, code)) <= self.imax[c]:
                break
            code -= 1
        return code

    def cmd_get_i(self, ch, value):
        c = self._channel(ch)
        current = self.hal.read_current(c) if self.codes[c] else 0
        return format_fixed(current, "mA") + "\n"

    def cmd_set_vmax(self, ch, value):
        c = self._channel(ch)
        units = self._number(value, c)
        if units < 0 or units > self.vfull[c]:
            raise CommandError(E_BAD_PARAMETER, c % 100)
        if self.volts_of(c, self.codes[c]) > units:
            raise CommandError(E_FORBIDDEN, c % 100)  # lower the output first
        self.vmax[c] = units
        return "OK\n"

    def cmd_get_vmax(self, ch, value):
        c = self._channel(ch)
        return format_fixed(self.vmax[c], "V") + "\n"

    def cmd_set_imax(self, ch, value):
        c = self._channel(ch)
        units = self._number(value, c)
        if units < 0 or units > self.ifull[c]:
            raise CommandError(E_BAD_PARAMETER, c % 100)
        if self.codes[c] and self.hal.read_current(c) > units:
            raise CommandError(E_FORBIDDEN, c % 100)
        self.imax[c] = units
        return "OK\n"

    def cmd_get_imax(self, ch, value):
        c = self._channel(ch)
        return format_fixed(self.imax[c], "mA") + "\n"

    def cmd_vall(self, ch, value):
        self._no_channel(ch)
        lines = []
        for c in range(self.n):
            lines.append(format_fixed(self.volts_of(c, self.codes[c]), "V") + "\n")
        return "".join(lines)

    def cmd_iall(self, ch, value):
        self._no_channel(ch)
        lines = []
        for c in range(self.n):
            current = self.hal.read_current(c) if self.codes[c] else 0
            lines.append(format_fixed(current, "mA") + "\n")
        return "".join(lines)

    def cmd_vmaxall(self, ch, value):
        self._no_channel(ch)
        return "".join([format_fixed(v, "V") + "\n" for v in self.vmax])

    def cmd_imaxall(self, ch, value):
        self._no_channel(ch)
        return "".join([format_fixed(i, "mA") + "\n" for i in self.imax])

    def cmd_vvec(self, ch, value):
        first = self._channel(0 if ch is None else ch)
        items = value.split(",")
        if first + len(items) > self.n:
            raise CommandError(E_BAD_CHANNEL, (first + len(items) - 1) % 100)
        targets = {}
        for k in range(len(items)):
            c = first + k
            targets[c] = self._volts_target(c, items[k])
        self._check_and_set(targets)
        return "OK\n"

    def cmd_set_vhex(self, ch, value):
        first = self._channel(0 if ch is None else ch)
        if not value or len(value) % 4:
            raise CommandError(E_BAD_PARAMETER, first % 100)
        count = len(value) // 4
        if first + count > self.n:
            raise CommandError(E_BAD_CHANNEL, (first + count - 1) % 100)
        targets = {}
        for k in range(count):
            word = value[4 * k:4 * k + 4]
            for h in word:
                if h not in "0123456789abcdef":
                    raise CommandError(E_BAD_PARAMETER, (first + k) % 100)
            targets[first + k] = int(word, 16)
        self._check_and_set(targets)
        return "OK\n"

    def cmd_get_vhex(self, ch, value):
        self._no_channel(ch)
        return "".join([f"{code:04X}" for code in self.codes]) + "\n"

    def cmd_id(self, ch, value):
        self._no_channel(ch)
        return self.modules[0].ident() + "\n"

    def cmd_set_nup(self, ch, value):
        self._no_channel(ch)
        if parse_fixed(value) != 0:
            raise CommandError(E_BAD_PARAMETER, 0)
        return "OK\n"

    def cmd_nupall(self, ch, value):
        self._no_channel(ch)
        return "".join([f"{m.ident()} : {k}\n" for k, m in enumerate(self.modules)])

    def cmd_nchan(self, ch, value):
        self._no_channel(ch)
        return f"{self.n}\n"

    def cmd_vfull(self, ch, value):
        return format_fixed(self.modules[0].vfull, "V") + "\n"

    def cmd_ifull(self, ch, value):
        return format_fixed(self.modules[0].ifull, "mA") + "\n"

    def cmd_firmware(self, ch, value):
        self._no_channel(ch)
        return f"v{FIRMWARE_VERSION}\n"

    def cmd_help(self, ch, value):
        return "".join([line + "\n" for line in HELP_TEXT])

    def cmd_set_wdt(self, ch, value):
        self._no_channel(ch)
        ms = parse_fixed(value)
        if ms % UNITS:
            raise CommandError(E_BAD_PARAMETER, 0)
        ms //= UNITS
        if ms != 0 and (ms < WDT_MIN_MS or ms > WDT_MAX_MS):
            raise CommandError(E_BAD_PARAMETER, 0)
        self.watchdog.arm(ms, self.hal.ticks_ms())
        return "OK\n"

    def cmd_get_wdt(self, ch, value):
        self._no_channel(ch)
        return f"{self.watchdog.ms}\n"

    def cmd_set_pmax(self, ch, value):
        self._no_channel(ch)
        units = parse_fixed(value)
        if units <= 0 or units % UNITS:
            raise CommandError(E_BAD_PARAMETER, 0)
        if self._measured_power() > (units // UNITS) * W11_PER_MW:
            raise CommandError(E_FORBIDDEN, 0)  # lower the outputs first
        self.pmax_mw = units // UNITS
        return "OK\n"

    def cmd_get_pmax(self, ch, value):
        self._no_channel(ch)
        return format_fixed(self.pmax_mw * UNITS, "mW") + "\n"

    def cmd_ptot(self, ch, value):
        self._no_channel(ch)
        return format_fixed((self._measured_power() + 5000) // 10000, "mW") + "\n"  # 1e-4 mW

    # ---- monitor photodiodes (our extension) ------------------------------------------------

    def _photocurrent(self, c):
        reader = getattr(self.hal, "read_photocurrent", None)
        value = reader(c) if reader is not None else None
        if value is None:
            raise CommandError(E_FORBIDDEN, c % 100)  # this board has no photodiode inputs
        return value

    def cmd_get_pd(self, ch, value):
        c = self._channel(ch)
        return format_fixed(self._photocurrent(c), "uA") + "\n"

    def cmd_pdall(self, ch, value):
        self._no_channel(ch)
        return "".join([format_fixed(self._photocurrent(c), "uA") + "\n" for c in range(self.n)])

    COMMANDS = {
        ("v", "="): cmd_set_v,
        ("v", "?"): cmd_get_v,
        ("i", "="): cmd_set_i,
        ("i", "?"): cmd_get_i,
        ("vmax", "="): cmd_set_vmax,
        ("vmax", "?"): cmd_get_vmax,
        ("imax", "="): cmd_set_imax,
        ("imax", "?"): cmd_get_imax,
        ("vall", "?"): cmd_vall,
        ("iall", "?"): cmd_iall,
        ("vmaxall", "?"): cmd_vmaxall,
        ("imaxall", "?"): cmd_imaxall,
        ("vvec", "="): cmd_vvec,
        ("vhex", "="): cmd_set_vhex,
        ("vhex", "?"): cmd_get_vhex,
        ("id", "?"): cmd_id,
        ("nup", "="): cmd_set_nup,
        ("nup", "?"): cmd_nupall,
        ("nupall", "?"): cmd_nupall,
        ("nchan", "?"): cmd_nchan,
        ("vfull", "?"): cmd_vfull,
        ("ifull", "?"): cmd_ifull,
        ("firmware", "?"): cmd_firmware,
        ("help", "?"): cmd_help,
        ("wdt", "="): cmd_set_wdt,
        ("wdt", "?"): cmd_get_wdt,
        ("pmax", "="): cmd_set_pmax,
        ("pmax", "?"): cmd_get_pmax,
        ("ptot", "?"): cmd_ptot,
        ("pd", "?"): cmd_get_pd,
        ("pdall", "?"): cmd_pdall,
    }
