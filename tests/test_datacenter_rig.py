"""The emulated datacenter rig (`opus2048`: 2,048 GPUs on 64 rail OCSes, each its own SCPI
endpoint): its description, the whole rig started in this process, and a smaller one of the
same kind through the real commands (`ptb emulate --write-rig`, `ptb serve --one-process`)."""
from __future__ import annotations

import json
import socket

import pytest

from photonic_testbed.emulator.control import request
from photonic_testbed.emulator.rig import EmulatedRig
from photonic_testbed.hil import rig as rigfile
from photonic_testbed.hil.bus.client import ServiceClient
from photonic_testbed.hil.rig import RigFileError, rig_spec
from photonic_testbed.ptb.stack import Stack

# 2 pods of 8 servers (7 working, 1 spare), 8 rails: 128 GPUs on 16 OCSes of 8 x 8
SMALL = """\
[emulator]
base = "opus2048"
servers = 16
pod = 8
"""


def scpi(resource: str, line: str) -> str:
    """One query over the instrument's raw socket (`TCPIP::host::port::SOCKET`)."""
    _, host, port, _ = resource.split("::")
    with socket.create_connection((host, int(port)), timeout=10) as s:
        s.sendall(line.encode() + b"\n")
        reply = b""
        while not reply.endswith(b"\n"):
            chunk = s.recv(4096)
            assert chunk, f"{resource} closed before answering {line!r}"
            reply += chunk
    return reply.decode().strip()


def test_the_datacenter_rack_as_described():
    lay = rig_spec("opus2048").rack_layout()
    assert len(lay.gpus) == 2048 and len(lay.switches) == 64
    assert set(lay.switches.values()) == {32}
    assert len(lay.spares) == 64                             # one server of 8 per pod
    assert {lay.servers[g] for g in lay.spares} == {f"s{32 * k + 31}" for k in range(8)}
    # GPU l of every server on rail l, on its pod's OCS
    assert lay.gpus["s40g3"][0].switch == "rail3-pod1"
    assert len(lay.server_gpus["s40"]) == 8


def test_datacenter_descriptions_are_checked(tmp_path):
    small = tmp_path / "small.toml"
    small.write_text(SMALL)
    spec = rig_spec(str(small))
    assert (spec.servers, spec.pod, spec.rails, spec.spare_servers) == (16, 8, 8, 1)
    assert len(spec.rack_layout().gpus) == 128
    for text, why in ((SMALL + "spare_servers = 8\n", "working server in every pod"),
                      (SMALL + "ocs_ports = 16\n", "no chip, bench OCS"),
                      (SMALL + "rails = 0\n", "rails must be at least 1"),
                      # pods of 8, 8 and 4 servers: the last cannot hold 4 spares and work
                      (SMALL.replace("16", "20") + "spare_servers = 4\n",
                       "the smallest has 4")):
        bad = tmp_path / "bad.toml"
        bad.write_text(text)
        with pytest.raises(RigFileError, match=why):
            rig_spec(str(bad))


def test_the_whole_datacenter_rig_starts_in_this_process():
    """2,048 GPUs and 64 OCS endpoints in one process, the rack's monitor on the bus; every
    OCS its own socket; the control endpoint reads the switches' own circuits."""
    spec = rig_spec("opus2048")
    with EmulatedRig(spec, switching_s=0.0) as emu:
        bus = rigfile.for_emulator(spec, emu.endpoints, gpus=tuple(
            rigfile.GpuConfig(g, atts[0].switch, atts[0].tx, g in lay.spares,
                              server=lay.servers[g])
            for lay in [spec.rack_layout()] for g, atts in lay.gpus.items()))
        emu.start_rack(bus.gpus_endpoints(), None)
        ocs = {d.name: d.address for d in bus.devices.values()}
        assert len(ocs) == 64 and len(set(ocs.values())) == 64
        assert all(d.kind == "switch" for d in bus.devices.values())
        assert scpi(ocs["rail7-pod7"], ":OXC:SWIT:SIZE?") == "32,32"
        assert scpi(ocs["rail0-pod3"], ":OXC:SWIT:CONN:ADD (@1),(@34);*OPC?") == "1"
        got = request(emu.endpoints["control"], {"cmd": "switch_circuits",
                                                 "switches": ["rail0-pod3", "rail1-pod3"]})
        assert got["rail0-pod3"]["commanded"] == [[1, 34]]
        assert got["rail1-pod3"]["commanded"] == []
        assert dict(map(tuple, got["rail0-pod3"]["port_moves"])) == {1: 1, 34: 1}
        # the rack's light through that switch: s96g0 (port 1) -> s97g0 (egress 34)
        up = emu.rack.rack.link_map([("s96g0", "s97g0"), ("s96g0", "s98g0")])
        assert up[("s96g0", "s97g0")].up and up[("s96g0", "s98g0")] is None
        # and the OCS's own port power monitor sees the GPUs' light
        assert float(scpi(ocs["rail0-pod3"], ":PMON:POW? 34")) > -10


def test_emulate_and_serve_one_process_run_a_datacenter_rig(tmp_path):
    """`ptb emulate --rig small.toml --write-rig`: a rig file with one switch device per rail
    OCS and every GPU with its server; `ptb serve --one-process` serves all of them."""
    desc = tmp_path / "small.toml"
    desc.write_text(SMALL)
    with Stack(tmp_path / "stack") as stack:
        rig = stack.emulate(str(desc), "--switching-ms", "0")
        assert sorted(rig.devices) == sorted(f"rail{r}-pod{k}" for r in range(8)
                                             for k in range(2))
        assert len(rig.gpus) == 128 and sum(g.spare for g in rig.gpus) == 16
        s9g4 = next(g for g in rig.gpus if g.name == "s9g4")
        assert (s9g4.switch, s9g4.port, s9g4.server) == ("rail4-pod1", 2, "s9")
        endpoints = json.loads((stack.workdir / "emulator.json").read_text())
        assert scpi(endpoints["rail4-pod1"], "*IDN?").startswith("Polatis")
        assert sorted(stack.serve("--one-process")) == sorted(rig.devices)
        for name, (req, _) in rig.endpoints().items():
            with ServiceClient(req, timeout=20) as c:
                assert c.call("read_circuits")["circuits"] == [], name
        with ServiceClient(rig.endpoints()["rail2-pod0"][0], timeout=20) as c:
            c.call("apply_circuits", circuits=[[1, 10], [2, 9]])
        got = request(stack.control, {"cmd": "switch_circuits", "switches": ["rail2-pod0"]})
        assert got["rail2-pod0"]["commanded"] == [[1, 10], [2, 9]]
        code_s, out_s = stack.stop("serve"), stack.tail("serve", 100)
        code_e, out_e = stack.stop("emulate"), stack.tail("emulate", 100)
    assert code_s == 0, out_s
    assert code_e == 0 and "stopped; every port and pty freed" in out_e, out_e


def test_a_failing_control_handler_is_answered_and_the_endpoint_keeps_serving():
    """A handler's unexpected error (a bad regex for `drop`'s header raised re.error) is an
    answer, never the end of the control thread."""
    from photonic_testbed.emulator.control import ControlError, ControlServer, request
    from photonic_testbed.emulator.scpi_server import SCPIServer

    def boom(req):
        raise RuntimeError("a bug")

    scpi = SCPIServer.__new__(SCPIServer)           # only its drop rules are used here
    scpi._drop_rules = []
    server = ControlServer({"boom": boom, "echo": lambda req: req.get("x"),
                            "drop": lambda req: scpi.drop_on(req["header"], req["when"])})
    endpoint = server.start()
    try:
        with pytest.raises(ControlError, match="boom failed: RuntimeError: a bug"):
            request(endpoint, {"cmd": "boom"}, timeout_s=30)
        with pytest.raises(ControlError, match="not a regular expression"):
            request(endpoint, {"cmd": "drop", "header": "([", "when": "after"}, timeout_s=30)
        assert request(endpoint, {"cmd": "echo", "x": 3}, timeout_s=30) == 3
        assert scpi._drop_rules == []
    finally:
        server.close()
