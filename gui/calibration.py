"""Calibration view: per-cell fringes with their fits, extinction per cell, crosstalk matrix.

It reads the chip calibration file that `ptb calibrate` writes (docs/calibration.md, version 2:
chip, chip id, rig, date, method, per-channel heater fits with uncertainties, the channels'
crosstalk matrix, per-cell fringes with fits and extinction). `load_calibration` turns a file
into the dict this view draws (the GUI reads the JSON itself: it never imports drivers/):

    {"cells": {id: {"sweep_v": [...], "power": [...], "fit_v": [...], "fit_power": [...],
                    "extinction_db": x, "note": "..." (optional)}},
     "crosstalk": [[...], ...],          square; one row and column per label (below)
     "crosstalk_labels": [...],          optional: default the cells' ids, in order
     "info": "..."}                      optional: what the file says of itself

A version 1 file (heater fits only, drivers/mesh.py) has no fringes: its crosstalk is shown and
the view says so. A file without `version` is taken to be in the view's own shape (what
`gui.demo.demo_calibration` makes).
"""
from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from typing import Any

import numpy as np
import pyqtgraph as pg
from PySide6.QtWidgets import (QFileDialog, QHBoxLayout, QLabel, QListWidget, QPushButton,
                               QSplitter, QVBoxLayout, QWidget)
from PySide6.QtCore import Qt

FRINGE_KEYS = ("sweep_v", "power", "fit_v", "fit_power", "extinction_db")


class CalibrationFileError(ValueError):
    """A calibration file that cannot be shown: the message names the file and the field."""


def check_calibration(data: Any, where: str = "calibration") -> dict[str, Any]:
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


def _from_file_format(data: Mapping[str, Any], where: str) -> dict[str, Any]:
    """A version 1 or 2 calibration file (docs/calibration.md) -> the view's dict."""
    version = data["version"]
    if version not in (1, 2):
        raise CalibrationFileError(f"{where}: calibration file version {version!r} is not one "
                                   "this GUI reads (1, 2)")
    channels = data.get("channels")
    if not isinstance(channels, list) or not channels:
        raise CalibrationFileError(f"{where}: needs a non-empty 'channels' list")
    labels = []
    for i, ch in enumerate(channels):
        if not isinstance(ch, Mapping) or "channel" not in ch:
            raise CalibrationFileError(f"{where}: channels[{i}] lacks 'channel'")
        labels.append(f"{ch['channel']}" + (f" {ch['cell']}" if ch.get("cell") else ""))
    cells: dict[str, Any] = {}
    if version == 2:
        raw = data.get("cells")
        if not isinstance(raw, Mapping):
            raise CalibrationFileError(f"{where}: a version 2 file needs a 'cells' dict")
        by_channel = {ch["channel"]: ch for ch in channels}
        for cid, c in raw.items():
            if not isinstance(c, Mapping):
                raise CalibrationFileError(f"{where}: cell {cid!r} is not a dict")
            cell = {k: c[k] for k in FRINGE_KEYS if k in c}
            notes = []
            for ch in c.get("channels", []):
                fit = by_channel.get(ch, {})
                if "p_pi_mw" in fit:
                    notes.append(f"ch {ch}: P_pi {fit['p_pi_mw']:.2f}"
                                 f" ± {fit.get('p_pi_std_mw', 0.0):.2g} mW, offset "
                                 f"{fit.get('offset_rad', 0.0):.3f}"
                                 f" ± {fit.get('offset_std', 0.0):.2g} rad")
            if "visibility" in c:
                notes.append(f"visibility {c['visibility']:.4f}")
            if c.get("splitter_limited"):
                notes.append(f"splitter-limited (imbalance {c.get('coupler_imbalance', 0):.3f})")
            if "detector" in c:
                notes.append(f"read on {c['detector']}")
            cell["note"] = "; ".join(notes)
            cells[str(cid)] = cell
    info = ", ".join(f"{k} {data[k]}" for k in ("chip", "chip_id", "rig", "date", "method")
                     if data.get(k))
    out = {"cells": cells, "crosstalk_labels": labels,
           "info": f"version {version}" + (f": {info}" if info else "")
           + ("" if version == 2 else " (heater fits only: no fringes)")}
    if data.get("crosstalk") is not None:
        out["crosstalk"] = data["crosstalk"]
    return check_calibration(out, where)


def load_calibration(path: str | os.PathLike) -> dict[str, Any]:
    """Read a calibration file (docs/calibration.md) into the view's dict."""
    where = os.fspath(path)
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except OSError as e:
        raise CalibrationFileError(f"cannot read {where}: {e.strerror}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CalibrationFileError(f"{where} is not JSON: {e}") from None
    if isinstance(data, Mapping) and "version" in data:
        return _from_file_format(data, where)
    return check_calibration(data, where)


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
        self.fringe = self.plots.addPlot(row=0, col=0, title="fringe")
        self.fringe.setLabel("bottom", "heater voltage", units="V")
        self.fringe.setLabel("left", "detector reading")
        self.points = self.fringe.plot([], [], pen=None, symbol="o", symbolSize=5,
                                       symbolBrush="#4fc3f7", symbolPen=None, name="measured")
        self.curve = self.fringe.plot([], [], pen=pg.mkPen("#ff9f1c", width=2), name="fit")
        self.ext_plot = self.plots.addPlot(row=0, col=1, title="extinction per cell (dB)")
        self.ext_plot.setLabel("left", "extinction", units="dB")
        self.bars = pg.BarGraphItem(x=[], height=[], width=0.8, brush="#81c784")
        self.ext_plot.addItem(self.bars)
        self.xt_plot = self.plots.addPlot(row=0, col=2, title="thermal crosstalk")
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
        self.cells.setMaximumWidth(130)
        layout_ = self.plots.ci.layout
        for col, stretch in ((0, 3), (1, 2), (2, 2)):
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

    def set_data(self, data: dict[str, Any], source: str = "") -> None:
        data = check_calibration(data)
        self.data = data
        self.error.clear()
        ids = list(data["cells"])
        self.source.setText(f"{source or 'calibration'}: {len(ids)} cells"
                            + (f" — {data['info']}" if data.get("info") else ""))
        ext = [data["cells"][c]["extinction_db"] for c in ids]
        self.bars.setOpts(x=np.arange(len(ids)), height=ext, width=0.8)
        step = max(1, -(-len(ids) // 6))          # at most about six labels: they stay apart
        self.ext_plot.getAxis("bottom").setTicks([[(i, c) for i, c in enumerate(ids)][::step]])
        labels = data.get("crosstalk_labels") or ids
        self.xt_plot.setTitle(f"thermal crosstalk ({len(labels)} "
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
            self.fringe.setTitle("no fringes in this file")
            self.note.clear()

    def show_cell(self, cid: str) -> None:
        if not self.data or cid not in self.data["cells"]:
            return
        c = self.data["cells"][cid]
        self.points.setData(c["sweep_v"], c["power"])
        self.curve.setData(c["fit_v"], c["fit_power"])
        self.fringe.setTitle(f"fringe of {cid}: extinction {c['extinction_db']:.1f} dB")
        self.note.setText(c.get("note", ""))
