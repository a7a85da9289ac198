"""HAL for running the firmware core off the board: heaters modelled as resistors.

The emulator (emulator) builds this with seeded heater resistances and a clock, and
listens to the outputs through `on_write` (the chip's heaters hear the board). The current
readback passes through a 16-bit ADC over the module's current full scale, like the board's.
"""

ADC_FULL = 65535
PD_FULL = 10000000  # photodiode input full scale, 1000 uA in 1e-4 uA (a 24-bit ADC behind a TIA)


class EmulatedHAL:
    def __init__(self, vfull, ifull, resistances_ohm, clock_ms, on_write=None, photocurrent=None):
        """vfull, ifull: per channel full scales in 1e-4 V and 1e-4 mA; clock_ms() -> int.

        photocurrent(ch) -> amperes: the light on the monitor photodiode beside heater channel
        ch (None: the board has no photodiode inputs).
        """
        self.photocurrent = photocurrent
        self.vfull = list(vfull)
        self.ifull = list(ifull)
        self.resistance = list(resistances_ohm)  # None or 0 means open circuit
        self.codes = [0] * len(self.vfull)
        # the last reading per channel with the code and resistance it was read at: the board
        # reads every live channel's current around each set (its power budget)
        self._read = [None] * len(self.vfull)
        self.clock_ms = clock_ms
        self.on_write = on_write

    def write(self, ch, code):
        self.codes[ch] = code
        if self.on_write is not None:
            self.on_write(ch, self.volts(ch))

    def volts(self, ch):
        """The output voltage of channel ch, in volts (for the physics)."""
        return self.codes[ch] * self.vfull[ch] / ADC_FULL / 10000.0

    def read_current(self, ch):
        r = self.resistance[ch]
        if not r:
            return 0
        code = self.codes[ch]
        last = self._read[ch]
        if last is not None and last[0] == code and last[1] == r:
            return last[2]
        units = code * self.vfull[ch] * 1000.0 / ADC_FULL / r  # 1e-4 mA
        full = self.ifull[ch]
        adc = int(units * ADC_FULL / full + 0.5)
        if adc > ADC_FULL:
            adc = ADC_FULL
        got = (adc * full + ADC_FULL // 2) // ADC_FULL
        self._read[ch] = (code, r, got)
        return got

    def read_photocurrent(self, ch):
        if self.photocurrent is None:
            return None
        units = int(self.photocurrent(ch) * 1e10 + 0.5)  # A -> 1e-4 uA
        if units < 0:
            return 0
        if units > PD_FULL:
            return PD_FULL
        return units

    def ticks_ms(self):
        return self.clock_ms()
