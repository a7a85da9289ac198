"""A running emulated rig: its instruments started on real wires.

`EmulatedRig(spec, seed).start()` brings every instrument of a rig's spec up (the DAC board
behind a pty; SCPI instruments on loopback sockets) and returns the endpoints a lab script would
be given. What each rig is made of (`RigSpec`, the named `RIGS`, an [emulator] TOML) lives with
the other rig facts in `hil.rig`. Nothing downstream imports this: it reads the endpoints.
"""
from __future__ import annotations

import json
import logging
import os
import pathlib
import shutil
import tempfile
from typing import TYPE_CHECKING, Any

from photonic_testbed.common.topology import build as build_topology
from photonic_testbed.emulator.bench_optics import OpticalBench
from photonic_testbed.emulator.chip import NOMINAL_R_OHM, ChipError, EmulatedChip
from photonic_testbed.emulator.control import ControlServer
from photonic_testbed.emulator.dac_board import EmulatedDACBoard, heater_resistances
from photonic_testbed.emulator.mesh_chip import make_chip
from photonic_testbed.hil.files import write_atomic
from photonic_testbed.hil.rig.emulated import RigSpec

if TYPE_CHECKING:
    from photonic_testbed.emulator.rackhost import RackHost
    from photonic_testbed.emulator.rails import RailSwitches

log = logging.getLogger(__name__)

# A PDALL? reads every photodiode of the chain in one pass over the channels: one optical
# solution serves the pass. A new pass, or any change the light depends on (a heater, the laser,
# the input selector), starts a new solution; never the wall clock, so that a run's readings
# (and their noise) are the same on a busy machine as on an idle one.


class EmulatedRig:
    """Every instrument of a rig, started on its wire. Use as a context manager."""

    def __init__(self, spec: RigSpec, seed: int = 0, workdir: str | os.PathLike | None = None,
                 port_base: int | None = None, switching_s: float = 0.025,
                 ideal_chip: bool = False, crosstalk_scale: float = 1.0,
                 chip_monitors: bool = True, chip_calibration=None):
        self.spec = spec
        self.seed = seed
        # Fixed TCP ports when given: ocs = base, powermeter = base+1, laser = base+2 (a
        # datacenter rig's rail OCSes base+4 on); ephemeral otherwise. The control endpoint is
        # never on TCP: an ipc:// socket in a folder only this user can enter (emulator.control).
        self.port_base = port_base
        self.switching_s = switching_s
        self.optics: OpticalBench | None = None
        self.control: ControlServer | None = None
        self.ideal_chip = ideal_chip     # no fabrication errors, nominal heaters (for tests)
        self.chip: EmulatedChip | None = None
        self.crosstalk_scale = crosstalk_scale   # scales the chip's thermal crosstalk
        self.chip_monitors = chip_monitors       # False: no cell photodiodes (outputs only)
        # A measured calibration (common.calibration.Calibration): the chip is its twin
        self.chip_calibration = chip_calibration
        self._own_dir = workdir is None
        self.workdir = pathlib.Path(workdir or tempfile.mkdtemp(prefix="ptb-rig-"))
        self.dac: EmulatedDACBoard | None = None
        self.endpoints: dict[str, str] = {}
        self.rack: RackHost | None = None            # once start_rack() ran
        self.rails: RailSwitches | None = None       # a datacenter rig's rail OCSes
        self._pd_cache: tuple[tuple[int, int], Any] | None = None
        self._pd_last = -1

    def start(self) -> dict[str, str]:
        try:
            if self.spec.chip_kind:
                self._make_chip()
            if self.spec.dac_modules:
                on_output = self._heater_changed if self.chip is not None else None
                resistances = ([NOMINAL_R_OHM] * self.spec.dac_modules * 8
                               if self.chip is not None and self.ideal_chip else None)
                if self.chip is not None and self.chip_calibration is not None:
                    resistances = heater_resistances(self.spec.dac_modules * 8, self.seed)
                    for ch, r in zip(self.chip.channels, self.chip.truth_.resistance_ohm,
                                     strict=True):
                        resistances[ch] = float(r)
                photocurrent = (self._photocurrent
                                if self.chip is not None and self.chip.monitors else None)
                self.dac = EmulatedDACBoard(self.workdir / "dac", modules=self.spec.dac_modules,
                                            seed=self.seed, resistances=resistances,
                                            on_output=on_output, photocurrent=photocurrent)
                if self.chip is not None:
                    self.chip.set_resistances(self.dac.resistances)
                self.endpoints["dac"] = self.dac.start()
            if self.spec.servers:
                self._start_rails()
            if self.spec.ocs_ports or self.spec.laser:
                base = self.port_base
                fixed = {} if base is None else {"ocs": base, "powermeter": base + 1,
                                                 "laser": base + 2}
                self.optics = OpticalBench(ocs_ports=self.spec.ocs_ports,
                                           meter_channels=self.spec.meter_channels,
                                           laser=self.spec.laser, seed=self.seed,
                                           switching_s=self.switching_s, ports=fixed,
                                           chip=self.chip)
                self.endpoints.update(self.optics.start())
                self.control = ControlServer()
                self.optics.register(self.control)
                self.endpoints["control"] = self.control.start()
        except BaseException:
            self.close()
            raise
        return dict(self.endpoints)

    def _start_rails(self) -> None:
        """A datacenter rig's rail OCSes, each its own SCPI endpoint (keyed by the switch's
        name in `endpoints`; port_base + 4 on, with fixed ports), and the control endpoint."""
        from photonic_testbed.emulator.rack import RackError
        from photonic_testbed.emulator.rails import RailSwitches
        base = self.port_base
        layout = self.spec.rack_layout()
        if layout is None:
            raise RackError(f"rig {self.spec.name} has servers but no rack of them")
        rails = self.rails = RailSwitches(layout, seed=self.seed,
                                          switching_s=self.switching_s,
                                          port_base=None if base is None else base + 4)
        self.endpoints.update(rails.start())
        self.control = ControlServer()
        rails.register(self.control)
        self.endpoints["control"] = self.control.start()

    def _photocurrent(self, channel: int) -> float:
        """The DAC board's photodiode input beside heater `channel`: the monitor photodiode of
        the cell that heater drives (amperes; 0 where no cell's first heater is `channel`)."""
        cell = self._pd_cells.get(channel)
        if cell is None:
            return 0.0
        chip = self._chip()
        if self.optics is not None and self.optics.physics is not None:
            self.optics.light_chip()
        if (self._pd_cache is None or channel <= self._pd_last
                or self._pd_cache[0] != chip.light_version):
            self._pd_cache = (chip.light_version, chip.monitor_currents_ua())
        self._pd_last = channel
        return self._pd_cache[1][cell] * 1e-6

    def _heater_changed(self, channel: int, volts: float) -> None:
        self._pd_cache = None
        self._pd_last = -1
        self._chip().set_voltage(channel, volts)

    def _chip(self) -> EmulatedChip:
        """The chip, for the DAC board's callbacks (which are wired only when there is one)."""
        if self.chip is None:
            raise ChipError(f"rig {self.spec.name} has no chip")
        return self.chip

    def _make_chip(self) -> None:
        """The chip on the DAC's heaters. With the rig's optical bench, the laser reaches the
        chip's inputs through the OCS (the input selector) and the power meter reads the chip's
        output taps; tests may also light inputs directly (`chip.inject(port, mw)`)."""
        topology = build_topology(self.spec.chip_kind, self.spec.chip_ports).describe()
        if self.chip_calibration is not None:
            if topology["kind"] not in ("benes", "clements"):
                raise ChipError(f"a twin is built for a feed-forward chip (calibrated), not "
                                f"{topology['name']}")
            self.chip = EmulatedChip.from_calibration(
                topology, self.chip_calibration, seed=self.seed,
                crosstalk_scale=self.crosstalk_scale, monitors=self.chip_monitors)
        else:
            self.chip = make_chip(topology, seed=self.seed, ideal=self.ideal_chip,
                                  crosstalk_scale=self.crosstalk_scale,
                                  monitors=self.chip_monitors)
        self._pd_cells = {cell["channels"][0]: cell["id"] for cell in topology["cells"]
                          if cell["channels"]}
        self._pd_cache = None
        self._pd_last = -1

    def start_rack(self, gpus_endpoints: tuple[str, str],
                   agent_endpoints: tuple[str, str] | None = None, *,
                   keys: Any = None, job_keys: Any = None):
        """The rack of GPUs on this rig's switch (common.rack_layout), its link state from the
        chip's or the OCS's physics; GPU health published at `gpus_endpoints`; faults, truth
        and the job on the control endpoint. With CURVE: the health monitor's server `keys`
        and the job's client `job_keys` (a tenant's). Returns the RackHost."""
        from photonic_testbed.emulator.rack import RackError
        from photonic_testbed.emulator.rackhost import RackHost
        physics: dict[str, Any] = {}
        if self.chip is not None:
            physics["chip"] = self.chip
        if self.optics is not None and self.optics.physics is not None:
            physics["ocs"] = self.optics.physics
        if self.rails is not None:
            physics.update(self.rails.physics)
        lay = self.spec.rack_layout()
        if lay is None:
            raise RackError(f"rig {self.spec.name} has no rack of GPUs")
        missing = sorted(set(lay.switches) - set(physics))
        if missing:
            raise RackError(f"rig {self.spec.name} has no {', '.join(missing)} for its rack")
        rack = self.rack = RackHost(lay, {s: physics[s] for s in lay.switches},
                                    gpus_endpoints=gpus_endpoints,
                                    agent_endpoints=agent_endpoints, keys=keys,
                                    job_keys=job_keys)
        if self.rails is not None:
            self.rails.light_from(rack.rack.launch_mw)
        rack.start()
        if self.control is not None:
            rack.register(self.control)
        return rack

    def write_endpoints(self, path: str | os.PathLike) -> None:
        """Write the endpoints JSON whole or not at all (hil.files)."""
        write_atomic(path, json.dumps(self.endpoints, indent=2) + "\n")

    def close(self) -> None:
        if self.rack is not None:
            self.rack.close()
            self.rack = None
        if self.control is not None:
            self.control.close()
            self.control = None
        if self.rails is not None:
            self.rails.close()
            self.rails = None
        if self.optics is not None:
            self.optics.close()
            self.optics = None
        if self.dac is not None:
            self.dac.close()
            self.dac = None
        if self._own_dir:
            shutil.rmtree(self.workdir, ignore_errors=True)

    def __enter__(self) -> EmulatedRig:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.close()
