"""The rail OCSes of a datacenter rig (Opus's photonic rails), emulated: one Polatis-class
switch per (rail, pod), each its own SCPI endpoint on loopback, all served by one thread of this
process (one `SCPILoop`).

`RailSwitches(layout)` makes an `OCSPhysics` and its SCPI persona (`OCSInstrument`) for every
switch of a rail rack (`common.rack_layout.rail_rack`: `rail{l}-pod{k}`, N x N with N the pod's
ports); `start()` puts each on its own port and returns {switch: VISA resource}. The rack's GPUs
light the switches (`EmulatedRack`), and each switch's port power monitor (`:PMON:POW?`) sees
their light once the rack is attached (`light_from`).

Control handlers (docs/control.md), each naming its switch as `device`: `drop`, `reboot`,
`stick`, `switching_time` (every switch when `device` is left out), and `switch_circuits`
`{switches?: [names]}`: the circuits each switch holds as the emulator sees them (`commanded`,
what its controller reports; `actual`, where the light goes) and the circuits made or broken on
each port so far (`port_moves`), so a test checks the switches themselves rather than what the
agent believes.
"""
from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any

from photonic_testbed.common.rack_layout import RackLayout
from photonic_testbed.emulator.control import ControlError, ControlServer
from photonic_testbed.emulator.instrument_faults import InstrumentFaults
from photonic_testbed.emulator.ocs import OCSInstrument, OCSPhysics
from photonic_testbed.emulator.scpi_loop import SCPILoop
from photonic_testbed.emulator.scpi_server import SCPIServer, close_servers, start_servers

log = logging.getLogger(__name__)

SEEDS_PER_RIG = 4096          # switch k of a rig of seed s draws its hidden truth from s*4096+k


class RailSwitches:
    """Every rail OCS of a rack, each on its own loopback port. Use as a context manager."""

    def __init__(self, layout: RackLayout, *, seed: int = 0, switching_s: float = 0.025,
                 host: str = "127.0.0.1", port_base: int | None = None):
        if len(layout.switches) > SEEDS_PER_RIG:
            raise ValueError(f"{len(layout.switches)} switches: at most {SEEDS_PER_RIG}")
        self.layout = layout
        self.physics: dict[str, OCSPhysics] = {}
        self.servers: dict[str, SCPIServer] = {}
        loop = SCPILoop("rails")        # one thread serves every switch's sessions
        for k, (name, n) in enumerate(layout.switches.items()):
            phys = OCSPhysics(n, seed=seed * SEEDS_PER_RIG + k, switching_s=switching_s)
            self.physics[name] = phys
            port = 0 if port_base is None else port_base + k
            self.servers[name] = SCPIServer(OCSInstrument(phys, serial=f"{seed:03d}{k:03d}"),
                                            host, port, name, loop=loop)
        self.faults = InstrumentFaults(self.servers, self.physics)

    def light_from(self, launch_mw: Callable[[str], dict[int, float]]) -> None:
        """What enters each switch's ingress ports (`launch_mw(switch)` -> {port: mW}): the
        rack's live transmitters, so the switches' own port power monitors see the GPUs."""
        for name, phys in self.physics.items():
            phys.light_in = functools.partial(launch_mw, name)

    def start(self) -> dict[str, str]:
        endpoints = start_servers(self.servers)
        log.info("%d rail OCSes listening", len(endpoints))
        return endpoints

    def close(self) -> None:
        close_servers(self.servers)

    def __enter__(self) -> RailSwitches:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- control handlers ------------------------------------------------------------------

    def register(self, control: ControlServer) -> None:
        self.faults.register(control)
        control.register("switch_circuits", self._circuits)

    def _circuits(self, req: dict) -> Any:
        names = req.get("switches")
        if names is None:
            names = list(self.physics)
        elif not isinstance(names, list) or not all(isinstance(n, str) for n in names):
            raise ControlError(f"switches must be a list of switch names, not {names!r}")
        out = {}
        for name in names:
            phys = self.physics[self.faults.switch_name({"device": name})]
            with phys.lock:
                out[name] = {"commanded": sorted(phys.commanded.items()),
                             "actual": sorted(phys.actual.items()), "moves": phys.moves,
                             "port_moves": sorted(phys.port_moves.items())}
        return out
