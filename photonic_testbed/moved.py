"""Modules that moved between releases: one table, read by the importer and the rig file.

Code (or a rig file's `driver = "module:Class"`) that names a module by an old path keeps
working, with a `DeprecationWarning` naming the new one; the module is the same object under
both names. Nothing of ours imports an old path.
"""
from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import warnings
from types import ModuleType

ROOT = __name__.rpartition(".")[0]

# The top-level names of releases before 0.2, when every folder installed as its own package.
OLD_ROOTS = ("firmware", "drivers", "calibration", "hil", "gui", "ptb")

# old module (or package: its submodules move with it) -> new, and the release that moved it
MOVED: dict[str, tuple[str, str]] = {f"{ROOT}.{old}": (f"{ROOT}.{new}", "0.3") for old, new in (
    ("hil.emulator", "emulator"),
    ("hil.jobplan", "common.jobplan"),
    ("hil.rack_layout", "common.rack_layout"),
    ("hil.heap", "common.heap"),
    ("hil.journal", "hil.agent.journal"),
    ("hil.gpu_monitor", "hil.gpus.monitor"),
    ("hil.gpu_health", "hil.gpus.health"),
    ("hil.ddm", "hil.gpus.ddm"),
    ("hil.fabric_client", "hil.job.fabric_client"),
    ("hil.torch_fabric", "hil.job.worker"),
    ("hil.torch_job", "hil.job.torch_job"),
    ("hil.recorder", "hil.lab.recorder"),
    ("hil.replayer", "hil.lab.replayer"),
    ("hil.session", "hil.lab.session"),
    ("hil.control_client", "hil.lab.control_client"),
    ("hil.bus.service", "hil.devices.service"),
    ("hil.bus.supervisor", "hil.devices.supervisor"),
)}


def current(module: str) -> tuple[str, str] | None:
    """(the module's name now, the release that changed it) when `module` is an old name;
    None when it is current (or not ours)."""
    if module.partition(".")[0] in OLD_ROOTS:
        name = f"{ROOT}.{module}"
        return (current(name) or (name, ""))[0], "0.2"
    for old, (new, since) in MOVED.items():
        if module == old or module.startswith(old + "."):
            return new + module[len(old):], since
    return None


class _Alias(importlib.abc.Loader):
    def __init__(self, new: str):
        self.new = new

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        module = importlib.import_module(self.new)
        sys.modules[spec.name] = module
        return module

    def exec_module(self, module: ModuleType) -> None:
        """The module ran under its new name."""


class _MovedFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname: str, path: object = None, target: object = None
                  ) -> importlib.machinery.ModuleSpec | None:
        if not fullname.startswith(ROOT + ".hil."):
            return None
        found = current(fullname)
        if found is None:
            return None
        new, since = found
        warnings.warn(f"{fullname} is {new} since {since}: import it by its new name",
                      DeprecationWarning, stacklevel=2)
        return importlib.machinery.ModuleSpec(fullname, _Alias(new))


def install() -> None:
    """Let old module paths import, with a warning (once per process)."""
    if not any(isinstance(f, _MovedFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _MovedFinder())   # before the path finder: a moved
        # package's submodules would be found again in its folder under their old names
