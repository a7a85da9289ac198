"""Protocol tests: the exact SCPI lines our OCS, power meter and laser drivers send."""
from __future__ import annotations

import math

import pytest

from photonic_testbed.drivers.circuit_switch import CircuitConflict
from photonic_testbed.drivers.laser import Laser
from photonic_testbed.drivers.ocs import OpticalCircuitSwitch, format_circuits, parse_circuits
from photonic_testbed.drivers.power_meter import PowerMeter
from photonic_testbed.drivers.scpi import (
    CommandError,
    DataOutOfRange,
    ExecutionError,
    IllegalParameterValue,
    ProtocolError,
    UndefinedHeader,
    scpi_error,
)
from tests.scripted_visa import DROP, expected_protocol

IDN = "Polatis,N-OST-32x32-HU1-DMHNS,001234,6.5.2.18"
OPEN = [("*IDN?", IDN), (":OXC:SWIT:SIZE?", "32,32")]
OK = '1;0,"No error"'


def test_apply_is_one_only_line_and_unchanged_apply_sends_nothing():
    with expected_protocol(OpticalCircuitSwitch, OPEN + [
        (":OXC:SWIT:CONN:STAT?", "(@),(@)"),
        (":OXC:SWIT:CONN:ONLY (@1,2),(@34,33);*OPC?;:SYST:ERR?", OK),
        (":OXC:SWIT:CONN:ONLY (@1),(@34);*OPC?;:SYST:ERR?", OK),
    ]) as ocs:
        assert ocs.ports == 32
        report = ocs.apply({2: 33, 1: 34})
        assert report.added == {1: 34, 2: 33} and report.removed == {}
        assert ocs.apply({1: 34, 2: 33}).added == {}        # nothing on the wire
        report = ocs.apply({1: 34})
        assert report.removed == {2: 33} and report.added == {}


def test_apply_refuses_impossible_maps_before_sending():
    with expected_protocol(OpticalCircuitSwitch, OPEN) as ocs:
        with pytest.raises(CircuitConflict):
            ocs.apply({1: 33, 2: 33})
        with pytest.raises(CircuitConflict):
            ocs.apply({1: 2})
        with pytest.raises(CircuitConflict):
            ocs.apply({1: 65})


def test_refusal_drains_the_queue_into_a_typed_error():
    with expected_protocol(OpticalCircuitSwitch, OPEN + [
        (":OXC:SWIT:CONN:ADD (@3),(@35);*OPC?;:SYST:ERR?",
         '1;-224,"Illegal parameter value; ingress 3 is already connected to 40"'),
        (":SYST:ERR?", '-350,"Queue overflow"'),
        (":SYST:ERR?", '0,"No error"'),
    ]) as ocs:
        with pytest.raises(IllegalParameterValue) as err:
            ocs.connect(3, 35)
        assert err.value.code == -224
        assert "ingress 3" in err.value.message
        assert err.value.errors[1][0] == -350
        assert ocs.known is None          # state unknown after a refusal: read back next time


def test_connect_disconnect_single_and_bulk():
    with expected_protocol(OpticalCircuitSwitch, OPEN + [
        (":OXC:SWIT:CONN:ADD (@3),(@35);*OPC?;:SYST:ERR?", OK),
        (":OXC:SWIT:CONN:ADD (@4,5),(@37,36);*OPC?;:SYST:ERR?", OK),
        (":OXC:SWIT:CONN:PORT? 3", "35"),
        (":OXC:SWIT:CONN:SUB (@3),(@35);*OPC?;:SYST:ERR?", OK),
        (":OXC:SWIT:CONN:SUB (@4,5),(@37,36);*OPC?;:SYST:ERR?", OK),
        (":OXC:SWIT:CONN:PORT? 9", "0"),
        (":OXC:SWIT:DISC:ALL;*OPC?;:SYST:ERR?", OK),
    ]) as ocs:
        ocs.connect(3, 35)
        ocs.connect_many({5: 36, 4: 37})
        ocs.disconnect(3)
        ocs.disconnect_many({4: 37, 5: 36})
        ocs.disconnect(9)                   # nothing connected: nothing sent
        ocs.disconnect_all()


def test_circuits_and_port_power_parse():
    with expected_protocol(OpticalCircuitSwitch, OPEN + [
        (":OXC:SWIT:CONN:STAT?", "(@1,2),(@33,34)"),
        (":OXC:SWIT:CONN:STAT?", "(@1),(@40);(@2),(@41)"),
        (":PMON:POW? (@1,33)", "-3.00,-4.25"),
        (":OXC:SWIT:CONN:STAT?", "garbage"),
    ]) as ocs:
        assert ocs.circuits() == {1: 33, 2: 34}
        assert ocs.circuits() == {1: 40, 2: 41}
        assert ocs.port_power([1, 33]) == {1: -3.0, 33: -4.25}
        with pytest.raises(ProtocolError):
            ocs.circuits()


def test_dropped_apply_that_the_switch_completed_is_not_resent():
    with expected_protocol(OpticalCircuitSwitch, OPEN + [
        (":OXC:SWIT:CONN:STAT?", "(@1),(@33)"),
        (":OXC:SWIT:CONN:ONLY (@1,2),(@34,33);*OPC?;:SYST:ERR?", DROP),
    ], [
        ("*IDN?", IDN),
        (":OXC:SWIT:CONN:STAT?", "(@1,2),(@34,33)"),       # already done: nothing more
    ]) as ocs:
        report = ocs.apply({1: 34, 2: 33})
        assert report.added == {1: 34, 2: 33} and report.removed == {1: 33}
        assert ocs.reconnects == 1


def test_dropped_apply_that_the_switch_missed_is_sent_once_more():
    with expected_protocol(OpticalCircuitSwitch, OPEN + [
        (":OXC:SWIT:CONN:STAT?", "(@1),(@33)"),
        (":OXC:SWIT:CONN:ONLY (@1,2),(@34,33);*OPC?;:SYST:ERR?", DROP),
    ], [
        ("*IDN?", IDN),
        (":OXC:SWIT:CONN:STAT?", "(@1),(@33)"),
        (":OXC:SWIT:CONN:ONLY (@1,2),(@34,33);*OPC?;:SYST:ERR?", OK),
    ]) as ocs:
        ocs.apply({1: 34, 2: 33})
        assert ocs.known == {1: 34, 2: 33}


def test_dropped_bulk_add_resends_only_the_missing_circuits():
    with expected_protocol(OpticalCircuitSwitch, OPEN + [
        (":OXC:SWIT:CONN:ADD (@1,2),(@33,34);*OPC?;:SYST:ERR?", DROP),
    ], [
        ("*IDN?", IDN),
        (":OXC:SWIT:CONN:STAT?", "(@1),(@33)"),
        (":OXC:SWIT:CONN:ADD (@2),(@34);*OPC?;:SYST:ERR?", OK),
    ]) as ocs:
        ocs.connect_many({1: 33, 2: 34})


def test_format_and_parse_round_trip():
    c = {3: 40, 1: 33, 2: 64}
    assert format_circuits(c) == "(@1,2,3),(@33,64,40)"
    assert parse_circuits(format_circuits(c)) == c
    assert format_circuits({}) == "(@),(@)"
    assert parse_circuits("(@),(@)") == {}


def test_error_classes_by_code():
    assert isinstance(scpi_error(-113, "Undefined header"), UndefinedHeader)
    assert isinstance(scpi_error(-101, "x"), CommandError)
    assert isinstance(scpi_error(-222, "x"), DataOutOfRange)
    assert isinstance(scpi_error(-230, "x"), ExecutionError)


PM_IDN = "Keysight Technologies,N7744A,MY00000001,1.0.0"
NOERR = '+0,"No error"'


def test_power_meter_lines_and_units():
    with expected_protocol(PowerMeter, [
        ("*IDN?", PM_IDN),
        (":SENS2:CHAN1:POW:WAV 1310.0000NM;:SYST:ERR?", NOERR),
        (":SENS2:CHAN1:POW:WAV?", "+1.31000000E-006"),
        (":SENS1:CHAN1:POW:ATIM 0.001S;:SYST:ERR?", NOERR),
        (":SENS1:CHAN1:POW:UNIT?", "+0"),
        (":READ1:CHAN1:POW?", "-3.00000000E+000"),
        (":SENS3:CHAN1:POW:UNIT 1;:SYST:ERR?", NOERR),
        (":SENS3:CHAN1:POW:ATIM?", "+1.00000000E-001"),
        (":READ3:CHAN1:POW?", "+2.50000000E-004"),
        (":FETC3:CHAN1:POW?", "+2.50000000E-004"),
        (":SENS1:CHAN1:POW:ATIM 20S;:SYST:ERR?", '-222,"Data out of range"'),
        (":SYST:ERR?", NOERR),
    ]) as pm:
        pm.set_wavelength_nm(2, 1310)
        assert pm.wavelength_nm(2) == pytest.approx(1310)
        pm.set_averaging_time(1, 0.001)
        r = pm.read(1)
        assert r.dbm == -3.0 and r.mw == pytest.approx(0.501, rel=1e-3)
        pm.set_unit(3, "W")
        r = pm.read(3)
        assert r.mw == pytest.approx(0.25) and r.dbm == pytest.approx(10 * math.log10(0.25))
        assert pm.fetch(3).mw == pytest.approx(0.25)
        with pytest.raises(DataOutOfRange):
            pm.set_averaging_time(1, 20)
        with pytest.raises(ValueError):
            pm.read(5)
        with pytest.raises(ValueError):
            pm.set_unit(1, "mW")


LASER_IDN = "Keysight Technologies,N7776C,DE00000001,1.0.0"


def test_laser_lines_and_units():
    with expected_protocol(Laser, [
        ("*IDN?", LASER_IDN),
        (":SOUR0:WAV 1550.1200NM;:SYST:ERR?", NOERR),
        (":SOUR0:WAV?", "+1.55012000E-006"),
        (":SOUR0:POW 1.500000MW;:SYST:ERR?", NOERR),
        (":SOUR0:POW -3.000DBM;:SYST:ERR?", NOERR),
        (":SOUR0:POW:UNIT?", "+0"),
        (":SOUR0:POW?", "-3.00000000E+000"),
        (":SOUR0:POW:STAT 1;:SYST:ERR?", NOERR),
        (":SOUR0:POW:STAT?", "+1"),
        (":SOUR0:POW:STAT 0;:SYST:ERR?", NOERR),
        (":SOUR0:POW 30.000DBM;:SYST:ERR?", '-222,"Data out of range"'),
        (":SYST:ERR?", NOERR),
    ]) as laser:
        laser.set_wavelength_nm(1550.12)
        assert laser.wavelength_nm() == pytest.approx(1550.12)
        laser.set_power_mw(1.5)
        laser.set_power_dbm(-3)
        assert laser.power_mw() == pytest.approx(0.501, rel=1e-3)
        laser.on()
        assert laser.is_on()
        laser.off()
        with pytest.raises(DataOutOfRange):
            laser.set_power_dbm(30)
        with pytest.raises(ValueError):
            laser.set_power_mw(0)


def test_a_unit_code_other_than_dbm_or_watt_is_refused_by_both_drivers():
    # "+0.5" once read as dBm (int() of it is 0): a reading in an unknown unit, silently
    with expected_protocol(PowerMeter, [
        ("*IDN?", PM_IDN),
        (":SENS2:CHAN1:POW:UNIT?", "+0.5"),
        (":SENS2:CHAN1:POW:UNIT?", "+2"),
    ]) as pm:
        for _ in range(2):
            with pytest.raises(ProtocolError, match="unit query answered"):
                pm.unit(2)
    with expected_protocol(Laser, [
        ("*IDN?", LASER_IDN),
        (":SOUR0:POW:UNIT?", "+0.5"),
        (":SOUR0:POW:UNIT?", "dBm"),
    ]) as laser:
        with pytest.raises(ProtocolError, match="unit query answered"):
            laser.power_mw()
        with pytest.raises(ProtocolError, match="unit answered 'dBm'"):
            laser.power_mw()


def test_setting_resent_after_a_drop():
    with expected_protocol(Laser, [
        ("*IDN?", LASER_IDN),
        (":SOUR0:POW:STAT 1;:SYST:ERR?", DROP),
    ], [
        ("*IDN?", LASER_IDN),
        (":SOUR0:POW:STAT 1;:SYST:ERR?", NOERR),
    ]) as laser:
        laser.on()
        assert laser.reconnects == 1
