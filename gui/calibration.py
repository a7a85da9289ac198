"""Calibration view: per-cell fringes with their fits, extinction per cell, crosstalk matrix.

It reads the chip calibration file that `ptb calibrate` writes (docs/calibration.md) with the
model every layer shares (`common.calibration.Calibration.parse`: the checksum, every field
checked; the GUI never imports drivers/), and turns it into the dict this view draws:

    {"cells": {id: {"sweep_v": [...], "power": [...], "fit_v": [...], "fit_power": [...],
                    "extinction_db": x, "note": "..." (optional)}},
     "crosstalk": [[...], ...],          square; one row and column per label (below)
     "crosstalk_labels": [...],          optional: default the cells' ids, in order
     "info": "..."}                      optional: what the file says of itself

A file of heater fits only (version 1) has no fringes: its crosstalk is shown and the view says
so. `set_data` also takes that dict directly (what `gui.demo.demo_calibration` makes).
"""
from __future__ import annotations

import math
import os
import warnings
from collections.abc import Mapping
from typing import Any

import numpy as np
import pyqtgraph as pg
from PySide6.QtCore import Qt, QTimer
from PySide6.QtWidgets import (
    QFileDialog,
    QHBoxLayout,
    QLabel,
    QListWidget,
    QPushButton,
    QSplitter,
    QVBoxLayout,
    QWidget,
)

from photonic_testbed.common.calibration import (
    MAX_FILE_BYTES,
    Calibration,
    CalibrationFileError,
    UnverifiedCalibrationWarning,
)

FRINGE_KEYS = ("sweep_v", "power", "fit_v", "fit_power", "extinction_db")
TITLE = "9pt"


def check_calibration(data: Any, where: str = "calibration") -> dict[str, Any]:
    """The view's dict, checked (CalibrationFileError naming `where` and the field)."""
    if not isinstance(data, Mapping) or not isinstance(data.get("cells"), Mapping):
        raise CalibrationFileError(f"{where}: needs a 'cells' dict")
    for cid, c in data["cells"].items():
        if not isinstance(c, Mapping):
            raise CalibrationFileError(f"{where}: cell {cid!r} is not a dict")
        for key in FRINGE_KEYS:
            if key not in c:
                raise CalibrationFileError(f"{where}: cell {cid!r} lacks {key!r}")
        for a, b in (("sweep_v", "power"), ("fit_v", "fit_power")):
            if not isinstance(c[a], list) or not isinstance(c[b], list):
                raise CalibrationFileError(f"{where}: cell {cid!r} {a} and {b} must be lists")
            if len(c[a]) != len(c[b]):
                raise CalibrationFileError(f"{where}: cell {cid!r} has {len(c[a])} {a} but "
                                           f"{len(c[b])} {b}")
        ext = c["extinction_db"]
        if isinstance(ext, bool) or not isinstance(ext, (int, float)) or not math.isfinite(ext):
            raise CalibrationFileError(f"{where}: cell {cid!r} extinction_db is not a number")
    labels = data.get("crosstalk_labels")
    if labels is not None and (not isinstance(labels, list) or
                               not all(isinstance(x, str) for x in labels)):
        raise CalibrationFileError(f"{where}: crosstalk_labels must be a list of strings")
    xt = data.get("crosstalk")
    if xt is not None:
        try:
            arr = np.asarray(xt, dtype=float)
        except (TypeError, ValueError):
            raise CalibrationFileError(f"{where}: crosstalk is not a matrix of numbers") from None
        n = len(labels) if labels is not None else len(data["cells"])
        what = "labels" if labels is not None else "cells"
        if arr.shape != (n, n):
            raise CalibrationFileError(f"{where}: crosstalk is {arr.shape}, expected ({n}, {n}) "
                                       f"for {n} {what}")
        if not np.all(np.isfinite(arr)):
            raise CalibrationFileError(f"{where}: crosstalk has a value that is not finite")
    return dict(data)


def view_of(cal: Calibration) -> dict[str, Any]:
    """A calibration (common.calibration) -> the view's dict."""
    labels = [f"{ch}" + (f" {h.cell}" if h.cell else "") for ch, h in sorted(cal.heaters.items())]
    cells: dict[str, Any] = {}
    for cid, c in cal.cells.items():
        cell = {k: c[k] for k in FRINGE_KEYS if k in c}
        notes = []
        for ch in c.get("channels", []):
            h = cal.heaters.get(ch)
            if h is not None:
                notes.append(f"ch {ch}: P_pi {h.p_pi_mw:.2f} ± {h.p_pi_std_mw:.2g} mW, offset "
                             f"{h.offset_rad:.3f} ± {h.offset_std:.2g} rad")
        if "visibility" in c:
            notes.append(f"visibility {c['visibility']:.4f}")
        if c.get("splitter_limited"):
            notes.append(f"splitter-limited (imbalance {c.get('coupler_imbalance', 0):.3f})")
        if "detector" in c:
            notes.append(f"read on {c['detector']}")
        cell["note"] = "; ".join(notes)
        cells[str(cid)] = cell
    info = ", ".join(f"{k} {getattr(cal, k)}" for k in ("chip", "chip_id", "rig", "date",
                                                        "method") if getattr(cal, k))
    check = "checksum verified" if cal.verified else "no checksum: unverified (older file)"
    out = {"cells": cells, "crosstalk_labels": labels,
           "info": check + (f": {info}" if info else "")
           + ("" if cells else " (heater fits only: no fringes)")}
    if cal.crosstalk is not None:
        out["crosstalk"] = cal.crosstalk.tolist()
    return check_calibration(out, cal.source)


def load_calibration(path: str | os.PathLike) -> dict[str, Any]:
    """Read a calibration file (docs/calibration.md) into the view's dict; any problem with
    it is a CalibrationFileError naming the file."""
    where = os.fspath(path)
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_FILE_BYTES + 1)
    except OSError as e:
        raise CalibrationFileError(f"cannot read {where}: {e.strerror}") from None
    with warnings.catch_warnings():
        # an older file's lack of checksum is said in the view's info line
        warnings.simplefilter("ignore", UnverifiedCalibrationWarning)
        return view_of(Calibration.parse(data, where))


class CalibrationView(QWidget):
    def __init__(self, parent: QWidget | None = None):
        super().__init__(parent)
        self.data: dict[str, Any] | None = None
        self.source = QLabel("no calibration loaded (Ctrl+O)")
        open_button = QPushButton("Open calibration…")
        open_button.clicked.connect(self.choose_file)
        self.cells = QListWidget()
        self.cells.currentTextChanged.connect(self.show_cell)
        self.plots = pg.GraphicsLayoutWidget()
        self.plots.setBackground("#16181d")
        # One row of three: each plot gets the dock's full height (two rows left each one
        # about 40 px in a docked view, with their tick labels on top of each other).
        self.plots.setMinimumSize(540, 220)
        # Titles in a small font: a plot is at least as wide as its title.
        self.fringe = self.plots.addPlot(row=0, col=0)
        self.fringe.setTitle("fringe", size=TITLE)
        self.fringe.setLabel("bottom", "heater voltage", units="V")
        self.fringe.setLabel("left", "detector reading")
        self.points = self.fringe.plot([], [], pen=None, symbol="o", symbolSize=5,
                                       symbolBrush="#4fc3f7", symbolPen=None, name="measured")
        self.curve = self.fringe.plot([], [], pen=pg.mkPen("#ff9f1c", width=2), name="fit")
        self.ext_plot = self.plots.addPlot(row=0, col=1)
        self.ext_plot.setTitle("extinction per cell", size=TITLE)
        self.ext_plot.setLabel("left", "extinction", units="dB")
        self.bars = pg.BarGraphItem(x=[], height=[], width=0.8, brush="#81c784", pen=None)
        self.ext_plot.addItem(self.bars)
        self.xt_plot = self.plots.addPlot(row=0, col=2)
        self.xt_plot.setTitle("thermal crosstalk", size=TITLE)
        self.xt_plot.setAspectLocked(True)
        self.image = pg.ImageItem()
        self.xt_plot.addItem(self.image)
        self.colorbar = self.xt_plot.addColorBar(self.image, colorMap="inferno", values=(0, 0.05))
        left = QWidget()
        box = QVBoxLayout(left)
        box.setContentsMargins(0, 0, 0, 0)
        box.addWidget(open_button)
        box.addWidget(self.cells)
        split = QSplitter(Qt.Orientation.Horizontal)
        split.addWidget(left)
        split.addWidget(self.plots)
        split.setStretchFactor(1, 6)
        self.cells.setMaximumWidth(90)
        layout_ = self.plots.ci.layout
        for col, stretch in ((0, 4), (1, 3), (2, 4)):
            layout_.setColumnStretchFactor(col, stretch)
        top = QHBoxLayout()
        top.addWidget(self.source, 1)
        layout = QVBoxLayout(self)
        layout.addLayout(top)
        layout.addWidget(split, 1)
        self.note = QLabel()              # the cell's fit parameters and uncertainties
        layout.addWidget(self.note)
        self.error = QLabel()
        self.error.setStyleSheet("color: #ef5350")
        layout.addWidget(self.error)

    def choose_file(self) -> None:
        path, _ = QFileDialog.getOpenFileName(self, "Open calibration", "", "JSON (*.json)")
        if path:
            self.open(path)

    def open(self, path: str) -> bool:
        try:
            data = load_calibration(path)
        except CalibrationFileError as e:
            self.error.setText(str(e))
            return False
        self.set_data(data, os.path.basename(path))
        return True

    def _cell_ticks(self) -> None:
        """Cell names under the extinction bars, as many as the plot's width leaves apart."""
        ids = list(self.data["cells"]) if self.data else []
        room = max(3, int(self.ext_plot.vb.width() // 45))
        step = max(1, -(-len(ids) // room))
        self.ext_plot.getAxis("bottom").setTicks([[(i, c) for i, c in enumerate(ids)][::step]])

    def resizeEvent(self, event) -> None:
        super().resizeEvent(event)
        QTimer.singleShot(0, self, self._cell_ticks)     # once the plots have their new sizes

    def set_data(self, data: dict[str, Any], source: str = "") -> None:
        data = check_calibration(data)
        self.data = data
        self.error.clear()
        ids = list(data["cells"])
        self.source.setText(f"{source or 'calibration'}: {len(ids)} cells"
                            + (f" — {data['info']}" if data.get("info") else ""))
        ext = [data["cells"][c]["extinction_db"] for c in ids]
        self.bars.setOpts(x=np.arange(len(ids)), height=ext, width=0.8)
        self.ext_plot.setXRange(-4, len(ids) + 0.5, padding=0)    # the first label in view
        self._cell_ticks()
        labels = data.get("crosstalk_labels") or ids
        self.xt_plot.setTitle(size=TITLE, title=f"crosstalk ({len(labels)} "
                              f"{'channels' if data.get('crosstalk_labels') else 'cells'})")
        if data.get("crosstalk") is not None:
            xt = np.asarray(data["crosstalk"], dtype=float)
            off = xt[~np.eye(len(xt), dtype=bool)] if len(xt) > 1 else xt.ravel()
            top = float(off.max()) if off.size and off.max() > 0 else 1.0
            self.image.setImage(xt, levels=(0.0, top))
            self.colorbar.setLevels((0.0, top))
        self.cells.clear()
        self.cells.addItems(ids)
        if ids:
            self.cells.setCurrentRow(0)
        else:                              # a file of heater fits only: no fringe to show
            self.points.setData([], [])
            self.curve.setData([], [])
            self.fringe.setTitle("no fringes in this file", size=TITLE)
            self.note.clear()

    def show_cell(self, cid: str) -> None:
        if not self.data or cid not in self.data["cells"]:
            return
        c = self.data["cells"][cid]
        self.points.setData(c["sweep_v"], c["power"])
        self.curve.setData(c["fit_v"], c["fit_power"])
        self.fringe.setTitle(f"fringe of {cid}: extinction {c['extinction_db']:.1f} dB",
                             size=TITLE)
        self.note.setText(c.get("note", ""))
