"""The GUI's picture of the fabric: Qt objects fed by the bus's own state and changes.

A bus adapter (gui/bus.py; the demo's synthetic fabric, gui/demo.py) gives the model each
device's state in the bus's vocabulary (hil.bus.state): a snapshot (`post_snapshot(device,
kind, state)`), then its changes (`post_change(device, ops)`, `Set`/`Delete` operations, as the
device published them). The model keeps its own copy of each state, applies the changes to it,
and works out what the views show from the parts a change touched:

    kind `switch` (an OCS)  `ports`, `circuits` ([[input, output], ...])  -> a switch "ocs"
    kind `chip`             the same -> a switch "chip"; `cells` -> its cell states; `drift`
    kind `agent`            `rack` -> the GPUs; `events` -> the journal (kept past the agent's
                            last 200); `jobs` -> the jobs and their reports; `alarms`
                            (docs/agent-bus.md)

Other kinds' states are kept, not shown. What is not a device's state has its own entry point:
`post_service` (a service's connection, for the status bar), `post_samples` (the trends:
`{series: [[t, value], ...]}`, gui/series.py), `post_power` (a switch's port powers, from its
telemetry), `post_topology` (a chip's, from its `describe`), `post_budget` (a device's heater
power budget). Every `post_*` may be called from any thread: it only queues the call, which
the Qt main thread makes (`apply_*`/`set_*`, callable there directly) and announces with
signals; a call that does not fit is announced by `rejected`. Nothing here waits on the
network.
"""
from __future__ import annotations

import collections
import logging
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import msgspec
from PySide6.QtCore import QObject, Qt, Signal, Slot

from photonic_testbed.common.topology import Topology, TopologyError
from photonic_testbed.gui.series import SeriesStore
from photonic_testbed.hil.agent.entries import Details, Unread, decode
from photonic_testbed.hil.agent.journal import KINDS as JOURNAL_KINDS
from photonic_testbed.hil.agent.journal import Entry
from photonic_testbed.hil.bus.mirror import clone
from photonic_testbed.hil.bus.state import Set, StateError, StateOp, apply, touched

log = logging.getLogger(__name__)

HEALTH = ("ok", "degraded", "failed")
ROLES = ("active", "spare", "in_use_spare")
SERVICE_STATES = ("connected", "connecting", "down")
# What a job says of itself (`job_report`), and "admitted" until it first does.
JOB_STATES = ("running", "waiting", "failed", "restarting", "stopped", "done", "admitted")
MAX_ENTRIES = 5000          # the events view keeps the newest; the journal keeps everything
AGENT = "agent"             # the agent's kind (a device service's is the rig's kind)
SHOWN_SWITCHES = {"switch": "ocs", "chip": "chip"}     # device kind -> the switch shown


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
    kind: str                   # "ocs" or "chip"
    ports: int
    circuits: dict[int, int] = field(default_factory=dict)
    power_dbm: dict[int, float] = field(default_factory=dict)

    @classmethod
    def from_state(cls, name: str, kind: str, state: Mapping[str, Any],
                   old: SwitchState | None = None) -> SwitchState:
        """A switch from its service's state (`ports`, `circuits` as [[input, output], ...]);
        the port powers kept from `old`."""
        try:
            ports = int(state["ports"])
        except KeyError:
            raise ModelError(f"switch {name!r}: its state gives no 'ports'") from None
        except (TypeError, ValueError):
            raise ModelError(f"switch {name!r}: ports {state['ports']!r} is not a number") \
                from None
        if ports < 1:
            raise ModelError(f"switch {name!r}: ports must be >= 1, not {ports}")
        circuits: dict[int, int] = {}
        for pair in state.get("circuits") or ():
            if not isinstance(pair, (list, tuple)) or len(pair) != 2:
                raise ModelError(f"switch {name!r}: a circuit is [input, output], not {pair!r}")
            try:
                a, b = int(pair[0]), int(pair[1])
            except (TypeError, ValueError):
                raise ModelError(f"switch {name!r}: circuit {pair!r} is not two ports") \
                    from None
            if not (1 <= a <= ports < b <= 2 * ports):
                raise ModelError(f"switch {name!r}: circuit {a}->{b} is not input 1..{ports} "
                                 f"to output {ports + 1}..{2 * ports}")
            circuits[a] = b
        return cls(name, kind, ports, circuits, dict(old.power_dbm) if old else {})


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
    def from_dict(cls, d: Mapping[str, Any], old: Gpu | None = None) -> Gpu:
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
    def from_dict(cls, d: Any, what: str) -> JobReport:
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
    restart_t: float | None       # when the agent gave its last restart order (Unix time)
    report: JobReport
    report_seen: float            # when the newest report reached the GUI
    state_since: float            # since when the report's state holds

    @classmethod
    def from_dict(cls, name: str, d: Any, old: Job | None, now: float) -> Job:
        what = f"job {name!r}"
        if not isinstance(d, Mapping):
            raise ModelError(f"{what} is a dict, not {d!r}")
        try:
            rank_map = {int(r): str(g) for r, g in (d.get("rank_map") or {}).items()}
            world = int(d.get("world", len(rank_map)))
            rnd = int(d.get("round") or 0)
            restart = d.get("restart") or {}
            seq = int(restart.get("seq", 0))
            ordered = restart.get("t")
            ordered = None if ordered is None else float(ordered)
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
                   str(restart.get("cause", "")), ordered, report, seen, since)


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
    rackChanged = Signal(object)               # set of changed GPU names
    entriesAdded = Signal(object)              # list[Entry]
    entriesReset = Signal()
    serviceChanged = Signal(str)               # service name
    jobsChanged = Signal()
    alarmsChanged = Signal()                   # the agent's alarms
    samplesAdded = Signal(object)              # set of series names (gui/series.py)
    budgetChanged = Signal(str)                # device
    driftChanged = Signal(str)                 # chip
    rejected = Signal(str)                     # a call that could not be applied, and why
    _inbox = Signal(object)

    def __init__(self, parent: QObject | None = None):
        super().__init__(parent)
        self.states: dict[str, dict[str, Any]] = {}   # device -> its state, as published
        self.kinds: dict[str, str] = {}               # device -> its kind
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
        self.seq = 0                       # state snapshots and changes applied so far
        self._last_event = -1              # the newest journal entry taken in
        self._inbox.connect(self._receive, Qt.ConnectionType.QueuedConnection)

    # --- thread-safe entry points (any thread) -------------------------------------------
    def post_snapshot(self, device: str, kind: str, state: Mapping[str, Any]) -> None:
        """A device's whole state (handed over: the caller keeps no reference)."""
        self._inbox.emit((self.apply_snapshot, (device, kind, state)))

    def post_change(self, device: str, ops: Sequence[StateOp]) -> None:
        """A change of a device's state, as it published it (the values are copied)."""
        self._inbox.emit((self.apply_change, (device, ops)))

    def post_service(self, name: str, state: str, detail: str = "") -> None:
        self._inbox.emit((self.set_service, (name, state, detail)))

    def post_samples(self, samples: Mapping[str, Any]) -> None:
        self._inbox.emit((self.add_samples, (samples,)))

    def post_power(self, switch: str, power_dbm: Mapping[Any, float]) -> None:
        self._inbox.emit((self.set_power, (switch, power_dbm)))

    def post_topology(self, chip: str, topology: Mapping[str, Any]) -> None:
        self._inbox.emit((self.set_topology, (chip, topology)))

    def post_budget(self, device: str, mw: float | None, why: str = "") -> None:
        self._inbox.emit((self.set_budget, (device, mw, why)))

    @Slot(object)
    def _receive(self, call: tuple[Callable[..., None], tuple]) -> None:
        method, args = call
        try:
            method(*args)
        except (ModelError, TopologyError) as e:
            self._reject(method, args, str(e))
        except (TypeError, ValueError, KeyError, AttributeError) as e:
            # (a state of a shape the model does not check field by field)
            self._reject(method, args, f"not understood: {type(e).__name__}: {e}")

    def _reject(self, method: Callable[..., None], args: tuple, why: str) -> None:
        what = f"{method.__name__} of {args[0]}" if args else method.__name__
        log.warning("ignored %s: %s", what, why)
        self.rejected.emit(f"{what}: {why}")

    # --- device states (main thread) ------------------------------------------------------
    def apply_snapshot(self, device: str, kind: str, state: Mapping[str, Any]) -> None:
        """A device's whole state: everything shown of it worked out again."""
        if not isinstance(state, Mapping):
            raise ModelError(f"the state of {device!r} is a dict, not {type(state).__name__}")
        self.kinds[device] = kind
        self.states[device] = clone(dict(state))
        self.seq += 1
        self._show(device, None, snapshot=True)

    def apply_change(self, device: str, ops: Sequence[StateOp]) -> None:
        """A change of a device's state: applied to the model's copy, and what it touched
        shown. A change that does not fit the state (a path that is not there) is refused;
        what is shown stays as it was until a change that can be shown comes."""
        state = self.states.get(device)
        if state is None:
            raise ModelError(f"a change of {device!r} before its state")
        try:
            apply(state, [Set(op.path, clone(op.value)) if type(op) is Set else op
                          for op in ops])
        except StateError as e:
            raise ModelError(f"{device}: {e}") from None
        self.seq += 1
        self._show(device, ops, snapshot=False)

    def _show(self, device: str, ops: Sequence[StateOp] | None, *, snapshot: bool) -> None:
        kind, state = self.kinds[device], self.states[device]
        keys = None if ops is None else touched(ops)

        def changed(*names: str) -> bool:
            return keys is None or any(n in keys for n in names)
        if kind in SHOWN_SWITCHES:
            if changed("circuits", "ports"):
                self._show_switch(device, SHOWN_SWITCHES[kind], state)
            if kind == "chip" and changed("cells"):
                self._show_cells(device, state.get("cells") or {})
            if kind == "chip" and changed("drift"):
                self._show_drift(device, state.get("drift"))
        elif kind == AGENT:
            if changed("rack"):
                self._show_rack(state.get("rack") or [])
            if changed("events"):
                self._show_events(state.get("events") or [], snapshot)
            if changed("jobs"):
                self._show_jobs(state.get("jobs") or {})
            if changed("alarms"):
                self._show_alarms(state.get("alarms") or [])

    def _show_switch(self, name: str, kind: str, state: Mapping[str, Any]) -> None:
        old = self.switches.get(name)
        new = SwitchState.from_state(name, kind, state, old)
        self.switches[name] = new
        if old is None:
            self.switchesChanged.emit()
            return
        change = SwitchChange.between(old, new)
        if change.added or change.removed:
            self.circuits_changed[name] = time.time()
        self.switchChanged.emit(name, change, self.seq)

    def _show_cells(self, chip: str, value: Any) -> None:
        if not isinstance(value, Mapping):
            raise ModelError(f"cell states of {chip!r} must be a dict, not {value!r}")
        old = self.cells.get(chip, {})
        cells = {}
        for cid, s in value.items():
            if not isinstance(s, Mapping):
                raise ModelError(f"cell {cid!r} of {chip!r}: a state is a dict, not {s!r}")
            cells[str(cid)] = dict(s)
        changed = {cid for cid, s in cells.items()
                   if s.get("state") != old.get(cid, {}).get("state")}
        self.cells[chip] = cells
        self.cellsChanged.emit(chip, changed, self.seq)

    def _show_drift(self, chip: str, value: Any) -> None:
        """A drift check the chip's service publishes (docs/gui.md)."""
        if value is None:
            self.drift.pop(chip, None)
        else:
            if not isinstance(value, Mapping):
                raise ModelError(f"a drift report is a dict, not {value!r}")
            what = f"drift of {chip!r}"
            worst, limit = _number(value, "worst_rad", what), _number(value, "threshold_rad",
                                                                     what)
            if worst is None or limit is None:
                raise ModelError(f"{what} needs worst_rad and threshold_rad")
            self.drift[chip] = {"worst_rad": worst, "threshold_rad": limit,
                                "t": _number(value, "t", what) or time.time()}
        self.driftChanged.emit(chip)

    def _show_rack(self, value: Any) -> None:
        if not isinstance(value, list):
            raise ModelError(f"a rack is a list of GPUs, not {value!r}")
        rack = {}
        for d in value:
            gpu = Gpu.from_dict(d)
            rack[gpu.name] = gpu
        changed = {n for n, g in rack.items() if self.rack.get(n) != g} | \
            {n for n in self.rack if n not in rack}
        self.rack = rack
        if changed:
            self.rackChanged.emit(changed)

    def _show_events(self, value: Any, snapshot: bool) -> None:
        """New journal entries (by their seq) are added to those shown; a snapshot whose newest
        entry is older than one already shown is a new journal (the agent started afresh):
        shown from its beginning."""
        if not isinstance(value, list):
            raise ModelError(f"the agent's events are a list, not {value!r}")
        entries = [to_entry(e) for e in value]
        newest = max((e.seq for e in entries), default=-1)
        if snapshot and entries and newest < self._last_event:
            self.entries.clear()
            self.entries.extend(entries)
            self._last_event = newest
            self.entriesReset.emit()
            return
        new = [e for e in entries if e.seq > self._last_event]
        self._last_event = max(self._last_event, newest)
        if new:
            self.entries.extend(new)
            self.entriesAdded.emit(new)

    def _show_jobs(self, value: Any) -> None:
        if not isinstance(value, Mapping):
            raise ModelError(f"jobs are a dict by name, not {value!r}")
        now = time.time()
        jobs = {str(n): Job.from_dict(str(n), d, self.jobs.get(str(n)), now)
                for n, d in value.items()}
        added = set()
        for job in jobs.values():
            old = self.jobs.get(job.name)
            r = job.report
            if old is not None and job.restart_seq > old.restart_seq and \
                    job.restart_t is not None and \
                    self.trends.add(f"throughput/{job.name}", job.restart_t, 0.0):
                # a restart ordered: the job stood still then, whichever of its reports came
                # through (the agent publishes its latest; a busy machine merges them)
                added.add(f"throughput/{job.name}")
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

    def _show_alarms(self, value: Any) -> None:
        if not isinstance(value, list):
            raise ModelError(f"alarms are a list of texts, not {value!r}")
        self.agent_alarms = [str(a) for a in value]
        self.alarmsChanged.emit()

    # --- what is not a device's state (main thread) ---------------------------------------
    def set_service(self, name: str, state: str, detail: str = "") -> None:
        """A service's connection: one of SERVICE_STATES, and what it means."""
        if state not in SERVICE_STATES:
            raise ModelError(f"service {name!r}: state must be one of "
                             f"{', '.join(SERVICE_STATES)}, not {state!r}")
        old = self.services.get(name)
        since = old.since if old and old.state == state else time.time()
        self.services[name] = Service(name, state, str(detail), since)
        self.serviceChanged.emit(name)

    def add_samples(self, value: Any) -> None:
        """{series: [[t, value], ...]} appended to the trends (older samples refused)."""
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

    def set_power(self, switch: str, power_dbm: Mapping[Any, float]) -> None:
        """Port powers of a switch, dBm, from its own monitors (merged into those known)."""
        old = self.switches.get(switch)
        if old is None:
            raise ModelError(f"port powers of {switch!r} before its state")
        power = {**old.power_dbm, **_int_map(power_dbm, f"switch {switch!r} power_dbm",
                                              float)}
        new = replace(old, power_dbm=power)
        self.switches[switch] = new
        self.switchChanged.emit(switch, SwitchChange.between(old, new), self.seq)

    def set_topology(self, chip: str, topology: Mapping[str, Any]) -> None:
        self.topologies[chip] = Topology.from_dict(topology)
        self.topologyChanged.emit(chip)

    def set_budget(self, device: str, mw: float | None, why: str = "") -> None:
        """A device's heater power budget, mW, or None and why it is not known."""
        self.budgets[device] = (_number({"mw": mw}, "mw", f"budget of {device!r}"), str(why))
        self.budgetChanged.emit(device)

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
    def between(cls, old: SwitchState, new: SwitchState) -> SwitchChange:
        added = {a: b for a, b in new.circuits.items() if old.circuits.get(a) != b}
        removed = {a: b for a, b in old.circuits.items() if new.circuits.get(a) != b}
        power = frozenset(p for p, v in new.power_dbm.items() if old.power_dbm.get(p) != v)
        return cls(added, removed, power)
