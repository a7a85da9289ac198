"""The lumion rig over its real wires only: laser -> OCS (input selector) -> chip -> power meter,
heaters and monitor photodiodes through the DAC board's serial line."""
from __future__ import annotations

import numpy as np
import pytest

from photonic_testbed.common.topology import benes
from photonic_testbed.drivers.heater_dac import HeaterDAC
from photonic_testbed.drivers.laser import Laser
from photonic_testbed.drivers.mesh import Mesh
from photonic_testbed.drivers.ocs import OpticalCircuitSwitch
from photonic_testbed.drivers.power_meter import PowerMeter
from photonic_testbed.emulator.rig import EmulatedRig
from photonic_testbed.hil.rig import rig_spec
from tests.timeouts import DEVICE_S

N = 16


@pytest.fixture(params=[True, False], ids=["ideal", "seeded"])
def lumion(request, tmp_path):
    with EmulatedRig(rig_spec("lumion"), seed=7, workdir=tmp_path, switching_s=0.0,
                     ideal_chip=request.param) as rig:
        ep = rig.endpoints
        dac = HeaterDAC(ep["dac"], timeout=10.0).__enter__()   # a busy machine: generous
        mesh = Mesh(benes(N), dac)
        selector = OpticalCircuitSwitch(ep["ocs"], timeout_s=DEVICE_S)
        meter = PowerMeter(ep["powermeter"], ports=N, timeout_s=DEVICE_S)
        for port in range(1, N + 1):
            meter.set_averaging_time(port, 0.0)     # the emulator honours it as a delay
        laser = Laser(ep["laser"], timeout_s=DEVICE_S)
        laser.set_power_mw(1.0)
        laser.on()
        try:
            yield request.param, mesh, selector, meter
        finally:
            for d in (mesh, selector, meter, laser):
                d.close()


def intended_share(mesh, selector, meter, circuits):
    """Light each chip input in turn through the selector; the share of the meter's total that
    arrives at the intended output."""
    shares = []
    for chip_in, chip_out in circuits.items():
        selector.apply({1: N + chip_in})            # laser (ingress 1) -> chip input chip_in
        power = meter.read_power()
        shares.append(power[chip_out - N] / sum(power.values()))
    return np.array(shares)


def test_permutation_lights_the_intended_outputs_as_the_meter_reads(lumion):
    ideal, mesh, selector, meter = lumion
    perm = np.random.default_rng(3).permutation(N)
    circuits = {i + 1: N + 1 + int(perm[i]) for i in range(N)}
    mesh.apply(circuits)
    shares = intended_share(mesh, selector, meter, circuits)
    if ideal:
        assert shares.min() > 0.999
    else:
        # an uncalibrated seeded chip sends most light elsewhere (docs/chip.md: the next issue)
        assert np.median(shares) < 0.5


def test_monitor_photodiodes_see_the_light_through_the_board(lumion):
    ideal, mesh, selector, meter = lumion
    mesh.apply({i: N + i for i in range(1, N + 1)})
    dark = mesh.dac.photocurrents()
    # input 2 enters the first cell's bottom arm; all bar, it stays on bottom arms, where the
    # monitor photodiodes sit
    selector.apply({1: N + 2})
    lit = mesh.dac.photocurrents()
    assert len(lit) == 56
    assert max(dark) < 0.01                       # dark current only (uA)
    assert max(lit) > 1.0                         # some cell on the lit path carries light
    assert sum(1 for x in lit if x > 0.01) < 56   # not every cell: one path is lit
