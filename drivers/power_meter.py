"""Driver for a Keysight N774x-style multi-port optical power meter (SCPI over pyvisa).

Ports are numbered 1..P as on the front panel (`:READn:CHAN1:POW?` on an N7744A). Readings come
back as `PowerReading` in both mW and dBm: the driver asks the meter which unit each port
answers in (`:SENSn:CHAN1:POW:UNIT?`, 0 = dBm, 1 = W) once, remembers it, and converts, so the
caller never guesses a unit. Settings are confirmed in the same round trip (see drivers.scpi).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from photonic_testbed.drivers.scpi import SCPIInstrument, reply_float

NO_LIGHT_DBM = -200.0


def dbm_to_mw(dbm: float) -> float:
    return 10 ** (dbm / 10)


def mw_to_dbm(mw: float) -> float:
    return 10 * math.log10(mw) if mw > 0 else NO_LIGHT_DBM


@dataclass(frozen=True)
class PowerReading:
    port: int
    mw: float
    dbm: float


class PowerMeter(SCPIInstrument):
    """An N774x-style power meter on `TCPIP::host::port::SOCKET`."""

    def __init__(self, resource: str, *, ports: int = 4, **kwargs):
        super().__init__(resource, **kwargs)
        self.ports = ports
        self._units: dict[int, int] = {}
        self._atim: dict[int, float] = {}

    def _on_reconnect(self) -> None:
        self._units.clear()
        self._atim.clear()

    def _port(self, port: int) -> int:
        if not isinstance(port, int) or not 1 <= port <= self.ports:
            raise ValueError(f"power meter port {port!r} is not in 1..{self.ports}")
        return port

    # ---- settings ----------------------------------------------------------------------------

    def set_wavelength_nm(self, port: int, nm: float) -> None:
        self.command(f":SENS{self._port(port)}:CHAN1:POW:WAV {nm:.4f}NM")

    def wavelength_nm(self, port: int) -> float:
        return self.query_float(f":SENS{self._port(port)}:CHAN1:POW:WAV?", "wavelength") * 1e9

    def set_averaging_time(self, port: int, seconds: float) -> None:
        self.command(f":SENS{self._port(port)}:CHAN1:POW:ATIM {seconds:.6g}S")
        self._atim[port] = seconds

    def averaging_time(self, port: int) -> float:
        t = self.query_float(f":SENS{self._port(port)}:CHAN1:POW:ATIM?", "averaging time")
        self._atim[port] = t
        return t

    def set_unit(self, port: int, unit: str) -> None:
        """`"dBm"` or `"W"`: what the meter itself answers in (readings here carry both)."""
        code = {"dbm": 0, "w": 1}.get(unit.lower())
        if code is None:
            raise ValueError(f"unit must be 'dBm' or 'W', not {unit!r}")
        self.command(f":SENS{self._port(port)}:CHAN1:POW:UNIT {code}")
        self._units[port] = code

    def unit(self, port: int) -> str:
        return "W" if self._unit_code(port) else "dBm"

    def _unit_code(self, port: int) -> int:
        if port not in self._units:
            self._units[port] = self.query_power_unit(f":SENS{self._port(port)}:CHAN1:POW:UNIT?")
        return self._units[port]

    # ---- readings ----------------------------------------------------------------------------

    def _reading(self, port: int, reply: str) -> PowerReading:
        value = reply_float(reply, "power")
        if self._unit_code(port) == 0:
            return PowerReading(port, dbm_to_mw(value), value)
        mw = value * 1e3
        return PowerReading(port, mw, mw_to_dbm(mw))

    def read(self, port: int) -> PowerReading:
        """A new measurement (takes the averaging time)."""
        self._port(port)
        self._unit_code(port)            # asked before the read, so the reply is never ambiguous
        atim = self._atim.get(port)
        if atim is None:
            atim = self.averaging_time(port)
        reply = self.query(f":READ{port}:CHAN1:POW?", timeout_s=self.timeout_s + atim)
        return self._reading(port, reply)

    def fetch(self, port: int) -> PowerReading:
        """The last measurement, without measuring again."""
        self._port(port)
        self._unit_code(port)
        return self._reading(port, self.query(f":FETC{port}:CHAN1:POW?"))

    def read_all(self) -> dict[int, PowerReading]:
        return {p: self.read(p) for p in range(1, self.ports + 1)}

    def read_power(self, ports: list[int] | None = None) -> dict[int, float]:
        """New measurements in mW of the given ports (all when None)."""
        wanted = range(1, self.ports + 1) if ports is None else ports
        return {p: self.read(p).mw for p in wanted}

    def describe(self) -> dict:
        return {"kind": "power_meter", "identity": self.identity, "ports": self.ports,
                "resource": self.resource_name}
