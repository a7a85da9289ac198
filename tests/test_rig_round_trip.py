"""Every emulated rig through the real commands, as a user runs them: `ptb emulate --rig X
--write-rig r.toml`, then `ptb calibrate --rig r.toml` (every rig with a chip: the hexagonal
mesh's whole calibration, whose file the served chip then loads and routes light with, read on
the bus's power meter) and `ptb serve --rig r.toml`; and one writer per device: while the chip
service holds the heater DAC, `ptb calibrate` and any other program that opens the board are
refused, and the chip's heaters stay as they were."""
from __future__ import annotations

import json
import os
import pathlib
import signal
import subprocess
import sys
import time

import pytest

from photonic_testbed.drivers.heater_dac import HeaterDAC, PortInUse
from photonic_testbed.drivers.mesh import read_calibration
from photonic_testbed.hil import rig as rigfile
from photonic_testbed.hil.bus.client import ServiceClient

ROOT = pathlib.Path(__file__).resolve().parents[1]
START_S = 60                      # generous: a busy 2-core machine starts processes slowly

# A bench of our own ([emulator] table, docs/rigfile.md): an 8-port Benes chip on 3 modules.
BENCH = """\
[emulator]
base = "lumion"
description = "8 x 8 Benes chip, its OCS input selector, meter and laser"
dac_modules = 3
chip_ports = 8
ocs_ports = 8
meter_channels = 8
"""

# rig -> (the chip's topology in the written rig file, what `ptb calibrate` is asked beyond
# --rig and --out) or None: no chip. The feed-forward chips calibrate one cell (their whole
# calibration is tests/test_calibration.py's), the hexagonal mesh all of it.
CHIPS = {"lumion": ("benes16", ["--cells", "s0r0", "--no-crosstalk"]),
         "bench": ("benes8", ["--cells", "s0r0", "--no-crosstalk"]),
         "hexmesh": ("hexagonal4x4", []), "opus": None}
# circuits on the hexagonal mesh (8 and 6 cells long), each lit from one end in turn
HEX_CIRCUITS = [[1, 9], [4, 13]]


def _ptb(*args) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.Popen([sys.executable, "-m", "photonic_testbed.ptb", *args], cwd=ROOT,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _run(*args, timeout=240) -> tuple[int, str]:
    proc = _ptb(*args)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
        raise AssertionError(f"ptb {' '.join(args)} did not finish:\n{out}") from None
    return proc.returncode, out


def _wait_for(path: pathlib.Path, proc: subprocess.Popen) -> None:
    deadline = time.monotonic() + START_S
    while not path.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise AssertionError(f"{path} never appeared:\n{proc.communicate()[0]}")
        time.sleep(0.05)


def _stop(proc: subprocess.Popen | None) -> str:
    if proc is None:
        return ""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        return proc.communicate(timeout=20)[0]
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.communicate()[0]


@pytest.fixture
def emulated(request, tmp_path):
    """`ptb emulate --rig NAME --write-rig rig.toml --endpoints endpoints.json` running."""
    name = request.param
    target = name
    if name == "bench":
        target = str(tmp_path / "bench.toml")
        pathlib.Path(target).write_text(BENCH)
    rig_path, ep_path = tmp_path / "rig.toml", tmp_path / "endpoints.json"
    proc = _ptb("emulate", "--rig", target, "--write-rig", str(rig_path),
                "--endpoints", str(ep_path))
    try:
        _wait_for(rig_path, proc)
        _wait_for(ep_path, proc)
        yield name, rig_path, json.loads(ep_path.read_text())
    finally:
        out = _stop(proc)
    assert "Traceback" not in out, out


@pytest.mark.parametrize("emulated", list(CHIPS), indirect=True)
def test_every_emulated_rig_writes_a_rig_file_that_calibrates_and_serves(emulated, tmp_path):
    name, rig_path, _ = emulated
    rig = rigfile.load(rig_path)
    chip = CHIPS[name]
    assert (rig.chip.topology if rig.chip else None) == (chip[0] if chip else None)
    if chip:                  # the chip is one device: the mesh driver owns the heater DAC
        assert rig.devices["chip"].kind == "chip" and rig.chip.switch == "chip"

    cal = tmp_path / "cal.json"
    code, out = _run("calibrate", "--rig", str(rig_path), "--out", str(cal),
                     *(chip[1] if chip else []))
    assert "Traceback" not in out, out
    if chip:
        assert code == 0, out
        written = read_calibration(cal)
        assert written.verified and written.chip == chip[0] and written.method == "monitors"
        assert written.chip_id == f"{rig.name}/{chip[0]}" and written.heaters
        if name == "hexmesh":               # every cell, with the crosstalk between them
            assert sorted(written.heaters) == list(range(18)) and len(written.cells) == 18
            assert written.crosstalk is not None and written.crosstalk.max() > 0.01
    else:
        assert code == 1 and not cal.exists(), out
        assert "names no chip to calibrate" in out

    ep_path = tmp_path / "served.json"
    serve = _ptb("serve", "--rig", str(rig_path), "--one-process", "--endpoints", str(ep_path))
    try:
        _wait_for(ep_path, serve)
        served = json.loads(ep_path.read_text())
        assert set(served) == set(rig.devices)
        for device, (request, _) in served.items():
            with ServiceClient(request, timeout=10) as client:
                assert client.call("ping")
                described = client.call("describe")["device"]
                if device == "chip":
                    assert described["topology"]["name"] == chip[0]
        if name == "hexmesh":
            ideal = _light_at_the_far_ends(served)
            with ServiceClient(served["chip"][0], timeout=10) as chip_service:
                loaded = chip_service.call("load_calibration", calibration=cal.read_text())
            assert loaded["chip_id"] == "hexmesh/hexagonal4x4"
            ours = _light_at_the_far_ends(served)
            print(f"share of the light leaving by the circuit's other end: {ours} with the "
                  f"calibration, {ideal} with the ideal one")
            assert min(ours) > 0.9 and min(ours) > max(ideal)
    finally:
        out = _stop(serve)
    assert serve.returncode == 0 and "Traceback" not in out, out


def _light_at_the_far_ends(served: dict) -> list[float]:
    """HEX_CIRCUITS made by the served chip; each end lit in turn (the laser through the OCS
    into that port), the share of the light the power meter reads leaving the chip's ports
    that leaves by the circuit's other end: everything through the bus."""
    calls = {d: ServiceClient(served[d][0], timeout=10) for d in ("chip", "ocs", "laser",
                                                                  "powermeter")}
    try:
        calls["chip"].call("apply_circuits", circuits=HEX_CIRCUITS)
        calls["laser"].call("set_laser", on=True, power_mw=1.0)
        shares = []
        for a, b in HEX_CIRCUITS:
            for lit, far in ((a, b), (b, a)):
                calls["ocs"].call("apply_circuits", circuits=[[1, 16 + lit]])
                power = calls["powermeter"].call("read_power", channels=list(range(1, 17)))
                mw = power["power"]
                shares.append(round(mw[far] / sum(mw.values()), 4))
        return shares
    finally:
        for client in calls.values():
            client.close()


@pytest.mark.parametrize("emulated", ["lumion"], indirect=True)
def test_one_writer_while_the_chip_service_holds_the_dac(emulated, tmp_path):
    """Process 1 is the chip service, which holds the heater DAC; `ptb calibrate --rig` is
    refused before it opens anything (naming the service), `ptb calibrate --endpoints` (no
    rig file to know the service from) and this process are refused by the port's lock; the
    heaters read back unchanged throughout."""
    _, rig_path, endpoints = emulated
    link = endpoints["dac"]
    ep_path = tmp_path / "served.json"
    serve = _ptb("serve", "--rig", str(rig_path), "--device", "chip", "--one-process",
                 "--endpoints", str(ep_path))
    try:
        _wait_for(ep_path, serve)
        request = json.loads(ep_path.read_text())["chip"][0]
        with ServiceClient(request, timeout=10) as chip:
            chip.call("apply_circuits", circuits=[[1, 18], [2, 17], [5, 30]])
            before = chip.call("read_heaters")["volts"]
            assert any(v > 0.5 for v in before)         # the circuits heat some cells

            code, out = _run("calibrate", "--rig", str(rig_path), "--out",
                             str(tmp_path / "cal.json"))
            assert code == 1 and "Traceback" not in out, out
            assert f"the chip service 'chip' at {request} is running" in out
            assert "stop it" in out and not (tmp_path / "cal.json").exists()

            code, out = _run("calibrate", "--endpoints", str(rig_path.parent / "endpoints.json"),
                             "--topology", "benes16", "--out", str(tmp_path / "cal.json"))
            assert code == 1 and "Traceback" not in out, out
            assert f"{link} is in use" in out

            with pytest.raises(PortInUse, match=f"{link} is in use"):
                HeaterDAC(link, timeout=5).open()

            assert chip.call("read_heaters")["volts"] == before
            assert [[1, 18], [2, 17], [5, 30]] == sorted(chip.call("read_circuits")["circuits"])
    finally:
        out = _stop(serve)
    assert "Traceback" not in out, out
    with HeaterDAC(link, timeout=5) as dac:          # the lock went with the service
        assert dac.voltages() == pytest.approx(before, abs=2e-4)


def test_calibrate_starts_an_emulator_description_itself(tmp_path):
    """`ptb calibrate --rig bench.toml` with an [emulator] table: started in this process (as a
    rig's name is), not read as a rig file."""
    bench = tmp_path / "bench.toml"
    bench.write_text(BENCH)
    cal = tmp_path / "cal.json"
    code, out = _run("calibrate", "--rig", str(bench), "--out", str(cal), "--cells", "s1r0",
                     "--no-crosstalk", "--no-monitors")
    assert code == 0 and "started the emulated rig bench" in out, out
    written = read_calibration(cal)
    assert written.chip == "benes8" and written.method == "outputs" and written.verified
