"""Driver for a Keysight N7776C-style tunable laser source (SCPI over pyvisa).

Power is set with an explicit unit on the wire (`:SOUR0:POW 1.000000MW` or `... 0.000DBM`) and
read back in whichever unit the laser answers in (`:SOUR0:POW:UNIT?`, 0 = dBm, 1 = W), which the
driver asks once and remembers, so a caller never guesses a unit.
"""
from __future__ import annotations

from photonic_testbed.drivers.power_meter import dbm_to_mw, mw_to_dbm
from photonic_testbed.drivers.scpi import SCPIInstrument


class Laser(SCPIInstrument):
    """An N7776C-style laser on `TCPIP::host::port::SOCKET` (source 0)."""

    def __init__(self, resource: str, **kwargs):
        super().__init__(resource, **kwargs)
        self._unit: int | None = None

    def _on_reconnect(self) -> None:
        self._unit = None

    def set_wavelength_nm(self, nm: float) -> None:
        self.command(f":SOUR0:WAV {nm:.4f}NM")

    def wavelength_nm(self) -> float:
        return self.query_float(":SOUR0:WAV?", "wavelength") * 1e9

    def set_power_mw(self, mw: float) -> None:
        if mw <= 0:
            raise ValueError(f"laser power must be positive, not {mw} mW (turn it off instead)")
        self.command(f":SOUR0:POW {mw:.6f}MW")

    def set_power_dbm(self, dbm: float) -> None:
        self.command(f":SOUR0:POW {dbm:.3f}DBM")

    def _unit_code(self) -> int:
        if self._unit is None:
            self._unit = self.query_power_unit(":SOUR0:POW:UNIT?")
        return self._unit

    def power_mw(self) -> float:
        unit = self._unit_code()
        value = self.query_float(":SOUR0:POW?", "power")
        return dbm_to_mw(value) if unit == 0 else value * 1e3

    def power_dbm(self) -> float:
        return mw_to_dbm(self.power_mw())

    def set_output(self, on: bool) -> None:
        self.command(f":SOUR0:POW:STAT {1 if on else 0}")

    def on(self) -> None:
        self.set_output(True)

    def off(self) -> None:
        self.set_output(False)

    def is_on(self) -> bool:
        return bool(int(self.query_float(":SOUR0:POW:STAT?", "output state")))

    def describe(self) -> dict:
        return {"kind": "laser", "identity": self.identity, "resource": self.resource_name}
