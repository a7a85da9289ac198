"""Modules that moved (photonic_testbed.moved): old paths in code and in rig files still load,
with a DeprecationWarning naming the new one, and give the very same module."""
from __future__ import annotations

import importlib
import subprocess
import sys
import warnings

import pytest

from photonic_testbed import moved
from photonic_testbed.hil.devices.kinds import load_class


@pytest.mark.parametrize("old", sorted(moved.MOVED))
def test_every_moved_module_is_gone_from_its_old_place_and_found_at_its_new(old):
    new, since = moved.MOVED[old]
    assert importlib.util.find_spec(new) is not None
    assert since
    parent, _, leaf = old.rpartition(".")
    folder = importlib.import_module(parent).__path__[0]
    import pathlib
    assert not (pathlib.Path(folder) / f"{leaf}.py").exists()
    assert not (pathlib.Path(folder) / leaf / "__init__.py").exists()


def test_an_old_import_path_warns_and_is_the_same_module():
    """In a fresh interpreter: nothing of it imported before."""
    code = """if True:
        import warnings
        warnings.simplefilter("error")
        try:
            import photonic_testbed.hil.journal
        except DeprecationWarning as e:
            print("warned:", e)
        warnings.simplefilter("ignore")
        import photonic_testbed.hil.journal as old
        from photonic_testbed.hil.emulator.chip import EmulatedChip
        import photonic_testbed.hil.agent.journal as new
        import photonic_testbed.emulator.chip as chip
        print(old is new, EmulatedChip is chip.EmulatedChip)
    """
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60, check=True).stdout.splitlines()
    assert out == ["warned: photonic_testbed.hil.journal is photonic_testbed.hil.agent.journal "
                   "since 0.3: import it by its new name", "True True"]


def test_a_rig_files_old_driver_path_loads_with_a_warning():
    from photonic_testbed.drivers.ocs import OpticalCircuitSwitch
    with pytest.warns(DeprecationWarning, match="'photonic_testbed.drivers.ocs' .since 0.2."):
        assert load_class("drivers.ocs:OpticalCircuitSwitch") is OpticalCircuitSwitch
    with pytest.warns(DeprecationWarning, match="'photonic_testbed.emulator.ocs' .since 0.3."):
        cls = load_class("photonic_testbed.hil.emulator.ocs:OCSPhysics")
    assert cls.__module__ == "photonic_testbed.emulator.ocs"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert load_class("photonic_testbed.drivers.ocs:OpticalCircuitSwitch") \
            is OpticalCircuitSwitch


def test_current_names():
    assert moved.current("photonic_testbed.drivers.ocs") is None
    assert moved.current("hil.torch_job") == ("photonic_testbed.hil.job.torch_job", "0.2")
    assert moved.current("photonic_testbed.hil.emulator") == ("photonic_testbed.emulator", "0.3")
    assert moved.current("photonic_testbed.hil.emulatorx") is None
