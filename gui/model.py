"""The GUI's picture of the fabric: Qt objects fed by plain dict snapshots and deltas.

The bus adapter (a client of the bus's state mirror) calls `FabricModel.post_snapshot` and
`post_delta` from its own background thread; both only queue the message, which the Qt main
thread applies and announces with signals. Nothing here waits on the network.

Messages (what an adapter translates the bus's mirror into):

    snapshot = {"seq": n,
                "switches": [switch state, ...],
                "topologies": {chip: topology}, "cells": {chip: {cell: cell state}},
                "rack": [gpu, ...], "journal": [entry, ...],
                "services": {service: {"state": ..., "detail": ...}},
                "jobs": {job: job dict}, "alarms": [text, ...]}            (every key optional)
    delta    = {"seq": n, "op": OP, "name": ..., "value": ...} with OP one of
        "switch"    value = switch state (whole or partial: circuits replace, power_dbm merges)
        "topology"  name = chip, value = topology
        "cells"     name = chip, value = {cell: cell state} (merged)
        "rack"      value = [gpu, ...] (replaces the rack)
        "gpu"       value = gpu dict (merged by name)
        "journal"   value = [entry, ...] (appended)
        "journal_reset"  value = [entry, ...] (replaces the journal: a new one started)
        "service"   name = service, value = {"state": ..., "detail": ...}
        "jobs"      value = {job: job dict} (replaces every job; docs/agent-bus.md `jobs`)
        "alarms"    value = [text, ...] (the agent's alarms, replaced)
        "samples"   value = {series: [[t, value], ...]} (appended to the trends, gui/series.py)
        "budget"    name = device, value = {"mw": heater power budget or None, "why": text}
        "drift"     name = chip, value = {"worst_rad", "threshold_rad", "t"} or None

A switch state is {"name", "kind": "ocs"|"chip", "ports": N, "circuits": {in: out},
"power_dbm": {port: dBm}}; a gpu {"name", "port", "switch", "health", "role", "rank", "job"}; a
journal entry a `hil.agent.journal.Entry` or a dict with its fields. A delta whose `seq` is not the
one after the last is still applied, and `gap` is emitted so the adapter can ask for a fresh
snapshot.
"""
from __future__ import annotations

import collections
import logging
import math
import time
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import msgspec
from photonic_testbed.common.topology import Topology, TopologyError
from photonic_testbed.gui.series import SeriesStore
from photonic_testbed.hil.agent.entries import Details, Unread, decode
from photonic_testbed.hil.agent.journal import KINDS as JOURNAL_KINDS
from photonic_testbed.hil.agent.journal import Entry
from PySide6.QtCore import QObject, Qt, Signal, Slot

log = logging.getLogger(__name__)

HEALTH = ("ok", "degraded", "failed")
ROLES = ("active", "spare", "in_use_spare")
SERVICE_STATES = ("connected", "connecting", "down")
# What a job says of itself (`job_report`), and "admitted" until it first does.
JOB_STATES = ("running", "waiting", "failed", "restarting", "stopped", "done", "admitted")
MAX_ENTRIES = 5000          # the events view keeps the newest; the journal keeps everything


class ModelError(ValueError):
    """A snapshot or delta that does not have the documented shape; says which field."""


def _int_map(value: Any, what: str, conv=int) -> dict:
    if not isinstance(value, Mapping):
        raise ModelError(f"{what} must be a dict, not {type(value).__name__}")
    try:
        return {int(k): conv(v) for k, v in value.items()}
    except (TypeError, ValueError) as e:
        raise ModelError(f"{what} has a non-numeric entry: {e}") from None


@dataclass(frozen=True)
class SwitchState:
    name: str
    kind: str
    ports: int
    circuits: dict[int, int] = field(default_factory=dict)
    power_dbm: dict[int, float] = field(default_factory=dict)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], old: "SwitchState | None" = None) -> "SwitchState":
        if not isinstance(d, Mapping) or "name" not in d:
            raise ModelError(f"a switch state is a dict with a 'name', not {d!r}")
        name = str(d["name"])
        if old is None:
            for key in ("kind", "ports"):
                if key not in d:
                    raise ModelError(f"switch {name!r}: the first state must give {key!r}")
        kind = str(d.get("kind", old.kind if old else ""))
        if kind not in ("ocs", "chip"):
            raise ModelError(f"switch {name!r}: kind {kind!r} is not 'ocs' or 'chip'")
        try:
            ports = int(d.get("ports", old.ports if old else 0))
        except (TypeError, ValueError):
            raise ModelError(f"switch {name!r}: ports {d.get('ports')!r} is not a number") from None
        if ports < 1:
            raise ModelError(f"switch {name!r}: ports must be >= 1, not {ports}")
        circuits = (_int_map(d["circuits"], f"switch {name!r} circuits") if "circuits" in d
                    else dict(old.circuits) if old else {})
        for a, b in circuits.items():
            if not (1 <= a <= ports < b <= 2 * ports):
                raise ModelError(f"switch {name!r}: circuit {a}->{b} is not input 1..{ports} "
                                 f"to output {ports + 1}..{2 * ports}")
        power = dict(old.power_dbm) if old else {}
        if "power_dbm" in d:
            power.update(_int_map(d["power_dbm"], f"switch {name!r} power_dbm", float))
        return cls(name, kind, ports, circuits, power)


@dataclass(frozen=True)
class Gpu:
    name: str
    port: int | None
    switch: str
    health: str
    role: str
    rank: int | None
    job: str | None = None        # the job holding it (docs/agent-bus.md `rack[].job`)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], old: "Gpu | None" = None) -> "Gpu":
        if not isinstance(d, Mapping) or "name" not in d:
            raise ModelError(f"a GPU is a dict with a 'name', not {d!r}")
        base = old or cls(str(d["name"]), None, "", "ok", "active", None)
        try:
            gpu = replace(base, **{k: d[k] for k in ("port", "switch", "health", "role", "rank",
                                                     "job") if k in d})
            gpu = replace(gpu, port=None if gpu.port is None else int(gpu.port),
                          rank=None if gpu.rank is None else int(gpu.rank),
                          switch=str(gpu.switch),
                          job=None if gpu.job is None else str(gpu.job))
        except (TypeError, ValueError) as e:
            raise ModelError(f"GPU {base.name!r}: {e}") from None
        if gpu.health not in HEALTH:
            raise ModelError(f"GPU {gpu.name!r}: health {gpu.health!r} is not one of "
                             f"{', '.join(HEALTH)}")
        if gpu.role not in ROLES:
            raise ModelError(f"GPU {gpu.name!r}: role {gpu.role!r} is not one of "
                             f"{', '.join(ROLES)}")
        return gpu


def _number(d: Mapping[str, Any], key: str, what: str) -> float | None:
    v = d.get(key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise ModelError(f"{what}: {key} {v!r} is not a finite number")
    return float(v)


@dataclass(frozen=True)
class JobReport:
    """What a job last said of itself; `state` None when it has not reported yet."""
    state: str | None = None
    step: int = 0
    throughput: float | None = None      # steps a second
    loss: float | None = None
    detail: str = ""
    t: float | None = None               # when the agent received it (Unix time)

    @classmethod
    def from_dict(cls, d: Any, what: str) -> "JobReport":
        if not d:
            return cls()
        if not isinstance(d, Mapping):
            raise ModelError(f"{what}: a report is a dict, not {d!r}")
        state = d.get("state")
        if state not in JOB_STATES:
            raise ModelError(f"{what}: report state {state!r} is not one of "
                             f"{', '.join(JOB_STATES)}")
        try:
            step = int(d.get("step") or 0)
        except (TypeError, ValueError):
            raise ModelError(f"{what}: step {d.get('step')!r} is not a number") from None
        return cls(str(state), step, _number(d, "throughput", what), _number(d, "loss", what),
                   str(d.get("detail") or ""), _number(d, "t", what))


@dataclass(frozen=True)
class Job:
    """A job as the agent publishes it (docs/agent-bus.md `jobs`), with when the GUI saw its
    report arrive and its state begin (this machine's clock, Unix time)."""
    name: str
    plan: str
    world: int
    rank_map: dict[int, str]
    phase: str | None
    round: int
    restart_seq: int
    restart_cause: str
    report: JobReport
    report_seen: float            # when the newest report reached the GUI
    state_since: float            # since when the report's state holds

    @classmethod
    def from_dict(cls, name: str, d: Any, old: "Job | None", now: float) -> "Job":
        what = f"job {name!r}"
        if not isinstance(d, Mapping):
            raise ModelError(f"{what} is a dict, not {d!r}")
        try:
            rank_map = {int(r): str(g) for r, g in (d.get("rank_map") or {}).items()}
            world = int(d.get("world", len(rank_map)))
            rnd = int(d.get("round") or 0)
            restart = d.get("restart") or {}
            seq = int(restart.get("seq", 0))
        except (TypeError, ValueError, AttributeError) as e:
            raise ModelError(f"{what}: {e}") from None
        report = JobReport.from_dict(d.get("report"), what)
        if old is not None and old.report.t == report.t and old.report.state == report.state:
            seen = old.report_seen
        elif old is None and report.t is not None:
            # First sight: a report that came before the GUI started is that old already.
            seen = min(now, report.t)
        else:
            seen = now
        since = old.state_since if old is not None and old.report.state == report.state \
            else seen
        phase = d.get("phase")
        return cls(name, str(d.get("plan", name)), world, rank_map,
                   None if phase is None else str(phase), rnd, seq,
                   str(restart.get("cause", "")), report, seen, since)


def to_entry(e: Entry | Mapping[str, Any]) -> Entry:
    """A journal entry as published (`hil.agent.bus`: its details whole, or `brief`: lists
    given as their size), its details in the type of its kind; details that do not read as
    one (shortened, or of a kind this GUI does not know) are kept as they came (`Unread`)."""
    if isinstance(e, Entry):
        return e
    if not isinstance(e, Mapping):
        raise ModelError(f"a journal entry is a dict or Entry, not {type(e).__name__}")
    try:
        lat = e.get("latency_s")
        seq, ts, kind = int(e["seq"]), float(e["ts"]), str(e["kind"])
        cause, latency = str(e.get("cause", "")), None if lat is None else float(lat)
    except (KeyError, TypeError, ValueError) as err:
        raise ModelError(f"journal entry {e!r} is malformed: {err!r}") from None
    details = e.get("details") or {}
    if isinstance(details, Details):
        return Entry(seq, ts, kind, cause, latency, details)
    if not isinstance(details, Mapping):
        raise ModelError(f"journal entry {seq}'s details are a dict, not {details!r}")
    if kind not in JOURNAL_KINDS:
        log.warning("journal entry %d has an unknown kind %r", seq, kind)
    if e.get("brief") or kind not in JOURNAL_KINDS:
        return Entry(seq, ts, kind, cause, latency, Unread(fields=dict(details)))
    try:
        typed = decode(kind, details)
    except msgspec.ValidationError as err:
        log.warning("journal entry %d's details do not read as a %r entry (%s): shown as "
                    "they came", seq, kind, err)
        typed = Unread(fields=dict(details))
    return Entry(seq, ts, kind, cause, latency, typed)


@dataclass(frozen=True)
class Service:
    name: str
    state: str
    detail: str = ""
    since: float = 0.0


class FabricModel(QObject):
    """Switches, chip topologies and cell states, the rack, the journal and the services."""

    switchesChanged = Signal()                 # a switch appeared or went
    switchChanged = Signal(str, object, int)   # name, SwitchChange, seq
    topologyChanged = Signal(str)              # chip name
    cellsChanged = Signal(str, object, int)    # chip name, set of changed cell ids, seq
    rackChanged = Signal(object)               # set of changed GPU names (all on replace)
    entriesAdded = Signal(object)              # list[Entry]
    entriesReset = Signal()
    serviceChanged = Signal(str)               # service name
    jobsChanged = Signal()
    alarmsChanged = Signal()                   # the agent's alarms
    samplesAdded = Signal(object)              # set of series names (gui/series.py)
    budgetChanged = Signal(str)                # device
    driftChanged = Signal(str)                 # chip
    gap = Signal(int, int)                     # expected seq, received seq
    rejected = Signal(str)                     # a message that could not be applied, and why
    _inbox = Signal(str, object)

    def __init__(self, parent: QObject | None = None):
        super().__init__(parent)
        self.switches: dict[str, SwitchState] = {}
        self.topologies: dict[str, Topology] = {}
        self.cells: dict[str, dict[str, dict[str, Any]]] = {}
        self.rack: dict[str, Gpu] = {}
        self.entries: collections.deque[Entry] = collections.deque(maxlen=MAX_ENTRIES)
        self.services: dict[str, Service] = {}
        self.jobs: dict[str, Job] = {}
        self.agent_alarms: list[str] = []
        self.trends = SeriesStore()
        self.budgets: dict[str, tuple[float | None, str]] = {}   # device -> (mW, why not)
        self.drift: dict[str, dict[str, float]] = {}
        self.circuits_changed: dict[str, float] = {}              # switch -> Unix time
        self.seq = 0
        self._inbox.connect(self._receive, Qt.ConnectionType.QueuedConnection)

    # --- thread-safe entry points (any thread) -------------------------------------------
    def post_snapshot(self, snapshot: Mapping[str, Any]) -> None:
        self._inbox.emit("snapshot", snapshot)

    def post_delta(self, delta: Mapping[str, Any]) -> None:
        self._inbox.emit("delta", delta)

    @Slot(str, object)
    def _receive(self, what: str, message: Mapping[str, Any]) -> None:
        try:
            if what == "snapshot":
                self.apply_snapshot(message)
            else:
                self.apply_delta(message)
        except (ModelError, TopologyError) as e:
            log.warning("ignored a %s: %s", what, e)
            self.rejected.emit(f"{what}: {e}")

    # --- main-thread application ----------------------------------------------------------
    def apply_snapshot(self, snap: Mapping[str, Any]) -> None:
        if not isinstance(snap, Mapping):
            raise ModelError(f"a snapshot is a dict, not {type(snap).__name__}")
        self.seq = int(snap.get("seq", 0))
        switches = snap.get("switches", [])
        if isinstance(switches, Mapping):
            switches = list(switches.values())
        new = {}
        for d in switches:
            state = SwitchState.from_dict(d)
            new[state.name] = state
        topologies = {str(k): Topology.from_dict(v) for k, v in snap.get("topologies", {}).items()}
        self.switches = new
        self.topologies = topologies
        self.cells = {str(k): {str(c): dict(s) for c, s in v.items()}
                      for k, v in snap.get("cells", {}).items()}
        self.rack = {}
        for d in snap.get("rack", []):
            gpu = Gpu.from_dict(d)
            self.rack[gpu.name] = gpu
        self.entries.clear()
        self.entries.extend(to_entry(e) for e in snap.get("journal", []))
        for name, s in snap.get("services", {}).items():
            self._set_service(str(name), s, emit=False)
        if "jobs" in snap:
            self._set_jobs(snap["jobs"])
        if "alarms" in snap:
            self.apply_delta({"op": "alarms", "value": snap["alarms"]})
        self.switchesChanged.emit()
        for name in self.topologies:
            self.topologyChanged.emit(name)
        self.rackChanged.emit(set(self.rack))
        self.entriesReset.emit()
        for name in self.services:
            self.serviceChanged.emit(name)

    def apply_delta(self, delta: Mapping[str, Any]) -> None:
        if not isinstance(delta, Mapping) or "op" not in delta:
            raise ModelError(f"a delta is a dict with an 'op', not {delta!r}")
        if "seq" in delta:
            seq = int(delta["seq"])
            if seq != self.seq + 1:
                self.gap.emit(self.seq + 1, seq)
            self.seq = seq
        op, value = delta["op"], delta.get("value")
        name = str(delta.get("name", ""))
        if op == "switch":
            self._update_switch(value)
        elif op == "topology":
            self.topologies[name] = Topology.from_dict(value)
            self.topologyChanged.emit(name)
        elif op == "cells":
            self._update_cells(name, value)
        elif op == "rack":
            if not isinstance(value, list):
                raise ModelError(f"a rack is a list of GPUs, not {value!r}")
            gpus = [Gpu.from_dict(d) for d in value]
            self.rack = {g.name: g for g in gpus}
            self.rackChanged.emit(set(self.rack))
        elif op == "gpu":
            old = self.rack.get(str(value.get("name"))) if isinstance(value, Mapping) else None
            gpu = Gpu.from_dict(value, old)
            self.rack[gpu.name] = gpu
            self.rackChanged.emit({gpu.name})
        elif op == "journal":
            entries = [to_entry(e) for e in (value or [])]
            self.entries.extend(entries)
            self.entriesAdded.emit(entries)
        elif op == "journal_reset":
            entries = [to_entry(e) for e in (value or [])]
            self.entries.clear()
            self.entries.extend(entries)
            self.entriesReset.emit()
        elif op == "service":
            self._set_service(name, value)
        elif op == "jobs":
            self._set_jobs(value)
        elif op == "alarms":
            if not isinstance(value, list):
                raise ModelError(f"alarms are a list of texts, not {value!r}")
            self.agent_alarms = [str(a) for a in value]
            self.alarmsChanged.emit()
        elif op == "samples":
            self._add_samples(value)
        elif op == "budget":
            if not isinstance(value, Mapping):
                raise ModelError(f"a budget is {{'mw', 'why'}}, not {value!r}")
            mw = _number(value, "mw", f"budget of {name!r}")
            self.budgets[name] = (mw, str(value.get("why", "")))
            self.budgetChanged.emit(name)
        elif op == "drift":
            if value is None:
                self.drift.pop(name, None)
            else:
                if not isinstance(value, Mapping):
                    raise ModelError(f"a drift report is a dict, not {value!r}")
                what = f"drift of {name!r}"
                worst, limit = _number(value, "worst_rad", what), _number(value, "threshold_rad",
                                                                         what)
                if worst is None or limit is None:
                    raise ModelError(f"{what} needs worst_rad and threshold_rad")
                self.drift[name] = {"worst_rad": worst, "threshold_rad": limit,
                                    "t": _number(value, "t", what) or time.time()}
            self.driftChanged.emit(name)
        else:
            raise ModelError(f"unknown delta op {op!r}")

    def _update_switch(self, value: Any) -> None:
        if not isinstance(value, Mapping) or "name" not in value:
            raise ModelError(f"a switch delta is a switch state with a 'name', not {value!r}")
        old = self.switches.get(str(value["name"]))
        state = SwitchState.from_dict(value, old)
        self.switches[state.name] = state
        if old is None:
            self.switchesChanged.emit()
            return
        change = SwitchChange.between(old, state)
        if change.added or change.removed:
            self.circuits_changed[state.name] = time.time()
        self.switchChanged.emit(state.name, change, self.seq)

    def _update_cells(self, chip: str, value: Any) -> None:
        if not isinstance(value, Mapping):
            raise ModelError(f"cell states of {chip!r} must be a dict, not {value!r}")
        cells = self.cells.setdefault(chip, {})
        changed = set()
        for cid, s in value.items():
            if not isinstance(s, Mapping):
                raise ModelError(f"cell {cid!r} of {chip!r}: a state is a dict, not {s!r}")
            cid = str(cid)
            old = cells.get(cid, {})
            new = {**old, **s}
            if new.get("state") != old.get("state"):
                changed.add(cid)
            cells[cid] = new
        self.cellsChanged.emit(chip, changed, self.seq)

    def _set_jobs(self, value: Any) -> None:
        if not isinstance(value, Mapping):
            raise ModelError(f"jobs are a dict by name, not {value!r}")
        now = time.time()
        jobs = {str(n): Job.from_dict(str(n), d, self.jobs.get(str(n)), now)
                for n, d in value.items()}
        added = set()
        for job in jobs.values():
            old = self.jobs.get(job.name)
            r = job.report
            if r.t is None or (old is not None and old.report.t == r.t):
                continue
            # A report is a sample of the job's throughput and loss trends, at its own time.
            if r.throughput is not None and self.trends.add(f"throughput/{job.name}", r.t,
                                                            r.throughput):
                added.add(f"throughput/{job.name}")
            elif r.throughput is None and r.state in ("failed", "restarting", "waiting") and \
                    self.trends.add(f"throughput/{job.name}", r.t, 0.0):
                added.add(f"throughput/{job.name}")     # not stepping: none
            if r.loss is not None and self.trends.add(f"loss/{job.name}", r.t, r.loss):
                added.add(f"loss/{job.name}")
        self.jobs = jobs
        self.jobsChanged.emit()
        if added:
            self.samplesAdded.emit(added)

    def _add_samples(self, value: Any) -> None:
        if not isinstance(value, Mapping):
            raise ModelError(f"samples are {{series: [[t, value], ...]}}, not {value!r}")
        added = set()
        for series, points in value.items():
            if not isinstance(points, (list, tuple)):
                raise ModelError(f"samples of {series!r} are a list of [t, value]")
            for p in points:
                if isinstance(p, (list, tuple)) and len(p) == 2 and \
                        self.trends.add(str(series), p[0], p[1]):
                    added.add(str(series))
        if added:
            self.samplesAdded.emit(added)

    def _set_service(self, name: str, value: Any, emit: bool = True) -> None:
        if not isinstance(value, Mapping) or value.get("state") not in SERVICE_STATES:
            raise ModelError(f"service {name!r}: state must be one of "
                             f"{', '.join(SERVICE_STATES)}, got {value!r}")
        old = self.services.get(name)
        since = old.since if old and old.state == value["state"] else time.time()
        self.services[name] = Service(name, value["state"], str(value.get("detail", "")), since)
        if emit:
            self.serviceChanged.emit(name)

    # --- questions the views ask ----------------------------------------------------------
    def chips(self) -> list[str]:
        return [n for n, s in self.switches.items() if s.kind == "chip"]

    def spares(self) -> list[Gpu]:
        return [g for g in self.rack.values() if g.role == "spare" and g.health != "failed"]

    def gpu_at(self, switch: str, port: int) -> Gpu | None:
        """The GPU whose transmitter (input `port`) or receiver (output N + its port) is on
        this port of `switch`."""
        state = self.switches.get(switch)
        if state is not None and port > state.ports:
            port -= state.ports
        return next((g for g in self.rack.values() if g.switch == switch and g.port == port),
                    None)

    def rx_dbm(self, gpu: str) -> tuple[float, float] | None:
        """(time, dBm) of the newest reading of `gpu`'s receiver, if any."""
        return self.trends.last(f"rx/{gpu}")


@dataclass(frozen=True)
class SwitchChange:
    """Circuits added and removed by one update, and ports whose power changed."""
    added: dict[int, int]
    removed: dict[int, int]
    power: frozenset[int]

    @classmethod
    def between(cls, old: SwitchState, new: SwitchState) -> "SwitchChange":
        added = {a: b for a, b in new.circuits.items() if old.circuits.get(a) != b}
        removed = {a: b for a, b in old.circuits.items() if new.circuits.get(a) != b}
        power = frozenset(p for p, v in new.power_dbm.items() if old.power_dbm.get(p) != v)
        return cls(added, removed, power)
