"""A leader cut off for real: replica `a` of the agent group runs on a host of its own (a network
namespace this test makes, joined to this one by a veth pair), the etcd cluster, the opus rig's
OCS service, the GPU monitor and replica `b` on this side, CURVE on (the endpoints are off
loopback). The link is cut while `a` leads and keeps running: `b` takes the lead, swaps a failed
GPU's spare in, and once the link is back `a` has moved nothing: it took itself as deposed when
its lease lapsed by its own clock, and the OCS has taken `b`'s term. Needs root and `ip`; skipped
(with the reason) elsewhere."""
from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
import threading
import time

import pytest

from photonic_testbed.common.jobplan import dp_ring
from photonic_testbed.common.rack_layout import layout
from photonic_testbed.emulator.rig import EmulatedRig
from photonic_testbed.hil import rig as rigfile
from photonic_testbed.hil.bus.client import ServiceClient
from photonic_testbed.hil.bus.security import authorize, client_keys, generate
from photonic_testbed.hil.devices.service import DeviceService
from photonic_testbed.hil.etcd.client import Etcd
from photonic_testbed.hil.etcd.cluster import LocalCluster
from photonic_testbed.hil.job.fabric_client import Fabric
from photonic_testbed.hil.rig import rig_spec
from tests.test_agent_bus import ROOT, _stop, _until


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=10,
                          check=check)


@pytest.fixture
def leader_host():
    """A network namespace joined to this one by a veth pair: (namespace, its veth, this
    side's address, its address)."""
    if shutil.which("ip") is None:
        pytest.skip("network namespaces unavailable: the `ip` command (iproute2) is missing")
    if os.geteuid() != 0:
        pytest.skip("network namespaces unavailable: the tests are not running as root")
    tag = f"{os.getpid() % 100000}"
    ns, here_dev, there_dev = f"ptbl{tag}", f"ptbh{tag}", f"ptbt{tag}"
    subnet = f"10.{150 + os.getpid() % 50}.{os.getpid() % 250}"
    r = _ip("netns", "add", ns, check=False)
    if r.returncode != 0:
        pytest.skip(f"network namespaces unavailable: ip netns add: {r.stderr.strip()}")
    try:
        r = _ip("link", "add", here_dev, "type", "veth", "peer", "name", there_dev, check=False)
        if r.returncode != 0:
            pytest.skip(f"veth pairs unavailable: {r.stderr.strip()}")
        _ip("link", "set", there_dev, "netns", ns)
        _ip("addr", "add", f"{subnet}.1/24", "dev", here_dev)
        _ip("link", "set", here_dev, "up")
        _ip("-n", ns, "addr", "add", f"{subnet}.2/24", "dev", there_dev)
        _ip("-n", ns, "link", "set", there_dev, "up")
        _ip("-n", ns, "link", "set", "lo", "up")
        yield ns, there_dev, f"{subnet}.1", f"{subnet}.2"
    finally:
        _ip("link", "del", here_dev, check=False)
        _ip("netns", "del", ns, check=False)


def _keys(folder):
    generate(folder, "server")
    for name, role, jobs in (("agent", "agent", []), ("tenant", "tenant", ["dp"])):
        public, _ = generate(folder, name, role, jobs)
        authorize(public, folder / "authorized")
    return folder


def _leader(etcd) -> dict | None:
    kv = Etcd(etcd.endpoints).get("/ptb/opus/leader")
    return json.loads(kv.value) if kv else None


def test_a_leader_cut_off_from_etcd_and_the_services_moves_nothing(leader_host, tmp_path):
    ns, there_dev, here, there = leader_host
    keys = _keys(tmp_path / "keys")
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    with LocalCluster(3, tmp_path / "etcd", host=here) as etcd:
        emu = EmulatedRig(rig_spec("opus"), switching_s=0.0)
        emu.start()
        procs: dict[str, subprocess.Popen] = {}
        stop = threading.Event()
        service = thread = fabric = None
        try:
            lay = layout("opus")
            gpus = tuple(rigfile.GpuConfig(g, a[0].switch, a[0].tx, g in lay.spares)
                         for g, a in lay.gpus.items())
            bus = rigfile.for_emulator("opus", emu.endpoints, host=here, gpus=gpus)
            port = iter(rigfile.free_ports(4, here))
            rig = dataclasses.replace(
                bus, bus=dataclasses.replace(
                    bus.bus, curve=True, heartbeat_s=0.2,
                    server_key=str(keys / "server.key_secret"),
                    server_public_key=str(keys / "server.key"),
                    authorized_keys=str(keys / "authorized"),
                    client_key=str(keys / "agent.key_secret")),
                replicas={"a": (f"tcp://{there}:{next(port)}", f"tcp://{there}:{next(port)}"),
                          "b": (f"tcp://{here}:{next(port)}", f"tcp://{here}:{next(port)}")})
            path = tmp_path / "rig.toml"
            rigfile.write(path, rig)
            rig = rigfile.load(path)
            tenant = client_keys(keys / "tenant.key_secret", keys / "server.key")
            emu.start_rack(rig.gpus_endpoints(), rig.agent_endpoints(), keys=rig.server_keys(),
                           job_keys=tenant)
            service = DeviceService(rig.service_specs(["ocs"])[0])
            service.bind()
            thread = threading.Thread(target=service.serve, args=(stop,), daemon=True)
            thread.start()
            url = f"etcd://{etcd.endpoints}/opus"
            agent = ["-m", "photonic_testbed.ptb", "agent", "--rig", str(path), "--journal", url,
                     "--quarantine", "0", "--lease", "1"]
            procs["a"] = subprocess.Popen(
                ["ip", "netns", "exec", ns, sys.executable, *agent, "--replica", "a"], cwd=ROOT,
                env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            first = _until(lambda: _leader(etcd), timeout=60, what="replica a leading")
            assert first["name"] == "a"
            procs["b"] = subprocess.Popen([sys.executable, *agent, "--replica", "b"], cwd=ROOT,
                                          env=env, stdout=subprocess.PIPE,
                                          stderr=subprocess.STDOUT, text=True)
            fabric = Fabric(*rig.agent_endpoints(), replicas=rig.agent_replicas(), keys=tenant,
                            timeout=10)
            rank_map = fabric.admit(dp_ring(8))
            assert fabric.phase("dp")["granted"]
            physics = emu.optics.physics

            _ip("-n", ns, "link", "set", there_dev, "down")     # a keeps running, alone
            now = _until(lambda: (lambda w: w if w and w["name"] == "b" else None)(
                _leader(etcd)), timeout=30, what="replica b leading")
            assert now["term"] == first["term"] + 1
            emu.rack.rack.faults.fail_gpu("server3")
            order = fabric.wait_restart(timeout=30)
            assert order is not None and order[0] == {**rank_map, 3: "spare0"}
            moves = physics.moves
            truth = physics.truth()
            _ip("-n", ns, "link", "set", there_dev, "up")
            time.sleep(3.0)                   # whatever a would still do, it has done by now
            assert physics.moves == moves, "the cut-off leader moved a switch"
            assert physics.truth()["actual"] == truth["actual"]
            assert _leader(etcd)["name"] == "b"
            with ServiceClient(rig.endpoints()["ocs"][0], keys=rig.client_keys(),
                               timeout=5) as c:
                assert c.call("ping")["term"] == now["term"]
            out = _stop(procs.pop("a"))
            assert "lost the lead" in out, out
        finally:
            if fabric is not None:
                fabric.close()
            for p in procs.values():
                _stop(p)
            stop.set()
            if thread is not None:
                thread.join(5)
            if service is not None:
                service.close()
            emu.close()


