"""What the benches measure the stack with: the stack of the agent benchmarks brought up
(`agent_stack`: `ptb emulate`, `ptb serve`, `ptb agent`, as `ptb demo` starts them, through
`ptb.stack.Stack`), the memory and CPU time of its processes, percentiles and a fast wait."""
from __future__ import annotations

import os
import pathlib
import time
from collections.abc import Callable
from typing import Any, TypeVar

from photonic_testbed.ptb.cli import CommandFailed
from photonic_testbed.ptb.stack import Stack

T = TypeVar("T")


def agent_stack(rig: str, *, switching_ms: float = 0.0, quarantine_s: float = 0.0,
                journal_sync: str = "full", one_process: bool = False,
                journal: str = "sqlite", cabling: str = "", ddm_noise_db: float = 0.0,
                workdir: str | None = None) -> Stack:
    """The rig's emulator (its chip ideal: no calibration), device services (`one_process`:
    as threads of one `ptb serve --one-process`, for a rig of 64 OCSes) and agent, in a
    temporary folder; `stack.started` holds each one's start-up (launch to ready). The caller
    closes it. `journal` "etcd": the agent is the one replica of a group on a local 3-member
    etcd cluster (its endpoints are the rig's `agent_endpoints()`). `cabling`, `ddm_noise_db`:
    `ptb emulate`'s."""
    stack = Stack(workdir)
    try:
        stack.emulate(rig, "--ideal-chip", "--switching-ms", str(switching_ms),
                      *(["--replicas", "1"] if journal == "etcd" else []),
                      *(["--cabling", cabling] if cabling else []),
                      *(["--ddm-noise-db", str(ddm_noise_db)] if ddm_noise_db else []))
        stack.serve(*(["--one-process"] if one_process else []))
        if journal == "etcd":
            stack.replicas(stack.etcd(3), "--quarantine", str(quarantine_s))
        else:
            stack.agent("--quarantine", str(quarantine_s), "--journal-sync", journal_sync)
    except BaseException:
        stack.close()
        raise
    return stack


def journal_reader(stack: Stack) -> Any:
    """The stack's agent journal, to read (a context manager): its SQLite file, or its group's
    on the stack's etcd cluster (`agent_stack(journal="etcd")`)."""
    from photonic_testbed.hil.agent.sqlite_journal import SqliteJournal
    written = stack.workdir / "etcd.json"
    if not written.exists():
        return SqliteJournal(stack.journal, read_only=True)
    import json
    return etcd_journal_reader(json.loads(written.read_text())["journal"])


def etcd_journal_reader(url: str) -> Any:
    """The journal of the agent group at `url` (etcd://MEMBERS/GROUP), to read: its
    `leadership` never campaigns, so it can say who leads and never writes."""
    from photonic_testbed.hil.agent.etcd_journal import EtcdJournal, parse_url
    from photonic_testbed.hil.agent.leadership import Leadership
    from photonic_testbed.hil.etcd.client import Etcd
    members, group = parse_url(url)
    etcd = Etcd(members, timeout=5.0)
    return EtcdJournal(etcd, Leadership(etcd, group, {"name": "bench (reads only)"}))


def stack_rss_mb(stack: Stack) -> dict[str, float]:
    """Resident memory of each process of the stack (and its children), MiB."""
    return {name: rss_mb(proc.pid) for name, proc in stack.processes.items()}


def stack_cpu_s(stack: Stack) -> dict[str, float]:
    """CPU seconds each process of the stack (and its children) has used so far."""
    return {name: cpu_s(proc.pid) for name, proc in stack.processes.items()}


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


def wait_for(cond: Callable[[], T | None], what: str, timeout: float = 30.0,
             every: float = 0.0005) -> T:
    """Poll `cond` fast (a bench times what it waits for; `every` seconds apart) until it gives
    a true value."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = cond()
        if got:
            return got
        time.sleep(every)
    raise CommandFailed(f"{what} did not happen within {timeout:g} s")
