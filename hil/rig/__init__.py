"""The rig: what a lab (or an emulated one) is made of, in one package every command uses.

    hil.rig.model      the values: Rig, its devices, chip, GPUs, monitors and bus
    hil.rig.file       the rig file (TOML): parse/load with line-exact errors, dumps/write
    hil.rig.emulated   the emulated rigs' specs (lumion, opus, hexmesh, an [emulator] TOML)
                       and the rig file that points at a running one (`for_emulator`)

The names below are the package's interface: `from photonic_testbed.hil import rig` and
`rig.load(path)`, `rig.for_emulator(spec, endpoints)`, ... (docs/rigfile.md).
"""
from photonic_testbed.hil.rig.emulated import (
                                               EMULATED_DEVICES,
                                               RIGS,
                                               RigSpec,
                                               for_emulator,
                                               free_port,
                                               free_ports,
                                               is_emulator_description,
                                               rig_spec,
                                               rig_spec_from_file,
)
from photonic_testbed.hil.rig.file import ENDPOINT, dumps, load, parse, write
from photonic_testbed.hil.rig.model import (
                                               PROCESSES,
                                               AgentGroup,
                                               BusConfig,
                                               ChipConfig,
                                               DeviceConfig,
                                               GpuConfig,
                                               Rig,
                                               RigFileError,
                                               monitor_device,
)

__all__ = ["EMULATED_DEVICES", "ENDPOINT", "PROCESSES", "RIGS", "AgentGroup", "BusConfig",
           "ChipConfig", "DeviceConfig", "GpuConfig", "Rig", "RigFileError", "RigSpec", "dumps",
           "for_emulator", "free_port", "free_ports", "is_emulator_description", "load",
           "monitor_device",
           "parse", "rig_spec", "rig_spec_from_file", "write"]
