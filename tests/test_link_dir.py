"""A serial device's pty link in a folder the user names (`--link-dir`) replaces nothing of
theirs and removes only itself: a file, a link elsewhere or a link to an open pty of that name is
refused and left as it was; a link left by a run that did not end cleanly (its pty gone) is
replaced; on exit the link made is removed only while it still names its pty."""
from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

from photonic_testbed.hil.lab.client_side import ListenError, serial_link
from photonic_testbed.hil.lab.recorder import Recorder, RecorderError
from photonic_testbed.hil.lab.replayer import ScriptedDevices
from photonic_testbed.hil.lab.session import Session, Wire

ROOT = pathlib.Path(__file__).resolve().parents[1]
LINES = [{"format": "ptb-session", "version": 1, "started": "2026-11-24T00:00:00.000Z",
          "devices": {"dac": {"wire": "serial", "address": "/dev/ttyACM0", "baud": 115200}}},
         {"t": 0.0, "device": "dac", "conn": 1, "event": "open"},
         {"t": 0.1, "device": "dac", "conn": 1, "from": "client", "data": "id?\n"},
         {"t": 0.11, "device": "dac", "conn": 1, "from": "device", "data": "Q8iv\n"},
         {"t": 0.6, "event": "end"}]


@pytest.fixture
def session(tmp_path) -> pathlib.Path:
    path = tmp_path / "dac.jsonl"
    path.write_text("".join(json.dumps(x) + "\n" for x in LINES))
    return path


def _gone_pty() -> str:
    """The name of a pty that no longer exists (opened, named, closed)."""
    master, slave = os.openpty()
    name = os.ttyname(slave)
    os.close(master)
    os.close(slave)
    assert not os.path.exists(name)
    return name


def test_ptb_replay_as_device_refuses_a_file_of_the_same_name_and_leaves_it(session, tmp_path):
    links = tmp_path / "links"
    links.mkdir()
    mine = links / "dac"
    mine.write_text("the user's notes\n")
    # (in a process of its own: a player that started would serve until stopped)
    done = subprocess.run([sys.executable, "-m", "photonic_testbed.ptb", "replay", str(session),
                           "--as-device", "--link-dir", str(links)], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    code, err = done.returncode, done.stderr
    assert code == 1 and f"{mine} exists and is not a link of ours: not replaced" in err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert mine.read_text() == "the user's notes\n"          # as it was
    assert sorted(p.name for p in links.iterdir()) == ["dac"]  # and nothing else made


def test_a_link_elsewhere_or_to_an_open_pty_is_refused_and_kept(tmp_path):
    elsewhere = tmp_path / "dac"
    elsewhere.symlink_to(tmp_path / "target")
    with pytest.raises(ListenError, match="is a link to .*target, not a pty link of ours"):
        serial_link(tmp_path, "dac")
    assert os.readlink(elsewhere) == str(tmp_path / "target")
    elsewhere.unlink()
    master, slave = os.openpty()                 # a pty someone holds open
    try:
        elsewhere.symlink_to(os.ttyname(slave))
        with pytest.raises(ListenError, match="which is open"):
            serial_link(tmp_path, "dac")
        assert os.readlink(elsewhere) == os.ttyname(slave)
    finally:
        os.close(master)
        os.close(slave)


def test_a_stale_link_is_replaced_and_only_our_link_is_removed_on_exit(session, tmp_path):
    link = tmp_path / "dac"
    link.symlink_to(_gone_pty())                 # a run killed before it removed its link
    with ScriptedDevices(Session.load(session), link_dir=tmp_path) as scripted:
        assert scripted.addresses["dac"] == str(link) and os.path.exists(link)
    assert not os.path.lexists(link)             # ours: removed
    with ScriptedDevices(Session.load(session), link_dir=tmp_path) as scripted:
        link.unlink()                            # the user put a file of theirs in its place
        link.write_text("theirs\n")
    assert link.read_text() == "theirs\n"        # not ours: kept


def test_ptb_record_refuses_a_file_of_the_same_name_and_leaves_it(tmp_path):
    master, slave = os.openpty()                 # a pty stands for the board
    mine = tmp_path / "dac"
    mine.write_text("the user's notes\n")
    try:
        rec = Recorder(tmp_path / "s.jsonl", {"dac": Wire("serial", path=os.ttyname(slave))},
                       link_dir=tmp_path)
        with pytest.raises(RecorderError, match="exists and is not a link of ours"):
            rec.start()
        assert mine.read_text() == "the user's notes\n"
        mine.unlink()
        with Recorder(tmp_path / "t.jsonl", {"dac": Wire("serial", path=os.ttyname(slave))},
                      link_dir=tmp_path) as rec:
            assert os.path.islink(mine)
            mine.unlink()
            mine.write_text("theirs\n")          # replaced while recording
        assert mine.read_text() == "theirs\n"
    finally:
        os.close(master)
        os.close(slave)
