"""The calibration report: PNG figures (matplotlib, off-screen) and a short text summary; and
the drift check, a quick run on a few cells that says whether to recalibrate."""
from __future__ import annotations

import logging
import math
import os
import pathlib
from dataclasses import dataclass

import numpy as np

from photonic_testbed.calibration.crosstalk import EXTINCTION_CAP_DB
from photonic_testbed.drivers.mesh import Calibration

log = logging.getLogger(__name__)


def summary(cal: Calibration) -> str:
    cells = cal.cells
    ext = np.array([c["extinction_db"] for c in cells.values()]) if cells else np.array([])
    limited = sorted(cid for cid, c in cells.items() if c.get("splitter_limited"))
    p_pi = np.array([h.p_pi_mw for h in cal.heaters.values()])
    off_std = np.array([h.offset_std for h in cal.heaters.values()])
    lines = [f"chip {cal.chip} ({cal.chip_id}) on rig {cal.rig or '?'}, {cal.date}, "
             f"method {cal.method or '?'}",
             f"heaters: {len(cal.heaters)}; P_pi {p_pi.min():.2f}..{p_pi.max():.2f} mW; "
             f"offset uncertainty median {np.median(off_std) * 1e3:.2f} mrad, "
             f"max {off_std.max() * 1e3:.2f} mrad"]
    if len(ext):
        where = "the outputs" if cal.method == "outputs" else "the monitors"
        worst = min(cells, key=lambda c: cells[c]['extinction_db'])
        lines.append(f"bar extinction at {where}: median {np.median(ext):.1f} dB, "
                     f"worst {ext.min():.1f} dB ({worst})")
        cross = {cid: c["cross_extinction_db"] for cid, c in cells.items()
                 if "cross_extinction_db" in c}
        if cross:
            worst = min(cross, key=lambda cid: cross[cid])
            lines.append(f"cross extinction at the monitors: median "
                         f"{np.median(list(cross.values())):.1f} dB, worst {cross[worst]:.1f} dB "
                         f"({worst})")
        if any(c.get("extinction_from") == "settings" for c in cells.values()):
            # (a recirculating mesh: a cell whose input arm is at a free end cannot be lit on it)
            unlit_bar = sorted(cid for cid, c in cells.items()
                               if c.get("extinction_from") != "settings")
            unlit_cross = sorted(cid for cid, c in cells.items()
                                 if "cross_extinction_db" not in c)
            if unlit_bar or unlit_cross:
                lines.append(f"extinction not measured at the settings (the input arm cannot be "
                             f"lit): bar {', '.join(unlit_bar) or 'none'}; cross "
                             f"{', '.join(unlit_cross) or 'none'} (bar: the fringe's estimate)")
        lines.append(f"splitter-limited cells (< 35 dB whatever the phase): "
                     f"{', '.join(limited) if limited else 'none'}")
        meas = [c.get("measurements", 0) for c in cells.values()]
        lines.append(f"fringe measurements per cell: mean {np.mean(meas):.1f}")
    if cal.crosstalk is not None:
        k = cal.crosstalk
        nz = k[k != 0]
        lines.append(f"crosstalk: {len(nz)} pairs measured, largest {k.max():.4f}, "
                     f"median {np.median(nz) if len(nz) else 0:.4f} (fraction of a heater's "
                     "power felt by its neighbour)")
    else:
        lines.append("crosstalk: not measured (no compensation)")
    return "\n".join(lines)


def _extinction_plot(plt, cells: dict, ids: list[str]) -> None:
    """Each cell's bar (and, where measured, cross) extinction; its legend says what the colours
    and the shades mean, and values at the cap are hatched and said to be a floor."""
    from matplotlib.patches import Patch
    fig, ax = plt.subplots(figsize=(12, 3.4))
    ext = [cells[c]["extinction_db"] for c in ids]
    colours = ["tab:red" if cells[c].get("splitter_limited") else "tab:blue" for c in ids]
    cross = [cells[c].get("cross_extinction_db") for c in ids]
    both = all(x is not None for x in cross)
    x = np.arange(len(ids))
    width = 0.4 if both else 0.8
    series = [(x - 0.2 if both else x, ext, 1.0)] + ([(x + 0.2, cross, 0.45)] if both else [])
    capped = False
    for at, values, alpha in series:
        hatch = ["//" if v >= EXTINCTION_CAP_DB else "" for v in values]
        capped = capped or any(hatch)
        for xi, v, colour, h in zip(at, values, colours, hatch, strict=True):
            ax.bar(xi, v, width=width, color=colour, alpha=alpha, hatch=h, edgecolor="white")
    handles = [Patch(color="tab:blue", label="fitted by its heater"),
               Patch(color="tab:red", label="limited by its splitters")]
    if both:
        handles += [Patch(color="grey", label="bar (solid)"),
                    Patch(color="grey", alpha=0.45, label="cross (light)")]
    if capped:
        ax.axhline(EXTINCTION_CAP_DB, color="black", lw=0.6, ls="--")
        handles.append(Patch(facecolor="white", edgecolor="black", hatch="//",
                             label=f">= {EXTINCTION_CAP_DB:g} dB: below the detector's floor,\n"
                             "written as the cap"))
    ax.legend(handles=handles, fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    ax.set_ylabel("extinction (dB)" if both else "bar extinction (dB)")
    ax.set_xticks(x, ids, rotation=90, fontsize=6)
    ax.set_title("extinction per cell")
    fig.tight_layout()


def write_report(cal: Calibration, folder: str | os.PathLike) -> str:
    """fringes.png, extinction.png, crosstalk.png and summary.txt in `folder`."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    out = pathlib.Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    cells = cal.cells
    ids = list(cells)
    if ids:
        cols = 8
        rows = math.ceil(len(ids) / cols)
        fig, axes = plt.subplots(rows, cols, figsize=(2.2 * cols, 1.7 * rows), squeeze=False)
        for ax, cid in zip(axes.flat, ids, strict=False):
            c = cells[cid]
            ax.plot(c["sweep_p_mw"], c["power"], ".", ms=3)
            p_fit = np.asarray(c["fit_v"]) ** 2
            h = cal.heaters[c["channels"][0]]
            ax.plot(1000.0 * p_fit / h.r_ohm, c["fit_power"], "-", lw=0.8)
            ax.set_title(cid, fontsize=7)
            ax.tick_params(labelsize=5)
        for ax in list(axes.flat)[len(ids):]:
            ax.axis("off")
        fig.supxlabel("heater power (mW)")
        fig.supylabel("monitor reading")
        fig.tight_layout()
        fig.savefig(out / "fringes.png", dpi=90)
        plt.close(fig)
        _extinction_plot(plt, cells, ids)
        fig = plt.gcf()
        fig.savefig(out / "extinction.png", dpi=90)
        plt.close(fig)
    if cal.crosstalk is not None:
        fig, ax = plt.subplots(figsize=(6, 5))
        im = ax.imshow(cal.crosstalk, cmap="viridis")
        fig.colorbar(im, ax=ax, label="k_ij")
        ax.set_xlabel("heated channel j")
        ax.set_ylabel("affected channel i")
        ax.set_title("thermal crosstalk")
        fig.tight_layout()
        fig.savefig(out / "crosstalk.png", dpi=90)
        plt.close(fig)
    text = summary(cal)
    (out / "summary.txt").write_text(text + "\n")
    return text


@dataclass(frozen=True)
class DriftReport:
    cells: dict[str, float]          # cell -> phase error now (rad)
    threshold_rad: float

    @property
    def worst(self) -> float:
        return max((abs(v) for v in self.cells.values()), default=0.0)

    @property
    def recalibrate(self) -> bool:
        return self.worst > self.threshold_rad


def drift_check(station, calibration: Calibration, cells: list[str] | None = None,
                count: int = 6, threshold_rad: float = 0.05, seed: int = 0) -> DriftReport:
    """Measure a few cells' phases (four-step, with the calibration's compensated routes) and
    compare with what the calibration predicts: recalibrate when the worst is above
    `threshold_rad`. Costs about 4 readings per cell (photodiodes, or the power meter on the
    outputs when the chip has no photodiodes)."""
    from photonic_testbed.calibration.crosstalk import _Probe
    cal = calibrator_from(station, calibration)
    if not station.has_monitors():
        from photonic_testbed.calibration.outputs import use_outputs
        use_outputs(cal)             # a chip without photodiodes: read from its outputs
    ids = [c.id for c in station.topology.cells]
    if cells is None:
        rng = np.random.default_rng(seed)
        cells = [ids[i] for i in sorted(rng.choice(len(ids), size=min(count, len(ids)),
                                                    replace=False))]
    errors = {}
    for cell in cells:
        probe = _Probe(cal, cell, compensated=cal.crosstalk is not None)
        errors[cell] = probe.four_step()[0]
    station.set_volts({ch: 0.0 for ch in station.channels})
    return DriftReport(errors, threshold_rad)


def calibrator_from(station, calibration: Calibration):
    """A Calibrator whose knowledge is a saved calibration (offsets as if swept with no other
    heater on, the file's crosstalk)."""
    from photonic_testbed.calibration.progressive import Calibrator, CellFit
    cal = Calibrator(station)
    cal.state["r_ohm"] = {str(ch): h.r_ohm for ch, h in calibration.heaters.items()}
    for c in station.topology.cells:
        ch = c.channels[0]
        h = calibration.heaters[ch]
        rec = calibration.cells.get(c.id, {})
        n = 1 + max(station.channels)
        amp = max(rec.get("fit_power", [1.0])) - min(rec.get("fit_power", [0.0]))
        mean = (max(rec.get("fit_power", [1.0])) + min(rec.get("fit_power", [0.0]))) / 2
        cal.state["fits"][c.id] = CellFit(
            c.id, ch, 0, h.offset_rad, h.offset_std, math.pi / h.p_pi_mw, 0.0,
            mean, amp / 2, 0.0, [0.0] * n, [], [], [], rec.get("detector", "pd"),
            0).to_dict()
    # the arm each cell is lit on, once every cell is known (a recirculating mesh's routes
    # run through the calibrated cells)
    for cell, fit in cal.state["fits"].items():
        fit["arm"] = cal.graph.route(cell).arm
    if calibration.crosstalk is not None:
        n = 1 + max(station.channels)
        k = np.zeros((n, n))
        chans = sorted(calibration.heaters)
        k[np.ix_(chans, chans)] = calibration.crosstalk
        cal.crosstalk = k
    return cal
