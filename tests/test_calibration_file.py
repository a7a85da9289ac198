"""The calibration file (common.calibration): what is written reads back exactly, and a damaged
file is refused with one error type, CalibrationFileError, never another exception; older
files without a checksum load with a warning; `ptb calibrate` says so in plain words."""
from __future__ import annotations

import json
import os
import pathlib
import re
import subprocess
import sys
import warnings

import numpy as np
import pytest

from photonic_testbed.common.calibration import (
    CALIBRATION_VERSION,
    Calibration,
    CalibrationFileError,
    HeaterCalibration,
    UnverifiedCalibrationWarning,
    checksum,
)
from photonic_testbed.drivers.mesh import read_calibration, write_calibration

ROOT = pathlib.Path(__file__).resolve().parents[1]


def written() -> Calibration:
    """A calibration like a run writes: 12 heaters, crosstalk, every kind of cell record."""
    rng = np.random.default_rng(5)
    heaters = {ch: HeaterCalibration(float(rng.uniform(0, 2 * np.pi)), float(rng.uniform(20, 25)),
                                     float(rng.uniform(950, 1050)), float(rng.uniform(0, 0.01)),
                                     float(rng.uniform(0, 0.05)), f"s{ch // 4}r{ch % 4}")
               for ch in range(12)}
    k = rng.uniform(0, 0.04, (12, 12)) * (1 - np.eye(12))
    cells = {}
    for ch in range(12):
        v = np.linspace(0, 7, 16)
        cells[f"s{ch // 4}r{ch % 4}"] = {
            "channels": [ch], "sweep_v": v.tolist(), "sweep_p_mw": (v ** 2).tolist(),
            "power": rng.uniform(0, 3, 16).tolist(), "fit_v": v.tolist(),
            "fit_power": rng.uniform(0, 3, 16).tolist(), "detector": "pd", "sweep": "final",
            "extinction_db": float(rng.uniform(25, 40)), "cross_extinction_db": 31.25,
            "extinction_from": "settings", "visibility": 0.9985, "splitter_limited": ch == 3,
            "coupler_imbalance": 0.02, "coupler_sum_error": 0.04, "residual_rms": 0.001,
            "measurements": 38, "p_pi_mw": heaters[ch].p_pi_mw,
            "offset_rad": heaters[ch].offset_rad}
    return Calibration(heaters, k, "benes8", "run", "bench/benes8", "bench",
                       "2026-11-23T08:00:00Z", "monitors", k / 10, cells)


def same(a: Calibration, b: Calibration) -> bool:
    """Exactly the same values (floats bit for bit)."""
    return a.to_dict() == b.to_dict() and np.array_equal(a.crosstalk, b.crosstalk) and \
        np.array_equal(a.crosstalk_std, b.crosstalk_std)


def test_what_is_written_reads_back_exactly(tmp_path):
    cal = written()
    path = tmp_path / "cal.json"
    write_calibration(cal, path)
    back = read_calibration(path)
    assert same(back, cal) and back.verified and back.source == str(path)
    assert back.heaters == cal.heaters and back.cells == cal.cells
    data = json.loads(path.read_text())
    assert data["version"] == CALIBRATION_VERSION == 3
    assert re.fullmatch(r"sha256:[0-9a-f]{64}", data["checksum"])
    # the check is of the values, not the layout: another indentation still verifies
    relaid = tmp_path / "relaid.json"
    relaid.write_text(json.dumps(data, indent=4, sort_keys=True))
    assert same(read_calibration(relaid), cal)
    assert not (tmp_path / "cal.json.tmp").exists()


def test_a_calibration_that_would_not_read_back_is_not_written(tmp_path):
    path = tmp_path / "cal.json"
    bad = written()
    bad = Calibration({**bad.heaters, 0: HeaterCalibration(p_pi_mw=float("nan"))}, None, "x")
    with pytest.raises(CalibrationFileError, match="not a number|NaN|JSON"):
        write_calibration(bad, path)
    huge = Calibration({0: HeaterCalibration(p_pi_mw=1e308)}, None, "x")
    with pytest.raises(CalibrationFileError, match=r"channels\[0\].p_pi_mw"):
        write_calibration(huge, path)
    assert not path.exists()


# ---- damaged files: each loads exactly as written or raises CalibrationFileError -------------

def _resealed(content: dict) -> bytes:
    """A file whose checksum matches its (changed) content: only the field checks stand."""
    return json.dumps({**content, "checksum": checksum(content)}, indent=1).encode()


def corrupted_variants(text: str) -> list[tuple[str, bytes]]:
    """~200 damaged versions of a file's text: bit flips, bad bytes, digit edits, numbers as
    strings, huge and non-finite numbers, missing and extra fields, truncations (each with the
    checksum left as written); and the same kinds of damage with the checksum recomputed, so
    that the field checks alone must refuse them."""
    rng = np.random.default_rng(2024)
    raw = text.encode()
    out = []
    for pos in rng.choice(len(raw), 60, replace=False):
        b = bytearray(raw)
        b[pos] ^= 1 << int(rng.integers(8))
        out.append((f"bit flip at {pos}", bytes(b)))
    for pos in rng.choice(len(raw), 10, replace=False):
        b = bytearray(raw)
        b[pos] = 0xFF
        out.append((f"byte 0xff at {pos}", bytes(b)))
    digits = [m.start() for m in re.finditer(rb"\d", raw)]
    for pos in rng.choice(digits, 30, replace=False):
        b = bytearray(raw)
        b[pos] = ord("0") + (b[pos] - ord("0") + int(rng.integers(1, 10))) % 10
        out.append((f"digit edit at {pos}", bytes(b)))
    numbers = [m for m in re.finditer(rb'("(?:offset_rad|p_pi_mw|r_ohm|offset_std|extinction_db|'
                                      rb'visibility)": )(-?[0-9.e+-]+)', raw)]
    for m in [numbers[int(i)] for i in rng.choice(len(numbers), 10, replace=False)]:
        for what, new in (("string", b'"' + m.group(2) + b'"'), ("1e308", b"1e308"),
                          ("NaN", b"NaN"), ("Infinity", b"-Infinity"), ("true", b"true"),
                          ("1e999", b"1e999")):
            out.append((f"{what} for {m.group(1).decode()!r} at {m.start()}",
                        raw[:m.start(2)] + new + raw[m.end(2):]))
    for cut in rng.choice(len(raw), 8, replace=False):
        out.append((f"truncated at {cut}", raw[:cut]))
    out += [("empty", b""), ("not an object", b"[]"), ("BOM", b"\xef\xbb\xbf" + raw),
            ("checksum removed", re.sub(rb',\s*"checksum": "[^"]*"', b"", raw)),
            ("version 2 with a checksum", raw.replace(b'"version": 3', b'"version": 2', 1)),
            ("duplicate key", raw.replace(b'"rig": "bench"', b'"rig": "bench", "rig": "x"', 1)),
            ("deep nesting", b"[" * 100_000 + b"]" * 100_000)]
    content = {k: v for k, v in json.loads(text).items() if k != "checksum"}
    first = dict(content["channels"][0])
    cell = next(iter(content["cells"]))
    resealed = [
        ("string for a number", {**content, "channels": [{**first, "p_pi_mw": "22.1"},
                                                         *content["channels"][1:]]}),
        ("1e308 for R", {**content, "channels": [{**first, "r_ohm": 1e308},
                                                 *content["channels"][1:]]}),
        ("negative P_pi", {**content, "channels": [{**first, "p_pi_mw": -1.0},
                                                   *content["channels"][1:]]}),
        ("offset out of range", {**content, "channels": [{**first, "offset_rad": 1e6},
                                                         *content["channels"][1:]]}),
        ("bool for a channel", {**content, "channels": [{**first, "channel": True},
                                                        *content["channels"][1:]]}),
        ("a channel twice", {**content, "channels": [first, *content["channels"]]}),
        ("no channels", {**content, "channels": []}),
        ("crosstalk of 2", {**content, "crosstalk": [[2.0] * 12] * 12}),
        ("crosstalk not square", {**content, "crosstalk": content["crosstalk"][1:]}),
        ("negative spread", {**content, "crosstalk_std": [[-0.1] * 12] * 12}),
        ("unknown method", {**content, "method": "guess"}),
        ("a number for a name", {**content, "chip": 16}),
        ("extra top-level field", {**content, "operator": "me"}),
        ("extra channel field", {**content, "channels": [{**first, "gain": 1.0},
                                                         *content["channels"][1:]]}),
        ("extra cell field", {**content, "cells": {**content["cells"],
                                                   cell: {**content["cells"][cell], "x": 1}}}),
        ("fringe lengths differ", {**content, "cells": {
            **content["cells"], cell: {**content["cells"][cell], "power": [1.0]}}}),
        ("visibility above 1", {**content, "cells": {
            **content["cells"], cell: {**content["cells"][cell], "visibility": 1.5}}}),
        ("a cell record not an object", {**content, "cells": {cell: [1, 2]}}),
        ("future version", {**content, "version": 4}),
    ]
    for key in content:
        resealed.append((f"{key} missing", {k: v for k, v in content.items() if k != key}))
    for key in first:
        resealed.append((f"channel {key} missing",
                         {**content, "channels": [{k: v for k, v in first.items() if k != key},
                                                  *content["channels"][1:]]}))
    for key in ("channels", "sweep_v", "power", "fit_v", "fit_power", "extinction_db"):
        resealed.append((f"cell record {key} missing", {**content, "cells": {
            **content["cells"], cell: {k: v for k, v in content["cells"][cell].items()
                                       if k != key}}}))
    out += [(f"resealed: {what}", _resealed(c)) for what, c in resealed]
    return out


def test_damaged_files_load_exactly_or_are_refused_with_one_error(tmp_path):
    cal = written()
    text = cal.dumps()
    variants = corrupted_variants(text)
    assert len(variants) >= 100
    refused, loaded = 0, 0
    path = tmp_path / "cal.json"
    for what, data in variants:
        assert data != text.encode(), what
        path.write_bytes(data)
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("error")           # no silent legacy load either
                back = read_calibration(path)
        except CalibrationFileError as e:
            assert str(path) in str(e), (what, str(e))
            refused += 1
            continue
        assert same(back, cal), f"{what}: loaded different values"
        loaded += 1
    # a flip that leaves the values as they were (in the layout) may load: only exactly
    assert refused >= len(variants) - 10 and refused + loaded == len(variants)
    # the error names what is wrong
    path.write_bytes(text.encode().replace(b"benes8", b"benes9", 1))
    with pytest.raises(CalibrationFileError, match="checksum: expected the SHA-256"):
        read_calibration(path)
    path.write_bytes(b'{"version": 3}\xff')
    with pytest.raises(CalibrationFileError, match=r"not UTF-8 text \(byte 14"):
        read_calibration(path)


# ---- files of the previous versions -------------------------------------------------------------

def legacy(version: int) -> dict:
    d = written().to_dict()
    d["version"] = version
    if version == 1:
        d = {"version": 1, "chip": d["chip"], "crosstalk": d["crosstalk"],
             "channels": [{k: c[k] for k in ("channel", "offset_rad", "p_pi_mw", "r_ohm")}
                          for c in d["channels"]]}
    return d


@pytest.mark.parametrize("version", [1, 2])
def test_older_files_load_with_a_warning(tmp_path, version):
    path = tmp_path / "old.json"
    path.write_text(json.dumps(legacy(version), indent=1))
    with pytest.warns(UnverifiedCalibrationWarning, match="re-save it with `ptb calibrate "
                      "--resave FILE`"):
        back = read_calibration(path)
    assert not back.verified
    cal = written()
    assert back.heaters.keys() == cal.heaters.keys()
    assert np.array_equal(back.crosstalk, cal.crosstalk)
    if version == 2:
        assert same(back, cal)
    # still checked field by field
    bad = legacy(version)
    bad["channels"][0]["p_pi_mw"] = "22.1"
    path.write_text(json.dumps(bad))
    with pytest.raises(CalibrationFileError, match=r"channels\[0\].p_pi_mw: expected a number"):
        read_calibration(path)


# ---- the command line ---------------------------------------------------------------------------

def _ptb(*args) -> tuple[int, str]:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, "-m", "photonic_testbed.ptb", *args], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=240)
    return proc.returncode, proc.stdout + proc.stderr


def test_resave_adds_the_checksum_to_an_older_file(tmp_path):
    path = tmp_path / "old.json"
    path.write_text(json.dumps(legacy(2)))
    code, out = _ptb("calibrate", "--resave", str(path))
    assert code == 0 and "had no checksum" in out, out
    back = read_calibration(path)
    assert back.verified and same(back, written())
    path.write_bytes(path.read_bytes().replace(b'"rig": "bench"', b'"rig": "bunch"'))
    code, out = _ptb("calibrate", "--resave", str(path))
    assert code == 1 and "checksum" in out and "Traceback" not in out, out


@pytest.mark.parametrize("mode", ["--drift-check", "--update"])
def test_calibrate_refuses_a_damaged_file_plainly(tmp_path, mode):
    """The damage of issue 15 (one non-UTF-8 byte) in the file of a drift check or update:
    exit 1 and a sentence, no traceback, before any instrument is driven."""
    path = tmp_path / "cal.json"
    data = bytearray(written().dumps().encode())
    data[40] = 0xFF
    path.write_bytes(bytes(data))
    code, out = _ptb("calibrate", "--rig", "lumion", mode, str(path),
                     *(["--cells", "s0r0"] if mode == "--update" else []))
    assert code == 1 and "Traceback" not in out, out
    assert f"cannot use {path}" in out and "not UTF-8 text (byte 40" in out
