"""`ptb status`: every process a rig names is asked for `ping`; what answers and what does not
is printed, and the exit code says whether all did."""
from __future__ import annotations

import threading

import pytest

from photonic_testbed.hil import rig as rigfile
from photonic_testbed.hil.bus.server import Server
from photonic_testbed.ptb.cli import main


@pytest.fixture
def one_up(tmp_path):
    """A rig of two switches: `up` served by a real bus server, `down` by nothing."""
    server = Server("up", {"circuits": []}, kind="switch")
    request, publish = server.bind()
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            server.poll(0.05)
    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    nobody = [f"tcp://127.0.0.1:{p}" for p in rigfile.free_ports(2, "127.0.0.1")]
    path = tmp_path / "rig.toml"
    path.write_text(
        '[rig]\nname = "r"\n[bus]\ncurve = false\n'
        '[devices.up]\nkind = "switch"\naddress = "TCPIP::127.0.0.1::1::SOCKET"\n'
        'driver = "photonic_testbed.drivers.ocs:OpticalCircuitSwitch"\n'
        f'request = "{request}"\npublish = "{publish}"\n'
        '[devices.down]\nkind = "switch"\naddress = "TCPIP::127.0.0.1::2::SOCKET"\n'
        'driver = "photonic_testbed.drivers.ocs:OpticalCircuitSwitch"\n'
        f'request = "{nobody[0]}"\npublish = "{nobody[1]}"\n')
    yield path
    stop.set()
    thread.join(5)
    server.close()


def test_what_answers_and_what_does_not_is_said_and_the_exit_code_follows(one_up, capsys):
    assert main(["status", "--rig", str(one_up)]) == 1
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split()[:3] == ["up", "switch", "up"]
    assert lines[1].split()[:3] == ["down", "switch", "DOWN"]
    assert lines[-1].startswith("1 of 2 did not answer: down")
    assert main(["status", "--rig", str(one_up), "--device", "up"]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == "all 1 answered"
    # a rig without GPUs runs no agent: it is not asked for
    assert main(["status", "--rig", str(one_up), "--device", "agent"]) == 1
    assert "--device agent: rig r has up, down" in capsys.readouterr().err


def test_bad_asks_are_refused_before_asking(tmp_path, capsys):
    assert main(["status", "--rig", str(tmp_path / "none.toml")]) == 1
    assert "cannot read the rig file" in capsys.readouterr().err
    assert main(["status", "--endpoints", str(tmp_path / "ep.json"), "--wait", "-1"]) == 1
    assert "--wait must be in 0..3600 s" in capsys.readouterr().err
    assert main(["status", "--endpoints", str(tmp_path / "ep.json"), "--wait", "0.2"]) == 1
    assert "did not appear within 0.2 s" in capsys.readouterr().err
