"""The whole stack as processes for the agent benchmarks: `ptb emulate` (rack included),
`ptb serve` and `ptb agent`, as `ptb demo` starts them; the benchmark drives the control
endpoint and the job side (`hil.job.fabric_client.Fabric`) and reads the agent's journal."""
from __future__ import annotations

import json
import os
import pathlib
import tempfile
import time

from photonic_testbed.hil import rig as rigfile
from photonic_testbed.hil.bus.client import BusError, ServiceClient
from photonic_testbed.ptb.cli import CommandFailed
from photonic_testbed.ptb.demo import Processes, _wait


PEER_TIMEOUT_S = 10.0        # a process that answers answers sooner: only a busy machine waits


class Stack:
    """`one_process`: the device services as threads of one `ptb serve --one-process` (a rig
    of 64 OCSes). `started` holds each process's start-up time: launch to ready (the emulator:
    its rig file written; the services: every one bound; the agent: answering a ping)."""

    def __init__(self, rig: str, switching_ms: float = 0.0, quarantine_s: float = 0.0,
                 journal_sync: str = "full", one_process: bool = False):
        self._tmp = tempfile.TemporaryDirectory(prefix="ptb-bench-")
        self.workdir = pathlib.Path(self._tmp.name)
        self.procs = Processes(self.workdir)
        self.journal = self.workdir / "journal.db"
        self.started: dict[str, float] = {}
        try:
            rig_path, eps = self.workdir / "rig.toml", self.workdir / "emulator.json"
            t0 = time.monotonic()
            self.procs.start("emulate", "emulate", "--rig", rig, "--ideal-chip",
                             "--switching-ms", str(switching_ms), "--write-rig", str(rig_path),
                             "--endpoints", str(eps))
            _wait("the emulator", lambda: rig_path.exists() and eps.exists(), self.procs)
            self.started["emulator"] = time.monotonic() - t0
            self.rig = rigfile.load(rig_path)
            self.control = json.loads(eps.read_text())["control"]
            served = self.workdir / "services.json"
            t0 = time.monotonic()
            self.procs.start("serve", "serve", "--rig", str(rig_path), "--endpoints",
                             str(served), *(["--one-process"] if one_process else []))
            _wait("the services", served.exists, self.procs)
            self.started["services"] = time.monotonic() - t0
            t0 = time.monotonic()
            self.procs.start("agent", "agent", "--rig", str(rig_path), "--journal",
                             str(self.journal), "--quarantine", str(quarantine_s),
                             "--journal-sync", journal_sync)
            with ServiceClient(self.rig.agent_endpoints()[0], timeout=PEER_TIMEOUT_S) as c:
                def up():
                    try:
                        return c.call("ping")
                    except BusError:
                        return None
                _wait("the agent", up, self.procs)
            self.started["agent"] = time.monotonic() - t0
        except BaseException:
            self.close()
            raise

    def rss_mb(self) -> dict[str, float]:
        """Resident memory of each process of the stack (and its children), MiB."""
        return {name: rss_mb(proc.pid) for name, proc in self.procs.procs}

    def cpu_s(self) -> dict[str, float]:
        """CPU seconds each process of the stack (and its children) has used so far."""
        return {name: cpu_s(proc.pid) for name, proc in self.procs.procs}

    def close(self) -> None:
        self.procs.close()
        self._tmp.cleanup()


def _tree(pid: int) -> list[int]:
    """A process and its children, theirs, ... (from /proc); [] where /proc cannot say."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        if p in out:
            continue
        try:
            kids = pathlib.Path(f"/proc/{p}/task/{p}/children").read_text().split()
        except OSError:
            continue
        out.append(p)
        todo += [int(k) for k in kids]
    return out


def rss_mb(pid: int) -> float:
    """A process's resident memory with its children's (VmRSS from /proc), MiB; nan where
    /proc cannot say."""
    total, read = 0, False
    for p in _tree(pid):
        try:
            status = pathlib.Path(f"/proc/{p}/status").read_text()
        except OSError:
            continue
        read = True
        total += next((int(line.split()[1]) for line in status.splitlines()
                       if line.startswith("VmRSS:")), 0)
    return total / 1024 if read else float("nan")


def cpu_s(pid: int) -> float:
    """CPU time (user + system) a process and its live children have used so far, seconds;
    nan where /proc cannot say."""
    ticks, read = 0, False
    for p in _tree(pid):
        try:
            fields = pathlib.Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        read = True
        ticks += int(fields[11]) + int(fields[12])        # utime, stime
    return ticks / os.sysconf("SC_CLK_TCK") if read else float("nan")


def percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    if not xs:
        raise CommandFailed("no samples")
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def wait_for(cond, timeout: float = 30.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = cond()
        if got:
            return got
        time.sleep(0.0005)
    raise CommandFailed("the agent did not answer in time")
