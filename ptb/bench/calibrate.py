"""Full calibration of the lumion rig's 16 x 16 Benes chip (56 cells) through its real wires
with instrument delays at 0: wall time, measurements per cell, and the same figures for a naive
fixed 256-point sweep per cell; the lab time both would take at 1 ms per serial command and
10 ms of power meter averaging (photodiode reads are serial commands). Then the same chip
without monitor photodiodes, calibrated from its outputs (every reading a meter reading)."""
from __future__ import annotations

import time

import numpy as np

from photonic_testbed.calibration.fringe import fit_fringe
from photonic_testbed.calibration.progressive import Calibrator, CellFit
from photonic_testbed.calibration.run import calibrate
from photonic_testbed.calibration.station import Station, heater_volts
from photonic_testbed.common.topology import benes
from photonic_testbed.drivers.heater_dac import HeaterDAC
from photonic_testbed.drivers.laser import Laser
from photonic_testbed.drivers.ocs import OpticalCircuitSwitch
from photonic_testbed.drivers.power_meter import PowerMeter
from photonic_testbed.emulator.rig import EmulatedRig
from photonic_testbed.hil.rig import rig_spec
from photonic_testbed.ptb.bench import SEED, integer

NAME = "calibrate"
HELP = "full 56-cell chip calibration: wall time, measurements per cell, vs a 256-point sweep"
N = 16


def add_arguments(p) -> None:
    p.add_argument("--seed", type=SEED, default=0)
    p.add_argument("--naive-points", type=integer(8, 100_000), default=256,
                   help="points of the fixed sweep compared with (default 256)")


class _Rig:
    def __init__(self, seed: int, monitors: bool = True):
        self.rig = EmulatedRig(rig_spec("lumion"), seed=seed, switching_s=0.0,
                               chip_monitors=monitors)

    def __enter__(self) -> Station:
        self.rig.start()
        ep = self.rig.endpoints
        self.dac = HeaterDAC(ep["dac"])
        self.dac.open()
        self.ocs = OpticalCircuitSwitch(ep["ocs"])
        self.meter = PowerMeter(ep["powermeter"], ports=N)
        for port in range(1, N + 1):        # no averaging here: the lab time counts 10 ms
            self.meter.set_averaging_time(port, 0.0)
        self.laser = Laser(ep["laser"])
        self.laser.set_power_mw(1.0)
        self.laser.on()
        return Station(benes(N), self.dac, self.ocs, self.meter)

    def __exit__(self, *exc) -> None:
        for d in (self.dac, self.ocs, self.meter, self.laser):
            d.close()
        self.rig.close()


def _naive(station: Station, points: int) -> dict:
    """Every cell swept on a fixed grid of `points` powers (same routes, same fit)."""
    cal = Calibrator(station)
    cal.prepare()
    t0 = time.perf_counter()
    grid = np.linspace(0.0, cal.p_max_mw, points)
    for cell in cal.order():
        route = cal.graph.route(cell)
        ch = cal.channel_of[cell]
        station.set_volts({c: 0.0 for c in cal.channels})
        station.set_volts(cal.settings({**route.cells, **route.away}))
        station.light(route.port)
        ys, ps = [], []
        for p in grid:
            station.set_volts({ch: heater_volts(float(p), cal.r_ohm[ch])})
            v = float(station.commanded()[ch])
            pd = station.monitors_ua()
            y = pd[cell] / (pd[route.reference] if route.reference else 1.0)
            ps.append(1000.0 * v * v / cal.r_ohm[ch])
            ys.append(y)
        fit = fit_fringe(ps, ys)
        station.set_volts({ch: 0.0})
        off = (fit.offset - (np.pi if route.arm == 1 else 0.0)) % (2 * np.pi)
        cal.state["fits"][cell] = CellFit(
            cell, ch, route.arm, off, fit.offset_std, fit.rad_per_mw, fit.rad_per_mw_std,
            fit.mean, fit.amplitude, fit.residual_rms, [0.0] * len(station.commanded()), [],
            ps, ys, "pd", points).to_dict()
    return {"wall_s": time.perf_counter() - t0}


class _Phases:
    """A calibration's `on_progress`: wall time and the growth of some counters per phase
    (a phase ends at its last progress call)."""

    def __init__(self, counters: dict):
        self.counters = counters                # name -> function giving the count now
        self.seconds: dict[str, float] = {}
        self.counts: dict[str, dict[str, int]] = {k: {} for k in counters}
        self._last = time.perf_counter(), {k: f() for k, f in counters.items()}

    def __call__(self, phase: str, cell: str, done: int, total: int) -> None:
        if done != total:
            return
        now, before = time.perf_counter(), self._last[1]
        self.seconds[phase] = self.seconds.get(phase, 0.0) + now - self._last[0]
        counts = {k: f() for k, f in self.counters.items()}
        for k, n in counts.items():
            self.counts[k][phase] = self.counts[k].get(phase, 0) + n - before[k]
        self._last = now, counts


def run(args) -> dict:
    rows = []
    with _Rig(args.seed) as station:
        t0 = time.perf_counter()
        progress = _Phases({"commands": lambda: station.counters.serial_commands,
                            "reads": lambda: station.counters.pd_reads})
        cal = calibrate(station, rig="lumion", on_progress=progress)
        phases, commands, reads = (progress.seconds, progress.counts["commands"],
                                   progress.counts["reads"])
        wall = time.perf_counter() - t0
        c = station.counters
        fringe = np.mean([cell["measurements"] for cell in cal.cells.values()])
        per_cell_total = c.pd_reads / len(cal.cells)
        lab = station.lab_time_s(1e-3, 10e-3, 0.0)
        rows.append({"method": "adaptive + crosstalk + refinements", "wall_s": f"{wall:.1f}",
                     "fringe_meas_per_cell": f"{fringe:.1f}",
                     "all_meas_per_cell": f"{per_cell_total:.0f}",
                     "serial_cmds": c.serial_commands, "lab_time_s": f"{lab:.0f}"})
        sweep_cmds = commands.get("sweep", 0)
        rows.append({"method": "  of which the adaptive sweeps", "wall_s": f"{phases['sweep']:.1f}",
                     "fringe_meas_per_cell": f"{reads['sweep'] / len(cal.cells):.1f}",
                     "all_meas_per_cell": "",
                     "serial_cmds": sweep_cmds, "lab_time_s": f"{sweep_cmds * 1e-3:.0f}"})
        ours = {"wall_s": wall, "phases_s": phases, "phase_serial_commands": commands,
                "phase_pd_reads": reads,
                "counters": c.as_dict(),
                "fringe_measurements_per_cell": fringe,
                "measurements_per_cell": per_cell_total, "lab_time_s": lab}
    with _Rig(args.seed) as station:
        naive = _naive(station, args.naive_points)
        c = station.counters
        per_cell = c.pd_reads / len(station.topology.cells)
        lab = station.lab_time_s(1e-3, 10e-3, 0.0)
        rows.append({"method": f"fixed {args.naive_points}-point sweep (no crosstalk)",
                     "wall_s": f"{naive['wall_s']:.1f}",
                     "fringe_meas_per_cell": f"{per_cell:.0f}",
                     "all_meas_per_cell": f"{per_cell:.0f}",
                     "serial_cmds": c.serial_commands, "lab_time_s": f"{lab:.0f}"})
        naive.update({"counters": c.as_dict(), "measurements_per_cell": per_cell,
                      "lab_time_s": lab})
    outputs = _outputs_method(args.seed, rows)
    notes = ["lab time: 1 ms per serial command (heater line, PDALL?, IALL?), 10 ms per power "
             "meter reading; the monitors method reads the cells' photodiodes, not the meter",
             "phases (s): " + ", ".join(f"{k} {v:.1f}" for k, v in phases.items()),
             "outputs method (chip without photodiodes): phases (s): "
             + ", ".join(f"{k} {v:.1f}" for k, v in outputs["phases_s"].items())
             + f"; {outputs['counters']['selector_switches']} input switches (at 25 ms each: "
             f"+{outputs['counters']['selector_switches'] * 0.025:.0f} s of lab time)"]
    return {"rows": rows, "ours": ours, "naive": naive, "outputs": outputs, "notes": notes}


def _outputs_method(seed: int, rows: list) -> dict:
    """The same chip without monitor photodiodes, calibrated from the power meter on its
    outputs (calibration.outputs): two sweeps a cell, crosstalk and refinement."""
    with _Rig(seed, monitors=False) as station:
        t0 = time.perf_counter()
        progress = _Phases({"reads": lambda: station.counters.meter_reads})
        cal = calibrate(station, rig="lumion", method="outputs", on_progress=progress)
        phases, reads = progress.seconds, progress.counts["reads"]
        wall = time.perf_counter() - t0
        c = station.counters
        cells = len(cal.cells)
        fringe = np.mean([cell["measurements"] for cell in cal.cells.values()])
        lab = station.lab_time_s(1e-3, 10e-3, 0.0)
        rows.append({"method": "outputs (no photodiodes): both sweeps + crosstalk + refine",
                     "wall_s": f"{wall:.1f}", "fringe_meas_per_cell": f"{fringe:.1f}",
                     "all_meas_per_cell": f"{c.meter_reads / cells:.0f}",
                     "serial_cmds": c.serial_commands, "lab_time_s": f"{lab:.0f}"})
        rows.append({"method": "  of which the sweeps (bootstrap + final)",
                     "wall_s": f"{phases['sweep']:.1f}",
                     "fringe_meas_per_cell": f"{reads['sweep'] / cells:.1f}",
                     "all_meas_per_cell": "", "serial_cmds": "",
                     "lab_time_s": f"{reads['sweep'] * 10e-3:.0f}"})
        return {"wall_s": wall, "phases_s": phases, "phase_meter_reads": reads,
                "counters": c.as_dict(), "measurements_per_cell": c.meter_reads / cells,
                "lab_time_s": lab}
