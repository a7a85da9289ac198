"""The chip's topology model every layer shares (common.topology): names, descriptions, the
checks a topology passes however it is made, and the package's own rules (nothing of ours, no
Qt, no files)."""
from __future__ import annotations

import ast
import json
import pathlib

import pytest

from photonic_testbed.common.topology import (
    Topology,
    TopologyError,
    benes,
    clements,
    hexagonal,
    square,
    topology_from_json,
    topology_named,
)
from photonic_testbed.drivers.mesh import read_topology

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("name, built", [
    ("benes16", benes(16)), ("benes2", benes(2)), ("clements8", clements(8)),
    ("square9", square(9)), ("square3x5", square(3, 5)), ("hexagonal4", hexagonal(4)),
    ("hexagonal4x4", hexagonal(4)),
])
def test_a_name_builds_its_topology(name, built):
    topology = topology_named(name)
    assert topology == built
    assert topology_named(topology.name) == topology      # the canonical name reads back


@pytest.mark.parametrize("name, message", [
    ("benes12", "2\\^k ports"), ("benes2048", "2..1024"), ("clements1", "2..256"),
    ("square1", "2..64 nodes"), ("hexagonal4x99", "2..64 nodes"), ("benes", "KIND\\+SIZE"),
    ("Benes16", "KIND\\+SIZE"), ("spiral8", "KIND\\+SIZE"), ("", "KIND\\+SIZE"),
    ("benes999999999", "KIND\\+SIZE"),
])
def test_bad_names_are_refused_clearly(name, message):
    with pytest.raises(TopologyError, match=message):
        topology_named(name)


def test_a_description_reads_back_and_is_checked(tmp_path):
    for topology in (benes(8), clements(4), square(3), hexagonal(4)):
        text = json.dumps(topology.describe())
        assert topology_from_json(text) == topology == topology_from_json(text.encode())
    d = hexagonal(3).describe()
    d["links"].append({"from": ["port", d["ports"] + 1], "to": ["cell", "e0", 0]})
    with pytest.raises(TopologyError, match=f"port {d['ports'] + 1} is outside 1..{d['ports']}"):
        Topology.from_dict(d)
    d = hexagonal(3).describe()
    d["joins"][0] = [["cell", "e99", 0], ["port", 1]]
    with pytest.raises(TopologyError, match="join #0: cell 'e99'"):
        Topology.from_dict(d)
    for bad, message in ((b"\xff{", "not a JSON topology"), (b"[]", "a topology is a dict"),
                         (b'{"kind": "benes"}', "lacks name, ports, cells, links")):
        with pytest.raises(TopologyError, match=message):
            topology_from_json(bad, "t.json")
    path = tmp_path / "chip.json"
    path.write_text(json.dumps(benes(4).describe()))
    assert read_topology(str(path)) == benes(4) and read_topology("benes4") == benes(4)
    with pytest.raises(TopologyError, match="cannot read the topology file"):
        read_topology(str(tmp_path / "none.json"))


def test_the_shared_model_imports_nothing_of_ours_nor_qt_nor_files():
    """common/ may be imported by every layer: it imports only itself, the standard library's
    plain modules and numpy, and opens no file."""
    allowed = {"__future__", "collections", "dataclasses", "functools", "gc", "hashlib", "json",
               "logging", "math", "re", "time", "tomllib", "typing", "warnings", "numpy"}
    for path in (ROOT / "common").glob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            elif isinstance(node, ast.Call) and getattr(node.func, "id", "") == "open":
                raise AssertionError(f"{path.name}:{node.lineno} opens a file")
            else:
                continue
            for name in names:
                top = name.split(".")[0]
                assert top in allowed or name.startswith("photonic_testbed.common"), \
                    f"{path.name}:{node.lineno} imports {name}"
