"""Keysight-style optical test instruments, emulated: an N774x power meter and an N7776C laser.

The power meter reads the light that reaches each of its channels from a callable the rig gives
it (the optics), adds a noise floor near -70 dBm and ~0.1 % relative noise (seeded), and honours
the averaging time as a delay. The laser's output (mW when on, 0 when off) is what the optics
reads. Both speak SCPI on a loopback socket through `emulator.scpi_server`; see docs/instruments.md.
"""
from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from photonic_testbed.emulator.scpi import Instrument, SCPIError, Waiting, boolean, no_arg, number

log = logging.getLogger(__name__)

WAVELENGTH_UNITS = {"M": 1.0, "MM": 1e-3, "UM": 1e-6, "NM": 1e-9, "PM": 1e-12}
TIME_UNITS = {"S": 1.0, "MS": 1e-3, "US": 1e-6}
POWER_UNITS = {"0": 0, "DBM": 0, "1": 1, "W": 1, "WATT": 1}   # `...:POW:UNIT` codes: 0 dBm, 1 W
NOISE_FLOOR_MW = 1e-7          # -70 dBm
RELATIVE_NOISE = 1e-3          # 0.1 %
MAX_ATIM_S = 10.0
WAVELENGTH_RANGE_M = (1.25e-6, 1.65e-6)


def _sci(x: float) -> str:
    """Keysight's number format: `+1.55000000E-006` (three exponent digits)."""
    mantissa, _, exp = f"{x:+.8E}".partition("E")
    return f"{mantissa}E{int(exp):+04d}"


def _dbm_to_mw(dbm: float) -> float:
    if not -100.0 <= dbm <= 100.0:
        raise SCPIError(-222, f"{dbm:g} dBm is out of range")
    return 10 ** (dbm / 10)


def mw_to_dbm(mw: float) -> float:
    return 10 * math.log10(mw) if mw > 0 else -200.0


def power_unit(arg: str) -> int:
    """The unit code a `...:POW:UNIT` setting names (the meter's and the laser's alike)."""
    a = arg.strip().upper()
    if a not in POWER_UNITS:
        raise SCPIError(-224 if a else -109, f"unit must be 0|DBM or 1|W, not {arg[:20]!r}")
    return POWER_UNITS[a]


@dataclass
class MeterChannel:
    wavelength_m: float = 1550e-9
    atim_s: float = 0.1
    unit: int = 0                 # 0 dBm, 1 W
    range_dbm: float = 10.0
    auto_range: bool = True
    last_mw: float | None = None


class PowerMeterInstrument(Instrument):
    """N774x-style multi-port power meter. Port n (1..channels) is `:READn:CHAN1:POW?`."""

    no_error = '+0,"No error"'

    def __init__(self, light: Callable[[int], float], channels: int = 4, seed: int = 0,
                 serial: str = "MY00000001"):
        super().__init__()
        self.idn = f"Keysight Technologies (emulated),N7744A,{serial},1.0.0"
        self.light = light
        self.channels = channels
        self._rng = np.random.default_rng([seed, 0x7744])
        self._rng_lock = threading.Lock()
        self.ch = [MeterChannel() for _ in range(channels)]
        self.readings = 0
        self.command(":READ#[:CHANnel#][:SCALar]:POWer[:DC]?", self._read, locked=False)
        self.command(":FETCh#[:CHANnel#][:SCALar]:POWer[:DC]?", self._fetch)
        self.command(":SENSe#[:CHANnel#]:POWer:WAVelength", self._set_wav)
        self.command(":SENSe#[:CHANnel#]:POWer:WAVelength?",
                     lambda s, x, a: _sci(self._chan(x).wavelength_m))
        self.command(":SENSe#[:CHANnel#]:POWer:ATIMe", self._set_atim)
        self.command(":SENSe#[:CHANnel#]:POWer:ATIMe?", lambda s, x, a: _sci(self._chan(x).atim_s))
        self.command(":SENSe#[:CHANnel#]:POWer:UNIT", self._set_unit)
        self.command(":SENSe#[:CHANnel#]:POWer:UNIT?", lambda s, x, a: f"+{self._chan(x).unit}")
        self.command(":SENSe#[:CHANnel#]:POWer:RANGe[:UPPer]", self._set_range)
        self.command(":SENSe#[:CHANnel#]:POWer:RANGe[:UPPer]?",
                     lambda s, x, a: _sci(self._chan(x).range_dbm))
        self.command(":SENSe#[:CHANnel#]:POWer:RANGe:AUTO", self._set_auto)
        self.command(":SENSe#[:CHANnel#]:POWer:RANGe:AUTO?",
                     lambda s, x, a: f"+{int(self._chan(x).auto_range)}")

    def reset(self) -> None:
        self.ch = [MeterChannel() for _ in range(self.channels)]

    def _chan(self, sfx: tuple) -> MeterChannel:
        n, m = (sfx + (None, None))[:2]
        n = 1 if n is None else n
        if not 1 <= n <= self.channels or m not in (None, 1):
            raise SCPIError(-114, f"no channel {n}:{m} (ports 1..{self.channels}, channel 1)")
        return self.ch[n - 1]

    def measure(self, index: int) -> float:
        """One reading of port `index` (1-based), mW, with the detector's noise."""
        true_mw = max(0.0, float(self.light(index)))
        with self._rng_lock:
            rel, floor = self._rng.normal(0.0, 1.0, 2)
        mw = true_mw * (1 + RELATIVE_NOISE * rel) + NOISE_FLOOR_MW * abs(1 + 0.3 * floor)
        self.readings += 1
        return mw

    def _format(self, c: MeterChannel, mw: float) -> str:
        return _sci(mw_to_dbm(mw)) if c.unit == 0 else _sci(mw * 1e-3)

    def _read(self, session, sfx, arg) -> Waiting:
        no_arg(arg)
        with self.lock:
            c = self._chan(sfx)
            atim = c.atim_s
        if atim > 0:
            yield time.monotonic() + atim       # averaging: the reading takes this long
        n = sfx[0] or 1
        with self.lock:
            c.last_mw = self.measure(n)
            return self._format(c, c.last_mw)

    def _fetch(self, session, sfx, arg) -> str:
        no_arg(arg)
        c = self._chan(sfx)
        if c.last_mw is None:
            c.last_mw = self.measure(sfx[0] or 1)
        return self._format(c, c.last_mw)

    def _set_wav(self, session, sfx, arg) -> None:
        c = self._chan(sfx)
        w = number(arg, WAVELENGTH_UNITS)
        if not WAVELENGTH_RANGE_M[0] <= w <= WAVELENGTH_RANGE_M[1]:
            raise SCPIError(-222, f"wavelength {w:g} m is outside 1250..1650 nm")
        c.wavelength_m = w

    def _set_atim(self, session, sfx, arg) -> None:
        c = self._chan(sfx)
        t = number(arg, TIME_UNITS)
        if not 0 <= t <= MAX_ATIM_S:
            raise SCPIError(-222, f"averaging time {t:g} s is outside 0..{MAX_ATIM_S:g} s")
        c.atim_s = t

    def _set_unit(self, session, sfx, arg) -> None:
        self._chan(sfx).unit = power_unit(arg)

    def _set_range(self, session, sfx, arg) -> None:
        c = self._chan(sfx)
        r = number(arg, {"DBM": 1.0})
        if not -30 <= r <= 10:
            raise SCPIError(-222, f"range {r:g} dBm is outside -30..+10 dBm")
        c.range_dbm = r
        c.auto_range = False

    def _set_auto(self, session, sfx, arg) -> None:
        self._chan(sfx).auto_range = boolean(arg)


@dataclass
class LaserState:
    wavelength_m: float = 1550e-9
    power_mw: float = 1.0
    unit: int = 0              # what :SOUR0:POW? answers in: 0 dBm, 1 W
    on: bool = False


class LaserInstrument(Instrument):
    """N7776C-style tunable laser source, `:SOURce0:...`."""

    no_error = '+0,"No error"'
    MIN_MW = 0.01              # -20 dBm
    MAX_MW = 20.0              # +13 dBm

    def __init__(self, serial: str = "DE00000001"):
        super().__init__()
        self.idn = f"Keysight Technologies (emulated),N7776C,{serial},1.0.0"
        self.state = LaserState()
        self.command(":SOURce#:WAVelength", self._set_wav)
        self.command(":SOURce#:WAVelength?", lambda s, x, a: _sci(self._src(x).wavelength_m))
        self.command(":SOURce#:POWer[:LEVel][:IMMediate][:AMPLitude]", self._set_pow)
        self.command(":SOURce#:POWer[:LEVel][:IMMediate][:AMPLitude]?", self._get_pow)
        self.command(":SOURce#:POWer:UNIT", self._set_unit)
        self.command(":SOURce#:POWer:UNIT?", lambda s, x, a: f"+{self._src(x).unit}")
        self.command(":SOURce#:POWer:STATe", self._set_state)
        self.command(":SOURce#:POWer:STATe?", lambda s, x, a: f"+{int(self._src(x).on)}")

    def output_mw(self) -> float:
        """What leaves the fibre: the set power when on, nothing when off."""
        s = self.state
        return s.power_mw if s.on else 0.0

    def reset(self) -> None:
        self.state = LaserState()

    def _src(self, sfx: tuple) -> LaserState:
        if sfx[0] not in (None, 0):
            raise SCPIError(-114, f"no source {sfx[0]} (this laser is source 0)")
        return self.state

    def _set_wav(self, session, sfx, arg) -> None:
        s = self._src(sfx)
        w = number(arg, WAVELENGTH_UNITS)
        if not 1.48e-6 <= w <= 1.64e-6:
            raise SCPIError(-222, f"wavelength {w:g} m is outside 1480..1640 nm")
        s.wavelength_m = w

    def _set_pow(self, session, sfx, arg) -> None:
        s = self._src(sfx)
        a = arg.strip().upper()
        units = {"MW": 1.0, "UW": 1e-3, "NW": 1e-6, "W": 1e3}
        if a.endswith("DBM"):
            mw = _dbm_to_mw(number(a[:-3]))
        elif a[-1:].isalpha():
            mw = number(a, units)
        elif s.unit == 0:
            mw = _dbm_to_mw(number(a))         # a bare number is in the chosen unit: dBm
        else:
            mw = number(a) * 1e3                # ... or watts
        if not self.MIN_MW * 0.999 <= mw <= self.MAX_MW * 1.001:
            raise SCPIError(-222, f"power {mw:g} mW is outside {self.MIN_MW:g}..{self.MAX_MW:g} mW")
        s.power_mw = mw

    def _get_pow(self, session, sfx, arg) -> str:
        no_arg(arg)
        s = self._src(sfx)
        return _sci(mw_to_dbm(s.power_mw)) if s.unit == 0 else _sci(s.power_mw * 1e-3)

    def _set_unit(self, session, sfx, arg) -> None:
        self._src(sfx).unit = power_unit(arg)

    def _set_state(self, session, sfx, arg) -> None:
        self._src(sfx).on = boolean(arg)
