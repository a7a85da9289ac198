"""Files nested thousands of levels deep (a session, an endpoints file, a calibration, a topology,
a rig file, an emulated rig's TOML, a job spec) are refused with a one-line error of their
reader naming the file, never a RecursionError's traceback; brackets inside strings and comments
do not count, and a file at the bound reads as before."""
from __future__ import annotations

import json
import pathlib

import pytest

from photonic_testbed.common import nesting
from photonic_testbed.common.calibration import Calibration, CalibrationFileError
from photonic_testbed.common.topology import TopologyError, topology_from_json
from photonic_testbed.drivers.mesh import read_calibration
from photonic_testbed.hil.job.torch_job import JobSpec, JobSpecError
from photonic_testbed.hil.lab.session import Session, SessionError, read_endpoints
from photonic_testbed.hil.rig import RigFileError, load, rig_spec
from photonic_testbed.ptb.cli import main

DEEP = 100_000                  # far past the interpreter's recursion limit
HEADER = {"format": "ptb-session", "version": 1,
          "devices": {"dac": {"wire": "serial", "address": "/dev/ttyACM0"}}}


def _deep(n: int = DEEP) -> str:
    return "[" * n + "]" * n


def test_the_bound_is_exact_and_strings_and_comments_do_not_count():
    at = nesting.MAX_NESTING
    assert json.loads(_deep(at)) == nesting.loads_json(_deep(at), "f")
    with pytest.raises(nesting.NestingError, match=r"^f: nested more than 64 levels deep"):
        nesting.loads_json(_deep(at + 1), "f")
    text = json.dumps({"said": "[" * DEEP, "escaped": '\\"[[[' + "{" * DEEP})
    assert nesting.loads_json(text, "f")["said"] == "[" * DEEP
    assert nesting.loads_toml(f'# {"[" * DEEP}\na = "{"[" * DEEP}"\nb = \'{"{" * DEEP}\'\n'
                              f'c = """\n{"[" * DEEP}\n"""\n', "t")["b"] == "{" * DEEP
    with pytest.raises(nesting.NestingError, match=r"^t:3: nested more than 64"):
        nesting.loads_toml(f"a = 1\nb = 2\nc = {_deep()}\n", "t")
    # dotted keys nest without a bracket: a key of more parts is refused unread, and a file
    # nesting deeper by keys and brackets together once read
    with pytest.raises(nesting.NestingError, match="^t:2: nested more than 64"):
        nesting.loads_toml("x = 1.5\n[" + ".".join(["a"] * DEEP) + "]\nx = 1\n", "t")
    with pytest.raises(nesting.NestingError, match="^t:2: nested more than 64"):
        nesting.loads_toml("x = [1.5, 2.5]\n" + ".".join(["a"] * DEEP) + " = 1\n", "t")
    assert nesting.loads_toml("x = [" + ", ".join(["1.5"] * DEEP) + "]\n", "t")["x"][0] == 1.5
    with pytest.raises(nesting.NestingError, match="^t: nested more than 64"):
        nesting.loads_toml("[" + ".".join(["a"] * 60) + "]\nx = " + _deep(10) + "\n", "t")


def test_a_deeply_nested_session_is_a_session_error_and_ptb_replay_says_so(tmp_path, capsys):
    path = tmp_path / "s.jsonl"
    line = {"t": 0.1, "device": "dac", "conn": 1, "from": "client", "data": "id?\n"}
    path.write_text(json.dumps(HEADER) + "\n" + json.dumps(line)[:-1] + ', "x": '
                    + _deep() + "}\n")
    with pytest.raises(SessionError, match=r"s\.jsonl:2: nested more than 64 levels deep"):
        Session.load(path)
    path.write_text(json.dumps(HEADER)[:-1] + ', "x": ' + _deep() + "}\n")   # the header
    with pytest.raises(SessionError, match=r"s\.jsonl:1: nested more than 64 levels deep"):
        Session.load(path)
    path.write_text(json.dumps(HEADER) + "\n" + _deep())     # a last line without its newline
    with pytest.raises(SessionError, match=r"s\.jsonl:2: nested more than 64 levels deep"):
        Session.load(path)
    try:
        code = main(["replay", str(path), "--as-device"])
    except SystemExit as e:
        code = e.code
    out, err = capsys.readouterr()
    assert code == 1 and "nested more than 64 levels deep" in err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_deeply_nested_endpoints_calibration_and_topology_files_are_refused(tmp_path):
    endpoints = tmp_path / "endpoints.json"
    endpoints.write_text('{"dac": "/tmp/x", "y": ' + _deep() + "}")
    with pytest.raises(SessionError, match="endpoints.json: nested more than 64"):
        read_endpoints(endpoints)
    cal = json.loads(Calibration.ideal(range(4), "benes4").dumps())
    text = json.dumps(cal)[:-1] + ', "x": ' + _deep() + "}"
    (tmp_path / "cal.json").write_text(text)
    with pytest.raises(CalibrationFileError, match="cal.json.*nested more than 64"):
        read_calibration(tmp_path / "cal.json")
    with pytest.raises(TopologyError, match="^chip.json: nested more than 64"):
        topology_from_json('{"kind": "benes", "cells": ' + _deep() + "}", "chip.json")


def test_deeply_nested_rig_files_and_job_specs_are_refused(tmp_path):
    rig = tmp_path / "rig.toml"
    rig.write_text('[rig]\nname = "x"\n[devices.a]\noptions = { v = ' + _deep() + " }\n")
    with pytest.raises(RigFileError, match="rig.toml:4: nested more than 64"):
        load(rig)
    rig.write_text('[rig]\nname = "x"\n[devices.a.' + ".".join(["o"] * DEEP) + "]\nv = 1\n")
    with pytest.raises(RigFileError, match="rig.toml:3: nested more than 64"):
        load(rig)
    emulated = tmp_path / "emulated.toml"
    emulated.write_text('[emulator]\nbase = "lumion"\nx = ' + _deep() + "\n")
    with pytest.raises(RigFileError, match="emulated.toml:3: nested more than 64"):
        rig_spec(str(emulated))
    spec = tmp_path / "job.json"
    spec.write_text('{"plan": ' + _deep() + "}")
    with pytest.raises(JobSpecError, match="job.json: nested more than 64"):
        JobSpec.load(spec)


def test_files_of_ours_read_as_before():
    """Every calibration and session shipped with the tests is far within the bound."""
    root = pathlib.Path(__file__).resolve().parent
    sessions = sorted((root / "sessions").glob("*.jsonl"))
    assert sessions
    for path in sessions:
        assert Session.load(path).exchanges()


def test_a_deeply_nested_control_request_is_answered_with_the_bound():
    """The emulator's control endpoint reads its requests the same way."""
    from photonic_testbed.emulator.control import ControlServer
    got = ControlServer().handle(_deep().encode())
    assert got == {"ok": False, "error": "the request: nested more than 64 levels deep "
                                         "(nothing of ours nests so deep): refused"}
