"""The digital twin (`ptb emulate --chip-from CALIBRATION`): a chip whose hidden truth is a
measured calibration file's. Built from a file, its truth holds the file's offsets, P_pi,
resistances and crosstalk, and couplers with the file's bar and cross extinctions; calibrating
the twin through its wires recovers the file within the calibration's stated accuracy
(docs/calibration.md: offsets 0.02 rad, efficiencies 2 %, measured extinctions within 2 dB
where the couplers allow less than 35 dB), on two seeds."""
from __future__ import annotations

import json
import math
import os
import pathlib
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from photonic_testbed.calibration.run import calibrate
from photonic_testbed.calibration.station import Station
from photonic_testbed.common.calibration import Calibration, HeaterCalibration
from photonic_testbed.common.topology import benes
from photonic_testbed.drivers.heater_dac import HeaterDAC
from photonic_testbed.drivers.laser import Laser
from photonic_testbed.drivers.mesh import write_calibration
from photonic_testbed.drivers.ocs import OpticalCircuitSwitch
from photonic_testbed.drivers.power_meter import PowerMeter
from photonic_testbed.emulator.chip import ChipError, EmulatedChip, cell_matrix
from photonic_testbed.emulator.dac_board import heater_resistances
from photonic_testbed.emulator.rig import EmulatedRig
from photonic_testbed.hil import rig as rigfile
from tests.timeouts import DEVICE_S

ROOT = pathlib.Path(__file__).resolve().parents[1]
N = 16
TOPOLOGY = benes(N).describe()


def extinctions_db(r1: float, r2: float) -> tuple[float, float]:
    """A cell's bar and cross extinction (dB) as its monitor photodiode sees them (bottom
    output; lit on the top input for bar, on the bottom one for cross)."""
    p = np.abs(cell_matrix(np.array([0.0, math.pi]), 0.0, r1, r2)) ** 2
    return 10 * math.log10(p[0, 1, 0] / p[1, 1, 0]), 10 * math.log10(p[1, 1, 1] / p[0, 1, 1])


def chip_file(seed: int) -> Calibration:
    """The calibration file of the lumion chip of `seed`, as a perfect measurement would
    write it (the truth, in the file's terms): a chip the test's own to copy."""
    chip = EmulatedChip(TOPOLOGY, seed=seed, resistances=heater_resistances(56, seed))
    t = chip.truth()
    heaters = {ch: HeaterCalibration(float(o), float(p), float(r), cell=chip.cell_ids[i])
               for i, (ch, o, p, r) in enumerate(zip(t.channels, t.offset_rad, t.p_pi_mw,
                                                     t.resistance_ohm, strict=True))}
    at = [t.channels.index(ch) for ch in sorted(t.channels)]
    cells = {}
    for i, cid in enumerate(chip.cell_ids):
        bar, cross = extinctions_db(*t.couplers[i])
        cells[cid] = {"channels": [t.channels[i]], "sweep_v": [], "power": [], "fit_v": [],
                      "fit_power": [], "extinction_db": min(bar, 60.0),
                      "cross_extinction_db": min(cross, 60.0)}
    return Calibration(heaters, t.crosstalk[np.ix_(at, at)], "benes16", "chip.json",
                       chip_id=f"seed{seed}", rig="lumion", method="monitors", cells=cells)


def test_the_twins_truth_is_the_files():
    source = chip_file(5)
    now = [0.0]                       # the twin's own clock: its heaters settle when told
    twin = EmulatedChip.from_calibration(TOPOLOGY, source, seed=11, clock=lambda: now[0])
    t = twin.truth()
    chans = list(t.channels)
    assert t.offset_rad == pytest.approx([source.heaters[c].offset_rad for c in chans])
    assert t.p_pi_mw == pytest.approx([source.heaters[c].p_pi_mw for c in chans])
    assert t.resistance_ohm == pytest.approx([source.heaters[c].r_ohm for c in chans])
    at = [sorted(chans).index(c) for c in chans]
    assert t.crosstalk == pytest.approx(source.crosstalk[np.ix_(at, at)])
    for i, cid in enumerate(t.cells):
        bar, cross = extinctions_db(*t.couplers[i])
        assert bar == pytest.approx(source.cells[cid]["extinction_db"], abs=1e-6)
        assert cross == pytest.approx(source.cells[cid]["cross_extinction_db"], abs=1e-6)
    # the phase law the mesh driver uses sees the same chip (the crosstalk in the mix too)
    volts = {ch: 2.0 + 0.05 * k for k, ch in enumerate(sorted(chans))}
    twin.set_voltages(volts)
    now[0] += 1.0                     # a million thermal time constants later
    want = source.phases(volts)
    got = np.mod(twin.phases(), 2 * math.pi)
    diff = np.angle(np.exp(1j * (got - np.array([want[c] for c in chans]))))
    assert np.abs(diff).max() < 1e-9
    # a file for another chip, and a file without its crosstalk
    with pytest.raises(ChipError, match="not this chip's"):
        EmulatedChip.from_calibration(benes(8).describe(), source)
    flat = EmulatedChip.from_calibration(TOPOLOGY, source.without_crosstalk(), seed=11)
    assert not flat.truth().crosstalk.any()


def _calibrate(rig: EmulatedRig) -> Calibration:
    ep = rig.endpoints
    dac = HeaterDAC(ep["dac"], timeout=DEVICE_S)
    dac.open()
    selector = OpticalCircuitSwitch(ep["ocs"], timeout_s=DEVICE_S)
    meter = PowerMeter(ep["powermeter"], ports=N, timeout_s=DEVICE_S)
    laser = Laser(ep["laser"], timeout_s=DEVICE_S)
    try:
        laser.set_power_mw(1.0)
        laser.on()
        return calibrate(Station(benes(N), dac, selector, meter), rig="twin")
    finally:
        for d in (dac, selector, meter, laser):
            d.close()


@pytest.mark.parametrize("seed", [1, 2])
def test_calibrating_the_twin_recovers_its_file(seed, tmp_path):
    source = chip_file(seed)
    with EmulatedRig(rigfile.rig_spec("lumion"), seed=seed + 100, workdir=tmp_path,
                     switching_s=0.0, chip_calibration=source) as rig:
        got = _calibrate(rig)
    chans = sorted(source.heaters)
    off = np.array([got.heaters[c].offset_rad - source.heaters[c].offset_rad for c in chans])
    off = np.abs((off + math.pi) % (2 * math.pi) - math.pi)
    eff = np.abs([source.heaters[c].p_pi_mw / got.heaters[c].p_pi_mw - 1 for c in chans])
    r = np.abs([got.heaters[c].r_ohm / source.heaters[c].r_ohm - 1 for c in chans])
    dk = got.crosstalk - source.crosstalk
    print(f"seed {seed}: offsets max {off.max():.4f} rad, efficiencies max "
          f"{eff.max() * 100:.3f} %, resistances max {r.max() * 100:.4f} %, crosstalk rms "
          f"{np.sqrt((dk ** 2).mean()):.1e} max {np.abs(dk).max():.1e}")
    assert off.max() <= 0.02 and eff.max() < 0.02 and r.max() < 1e-3
    assert np.sqrt((dk ** 2).mean()) < 3e-4 and np.abs(dk).max() < 3e-3
    for key in ("extinction_db", "cross_extinction_db"):
        want = np.array([source.cells[c][key] for c in source.cells])
        have = np.array([got.cells[c][key] for c in source.cells])
        low = want < 35.0
        print(f"  {key}: {low.sum()} cells below 35 dB, within "
              f"{np.abs(have - want)[low].max():.2f} dB; above, the twin's min "
              f"{have[~low].min():.1f} dB")
        assert np.abs(have - want)[low].max() < 2.0 and (have[~low] > 33.0).all()


def test_ptb_emulate_chip_from_serves_the_twin(tmp_path):
    """From the command line: the board's heaters have the file's resistances, and the rig
    file names the file as the chip's calibration; a file for another chip is refused."""
    source = chip_file(7)
    cal = tmp_path / "chip.json"
    write_calibration(source, cal)
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    cmd = [sys.executable, "-m", "photonic_testbed.ptb", "emulate", "--rig", "lumion",
           "--chip-from", str(cal)]
    proc = subprocess.Popen([*cmd, "--endpoints", "e.json", "--write-rig", "r.toml"],
                            cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 60
        while not (tmp_path / "r.toml").exists():
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[0]
            time.sleep(0.05)
        written = rigfile.load(tmp_path / "r.toml")
        assert written.chip.calibration == str(cal)
        with HeaterDAC(json.loads((tmp_path / "e.json").read_text())["dac"]) as dac:
            dac.set_voltages({0: 4.0, 9: 4.0})
            for ch in (0, 9):
                r = dac.voltage(ch) / dac.current(ch) * 1000.0
                assert r == pytest.approx(source.heaters[ch].r_ohm, rel=2e-3)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
        out = proc.communicate(timeout=30)[0]
    assert proc.returncode == 0 and f"chip: the twin of {cal}" in out, out
    done = subprocess.run([*cmd[:-4], "--rig", "opus", "--chip-from", str(cal)], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 1 and "the rig opus has no chip" in done.stderr
