"""The fault handlers of a rig's emulated SCPI instruments, answered the same way wherever the
instruments sit (the optical bench's OCS, meter and laser in `bench_optics`, the rail OCSes of a
datacenter rig in `rails`): cutting an instrument's sessions (`drop`), power-cycling it
(`reboot`), sticking an OCS port's mirror (`stick`) and the time an OCS move takes
(`switching_time`). Each checks its request and says what was wrong (docs/control.md)."""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from photonic_testbed.emulator.control import ControlError, ControlServer
from photonic_testbed.emulator.ocs import OCSPhysics
from photonic_testbed.emulator.scpi_server import SCPIServer

MAX_SWITCHING_S = 10.0
NAMES_SHOWN = 4                # a refusal lists this many of the instruments' names at most


class InstrumentFaults:
    """`servers`: every instrument by the name a request's `device` gives; `switches`: the
    physics of those that are OCSes. `stick` and `switching_time` may leave `device` out on a
    rig of one OCS (`switching_time` without it sets every OCS)."""

    def __init__(self, servers: Mapping[str, SCPIServer], switches: Mapping[str, OCSPhysics]):
        self.servers = servers
        self.switches = switches

    def register(self, control: ControlServer) -> None:
        control.register("drop", self.drop)
        control.register("reboot", self.reboot)
        control.register("stick", self.stick)
        control.register("switching_time", self.switching_time)

    def server(self, req: dict) -> SCPIServer:
        """The instrument the request's `device` names."""
        return self.servers[_named(req.get("device"), self.servers, "an instrument")]

    def switch_name(self, req: dict) -> str:
        """The OCS the request's `device` names (or the rig's one OCS, if it leaves it out)."""
        if not self.switches:
            raise ControlError("this rig has no OCS")
        if "device" not in req and len(self.switches) == 1:
            return next(iter(self.switches))
        return _named(req.get("device"), self.switches, "an OCS")

    def drop(self, req: dict) -> dict:
        """`when`: "now" (cut every session), or "before" | "after" the next line matching
        `header` (a regex)."""
        server = self.server(req)
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

    def reboot(self, req: dict) -> dict:
        """Power-cycle: the instrument's volatile state is lost and every session cut."""
        server = self.server(req)
        with server.instrument.lock:
            server.instrument.reboot()
        return {"dropped": server.drop_clients()}

    def stick(self, req: dict) -> list[int]:
        """`port` stuck (`stuck`: true, the default) or freed; returns the stuck ports."""
        phys = self.switches[self.switch_name(req)]
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

    def switching_time(self, req: dict) -> dict:
        """The `seconds` a move takes, on the OCS `device` names or on every OCS."""
        s: Any = req.get("seconds")
        if isinstance(s, bool) or not isinstance(s, (int, float)) or \
                not 0 <= s <= MAX_SWITCHING_S:
            raise ControlError(f"seconds must be a number in 0..{MAX_SWITCHING_S:g}, not {s!r}")
        names = [self.switch_name(req)] if "device" in req else list(self.switches)
        if not names:
            raise ControlError("this rig has no OCS")
        for name in names:
            self.switches[name].switching_s = float(s)
        return {"seconds": float(s), "switches": len(names)}


def _named(name: Any, among: Mapping[str, Any], what: str) -> str:
    if not isinstance(name, str) or name not in among:
        names = list(among)
        shown = ", ".join(map(repr, names[:NAMES_SHOWN])) + \
            (f", ... ({len(names)} in all)" if len(names) > NAMES_SHOWN else "")
        raise ControlError(f"device must name {what}: one of {shown}; not {name!r}")
    return name
