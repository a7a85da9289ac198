"""`ptb calibrate`: calibrate a chip on a rig and write its calibration file.

The rig is a rig file (hil.rig: its heater DAC, OCS input selector, power meter and laser), an
endpoints JSON from `ptb emulate --endpoints`, or, for convenience, an emulated rig (a name, or
a TOML file with an [emulator] table), which is then started in this process. With a rig file,
the bus services of the devices it drives are asked first: while one runs, nothing is opened
(one writer per device). Progress is saved after every cell (temp file + rename) beside the
output; Ctrl-C stops, and the same command continues from there. `--resave FILE` rewrites a
calibration file of an earlier version with its checksum.
"""
from __future__ import annotations

import contextlib
import json
import logging
import pathlib
import sys
import time
from typing import Any

from photonic_testbed.hil.files import WAIT_S, write_atomic
from photonic_testbed.ptb.cli import CommandFailed, check_output

log = logging.getLogger(__name__)


def add_parser(sub) -> None:
    p = sub.add_parser(
        "calibrate", help="calibrate a chip (heater offsets, efficiencies, crosstalk)",
        description="Calibrate the chip of a rig cell by cell through its instruments and write "
        "the calibration file (docs/calibration.md). --rig takes a rig file (TOML), or an "
        "emulated rig (its name, e.g. lumion, or a TOML file with an [emulator] table), which "
        "is then started inside this process for convenience; --endpoints takes the JSON "
        "written by `ptb emulate --endpoints`. With a rig file, calibration is refused while a "
        "bus service of the rig drives the chip or the instruments (stop `ptb serve` first). "
        "Interrupt with Ctrl-C: progress is kept and the same command continues.")
    p.add_argument("--rig", metavar="NAME_OR_FILE",
                   help="rig file, or an emulated rig's name or [emulator] TOML (started "
                   "in-process)")
    p.add_argument("--endpoints", metavar="FILE", help="endpoints JSON of `ptb emulate`")
    p.add_argument("--topology", default="benes16",
                   help="chip topology with --endpoints (default benes16)")
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument("--out", metavar="FILE", help="calibration file to write")
    what.add_argument("--update", metavar="FILE",
                      help="calibrate the --cells again and write them into this calibration "
                      "file (every other heater and crosstalk entry is kept)")
    what.add_argument("--drift-check", metavar="FILE",
                      help="instead of calibrating: measure a few cells against this "
                      "calibration file and say whether to recalibrate (exit 0: keep it, "
                      "exit 3: recalibrate)")
    what.add_argument("--resave", metavar="FILE",
                      help="instead of calibrating: read this calibration file (an earlier "
                      "version without a checksum too) and write it again in the current "
                      "version, with its checksum; needs no rig")
    p.add_argument("--drift-threshold-rad", type=float, default=0.05,
                   help="phase error above which --drift-check advises recalibrating "
                   "(default 0.05 rad)")
    p.add_argument("--report", metavar="DIR", help="also write PNG figures and a summary here")
    p.add_argument("--cells", nargs="+", metavar="CELL",
                   help="calibrate only these cells (and the cells their light needs)")
    p.add_argument("--progress", metavar="FILE",
                   help="where progress is kept (default: OUT.progress.json)")
    p.add_argument("--fresh", action="store_true", help="ignore saved progress, start over")
    p.add_argument("--method", choices=("monitors", "outputs"),
                   help="read the cells' monitor photodiodes, or the power meter on the chip's "
                   "outputs (default: monitors when the heater DAC reads photodiodes, else "
                   "outputs)")
    p.add_argument("--no-monitors", action="store_true",
                   help="an emulated rig started here gets a chip without cell photodiodes")
    p.add_argument("--no-crosstalk", action="store_true",
                   help="skip the crosstalk measurement (and the refinement that needs it)")
    p.add_argument("--averaging-s", type=float, default=0.0,
                   help="power meter averaging time per reading, s (default 0)")
    p.add_argument("--laser-mw", type=float, default=1.0, help="laser power, mW (default 1)")
    p.add_argument("--seed", type=int, default=0, help="seed of an in-process emulated rig")
    p.add_argument("--timeout-s", type=float, default=10.0,
                   help="how long an instrument may stay silent (default 10 s: on a busy "
                   "machine an emulated rig in this process can pause for seconds)")
    p.set_defaults(func=run)


# ---- finding the instruments ----------------------------------------------------------------

def topology_by_name(name: str):
    """The chip topology a name ("benes16") or a JSON file stands for."""
    from photonic_testbed.common.topology import TopologyError
    from photonic_testbed.drivers.mesh import read_topology
    try:
        return read_topology(name)
    except TopologyError as e:
        raise CommandFailed(f"topology {name!r}: {e}") from None


def read_rig(path: str):
    from photonic_testbed.hil import rig as rigfile
    try:
        return rigfile.load(path, wait_s=WAIT_S)
    except rigfile.RigFileError as e:
        raise CommandFailed(str(e)) from None


def endpoints_from_rig(rig) -> tuple[dict[str, str], dict[str, Any]]:
    """(endpoints like `ptb emulate` writes, the rig's device behind each) of a rig file."""
    ep: dict[str, str] = {}
    used: dict[str, Any] = {}
    heaters = rig.chip.heaters if rig.chip and rig.chip.heaters else ""
    for name, dev in rig.devices.items():
        if dev.kind in ("heater_dac", "chip") and (not heaters or name == heaters):
            key = "dac"
        elif dev.kind == "switch" and dev.driver.endswith("OpticalCircuitSwitch"):
            key = "ocs"
        elif dev.kind == "power_meter":
            key = "powermeter"
        elif dev.kind == "laser":
            key = "laser"
        else:
            continue
        if key not in ep:
            ep[key], used[key] = dev.address, dev
    if rig.chip is None:
        raise CommandFailed(f"rig file {rig.path} names no chip to calibrate")
    return ep, used


PROBE_S = 2.0        # how long a service on the bus may take to answer the ping


def _serving(endpoint: str, keys) -> bool:
    """Whether a bus service answers at `endpoint` (read-only `ping`). A refused TCP
    connection settles it at once; anything listening gets the ping, and any answer (an error
    too) means a service is there."""
    import socket
    from urllib.parse import urlsplit

    from photonic_testbed.hil.bus.client import BusError, ServiceClient, ServiceUnavailable
    where = urlsplit(endpoint)
    try:
        with socket.create_connection((where.hostname, where.port), timeout=PROBE_S):
            pass
    except ConnectionRefusedError:
        return False
    except (OSError, ValueError):
        pass                                  # unreachable or slow: let the ping decide
    client = ServiceClient(endpoint, timeout=PROBE_S, keys=keys)
    try:
        client.call("ping")
        return True
    except ServiceUnavailable:
        return False
    except BusError:
        return True
    finally:
        client.close()


def refuse_if_served(rig, used: dict[str, Any]) -> None:
    """One writer per device: refuse to calibrate while a bus service of this rig drives the
    chip's heater DAC (its `chip` or `heater_dac` service) or another instrument calibration
    drives (the OCS, the laser, the power meter). Asked before any instrument is opened."""
    from concurrent.futures import ThreadPoolExecutor

    from photonic_testbed.hil.bus.security import KeyFileError
    try:
        keys = rig.client_keys()
    except KeyFileError as e:
        keys = None
        log.warning("cannot read this host's bus keys (%s): services that check keys cannot "
                    "be asked whether they run; the heater DAC's port lock still keeps a "
                    "second writer out", e)
    devices = [d for d in used.values() if not d.request.endswith(":0")]
    with ThreadPoolExecutor(max_workers=max(1, len(devices))) as pool:
        up = list(pool.map(lambda d: _serving(d.request, keys), devices))
    running = [d for d, yes in zip(devices, up, strict=True) if yes]
    if running:
        names = "; ".join(f"the {d.kind} service {d.name!r} at {d.request}" for d in running)
        raise CommandFailed(f"{names} is running on the bus and drives "
                            f"{'these devices' if len(running) > 1 else 'this device'}: stop "
                            f"it (stop `ptb serve --rig {rig.path}`) before calibrating, so "
                            "that one program at a time writes to the chip and its instruments")


class Instruments(contextlib.ExitStack):
    """The drivers opened on a rig's endpoints (closed on exit)."""

    def open(self, ep: dict[str, str], topology, args):
        from photonic_testbed.calibration.station import Station
        from photonic_testbed.drivers.heater_dac import DACError, HeaterDAC, PortInUse
        from photonic_testbed.drivers.laser import Laser
        from photonic_testbed.drivers.ocs import OpticalCircuitSwitch
        from photonic_testbed.drivers.power_meter import PowerMeter
        from photonic_testbed.drivers.scpi import InstrumentError
        missing = [k for k in ("dac", "ocs", "laser") if k not in ep]
        if missing:
            raise CommandFailed(f"the rig lacks {', '.join(missing)}: calibration needs the "
                                "heater DAC, the OCS input selector and the laser")
        where = "heater DAC"
        try:
            dac = HeaterDAC(ep["dac"], timeout=args.timeout_s,
                            reconnect_timeout=args.timeout_s)
            dac.open()
            self.callback(dac.close)
            where = "OCS"
            ocs = OpticalCircuitSwitch(ep["ocs"], timeout_s=args.timeout_s,
                     reconnect_s=args.timeout_s)
            self.callback(ocs.close)
            meter = None
            if "powermeter" in ep:
                where = "power meter"
                meter = PowerMeter(ep["powermeter"], ports=topology.ports,
                                   timeout_s=args.timeout_s, reconnect_s=args.timeout_s)
                self.callback(meter.close)
                for port in range(1, topology.ports + 1):
                    meter.set_averaging_time(port, args.averaging_s)
            where = "laser"
            laser = Laser(ep["laser"], timeout_s=args.timeout_s,
                     reconnect_s=args.timeout_s)
            self.callback(laser.close)
            laser.set_power_mw(args.laser_mw)
            laser.on()
        except PortInUse as e:
            raise CommandFailed(f"the heater DAC: {e}") from None
        except (DACError, InstrumentError, OSError) as e:
            raise CommandFailed(f"the {where} at {ep.get(_KEY[where])} does not answer: "
                                f"{e}") from None
        if dac.channels < topology.channels:
            raise CommandFailed(f"{topology.name} needs {topology.channels} heater channels; "
                                f"the DAC has {dac.channels}")
        return Station(topology, dac, ocs, meter)


_KEY = {"heater DAC": "dac", "OCS": "ocs", "power meter": "powermeter", "laser": "laser"}


# ---- progress ---------------------------------------------------------------------------------

class Progress:
    """A bar with an ETA on a terminal; otherwise (a log, the demo) a plain line when a phase is
    done, and one every LINE_S while it runs."""

    LINE_S = 5.0

    def __init__(self, stream=None):
        self.stream = stream or sys.stderr
        self.tty = self.stream.isatty()
        self.phase: str | None = None
        self.t0 = time.monotonic()
        self.last_line = self.t0

    def __call__(self, phase: str, cell: str, done: int, total: int) -> None:
        if phase != self.phase:
            if self.tty and self.phase is not None:
                self.stream.write("\n")
            self.phase, self.t0 = phase, time.monotonic()
            self.last_line = self.t0
        elapsed = time.monotonic() - self.t0
        eta = elapsed / done * (total - done) if done else 0.0
        if self.tty:
            width = 30
            fill = int(width * done / total)
            self.stream.write(f"\r{phase:<9} [{'#' * fill}{'.' * (width - fill)}] "
                              f"{done}/{total} {cell:<6} ETA {eta:5.0f} s")
            if done == total:
                self.stream.write("\n")
                self.phase = None
            self.stream.flush()
        elif done == total:
            print(f"{phase}: {total} cells in {elapsed:.1f} s", file=self.stream, flush=True)
        elif time.monotonic() - self.last_line >= self.LINE_S:
            self.last_line = time.monotonic()
            print(f"{phase}: {done}/{total} cells ({cell}), ETA {eta:.0f} s",
                  file=self.stream, flush=True)


def _save_json(path: pathlib.Path, data: dict) -> None:
    write_atomic(path, json.dumps(data))


# ---- the command ------------------------------------------------------------------------------

def run(args) -> int:
    if args.resave:
        check_output(args.resave, "--resave")
        return _resave(pathlib.Path(args.resave))
    if bool(args.rig) == bool(args.endpoints):
        raise CommandFailed("give the rig: either --rig NAME_OR_FILE or --endpoints FILE")
    if not 0 <= args.averaging_s <= 10:
        raise CommandFailed(f"--averaging-s must be in 0..10 s, not {args.averaging_s:g}")
    if not 0 < args.laser_mw <= 100:
        raise CommandFailed(f"--laser-mw must be in (0, 100], not {args.laser_mw:g}")
    out = pathlib.Path(args.out or args.update or args.drift_check)
    if args.update and not args.cells:
        raise CommandFailed("--update FILE recalibrates the cells named by --cells: name them "
                            "(or write a new file with --out)")
    check_output(args.out, "--out")
    check_output(args.update, "--update")
    check_output(args.progress, "--progress")
    check_output(args.report, "--report", folder=True)
    if not 0 < args.drift_threshold_rad < 3.2:
        raise CommandFailed("--drift-threshold-rad must be in (0, pi]")
    emulated_here = not args.endpoints and _emulated_here(args.rig)
    if args.no_monitors and not emulated_here:
        raise CommandFailed("--no-monitors chooses the chip of an emulated rig started by "
                            "this command (--rig NAME); a running rig's chip is as it is")
    progress_path = pathlib.Path(args.progress or f"{out}.progress.json")
    with contextlib.ExitStack() as stack:
        rig_name, chip_id = "", ""
        if args.endpoints:
            from photonic_testbed.hil.lab.session import SessionError, read_endpoints
            try:
                ep = read_endpoints(args.endpoints, wait_s=WAIT_S)
            except SessionError as e:
                raise CommandFailed(str(e)) from None
            topology = topology_by_name(args.topology)
        elif not emulated_here:
            rig = read_rig(args.rig)
            ep, used = endpoints_from_rig(rig)
            topology = topology_by_name(rig.chip.topology)
            rig_name = rig.name
            refuse_if_served(rig, used)
        else:
            ep, topo_name, rig_name = _start_emulated(stack, args)
            topology = topology_by_name(topo_name)
        chip_id = f"{rig_name}/{topology.name}" if rig_name else topology.name
        if args.drift_check:
            calibration = _load_calibration(out, topology, chip_id, "the drift check")
            station = stack.enter_context(Instruments()).open(ep, topology, args)
            return _drift(station, calibration, args)
        base = _load_calibration(out, topology, chip_id, "--update") if args.update else None
        station = stack.enter_context(Instruments()).open(ep, topology, args)
        return _calibrate(station, args, out, progress_path, rig_name, chip_id, base)


def _load_calibration(path: pathlib.Path, topology, chip_id: str, purpose: str):
    from photonic_testbed.drivers.mesh import CalibrationError, read_calibration
    try:
        calibration = read_calibration(path)
        calibration.check_chip(topology.name, chip_id)
    except CalibrationError as e:
        raise CommandFailed(f"cannot use {path} for {purpose}: {e}") from None
    return calibration


def _resave(path: pathlib.Path) -> int:
    """Read a calibration file and write it back in the current version (with a checksum)."""
    import warnings

    from photonic_testbed.common.calibration import (
        CALIBRATION_VERSION,
        UnverifiedCalibrationWarning,
    )
    from photonic_testbed.drivers.mesh import CalibrationError, read_calibration, write_calibration
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UnverifiedCalibrationWarning)
            calibration = read_calibration(path)
        write_calibration(calibration, path)
    except (CalibrationError, OSError) as e:
        raise CommandFailed(f"cannot re-save {path}: {e}") from None
    what = "had its checksum already" if calibration.verified else \
        "had no checksum: its values were checked one by one, not verified"
    print(f"{path}: {len(calibration.heaters)} heaters written as version "
          f"{CALIBRATION_VERSION} with a checksum (the file {what})")
    return 0


def _drift(station, calibration, args) -> int:
    from photonic_testbed.calibration.report import drift_check
    from photonic_testbed.drivers.heater_dac import DACError
    from photonic_testbed.drivers.scpi import InstrumentError
    try:
        report = drift_check(station, calibration, cells=args.cells,
                             threshold_rad=args.drift_threshold_rad, seed=args.seed)
    except (DACError, InstrumentError, OSError) as e:
        raise CommandFailed(f"an instrument stopped answering: {e}") from None
    for cell, err in sorted(report.cells.items()):
        print(f"  {cell}: phase error {err:+.4f} rad")
    verdict = "recalibrate" if report.recalibrate else "calibration still good"
    print(f"drift check: worst {report.worst:.4f} rad over {len(report.cells)} cells "
          f"(threshold {report.threshold_rad:g} rad): {verdict}")
    return 3 if report.recalibrate else 0


def _emulated_here(rig_arg: str) -> bool:
    """Whether --rig names an emulated rig to start here (a name, or a TOML file with an
    [emulator] table) rather than a rig file. A file's name (a .toml, or a path) is waited for
    when it is not there yet: another command may be writing it (hil.files)."""
    from photonic_testbed.hil.files import FileNotWritten, wait_for
    from photonic_testbed.hil.rig import RIGS, is_emulator_description
    if rig_arg in RIGS:
        return True
    path = pathlib.Path(rig_arg)
    if path.suffix == ".toml" or len(path.parts) > 1:
        try:
            wait_for(path, WAIT_S, "rig file")
        except FileNotWritten as e:
            raise CommandFailed(f"--rig {rig_arg}: {e}") from None
    return not path.exists() or is_emulator_description(path)


def _start_emulated(stack, args):
    from photonic_testbed.emulator.rig import EmulatedRig
    from photonic_testbed.hil.rig import RigFileError, rig_spec
    try:
        spec = rig_spec(args.rig)
    except RigFileError as e:
        raise CommandFailed(f"--rig {args.rig!r}: {e}") from None
    if not spec.chip_kind:
        raise CommandFailed(f"the emulated rig {spec.name} has no chip to calibrate")
    rig = EmulatedRig(spec, seed=args.seed, switching_s=0.0,
                      chip_monitors=not args.no_monitors)
    try:
        rig.start()
    except OSError as e:
        raise CommandFailed(f"cannot start the emulated rig {spec.name}: {e}") from None
    stack.callback(rig.close)
    print(f"started the emulated rig {spec.name} (seed {args.seed}"
          f"{', chip without photodiodes' if args.no_monitors else ''}) in this process",
          file=sys.stderr)
    return rig.endpoints, spec.chip_topology, spec.name


def _calibrate(station, args, out, progress_path, rig_name, chip_id, base=None) -> int:
    """Calibrate and write `out`; with `base` (--update), the run's cells merged into it."""
    from photonic_testbed.calibration.progressive import CalibrationRunError
    from photonic_testbed.calibration.run import calibrate
    from photonic_testbed.calibration.station import StationError
    from photonic_testbed.drivers.heater_dac import DACError
    from photonic_testbed.drivers.scpi import InstrumentError
    state = None
    if progress_path.exists() and not args.fresh:
        try:
            state = json.loads(progress_path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as e:
            raise CommandFailed(f"cannot read the saved progress {progress_path}: {e} "
                                "(use --fresh to start over)") from None
        print(f"continuing from {progress_path} ({len(state.get('fits', {}))} cells swept)",
              file=sys.stderr)
    t0 = time.monotonic()
    try:
        method = args.method or ("monitors" if station.has_monitors() else "outputs")
        if args.method is None:
            print(f"method {method}: the heater DAC "
                  f"{'reads' if method == 'monitors' else 'reads no'} monitor photodiodes",
                  file=sys.stderr)
        cal = calibrate(station, cells=args.cells, rig=rig_name, chip_id=chip_id, state=state,
                        crosstalk=not args.no_crosstalk, method=method, on_progress=Progress(),
                        on_checkpoint=lambda s: _save_json(progress_path, s))
    except KeyboardInterrupt:
        print(f"\ninterrupted: progress is saved in {progress_path}; run the same command "
              "again to continue", file=sys.stderr)
        return 130
    except (DACError, InstrumentError, OSError) as e:
        raise CommandFailed(f"an instrument stopped answering: {e}; progress is saved in "
                            f"{progress_path}") from None
    except (CalibrationRunError, StationError, ValueError) as e:
        raise CommandFailed(str(e)) from None
    if base is not None:
        from photonic_testbed.drivers.mesh import CalibrationError
        try:
            cal, run_heaters = base.merged(cal), len(cal.heaters)
        except CalibrationError as e:
            raise CommandFailed(f"cannot update {out}: {e}") from None
        print(f"{run_heaters} heaters calibrated again ({', '.join(args.cells)} and the cells "
              f"their light needs); the other {len(cal.heaters) - run_heaters} kept")
    from photonic_testbed.drivers.mesh import CalibrationError, write_calibration
    try:
        write_calibration(cal, out)
    except (CalibrationError, OSError) as e:
        raise CommandFailed(f"cannot write {out}: {e}; progress is saved in "
                            f"{progress_path}") from None
    progress_path.unlink(missing_ok=True)
    reads = (f"{station.counters.pd_reads} photodiode reads" if method == "monitors" else
             f"{station.counters.meter_reads} power meter reads")
    print(f"calibration of {len(cal.heaters)} heaters ({method}) written to {out} in "
          f"{time.monotonic() - t0:.1f} s ({reads})")
    if args.report:
        from photonic_testbed.calibration.report import write_report
        summary = write_report(cal, args.report)
        print(summary)
    return 0
