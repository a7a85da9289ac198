"""Replays command/response vectors through the firmware core with the emulation HAL.

Shared by the CPython test (tests/test_firmware_vectors.py) and the MicroPython run
(tests/micropython/replay.mjs), so it is written in the subset MicroPython has: no
dataclasses, typing or f-strings with format specs it lacks; only `json` from its library.

A vectors file is JSON: {"sessions": [session, ...]}. A session is
    {"name": str, "kind": "Q8iv", "modules": int, "channels_per_module": int,
     "resistances": [ohms or 0 (open circuit), ...], "steps": [step, ...]}
and a step is one of
    {"power_up": true, "expect": "E90:00\\n"}    the board's power-up notice
    {"send": str, "expect": str}                 bytes to the board (each char one byte,
                                                 U+0000..U+00FF) and its exact reply
    {"wait_ms": int, "expect": ""}               the clock runs on while the main loop
                                                 ticks every TICK_MS (watchdog, ramp);
                                                 sends take no time on this clock
"""
TICK_MS = 2


class FakeClock:
    def __init__(self, start=1000):
        self.now = start

    def __call__(self):
        return self.now


def to_bytes(text):
    return bytes([ord(ch) for ch in text])


def run_session(session, core, hal_module):
    """One session -> the reply bytes of each of its steps, in order.

    `core` and `hal_module` are the firmware's core and hal_emulated modules (imported as
    firmware.core on CPython, as plain `core` from the board's filesystem on MicroPython).
    """
    modules = core.make_chain(session.get("kind", "Q8iv"),
                         [k + 1 for k in range(session["modules"])],
                         session.get("channels_per_module", 8))
    n = session["modules"] * session.get("channels_per_module", 8)
    resistances = session["resistances"]
    if len(resistances) != n:
        raise ValueError("session %s: %d resistances for %d channels"
                         % (session["name"], len(resistances), n))
    clock = FakeClock()
    photocurrent = None
    if "photocurrents_na" in session:
        nanoamps = session["photocurrents_na"]
        photocurrent = lambda ch: nanoamps[ch] * 1e-9  # noqa: E731
    hal = hal_module.EmulatedHAL([m.vfull for m in modules for _ in range(m.n)],
                      [m.ifull for m in modules for _ in range(m.n)],
                      resistances, clock, None, photocurrent)
    board = core.Board(hal, modules)
    replies = []
    for step in session["steps"]:
        if "power_up" in step:
            replies.append(board.power_up())
        elif "send" in step:
            replies.append(board.feed(to_bytes(step["send"])))
        elif "wait_ms" in step:
            if step["wait_ms"] % TICK_MS:
                raise ValueError("session %s: wait_ms must be a multiple of %d"
                                 % (session["name"], TICK_MS))
            for _ in range(step["wait_ms"] // TICK_MS):
                clock.now += TICK_MS
                board.tick()
            replies.append(b"")
        else:
            raise ValueError("session %s: unknown step %r" % (session["name"], step))
    return replies


def to_hex(data):
    return "".join(["%02x" % b for b in data])


def run_all(vectors, core, hal_module):
    """{"name": [hex reply of each step]} for every session."""
    result = {}
    for session in vectors["sessions"]:
        result[session["name"]] = [to_hex(r) for r in run_session(session, core, hal_module)]
    return result
