"""HAL for the RP2040 board: an AD5370 40-channel 16-bit DAC on SPI, current sense on an ADC.

MicroPython only (`machine` does not exist on CPython); mpy-cross compiles it in the tests.
The AD5370 takes 24-bit frames: mode bits 11 (write DAC input register X1A), then a 6-bit
address (group, channel) and the 16-bit code; /LDAC pulses low to move input registers to the
outputs. Heater current is sensed through a 16:1 analog multiplexer per bank in front of an
RP2040 ADC input, scaled so that the module's full-scale current reads 65535. Boards that carry
the chip's monitor photodiodes read them through transimpedance amplifiers on further ADC
inputs, behind the same multiplexer lines, 1000 uA full scale.
"""
import time

import machine

MODE_WRITE_X = 0xC0  # M1 M0 = 11: write the X1A data register
PD_FULL = 10000000   # photodiode full scale, 1000 uA in 1e-4 uA


class BoardHAL:
    def __init__(self, ifull, spi_id=0, sck=2, mosi=3, miso=4, sync=5, ldac=6,
                 mux_pins=(10, 11, 12, 13), adc_pins=(26, 27, 28), pd_adc_pins=()):
        self.ifull = list(ifull)
        self.spi = machine.SPI(spi_id, baudrate=10000000, polarity=0, phase=1,
                               sck=machine.Pin(sck), mosi=machine.Pin(mosi),
                               miso=machine.Pin(miso))
        self.sync = machine.Pin(sync, machine.Pin.OUT, value=1)
        self.ldac = machine.Pin(ldac, machine.Pin.OUT, value=1)
        self.mux = [machine.Pin(p, machine.Pin.OUT, value=0) for p in mux_pins]
        self.adcs = [machine.ADC(machine.Pin(p)) for p in adc_pins]
        self.pd_adcs = [machine.ADC(machine.Pin(p)) for p in pd_adc_pins]
        self.frame = bytearray(3)

    def write(self, ch, code):
        group, channel = ch // 8, ch % 8
        self.frame[0] = MODE_WRITE_X | ((group + 1) << 3) | channel
        self.frame[1] = (code >> 8) & 0xFF
        self.frame[2] = code & 0xFF
        self.sync(0)
        self.spi.write(self.frame)
        self.sync(1)
        self.ldac(0)
        self.ldac(1)

    def _select(self, ch):
        line = ch % 16
        for bit in range(4):
            self.mux[bit]((line >> bit) & 1)
        # multiplexer and RC settling; sleep_us and ticks_ms are MicroPython's own: CPython's
        # `time` (whose stubs mypy reads) has neither, nor can a stub replace a stdlib module
        time.sleep_us(20)  # type: ignore[attr-defined]

    def read_current(self, ch):
        self._select(ch)
        raw = self.adcs[ch // 16].read_u16()
        return (raw * self.ifull[ch] + 32767) // 65535

    def read_photocurrent(self, ch):
        if ch // 16 >= len(self.pd_adcs):
            return None
        self._select(ch)
        raw = self.pd_adcs[ch // 16].read_u16()
        return (raw * PD_FULL + 32767) // 65535

    def ticks_ms(self):
        return time.ticks_ms()  # type: ignore[attr-defined]  # (MicroPython's: see _select)
