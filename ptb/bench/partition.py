"""Leaders cut off for real: each agent replica on a host of its own (a network namespace joined
to this one by a veth pair), the etcd cluster, the opus rig's OCS service and the GPU monitor on
this side, CURVE on (the endpoints are off loopback). What `ptb bench ha --partitions` and
tests/test_control_plane_partition.py run.

A trial (`cut_trial`) cuts the link of the replica that leads while it keeps running: another
takes the lead, swaps a failed GPU's spare in, and the link comes back; whatever the cut-off
replica still does after that is counted on the emulated OCS itself (its moves and circuits): a
deposed leader must move nothing. Needs root and iproute2 (`Unavailable` says why not).
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import pathlib
import random
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

from photonic_testbed.common.jobplan import dp_ring
from photonic_testbed.common.rack_layout import layout
from photonic_testbed.emulator.rig import EmulatedRig
from photonic_testbed.hil import rig as rigfile
from photonic_testbed.hil.bus.client import ServiceClient
from photonic_testbed.hil.bus.security import ClientKeys, authorize, client_keys, generate
from photonic_testbed.hil.devices.service import DeviceService
from photonic_testbed.hil.etcd.client import Etcd, EtcdError
from photonic_testbed.hil.etcd.cluster import LocalCluster
from photonic_testbed.hil.job.fabric_client import Fabric
from photonic_testbed.hil.rig import rig_spec
from photonic_testbed.ptb.bench.measure import wait_for

ROOT = pathlib.Path(__file__).resolve().parents[2]
GROUP = "opus"
LINGER_S = 3.0          # after the link is back: what the cut-off replica would do, it has done


class Unavailable(Exception):
    """Network namespaces cannot be made here (why)."""


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=10,
                          check=check)


@dataclasses.dataclass(frozen=True)
class Host:
    """A network namespace joined to this one: `here` this side's address of the pair,
    `there` the namespace's."""
    ns: str
    dev: str                # the namespace's end of the pair
    here: str
    there: str

    def cut(self) -> None:
        _ip("-n", self.ns, "link", "set", self.dev, "down")

    def join(self) -> None:
        _ip("-n", self.ns, "link", "set", self.dev, "up")
        _ip("-n", self.ns, "route", "replace", "default", "via", self.here)


@contextlib.contextmanager
def hosts(count: int) -> Iterator[list[Host]]:
    """`count` network namespaces, each joined to this one by a veth pair of its own (and
    routed through it to every address of this side), removed after."""
    if shutil.which("ip") is None:
        raise Unavailable("network namespaces unavailable: the `ip` command (iproute2) is "
                          "missing")
    if os.geteuid() != 0:
        raise Unavailable("network namespaces unavailable: not running as root")
    made: list[tuple[str, str]] = []
    try:
        out = []
        for k in range(count):
            tag = f"{os.getpid() % 100000}{k}"
            ns, here_dev, there_dev = f"ptbl{tag}", f"ptbh{tag}", f"ptbt{tag}"
            subnet = f"10.{150 + (os.getpid() + k) % 50}.{(os.getpid() // 50 + 7 * k) % 250}"
            r = _ip("netns", "add", ns, check=False)
            if r.returncode != 0:
                raise Unavailable(f"network namespaces unavailable: ip netns add: "
                                  f"{r.stderr.strip()}")
            made.append((ns, here_dev))
            r = _ip("link", "add", here_dev, "type", "veth", "peer", "name", there_dev,
                    check=False)
            if r.returncode != 0:
                raise Unavailable(f"veth pairs unavailable: {r.stderr.strip()}")
            _ip("link", "set", there_dev, "netns", ns)
            _ip("addr", "add", f"{subnet}.1/24", "dev", here_dev)
            _ip("link", "set", here_dev, "up")
            _ip("-n", ns, "addr", "add", f"{subnet}.2/24", "dev", there_dev)
            _ip("-n", ns, "link", "set", "lo", "up")
            host = Host(ns, there_dev, f"{subnet}.1", f"{subnet}.2")
            host.join()
            out.append(host)
        yield out
    finally:
        for ns, here_dev in made:
            _ip("link", "del", here_dev, check=False)
            _ip("netns", "del", ns, check=False)


def _keys(folder: pathlib.Path) -> pathlib.Path:
    generate(folder, "server")
    for name, role, jobs in (("agent", "agent", []), ("tenant", "tenant", ["dp"])):
        public, _ = generate(folder, name, role, jobs)
        authorize(public, folder / "authorized")
    return folder


@dataclasses.dataclass
class CutOff:
    """The set-up (see the module): `start(name)` starts replica `name` in its namespace."""
    rig: rigfile.Rig
    path: pathlib.Path
    emu: EmulatedRig
    etcd: LocalCluster
    hosts: dict[str, Host]
    tenant: ClientKeys | None
    procs: dict[str, subprocess.Popen] = dataclasses.field(default_factory=dict)

    def start(self, name: str) -> subprocess.Popen:
        env = dict(os.environ, PYTHONPATH=str(ROOT))
        argv = [sys.executable, "-m", "photonic_testbed.ptb", "agent", "--rig", str(self.path),
                "--journal", f"etcd://{self.etcd.endpoints}/{GROUP}", "--quarantine", "0",
                "--lease", "1", "--replica", name]
        self.procs[name] = subprocess.Popen(
            ["ip", "netns", "exec", self.hosts[name].ns, *argv], cwd=ROOT, env=env,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        return self.procs[name]

    def leader(self) -> dict | None:
        try:
            kv = Etcd(self.etcd.endpoints, timeout=2.0).get(f"/ptb/{GROUP}/leader")
        except EtcdError:
            return None
        return json.loads(kv.value) if kv else None

    def ocs_term(self) -> int:
        with ServiceClient(self.rig.endpoints()["ocs"][0], keys=self.rig.client_keys(),
                           timeout=5) as c:
            return int(c.call("ping")["term"])

    def fabric(self) -> Fabric:
        return Fabric(*self.rig.agent_endpoints(), replicas=self.rig.agent_replicas(),
                      keys=self.tenant, timeout=10)


@contextlib.contextmanager
def cut_off(folder: pathlib.Path, names: tuple[str, ...] = ("a", "b")) -> Iterator[CutOff]:
    """The set-up of the module's text, every replica of `names` started (in its own
    namespace); stopped and removed after."""
    keys = _keys(folder / "keys")
    with hosts(len(names)) as made, \
            LocalCluster(3, folder / "etcd", host=made[0].here) as etcd:
        here = made[0].here
        emu = EmulatedRig(rig_spec("opus"), switching_s=0.0)
        emu.start()
        stop = threading.Event()
        service = thread = None
        setup = None
        try:
            lay = layout("opus")
            gpus = tuple(rigfile.GpuConfig(g, a[0].switch, a[0].tx, g in lay.spares)
                         for g, a in lay.gpus.items())
            bus = rigfile.for_emulator("opus", emu.endpoints, host=here, gpus=gpus)
            replicas = {}
            for name, host in zip(names, made, strict=True):
                ports = rigfile.free_ports(2, host.here)
                replicas[name] = (f"tcp://{host.there}:{ports[0]}",
                                  f"tcp://{host.there}:{ports[1]}")
            rig = dataclasses.replace(
                bus, bus=dataclasses.replace(
                    bus.bus, curve=True, heartbeat_s=0.2,
                    server_key=str(keys / "server.key_secret"),
                    server_public_key=str(keys / "server.key"),
                    authorized_keys=str(keys / "authorized"),
                    client_key=str(keys / "agent.key_secret")),
                replicas=replicas)
            path = folder / "rig.toml"
            rigfile.write(path, rig)
            rig = rigfile.load(path)
            tenant = client_keys(keys / "tenant.key_secret", keys / "server.key")
            emu.start_rack(rig.gpus_endpoints(), rig.agent_endpoints(), keys=rig.server_keys(),
                           job_keys=tenant)
            service = DeviceService(rig.service_specs(["ocs"])[0])
            service.bind()
            thread = threading.Thread(target=service.serve, args=(stop,), daemon=True)
            thread.start()
            setup = CutOff(rig, path, emu, etcd, dict(zip(names, made, strict=True)), tenant)
            for name in names:
                setup.start(name)
            yield setup
        finally:
            if setup is not None:
                for p in setup.procs.values():
                    stop_process(p)
            stop.set()
            if thread is not None:
                thread.join(5)
            if service is not None:
                service.close()
            emu.close()


def stop_process(proc: subprocess.Popen) -> str:
    """SIGTERM, then SIGKILL after 10 s; what it wrote."""
    if proc.poll() is None:
        proc.terminate()
        try:
            return proc.communicate(timeout=10)[0] or ""
        except subprocess.TimeoutExpired:
            proc.kill()
    return proc.communicate()[0] or ""


@dataclasses.dataclass(frozen=True)
class Trial:
    """One cut: who led (cut off) and who took the lead, the restart order the new leader
    gave, and what the OCS did after the link came back (its moves, whether its circuits
    changed, the term it holds)."""
    cut: dict
    new: dict
    order: tuple[dict[int, str], str] | None
    moves_after: int
    circuits_changed: bool
    ocs_term: int


def cut_trial(setup: CutOff, fabric: Fabric, rnd: random.Random) -> Trial:
    """One trial of the module's text; the failed GPU healed after (a spare again)."""
    optics, rack = setup.emu.optics, setup.emu.rack
    physics = optics.physics if optics is not None else None
    if physics is None or rack is None:
        raise RuntimeError("the emulated opus rig has no OCS or no rack")
    first = wait_for(setup.leader, "a leader", every=0.02)
    host = setup.hosts[first["name"]]
    host.cut()                                      # it keeps running, alone
    try:
        now = wait_for(lambda: (lambda w: w if w and int(w["term"]) > int(first["term"])
                                else None)(setup.leader()), "another replica leading",
                       every=0.02)
        victim = rnd.choice(list(fabric.rank_map.values()))
        rack.rack.faults.fail_gpu(victim)
        order = fabric.wait_restart(timeout=30)
        moves, truth = physics.moves, physics.truth()["actual"]
    finally:
        host.join()
    time.sleep(LINGER_S)
    trial = Trial(first, now, order, physics.moves - moves,
                  physics.truth()["actual"] != truth, setup.ocs_term())
    rack.rack.faults.heal_gpu(victim)
    return trial


def admitted(setup: CutOff) -> Fabric:
    """The job (a DP ring of 8) admitted by the group's leader, its phase granted."""
    fabric = setup.fabric()
    try:
        fabric.admit(dp_ring(8))
        if not fabric.phase("dp")["granted"]:
            raise RuntimeError("the DP ring's phase was not granted")
    except BaseException:
        fabric.close()
        raise
    return fabric
