"""The control handlers every emulated OCS answers the same way, wherever it sits (the bench's
one OCS in `bench_optics`, the rail OCSes of a datacenter rig in `rails`): cutting a session
(`drop`), sticking a port's mirror (`stick`) and the time a move takes (`switching_time`).
Each checks its request and says what was wrong (docs/control.md); the caller finds the switch
the request names."""
from __future__ import annotations

from typing import Any

from photonic_testbed.emulator.control import ControlError
from photonic_testbed.emulator.ocs import OCSPhysics
from photonic_testbed.emulator.scpi import SCPIServer

MAX_SWITCHING_S = 10.0


def drop(server: SCPIServer, req: dict) -> dict:
    """`when`: "now" (cut every session), or "before" | "after" the next line matching
    `header` (a regex)."""
    when = req.get("when", "now")
    if when == "now":
        return {"dropped": server.drop_clients()}
    header = req.get("header")
    if not isinstance(header, str) or not header:
        raise ControlError('"header" (a regex of the line to cut on) is needed with '
                           '"when": "before" | "after"')
    try:
        server.drop_on(header, when)
    except ValueError as e:
        raise ControlError(str(e)) from None
    return {"armed": header, "when": when}


def stick(phys: OCSPhysics, req: dict) -> list[int]:
    """`port` stuck (`stuck`: true, the default) or freed; returns the stuck ports."""
    port = req.get("port")
    if isinstance(port, bool) or not isinstance(port, int) or not 1 <= port <= 2 * phys.n:
        raise ControlError(f"port must be an integer in 1..{2 * phys.n}, not {port!r}")
    stuck = req.get("stuck", True)
    if not isinstance(stuck, bool):
        raise ControlError(f"stuck is true or false, not {stuck!r}")
    with phys.lock:
        if stuck:
            phys.stuck.add(port)
        else:
            phys.stuck.discard(port)
        return sorted(phys.stuck)


def switching_seconds(req: dict) -> float:
    """The `seconds` a move takes, checked."""
    s: Any = req.get("seconds")
    if isinstance(s, bool) or not isinstance(s, (int, float)) or not 0 <= s <= MAX_SWITCHING_S:
        raise ControlError(f"seconds must be a number in 0..{MAX_SWITCHING_S:g}, not {s!r}")
    return float(s)
