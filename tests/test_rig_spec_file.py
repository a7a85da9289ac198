"""`ptb emulate --rig FILE.toml`: an emulated rig described in a file."""
import pytest

from photonic_testbed.emulator.rig import EmulatedRig
from photonic_testbed.hil.rig import rig_spec


def write(tmp_path, text):
    path = tmp_path / "bench.toml"
    path.write_text(text)
    return str(path)


def test_a_file_describes_a_rig_that_starts(tmp_path):
    spec = rig_spec(write(tmp_path, '[emulator]\nbase = "opus"\nocs_ports = 8\n'
                                    'meter_channels = 2\n'))
    assert (spec.name, spec.ocs_ports, spec.meter_channels, spec.laser) == ("bench", 8, 2, True)
    with EmulatedRig(spec, switching_s=0.0) as rig:
        assert set(rig.endpoints) == {"ocs", "powermeter", "laser", "control"}


@pytest.mark.parametrize("text, message", [
    ("[emulator]\nocs_ports = '8'\n", "emulator.ocs_ports must be int"),
    ("[emulator]\nports = 8\n", "emulator.ports is not a rig field"),
    ("[emulator]\nbase = 'nope'\n", "emulator.base must be one of"),
    ("[emulator]\nchip_kind = 'benes'\nchip_ports = 8\n", "dac_modules to at least 3"),
    ("[emulator]\nchip_kind = 'benes'\nchip_ports = 12\ndac_modules = 3\n", r"2\^k ports"),
    ("[emulator]\nocs_ports = 5000\n", "must be in 0..1024"),
    ("[devices]\n", r"\[emulator\] table"),
    ("[emulator\n", "not valid TOML"),
])
def test_bad_rig_descriptions_are_refused_clearly(tmp_path, text, message):
    with pytest.raises(ValueError, match=message):
        rig_spec(write(tmp_path, text))


def test_missing_file_and_unknown_name():
    with pytest.raises(ValueError, match="cannot read the rig file"):
        rig_spec("/nonexistent/rig.toml")
    with pytest.raises(ValueError, match="unknown rig 'nope'"):
        rig_spec("nope")
