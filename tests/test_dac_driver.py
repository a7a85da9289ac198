"""Our heater DAC driver against the emulated board, over the real pseudo-terminal."""
from __future__ import annotations

import time

import pytest
import serial

from photonic_testbed.drivers.heater_dac import DACDisconnected, DACError, HeaterDAC, OverVoltage
from photonic_testbed.emulator.dac_board import IDLE_S, EmulatedDACBoard
from tests.timeouts import DEVICE_S


def wait_until(predicate, timeout=10.0, step=0.01):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(step)
    return predicate()


def test_identify_set_and_read_back(dac_board):
    with HeaterDAC(str(dac_board.link), timeout=DEVICE_S) as dac:
        assert dac.info.channels == 56
        assert [m.index for m in dac.info.modules] == list(range(7))
        assert dac.set_voltages([1.0] * 56) == 1
        assert dac.voltages() == pytest.approx([1.0] * 56, abs=2e-4)
        assert dac_board.outputs == pytest.approx([1.0] * 56, abs=2e-4)
        # Ohm's law through the board's current sense: I = V / R of each seeded heater.
        expected = [1000.0 / r for r in dac_board.resistances]
        assert dac.currents() == pytest.approx(expected, abs=2e-3)


def test_refused_over_voltage_leaves_the_output_alone(dac_board):
    with HeaterDAC(str(dac_board.link), timeout=DEVICE_S) as dac:
        dac.set_voltage(0, 1.0)
        dac.set_vmax(0, 2.0)
        with pytest.raises(OverVoltage) as e:
            dac.set_voltage(0, 2.5)
        assert e.value.channel == 0
        assert dac_board.outputs[0] == pytest.approx(1.0, abs=2e-4)


def test_only_changed_channels_travel(dac_board):
    with HeaterDAC(str(dac_board.link), timeout=DEVICE_S) as dac:
        dac.set_voltages([0.5] * 56)
        before = dac.bytes_sent
        assert dac.set_voltages([0.5] * 56) == 0
        assert dac.bytes_sent == before
        values = [0.5] * 56
        values[10] = 1.5
        values[40] = 1.5
        assert dac.set_voltages(values) == 2
        assert dac.bytes_sent - before == len(b"vhex10=2001\n") * 2


def test_long_runs_split_below_the_line_limit_and_scattered_lines_go_together(tmp_path):
    from photonic_testbed.drivers.heater_dac import LINE_LIMIT
    from photonic_testbed.emulator.dac_board import EmulatedDACBoard
    board = EmulatedDACBoard(tmp_path / "dac", modules=16, seed=3)     # 128 channels
    board.start()
    try:
        with HeaterDAC(str(board.link), timeout=DEVICE_S) as dac:
            assert dac.set_voltages([0.5] * 128) == 3       # 512 hex digits: three lines
            assert board.outputs == pytest.approx(dac.commanded, abs=2e-4)
            values = list(dac.commanded)
            for ch in (3, 20, 40, 77, 100, 127):
                values[ch] = 1.0
            assert dac.set_voltages(values) == 6
            assert board.outputs == pytest.approx(dac.commanded, abs=2e-4)
            assert dac.bytes_sent < 10 * (LINE_LIMIT + 1)
    finally:
        board.close()


@pytest.mark.parametrize("power_cycle", [False, True])
def test_unplug_replug_reopens_and_restores(dac_board, power_cycle):
    with HeaterDAC(str(dac_board.link), reconnect_timeout=3.0) as dac:
        dac.set_vmax(5, 3.0)
        dac.set_voltages({c: 0.1 * c for c in range(56)})
        wanted = list(dac.commanded)
        dac_board.unplug()
        dac_board.replug(power_cycle=power_cycle)
        dac.set_voltage(1, 2.0)   # the first write after the drop finds a dead pty
        wanted[1] = dac.commanded[1]
        assert dac.reconnects == 1
        assert dac_board.outputs == pytest.approx(wanted, abs=2e-4)
        assert dac.vmax(5) == 3.0  # limits come back before voltages
        with pytest.raises(OverVoltage):
            dac.set_voltage(5, 3.5)


def test_a_board_that_stays_away_is_a_clear_error_in_bounded_time(dac_board):
    dac = HeaterDAC(str(dac_board.link), reconnect_timeout=0.3)
    dac.open()
    dac_board.unplug()
    t = time.monotonic()
    with pytest.raises(DACDisconnected, match="did not come back within 0.3 s"):
        dac.set_voltage(0, 1.0)
    assert time.monotonic() - t < 5
    dac.close()


def test_a_different_board_on_the_port_is_refused(tmp_path):
    link = tmp_path / "dac"
    first = EmulatedDACBoard(link, modules=2, seed=1)
    first.start()
    dac = HeaterDAC(str(link), reconnect_timeout=10.0)
    dac.open()
    dac.set_voltage(0, 1.0)
    first.close()
    other = EmulatedDACBoard(link, modules=2, seed=2)
    other.start()
    try:
        with pytest.raises(DACError, match="refusing to drive a different board"):
            dac.set_voltage(0, 2.0)
        assert other.outputs[0] == 0.0
    finally:
        dac.close()
        other.close()


def test_watchdog_ramps_outputs_to_zero_when_the_host_goes_silent(dac_board):
    with HeaterDAC(str(dac_board.link), timeout=DEVICE_S) as dac:
        dac.set_voltages([2.0] * 56)
        dac.set_watchdog(50)
        assert wait_until(lambda: max(dac_board.outputs) == 0.0, timeout=10.0)
        # the host speaks again: normal service resumes
        dac.set_watchdog(0)
        dac.set_voltage(3, 1.0)
        assert dac_board.outputs[3] == pytest.approx(1.0, abs=2e-4)


def test_the_board_ticks_on_the_clock_only_with_its_watchdog_armed(dac_board):
    """The firmware's tick runs the watchdog and its ramp; with neither, the emulated board
    waits for the host (at most IDLE_S), not every TICK_S."""
    ticks = []
    board = dac_board.board
    tick = board.tick
    board.tick = lambda: (ticks.append(None), tick())[1]
    with HeaterDAC(str(dac_board.link), timeout=DEVICE_S) as dac:
        dac.set_voltage(0, 1.0)
        ticks.clear()
        time.sleep(0.5)                      # silent host, no watchdog: a tick per IDLE_S
        assert len(ticks) <= 0.5 / IDLE_S + 3, len(ticks)
        dac.set_watchdog(60_000)             # armed (it will not trip): ticks on the clock
        ticks.clear()
        assert wait_until(lambda: len(ticks) > 0.5 / IDLE_S + 3, timeout=10.0)
        dac.set_watchdog(0)


def test_garbage_on_the_line_is_answered_and_the_board_keeps_serving(dac_board):
    with serial.Serial(str(dac_board.link), 115200, timeout=10.0) as raw:
        raw.reset_input_buffer()
        raw.write(b"\xff\xfe\x00garbage\n" + b"x" * 1000 + b"\nid?\n")
        lines = []
        for _ in range(5):  # at most: a power-up notice, then the three answers
            line = raw.readline()
            if line != b"E90:00\n":
                lines.append(line)
            if len(lines) == 3:
                break
    assert lines[0] == b"E15:00\n"
    assert lines[1] == b"E14:00\n"
    assert lines[2].startswith(b"Q8iv-")
    with HeaterDAC(str(dac_board.link), timeout=DEVICE_S) as dac:
        assert dac.ping().startswith("Q8iv-")


def test_monitor_photodiodes_read_through_the_board(tmp_path):
    """PD<ch>? / PDALL? carry the chip's monitor photocurrents over the same serial line."""
    light = {3: 12.5e-6, 9: 0.25e-6}
    board = EmulatedDACBoard(tmp_path / "dac", modules=2, seed=1,
                             photocurrent=lambda ch: light.get(ch, 0.0))
    port = board.start()
    try:
        with HeaterDAC(port, timeout=DEVICE_S) as dac:
            assert dac.photocurrent(3) == pytest.approx(12.5)
            values = dac.photocurrents()
            assert len(values) == 16
            assert values[9] == pytest.approx(0.25) and values[0] == 0.0
            with pytest.raises(ValueError):
                dac.photocurrent(16)
    finally:
        board.close()


def test_board_without_photodiodes_says_so(dac_board):
    from photonic_testbed.drivers.heater_dac import Forbidden
    with HeaterDAC(str(dac_board.link), timeout=DEVICE_S) as dac:
        with pytest.raises(Forbidden) as refused:
            dac.photocurrents()
        assert refused.value.code == 13
        assert dac.ping()  # the session goes on
