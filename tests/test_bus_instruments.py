"""The opus rig's instruments on the bus: OCS, power meter and laser services over loopback."""
from __future__ import annotations

import math

import pytest

from photonic_testbed.emulator.rig import EmulatedRig
from photonic_testbed.hil import rig as rigfile
from photonic_testbed.hil.bus.client import BadRequest, RemoteError, ServiceClient
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
        dark = meter.call("read_power", channels=[1])["power"][1]
        ocs.call("apply_circuits", circuits=[[1, 33]])
        assert ocs.call("read_circuits")["circuits"] == [[1, 33]]
        lit = meter.call("read_power", channels=[1])["power"][1]
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


def test_the_lumion_meter_serves_all_sixteen_ports_and_refuses_hostile_channels():
    """The rig file carries the meter's port count (16 on lumion, not the driver's default
    4); a channel list of the wrong type or size is refused before the meter hears of it, and
    the service goes on answering."""
    with EmulatedRig(rig_spec("lumion"), seed=2, switching_s=0.0) as emulated:
        rig = rigfile.for_emulator("lumion", emulated.endpoints)
        assert rig.devices["powermeter"].options == {"ports": 16}
        specs = [s for s in rig.service_specs() if s.name == "powermeter"]
        # a generous deadline: its telemetry reads 16 ports at 0.1 s each between requests
        with Supervised(specs) as supervised, \
                ServiceClient(supervised.endpoints["powermeter"][0], timeout=60) as meter:
            got = meter.call("read_power", channels=[16, 1])["power"]
            assert set(got) == {16, 1}                # ports as the driver gives them
            assert len(meter.call("read_power")["power"]) == 16
            with pytest.raises(BadRequest, match=r"got `bool` \(at channels\[0\]\)"):
                meter.call("read_power", channels=[True])
            with pytest.raises(BadRequest, match="length <= 4096"):
                meter.call("read_power", channels=list(range(1, 100_001)))
            with pytest.raises(RemoteError, match="not in 1..16"):
                meter.call("read_power", channels=[17])
            # one channel named thousands of times would hold the meter for minutes: refused
            # before any is read
            with pytest.raises(BadRequest, match="channel 1 named twice"):
                meter.call("read_power", channels=[1] * 4096)
            assert meter.call("ping")["device"] == "powermeter"
