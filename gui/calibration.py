"""Calibration view: per-cell fringes with their fits, extinction per cell, crosstalk matrix.

The file format belongs to the calibration package; `load_calibration` is the one place that
turns a file into the dict this view draws:

    {"cells": {id: {"sweep_v": [...], "power": [...], "fit_v": [...], "fit_power": [...],
                    "extinction_db": x}},
     "crosstalk": [[...], ...]}          (square, one row and column per cell, in cells' order)
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


class CalibrationFileError(ValueError):
    """A calibration file that cannot be shown: the message names the file and the field."""


def check_calibration(data: Any, where: str = "calibration") -> dict[str, Any]:
    if not isinstance(data, Mapping) or not isinstance(data.get("cells"), Mapping):
        raise CalibrationFileError(f"{where}: needs a 'cells' dict")
    for cid, c in data["cells"].items():
        if not isinstance(c, Mapping):
            raise CalibrationFileError(f"{where}: cell {cid!r} is not a dict")
        for key in ("sweep_v", "power", "fit_v", "fit_power", "extinction_db"):
            if key not in c:
                raise CalibrationFileError(f"{where}: cell {cid!r} lacks {key!r}")
        for a, b in (("sweep_v", "power"), ("fit_v", "fit_power")):
            if len(c[a]) != len(c[b]):
                raise CalibrationFileError(f"{where}: cell {cid!r} has {len(c[a])} {a} but "
                                           f"{len(c[b])} {b}")
        if not isinstance(c["extinction_db"], (int, float)) or not math.isfinite(c["extinction_db"]):
            raise CalibrationFileError(f"{where}: cell {cid!r} extinction_db is not a number")
    xt = data.get("crosstalk")
    if xt is not None:
        try:
            arr = np.asarray(xt, dtype=float)
        except (TypeError, ValueError):
            raise CalibrationFileError(f"{where}: crosstalk is not a matrix of numbers") from None
        n = len(data["cells"])
        if arr.shape != (n, n):
            raise CalibrationFileError(f"{where}: crosstalk is {arr.shape}, expected ({n}, {n}) "
                                       f"for {n} cells")
    return dict(data)


def load_calibration(path: str | os.PathLike) -> dict[str, Any]:
    """Read a calibration file into the view's dict (replace when the file format lands)."""
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except OSError as e:
        raise CalibrationFileError(f"cannot read {path}: {e.strerror}") from None
    except json.JSONDecodeError as e:
        raise CalibrationFileError(f"{path} is not JSON: {e}") from None
    return check_calibration(data, os.fspath(path))


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
        self.fringe = self.plots.addPlot(row=0, col=0, colspan=2, title="fringe")
        self.fringe.setLabel("bottom", "heater voltage", units="V")
        self.fringe.setLabel("left", "output power (norm.)")
        self.points = self.fringe.plot([], [], pen=None, symbol="o", symbolSize=5,
                                       symbolBrush="#4fc3f7", symbolPen=None, name="measured")
        self.curve = self.fringe.plot([], [], pen=pg.mkPen("#ff9f1c", width=2), name="fit")
        self.ext_plot = self.plots.addPlot(row=1, col=0, title="extinction per cell (dB)")
        self.bars = pg.BarGraphItem(x=[], height=[], width=0.8, brush="#81c784")
        self.ext_plot.addItem(self.bars)
        self.xt_plot = self.plots.addPlot(row=1, col=1, title="thermal crosstalk")
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
        split.setStretchFactor(1, 4)
        top = QHBoxLayout()
        top.addWidget(self.source, 1)
        layout = QVBoxLayout(self)
        layout.addLayout(top)
        layout.addWidget(split, 1)
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
        self.source.setText(f"{source or 'calibration'}: {len(ids)} cells")
        ext = [data["cells"][c]["extinction_db"] for c in ids]
        self.bars.setOpts(x=np.arange(len(ids)), height=ext, width=0.8)
        self.ext_plot.getAxis("bottom").setTicks([[(i, c) for i, c in enumerate(ids)][::8]])
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

    def show_cell(self, cid: str) -> None:
        if not self.data or cid not in self.data["cells"]:
            return
        c = self.data["cells"][cid]
        self.points.setData(c["sweep_v"], c["power"])
        self.curve.setData(c["fit_v"], c["fit_power"])
        self.fringe.setTitle(f"fringe of {cid}: extinction {c['extinction_db']:.1f} dB")
