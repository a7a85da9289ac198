"""The rig file: reading, validation messages, writing one for the emulator, and `ptb serve`
and `ptb keys` driven through the command line."""
from __future__ import annotations

import json
import os
import pathlib
import re
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from photonic_testbed.hil import rig as rigfile
from photonic_testbed.hil.agent.config import AgentConfig
from photonic_testbed.hil.bus.client import ServiceClient
from photonic_testbed.hil.rig import RigFileError
from photonic_testbed.ptb.stack import Stack

ROOT = pathlib.Path(__file__).resolve().parents[1]

GOOD = textwrap.dedent("""\
    [rig]
    name = "bench-a"

    [bus]
    host = "10.0.0.2"
    base_port = 5700
    bind = "*"
    server_key = "keys/server.key_secret"
    server_public_key = "keys/server.key"
    authorized_keys = "keys/authorized"
    client_key = "keys/operator.key_secret"

    [devices.heaters]
    kind = "heater_dac"
    address = "/dev/serial/by-id/usb-Qontrol-if00"
    options = { timeout = 0.5 }

    [devices.ocs]
    kind = "switch"
    driver = "photonic_testbed.drivers.polatis:Polatis"
    address = "TCPIP::10.0.0.9::5025::SOCKET"
    request = "tcp://10.0.0.2:5800"
    publish = "tcp://10.0.0.2:5801"

    [chip]
    topology = "benes16"
    calibration = "cal/chip.json"
    heaters = "heaters"

    [[gpus]]
    name = "gpu0"
    switch = "ocs"
    port = 1

    [[gpus]]
    name = "spare0"
    switch = "ocs"
    port = 2
    spare = true
    """)


def test_a_good_rig_file(tmp_path):
    path = tmp_path / "rig.toml"
    path.write_text(GOOD)
    rig = rigfile.load(path)
    assert rig.endpoints() == {"heaters": ("tcp://10.0.0.2:5700", "tcp://10.0.0.2:5701"),
                               "ocs": ("tcp://10.0.0.2:5800", "tcp://10.0.0.2:5801")}
    assert rig.chip.calibration == str(tmp_path / "cal/chip.json")
    assert [g.name for g in rig.gpus if g.spare] == ["spare0"]
    specs = rig.service_specs(["ocs"])
    assert specs[0].request == "tcp://*:5800"
    assert specs[0].driver == "photonic_testbed.drivers.polatis:Polatis"
    assert specs[0].curve_secret == str(tmp_path / "keys/server.key_secret")
    assert rigfile.parse(rigfile.dumps(rig), base=tmp_path) == rigfile.parse(GOOD, base=tmp_path)
    with pytest.raises(RigFileError, match="no device named laser"):
        rig.service_specs(["laser"])


@pytest.mark.parametrize("edit, message", [
    (('kind = "heater_dac"', 'kind = "heater_dax"'),
     r"rig.toml:14: devices.heaters.kind: expected one of chip, heater_dac, laser, power_meter, "
     r"switch, got 'heater_dax'"),
    (('port = 2\n', 'port = "2"\n'),
     r"rig.toml:38: gpus.port: expected the switch input port it attaches to"),
    (('port = 2\n', 'port = 1\n'),
     r"rig.toml:38: gpus.port: expected a port no other GPU uses \(gpu0 has it\), got 1"),
    (('base_port = 5700', 'base_prot = 5700'), r"rig.toml:6: bus.base_prot: expected one of"),
    (('request = "tcp://10.0.0.2:5800"', 'request = "10.0.0.2:5800"'),
     r"rig.toml:22: devices.ocs.request: expected an endpoint tcp://HOST:PORT"),
    (('request = "tcp://10.0.0.2:5800"', 'request = "tcp://10.0.0.2:5700"'),
     r"devices.ocs.request: expected an endpoint of its own \(devices.heaters.request"),
    (('driver = "photonic_testbed.drivers.polatis:Polatis"\n', ''),
     r"devices.ocs.driver: expected the driver class"),
    (('client_key = "keys/operator.key_secret"\n', ''),
     r"bus.client_key: expected a key file \(CURVE is on"),
    (('bind = "*"\n', 'curve = false\n'),
     r"rig.toml:7: bus.curve: expected true: endpoints off loopback need CURVE"),
    (('switch = "ocs"\nport = 1', 'switch = "oxc"\nport = 1'), r"gpus.switch: expected a device"),
    (('heaters = "heaters"', 'heaters = "dac"'), r"chip.heaters: expected a device name"),
    (('topology = "benes16"', 'topology = "benes12"'),
     r"rig.toml:\d+: chip.topology: expected a topology name or a .json file \(a Benes"),
    (('[rig]\nname = "bench-a"\n', ''), r"expected a key 'rig'"),
    (('name = "bench-a"', 'name = bench-a'), r"not valid TOML"),
])
def test_bad_rig_files_say_where_and_what(tmp_path, edit, message):
    assert edit[0] in GOOD
    path = tmp_path / "rig.toml"
    path.write_text(GOOD.replace(edit[0], edit[1], 1))
    with pytest.raises(RigFileError, match=message):
        rigfile.load(path)


AGENT = textwrap.dedent("""\

    [agent]
    verify_dbm = -14.5
    quarantine_s = 5
    prestage = true
    verify_phases = true
    allocation = "first-fit"
    diagnosed_per_incident = 1
    diagnosed_per_window = 3
    eviction_window_s = 120.0
    """)


def test_the_agent_table_is_read_and_written_back(tmp_path):
    assert rigfile.parse(GOOD).agent == AgentConfig()
    assert "[agent]" not in rigfile.dumps(rigfile.parse(GOOD))      # the defaults: no table
    rig = rigfile.parse(GOOD + AGENT, base=tmp_path)
    assert rig.agent == AgentConfig(verify_dbm=-14.5, quarantine_s=5.0, prestage=True,
                                    verify_phases=True, allocation="first-fit",
                                    diagnosed_per_incident=1, diagnosed_per_window=3,
                                    eviction_window_s=120.0)
    assert isinstance(rig.agent.quarantine_s, float)
    assert rigfile.parse(rigfile.dumps(rig), base=tmp_path) == rig
    only = rigfile.parse(GOOD + "\n[agent]\nallocation = \"first-fit\"\n")
    assert only.agent == AgentConfig(allocation="first-fit")
    assert rigfile.dumps(only).endswith('\n[agent]\nallocation = "first-fit"\n')


@pytest.mark.parametrize("edit, message", [
    (("quarantine_s = 5", "quarantine_s = -1"),
     "agent.quarantine_s: expected a number of seconds >= 0, got -1"),
    (("quarantine_s = 5", "quarantine_s = nan"),
     "agent.quarantine_s: expected a number of seconds >= 0, got nan"),
    (("quarantine_s = 5", 'quarantine_s = "5"'),
     "agent.quarantine_s: expected a number of seconds >= 0, got '5'"),
    (("verify_dbm = -14.5", "verify_dbm = inf"),
     r"agent.verify_dbm: expected a power in dBm \(a finite number\), got inf"),
    (("prestage = true", "prestage = 1"), "agent.prestage: expected true or false, got 1"),
    (('allocation = "first-fit"', 'allocation = "worst-fit"'),
     "agent.allocation: expected one of best-fit, first-fit, got 'worst-fit'"),
    (("diagnosed_per_window = 3", "diagnosed_per_window = 2.5"),
     "agent.diagnosed_per_window: expected a count >= 0, got 2.5"),
    (("diagnosed_per_incident = 1", "diagnosed_per_incident = true"),
     "agent.diagnosed_per_incident: expected a count >= 0, got True"),
    (("eviction_window_s = 120.0", "eviction_window_s = 0"),
     "agent.eviction_window_s: expected a number of seconds > 0, got 0"),
    (("quarantine_s = 5", "quarantine = 5"),
     "agent.quarantine: expected one of the keys verify_dbm, quarantine_s, prestage, "
     "verify_phases, allocation, diagnosed_per_incident, diagnosed_per_window, "
     "eviction_window_s, lease_s, etcd_timeout_s, work_ahead, gray_swaps, gray_above, "
     "gray_swap_cost_s, metrics_port, metrics_host, link_moves, got 'quarantine'"),
])
def test_bad_agent_settings_say_where_and_what(tmp_path, edit, message):
    text = GOOD + AGENT
    assert edit[0] in text
    text = text.replace(edit[0], edit[1], 1)
    line = next(n for n, x in enumerate(text.splitlines(), 1) if x == edit[1])
    path = tmp_path / "rig.toml"
    path.write_text(text)
    with pytest.raises(RigFileError) as e:
        rigfile.load(path)
    assert re.fullmatch(f"{re.escape(str(path))}:{line}: {message}", str(e.value)), str(e.value)


def test_missing_rig_file(tmp_path):
    with pytest.raises(RigFileError, match="cannot read the rig file"):
        rigfile.load(tmp_path / "none.toml")


def _ptb(*args, **kwargs):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.Popen([sys.executable, "-m", "photonic_testbed.ptb", *args], cwd=ROOT,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            **kwargs)


def _wait_for(path: pathlib.Path, proc, timeout=20.0):
    deadline = time.monotonic() + timeout
    while not path.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise AssertionError(f"{path} never appeared:\n{proc.communicate()[0]}")
        time.sleep(0.05)


def test_emulate_writes_a_rig_that_serve_serves(tmp_path):
    with Stack(tmp_path) as stack:
        rig = stack.emulate("lumion")          # `ptb emulate --write-rig`, as a user runs it
        # the lumion chip is one device: the mesh driver owns the heater DAC
        assert rig.bus.curve is False and rig.devices["chip"].kind == "chip"
        assert "heaters" not in rig.devices and rig.chip.switch == "chip"
        assert len(rig.gpus) == 10 and sum(g.spare for g in rig.gpus) == 2
        request, _ = stack.serve()["chip"]
        assert request == rig.devices["chip"].request
        with ServiceClient(request, timeout=5) as c:
            topo = c.call("describe")["device"]["topology"]
            assert topo["kind"] == "benes" and topo["ports"] == 16 and len(topo["cells"]) == 56
            c.call("apply_circuits", circuits=[[1, 18], [2, 17]])
            snap = c.call("snapshot")["state"]
            assert [1, 18] in snap["circuits"] and [2, 17] in snap["circuits"]
            assert {s["state"] for s in snap["cells"].values()} <= {"bar", "cross"}
            assert len(snap["volts"]) == 56
            c.call("set_heaters", volts=[3.0])
            assert c.call("read_heaters")["volts"][0] == pytest.approx(3.0, abs=2e-4)
        code, out = stack.stop("serve"), stack.tail("serve", 100)
        assert code == 0, out
        assert "chip" in out and "stopped" in out


def test_serve_refuses_a_bad_rig_clearly(tmp_path):
    path = tmp_path / "rig.toml"
    path.write_text(GOOD.replace('kind = "switch"', 'kind = 3'))
    proc = _ptb("serve", "--rig", str(path))
    out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 1
    assert "devices.ocs.kind: expected the device kind" in out and "Traceback" not in out


def test_keys_command(tmp_path):
    proc = _ptb("keys", "server", "operator", "--dir", str(tmp_path), "--authorize")
    out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 0, out
    assert (tmp_path / "authorized" / "operator.key").exists()
    assert oct((tmp_path / "server.key_secret").stat().st_mode & 0o777) == "0o600"
    again = _ptb("keys", "server", "--dir", str(tmp_path))
    out, _ = again.communicate(timeout=30)
    assert again.returncode == 1 and "refusing to overwrite" in out


def test_serve_one_process_with_any_ports_and_ipv6_loopback(tmp_path):
    rig_path, ep_path = tmp_path / "rig.toml", tmp_path / "endpoints.json"
    rig_path.write_text(textwrap.dedent("""\
        [rig]
        name = "loopback"
        [bus]
        curve = false
        base_port = 1
        [devices.ocs]
        kind = "switch"
        driver = "tests.bus_doubles:MemorySwitch"
        address = "memory"
        request = "tcp://127.0.0.1:0"
        publish = "tcp://127.0.0.1:0"
        [devices.meter]
        kind = "power_meter"
        driver = "tests.bus_doubles:MemoryPowerMeter"
        address = "memory"
        request = "tcp://127.0.0.1:0"
        publish = "tcp://127.0.0.1:0"
        """))
    assert rigfile.load(rig_path).bus.curve is False      # port 0 (any) may repeat
    rig_path.write_text(rig_path.read_text().replace(
        'request = "tcp://127.0.0.1:0"\npublish = "tcp://127.0.0.1:0"\n',
        'request = "tcp://[::1]:0"\npublish = "tcp://[::1]:0"\n', 1))
    serve = _ptb("serve", "--rig", str(rig_path), "--one-process", "--endpoints", str(ep_path))
    try:
        _wait_for(ep_path, serve)
        endpoints = json.loads(ep_path.read_text())
        assert sorted(endpoints) == ["meter", "ocs"] and "[::1]" in endpoints["ocs"][0]
        with ServiceClient(endpoints["ocs"][0], timeout=5) as c:
            c.call("apply_circuits", circuits=[[1, 17]])
            assert c.call("read_circuits") == {"circuits": [[1, 17]]}
        with ServiceClient(endpoints["meter"][0], timeout=5) as c:
            assert c.call("read_power", channels=[1]) == {"power": {1: 0.001}}
    finally:
        serve.send_signal(signal.SIGTERM)
        out, _ = serve.communicate(timeout=15)
    assert serve.returncode == 0, out


def test_ports_handed_out_are_not_handed_out_again_by_another_process(tmp_path):
    """free_ports: a port given to one process (a file under RESERVED) is not given to another
    while it is held; once HOLD_S old it is taken back. Two processes, in turn: no port twice."""
    import subprocess
    import sys
    code = ("from photonic_testbed.hil.rig import free_ports; "
            "print(' '.join(map(str, free_ports(300))))")
    got = [set(map(int, subprocess.run([sys.executable, "-c", code], capture_output=True,
                                       text=True, timeout=60, check=True).stdout.split()))
           for _ in range(2)]
    assert len(got[0]) == len(got[1]) == 300 and not got[0] & got[1]
    from photonic_testbed.hil.rig import emulated
    port = min(got[0])
    assert not emulated._reserve(port)                      # held
    old = emulated.RESERVED / str(port)
    import os
    os.utime(old, (0, 0))                                   # ... long ago
    assert emulated._reserve(port) and not emulated._reserve(port)


def test_a_reservation_folder_others_may_write_reserves_nothing(tmp_path, monkeypatch):
    """RESERVED must be this user's alone: one that others may write (or a link) is not used."""
    from photonic_testbed.hil.rig import emulated
    folder = tmp_path / "ports"
    folder.mkdir(mode=0o700)
    monkeypatch.setattr(emulated, "RESERVED", folder)
    assert emulated._reserve(20001) and not emulated._reserve(20001)
    folder.chmod(0o777)
    assert emulated._reserve(20001) and emulated._reserve(20001)      # (not used)
    link = tmp_path / "link"
    link.symlink_to(folder)
    folder.chmod(0o700)
    monkeypatch.setattr(emulated, "RESERVED", link)
    assert emulated._reserve(20002) and emulated._reserve(20002)
