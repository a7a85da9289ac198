"""The bring-up path of docs/lab.md on the emulator: `ptb discover` writes the rig file, and the
hardware-marked tests (tests/test_hardware.py) run against it in their own pytest, exactly as
the guide has a lab run them (PTB_RIG=... python -m pytest -m hardware ...), so that they are
exercised on every change and cannot rot."""
from __future__ import annotations

import os
import pathlib
import subprocess
import sys

from photonic_testbed.emulator.rig import EmulatedRig
from photonic_testbed.hil import rig as rigfile
from photonic_testbed.ptb.replay import _wait_for_power_up

ROOT = pathlib.Path(__file__).resolve().parents[1]
# The guide's command, as a lab runs it from a checkout (docs/lab.md, "Hardware tests").
HARDWARE_TESTS = "python -m pytest -m hardware tests/test_hardware.py"


def test_the_guide_runs_the_hardware_tests_this_way():
    assert f"PTB_RIG=/path/to/rig.toml {HARDWARE_TESTS}" in (ROOT / "docs/lab.md").read_text()


def test_the_hardware_tests_pass_on_a_discovered_emulated_rig(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    workdir = tmp_path / "rig"
    workdir.mkdir()
    with EmulatedRig(rigfile.rig_spec("lumion"), seed=0, workdir=workdir) as rig:
        _wait_for_power_up(rig.dac)
        rig.write_endpoints(tmp_path / "endpoints.json")
        done = subprocess.run([sys.executable, "-m", "photonic_testbed.ptb", "discover",
                               "--no-scan", "--endpoints", "endpoints.json", "--chip",
                               "benes16"], cwd=tmp_path, env=env, capture_output=True,
                              text=True, timeout=120)
        assert done.returncode == 0, done.stdout + done.stderr
        argv = HARDWARE_TESTS.split()
        done = subprocess.run([sys.executable, *argv[1:], "-p", "no:cacheprovider", "-rs"],
                              cwd=ROOT, env={**env, "PTB_RIG": str(tmp_path / "rig.toml")},
                              capture_output=True, text=True, timeout=300)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out
    assert "4 passed" in out and "skipped" not in out, out
