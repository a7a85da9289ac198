"""A whole calibration run: resistances, progressive sweeps, crosstalk, refinement, the file.

`calibrate(station, ...)` runs every phase, reporting progress through `on_progress(phase,
cell, done, total)` and handing its resumable state to `on_checkpoint(state)` after every cell
(the command line saves it atomically; a rerun passes it back as `state` and continues). It
returns a `drivers.mesh.Calibration` ready to save and to give to `Mesh`. `method` chooses the
detector: the cells' monitor photodiodes, or the power meter on the chip's outputs
(`calibration.outputs`, for a chip without photodiodes); the file says which.
"""
from __future__ import annotations

import datetime
import logging
import math
from collections.abc import Callable

import numpy as np

from photonic_testbed.calibration.crosstalk import (
    extinction_db,
    measure_crosstalk,
    measure_extinctions,
    refine_offsets,
    refine_under_load,
)
from photonic_testbed.calibration.outputs import output_calibrator, sweep_from_outputs
from photonic_testbed.calibration.progressive import Calibrator, CellFit
from photonic_testbed.calibration.station import Station, StationError
from photonic_testbed.common.calibration import Calibration, HeaterCalibration

log = logging.getLogger(__name__)

STATE_VERSION = 2           # 2: rows solved with the route's moves, load checks, extinctions
SPLITTER_LIMIT_DB = 35.0       # a fringe whose extinction is below this is splitter-limited


METHODS = ("monitors", "outputs")


def calibrate(station: Station, *, cells: list[str] | None = None, rig: str = "",
              chip_id: str = "", state: dict | None = None, crosstalk: bool = True,
              refine: bool = True, radius: float = 2.5, method: str = "monitors",
              on_progress: Callable[[str, str, int, int], None] | None = None,
              on_checkpoint: Callable[[dict], None] | None = None) -> Calibration:
    """`method`: "monitors" reads the cells' photodiodes (through the DAC), "outputs" the
    power meter on the chip's outputs (calibration.outputs; for chips without photodiodes)."""
    progress = on_progress or (lambda *a: None)
    if method not in METHODS:
        raise ValueError(f"calibration method {method!r}: known methods are "
                         f"{', '.join(METHODS)}")
    if method == "monitors" and not station.has_monitors():
        raise StationError(f"{station.topology.name}: the chip has no monitor photodiodes (the "
                           "heater DAC reads none); calibrate it from its outputs (method "
                           "outputs: ptb calibrate --method outputs)")
    if method == "outputs" and station.topology.recirculating:
        raise StationError(f"{station.topology.name}: a recirculating mesh is calibrated with "
                           "its monitor photodiodes (method monitors); from its outputs alone "
                           "only a feed-forward mesh (benes, clements) can be")
    if state is not None and state.get("method", "monitors") != method:
        raise ValueError(f"the saved progress is of the {state.get('method', 'monitors')} "
                         f"method, not {method}; delete it to start over")
    if state is not None and state.get("version") != STATE_VERSION:
        raise ValueError("the saved progress is from another version of the calibration; "
                         "delete it to start over")
    if state is not None and state.get("chip") != station.topology.name:
        raise ValueError(f"the saved progress is for chip {state.get('chip')!r}, not "
                         f"{station.topology.name!r}")
    state = state if state is not None else {"version": STATE_VERSION,
                                             "chip": station.topology.name, "method": method}
    if method == "outputs":
        cal = output_calibrator(station, state=state,
                                on_progress=lambda c, k, n: progress("sweep", c, k, n),
                                on_checkpoint=on_checkpoint)
        sweep_from_outputs(cal, cells)
    else:
        cal = Calibrator(station, state=state,
                         on_progress=lambda c, k, n: progress("sweep", c, k, n),
                         on_checkpoint=on_checkpoint)
        cal.calibrate_cells(cells)
    if crosstalk:
        between = None
        if refine and station.topology.recirculating:
            # a hexagonal mesh's sweeps see light come back through cells not yet calibrated
            # (efficiencies some % off on a chip of strong crosstalk), and the crosstalk's
            # quadrature points stand on them: refined after the first pass, the second
            # pass measures with the efficiencies right (docs/calibration.md)
            def between(npass: int) -> None:
                refine_offsets(cal, key=f"refined_pass{npass + 1}",
                               on_progress=lambda c, k, n: progress("refine", c, k, n))
        passes = 3 if station.topology.recirculating else 2
        measure_crosstalk(cal, radius=radius, between=between, passes=passes,
                          on_progress=lambda c, k, n: progress("crosstalk", c, k, n))
        if refine:
            # from the outputs, a second round of four-step checks halves the offsets' error
            # on a chip of strong crosstalk (docs/calibration.md)
            refine_offsets(cal, rounds=2 if method == "outputs" else 1,
                           on_progress=lambda c, k, n: progress("refine", c, k, n))
            refine_under_load(cal, radius=radius,
                              on_progress=lambda c, k, n: progress("load", c, k, n))
            if method == "monitors":
                measure_extinctions(cal, on_progress=lambda c, k, n:
                                    progress("extinction", c, k, n))
    station.set_volts({ch: 0.0 for ch in station.channels})
    result = build_calibration(cal, rig=rig, chip_id=chip_id, method=method)
    if method == "outputs":
        # which cells had their final sweep ("bootstrap": only the first one; --cells)
        final = set(cal.state.get("outputs_final", []))
        for cell, rec in result.cells.items():
            rec["sweep"] = "final" if cell in final else "bootstrap"
    return result


def splitter_estimate(fit: CellFit) -> dict:
    """What the fringe's visibility says about the cell's couplers: the bar extinction the
    splitters allow, the coupler imbalance |r1 - r2| behind it, and whether it limits."""
    ext = extinction_db(fit.mean - fit.amplitude, fit.mean + fit.amplitude)
    v = min(1.0, max(0.0, fit.visibility))
    imbalance = math.sqrt(max(0.0, (1.0 - v) / (1.0 + v)))
    return {"extinction_db": ext, "visibility": v,
            "coupler_imbalance": imbalance, "splitter_limited": ext < SPLITTER_LIMIT_DB}


def measured_extinction(bar_db: float | None, cross_db: float | None,
                        estimate: dict | None = None) -> dict:
    """The record's fields from the measured bar and cross extinctions (dB): the coupler
    errors behind them, |r1 - r2| ~ sqrt(bar leak) and |r1 + r2 - 1| ~ sqrt(cross leak),
    and whether either limits the cell. One not measured (None: its input arm could not be
    lit) leaves the fringe's `estimate` (splitter_estimate) in its place."""
    out = dict(estimate or {})
    if bar_db is not None:
        out.update({"extinction_db": bar_db, "extinction_from": "settings",
                    "coupler_imbalance": math.sqrt(10.0 ** (-bar_db / 10.0))})
    if cross_db is not None:
        out.update({"cross_extinction_db": cross_db,
                    "coupler_sum_error": math.sqrt(10.0 ** (-cross_db / 10.0))})
    measured = [db for db in (bar_db, cross_db) if db is not None]
    if measured:
        limited = min(measured) < SPLITTER_LIMIT_DB
        out["splitter_limited"] = limited or (bar_db is None and
                                              bool(out.get("splitter_limited", False)))
    return out


def build_calibration(cal: Calibrator, rig: str = "", chip_id: str = "",
                      method: str = "monitors") -> Calibration:
    topo = cal.station.topology
    fits = cal.fits()
    offsets = cal.offsets()
    r = cal.r_ohm
    heaters, record = {}, {}
    for c in topo.cells:
        ch = c.channels[0]
        f = fits.get(c.id)
        if f is None:
            continue
        p_pi_std = math.pi * f.rad_per_mw_std / f.rad_per_mw ** 2
        heaters[ch] = HeaterCalibration(offsets[c.id], f.p_pi_mw, r[ch], f.offset_std,
                                        p_pi_std, c.id)
        dense_p = np.linspace(0.0, max(f.sweep_p_mw), 121)
        model = f.mean + f.amplitude * np.cos(f.offset_apparent + math.pi * (f.arm == 1)
                                              + f.rad_per_mw * dense_p)
        record[c.id] = {"channels": list(c.channels), "sweep_v": f.sweep_v,
                        "sweep_p_mw": f.sweep_p_mw, "power": f.readings,
                        "fit_v": np.sqrt(dense_p * r[ch] / 1000.0).tolist(),
                        "fit_power": model.tolist(), "detector": f.detector,
                        "residual_rms": f.residual_rms, "measurements": f.measurements,
                        "p_pi_mw": f.p_pi_mw, "offset_rad": offsets[c.id],
                        **splitter_estimate(f)}
        measured = cal.state.get("extinction", {}).get(c.id)
        if measured is not None:
            record[c.id].update(measured_extinction(measured.get("bar_db"),
                                                    measured.get("cross_db"), record[c.id]))
    chans = sorted(heaters)
    k = k_std = None
    if cal.crosstalk is not None:
        k = cal.crosstalk[np.ix_(chans, chans)]
        k_std = _crosstalk_spread(cal, chans)
    date = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    return Calibration(heaters, k, topo.name, "calibration run", chip_id or topo.name, rig,
                       date, method, k_std, record)


def _crosstalk_spread(cal: Calibrator, chans: list[int]) -> np.ndarray:
    """Per pair: half the difference between the last two passes (0 with one pass)."""
    from photonic_testbed.calibration.crosstalk import crosstalk_matrix
    keys = [k for k in ("crosstalk", "crosstalk2", "crosstalk3") if cal.state.get(k)]
    n = 1 + max(cal.channels)
    if len(keys) < 2:
        return np.zeros((len(chans), len(chans)))
    a = crosstalk_matrix(cal.state[keys[-1]], n)
    b = crosstalk_matrix(cal.state[keys[-2]], n)
    return (np.abs(a - b) / 2.0)[np.ix_(chans, chans)]
