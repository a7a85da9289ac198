"""The house's arrows (docs/design.md, "Layers"): every import of ours points down.

    ptb        the command line: may import everything
    gui        the operator's GUI: hil (the bus), common; never drivers or calibration
    emulator   the lab in software: hil, drivers' and common's values, and the firmware it runs
    hil        the loop: calibration, drivers, common
    calibration -> drivers -> common;  firmware: nothing of ours

Only `ptb` and the tests import the emulator; only the emulator, `ptb` and the tests import the
firmware (everything else reaches both over a wire). Read from the source with `ast`, imports
inside functions included.
"""
from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent
NAMESPACE = "photonic_testbed"

# layer -> the layers it may import (its own always)
MAY_IMPORT: dict[str, set[str]] = {
    "firmware": set(),
    "common": set(),
    "drivers": {"common"},
    "calibration": {"drivers", "common"},
    "hil": {"calibration", "drivers", "common"},
    "emulator": {"hil", "drivers", "common", "firmware"},
    "gui": {"hil", "common"},
    "ptb": {"gui", "emulator", "hil", "calibration", "drivers", "common", "firmware"},
}


def _imports(tree: ast.AST):
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module == NAMESPACE:        # from photonic_testbed import drivers
                for alias in node.names:
                    yield node.lineno, f"{NAMESPACE}.{alias.name}"
            else:
                yield node.lineno, node.module


def findings(root: pathlib.Path = ROOT) -> list[str]:
    out = []
    for layer, allowed in MAY_IMPORT.items():
        for path in sorted((root / layer).rglob("*.py")):
            rel = path.relative_to(root).as_posix()
            if "/rp2040-board/" in rel:          # the board's own files: data, MicroPython
                continue
            tree = ast.parse(path.read_text(encoding="utf-8"), rel)
            for line, name in _imports(tree):
                parts = name.split(".")
                if parts[0] != NAMESPACE or len(parts) < 2 or parts[1] not in MAY_IMPORT:
                    continue            # not ours, or the root's own (__version__, moved)
                target = parts[1]
                if target != layer and target not in allowed:
                    out.append(f"{rel}:{line} imports {name}: {layer} may import "
                               f"{', '.join(sorted(allowed)) or 'nothing of ours'}")
    return sorted(out)


def test_imports_point_down():
    assert findings() == []


def test_every_package_folder_has_a_layer():
    """A new top-level package folder gets its place in the picture above."""
    folders = {p.parent.name for p in ROOT.glob("*/__init__.py")} - {NAMESPACE, "tests"}
    assert folders == set(MAY_IMPORT)


def test_an_upward_import_is_found(tmp_path):
    """The checker itself: a driver importing the bus, and the GUI a driver, are named."""
    for layer in MAY_IMPORT:
        (tmp_path / layer).mkdir()
    (tmp_path / "drivers" / "x.py").write_text(f"from {NAMESPACE}.hil.bus import client\n")
    (tmp_path / "gui" / "y.py").write_text(
        f"def f():\n    from {NAMESPACE} import drivers\n")
    (tmp_path / "hil" / "z.py").write_text(f"import {NAMESPACE}.emulator.rig\n")
    got = findings(tmp_path)
    assert [g.split(" imports ")[0] for g in got] == ["drivers/x.py:1", "gui/y.py:2",
                                                        "hil/z.py:1"]
