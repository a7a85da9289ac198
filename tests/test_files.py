"""Files one command writes and another reads (hil.files): whole or not at all, waited for."""
from __future__ import annotations

import threading

import pytest

from photonic_testbed.hil import files
from photonic_testbed.hil.lab.session import SessionError, read_endpoints
from photonic_testbed.hil.rig import RigFileError, load

RIG = '[rig]\nname = "r"\n[bus]\ncurve = false\n[devices.laser]\nkind = "laser"\n' \
      'address = "TCPIP::127.0.0.1::5025::SOCKET"\n'


def _later(seconds: float, fn) -> threading.Timer:
    t = threading.Timer(seconds, fn)
    t.start()
    return t


def test_a_reader_waits_for_a_file_another_writes(tmp_path, caplog):
    path = tmp_path / "rig.toml"
    writer = _later(0.3, lambda: files.write_atomic(path, RIG))
    rig = load(path, wait_s=30)
    writer.join()
    assert rig.name == "r" and list(rig.devices) == ["laser"]
    assert "waiting up to 30 s for the rig file" in caplog.text
    ep = tmp_path / "ep.json"
    writer = _later(0.3, lambda: files.write_atomic(ep, '{"laser": "127.0.0.1:5025"}'))
    assert read_endpoints(ep, wait_s=30) == {"laser": "127.0.0.1:5025"}
    writer.join()


def test_a_file_that_never_comes_is_a_clear_error_after_the_wait(tmp_path):
    with pytest.raises(RigFileError, match=r"the rig file .*rig.toml did not appear within "
                                           r"0.2 s"):
        load(tmp_path / "rig.toml", wait_s=0.2)
    with pytest.raises(SessionError, match=r"no folder .*nowhere for the endpoints file"):
        read_endpoints(tmp_path / "nowhere" / "ep.json", wait_s=30)     # at once, no wait
    with pytest.raises(RigFileError, match="cannot read the rig file"):
        load(tmp_path / "rig.toml")                                        # no wait asked


def test_a_write_is_whole_or_nothing(tmp_path, monkeypatch):
    path = tmp_path / "rig.toml"
    files.write_atomic(path, RIG)
    calls = []

    def failing_replace(src, dst):
        calls.append(src)
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(files.os, "replace", failing_replace)
    with pytest.raises(OSError, match="No space left"):
        files.write_atomic(path, "half")
    assert path.read_text() == RIG                     # the old file, whole
    assert [p.name for p in tmp_path.iterdir()] == ["rig.toml"]      # no temporary left
    assert calls and calls[0] != str(path)
