"""The exact bytes our heater DAC driver sends and how it reads the replies (no hardware).

In the manner of PyMeasure's expected_protocol: a scripted serial port asserts every line
written and answers with the scripted reply.
"""
from __future__ import annotations

import pytest

from photonic_testbed.drivers.heater_dac import (
    DACTimeout,
    HeaterDAC,
    OverCurrent,
    OverVoltage,
    ProtocolError,
    UnknownCommand,
)

ONE_MODULE_OPEN = [
    (b"id?\n", b"Q8iv-0001\n"),
    (b"nup=0\n", b"OK\n"),
    (b"nchan?\n", b"8\n"),
    (b"nupall?\n", b"Q8iv-0001 : 0\n"),
    (b"vfull?\n", b"+12.0000 V\n"),
    (b"ifull?\n", b"+24.0000 mA\n"),
    (b"firmware?\n", b"v0.1.0\n"),
    (b"vhex?\n", b"0000" * 8 + b"\n"),
]


class ScriptedSerial:
    """A serial port that expects exact writes and answers each with a scripted reply."""

    def __init__(self, exchanges, unsolicited=b""):
        self.exchanges = list(exchanges)
        self.rx = bytearray(unsolicited)
        self.timeout = None
        self.closed = False

    def write(self, data):
        assert self.exchanges, f"driver sent {data!r} after the script ended"
        expected, reply = self.exchanges.pop(0)
        assert data == expected, f"driver sent {data!r}, the script expects {expected!r}"
        self.rx += reply
        return len(data)

    @property
    def in_waiting(self):
        return len(self.rx)

    def read(self, size=1):
        chunk = bytes(self.rx[:size])
        del self.rx[:size]
        return chunk

    def close(self):
        self.closed = True


def scripted(exchanges, unsolicited=b"", timeout=0.05):
    port = ScriptedSerial(exchanges, unsolicited)
    dac = HeaterDAC("scripted", timeout=timeout, open_serial=lambda name, t: port)
    return dac, port


def test_open_sends_the_discovery_sequence_and_reads_the_chain():
    dac, port = scripted(ONE_MODULE_OPEN)
    info = dac.open()
    assert port.exchanges == []
    assert info.ident == "Q8iv-0001" and info.firmware == "v0.1.0"
    assert info.channels == 8 and info.vfull == 12.0 and info.ifull == 24.0 and info.compact
    assert [(m.ident, m.index, m.first_channel, m.channels) for m in info.modules] == [
        ("Q8iv-0001", 0, 0, 8)]


def test_open_discards_a_power_up_notice_left_in_the_buffer():
    dac, port = scripted(ONE_MODULE_OPEN, unsolicited=b"E90:00\n")
    dac.open()
    assert port.exchanges == []


def test_changed_channels_go_in_one_hex_line_per_run():
    dac, port = scripted(ONE_MODULE_OPEN + [
        # channels 0 and 2 changed: the gap of one channel is resent, not a second line
        (b"vhex0=088900001111\n", b"OK\n"),
        # channel 7 alone
        (b"vhex7=FFFF\n", b"OK\n"),
    ])
    dac.open()
    assert dac.set_voltages({0: 0.4, 2: 0.8}) == 1
    assert dac.set_voltages({7: 12.0}) == 1
    assert port.exchanges == []


def test_unchanged_values_send_nothing():
    dac, port = scripted(ONE_MODULE_OPEN + [(b"vhex1=2AAB\n", b"OK\n")])
    dac.open()
    dac.set_voltage(1, 2.0)
    assert dac.set_voltages({0: 0.0, 1: 2.0}) == 0  # both already there
    assert port.exchanges == []


def test_far_apart_channels_make_separate_lines():
    dac, port = scripted(ONE_MODULE_OPEN + [(b"vhex0=1555\nvhex6=1555\n", b"OK\nOK\n")])
    dac.open()
    assert dac.set_voltages({0: 1.0, 6: 1.0}) == 2          # two lines, in one write
    assert dac.commanded[0] == dac.commanded[6] == 1.0


def test_a_refused_line_among_several_leaves_the_others_known_and_the_link_in_step():
    dac, port = scripted(ONE_MODULE_OPEN + [
        (b"vhex0=D555\nvhex6=1555\n", b"E01:00\nOK\n"),
        (b"v5?\n", b"+0.0000 V\n"),
    ])
    dac.open()
    with pytest.raises(OverVoltage) as e:
        dac.set_voltages({0: 10.0, 6: 1.0})
    assert e.value.channel == 0
    assert dac.commanded[6] == 1.0 and dac.commanded[0] == 0.0
    assert dac.voltage(5) == 0.0            # the next reply read is the next command's


def test_a_refusal_raises_with_code_and_channel_and_is_not_remembered():
    dac, port = scripted(ONE_MODULE_OPEN + [
        (b"vmax3=2.0000\n", b"OK\n"),
        (b"vhex3=3555\n", b"E01:03\n"),
        (b"vhex3=3555\n", b"E02:03\n"),
    ])
    dac.open()
    dac.set_vmax(3, 2.0)
    with pytest.raises(OverVoltage) as e:
        dac.set_voltage(3, 2.5)
    assert (e.value.code, e.value.channel, e.value.command) == (1, 3, "vhex3=3555")
    assert dac.commanded[3] == 0.0
    # the refused value was not taken as the board's state: asking again sends it again
    with pytest.raises(OverCurrent):
        dac.set_voltage(3, 2.5)
    assert port.exchanges == []


def test_out_of_range_values_are_refused_before_anything_is_sent():
    dac, port = scripted(ONE_MODULE_OPEN)
    dac.open()
    with pytest.raises(ValueError, match="outside the board's 0..12 V range"):
        dac.set_voltage(0, 12.5)
    with pytest.raises(ValueError, match="channel 8 does not exist"):
        dac.set_voltage(8, 1.0)
    with pytest.raises(ValueError):
        dac.set_voltage(0, -0.1)


def test_queries_parse_values_with_units():
    dac, port = scripted(ONE_MODULE_OPEN + [
        (b"i2?\n", b"+1.2345 mA\n"),
        (b"v2?\n", b"+0.0000 V\n"),
        (b"iall?\n", b"+0.0000 mA\n" * 7 + b"+2.0000 mA\n"),
        (b"ptot?\n", b"+12.5000 mW\n"),
        (b"wdt=250\n", b"OK\n"),
    ])
    dac.open()
    assert dac.current(2) == 1.2345
    assert dac.voltage(2) == 0.0
    assert dac.currents() == [0.0] * 7 + [2.0]
    assert dac.total_power() == 12.5
    dac.set_watchdog(250)
    assert port.exchanges == []


def test_a_reply_in_the_wrong_unit_is_a_protocol_error():
    dac, port = scripted(ONE_MODULE_OPEN + [(b"i2?\n", b"+1.2345 V\n")])
    dac.open()
    with pytest.raises(ProtocolError, match="expected a value in mA"):
        dac.current(2)


def test_silence_is_a_timeout_not_a_hang():
    dac, port = scripted(ONE_MODULE_OPEN + [(b"v1?\n", b"")])
    dac.open()
    with pytest.raises(DACTimeout, match="no answer to 'v1\\?'"):
        dac.voltage(1)


def test_unknown_error_codes_still_raise_typed():
    dac, port = scripted(ONE_MODULE_OPEN + [(b"ptot?\n", b"E10:00\n")])
    dac.open()
    with pytest.raises(UnknownCommand):
        dac.total_power()


def test_power_up_notice_mid_session_restores_outputs():
    dac, port = scripted(ONE_MODULE_OPEN + [
        (b"vhex0=1555\n", b"OK\n"),
        (b"v0?\n", b"E90:00\n+0.0000 V\n"),      # the board reset under us
        # restore: read back, then resend what was commanded
        (b"vhex?\n", b"0000" * 8 + b"\n"),
        (b"vhex0=1555\n", b"OK\n"),
    ])
    dac.open()
    dac.set_voltage(0, 1.0)
    assert dac.voltage(0) == 0.0
    assert port.exchanges == []


def test_stock_qontrol_board_gets_one_vvec_line_per_module():
    two_modules = [
        (b"id?\n", b"Q8iv-00A1\n"),
        (b"nup=0\n", b"OK\n"),
        (b"nchan?\n", b"16\n"),
        (b"nupall?\n", b"Q8iv-00A1 : 0\nQ8iv-00A2 : 1\n"),
        (b"vfull?\n", b"+12.0000 V\n"),
        (b"ifull?\n", b"+24.0000 mA\n"),
        (b"firmware?\n", b"v2.4.1\n"),
        (b"vhex?\n", b"E10:00\n"),
        (b"vall?\n", b"+0.0000 V\n" * 16),
        (b"vvec8=0.0000,1.5000,0.0000,0.0000,0.0000,0.0000,0.0000,0.0000\n", b"OK\n"),
    ]
    dac, port = scripted(two_modules)
    info = dac.open()
    assert not info.compact and info.channels == 16
    assert dac.set_voltages({9: 1.5}) == 1
    assert port.exchanges == []


class LateSerial(ScriptedSerial):
    """Answers the first write's lines only after the driver gave up on them."""

    def __init__(self, exchanges):
        super().__init__(exchanges)
        self.held = bytearray()
        self.late = b""

    def write(self, data):
        n = super().write(data)
        if self.held is not None and data.startswith(b"vhex0="):
            self.held, self.rx = None, bytearray()      # this write's replies come late
            self.late = b"OK\nE01:06\n"
        elif data == b"nchan?\n":
            self.rx = bytearray(self.late) + self.rx      # the late replies, then the answer
        return n


def test_after_a_timeout_late_replies_are_dropped_and_the_outputs_read_back():
    port = LateSerial(ONE_MODULE_OPEN + [
        (b"vhex0=1555\nvhex6=D555\n", b"(late)"),
        (b"nchan?\n", b"8\n"),
        (b"vhex?\n", b"1555" + b"0000" * 7 + b"\n"),      # the first line was applied
        (b"vhex3=1555\n", b"OK\n"),
    ])
    dac = HeaterDAC("scripted", timeout=0.05, open_serial=lambda name, t: port)
    dac.open()
    with pytest.raises(DACTimeout):
        dac.set_voltages({0: 1.0, 6: 10.0})
    # the next command finds the link in step: the stale OK and E01 are not its replies
    assert dac.set_voltages({0: 1.0, 3: 1.0}) == 1          # channel 0 is known to be set
    assert dac.commanded[0] == dac.commanded[3] == 1.0 and not port.exchanges
