"""The bench itself, through the rig file named by PTB_RIG (docs/lab.md, "Hardware tests").

Marked `hardware`: skipped without PTB_RIG (tests/conftest.py). On a lab's bench:

    PTB_RIG=/path/to/rig.toml python -m pytest -m hardware tests/test_hardware.py

CI runs the same file against an emulated rig's rig file (tests/test_lab.py), so these tests
are exercised on every change. They talk to the instruments through our drivers only, change
little (0.5 V on one heater, one OCS circuit, the laser at 1 mW) and put back what they changed.
"""
from __future__ import annotations

import os

import pytest

from photonic_testbed.drivers.heater_dac import HeaterDAC
from photonic_testbed.hil import rig as rigfile
from photonic_testbed.hil.devices.kinds import KINDS, open_driver

pytestmark = pytest.mark.hardware

FIRST_LIGHT_MW = 1.0
PROBE_VOLTS = 0.5                # a heater at 0.5 V draws about 0.25 mW: harmless to any chip
MIN_CONTRAST_DB = 10.0           # light on must read this much above light off


@pytest.fixture(scope="module")
def rig():
    return rigfile.load(os.environ["PTB_RIG"])


def _devices(rig, *kinds):
    return [d for d in rig.devices.values() if d.kind in kinds]


def _open(device):
    """Our driver for a device, as its service opens it (a chip's board: the DAC alone)."""
    if device.kind in ("heater_dac", "chip"):
        dac = HeaterDAC(device.address, timeout=5.0)
        dac.open()
        return dac
    return open_driver(KINDS[device.kind], device.driver, device.address, device.options)


def _one(rig, kind, what):
    found = _devices(rig, kind)
    if not found:
        pytest.skip(f"the rig has no {what}")
    return found[0]


def test_the_rig_file_reads_and_names_devices(rig):
    assert rig.devices, "a rig file names at least one device"
    assert all(d.kind in KINDS for d in rig.devices.values())


def test_every_device_answers_who_it_is(rig):
    for device in rig.devices.values():
        drv = _open(device)
        try:
            if isinstance(drv, HeaterDAC):
                assert drv.info.channels > 0 and drv.info.ident, device.name
            else:
                assert drv.identity.count(",") >= 3, (device.name, drv.identity)
        finally:
            drv.close()


def test_a_heater_takes_a_voltage_and_gives_it_back(rig):
    device = (_devices(rig, "heater_dac", "chip") or [None])[0]
    if device is None:
        pytest.skip("the rig has no heater DAC")
    with HeaterDAC(device.address, timeout=5.0) as dac:
        before = dac.voltage(0)
        try:
            dac.set_voltage(0, PROBE_VOLTS)
            assert dac.voltage(0) == pytest.approx(PROBE_VOLTS, abs=1e-3)
            assert dac.current(0) >= 0.0
        finally:
            dac.set_voltage(0, before)
        assert dac.voltage(0) == pytest.approx(before, abs=1e-3)


def test_first_light_laser_one_circuit_the_meter_reads_it(rig):
    """Laser on, one circuit from the laser's ingress (1) to the first egress, and the power
    meter sees the light: its best port reads at least 10 dB more with the laser on."""
    laser = _open(_one(rig, "laser", "laser"))
    switch = _open(_one(rig, "switch", "switch"))
    meter = _open(_one(rig, "power_meter", "power meter"))
    try:
        was_on, was_mw = laser.is_on(), laser.power_mw()
        circuits = switch.circuits()
        try:
            switch.apply({1: switch.ports + 1})
            laser.set_power_mw(FIRST_LIGHT_MW)
            laser.on()
            lit = max(r.dbm for r in meter.read_all().values())
            laser.off()
            dark = max(r.dbm for r in meter.read_all().values())
            assert lit > dark + MIN_CONTRAST_DB, (lit, dark)
        finally:
            switch.apply(circuits)
            laser.set_power_mw(was_mw)
            laser.set_output(was_on)
        assert switch.circuits() == circuits and laser.is_on() == was_on
    finally:
        for drv in (laser, switch, meter):
            drv.close()
