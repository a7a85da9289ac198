"""The opus rig's instruments on the bus: OCS, power meter and laser services over loopback."""
from __future__ import annotations

import math

import pytest

from photonic_testbed.hil import rig as rigfile
from photonic_testbed.hil.bus.client import BadRequest, RemoteError, ServiceClient
from photonic_testbed.hil.emulator.rig import EmulatedRig
from photonic_testbed.hil.rig import rig_spec
from tests.test_bus import Supervised


@pytest.fixture
def opus_on_bus():
    with EmulatedRig(rig_spec("opus"), seed=2, switching_s=0.0) as emulated:
        rig = rigfile.for_emulator("opus", emulated.endpoints)
        with Supervised(rig.service_specs()) as supervised:
            yield rig, supervised


def _client(supervised, name):
    return ServiceClient(supervised.endpoints[name][0], timeout=5.0)


def test_light_through_the_ocs_is_read_by_the_meter_over_the_bus(opus_on_bus):
    rig, supervised = opus_on_bus
    assert set(rig.devices) == {"ocs", "powermeter", "laser"}
    ocs, meter, laser = (_client(supervised, n) for n in ("ocs", "powermeter", "laser"))
    try:
        state = laser.call("set_laser", on=True, power_mw=1.0)
        assert state["on"] is True and state["power_mw"] == pytest.approx(1.0)
        dark = meter.call("read_power", channels=[1])["power"]["1"]
        ocs.call("apply_circuits", circuits=[[1, 33]])
        assert ocs.call("read_circuits")["circuits"] == [[1, 33]]
        lit = meter.call("read_power", channels=[1])["power"]["1"]
        # the laser feeds ingress 1, meter port 1 reads egress 33: 1 mW less the path loss
        assert 10 * math.log10(lit) == pytest.approx(-1.25, abs=0.5)
        assert dark < 1e-5
        assert meter.call("describe")["kind"] == "power_meter"
    finally:
        for c in (ocs, meter, laser):
            c.close()


def test_bad_instrument_requests_are_refused_with_reasons(opus_on_bus):
    _, supervised = opus_on_bus
    ocs, laser = _client(supervised, "ocs"), _client(supervised, "laser")
    try:
        with pytest.raises(BadRequest, match="power_mw"):
            laser.call("set_laser", power_mw=5000)
        with pytest.raises(RemoteError, match="port 99 does not exist"):
            ocs.call("apply_circuits", circuits=[[1, 99]])
        assert ocs.call("read_circuits")["circuits"] == []
    finally:
        ocs.close()
        laser.close()
