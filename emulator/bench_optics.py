"""The optical bench of a rig: an OCS, a power meter and a laser, wired by fibre, on sockets.

Wiring without a chip (the `opus` rig, documented in docs/instruments.md):
  laser output  -> OCS ingress `LASER_INGRESS` (1)
  OCS egress N+m -> power meter port m (m = 1..channels; egress 33..36 on a 32 x 32 switch)

With a chip (the `lumion` rig, docs/chip.md), the OCS is the chip's input selector:
  laser output  -> OCS ingress 1
  OCS egress N+k -> chip input k (k = 1..N; the OCS is N x N for an N-port chip)
  chip output N+m's 1 % monitor tap -> power meter port m
A recirculating chip (the `hexmesh` rig) has ports 1..P that are inputs and outputs both: egress
P+k lights port k, and meter port m reads the tap of the light leaving port m.

`OpticalBench.start()` serves each instrument on its own loopback port and registers the
control handlers (drop, reboot, stick, switching_time, truth) with a `ControlServer`.
"""
from __future__ import annotations

import logging
from typing import Any

from photonic_testbed.emulator.control import ControlServer
from photonic_testbed.emulator.instrument_faults import InstrumentFaults
from photonic_testbed.emulator.mesh_chip import RecirculatingChip
from photonic_testbed.emulator.ocs import OCSInstrument, OCSPhysics
from photonic_testbed.emulator.optical_instruments import LaserInstrument, PowerMeterInstrument
from photonic_testbed.emulator.scpi_server import SCPIServer, close_servers, start_servers

log = logging.getLogger(__name__)

LASER_INGRESS = 1


class OpticalBench:
    """OCS + power meter + laser; `ports` gives fixed TCP ports (ocs, powermeter, laser)."""

    def __init__(self, *, ocs_ports: int = 32, meter_channels: int = 4, laser: bool = True,
                 seed: int = 0, switching_s: float = 0.025, host: str = "127.0.0.1",
                 ports: dict[str, int] | None = None, chip: Any = None):
        ports = ports or {}
        self.chip = chip
        self.laser = LaserInstrument(serial=f"DE{seed:08d}") if laser else None
        self.physics = OCSPhysics(ocs_ports, seed=seed, switching_s=switching_s,
                                  light_in=self.light_in) if ocs_ports else None
        self.meter_channels = meter_channels if ocs_ports else 0
        self.servers: dict[str, SCPIServer] = {}
        if self.physics is not None:
            self.ocs = OCSInstrument(self.physics, serial=f"{seed:06d}")
            self.servers["ocs"] = SCPIServer(self.ocs, host, ports.get("ocs", 0), "ocs")
        if self.meter_channels:
            self.powermeter = PowerMeterInstrument(self.meter_light, meter_channels, seed=seed,
                                                   serial=f"MY{seed:08d}")
            self.servers["powermeter"] = SCPIServer(self.powermeter, host,
                                                    ports.get("powermeter", 0), "powermeter")
        if self.laser is not None:
            self.servers["laser"] = SCPIServer(self.laser, host, ports.get("laser", 0), "laser")

    # ---- optics ----------------------------------------------------------------------------

    def light_in(self) -> dict[int, float]:
        """mW entering each OCS ingress."""
        return {LASER_INGRESS: self.laser.output_mw()} if self.laser is not None else {}

    def selector(self) -> OCSPhysics:
        """The OCS's physics, which the meter and the chip's input light go through."""
        if self.physics is None:
            raise RuntimeError("this optical bench has no OCS (made with ocs_ports=0)")
        return self.physics

    def meter_egress(self, channel: int) -> int:
        return self.selector().n + channel

    def chip_light_in(self) -> dict[int, float]:
        """mW the input selector (the OCS) sends into each chip input."""
        physics = self.selector()
        n = physics.n
        out = physics.transfer(self.light_in())
        return {k: out[n + k] for k in range(1, n + 1) if out.get(n + k, 0.0) > 0.0}

    def light_chip(self) -> None:
        """Bring the chip's input light up to date with the laser and the selector."""
        self.chip.set_inputs(self.chip_light_in())

    def meter_output(self, channel: int) -> int:
        """The chip port whose 1 % tap power meter port `channel` reads: output N + channel of
        a feed-forward chip, port `channel` of a recirculating one (its ports are not split)."""
        return channel if isinstance(self.chip, RecirculatingChip) else self.chip.ports + channel

    def meter_light(self, channel: int) -> float:
        """mW reaching power meter port `channel`: what leaves its OCS egress, or with a chip,
        the monitor tap of the chip port it reads (`meter_output`)."""
        if self.chip is not None:
            self.light_chip()
            return self.chip.tap_power_mw(self.meter_output(channel))
        return self.selector().transfer(self.light_in())[self.meter_egress(channel)]

    # ---- lifecycle -------------------------------------------------------------------------

    def start(self) -> dict[str, str]:
        return start_servers(self.servers)

    def close(self) -> None:
        close_servers(self.servers)

    # ---- control handlers --------------------------------------------------------------------

    def register(self, control: ControlServer) -> None:
        switches = {"ocs": self.physics} if self.physics is not None else {}
        InstrumentFaults(self.servers, switches).register(control)
        control.register("truth", self._truth)

    def _truth(self, req: dict) -> Any:
        out: dict[str, Any] = {}
        if self.physics is not None:
            out["ocs"] = self.physics.truth()
            if self.chip is None:
                out["powermeter"] = {m: {"egress": self.meter_egress(m), "mw": self.meter_light(m)}
                                     for m in range(1, self.meter_channels + 1)}
            else:
                self.light_chip()
                out["chip_inputs"] = {str(k): v for k, v in self.chip.inputs.items()}
                out["powermeter"] = {m: {"chip_output": self.meter_output(m),
                                         "mw": self.chip.tap_power_mw(self.meter_output(m))}
                                     for m in range(1, self.meter_channels + 1)}
        if self.laser is not None:
            s = self.laser.state
            out["laser"] = {"on": s.on, "power_mw": s.power_mw, "wavelength_m": s.wavelength_m,
                            "output_mw": self.laser.output_mw(), "feeds_ingress": LASER_INGRESS}
        return out
