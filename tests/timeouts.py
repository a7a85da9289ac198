"""How long a test lets a device or a service take to answer: far longer than on an idle
machine, so that a test never depends on a client's short default (the heater DAC's 1 s) while
it shares two cores with other tests and other work."""

DEVICE_S = 10.0          # a driver's reply (heater DAC, OCS, meter, laser) on the emulator


def wait_until(cond, what: str, timeout: float, step: float = 0.01):
    """`cond()`'s first true value, asked every `step` s; AssertionError naming `what` once
    `timeout` s have passed without one (the bound says what it waited for when it runs out)."""
    import time
    deadline = time.monotonic() + timeout
    while True:
        got = cond()
        if got:
            return got
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout:g} s")
        time.sleep(step)
