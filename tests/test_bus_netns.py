"""Multi-host for real: the service in one network namespace, clients in another, joined by a
veth pair with addresses this test assigns, CURVE on. Needs root and `ip`; skipped (with the
reason) elsewhere."""
from __future__ import annotations

import json
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from photonic_testbed.hil.bus.security import authorize, generate

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=10,
                          check=check)


@pytest.fixture
def namespaces():
    if shutil.which("ip") is None:
        pytest.skip("network namespaces unavailable: the `ip` command (iproute2) is missing")
    if os.geteuid() != 0:
        pytest.skip("network namespaces unavailable: the tests are not running as root")
    tag = f"{os.getpid() % 100000}"
    server, client = f"ptbs{tag}", f"ptbc{tag}"
    veth_s, veth_c = f"ptbvs{tag}", f"ptbvc{tag}"
    subnet = f"10.{200 + os.getpid() % 50}.{os.getpid() % 250}"
    made = []
    try:
        for ns in (server, client):
            r = _ip("netns", "add", ns, check=False)
            if r.returncode != 0:
                pytest.skip(f"network namespaces unavailable: ip netns add: {r.stderr.strip()}")
            made.append(ns)
        r = _ip("link", "add", veth_s, "type", "veth", "peer", "name", veth_c, check=False)
        if r.returncode != 0:
            pytest.skip(f"veth pairs unavailable: {r.stderr.strip()}")
        for ns, dev, host in ((server, veth_s, 1), (client, veth_c, 2)):
            _ip("link", "set", dev, "netns", ns)
            _ip("-n", ns, "addr", "add", f"{subnet}.{host}/24", "dev", dev)
            _ip("-n", ns, "link", "set", dev, "up")
            _ip("-n", ns, "link", "set", "lo", "up")
        yield server, client, f"{subnet}.1"
    finally:
        for ns in made:
            _ip("netns", "del", ns, check=False)


CLIENT = textwrap.dedent("""\
    import json, sys
    from photonic_testbed.hil import rig as rigfile
    from photonic_testbed.hil.bus.client import ServiceClient, ServiceUnavailable
    from photonic_testbed.hil.bus.mirror import StateSubscriber
    from photonic_testbed.hil.bus.security import client_keys
    rig = rigfile.load(sys.argv[1])
    request, publish = rig.endpoints()["ocs"]
    out = {}
    with ServiceClient(request, keys=rig.client_keys(), timeout=10) as c:
        out["applied"] = c.call("apply_circuits", circuits=[[1, 9], [2, 10]],
                                expect=c.call("ping")["version"])
        with StateSubscriber({"ocs": (request, publish)}, keys=rig.client_keys()) as sub:
            out["synced"] = sub.wait_synced(10)
            out["mirror"] = sub.state("ocs")["circuits"]
        intruder = client_keys(sys.argv[2], rig.bus.server_public_key)
        for name, keys in (("intruder", intruder), ("no_key", None)):
            with ServiceClient(request, keys=keys, timeout=1.0) as bad:
                try:
                    bad.call("apply_circuits", circuits=[[3, 11]])
                    out[name] = "accepted"
                except ServiceUnavailable as e:
                    out[name] = "refused"
        out["after"] = c.call("read_circuits")["circuits"]
    print(json.dumps(out))
    """)


def test_service_and_client_in_separate_namespaces_with_curve(namespaces, tmp_path):
    server_ns, client_ns, address = namespaces
    keys = tmp_path / "keys"
    generate(keys, "server")
    for name in ("agent", "intruder"):
        generate(keys, name, role="agent")      # (devices take changes from the agent role)
    authorize(keys / "agent.key", keys / "authorized")
    rig = tmp_path / "rig.toml"
    rig.write_text(textwrap.dedent(f"""\
        [rig]
        name = "two-hosts"
        [bus]
        host = "{address}"
        base_port = 5710
        heartbeat_s = 0.2
        server_key = "keys/server.key_secret"
        server_public_key = "keys/server.key"
        authorized_keys = "keys/authorized"
        client_key = "keys/agent.key_secret"
        [devices.ocs]
        kind = "switch"
        driver = "tests.bus_doubles:MemorySwitch"
        address = "memory"
        options = {{ ports = 8 }}
        """))
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    endpoints = tmp_path / "endpoints.json"
    serve = subprocess.Popen(["ip", "netns", "exec", server_ns, sys.executable, "-m",
                              "photonic_testbed.ptb", "serve", "--rig", str(rig), "--endpoints",
                              str(endpoints)],
                             cwd=ROOT, env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 30
        while not endpoints.exists():
            assert serve.poll() is None and time.monotonic() < deadline, \
                serve.communicate(timeout=5)[0] if serve.poll() is not None else "timeout"
            time.sleep(0.05)
        client = subprocess.run(["ip", "netns", "exec", client_ns, sys.executable, "-c", CLIENT,
                                 str(rig), str(keys / "intruder.key_secret")],
                                cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
        assert client.returncode == 0, client.stderr
        out = json.loads(client.stdout.strip().splitlines()[-1])
        assert out["applied"]["added"] == [[1, 9], [2, 10]]
        assert out["synced"] and out["mirror"] == [[1, 9], [2, 10]]
        assert out["intruder"] == "refused" and out["no_key"] == "refused"
        assert out["after"] == [[1, 9], [2, 10]]
    finally:
        serve.send_signal(signal.SIGTERM)
        try:
            serve.communicate(timeout=15)
        except subprocess.TimeoutExpired:
            serve.kill()
            serve.communicate()
