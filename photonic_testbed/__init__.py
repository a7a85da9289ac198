"""photonic-testbed: the open control stack for photonic GPU fabrics.

One import root for the whole stack. Its subpackages live in the repository's top-level
folders (setuptools maps them, see pyproject.toml):

    photonic_testbed.common        common/        the chip's topology and calibration file (all)
    photonic_testbed.firmware      firmware/      the heater DAC board's command core
    photonic_testbed.drivers       drivers/       one module per instrument, plus the mesh
    photonic_testbed.calibration   calibration/   calibration runs, fits, files, reports
    photonic_testbed.hil           hil/           rig, bus, services, agent, emulator
    photonic_testbed.gui           gui/           the operator's desktop GUI
    photonic_testbed.ptb           ptb/           the `ptb` command line
"""
__version__ = "0.2.0"
