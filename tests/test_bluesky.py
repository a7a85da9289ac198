"""The rig's instruments as ophyd-async devices under Bluesky's RunEngine (hil.bridges.bluesky):
a scan of a chip heater read by the power meter, through the bus, holds the fringe the chip's
physics makes; the laser and an OCS through their drivers directly; limits and refusals."""
from __future__ import annotations

import math
import threading

import numpy as np
import pytest

pytest.importorskip("ophyd_async")

from bluesky import RunEngine  # noqa: E402
from bluesky import plan_stubs as bps  # noqa: E402
from bluesky import plans as bp  # noqa: E402
from bluesky.utils import FailedStatus  # noqa: E402
from ophyd_async.plan_stubs import ensure_connected  # noqa: E402

from photonic_testbed.emulator.chip import OUTPUT_TAP  # noqa: E402
from photonic_testbed.emulator.rig import EmulatedRig  # noqa: E402
from photonic_testbed.hil import rig as rigfile  # noqa: E402
from photonic_testbed.hil.bridges import bluesky as bridge  # noqa: E402
from photonic_testbed.hil.bridges.access import BridgeError  # noqa: E402
from photonic_testbed.hil.rig import rig_spec  # noqa: E402
from tests.test_bus import Supervised  # noqa: E402


@pytest.fixture(scope="module")
def lumion_on_bus():
    with EmulatedRig(rig_spec("lumion"), seed=2, switching_s=0.0) as emulated:
        rig = rigfile.for_emulator("lumion", emulated.endpoints)
        with Supervised(rig.service_specs()) as supervised:
            devices = bridge.rig_devices(rig)
            try:
                yield emulated, rig, supervised, devices
            finally:
                bridge.close(devices)


@pytest.fixture(scope="module")
def run_engine():
    yield RunEngine({}, call_returns_result=True)


def _docs(RE, plan) -> list[tuple[str, dict]]:
    docs: list[tuple[str, dict]] = []
    RE(plan, lambda name, doc: docs.append((name, doc)))
    return docs


def test_a_scan_of_a_chip_heater_reads_the_fringe_the_chip_makes(lumion_on_bus, run_engine):
    emulated, rig, _, devices = lumion_on_bus
    RE = run_engine
    chip, meter, laser, ocs = (devices[n] for n in ("chip", "powermeter", "laser", "ocs"))
    RE(ensure_connected(chip, meter, laser, ocs))
    # the laser into chip input 1 (the selector OCS: ingress 1 -> egress 16 + 1)
    RE(bps.mv(laser.on, True, laser.power_mw, 1.0))
    port_map = np.zeros(16, dtype=np.int64)
    port_map[0] = 17
    RE(bps.mv(ocs.port_map, port_map))
    assert list(RE(bps.rd(ocs.port_map)).plan_result) == list(port_map)   # read from the OCS
    docs = _docs(RE, bp.scan([meter.port[1], meter.port[2]], chip.channel[0], 0.0, 6.0, 25))

    names = [n for n, _ in docs]
    assert names[0] == "start" and names[-1] == "stop"
    assert docs[-1][1]["exit_status"] == "success"
    keys = next(d for n, d in docs if n == "descriptor")["data_keys"]
    volts_key = keys["chip-channel-0-volts"]
    assert volts_key["units"] == "V" and volts_key["source"] == "ptb://chip/heater/0"
    assert volts_key["limits"]["control"] == {"low": 0.0, "high": 12.0}    # the Q8iv's full scale
    assert keys["powermeter-port-1-power_mw"]["units"] == "mW"
    assert keys["powermeter-port-1-power_dbm"]["units"] == "dBm"
    events = [d["data"] for n, d in docs if n == "event"]
    assert len(events) == 25
    volts = np.array([e["chip-channel-0-volts"] for e in events])
    got = np.array([e["powermeter-port-1-power_mw"] for e in events])
    assert np.allclose(volts, np.linspace(0, 6, 25), atol=2e-3)     # read back from the board
    for e in events:          # one measurement, in both units
        assert e["powermeter-port-1-power_dbm"] == pytest.approx(
            10 * math.log10(e["powermeter-port-1-power_mw"]), abs=1e-9)
    # a fringe: the heater's phase goes as its power, V^2 / R; port 1's light swings
    assert got.max() > 4 * got.min()
    # and it is the chip's own: the emulated chip, set to each read-back voltage, sends this
    # to output 17's 1 % tap (meter port 1), less the detectors' noise
    chip_model = emulated.chip
    for v, reading in zip(volts, got, strict=True):
        chip_model.set_voltage(0, float(v))
        threading.Event().wait(0.001)          # 30 thermal time constants of a few us
        want = chip_model.output_power_mw(17) / (1 - OUTPUT_TAP) * OUTPUT_TAP
        assert reading == pytest.approx(want, rel=0.01, abs=1e-6), f"at {v} V"


def test_values_out_of_limits_and_refusals_fail_the_move_with_the_reason(lumion_on_bus,
                                                                          run_engine):
    emulated, rig, _, devices = lumion_on_bus
    RE = run_engine
    chip, laser, ocs = devices["chip"], devices["laser"], devices["ocs"]
    RE(ensure_connected(chip, laser, ocs))
    RE(bps.mv(chip.channel[3], 1.5))
    for bad, says in ((12.5, "must be in 0..12 V"), (-0.1, "must be in 0..12 V"),
                      (float("nan"), "finite number of V")):
        with pytest.raises(FailedStatus) as e:
            RE(bps.mv(chip.channel[3], bad))
        assert says in str(e.value.__cause__), repr(e.value.__cause__)
    assert RE(bps.rd(chip.channel[3].volts)).plan_result == pytest.approx(1.5, abs=2e-3)
    # the laser's own refusal (the bus's bound on its power) comes back with the device's reason
    with pytest.raises(FailedStatus) as e:
        RE(bps.mv(laser.power_mw, 5000.0))
    assert "power_mw" in repr(e.value.__cause__) and "laser" in repr(e.value.__cause__)
    # a port map naming an output twice is refused by the switch, nothing changed
    twice = np.zeros(16, dtype=np.int64)
    twice[:2] = 20
    RE(bps.mv(ocs.port_map, np.zeros(16, dtype=np.int64)))
    with pytest.raises(FailedStatus) as e:
        RE(bps.mv(ocs.port_map, twice))
    assert "20" in repr(e.value.__cause__)
    assert not RE(bps.rd(ocs.port_map)).plan_result.any()
    # channels and ports the devices do not have
    with pytest.raises(KeyError):
        chip.channel[56]
    with pytest.raises(KeyError):
        devices["powermeter"].port[17]


def test_the_laser_and_an_ocs_through_their_drivers_without_a_bus(run_engine):
    RE = run_engine
    with EmulatedRig(rig_spec("opus"), seed=3, switching_s=0.0) as emulated:
        rig = rigfile.for_emulator("opus", emulated.endpoints)
        devices = bridge.rig_devices(rig, direct=True)
        try:
            laser, ocs, meter = devices["laser"], devices["ocs"], devices["powermeter"]
            RE(ensure_connected(laser, ocs, meter))
            # the laser feeds ingress 1, meter port 1 reads egress 33
            port_map = np.zeros(32, dtype=np.int64)
            port_map[0] = 33
            RE(bps.mv(ocs.port_map, port_map, laser.on, True))
            docs = _docs(RE, bp.scan([meter.port[1]], laser.power_mw, 0.5, 4.0, 8))
            events = [d["data"] for n, d in docs if n == "event"]
            sent = np.array([e["laser-power_mw"] for e in events])
            got = np.array([e["powermeter-port-1-power_mw"] for e in events])
            assert np.allclose(sent, np.linspace(0.5, 4.0, 8), rtol=1e-4)
            loss = got / sent                  # the path's loss, the same at every power
            assert 0.5 < loss.min() and loss.max() / loss.min() < 1.02
            config = next(d for n, d in docs if n == "descriptor")
            assert "laser-power_mw" in config["data_keys"]
            # the laser's own refusal, from its driver, names the laser
            with pytest.raises(FailedStatus) as e:
                RE(bps.mv(laser.power_mw, 500.0))
            assert str(e.value.__cause__).startswith("laser: "), e.value.__cause__
            assert "500" in str(e.value.__cause__)
            RE(bps.mv(laser.on, False))
            RE(bp.count([meter.port[1]]))
            assert RE(bps.rd(meter.port[1].power_mw)).plan_result < 1e-4     # dark
        finally:
            bridge.close(devices)


def test_a_device_whose_service_is_gone_fails_with_its_name():
    with EmulatedRig(rig_spec("opus"), seed=4, switching_s=0.0) as emulated:
        rig = rigfile.for_emulator("opus", emulated.endpoints)
        # no service runs: describing the meter (its ports) finds nobody
        from photonic_testbed.hil.bridges.access import open_rig
        found = open_rig(rig, ["powermeter"], timeout=0.5)
        try:
            with pytest.raises(BridgeError, match="powermeter: describe: .*"):
                found["powermeter"].describe()
        finally:
            found["powermeter"].close()


def test_on_a_rig_with_an_agent_the_moves_are_the_operators_journaled_changes(tmp_path,
                                                                               run_engine):
    """CURVE on, GPUs and their agent: a device takes changes from the agent alone, so the
    bridge's moves go to the agent as the operator's manual changes (journaled, by whose key);
    an observer's key reads but may not move."""
    import dataclasses

    from photonic_testbed.hil.agent.entries import Manual
    from tests.test_roles import entries, secure_lumion
    RE = run_engine
    with secure_lumion(tmp_path) as s:
        keys = tmp_path / "keys"

        def as_role(role: str):
            return dataclasses.replace(s.rig, bus=dataclasses.replace(
                s.rig.bus, client_key=str(keys / f"{role}.key_secret")))
        operator = bridge.rig_devices(as_role("operator"), ["chip", "laser", "ocs"])
        observer = bridge.rig_devices(as_role("observer"), ["chip"])
        try:
            chip, laser = operator["chip"], operator["laser"]
            observer["chip"].set_name("chip_seen")
            RE(ensure_connected(chip, laser))
            RE(ensure_connected(observer["chip"]))
            RE(bps.mv(chip.channel[20], 1.5, laser.power_mw, 2.0))
            assert s.truth()["heaters"][20] == pytest.approx(1.5, abs=0.01)
            assert s.truth()["laser"][1] == pytest.approx(2.0)
            assert RE(bps.rd(observer["chip"].channel[20].volts)).plan_result == \
                pytest.approx(1.5, abs=0.01)
            with pytest.raises(FailedStatus) as e:
                RE(bps.mv(observer["chip"].channel[20], 0.5))
            assert "Unauthorized" in str(e.value.__cause__)
            assert s.truth()["heaters"][20] == pytest.approx(1.5, abs=0.01)
            # the input selector is no switch of the GPUs: the agent does not drive it, and
            # its service takes changes from the agent's key alone
            RE(ensure_connected(operator["ocs"]))
            with pytest.raises(FailedStatus) as e:
                RE(bps.mv(operator["ocs"].port_map, [17] + [0] * 15))
            assert "ocs: apply_circuits: Unauthorized" in str(e.value.__cause__)
        finally:
            bridge.close(operator)
            bridge.close(observer)
    manual = [(e.details.device, e.details.by, e.details.volts, e.details.laser)
              for e in entries(tmp_path / "journal.db", "decision")
              if isinstance(e.details, Manual)]
    assert manual == [("chip", "operator", [1.5], None),
                      ("laser", "operator", None, {"power_mw": 2.0})]


def test_detectors_moves_and_values_as_plans_give_them(lumion_on_bus, run_engine):
    """The meter and a heater bank as detectors of their own; numpy numbers; a refused move
    that leaves the last setpoint; port maps checked whole; mock mode asks no device."""
    emulated, rig, _, devices = lumion_on_bus
    RE = run_engine
    chip, meter, laser, ocs = (devices[n] for n in ("chip", "powermeter", "laser", "ocs"))
    RE(ensure_connected(chip, meter, laser, ocs))
    # the meter: every port measured by one trigger; the bank: every channel's volts
    docs = _docs(RE, bp.count([meter, chip], num=2))
    events = [d["data"] for n, d in docs if n == "event"]
    assert len(events) == 2
    assert {f"powermeter-port-{p}-power_mw" for p in range(1, 17)} <= set(events[0])
    assert len(events[0]["chip-volts"]) == 56
    keys = next(d for n, d in docs if n == "descriptor")["data_keys"]
    assert keys["chip-volts"]["units"] == "V" and keys["chip-volts"]["shape"] == [56]
    # a port never triggered has no measurement to give: NaN, staged or not
    fresh = bridge.rig_devices(rig, ["powermeter"])
    try:
        assert math.isnan(RE(bps.rd(fresh["powermeter"].port[3].power_mw)).plan_result)
    finally:
        bridge.close(fresh)
    # numpy's numbers are numbers
    docs = _docs(RE, bp.list_scan([meter.port[1]], chip.channel[2], np.arange(0, 3)))
    assert [d["data"]["chip-channel-2-volts"] for n, d in docs if n == "event"] == \
        pytest.approx([0, 1, 2], abs=2e-3)
    # a move the device refuses leaves the setpoint of the last move it took
    RE(bps.mv(laser.power_mw, 2.0))
    with pytest.raises(FailedStatus):
        RE(bps.mv(laser.power_mw, 500.0))
    RE(bps.mvr(laser.power_mw, 1.0))
    assert RE(bps.rd(laser.power_mw)).plan_result == pytest.approx(3.0)
    # a port map is whole numbers, one per input
    RE(bps.mv(ocs.port_map, [17] + [0] * 15))
    for bad in ([17.5] + [0] * 15, "0" * 16, [17] * 3, [[17] * 16], [float("nan")] * 16):
        with pytest.raises(FailedStatus) as e:
            RE(bps.mv(ocs.port_map, bad))
        assert str(e.value.__cause__).startswith("ocs: "), e.value.__cause__
    assert list(RE(bps.rd(ocs.port_map)).plan_result) == [17] + [0] * 15
    # mock mode: triggers and reads ask no device
    mocked = bridge.rig_devices(rig, ["powermeter"])
    try:
        RE(ensure_connected(mocked["powermeter"], mock=True))
        access = mocked["powermeter"].meter.access
        before = access.calls
        docs = _docs(RE, bp.count([mocked["powermeter"].port[1], mocked["powermeter"]], num=3))
        assert [n for n, _ in docs].count("event") == 3 and access.calls == before
    finally:
        bridge.close(mocked)


def test_a_whole_meter_read_waits_for_every_ports_averaging():
    """Every port of a meter read in one request takes each port's averaging time (up to 10 s
    on an N774x): its deadline is that long, not one request's."""
    from photonic_testbed.hil.bridges import devices as bridged
    from photonic_testbed.hil.bridges.access import TIMEOUT_S, Access

    class Recording(Access):
        def __init__(self):
            super().__init__("meter", "power_meter")
            self.deadlines = []

        def _describe(self):
            return {"ports": 16}

        def _call(self, op, args, change, within_s):
            self.deadlines.append(within_s)
            return {"power": {p: 1e-3 for p in args["channels"]}}

        def _close(self):
            pass

    access = Recording()
    meter = bridged.Meter(access)
    assert len(meter.read_power()) == 16 and meter.read(3)[0] == 1e-3
    assert access.deadlines == [TIMEOUT_S + 16 * bridged.METER_AVERAGING_MAX_S,
                                TIMEOUT_S + bridged.METER_AVERAGING_MAX_S]
