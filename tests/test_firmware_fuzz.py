"""Hypothesis fuzzing of the firmware core: random bytes and mutated command lines.

Properties, after every line: nothing raises out of Board.feed/execute/tick; no channel is
above its VMAX, no heater draws above its IMAX, the measured total power is within PMAX; the
HAL outputs are what the board believes; a line answered with an error changes nothing (multi-
channel sets are all-or-nothing); every non-blank line gets exactly one reply kind and a bad
one exactly one `Ecc:cc` line; no firmware trap (E31). Afterwards the board still answers id?.
"""
from __future__ import annotations

import re

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from photonic_testbed.firmware import core
from photonic_testbed.firmware.hal_emulated import EmulatedHAL

RESISTANCES = [1000, 980, 1020, 955, 1045, 0, 990, 1010, 1030, 970, 1000, 1040, 960, 1005,
               995, 1025]  # channel 5 is an open circuit
ERROR = re.compile(rb"E(\d\d):(\d\d)\n")
SETTINGS = settings(max_examples=200, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


class Clock:
    def __init__(self) -> None:
        self.now = 5000

    def __call__(self) -> int:
        return self.now


def make_board() -> tuple[core.Board, EmulatedHAL, Clock]:
    modules = core.make_chain("Q8iv", [1, 2])
    clock = Clock()
    hal = EmulatedHAL([m.vfull for m in modules for _ in range(m.n)],
                      [m.ifull for m in modules for _ in range(m.n)], RESISTANCES, clock)
    board = core.Board(hal, modules)
    assert board.power_up() == b"E90:00\n"
    return board, hal, clock


def state(board: core.Board) -> tuple:
    return (list(board.codes), list(board.vmax), list(board.imax), board.pmax_mw,
            board.watchdog.ms)


def check_safe(board: core.Board, hal: EmulatedHAL) -> None:
    total = 0
    for c in range(board.n):
        assert hal.codes[c] == board.codes[c], f"channel {c}: HAL and board disagree"
        volts = board.volts_of(c, board.codes[c])
        assert volts <= board.vmax[c], f"channel {c} at {volts} above VMAX {board.vmax[c]}"
        current = hal.read_current(c) if board.codes[c] else 0
        assert current <= board.imax[c], f"channel {c} draws {current} above {board.imax[c]}"
        total += volts * current
    assert total <= board.pmax_mw * core.W11_PER_MW, "total power above the budget"


# ---- line generators ----------------------------------------------------------------------

channels = st.integers(0, 18)
numbers = st.one_of(
    st.integers(-2, 30).map(str),
    st.floats(-1, 26, allow_nan=False).map(lambda x: f"{x:.4f}"),
    st.floats(0, 13, allow_nan=False).map(lambda x: f"{x:.3e}"),
    st.sampled_from(["", ".", "1e", "1e999", "+", "-0", "0x10", "1,2", "inf", "nan", "5.",
                     ".5", "1" * 45, "12.00005", "0.00005"]),
)
hex_words = st.lists(st.integers(0, 0xFFFF).map(lambda w: f"{w:04X}"), min_size=0, max_size=6)


@st.composite
def valid_lines(draw) -> bytes:
    kind = draw(st.sampled_from(["set", "get", "vec", "hex", "board", "setting"]))
    ch = draw(channels)
    if kind == "set":
        name = draw(st.sampled_from(["v", "i", "vmax", "imax"]))
        line = f"{name}{ch}={draw(numbers)}"
    elif kind == "get":
        name = draw(st.sampled_from(["v", "i", "vmax", "imax"]))
        line = f"{name}{ch}?"
    elif kind == "vec":
        values = draw(st.lists(numbers, min_size=1, max_size=6))
        line = f"vvec{ch}=" + ",".join(values)
    elif kind == "hex":
        line = f"vhex{ch}=" + "".join(draw(hex_words))
    elif kind == "board":
        line = draw(st.sampled_from(["id?", "nchan?", "nupall?", "nup=0", "vall?", "iall?",
                                     "vmaxall?", "imaxall?", "vhex?", "ptot?", "pmax?", "wdt?",
                                     "firmware?", "vfull?", "ifull?", "help"]))
    else:
        name = draw(st.sampled_from(["wdt", "pmax"]))
        line = f"{name}={draw(numbers)}"
    if draw(st.booleans()):
        line = "".join(c.upper() if draw(st.booleans()) else c for c in line)
    return line.encode()


@st.composite
def mutated_lines(draw) -> bytes:
    line = bytearray(draw(valid_lines()))
    for _ in range(draw(st.integers(1, 4))):
        op = draw(st.sampled_from(["insert", "delete", "replace", "duplicate", "truncate"]))
        pos = draw(st.integers(0, len(line)))
        byte = draw(st.integers(0, 255).filter(lambda b: b != 10))
        if op == "insert":
            line[pos:pos] = bytes([byte])
        elif op == "delete" and line:
            del line[min(pos, len(line) - 1)]
        elif op == "replace" and line:
            line[min(pos, len(line) - 1)] = byte
        elif op == "duplicate":
            line = line[:pos] + line + line[pos:]
        elif op == "truncate":
            del line[pos:]
    return bytes(line)


random_lines = st.binary(max_size=300).map(lambda b: b.replace(b"\n", b""))
long_lines = st.integers(257, 700).map(lambda n: b"v0=" + b"1" * n)
lines = st.one_of(valid_lines(), valid_lines(), mutated_lines(), mutated_lines(), random_lines,
                  long_lines)
steps = st.lists(st.one_of(lines, lines, lines, st.integers(1, 400)), min_size=1, max_size=25)


def feed_line(board: core.Board, hal: EmulatedHAL, line: bytes) -> None:
    before = state(board)
    reply = board.feed(line + b"\n")
    errors = ERROR.findall(reply)
    assert not any(code == b"31" for code, _ in errors), f"firmware trap on {line!r}"
    body = line.replace(b"\r", b"")
    garbled = any(b >= 128 or (b < 32 and b != 9) for b in body)
    if len(body) > core.MAX_LINE or (garbled and len(bytes(b for b in body if 32 <= b < 128
                                                                  or b == 9)) > core.MAX_LINE):
        assert reply in (b"E14:00\n", b"E15:00\n") and len(errors) == 1, (line, reply)
    elif garbled:
        assert reply == b"E15:00\n", (line, reply)
    elif not body.strip():
        assert reply == b"", (line, reply)
    else:
        assert reply, f"no reply to {line!r}"
    if errors:
        assert len(errors) == 1 and ERROR.fullmatch(reply), f"{line!r} -> {reply!r}"
        assert state(board) == before, f"refused {line!r} changed the board"
    check_safe(board, hal)


@SETTINGS
@given(steps)
def test_lines_never_break_the_limits_and_bad_lines_get_one_error(script):
    board, hal, clock = make_board()
    for step in script:
        if isinstance(step, int):
            clock.now += step
            board.tick()
            check_safe(board, hal)
        else:
            feed_line(board, hal, step)
    assert board.feed(b"id?\n") == b"Q8iv-0001\n"


@SETTINGS
@given(st.lists(st.binary(max_size=400), max_size=12))
def test_arbitrary_byte_streams_never_raise(chunks):
    board, hal, clock = make_board()
    for chunk in chunks:
        reply = board.feed(chunk)
        assert b"E31:" not in reply
        assert reply.isascii()
        clock.now += 7
        board.tick()
        check_safe(board, hal)
    assert board.feed(b"\nid?\n").endswith(b"Q8iv-0001\n")


@SETTINGS
@given(st.text(max_size=300))
def test_execute_never_raises_on_any_text(text):
    board, hal, _ = make_board()
    reply = board.execute(text)
    assert isinstance(reply, str)
    assert "E31:" not in reply
    check_safe(board, hal)


@SETTINGS
@given(st.lists(st.tuples(st.integers(0, 15), st.integers(0, 0xFFFF)), min_size=1,
                max_size=16, unique_by=lambda t: t[0]),
       st.integers(1, 400))
def test_multi_channel_sets_are_all_or_nothing(targets, pmax_mw):
    board, hal, _ = make_board()
    assert board.feed(b"pmax=%d\n" % pmax_mw) == b"OK\n"
    first = min(c for c, _ in targets)
    codes = dict(targets)
    run = []
    c = first
    while c in codes:
        run.append(codes[c])
        c += 1
    before = list(board.codes)
    reply = board.feed(b"vhex%d=%s\n" % (first, "".join(f"{w:04X}" for w in run).encode()))
    if reply == b"OK\n":
        assert board.codes[first:first + len(run)] == run
    else:
        assert ERROR.fullmatch(reply) and reply[:3] in (b"E01", b"E02", b"E03"), reply
        assert board.codes == before
    check_safe(board, hal)
