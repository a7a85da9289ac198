"""photonic-testbed: the open control stack for photonic GPU fabrics.

One import root for the whole stack. Its subpackages live in the repository's top-level
folders (setuptools maps them, see pyproject.toml):

    photonic_testbed.common        common/        what every layer shares: the chip's topology
                                                  and calibration file, a job's plan, a rack's
                                                  layout, the heap's settling
    photonic_testbed.firmware      firmware/      the heater DAC board's command core
    photonic_testbed.drivers       drivers/       one module per instrument, plus the mesh
    photonic_testbed.calibration   calibration/   calibration runs, fits, files, reports
    photonic_testbed.hil           hil/           the loop: rig, bus and device services, agent
                                                  (and its journal), job, GPUs, lab bench
    photonic_testbed.emulator      emulator/      the lab in software, on the same wires
    photonic_testbed.gui           gui/           the operator's desktop GUI
    photonic_testbed.ptb           ptb/           the `ptb` command line
"""
from photonic_testbed import moved

__version__ = "0.3.0.dev0"

moved.install()       # old module paths (0.2) still import, with a DeprecationWarning
