"""Frozen command/response vectors, replayed byte for byte on CPython and on MicroPython.

tests/firmware_vectors.json holds sessions of (bytes in, exact bytes out) covering every
command, query and error code of docs/firmware-protocol.md. They were generated once from the
core (tests/gen_firmware_vectors.py), read against the protocol, and frozen: a change in any
reply byte fails here until the vectors are deliberately regenerated and re-read.
"""
from __future__ import annotations

import json
import pathlib
import re
import shutil
import subprocess

import firmware_replay
import pytest

from photonic_testbed.firmware import core, hal_emulated

HERE = pathlib.Path(__file__).parent
VECTORS_PATH = HERE / "firmware_vectors.json"
MP_DIR = HERE / "micropython"
MP_PACKAGE = MP_DIR / "node_modules" / "@micropython" / "micropython-webassembly-pyscript"

VECTORS = json.loads(VECTORS_PATH.read_text())
SESSIONS = VECTORS["sessions"]


def expected(session: dict) -> list[bytes]:
    return [firmware_replay.to_bytes(step["expect"]) for step in session["steps"]]


def describe(session: dict, k: int) -> str:
    step = session["steps"][k]
    what = step.get("send", f"wait {step.get('wait_ms')} ms" if "wait_ms" in step else "power up")
    return f"session {session['name']!r} step {k} ({what[:60]!r})"


@pytest.mark.parametrize("session", SESSIONS, ids=[s["name"] for s in SESSIONS])
def test_cpython_core_replays_every_vector(session):
    got = firmware_replay.run_session(session, core, hal_emulated)
    want = expected(session)
    assert len(got) == len(want)
    for k, (g, w) in enumerate(zip(got, want, strict=True)):
        assert g == w, describe(session, k)


def test_vectors_cover_every_command_and_error_code():
    sent = "".join(step.get("send", "") for s in SESSIONS for step in s["steps"]).lower()
    replies = "".join(step["expect"] for s in SESSIONS for step in s["steps"])
    for name, op in core.Board.COMMANDS:
        assert re.search(rf"(^|\n)\s*{name}\d*\s*{re.escape(op)}", sent, re.M) or (
            op == "?" and re.search(rf"(^|\n){name}\n", sent)), f"no vector sends {name}{op}"
    for code in (1, 2, 3, 10, 11, 12, 13, 14, 15, 90):
        assert f"E{code:02d}:" in replies, f"no vector answers E{code:02d}"
    assert "E31:" not in replies  # a firmware trap is a bug, never an expected reply
    assert any("\r\n" in step.get("send", "") for s in SESSIONS for step in s["steps"])
    assert any("wait_ms" in step for s in SESSIONS for step in s["steps"])


def test_vector_file_is_well_formed():
    for session in SESSIONS:
        n = session["modules"] * session["channels_per_module"]
        assert len(session["resistances"]) == n
        assert session["steps"][0] == {"power_up": True, "expect": "E90:00\n"}
        for step in session["steps"]:
            assert set(step) in ({"send", "expect"}, {"wait_ms", "expect"},
                                 {"power_up", "expect"})
            assert all(ord(ch) < 256 for ch in step.get("send", ""))
            assert step["expect"].isascii()


def micropython_replies() -> dict:
    node = shutil.which("node")
    if node is None:
        pytest.skip("node is not installed: MicroPython (WebAssembly) replay not run")
    if not MP_PACKAGE.is_dir():
        pytest.skip("tests/micropython/node_modules is missing: run `cd tests/micropython && "
                    "npm ci` (./run does it) to replay the vectors under MicroPython")
    proc = subprocess.run([node, str(MP_DIR / "replay.mjs"), str(VECTORS_PATH)],
                          capture_output=True, text=True, timeout=120, cwd=MP_DIR)
    assert proc.returncode == 0, f"replay.mjs failed:\n{proc.stderr}"
    return json.loads(proc.stdout)


@pytest.fixture(scope="module")
def mp_result():
    return micropython_replies()


def test_micropython_runs_the_real_interpreter(mp_result):
    assert mp_result["implementation"] == "micropython"
    assert "MicroPython v1.27" in mp_result["micropython"]


@pytest.mark.parametrize("session", SESSIONS, ids=[s["name"] for s in SESSIONS])
def test_micropython_replays_every_vector_byte_for_byte(mp_result, session):
    got = [bytes.fromhex(h) for h in mp_result["replies"][session["name"]]]
    want = expected(session)
    assert len(got) == len(want)
    for k, (g, w) in enumerate(zip(got, want, strict=True)):
        assert g == w, describe(session, k)
