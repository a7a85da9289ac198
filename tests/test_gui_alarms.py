"""The cockpit's parts offscreen, from model data: the trends' series, the jobs and their
reports, every alarm shown with the time it began and cleared when fixed (banner pixels),
stale marks, readable event details, CSV and PNG exports, the port maps' scale, GPU names and
tooltips, the demo's label in the window, the start-up check, and `ptb demo`'s GUI."""
from __future__ import annotations

import csv
import os
import time

os.environ["QT_QPA_PLATFORM"] = "offscreen"

import numpy as np  # noqa: E402
import pytest  # noqa: E402
from PySide6.QtCore import QPoint, QPointF, QSettings, Qt  # noqa: E402
from PySide6.QtGui import QColor  # noqa: E402
from PySide6.QtWidgets import QLabel  # noqa: E402

from photonic_testbed.gui.alarms import (  # noqa: E402
    ALARM_BG,
    CLEAR_BG,
    AlarmBanner,
    AlarmBook,
    by_cause,
    job_condition,
)
from photonic_testbed.gui.events import readable  # noqa: E402
from photonic_testbed.gui.jobs import JobsView  # noqa: E402
from photonic_testbed.gui.limits import Limits  # noqa: E402
from photonic_testbed.gui.model import FabricModel, Job, ModelError  # noqa: E402
from photonic_testbed.gui.portmap import ChipView, OcsMatrixView, PowerScale, power_colour  # noqa: E402
from photonic_testbed.gui.series import Ring, SeriesStore  # noqa: E402
from photonic_testbed.gui.stale import StaleFrame  # noqa: E402
from photonic_testbed.gui.startup import install_hint, missing_in, qt_start_problem  # noqa: E402
from photonic_testbed.gui.trends import TrendsView  # noqa: E402
from photonic_testbed.hil.bus.state import Delete, Set  # noqa: E402
from tests.test_gui import (  # noqa: E402
    BENES,
    agent_state,
    assert_not_blank,
    colour_at,
    near,
    pixels,
    show_chip,
    show_ocs,
)

LIMITS = Limits(report_old_s=5.0, failed_s=3.0, stuck_s=15.0, link_dbm=-12.0,
                link_settle_s=1.0)


def job_dict(state="running", t=None, throughput=9.5, loss=None, step=100, detail=""):
    report = None if state is None else {
        "state": state, "step": step, "throughput": throughput, "loss": loss,
        "detail": detail, "t": time.time() if t is None else t}
    return {"plan": "dp", "world": 4, "rank_map": {str(r): f"gpu{r}" for r in range(4)},
            "phase": "dp", "round": 0, "restart": {"seq": 1, "rank_map": {}, "cause": "swap"},
            "report": report}


def rack(spares=2, used=0, failed=()):
    gpus = [{"name": f"gpu{i}", "switch": "ocs1", "port": i + 1, "role": "active",
             "rank": i, "job": "dp", "health": "failed" if f"gpu{i}" in failed else "ok"}
            for i in range(4)]
    gpus += [{"name": f"spare{i}", "switch": "ocs1", "port": 5 + i,
              "role": "in_use_spare" if i < used else "spare", "rank": 4 + i if i < used else None,
              "job": "dp" if i < used else None, "health": "ok"} for i in range(spares)]
    return gpus


# --- series and jobs ------------------------------------------------------------------------
def test_a_series_keeps_its_newest_samples_in_time_order():
    ring = Ring(4)
    for i in range(6):
        ring.append(float(i), float(10 * i))
    t, v = ring.since(0.0)
    assert list(t) == [2, 3, 4, 5] and list(v) == [20, 30, 40, 50]
    assert list(ring.since(4.0)[1]) == [40, 50] and ring.first() == 2.0
    store = SeriesStore(capacity=8)
    assert store.add("rx/gpu0", 1.0, -3.0)
    assert not store.add("rx/gpu0", 0.5, -3.0)            # older than the newest: refused
    assert not store.add("rx/gpu0", 2.0, float("nan"))
    assert not store.add("rx/gpu0", "x", 1.0)
    assert store.last("rx/gpu0") == (1.0, -3.0) and store.names("rx") == ["rx/gpu0"]
    with pytest.raises(ValueError, match="at least 2"):
        Ring(1)


def jobs(model, **by_name) -> None:
    """The agent's published jobs, as a change of its state."""
    model.apply_change("agent", [Set(["jobs"], by_name)])


def test_a_restart_order_is_a_stop_in_the_throughput_trend_whichever_reports_came(qtbot):
    """The agent publishes a job's latest report: on a busy machine its "restarting" report and
    the "running" one after it reach the GUI as one change. The restart order's time is a
    sample of no steps all the same."""
    model = FabricModel()
    model.apply_snapshot("agent", "agent", agent_state())
    t0 = time.time()
    jobs(model, dp=job_dict(t=t0))
    ordered = {"seq": 2, "rank_map": {}, "cause": "job failure: gpu3", "t": t0 + 1.0}
    jobs(model, dp={**job_dict(t=t0 + 2.0, throughput=9.0), "restart": ordered})
    t, v = model.trends.series["throughput/dp"].since(t0)
    assert list(zip(t, v, strict=True)) == [(t0, 9.5), (t0 + 1.0, 0.0), (t0 + 2.0, 9.0)]
    jobs(model, dp={**job_dict(t=t0 + 3.0, throughput=9.0), "restart": ordered})
    assert len(model.trends.series["throughput/dp"]) == 4          # the same order: no stop


def test_jobs_and_their_reports_reach_the_model_and_the_throughput_trend(qtbot):
    model = FabricModel()
    model.apply_snapshot("agent", "agent", agent_state())
    t0 = time.time()
    with qtbot.waitSignal(model.samplesAdded):
        jobs(model, dp=job_dict(t=t0, loss=2.5))
    job = model.jobs["dp"]
    assert (job.report.state, job.report.step, job.rank_map[3], job.restart_seq) == \
        ("running", 100, "gpu3", 1)
    assert model.trends.last("throughput/dp") == (t0, 9.5)
    assert model.trends.last("loss/dp") == (t0, 2.5)
    jobs(model, dp=job_dict(t=t0, loss=2.5))
    assert len(model.trends.series["throughput/dp"]) == 1          # the same report: no sample
    jobs(model, dp=job_dict("failed", t=t0 + 1, throughput=None))
    assert model.trends.last("throughput/dp") == (t0 + 1, 0.0)     # failed: not stepping
    assert model.jobs["dp"].state_since >= job.state_since
    for bad, message in ((job_dict("sleeping"), "sleeping"),
                         ({**job_dict(), "rank_map": {"x": "gpu0"}}, "job 'dp'"),
                         ({**job_dict(), "report": {"state": "running", "loss": "high"}},
                          "loss")):
        with pytest.raises(ModelError, match=message):
            jobs(model, dp=bad)
    jobs(model)
    assert model.jobs == {}


def test_a_job_is_failed_then_stuck_and_silent_jobs_are_stuck():
    now = 1000.0

    def job(state, seen, since):
        base = Job.from_dict("dp", job_dict(state, t=seen), None, seen)
        return Job(**{**base.__dict__, "report_seen": seen, "state_since": since})
    assert job_condition(job("running", now - 1, now - 100), now, LIMITS) is None
    level, what, since = job_condition(job("running", now - 7, now - 100), now, LIMITS)
    assert level == "stuck" and "no report for 7 s" in what and since == now - 7
    assert job_condition(job("failed", now, now - 1), now, LIMITS) is None   # a failover
    assert job_condition(job("failed", now, now - 4), now, LIMITS)[0] == "failed"
    level, what, _ = job_condition(job("restarting", now, now - 20), now, LIMITS)
    assert level == "stuck" and "restarting for 20 s" in what
    assert job_condition(job("stopped", now - 500, now - 500), now, LIMITS) is None
    assert "since it was admitted" in job_condition(job(None, now - 9, now - 9), now,
                                                    LIMITS)[1]


# --- alarms ---------------------------------------------------------------------------------
def test_every_alarm_begins_and_clears_with_its_condition():
    model = FabricModel()
    book = AlarmBook(LIMITS)
    now = time.time()
    model.apply_snapshot("agent", "agent", agent_state(rack=rack()))
    show_ocs(model, ports=8, circuits={1: 10, 2: 11})
    model.set_service("agent", "connected")
    model.set_service("ocs1", "connected")
    jobs(model, dp=job_dict(t=now))
    assert book.evaluate(model, now) == []

    # A service and the agent down: named, with the time they went down; jobs not judged.
    model.set_service("ocs1", "down", "heartbeats lost")
    model.set_service("agent", "down")
    got = {a.key: a for a in book.evaluate(model, now + 60)}
    assert set(got) == {"service:ocs1", "service:agent"}
    assert "ocs1 down (heartbeats lost)" in got["service:ocs1"].text
    assert got["service:ocs1"].since == model.services["ocs1"].since
    assert "stale" in got["service:agent"].text
    model.set_service("agent", "connected")
    model.set_service("ocs1", "connected")
    # ... and once it is back, the silent job is stuck.
    got = {a.key: a for a in book.evaluate(model, now + 60)}
    assert set(got) == {"job:dp"} and "STUCK" in got["job:dp"].text
    jobs(model, dp=job_dict(t=now + 60))
    assert book.evaluate(model, time.time()) == []

    # No spare left: both in use; the agent's own alarm is folded in; a spare back clears.
    model.apply_change("agent", [Set(["rack"], rack(used=2))])
    text = "no healthy spare for gpu3: job continues degraded on 3 ranks"
    model.apply_change("agent", [Set(["events", 0], {"seq": 7, "ts": now - 30,
                                                     "kind": "alarm", "cause": text}),
                                 Set(["alarms"], [text])])
    got = book.evaluate(model, now)
    assert [a.key for a in got] == ["spares"]
    assert "in use: spare0, spare1" in got[0].text and text in got[0].text
    assert got[0].since == now - 30 and not got[0].ackable
    model.apply_change("agent", [Set(["rack"], rack(used=1))])
    assert book.evaluate(model, now) == []         # the agent's old text is answered

    # A link below threshold, judged once the circuit has settled; cleared by light.
    t = time.time()
    model.apply_change("ocs1", [Set(["circuits"], [[1, 10]])])
    assert model.circuits_changed["ocs1"] >= t
    model.add_samples({"rx/gpu1": [[t + 0.1, -30.0]]})
    assert book.evaluate(model, t + 0.2) == []          # too soon after the circuits changed
    model.circuits_changed["ocs1"] = t - 10
    got = book.evaluate(model, t + 0.2)
    assert [a.key for a in got] == ["link:ocs1:10"]
    assert "link gpu0 → gpu1 on ocs1 (1 → 10): -30.0 dBm, below -12 dBm" in got[0].text
    began = got[0].since
    assert book.evaluate(model, t + 1)[0].since == began      # the same alarm, same start
    model.add_samples({"rx/gpu1": [[t + 2, -3.0]]})
    assert book.evaluate(model, t + 2) == []
    model.add_samples({"rx/gpu1": [[t + 3, -30.0]]})
    model.apply_change("agent", [Set(["rack", 0, "health"], "failed")])
    assert book.evaluate(model, t + 3) == []       # its transmitter failed: the GPU's fault
    model.apply_change("agent", [Set(["rack", 0, "health"], "ok")])
    model.add_samples({"rx/gpu1": [[t + 4, -3.0]]})

    # A calibration drifting, where the chip's service says so.
    show_chip(model, name="chip")
    model.apply_change("chip", [Set(["drift"], {"worst_rad": 0.12, "threshold_rad": 0.05,
                                                "t": t})])
    got = book.evaluate(model, t + 4)
    assert [a.key for a in got] == ["drift:chip"] and "0.120 rad > 0.050 rad" in got[0].text
    model.apply_change("chip", [Delete(["drift"])])

    # Any other alarm of the agent: shown until acknowledged, again if raised again.
    model.apply_change("agent", [Set(["alarms"], ["switch chip refused the circuits"])])
    got = book.evaluate(model, t + 4)
    assert [a.key for a in got] == ["agent:switch chip refused the circuits"] and got[0].ackable
    book.acknowledged.add(got[0].key)
    assert book.evaluate(model, t + 4) == []
    model.apply_change("agent", [Set(["alarms"], [])])
    assert book.evaluate(model, t + 4) == []
    model.apply_change("agent", [Set(["alarms"], ["switch chip refused the circuits"])])
    assert len(book.evaluate(model, t + 4)) == 1


def _ring_after_a_stop(job_state: str, agent_said: bool) -> FabricModel:
    """An opus-like rack of 8 servers without spares on a 32-port OCS, job dp on a ring of
    circuits, server5 failed, every receiver reading dark (-60 dBm)."""
    now = time.time()
    model = FabricModel()
    servers = [{"name": f"server{i}", "switch": "ocs", "port": i + 1, "role": "active",
                "rank": i, "job": "dp", "health": "failed" if i == 5 else "ok"}
               for i in range(8)]
    ring = {i + 1: 32 + (i + 1) % 8 + 1 for i in range(8)}
    show_ocs(model, name="ocs", ports=32, circuits=ring)
    model.circuits_changed["ocs"] = now - 30
    report = job_dict(job_state, t=now - 20, throughput=0.0)
    report["rank_map"] = {str(i): f"server{i}" for i in range(8)}
    events: list[dict] = []
    alarms: list[str] = []
    if agent_said:
        text = "no healthy spare for server5 and job 'dp' cannot run on 7 ranks: job stopped"
        events = [{"seq": 9, "ts": now - 20, "kind": "alarm", "cause": text,
                   "details": {"gpus": ["server5"], "job": "dp"}}]
        alarms = [text]
    model.apply_snapshot("agent", "agent", agent_state(rack=servers, events=events,
                                                       jobs={"dp": report}, alarms=alarms))
    model.set_service("agent", "connected")
    model.add_samples({f"rx/server{i}": [[now - 0.5, -60.0]] for i in range(8)})
    return model


def test_links_dark_after_a_stopped_job_follow_their_cause(qtbot, tmp_path):
    # The agent stopped the job for want of a spare: that leads, its six dark links (the ring
    # without the failed server's two) follow it on one line, not as six alarms.
    model = _ring_after_a_stop("stopped", agent_said=True)
    alarms = AlarmBook(LIMITS).evaluate(model)
    links = sorted(a.key for a in alarms if a.key.startswith("link:"))
    assert links == sorted(f"link:ocs:{33 + (i + 1) % 8}" for i in (0, 1, 2, 3, 6, 7))
    groups = by_cause(alarms)
    assert [g.lead.key for g in groups] == ["spares"]
    assert sorted(a.key for a in groups[0].follows) == links
    banner = AlarmBanner(model, AlarmBook(LIMITS))
    qtbot.addWidget(banner)
    banner.resize(1200, 80)
    banner.show()
    lines = banner.label.text().splitlines()
    assert len(lines) == 2, lines
    assert "no spare left" in lines[0] and "job stopped" in lines[0]
    assert "6 links dark on ocs: server0 → server1 -60.0 dBm" in lines[1]
    assert "(2 more)" in lines[1]
    assert_not_blank(pixels(banner, tmp_path / "stopped.png"), min_fraction=0.02)

    # Stopped by a person (no alarm of the agent): the job's stop leads, with its links.
    model = _ring_after_a_stop("stopped", agent_said=False)
    groups = by_cause(AlarmBook(LIMITS).evaluate(model))
    assert [g.lead.key for g in groups] == ["job:dp"]
    assert groups[0].lead.text == ("job dp stopped, its circuits still set: their links are "
                                   "dark")
    assert len(groups[0].follows) == 6
    # Failed: the job's alarm leads, its dark links follow it.
    model = _ring_after_a_stop("failed", agent_said=False)
    groups = by_cause(AlarmBook(LIMITS).evaluate(model))
    assert [g.lead.key for g in groups] == ["job:dp"] and "failed" in groups[0].lead.text
    assert len(groups[0].follows) == 6
    # Running, and still dark: nothing explains them; one alarm for the switch, links under it.
    model = _ring_after_a_stop("running", agent_said=False)
    model.apply_change("agent", [Set(["jobs"], {"dp": {
        **job_dict("running"), "rank_map": {str(i): f"server{i}" for i in range(8)}}})])
    groups = by_cause(AlarmBook(LIMITS).evaluate(model))
    assert [g.lead.key for g in groups] == ["links:ocs"]
    assert groups[0].lead.text == "6 links on ocs read below -12 dBm"
    assert len(groups[0].follows) == 6
    assert groups[0].lines(time.time())[1].strip() == (
        "↳ server0 → server1 -60.0 dBm, server1 → server2 -60.0 dBm, server2 → server3 "
        "-60.0 dBm, server3 → server4 -60.0 dBm, … (2 more)")



def test_the_banner_turns_red_naming_the_alarm_and_green_when_fixed(qtbot, tmp_path):
    model = FabricModel()
    model.set_service("agent", "connected")
    model.apply_snapshot("agent", "agent", agent_state())
    banner = AlarmBanner(model, AlarmBook(LIMITS))
    qtbot.addWidget(banner)
    banner.resize(900, 60)
    banner.show()
    left = QPoint(3, banner.height() // 2)
    assert near(colour_at(pixels(banner, tmp_path / "clear.png"), left), QColor(CLEAR_BG), 12)
    with qtbot.waitSignal(banner.changed):
        model.set_service("agent", "down", "heartbeats lost")
    rgb = pixels(banner, tmp_path / "agent-down.png")
    assert near(colour_at(rgb, QPoint(3, banner.height() // 2)), QColor(ALARM_BG), 12)
    assert "agent down" in banner.label.text() and "since" in banner.label.text()
    white = np.all(rgb > 200, axis=2).sum()
    assert white > 200, "the alarm's text is not drawn"
    assert not banner.ack.isVisible()
    model.apply_change("agent", [Set(["alarms"], ["cannot read switch chip"])])
    qtbot.waitUntil(lambda: banner.ack.isVisible())
    banner.acknowledge()
    assert all(not a.ackable for a in banner.alarms)
    with qtbot.waitSignal(banner.changed):
        model.set_service("agent", "connected")
    assert banner.alarms == [] and banner.label.text().endswith("no alarms")
    assert near(colour_at(pixels(banner, tmp_path / "fixed.png"),
                          QPoint(3, banner.height() // 2)), QColor(CLEAR_BG), 12)


def test_a_stale_view_is_greyed_and_says_since_when(qtbot, tmp_path):
    content = QLabel("live data")
    content.setStyleSheet("background: white; color: black;")
    frame = StaleFrame(content)
    qtbot.addWidget(frame)
    frame.resize(400, 200)
    frame.show()
    centre = QPoint(200, 150)
    assert near(colour_at(pixels(frame, tmp_path / "live.png"), centre), QColor("white"), 5)
    since = time.time() - 12
    frame.set_stale(since, "agent down")
    rgb = pixels(frame, tmp_path / "stale.png")
    grey = colour_at(rgb, centre)
    assert max(grey.getRgb()[:3]) < 200, grey.name()               # greyed over
    assert near(colour_at(rgb, QPoint(200, 14)), QColor("#fdd835"), 30)   # the tag
    assert frame.veil.text == f"STALE since {time.strftime('%H:%M:%S', time.localtime(since))}" \
                              " — agent down"
    frame.set_stale(None)
    assert near(colour_at(pixels(frame, tmp_path / "back.png"), centre), QColor("white"), 5)


# --- views ----------------------------------------------------------------------------------
def test_the_job_view_shows_state_rate_rank_map_and_a_stuck_job(qtbot, tmp_path):
    model = FabricModel()
    model.apply_snapshot("agent", "agent", agent_state(rack=rack(failed=("gpu2",)), jobs={
        "dp": job_dict(loss=2.3125), "old": job_dict("running", t=time.time() - 60)}))
    view = JobsView(model, LIMITS)
    qtbot.addWidget(view)
    view.resize(900, 400)
    view.show()
    row = view.row_of("dp")
    cells = [view.table.item(row, c).text() for c in range(view.table.columnCount())]
    assert cells[:7] == ["dp", "running", "100", "9.5", "2.312", "dp / round 0", "4"]
    stuck = view.row_of("old")
    assert view.table.item(stuck, 1).text() == "STUCK (running)"
    assert "old: no report for" in view.details.text()      # under the table, whole
    assert "STUCK: old" in view.summary.text()
    view.table.selectRow(row)
    assert view.ranks.rowCount() == 4
    assert [view.ranks.item(2, c).text() for c in range(3)] == ["2", "gpu2", "failed"]
    rgb = pixels(view, tmp_path / "jobs.png")
    assert_not_blank(rgb, min_fraction=0.02)
    rect = view.table.visualItemRect(view.table.item(stuck, 1))
    spot = view.table.viewport().mapTo(view, rect.topLeft() + QPoint(3, rect.height() // 2))
    assert near(colour_at(rgb, spot), QColor("#b71c1c"), 25)


def test_event_details_read_as_words_and_export_as_csv(qtbot, tmp_path):
    details = {"swaps": {"gpu3": "spare0"}, "added": [[1, 18], [2, 17]], "latency": 0.1234567,
               "dark": [], "ok": True}
    assert readable(details) == ("swaps: gpu3 → spare0; added: 1 → 18, 2 → 17; "
                                 "latency: 0.1235; dark: none; ok: true")
    model = FabricModel()
    model.apply_snapshot("agent", "agent", agent_state(events=[
        {"seq": 1, "ts": 1.7e9, "kind": "decision", "cause": "gpu3 failed", "latency_s": 0.002,
         "details": details},
        {"seq": 2, "ts": 1.7e9 + 1, "kind": "alarm", "cause": "no healthy spare"}]))
    from photonic_testbed.gui.app import demo_window
    win, fabric = demo_window(settings=QSettings(str(tmp_path / "g.ini"),
                                                 QSettings.Format.IniFormat))
    qtbot.addWidget(win)
    win.model.apply_snapshot("agent", "agent", agent_state(
        events=[dict(e.__dict__) for e in model.entries]))
    view = win.events
    assert view.proxy.index(0, 5).data() == readable(details)
    tip = view.proxy.index(0, 5).data(Qt.ItemDataRole.ToolTipRole)
    assert "swaps: gpu3 → spare0\nadded: 1 → 18, 2 → 17" in tip          # a line each
    path = tmp_path / "events.csv"
    assert win.export_events(str(path)) == 2
    rows = list(csv.DictReader(path.open(encoding="utf-8")))
    assert [r["kind"] for r in rows] == ["decision", "alarm"]
    assert rows[0]["details"] == readable(details) and rows[0]["latency_ms"] == "2.000"
    assert '"swaps": {"gpu3": "spare0"}' in rows[0]["details_json"]
    view.set_kinds({"alarm"})
    assert win.export_events(str(path)) == 1              # what the table shows
    assert win.export_events(str(tmp_path / "no" / "such" / "dir.csv")) is None
    assert "cannot write" in win.statusBar().currentMessage()
    assert win.save_view("trends", str(tmp_path / "trends.png"))
    assert (tmp_path / "trends.png").stat().st_size > 1000
    assert not win.save_view("jobs", str(tmp_path / "no" / "jobs.png"))
    win.close()


def test_the_ocs_map_has_a_dbm_scale_gpu_names_and_tooltips(qtbot, tmp_path):
    model = FabricModel()
    model.apply_snapshot("agent", "agent", agent_state(rack=rack(used=1)))
    show_ocs(model, ports=8, circuits={1: 10, 5: 9}, power={10: -4.25, 1: -2.0})
    view = OcsMatrixView(model, "ocs1")
    qtbot.addWidget(view)
    view.resize(600, 600)
    view.show()
    tip = view.tooltip_at(view.cell_rect(1, 10).center())
    assert "circuit 1 → 10: gpu0 → gpu1" in tip
    assert "in 1: -2.0 dBm" in tip and "out 10: -4.2 dBm" in tip
    assert "job dp (rank 0 → rank 1)" in tip
    assert "no circuit 2 → 12" in view.tooltip_at(view.cell_rect(2, 12).center())
    matrix = view.matrix_rect()
    assert "input 6: transmitter of spare1 (ok, spare, no rank)" in \
        view.tooltip_at(QPointF(matrix.left() - 3, matrix.top() + 5.5 * matrix.height() / 8))
    assert_not_blank(pixels(view, tmp_path / "ocs-names.png"))
    scale = PowerScale()
    qtbot.addWidget(scale)
    scale.resize(500, 30)
    scale.show()
    rgb = pixels(scale, tmp_path / "scale.png")
    x1 = scale.width() - 110
    assert near(colour_at(rgb, QPoint(66, 8)), power_colour(-40.0), 20)
    assert near(colour_at(rgb, QPoint(x1 - 2, 8)), power_colour(0.0), 20)


def test_chip_ports_carry_gpu_names_and_receiver_powers(qtbot, tmp_path):
    model = FabricModel()
    show_chip(model, circuits={1: 18}, topology=BENES)
    model.apply_snapshot("agent", "agent", agent_state(rack=[
        {"name": f"gpu{i}", "switch": "benes16", "port": i + 1, "role": "active", "rank": i,
         "job": "dp", "health": "ok"} for i in range(3)]))
    model.add_samples({"rx/gpu1": [[time.time(), -6.0]]})
    view = ChipView(model, "benes16")
    qtbot.addWidget(view)
    view.resize(1000, 600)
    view.show()
    ports = view._geometry_cache()[3]
    assert "receiver of gpu1" in view.tooltip_at(ports[("port", 18)])
    assert "circuit 1 → 18: gpu0 → gpu1" in view.tooltip_at(ports[("port", 18)])
    assert "gpu1's receiver: -6.0 dBm" in view.tooltip_at(ports[("port", 1)])
    rgb = pixels(view, tmp_path / "chip-names.png")
    mark = view.receiver_mark(18)
    assert near(colour_at(rgb, mark.center()), power_colour(-6.0), 12)
    assert view.receiver_mark(20) is None                 # no GPU on that port
    cell = model.topologies["benes16"].cells[0].id
    assert f"cell {cell}" in view.tooltip_at(view.cell_center(cell))


def test_trends_follow_the_window_and_the_heater_budget(qtbot, tmp_path):
    model = FabricModel()
    now = time.time()
    model.add_samples({"rx/gpu0": [[now - 200 + i, -5.0] for i in range(200)],
                       "heater/chip": [[now - 200 + i, 800.0 + i] for i in range(200)]})
    model.apply_snapshot("agent", "agent", agent_state(jobs={"dp": job_dict(t=now)}))
    view = TrendsView(model, LIMITS)
    qtbot.addWidget(view)
    view.resize(1000, 500)
    view.show()
    view.refresh()
    assert len(view.curve_data("rx/gpu0")[0]) == 200 and view.curve_data("throughput/dp")[1][0] \
        == 9.5
    view.set_window(60.0)
    t, _ = view.curve_data("rx/gpu0")
    assert len(t) <= 61 and t[0] >= now - 61
    assert "budget unknown" not in view.budget_note.text()
    model.set_budget("chip", None, "not in its describe")
    assert "budget unknown — chip: not in its describe" in view.budget_note.text()
    model.set_budget("chip", 1500.0)
    assert view.budget_note.text() == "" and view.budget_lines["chip"].value() == 1500.0
    view.refresh()
    assert view.heaters.getPlotItem().vb.viewRange()[1][1] >= 1500.0
    assert "heaters of chip: 999" in view.nearest("heaters", now - 1, 999.0)
    assert_not_blank(pixels(view, tmp_path / "trends.png"), min_colours=20)
    with pytest.raises(ValueError, match="no time window"):
        view.set_window(7.0)


def test_demo_data_is_labelled_in_the_window_itself(qtbot, tmp_path):
    from photonic_testbed.gui.app import demo_window
    win, fabric = demo_window(settings=QSettings(str(tmp_path / "g.ini"),
                                                 QSettings.Format.IniFormat))
    qtbot.addWidget(win)
    win.show()
    fabric.start()
    fabric.stop()
    qtbot.waitUntil(lambda: "dp" in win.model.jobs)
    rgb = pixels(win, tmp_path / "demo.png")
    banner = win.demo_banner
    assert banner is not None and "DEMO DATA" in banner.text()
    spot = banner.mapTo(win, QPoint(4, banner.height() // 2))
    assert near(colour_at(rgb, spot), QColor("#8e24aa"), 20)
    win.close()


# --- start-up -------------------------------------------------------------------------------
LDD = """\tlinux-vdso.so.1 (0x00007ffd)
\tlibxcb-cursor.so.0 => /lib/x86_64-linux-gnu/libxcb-cursor.so.0 (0x7f)
\tlibxcb-icccm.so.4 => not found
\tlibxcb-keysyms.so.1 => not found
\tlibxcb-icccm.so.4 => not found
\tlibweird.so.9 => not found
"""


def test_the_start_up_check_names_missing_libraries_and_their_packages():
    missing = missing_in(LDD)
    assert missing == ["libxcb-icccm.so.4", "libxcb-keysyms.so.1", "libweird.so.9"]
    hint = install_hint(missing)
    assert "sudo apt-get install libxcb-icccm4 libxcb-keysyms1" in hint
    assert "sudo dnf install xcb-util-wm xcb-util-keysyms" in hint
    assert "libweird.so.9" in hint
    assert qt_start_problem({"QT_QPA_PLATFORM": "offscreen"}) is None
    assert "no display" in qt_start_problem({"PATH": os.environ.get("PATH", "")})
    # A platform Qt does not have: Qt aborts in the child, and the check says so.
    said = qt_start_problem({**os.environ, "QT_QPA_PLATFORM": "nosuchplatform",
                             "DISPLAY": ":99"})
    assert said is not None and "Qt cannot start here" in said and "nosuchplatform" in said


def test_ptb_demo_reports_what_became_of_its_gui(tmp_path, monkeypatch):
    from photonic_testbed.hil import rig as rigfile
    from photonic_testbed.ptb.gui import DemoGui
    from photonic_testbed.ptb.stack import Stack
    path = tmp_path / "rig.toml"
    port = rigfile.free_port
    rigfile.write(path, rigfile.Rig(
        "nothing-up", path, rigfile.BusConfig(curve=False), {"ocs": rigfile.DeviceConfig(
            "ocs", "switch", "TCPIP::127.0.0.1::1::SOCKET",
            "photonic_testbed.drivers.ocs:OpticalCircuitSwitch",
            f"tcp://127.0.0.1:{port()}", f"tcp://127.0.0.1:{port()}")}))
    said: list[str] = []
    stack = Stack(tmp_path)
    try:
        monkeypatch.setenv("QT_QPA_PLATFORM", "offscreen")
        layout = ("--settings", str(tmp_path / "gui.ini"))     # not the user's own layout
        gui = DemoGui(stack, path, said.append, extra=("--quit-after", "30", *layout))
        assert gui.up and said[-1].startswith("GUI open")
        gui.finish()
        assert said[-1].startswith("GUI still open")
        gui.proc.terminate()
        gui.proc.wait(20)
        gui.finish()
        assert said[-1].startswith("GUI closed during the demo")
        # Kept open: the demo waits until the window closes (here: by itself).
        kept = DemoGui(stack, path, said.append, extra=("--quit-after", "1", *layout))
        assert kept.up
        kept.finish(keep_open=True)
        assert "kept open" in said[-2] and said[-1] == "GUI closed (exit 0)"
        monkeypatch.setenv("QT_QPA_PLATFORM", "nosuchplatform")
        monkeypatch.setenv("DISPLAY", ":99")
        dead = DemoGui(stack, path, said.append, extra=layout)
        assert not dead.up
        assert "GUI did not start (exit 1)" in said[-1] and "Qt cannot start here" in said[-1]
    finally:
        stack.close()
