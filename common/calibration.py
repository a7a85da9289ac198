"""A chip's calibration: the heaters' phase law, the crosstalk, and the file that holds them.

Per heater channel: phase = offset + pi * P / P_pi with P = V^2 / R (mW), plus the crosstalk
`phase_i += pi / P_pi_i * sum_j k_ij P_j`. Until a chip is calibrated, `Calibration.ideal()`
assumes P_pi = 22.5 mW, R = 1 kOhm, zero offset and no crosstalk: right for an ideal chip only.

The calibration file (docs/calibration.md describes every key) is JSON. Version 3 carries a
checksum of its content, so a file reads back as exactly the values written or is refused:

    {"version": 3, "chip": "benes16", "chip_id": "...", "rig": "lumion", "date": "ISO 8601",
     "method": "monitors" | "outputs" | "",
     "channels": [{"channel": 0, "cell": "s0r0", "offset_rad": 0.0, "offset_std": 0.001,
                   "p_pi_mw": 22.5, "p_pi_std_mw": 0.01, "r_ohm": 1000.0}, ...],
     "crosstalk": [[...], ...] | null,   k[i][j], channels in the order listed
     "crosstalk_std": [[...], ...] | null,
     "cells": {"s0r0": {...}, ...},       the measured fringes, fits, extinctions
     "checksum": "sha256:..."}           SHA-256 of the canonical content (below)

The canonical content is the file's object without "checksum", written by Python's
`json.dumps(content, sort_keys=True, separators=(",", ":"), ensure_ascii=True)`: it depends on
the values only (floats are written in their shortest exact form), not on the file's layout.

`Calibration.parse(bytes or text, where)` reads a file's text; `Calibration.dumps()` writes it.
Files of versions 1 and 2 (no checksum) still load, checked field by field, with an
`UnverifiedCalibrationWarning`: nothing can tell a changed digit in them; re-save them
(`ptb calibrate --resave FILE`) to add the checksum. Every problem with a file is one error,
`CalibrationFileError`, whose message names the file and what is wrong. No file is opened
here: `drivers.mesh.load_calibration` and `save_calibration` read and write them.
"""
from __future__ import annotations

import hashlib
import json
import math
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from photonic_testbed.common import nesting

NOMINAL_P_PI_MW = 22.5
NOMINAL_R_OHM = 1000.0
CALIBRATION_VERSION = 3
READABLE_VERSIONS = (1, 2, 3)
MAX_FILE_BYTES = 64 << 20        # a 1,024-heater chip's file is a few MB
METHODS = ("", "monitors", "outputs")

# The ranges a value may take in a file; anything outside is a damaged or hand-made file.
MAX_CHANNEL = 4095
OFFSET_RAD = (-4 * math.pi, 4 * math.pi)
P_PI_MW = (1e-3, 1e3)            # heaters reach pi somewhere between microwatts and a watt
R_OHM = (1.0, 1e6)
CROSSTALK = (-1.0, 1.0)          # a heater feels at most the whole of a neighbour's power
MAX_TEXT = 1000                  # characters of a name, id or date
MAX_POINTS = 100_000             # readings of one fringe
RECORD_NUMBER = 1e9              # |x| of any reading or figure in a cell's record


class CalibrationError(ValueError):
    """A calibration that does not fit: made for another chip, lacking heaters, or asked for
    settings it cannot reach."""


class CalibrationFileError(CalibrationError):
    """A calibration file that cannot be read as written: not UTF-8 or JSON, a checksum that
    does not match, a missing, extra or mistyped field, or a value out of range. The message
    names the file and what is wrong."""


class UnverifiedCalibrationWarning(UserWarning):
    """A calibration file without a checksum (version 1 or 2) was loaded: its values were
    checked one by one, but a changed digit cannot be seen. Re-save it to add the checksum."""


@dataclass(frozen=True)
class HeaterCalibration:
    offset_rad: float = 0.0
    p_pi_mw: float = NOMINAL_P_PI_MW
    r_ohm: float = NOMINAL_R_OHM
    offset_std: float = 0.0
    p_pi_std_mw: float = 0.0
    cell: str = ""


@dataclass(frozen=True)
class Calibration:
    heaters: dict[int, HeaterCalibration]
    crosstalk: np.ndarray | None = None        # k[i][j] in sorted channel order
    chip: str = ""
    source: str = "ideal"
    chip_id: str = ""                          # the chip's identity (serial), "" if unknown
    rig: str = ""
    date: str = ""                             # ISO 8601, UTC
    method: str = ""                           # "monitors" or "outputs"
    crosstalk_std: np.ndarray | None = None
    cells: dict = field(default_factory=dict)  # per-cell record: fringes, fits, extinction
    # False for a file without a checksum (version 1 or 2): its values are unverified
    verified: bool = field(default=True, compare=False)

    @classmethod
    def ideal(cls, channels, chip: str = "") -> Calibration:
        return cls({int(ch): HeaterCalibration() for ch in channels}, None, chip, "ideal")

    # ---- the file ------------------------------------------------------------------------

    @classmethod
    def parse(cls, data: bytes | str, where: str = "calibration") -> Calibration:
        """A calibration from a file's bytes (or text). Raises CalibrationFileError, naming
        `where`, for anything but a well-formed file whose checksum (version 3) matches."""
        if len(data) > MAX_FILE_BYTES:
            raise CalibrationFileError(f"calibration {where} is {len(data)} bytes: more than "
                                       f"{MAX_FILE_BYTES} is not a calibration file")
        if isinstance(data, (bytes, bytearray)):
            try:
                data = bytes(data).decode("utf-8")
            except UnicodeDecodeError as e:
                raise CalibrationFileError(f"calibration {where} is not UTF-8 text (byte "
                                           f"{e.start}: {data[e.start:e.start + 1]!r}): the "
                                           "file is damaged") from None
        try:
            d = nesting.loads_json(data, f"calibration {where}", object_pairs_hook=_no_duplicates,
                                   parse_constant=_no_constant, parse_float=_finite)
        except nesting.NestingError as e:
            raise CalibrationFileError(str(e)) from None
        except ValueError as e:
            raise CalibrationFileError(f"calibration {where} is not JSON: {e}") from None
        return cls.from_dict(d, source=where)

    @classmethod
    def from_dict(cls, d: Any, source: str = "dict") -> Calibration:
        """A calibration from a file's JSON object: the checksum (version 3) verified, every
        field checked for presence, type and range."""
        c = _Check(source)
        if not isinstance(d, dict):
            c.fail("", f"a JSON object, not {type(d).__name__}")
        version = d.get("version")
        if isinstance(version, bool) or version not in READABLE_VERSIONS:
            c.fail("version", f"a format version this reader knows "
                   f"({', '.join(map(str, READABLE_VERSIONS))}); version {version!r} is not one")
        if version == CALIBRATION_VERSION:
            if "checksum" not in d:
                c.fail("checksum", "a checksum in a version 3 file; it is missing (the file "
                       "was cut short or edited)")
            content = {k: v for k, v in d.items() if k != "checksum"}
            try:
                expected = checksum(content)
            except CalibrationFileError as e:
                c.fail("", f"values JSON can carry ({e})")
            if d["checksum"] != expected:
                c.fail("checksum", "the SHA-256 of the content: it does not match, so the "
                       "file was changed or damaged after it was written")
            required = set(_TOP)
        else:
            required = {"version", "channels"} | ({"chip", "chip_id", "rig", "date", "method"}
                                                   if version == 2 else set())
        c.keys(d, "", set(_TOP) if version == CALIBRATION_VERSION else set(_TOP) - {"checksum"},
               required)
        chip, chip_id, rig, date = (c.text(d.get(k, ""), k) for k in ("chip", "chip_id", "rig",
                                                                      "date"))
        method = c.text(d.get("method", ""), "method")
        if method not in METHODS:
            c.fail("method", f"one of {', '.join(repr(m) for m in METHODS)}, not {method!r}")
        heaters = c.channels(d["channels"], strict=version == CALIBRATION_VERSION)
        n = len(heaters)
        k = c.matrix(d.get("crosstalk"), "crosstalk", n, CROSSTALK)
        k_std = c.matrix(d.get("crosstalk_std"), "crosstalk_std", n, (0.0, CROSSTALK[1]))
        cells = c.cells(d.get("cells", {}))
        if version != CALIBRATION_VERSION:
            warnings.warn(f"calibration {source} is a version {version} file without a "
                          "checksum: its values are checked but cannot be verified; re-save it "
                          "with `ptb calibrate --resave FILE`", UnverifiedCalibrationWarning,
                          stacklevel=3)
        return cls(heaters, k, chip, source, chip_id, rig, date, method, k_std, cells,
                   verified=version == CALIBRATION_VERSION)

    def to_dict(self) -> dict:
        """The file's content (version 3), without the checksum: plain JSON values."""
        d = {"version": CALIBRATION_VERSION, "chip": self.chip, "chip_id": self.chip_id,
             "rig": self.rig, "date": self.date, "method": self.method,
             "channels": [{"channel": int(ch), "cell": h.cell,
                           "offset_rad": float(h.offset_rad), "offset_std": float(h.offset_std),
                           "p_pi_mw": float(h.p_pi_mw), "p_pi_std_mw": float(h.p_pi_std_mw),
                           "r_ohm": float(h.r_ohm)}
                          for ch, h in sorted(self.heaters.items())],
             "crosstalk": None if self.crosstalk is None
             else np.asarray(self.crosstalk, dtype=float).tolist(),
             "crosstalk_std": None if self.crosstalk_std is None
             else np.asarray(self.crosstalk_std, dtype=float).tolist(),
             "cells": _plain(self.cells)}
        return d

    def dumps(self) -> str:
        """The file's text: the content and its checksum. Refuses (CalibrationFileError) a
        calibration that would not read back (a value out of range, not finite)."""
        content = self.to_dict()
        text = json.dumps({**content, "checksum": checksum(content)}, indent=1,
                          allow_nan=False) + "\n"
        Calibration.parse(text, self.source)          # what is written must read back
        return text

    # ---- fitting the chip ------------------------------------------------------------------

    def check_chip(self, chip: str, chip_id: str = "") -> None:
        """Refuse a calibration made for another chip (by topology name, and by chip id when
        both sides know it)."""
        if self.chip and chip and self.chip != chip:
            raise CalibrationError(f"calibration {self.source} is for chip {self.chip!r}, "
                                   f"not {chip!r}")
        if self.chip_id and chip_id and self.chip_id != chip_id:
            raise CalibrationError(f"calibration {self.source} is for chip id {self.chip_id!r}, "
                                   f"not {chip_id!r}")

    def merged(self, newer: Calibration) -> Calibration:
        """This calibration with what a later run of some cells measured (`ptb calibrate
        --cells ... --update FILE`): the newer run's heaters replace these, its crosstalk
        entries (pairs of heaters it calibrated) replace these, every other heater and entry is
        kept; the cells' records say when they were updated. Refused for another chip or
        another method, and when the newer run has heaters this file does not."""
        self.check_chip(newer.chip, newer.chip_id)
        if self.method and newer.method and self.method != newer.method:
            raise CalibrationError(f"calibration {self.source} was made from the "
                                   f"{self.method}; this run from the {newer.method}: "
                                   "calibrate every cell again to change the method")
        extra = sorted(set(newer.heaters) - set(self.heaters))
        if extra:
            raise CalibrationError(f"calibration {self.source} has no heater channel(s) "
                                   f"{extra}: calibrate every cell instead")
        heaters = {**self.heaters, **newer.heaters}
        chans = sorted(heaters)
        k, k_std = self.crosstalk, self.crosstalk_std
        if newer.crosstalk is not None:
            if k is None:
                raise CalibrationError(f"calibration {self.source} has no crosstalk matrix "
                                       "to update: calibrate every cell with the crosstalk")
            at = [chans.index(ch) for ch in sorted(newer.heaters)]
            k = k.copy()
            k[np.ix_(at, at)] = newer.crosstalk
            if k_std is not None and newer.crosstalk_std is not None:
                k_std = k_std.copy()
                k_std[np.ix_(at, at)] = newer.crosstalk_std
        cells = dict(self.cells)
        for cell, record in newer.cells.items():
            cells[cell] = {**record, "updated": newer.date}
        return replace(self, heaters=heaters, crosstalk=k, crosstalk_std=k_std, cells=cells,
                       date=newer.date or self.date, source=f"{self.source} + {newer.source}")

    def without_crosstalk(self) -> Calibration:
        """The same heaters with no crosstalk compensation (for comparisons)."""
        return replace(self, crosstalk=None, crosstalk_std=None)

    # ---- the phase law ---------------------------------------------------------------------

    def _arrays(self, channels):
        try:
            hs = [self.heaters[ch] for ch in channels]
        except KeyError as e:
            raise CalibrationError(f"the calibration has no heater channel {e.args[0]}") from None
        return (np.array([h.offset_rad for h in hs]), np.array([h.p_pi_mw for h in hs]),
                np.array([h.r_ohm for h in hs]))

    def voltages(self, phases: Mapping[int, float]) -> dict[int, float]:
        """Heater voltages giving these phases (rad) on these channels; every channel of the
        calibration must be named when it has crosstalk (all heaters solved together)."""
        chans = sorted(phases)
        off, p_pi, r = self._arrays(chans)
        delta = np.mod(np.array([phases[c] for c in chans]) - off, 2 * math.pi)
        if self.crosstalk is None:
            p = delta * p_pi / math.pi
        else:
            if chans != sorted(self.heaters):
                raise CalibrationError("with crosstalk, give phases for every heater")
            mix = np.eye(len(chans)) + self.crosstalk
            for _ in range(8):
                p = np.linalg.solve(mix, delta * p_pi / math.pi)
                if (p >= 0).all():
                    break
                delta = delta + 2 * math.pi * (p < 0)
            else:
                raise CalibrationError("no non-negative heater powers reach these phases")
        return {c: float(v) for c, v in zip(chans, np.sqrt(p * r / 1000.0), strict=True)}

    def phases(self, volts: Mapping[int, float]) -> dict[int, float]:
        """Phases (rad, in [0, 2 pi)) the calibration predicts for these heater voltages."""
        chans = sorted(volts)
        off, p_pi, r = self._arrays(chans)
        p = 1000.0 * np.array([volts[c] for c in chans]) ** 2 / r
        if self.crosstalk is not None and chans == sorted(self.heaters):
            p = (np.eye(len(chans)) + self.crosstalk) @ p
        phases = np.mod(off + math.pi * p / p_pi, 2 * math.pi)
        return {c: float(x) for c, x in zip(chans, phases, strict=True)}


# ---- the file's checks -----------------------------------------------------------------------

def checksum(content: Mapping[str, Any]) -> str:
    """"sha256:HEX" of the canonical JSON of a file's content (without its checksum)."""
    try:
        canonical = json.dumps(content, sort_keys=True, separators=(",", ":"),
                               ensure_ascii=True, allow_nan=False)
    except (TypeError, ValueError) as e:
        raise CalibrationFileError(f"a calibration holds a value JSON cannot carry: {e}") \
            from None
    return "sha256:" + hashlib.sha256(canonical.encode("ascii")).hexdigest()


def _no_duplicates(pairs):
    keys = [k for k, _ in pairs]
    if len(keys) != len(set(keys)):
        raise ValueError(f"key {next(k for k in keys if keys.count(k) > 1)!r} appears twice")
    return dict(pairs)


def _no_constant(name):
    raise ValueError(f"{name} is not a number a calibration may hold")


def _finite(text: str) -> float:
    x = float(text)
    if not math.isfinite(x):
        raise ValueError(f"{text} is beyond the largest number a calibration may hold")
    return x


def _plain(value: Any) -> Any:
    """JSON's own types for what a calibration run put in its records (numpy included)."""
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, np.ndarray)):
        return [_plain(v) for v in value]
    if isinstance(value, np.generic):
        return value.item()
    return value


# Top-level keys of a file, and what each holds (for the messages).
_TOP = {"version": "the format version", "checksum": "sha256:HEX of the content",
        "chip": "the chip's topology name", "chip_id": "the chip's identity",
        "rig": "the rig it was measured on", "date": "when (ISO 8601, UTC)",
        "method": "monitors or outputs", "channels": "the heaters' fits",
        "crosstalk": "the crosstalk matrix or null", "crosstalk_std": "its spread or null",
        "cells": "the cells' records"}
_CHANNEL = {"channel": None, "cell": "", "offset_rad": OFFSET_RAD, "offset_std": (0.0, 2 * math.pi),
            "p_pi_mw": P_PI_MW, "p_pi_std_mw": (0.0, P_PI_MW[1]), "r_ohm": R_OHM}
_LISTS = ("sweep_v", "sweep_p_mw", "power", "fit_v", "fit_power")
_RECORD_NUMBERS = {"extinction_db": (-200.0, 200.0), "cross_extinction_db": (-200.0, 200.0),
                   "visibility": (0.0, 1.0), "coupler_imbalance": (0.0, 100.0),
                   "coupler_sum_error": (0.0, 100.0), "residual_rms": (0.0, RECORD_NUMBER),
                   "p_pi_mw": P_PI_MW, "offset_rad": OFFSET_RAD}
_RECORD_TEXT = ("detector", "sweep", "extinction_from", "updated")
# what every cell's record holds: its heaters, the fringe measured and fitted, the extinction
_RECORD_REQUIRED = {"channels", "sweep_v", "power", "fit_v", "fit_power", "extinction_db"}


class _Check:
    """Checks of one file's fields; `fail` raises CalibrationFileError naming the file."""

    def __init__(self, where: str):
        self.where = where

    def fail(self, key: str, expected: str):
        at = f" {key}:" if key else ""
        raise CalibrationFileError(f"calibration {self.where}:{at} expected {expected}")

    def keys(self, d: dict, where: str, known, required) -> None:
        extra = sorted(set(d) - set(known))
        if extra:
            self.fail(where, f"only the keys {', '.join(sorted(known))}; {extra[0]!r} is not one")
        missing = [k for k in sorted(required) if k not in d]
        if missing:
            self.fail(where, f"a key {missing[0]!r}; it is missing")

    def text(self, value: Any, key: str) -> str:
        if not isinstance(value, str) or len(value) > MAX_TEXT:
            self.fail(key, f"a string of at most {MAX_TEXT} characters, not {_show(value)}")
        return value

    def number(self, value: Any, key: str, bounds: tuple[float, float]) -> float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            self.fail(key, f"a number, not {_show(value)}")
        x = float(value)
        if not (math.isfinite(x) and bounds[0] <= x <= bounds[1]):
            self.fail(key, f"a number in {bounds[0]:g}..{bounds[1]:g}, not {value!r}")
        return x

    def integer(self, value: Any, key: str, top: int) -> int:
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= top:
            self.fail(key, f"an integer in 0..{top}, not {_show(value)}")
        return value

    def channels(self, value: Any, strict: bool) -> dict[int, HeaterCalibration]:
        if not isinstance(value, list) or not value:
            self.fail("channels", f"a non-empty list of heaters, not {_show(value)}")
        heaters: dict[int, HeaterCalibration] = {}
        for i, h in enumerate(value):
            at = f"channels[{i}]"
            if not isinstance(h, dict):
                self.fail(at, f"an object, not {_show(h)}")
            self.keys(h, at, _CHANNEL, set(_CHANNEL) if strict else
                      {"channel", "offset_rad", "p_pi_mw", "r_ohm"})
            ch = self.integer(h["channel"], f"{at}.channel", MAX_CHANNEL)
            if ch in heaters:
                self.fail(f"{at}.channel", f"a channel listed once; {ch} is listed twice")
            num = {k: self.number(h.get(k, 0.0), f"{at}.{k}", b)
                   for k, b in _CHANNEL.items() if isinstance(b, tuple)}
            heaters[ch] = HeaterCalibration(num["offset_rad"], num["p_pi_mw"], num["r_ohm"],
                                            num["offset_std"], num["p_pi_std_mw"],
                                            self.text(h.get("cell", ""), f"{at}.cell"))
        return heaters

    def matrix(self, value: Any, key: str, n: int, bounds) -> np.ndarray | None:
        if value is None:
            return None
        if not isinstance(value, list) or len(value) != n or \
                not all(isinstance(row, list) and len(row) == n for row in value):
            self.fail(key, f"a {n} x {n} matrix (one row and column per channel) or null")
        return np.array([[self.number(x, f"{key}[{i}][{j}]", bounds) for j, x in enumerate(row)]
                         for i, row in enumerate(value)], dtype=float).reshape(n, n)

    def cells(self, value: Any) -> dict:
        if not isinstance(value, dict):
            self.fail("cells", f"an object keyed by cell id, not {_show(value)}")
        for cid, rec in value.items():
            at = f"cells.{cid}"
            if len(cid) > MAX_TEXT:
                self.fail("cells", f"cell ids of at most {MAX_TEXT} characters")
            if not isinstance(rec, dict):
                self.fail(at, f"an object, not {_show(rec)}")
            self.keys(rec, at, {"channels", "splitter_limited", "measurements", *_LISTS,
                                *_RECORD_NUMBERS, *_RECORD_TEXT}, _RECORD_REQUIRED)
            for key, v in rec.items():
                if key == "channels":
                    if not isinstance(v, list) or not 1 <= len(v) <= 2:
                        self.fail(f"{at}.channels", f"a list of 1 or 2 channels, not {_show(v)}")
                    for ch in v:
                        self.integer(ch, f"{at}.channels", MAX_CHANNEL)
                elif key in _LISTS:
                    if not isinstance(v, list) or len(v) > MAX_POINTS:
                        self.fail(f"{at}.{key}", f"a list of at most {MAX_POINTS} numbers, not "
                                  f"{_show(v)}")
                    for x in v:
                        self.number(x, f"{at}.{key}", (-RECORD_NUMBER, RECORD_NUMBER))
                elif key in _RECORD_NUMBERS:
                    self.number(v, f"{at}.{key}", _RECORD_NUMBERS[key])
                elif key in _RECORD_TEXT:
                    self.text(v, f"{at}.{key}")
                elif key == "splitter_limited":
                    if not isinstance(v, bool):
                        self.fail(f"{at}.{key}", f"true or false, not {_show(v)}")
                else:                                              # measurements
                    self.integer(v, f"{at}.{key}", 1_000_000_000)
            for a, b in (("sweep_v", "power"), ("fit_v", "fit_power")):
                if a in rec and b in rec and len(rec[a]) != len(rec[b]):
                    self.fail(f"{at}.{b}", f"as many values as {a} ({len(rec[a])}), not "
                              f"{len(rec[b])}")
        return value


def _show(value: Any) -> str:
    """A value for a message: its type, and the value itself when short."""
    text = repr(value)
    return f"{type(value).__name__} {text}" if len(text) <= 40 else type(value).__name__
