"""Alarms: what is wrong now, worked out from the model, and the banner that names it.

`AlarmBook.evaluate(model)` lists the conditions a person must see, each with the time it
began; a condition that is fixed is simply no longer listed:

- a service or the agent down (heartbeats lost, or never heard);
- a job failed for longer than a failover takes, or stuck: failed / restarting too long, or
  silent (no report) while it should be running;
- no spare left: every spare of the rack in use or failed (the agent's "no healthy spare"
  alarms are folded in);
- a link below threshold: a circuit between two GPUs whose receiver reads less than the
  agent's verification threshold, once the circuit has settled;
- a calibration drifting, where the chip's service publishes a drift check (`drift`);
- any other alarm the agent raised. The agent keeps those until it restarts and never says
  they are over: the operator acknowledges them.

Alarms are grouped by cause so that the root cause leads (`by_cause`): each alarm may name the
alarm it follows from (`Alarm.cause`). Links that are dark because their job failed, stopped or
lost its GPUs follow that job's alarm (a job stopped with its circuits still set is one when
it has dark links); a job stopped or stuck because no spare was left follows the spares alarm
that names it; an agent alarm about a switch whose service is down follows that service. Dark
links with no such cause are one alarm per switch when there are several.
"""
from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from PySide6.QtCore import Qt, QTimer, Signal
from PySide6.QtWidgets import QFrame, QHBoxLayout, QLabel, QPushButton, QWidget

from photonic_testbed.gui.limits import Limits
from photonic_testbed.gui.model import FabricModel, Job
from photonic_testbed.hil.agent.journal import Entry

__all__ = ["Alarm", "AlarmBanner", "AlarmBook", "AlarmGroup", "Limits", "by_cause",
           "job_condition"]

ALARM_BG, CLEAR_BG = "#b71c1c", "#1b5e20"
MAX_LINES = 5              # lines of the banner; the rest are in its tooltip
MAX_NAMED = 4              # links named on a line that sums them up
RX_FRESH_S = 10.0          # older receiver readings are not judged (their source is down)
OVER = ("stopped", "done")     # a job in these states runs no more
LINKS = "links:"               # the key of a switch's dark links together: links:SWITCH


@dataclass(frozen=True)
class Alarm:
    key: str                       # stable identity: "service:ocs", "job:dp", "spares", ...
    text: str
    since: float                   # Unix time it began
    ackable: bool = False          # only the operator can say it is over
    cause: str = ""                # key of the alarm this one follows from ("": its own cause)
    switch: str = ""               # a dark link's switch (its lines are summed up per switch)
    link: str = ""                 # a dark link in a few words: "gpu0 → gpu1 -30.0 dBm"


@dataclass(frozen=True)
class AlarmGroup:
    """A root cause and the alarms that follow from it."""
    lead: Alarm
    follows: tuple[Alarm, ...] = ()

    def lines(self, now: float) -> list[str]:
        """The group as the banner shows it: the lead, then what follows from it, the dark
        links summed up per switch."""
        out = [f"⚠  {self.lead.text}   — since {clock(self.lead.since)} "
               f"({duration(now - self.lead.since)})"]
        links: dict[str, list[Alarm]] = {}
        for a in self.follows:
            if a.link:
                links.setdefault(a.switch, []).append(a)
            else:
                out.append(f"      ↳ {a.text}")
        for switch, dark in links.items():
            # Under the switch's own alarm its links are named only; elsewhere also counted.
            counted = "" if self.lead.key == LINKS + switch else switch
            out.append(f"      ↳ {dark_links(dark, counted)}")
        return out


def dark_links(links: list[Alarm], switch: str = "") -> str:
    """Several dark links on one line (counted, when `switch` is given)."""
    named = ", ".join(a.link for a in links[:MAX_NAMED])
    more = f", … ({len(links) - MAX_NAMED} more)" if len(links) > MAX_NAMED else ""
    if not switch:
        return named + more
    return f"{len(links)} link{'s' if len(links) > 1 else ''} dark on {switch}: {named}{more}"


def by_cause(alarms: list[Alarm]) -> list[AlarmGroup]:
    """The alarms as root causes (in the order given) with what follows from each; an alarm
    whose cause is not among `alarms` (acknowledged, or over) is a root itself."""
    keys = {a.key: a for a in alarms}

    def root(a: Alarm) -> Alarm:
        seen = {a.key}
        while a.cause in keys and a.cause not in seen:
            seen.add(a.cause)
            a = keys[a.cause]
        return a
    follows: dict[str, list[Alarm]] = {}
    leads: list[Alarm] = []
    for a in alarms:
        r = root(a)
        if r is a:
            leads.append(a)
        else:
            follows.setdefault(r.key, []).append(a)
    return [AlarmGroup(a, tuple(follows.get(a.key, ()))) for a in leads]


def clock(t: float) -> str:
    return time.strftime("%H:%M:%S", time.localtime(t))


def duration(s: float) -> str:
    s = max(0.0, s)
    if s < 60:
        return f"{s:.0f} s"
    if s < 3600:
        return f"{int(s // 60)} min {int(s % 60)} s"
    return f"{int(s // 3600)} h {int(s % 3600 // 60)} min"


def job_condition(job: Job, now: float, limits: Limits) -> tuple[str, str, float] | None:
    """(level, what, since) of a job that is not well: level "stuck" or "failed"; None when
    it is fine (running and reporting, or stopped / done)."""
    r = job.report
    if r.state in ("failed", "restarting"):
        held = now - job.state_since
        detail = f": {r.detail}" if r.detail else ""
        if held >= limits.stuck_s:
            return "stuck", f"{r.state} for {duration(held)}{detail}", job.state_since
        if held >= limits.failed_s:
            return "failed", f"{r.state} for {duration(held)}{detail}", job.state_since
        return None
    if r.state in OVER:
        return None
    silent = now - job.report_seen
    if silent >= limits.report_old_s:
        what = ("no report since it was admitted" if r.state in (None, "admitted")
                else f"no report for {duration(silent)} (last: {r.state}, step {r.step})")
        return "stuck", what, job.report_seen
    return None


Raise = Callable[..., None]


@dataclass
class AlarmBook:
    """Works out the alarms; remembers when each computed condition began."""
    limits: Limits = field(default_factory=Limits)
    acknowledged: set[str] = field(default_factory=set)
    _began: dict[str, float] = field(default_factory=dict)

    def evaluate(self, model: FabricModel, now: float | None = None) -> list[Alarm]:
        now = time.time() if now is None else now
        found: list[Alarm] = []

        def raised(key: str, text: str, since: float | None = None, ackable: bool = False,
                   **more: str) -> None:
            began = self._began.setdefault(key, now) if since is None else since
            found.append(Alarm(key, text, began, ackable, **more))

        agent = model.services.get("agent")
        for name, s in model.services.items():
            if s.state != "down":
                continue
            if name == "agent":
                raised("service:agent", "agent down — the rack, jobs and events shown are "
                       f"stale ({s.detail or 'heartbeats lost'})", s.since)
            else:
                raised(f"service:{name}", f"{name} down ({s.detail or 'heartbeats lost'})",
                       s.since)
        texts = list(model.agent_alarms)
        spare_texts = [a for a in texts if "no healthy spare" in a]
        drift_texts = [a for a in texts if "drift" in a.lower()]
        other = [a for a in texts if a not in spare_texts and a not in drift_texts]
        said = _alarm_entries(model, texts) if texts else {}
        # The agent's alarm that names a job is that job's cause (a stop for want of a spare).
        named: dict[str, str] = {}
        for text in texts:
            job = getattr(said[text].details, "job", None) if text in said else None
            if isinstance(job, str):
                named[job] = "spares" if text in spare_texts else f"agent:{text}"
        agent_up = agent is None or agent.state != "down"
        if agent_up:
            # With the agent down the jobs' state is stale: that alarm says so.
            for job in model.jobs.values():
                cond = job_condition(job, now, self.limits)
                if cond is not None:
                    level, what, since = cond
                    word = "STUCK" if level == "stuck" else "failed"
                    raised(f"job:{job.name}", f"job {job.name} {word}: {what}", since,
                           cause=named.get(job.name, ""))
        self._spares(model, spare_texts, said, raised)
        shown = {a.key for a in found} | {f"agent:{t}" for t in drift_texts + other[-MAX_LINES:]}
        self._links(model, now, raised, shown, named)
        for chip, d in model.drift.items():
            if d["worst_rad"] > d["threshold_rad"]:
                raised(f"drift:{chip}", f"calibration of {chip} drifting: phase error "
                       f"{d['worst_rad']:.3f} rad > {d['threshold_rad']:.3f} rad — recalibrate",
                       d.get("t"))
        for text in drift_texts:
            raised(f"agent:{text}", f"calibration drifting: {text}", _ts(said, text), True)
        down = {a.key for a in found if a.key.startswith("service:")}
        for text in other[-MAX_LINES:]:
            switch = getattr(said[text].details, "switch", None) if text in said else None
            raised(f"agent:{text}", f"agent: {text}", _ts(said, text), True,
                   cause=f"service:{switch}" if f"service:{switch}" in down else "")
        keys = {a.key for a in found}
        for key in [k for k in self._began if k not in keys]:
            del self._began[key]
        self.acknowledged &= keys           # a condition that comes back is shown again
        return [a for a in found if a.key not in self.acknowledged]

    def _spares(self, model: FabricModel, texts: list[str], said: Mapping[str, Entry],
                raised: Raise) -> None:
        roles = {g.role for g in model.rack.values()}
        has_spares = bool(roles & {"spare", "in_use_spare"})
        if has_spares and model.spares():
            return          # a healthy spare is free: the agent's old texts are answered
        if not has_spares and not texts:
            return          # a rack built without spares, and nothing failed for want of one
        used = sorted(g.name for g in model.rack.values() if g.role == "in_use_spare")
        failed = sorted(g.name for g in model.rack.values()
                        if g.role == "spare" and g.health == "failed")
        parts = []
        if used:
            parts.append("in use: " + ", ".join(used))
        if failed:
            parts.append("failed: " + ", ".join(failed))
        text = "no spare left" + (f" ({'; '.join(parts)})" if parts else "")
        if texts:
            text += f" — agent: {texts[-1]}"
        raised("spares", text, _ts(said, texts[-1]) if texts else None,
               ackable=not has_spares)

    def _links(self, model: FabricModel, now: float, raised: Raise, shown: set[str],
               named: Mapping[str, str]) -> None:
        """Circuits between two healthy GPUs whose receiver reads dark, each under what
        explains it: its job's alarm, the agent's alarm that stopped its job, or its job
        stopped with the circuit still set; the rest per switch."""
        limit = self.limits.link_dbm
        holders: dict[str, set[str]] = {}         # GPU -> the jobs whose rank map holds it
        for job in model.jobs.values():
            for gpu in job.rank_map.values():
                holders.setdefault(gpu, set()).add(job.name)
        dark: list[tuple[str, str, str, str, float]] = []   # key, text, switch, link, since
        causes: dict[str, str] = {}
        for name, state in model.switches.items():
            settled = model.circuits_changed.get(name, 0.0) + self.limits.link_settle_s
            for a, b in state.circuits.items():
                src, dst = model.gpu_at(name, a), model.gpu_at(name, b)
                if src is None or dst is None or "failed" in (src.health, dst.health):
                    continue        # a failed GPU's light is its own fault, shown as such
                reading = model.rx_dbm(dst.name)
                if reading is None:
                    continue
                t, dbm = reading
                if t < settled or now - t > RX_FRESH_S or dbm >= limit:
                    continue
                key = f"link:{name}:{b}"
                dark.append((key, f"link {src.name} → {dst.name} on {name} ({a} → {b}): "
                                  f"{dbm:.1f} dBm, below {limit:g} dBm", name,
                             f"{src.name} → {dst.name} {dbm:.1f} dBm", t))
                jobs = sorted({j for g in (src, dst) for j in holders.get(g.name, ())}
                              | {g.job for g in (src, dst) if g.job})
                causes[key] = self._link_cause(model, jobs, shown, named, raised)
        # Dark links with no cause of their own: one alarm per switch when there are several.
        loose: dict[str, int] = {}
        for key, _, switch, _, _ in dark:
            if not causes[key]:
                loose[switch] = loose.get(switch, 0) + 1
        for switch, n in loose.items():
            if n > 1:
                raised(LINKS + switch, f"{n} links on {switch} read below {limit:g} dBm")
        for key, text, switch, link, _ in dark:
            cause = causes[key] or (LINKS + switch if loose.get(switch, 0) > 1 else "")
            raised(key, text, cause=cause, switch=switch, link=link)

    def _link_cause(self, model: FabricModel, jobs: list[str], shown: set[str],
                    named: Mapping[str, str], raised: Raise) -> str:
        """The key of what explains a dark link of `jobs` ("" for nothing known), among the
        alarms `shown`; a job that runs no more is raised as the cause when nothing else
        names it."""
        for job in jobs:
            if f"job:{job}" in shown:
                return f"job:{job}"
            if named.get(job, "") in shown:
                return named[job]
        for job in jobs:
            j = model.jobs.get(job)
            state = j.report.state if j is not None else None
            if j is None or state in OVER:
                key = f"job:{job}"
                if key not in shown:
                    shown.add(key)
                    what = f"{state}" if j is not None else "released"
                    raised(key, f"job {job} {what}, its circuits still set: their links are "
                           "dark", j.state_since if j is not None else None)
                return key
        return ""


def _alarm_entries(model: FabricModel, texts: list[str]) -> dict[str, Entry]:
    """The journal entry of each of the agent's alarms (the newest of the same text)."""
    want, out = set(texts), {}
    for e in model.entries:
        if e.kind == "alarm" and e.cause in want:
            out[e.cause] = e
    return out


def _ts(said: Mapping[str, Entry], text: str) -> float | None:
    e = said.get(text)
    return e.ts if e is not None else None


class AlarmBanner(QFrame):
    """A band across the window: red with one line per alarm and the time it began, green
    when nothing is wrong. Ackable alarms (the agent's own) get an Acknowledge button."""

    changed = Signal(object)            # list[Alarm], when what is shown changes

    def __init__(self, model: FabricModel, book: AlarmBook | None = None,
                 parent: QWidget | None = None, period_ms: int = 500):
        super().__init__(parent)
        self.setObjectName("alarm-banner")
        self.model = model
        self.book = book or AlarmBook()
        self.alarms: list[Alarm] = []
        self.groups: list[AlarmGroup] = []       # the alarms by root cause, as shown
        self.label = QLabel()
        self.label.setObjectName("alarm-text")
        self.label.setTextFormat(Qt.TextFormat.PlainText)
        self.label.setWordWrap(True)
        font = self.label.font()
        font.setPointSizeF(font.pointSizeF() * 1.15)
        font.setBold(True)
        self.label.setFont(font)
        self.ack = QPushButton("Acknowledge")
        self.ack.setToolTip("hide the agent's alarms shown now (they come back if raised again)")
        self.ack.clicked.connect(self.acknowledge)
        box = QHBoxLayout(self)
        box.setContentsMargins(10, 4, 10, 4)
        box.addWidget(self.label, 1)
        box.addWidget(self.ack)
        self._shown: tuple = ()
        self._soon = QTimer(self)           # many model signals at once: one evaluation
        self._soon.setSingleShot(True)
        self._soon.timeout.connect(self.refresh)
        for signal in (model.serviceChanged, model.jobsChanged, model.alarmsChanged,
                       model.rackChanged, model.driftChanged, model.switchesChanged):
            signal.connect(self.schedule)
        self.timer = QTimer(self)           # durations and silent jobs move with the clock
        self.timer.timeout.connect(self.refresh)
        self.timer.start(period_ms)
        self.refresh()

    def schedule(self, *_args) -> None:
        if not self._soon.isActive():
            self._soon.start(0)

    def acknowledge(self) -> None:
        self.book.acknowledged |= {a.key for a in self.alarms if a.ackable}
        self.refresh()

    def refresh(self) -> None:
        now = time.time()
        alarms = self.book.evaluate(self.model, now)
        self.groups = by_cause(alarms)
        if alarms:
            # Whole groups while they fit: a root cause is never shown without what follows.
            lines: list[str] = []
            for i, group in enumerate(self.groups):
                more = group.lines(now)
                if lines and len(lines) + len(more) > MAX_LINES:
                    left = len(self.groups) - i
                    lines.append(f"… and {left} more cause{'s' if left > 1 else ''} "
                                 "(tooltip)")
                    break
                lines += more
            text, bg = "\n".join(lines), ALARM_BG
        else:
            text, bg = "✓  no alarms", CLEAR_BG
        shown = (text, bg, any(a.ackable for a in alarms))
        if shown != self._shown:
            self._shown = shown
            self.label.setText(text)
            self.setStyleSheet(f"#alarm-banner {{ background: {bg}; }} "
                               f"#alarm-text {{ color: white; }}")
            self.setToolTip("\n".join(
                f"{g.lead.text} (since {clock(g.lead.since)})"
                + "".join(f"\n    ↳ {a.text}" for a in g.follows) for g in self.groups))
            self.ack.setVisible(shown[2])
        keys = [(a.key, a.text) for a in alarms]
        if keys != [(a.key, a.text) for a in self.alarms]:
            self.alarms = alarms
            self.changed.emit(alarms)
        else:
            self.alarms = alarms
