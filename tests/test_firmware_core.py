"""Unit tests of the firmware core's number handling and of limit edge cases."""
from __future__ import annotations

from fractions import Fraction

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from photonic_testbed.firmware import core
from photonic_testbed.firmware.hal_emulated import EmulatedHAL

# ---- parse_fixed: decimal text to 1e-4 units, rounded half up (away from zero) ---------------

@pytest.mark.parametrize("text, units", [
    ("0", 0), ("1", 10000), ("1.5", 15000), ("+1.5", 15000), ("-1.5", -15000),
    ("12", 120000), (".5", 5000), ("5.", 50000), ("007.25000", 72500), ("  3.25 ", 32500),
    # rounding to 4 decimals, half up on the magnitude
    ("0.00005", 1), ("0.000049999", 0), ("0.00015", 2), ("1.23455", 12346),
    ("1.234549", 12345), ("-0.00005", -1), ("-0.000049", 0), ("2.99995", 30000),
    # exponents
    ("1e0", 10000), ("1e3", 10000000), ("1E3", 10000000), ("2.5e-1", 2500), ("2.5E+0", 25000),
    ("1e-4", 1), ("5e-5", 1), ("4e-5", 0), ("1e-100", 0), ("123e-2", 12300), ("-1e1", -100000),
    ("0.0000000001e3", 0), ("1e8", 10 ** 12), ("-0", 0), ("+0.0", 0),
])
def test_parse_fixed_values(text, units):
    assert core.parse_fixed(text) == units


@pytest.mark.parametrize("text", [
    "", " ", ".", "+", "-", "e5", "1e", "1e+", "1e-", "1.2.3", "1,2", "0x10", "inf", "nan",
    "1 0", "--1", "+-1", "1e1.5", "1e1000", "abc", "1" * 41, "1e9", "1e12", "٣", "²",
])
def test_parse_fixed_rejects(text):
    with pytest.raises(ValueError):
        core.parse_fixed(text)


def test_parse_fixed_bounds_its_work():
    # Overflow: more than 1e8 (shift beyond 10**12) is refused rather than built as a huge int.
    assert core.parse_fixed("99999999") == 999999990000
    with pytest.raises(ValueError):
        core.parse_fixed("1e9")
    assert core.parse_fixed("9" * 40) == int("9" * 40) * 10000  # 40 chars: allowed, exact
    with pytest.raises(ValueError):
        core.parse_fixed("9" * 41)


@settings(max_examples=300, deadline=None)
@given(st.decimals(min_value=-10 ** 6, max_value=10 ** 6, allow_nan=False, allow_infinity=False,
                   places=8))
def test_parse_fixed_rounds_half_away_from_zero_like_exact_arithmetic(d):
    text = format(d, "f")
    exact = Fraction(text) * 10000
    magnitude = abs(exact)
    rounded = int(magnitude) + (1 if magnitude - int(magnitude) >= Fraction(1, 2) else 0)
    assert core.parse_fixed(text) == (-rounded if exact < 0 else rounded)


# ---- format_fixed --------------------------------------------------------------------------

@pytest.mark.parametrize("units, unit, text", [
    (0, "V", "+0.0000 V"), (15000, "V", "+1.5000 V"), (1, "V", "+0.0001 V"),
    (-1, "V", "-0.0001 V"), (-15000, "mA", "-1.5000 mA"), (120000, "V", "+12.0000 V"),
    (9999, "mA", "+0.9999 mA"), (11520000, "mW", "+1152.0000 mW"),
    (10 ** 12, "V", "+100000000.0000 V"),
])
def test_format_fixed(units, unit, text):
    assert core.format_fixed(units, unit) == text


@given(st.integers(-10 ** 9, 10 ** 9))
def test_format_then_parse_round_trips(units):
    text = core.format_fixed(units, "V")
    assert core.parse_fixed(text[:-2]) == units


def test_error_lines_keep_two_digit_fields():
    assert core.error_line(1, 0) == "E01:00\n"
    assert core.error_line(12, 56) == "E12:56\n"
    assert core.error_line(10, 123) == "E10:23\n"
    assert core.error_line(11, 9999) == "E11:99\n"


# ---- limits --------------------------------------------------------------------------------

class Clock:
    now = 0

    def __call__(self):
        return self.now


def board_with(resistances):
    modules = core.make_chain("Q8iv", [1])
    hal = EmulatedHAL([120000] * 8, [240000] * 8, resistances, Clock())
    board = core.Board(hal, modules)
    board.power_up()
    return board, hal


def test_vmax_between_two_dac_codes_is_reachable_and_never_exceeded():
    board, hal = board_with([1000] * 8)
    hits = 0
    for vmax in range(40001, 40100):  # 1e-4 V steps: many fall between two DAC codes
        assert board.execute(f"vmax0={core.format_fixed(vmax, '')[1:].strip()}") == "OK\n"
        assert board.execute(f"v0={vmax // 10000}.{vmax % 10000:04d}") == "OK\n", vmax
        assert board.volts_of(0, board.codes[0]) <= vmax
        hits += board.code_of(0, vmax) != board.codes[0]
        assert board.execute("v0=0") == "OK\n"
    assert hits > 0  # the nearest code was above VMAX for some of them


def test_current_set_at_imax_lands_within_imax():
    for r in (955, 1000, 1045):
        board, hal = board_with([r] * 8)
        for imax in ("1", "5", "7.5", "11.4"):
            assert board.execute("imax0=" + imax) == "OK\n"
            assert board.execute("i0=" + imax) == "OK\n", (r, imax)
            measured = hal.read_current(0)
            assert measured <= core.parse_fixed(imax)
            # within the current ADC's resolution (3.7e-4 mA a step), or 0.2 %
            assert core.parse_fixed(imax) - measured <= max(15, core.parse_fixed(imax) // 500)
            assert board.execute("i0=0") == "OK\n"


def test_a_set_that_lowers_power_is_accepted_while_above_budget():
    """The heaters drift (lower resistance: more power) and the total ends above PMAX: the
    host must still be able to turn things down, and only down."""
    board, hal = board_with([1000] * 8)
    assert board.execute("pmax=40") == "OK\n"
    assert board.execute("vvec0=3,3,2") == "OK\n"            # 9 + 9 + 4 = 22 mW
    hal.resistance[:] = [500] * 8                             # drift: now 44 mW > 40 mW
    assert board._measured_power() > board.pmax_mw * core.W11_PER_MW
    assert board.execute("v0=2.8") == "OK\n"                  # 41.7 mW: lower, accepted
    assert board.execute("v0=2.9") == "E03:00\n"              # 42.8 mW: higher, refused
    assert board.execute("vvec0=2,3.5") == "OK\n"             # 40.5 mW: net fall, accepted
    assert board.execute("vvec0=3,3.5") == "E03:00\n"         # 50.5 mW: net rise, refused
    assert board.execute("v2=0") == "OK\n"                    # 32.5 mW: within budget again
    assert board.execute("v2=1") == "OK\n"                    # 34.5 mW: a rise within budget
    assert [board.volts_of(c, board.codes[c]) for c in range(3)] == [20001, 34999, 10000]


def test_pmax_below_the_present_total_is_forbidden():
    board, hal = board_with([1000] * 8)
    assert board.execute("v0=3") == "OK\n"                    # 9 mW
    assert board.execute("pmax=8") == "E13:00\n"
    assert board.execute("pmax=10") == "OK\n"
    assert board.execute("v0=0") == "OK\n"
    assert board.execute("pmax=1") == "OK\n"


def test_measured_overshoot_is_put_back_and_refused():
    """A heater whose resistance dropped since it was measured draws more than predicted:
    the write is verified, undone and answered E02."""
    board, hal = board_with([1000] * 8)
    assert board.execute("imax0=5") == "OK\n"
    assert board.execute("v0=1") == "OK\n"                    # measured: 1 kOhm
    hal.resistance[0] = 800                                   # now 5 V would draw 6.25 mA
    assert board.execute("v0=4.5") == "E02:00\n"
    assert board.volts_of(0, board.codes[0]) == 10000
    assert hal.codes[0] == board.codes[0]


def test_a_refused_set_does_not_stop_a_watchdog_ramp():
    clock = Clock()
    modules = core.make_chain("Q8iv", [1])
    hal = EmulatedHAL([120000] * 8, [240000] * 8, [1000] * 8, clock)
    board = core.Board(hal, modules)
    board.power_up()
    assert board.feed(b"wdt=100\nimax0=5\nv0=4\n") == b"OK\nOK\nOK\n"
    for _ in range(60):                                       # trip at 102 ms, ramp half way
        clock.now += 2
        board.tick()
    assert 0 < board.codes[0] < board.code_of(0, 40000)
    hal.resistance[0] = 700                                   # unseen: 3.9 V draws 5.6 mA
    assert board.feed(b"v0=3.9\n") == b"E02:00\n"             # refused after the write
    for _ in range(60):
        clock.now += 2
        board.tick()
    assert board.codes[0] == 0 and hal.codes[0] == 0          # the ramp went on to 0 V
