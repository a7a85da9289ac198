"""The agent's figures as Prometheus metrics (`prometheus-client`, the `metrics` extra), for the
datacenter's Prometheus and Grafana (docs/metrics.md; the dashboard docs/grafana-agent.json).

Everything is read from what the agent already writes or holds, nothing is added to its loop:
the journal's entries as they are written (`Journal.listen`) count the failovers, phase switches,
circuits moved, alarms, link moves and slow GPUs, and give the latencies (an entry's `latency_s`,
by kind: the decision, the apply, the verification) and the received power of every circuit the
agent verified; the term, the lead and the circuits held are read from the agent process when
Prometheus scrapes. `AgentMetrics.attach(process)` wires a process; `serve(host, port)` starts
the HTTP endpoint Prometheus scrapes (`ptb agent --metrics-port`, `[agent] metrics_port`).
"""
from __future__ import annotations

import logging
import threading
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from photonic_testbed.hil.agent.entries import (
    Alarm,
    Applied,
    LinkFade,
    PhaseSwitched,
    Slow,
    Swap,
    Verified,
    VerifyFailed,
)
from photonic_testbed.hil.agent.journal import Entry

log = logging.getLogger(__name__)

# latencies from a millisecond (a phase switch on the chip) to a minute (a slow failover)
BUCKETS = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0)
MAX_LINKS = 4096          # received powers kept as series (a 64-OCS rack's circuits: 2,048)


class AgentMetrics:
    """The agent's metrics, in a registry of their own (several agents in one process, as in the
    tests, each have theirs)."""

    def __init__(self, registry: CollectorRegistry | None = None):
        self.registry = r = registry if registry is not None else CollectorRegistry()
        self.failovers = Counter("ptb_agent_failovers", "GPUs replaced by a spare, or a job "
                                 "shrunk, by the agent's decisions", ["outcome"], registry=r)
        self.phase_switches = Counter("ptb_agent_phase_switches", "phase switches made for "
                                      "jobs", ["ahead"], registry=r)
        self.circuits_moved = Counter("ptb_agent_circuits_moved", "circuits added or removed "
                                      "on switches", ["switch", "change"], registry=r)
        self.verifications = Counter("ptb_agent_verifications", "circuits verified by light, "
                                     "by result", ["result"], registry=r)
        self.alarms = Counter("ptb_agent_alarms", "alarms raised", registry=r)
        self.link_moves = Counter("ptb_agent_link_moves", "circuits whose light faded or "
                                  "flapped, by what was done", ["action"], registry=r)
        self.slow = Counter("ptb_agent_slow_gpus", "GPUs found slow, by what was decided",
                            ["action"], registry=r)
        self.latency = Histogram("ptb_agent_latency_seconds", "from a cause to the entry "
                                 "journaled (decision, applied, verified, ...)", ["kind"],
                                 buckets=BUCKETS, registry=r)
        self.rx_power = Gauge("ptb_link_received_power_dbm", "received power of a circuit's "
                              "output, as last verified", ["switch", "port"], registry=r)
        self.entries = Counter("ptb_agent_journal_entries", "journal entries written, by kind",
                               ["kind"], registry=r)
        self._ports: set[tuple[str, str]] = set()
        self._lock = threading.Lock()
        self._process: Any = None        # the agent process read at each scrape (`attach`)
        Gauge("ptb_agent_term", "the agent's term (one above its journal's last)",
              registry=r).set_function(lambda: self._read("term", 0))
        Gauge("ptb_agent_leading", "1 while this agent leads its group (a lone agent: always)",
              registry=r).set_function(lambda: self._read("leading", 0))
        Gauge("ptb_agent_alarms_active", "alarms the agent publishes now",
              registry=r).set_function(lambda: self._read("alarms", 0))

    def on_entry(self, entry: Entry, text: str = "") -> None:
        """A journal entry as written (`Journal.listen`)."""
        d = entry.details
        self.entries.labels(entry.kind).inc()
        if entry.latency_s is not None and entry.latency_s >= 0:
            self.latency.labels(entry.kind).observe(entry.latency_s)
        if isinstance(d, Swap):
            self.failovers.labels("shrunk" if d.degraded else "swapped").inc()
        elif isinstance(d, PhaseSwitched):
            self.phase_switches.labels("yes" if d.ahead else "no").inc()
            for switch, report in d.applied.items():
                self._moved(switch, report.added, report.removed)
        elif isinstance(d, Applied):
            self._moved(d.switch, d.added, d.removed)
        elif isinstance(d, Verified):             # (VerifyFailed is one)
            self.verifications.labels("dark" if isinstance(d, VerifyFailed) else "lit").inc()
            self._powers(d.dbm)
        elif isinstance(d, Alarm):
            self.alarms.inc()
        elif isinstance(d, LinkFade):
            self.link_moves.labels(d.action).inc()
        elif isinstance(d, Slow):
            self.slow.labels(d.action).inc()

    def _moved(self, switch: str, added: list, removed: list) -> None:
        if added:
            self.circuits_moved.labels(switch, "added").inc(len(added))
        if removed:
            self.circuits_moved.labels(switch, "removed").inc(len(removed))

    def _powers(self, dbm: dict[str, float]) -> None:
        with self._lock:
            for point, value in dbm.items():
                switch, _, port = point.rpartition(":")
                key = (switch, port)
                if key not in self._ports:
                    if len(self._ports) >= MAX_LINKS:
                        continue
                    self._ports.add(key)
                self.rx_power.labels(switch, port).set(float(value))

    def attach(self, process: Any) -> None:
        """Wire an agent process (`hil.agent.bus.AgentProcess`): its journal's entries, and its
        term, lead and alarms read at each scrape (a replica that stands by again and is made
        anew is attached again: the counters go on)."""
        process.journal.listen(self.on_entry)
        self._process = process

    def _read(self, what: str, otherwise: float) -> float:
        p = self._process
        if p is None:
            return otherwise
        try:
            if what == "term":
                return float(p.term)
            if what == "leading":
                return float(p.leading())
            return float(len(p.alarms))
        except Exception:        # (a process closing): the scrape goes on without it
            return otherwise

    def serve(self, host: str, port: int) -> tuple[str, int]:
        """The HTTP endpoint Prometheus scrapes (`/metrics`), on a thread; returns where."""
        server, _ = start_http_server(port, addr=host, registry=self.registry)
        where = server.server_address[:2]
        log.info("metrics on http://%s:%d/metrics", *where)
        return str(where[0]), int(where[1])
