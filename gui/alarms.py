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
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

from PySide6.QtCore import Qt, QTimer, Signal
from PySide6.QtWidgets import QFrame, QHBoxLayout, QLabel, QPushButton, QWidget

from photonic_testbed.gui.limits import Limits
from photonic_testbed.gui.model import FabricModel, Job

__all__ = ["Alarm", "AlarmBanner", "AlarmBook", "Limits", "job_condition"]

ALARM_BG, CLEAR_BG = "#b71c1c", "#1b5e20"
MAX_LINES = 5
RX_FRESH_S = 10.0          # older receiver readings are not judged (their source is down)


@dataclass(frozen=True)
class Alarm:
    key: str                       # stable identity: "service:ocs", "job:dp", "spares", ...
    text: str
    since: float                   # Unix time it began
    ackable: bool = False          # only the operator can say it is over


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
    if r.state in ("stopped", "done"):
        return None
    silent = now - job.report_seen
    if silent >= limits.report_old_s:
        what = ("no report since it was admitted" if r.state in (None, "admitted")
                else f"no report for {duration(silent)} (last: {r.state}, step {r.step})")
        return "stuck", what, job.report_seen
    return None


@dataclass
class AlarmBook:
    """Works out the alarms; remembers when each computed condition began."""
    limits: Limits = field(default_factory=Limits)
    acknowledged: set[str] = field(default_factory=set)
    _began: dict[str, float] = field(default_factory=dict)

    def evaluate(self, model: FabricModel, now: float | None = None) -> list[Alarm]:
        now = time.time() if now is None else now
        found: list[Alarm] = []

        def raised(key: str, text: str, since: float | None = None, ackable: bool = False):
            began = self._began.setdefault(key, now) if since is None else since
            found.append(Alarm(key, text, began, ackable))

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
        agent_up = agent is None or agent.state != "down"
        if agent_up:
            # With the agent down the jobs' state is stale: that alarm says so.
            for job in model.jobs.values():
                cond = job_condition(job, now, self.limits)
                if cond is not None:
                    level, what, since = cond
                    word = "STUCK" if level == "stuck" else "failed"
                    raised(f"job:{job.name}", f"job {job.name} {word}: {what}", since)
        texts = list(model.agent_alarms)
        spare_texts = [a for a in texts if "no healthy spare" in a]
        drift_texts = [a for a in texts if "drift" in a.lower()]
        other = [a for a in texts if a not in spare_texts and a not in drift_texts]
        when = _alarm_times(model, texts) if texts else {}
        self._spares(model, spare_texts, when, raised)
        self._links(model, now, raised)
        for chip, d in model.drift.items():
            if d["worst_rad"] > d["threshold_rad"]:
                raised(f"drift:{chip}", f"calibration of {chip} drifting: phase error "
                       f"{d['worst_rad']:.3f} rad > {d['threshold_rad']:.3f} rad — recalibrate",
                       d.get("t"))
        for text in drift_texts:
            raised(f"agent:{text}", f"calibration drifting: {text}", when.get(text), True)
        for text in other[-MAX_LINES:]:
            raised(f"agent:{text}", f"agent: {text}", when.get(text), True)
        keys = {a.key for a in found}
        for key in [k for k in self._began if k not in keys]:
            del self._began[key]
        self.acknowledged &= keys           # a condition that comes back is shown again
        return [a for a in found if a.key not in self.acknowledged]

    def _spares(self, model: FabricModel, texts: list[str], when: dict, raised) -> None:
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
        raised("spares", text, when.get(texts[-1]) if texts else None,
               ackable=not has_spares)

    def _links(self, model: FabricModel, now: float, raised) -> None:
        limit = self.limits.link_dbm
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
                raised(f"link:{name}:{b}", f"link {src.name} → {dst.name} on {name} "
                       f"({a} → {b}): {dbm:.1f} dBm, below {limit:g} dBm")


def _alarm_times(model: FabricModel, texts: list[str]) -> dict[str, float]:
    """When the agent raised each alarm: its journal entry (newest of the same text)."""
    want, out = set(texts), {}
    for e in model.entries:
        if e.kind == "alarm" and e.cause in want:
            out[e.cause] = e.ts
    return out


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
        if alarms:
            lines = [f"⚠  {a.text}   — since {clock(a.since)} ({duration(now - a.since)})"
                     for a in alarms[:MAX_LINES]]
            if len(alarms) > MAX_LINES:
                lines.append(f"… and {len(alarms) - MAX_LINES} more (tooltip)")
            text, bg = "\n".join(lines), ALARM_BG
        else:
            text, bg = "✓  no alarms", CLEAR_BG
        shown = (text, bg, any(a.ackable for a in alarms))
        if shown != self._shown:
            self._shown = shown
            self.label.setText(text)
            self.setStyleSheet(f"#alarm-banner {{ background: {bg}; }} "
                               f"#alarm-text {{ color: white; }}")
            self.setToolTip("\n".join(f"{a.text} (since {clock(a.since)})" for a in alarms))
            self.ack.setVisible(shown[2])
        keys = [(a.key, a.text) for a in alarms]
        if keys != [(a.key, a.text) for a in self.alarms]:
            self.alarms = alarms
            self.changed.emit(alarms)
        else:
            self.alarms = alarms
