"""The agent's settings (`hil.agent.config.AgentConfig`): one home per default, checked values,
`ptb agent`'s flags over the rig file's [agent] table, and the settings reaching the agent."""
from __future__ import annotations

import dataclasses
import threading

import pytest

from photonic_testbed.common.rack_layout import RECEIVER_SENSITIVITY_DBM
from photonic_testbed.emulator.rack import EmulatedRack
from photonic_testbed.gui.limits import Limits
from photonic_testbed.hil import rig as rigfile
from photonic_testbed.hil.agent.agent import AgentError
from photonic_testbed.hil.agent.bus import AgentProcess
from photonic_testbed.hil.agent.config import SETTINGS, AgentConfig, AgentConfigError
from photonic_testbed.hil.bus.client import ServiceClient
from photonic_testbed.ptb.agent import config_of
from photonic_testbed.ptb.cli import build_parser, main
from tests.test_agent_bus import _rig_on_bus
from tests.test_bus_at_most_once import serving


def test_the_verification_threshold_is_the_receivers_sensitivity_everywhere():
    """One value: the agent verifies by it, the emulated receivers hear down to it, and the
    GUI's link alarm defaults to it."""
    assert AgentConfig().verify_dbm == RECEIVER_SENSITIVITY_DBM == Limits().link_dbm
    assert EmulatedRack.__init__.__kwdefaults__["sensitivity_dbm"] == RECEIVER_SENSITIVITY_DBM


@pytest.mark.parametrize("name, value, message", [
    ("quarantine_s", -1.0, "quarantine_s: expected a number of seconds >= 0, got -1.0"),
    ("verify_dbm", float("nan"), "verify_dbm: expected a power in dBm (a finite number), got nan"),
    ("allocation", "worst-fit", "allocation: expected one of best-fit, first-fit, got 'worst-fit'"),
    ("prestage", "yes", "prestage: expected true or false, got 'yes'"),
    ("diagnosed_per_incident", -2, "diagnosed_per_incident: expected a count >= 0, got -2"),
    ("eviction_window_s", 0.0, "eviction_window_s: expected a number of seconds > 0, got 0.0"),
])
def test_a_bad_setting_is_refused_by_name(name, value, message):
    with pytest.raises(AgentConfigError) as e:
        AgentConfig(**{name: value})
    assert str(e.value) == message


def test_ptb_agent_help_lists_every_setting(capsys):
    with pytest.raises(SystemExit) as e:
        main(["agent", "--help"])
    out = " ".join(capsys.readouterr().out.split())       # (help wraps at any width)
    assert e.value.code == 0
    for f in SETTINGS.values():
        assert f.metadata["flag"] in out
    assert "--no-prestage" in out and "--no-verify-phases" in out
    assert "(default 60)" in out and "(default -12)" in out and "(default best-fit)" in out


@pytest.mark.parametrize("flag, value, message", [
    ("--quarantine", "-1", "argument --quarantine: expected a number of seconds >= 0, got '-1'"),
    ("--quarantine", "soon", "argument --quarantine: expected a number of seconds >= 0, "
                             "got 'soon'"),
    ("--verify-dbm", "inf", "argument --verify-dbm: expected a power in dBm (a finite number), "
                            "got 'inf'"),
    ("--diagnosed-per-window", "1.5", "argument --diagnosed-per-window: expected a count >= 0, "
                                      "got '1.5'"),
    ("--allocation", "worst-fit", "argument --allocation: invalid choice: 'worst-fit'"),
])
def test_a_bad_flag_is_one_line_before_anything_starts(capsys, tmp_path, flag, value, message):
    with pytest.raises(SystemExit) as e:
        main(["agent", "--rig", str(tmp_path / "no-rig.toml"), "--journal",
              str(tmp_path / "j.db"), flag, value])
    err = capsys.readouterr().err
    assert e.value.code == 2 and message in err and "Traceback" not in err
    assert list(tmp_path.iterdir()) == []


def test_flags_override_the_rig_files_settings():
    rig = rigfile.parse(_rig_text("[agent]\nquarantine_s = 5.0\nprestage = true\n"
                                  "allocation = \"first-fit\"\n"))
    argv = ["agent", "--rig", "r", "--journal", "j", "--quarantine", "0", "--no-prestage",
            "--verify-phases"]
    args = build_parser(argv).parse_args(argv)
    assert config_of(rig, args) == AgentConfig(quarantine_s=0.0, prestage=False,
                                               verify_phases=True, allocation="first-fit")
    plain = build_parser(argv).parse_args(argv[:5])
    assert config_of(rig, plain) == rig.agent


def test_a_setting_in_the_rig_file_reaches_the_agent(tmp_path):
    with _rig_on_bus(tmp_path, "opus", "ocs", switching_s=0.0) as (emu, rig, path):
        path.write_text(path.read_text() + "\n[agent]\nquarantine_s = 7.5\n"
                        "verify_dbm = -15.0\nallocation = \"first-fit\"\n")
        rig = rigfile.load(path)
        agent = AgentProcess(rig, str(tmp_path / "journal.db"))
        agent.start()
        try:
            with serving(agent.run), ServiceClient(rig.agent_endpoints()[0], timeout=20) as c:
                described = c.call("describe")
            assert (described["quarantine_s"], described["verify_dbm"]) == (7.5, -15.0)
            assert agent.agent.config == dataclasses.replace(
                AgentConfig(), quarantine_s=7.5, verify_dbm=-15.0, allocation="first-fit")
            assert agent.agent.pool.quarantine_s == 7.5
            assert agent.agent.diagnosis.verify_dbm == -15.0
        finally:
            agent.close()


def _rig_text(agent: str) -> str:
    return ('[rig]\nname = "r"\n[bus]\ncurve = false\n[devices.ocs]\nkind = "switch"\n'
            'driver = "photonic_testbed.drivers.polatis:Polatis"\n'
            'address = "TCPIP::127.0.0.1::5025::SOCKET"\n' + agent)


def test_an_agent_process_used_before_start_or_after_close_says_so(tmp_path):
    """Its agent, server and subscriber are made by `start`: a loop run before then (or after
    `close`) is refused in a sentence, not an AttributeError of None."""
    agent = AgentProcess(rigfile.parse(_rig_text("")), str(tmp_path / "journal.db"))
    with pytest.raises(AgentError, match=r"^the agent of rig r is not started \(start\(\) it "
                                         r"first\) or is closed$"):
        agent.step()
    agent.close()
    with pytest.raises(AgentError, match="is not started"):
        agent.run(threading.Event())
