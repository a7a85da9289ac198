"""The whole stack as processes for the agent benchmarks: `ptb emulate` (rack included),
`ptb serve` and `ptb agent`, as `ptb demo` starts them; the benchmark drives the control
endpoint and the job side (`hil.fabric_client.Fabric`) and reads the agent's journal."""
from __future__ import annotations

import json
import pathlib
import tempfile
import time

from photonic_testbed.hil import rig as rigfile
from photonic_testbed.hil.bus.client import BusError, ServiceClient
from photonic_testbed.ptb.cli import CommandFailed
from photonic_testbed.ptb.demo import Processes, _wait


PEER_TIMEOUT_S = 10.0        # a process that answers answers sooner: only a busy machine waits


class Stack:
    def __init__(self, rig: str, switching_ms: float = 0.0, quarantine_s: float = 0.0,
                 journal_sync: str = "full"):
        self._tmp = tempfile.TemporaryDirectory(prefix="ptb-bench-")
        self.workdir = pathlib.Path(self._tmp.name)
        self.procs = Processes(self.workdir)
        self.journal = self.workdir / "journal.db"
        try:
            rig_path, eps = self.workdir / "rig.toml", self.workdir / "emulator.json"
            self.procs.start("emulate", "emulate", "--rig", rig, "--ideal-chip",
                             "--switching-ms", str(switching_ms), "--write-rig", str(rig_path),
                             "--endpoints", str(eps))
            _wait("the emulator", lambda: rig_path.exists() and eps.exists(), self.procs)
            self.rig = rigfile.load(rig_path)
            self.control = json.loads(eps.read_text())["control"]
            served = self.workdir / "services.json"
            self.procs.start("serve", "serve", "--rig", str(rig_path), "--endpoints",
                             str(served))
            _wait("the services", served.exists, self.procs)
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
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        self.procs.close()
        self._tmp.cleanup()


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
