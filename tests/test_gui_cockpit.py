"""The operator's cockpit on a live emulated rig, offscreen: the lumion rig (ideal chip) with
its rack, the chip, power meter and laser services on threads, the OCS service and `ptb agent`
as processes, the emulated training job (dp-tp) reporting itself through its fabric client,
and the window opened from the rig file. Each view opens with live data; a failover's dip and
recovery show in the throughput trend; each alarm is provoked (a service process killed, the
agent killed, a GPU failed with no spare left, the job stalled waiting for a restart that
never comes) and checked from the screenshot's pixels and the widgets' state, shown and
cleared when fixed."""
from __future__ import annotations

import os
import time

os.environ["QT_QPA_PLATFORM"] = "offscreen"

import numpy as np  # noqa: E402
import pytest  # noqa: E402
from PySide6.QtCore import QPoint, QSettings  # noqa: E402
from PySide6.QtGui import QColor  # noqa: E402

from photonic_testbed.gui.alarms import ALARM_BG, CLEAR_BG  # noqa: E402
from photonic_testbed.gui.app import rig_window  # noqa: E402
from photonic_testbed.gui.limits import Limits  # noqa: E402
from photonic_testbed.gui.trends import COLOURS  # noqa: E402
from photonic_testbed.hil.bus.client import ServiceClient  # noqa: E402
from photonic_testbed.hil.devices.service import DeviceService  # noqa: E402
from photonic_testbed.emulator.control import request  # noqa: E402
from tests.test_agent_bus import _agent, _ptb, _rig_on_bus, _serve, _stop  # noqa: E402
from tests.test_gui import assert_not_blank, colour_at, near, pixels  # noqa: E402

WAIT_MS = 30000
# Short limits so that a stalled job shows as stuck within seconds here.
LIMITS = Limits(report_old_s=3.0, failed_s=1.0, stuck_s=4.0)
JOB = "dp-tp"


def _ocs_process(path):
    """The OCS's service as a process of its own (`ptb serve`), to be killed."""
    return _ptb("serve", "--rig", str(path), "--device", "ocs", "--one-process")


def _bound(service: DeviceService) -> DeviceService:
    service.bind()
    return service


@pytest.fixture(scope="module")
def rig(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("cockpit")
    with _rig_on_bus(tmp, "lumion", "chip", ideal_chip=True) as (emu, rig_, path):
        closers = [_serve(_bound(DeviceService(spec)))
                   for spec in rig_.service_specs(["powermeter", "laser"])]
        procs = {"ocs": _ocs_process(path), "agent": _agent(path, tmp / "journal.db")}
        try:
            got = emu.rack.start_job(JOB, 1_000_000, restart_s=0.2)
            assert sorted(got["rank_map"]) == [str(r) for r in range(8)]
            yield emu, rig_, path, tmp, procs
        finally:
            emu.rack._stop_job()
            for name, p in procs.items():
                (tmp / f"{name}.log").write_text(_stop(p) or "")
            for close in closers:
                close()


@pytest.fixture(scope="module")
def window(rig, tmp_path_factory, qapp):
    emu, rig_, path, tmp, procs = rig
    settings = QSettings(str(tmp / "gui.ini"), QSettings.Format.IniFormat)
    win, fabric = rig_window(rig_, settings, limits=LIMITS, down_after_s=1.0,
                             rx_period_s=0.5)
    win.resize(1600, 1000)
    fabric.start()
    win.show()
    yield win
    win.close()
    fabric.close()


def until(qtbot, cond, timeout=WAIT_MS):
    qtbot.waitUntil(cond, timeout=timeout)


def alarm_keys(win) -> set[str]:
    return {a.key for a in win.alarms.alarms}


def banner_colour(win, rgb) -> QColor:
    """The banner's background, a few pixels in from its left edge (no text there)."""
    spot = win.alarms.mapTo(win, QPoint(4, win.alarms.height() // 2))
    return colour_at(rgb, spot)


def veiled(win, frame, rgb) -> bool:
    """The stale veil is drawn over `frame`: its tag (yellow) sits at the top middle."""
    spot = frame.mapTo(win, QPoint(frame.width() // 2, 14))
    return near(colour_at(rgb, spot), QColor("#fdd835"), 30)


def job(win):
    return win.model.jobs.get(JOB)


def running(win, since: float = 0.0) -> bool:
    j = job(win)
    return j is not None and j.report.state == "running" and (j.report.t or 0) > since


def test_each_view_opens_on_the_live_rig(qtbot, window, rig, tmp_path):
    win = window
    emu, rig_, path, tmp, procs = rig
    until(qtbot, lambda: running(win) and win.model.jobs[JOB].report.throughput)
    ring = [g for g in win.model.jobs[JOB].rank_map.values()]
    until(qtbot, lambda: all(len(win.model.trends.series.get(f"rx/{g}", ())) >= 2
                             for g in ring))
    until(qtbot, lambda: len(win.model.trends.series.get("heater/chip", ())) >= 2)
    until(qtbot, lambda: len(win.model.trends.series.get(f"throughput/{JOB}", ())) >= 3)
    until(qtbot, lambda: {"chip", "ocs"} <= set(win.portmap.views) and
          "chip" in win.model.topologies)
    until(qtbot, lambda: not win.alarms.alarms)
    win.trends.refresh()
    rgb = pixels(win, tmp_path / "cockpit.png")
    assert near(banner_colour(win, rgb), QColor(CLEAR_BG), 20)
    assert win.alarms.label.text().endswith("no alarms")
    # The job view: the job, its state and rate, its rank map with each GPU's health.
    row = win.jobs.row_of(JOB)
    assert win.jobs.table.item(row, 1).text() == "running"
    assert float(win.jobs.table.item(row, 3).text()) > 0
    assert win.jobs.ranks.rowCount() == 8
    assert_not_blank(pixels(win.jobs, tmp_path / "jobs.png"), min_fraction=0.02)
    # The trends: a line per ring link above the threshold, the heaters, the throughput.
    t, v = win.trends.curve_data(f"rx/{ring[0]}")
    assert len(t) >= 2 and v[-1] > LIMITS.link_dbm
    assert win.trends.curve_data("heater/chip")[1][-1] >= 0
    # the chip's describe gives its board's power budget: a line at it, no "unknown" note
    assert "chip" in win.trends.budget_lines
    assert "budget unknown" not in win.trends.budget_note.text()
    assert_not_blank(pixels(win.trends, tmp_path / "trends.png"), min_colours=20)
    # The chip's ports carry the GPUs' names, and a receiver's mark its power colour.
    chip = win.portmap.views["chip"]
    assert "gpu0" in chip.tooltip_at(chip._geometry_cache()[3][("port", 1)])
    assert_not_blank(pixels(win.portmap, tmp_path / "portmap.png"), min_colours=50)


def test_the_throughput_trend_shows_a_failover(qtbot, window, rig, tmp_path):
    win = window
    emu = rig[0]
    win.trends.set_window(60.0)
    until(qtbot, lambda: running(win))
    time.sleep(2.5)                         # a steady rate before the failure
    t_fail = time.time()
    emu.rack.rack.faults.fail_gpu("gpu3")
    until(qtbot, lambda: win.model.rack["spare0"].role == "in_use_spare")
    series = win.model.trends.series[f"throughput/{JOB}"]
    t, v = series.since(t_fail - 2.0)
    before = v[t < t_fail]
    assert len(before), "no throughput report before the failure"
    rate = float(np.median(before))
    assert rate > 0

    def recovered():
        t, v = series.since(t_fail + 1.0)
        return len(v) and v[-1] > 0.5 * rate
    until(qtbot, recovered)
    win.trends.refresh()
    t, v = win.trends.curve_data(f"throughput/{JOB}")         # what is drawn
    during = v[(t >= t_fail) & (t < t_fail + 3.0)]
    assert len(during) and during.min() < 0.5 * rate, (rate, during)     # the dip...
    assert v[-1] > 0.5 * rate, (rate, v[-1])                             # ... the recovery
    rgb = pixels(win.trends, tmp_path / "failover-trend.png")
    plot = win.trends.frames["jobs"]
    top = plot.mapTo(win.trends, QPoint(0, 0))
    box = rgb[top.y(): top.y() + plot.height(), top.x(): top.x() + plot.width()]
    line = np.all(np.abs(box.astype(int) - QColor(COLOURS[0]).getRgb()[:3]) < 30, axis=2)
    assert line.sum() > 50, "the throughput line is not drawn"


def test_a_killed_service_and_a_killed_agent_raise_alarms_that_clear(
        qtbot, window, rig, tmp_path):
    win = window
    emu, rig_, path, tmp, procs = rig
    until(qtbot, lambda: "service:ocs" not in alarm_keys(win))
    procs["ocs"].kill()
    procs["ocs"].wait(10)
    until(qtbot, lambda: "service:ocs" in alarm_keys(win))
    rgb = pixels(win, tmp_path / "ocs-down.png")
    assert near(banner_colour(win, rgb), QColor(ALARM_BG), 20)
    assert "ocs down" in win.alarms.label.text()
    frame = win.portmap.frames["ocs"]
    assert frame.stale and "ocs down" in frame.veil.text
    assert veiled(win, frame, rgb)
    assert not win.portmap.frames["chip"].stale
    procs["ocs"] = _ocs_process(path)
    until(qtbot, lambda: "service:ocs" not in alarm_keys(win) and not frame.stale)
    assert not veiled(win, frame, pixels(win, tmp_path / "ocs-back.png"))

    procs["agent"].kill()
    (tmp / "agent-killed.log").write_text(_stop(procs["agent"]) or "")
    until(qtbot, lambda: "service:agent" in alarm_keys(win))
    rgb = pixels(win, tmp_path / "agent-down.png")
    assert near(banner_colour(win, rgb), QColor(ALARM_BG), 20)
    assert "agent down" in win.alarms.label.text()
    for key in ("rack", "jobs", "events"):
        assert win.frames[key].stale and "agent down" in win.frames[key].veil.text
        assert veiled(win, win.frames[key], rgb), key
    assert win.trends.frames["jobs"].stale
    t_back = time.time()
    procs["agent"] = _agent(path, tmp / "journal.db")
    until(qtbot, lambda: "service:agent" not in alarm_keys(win) and
          not win.frames["jobs"].stale)
    # The job rejoins the new agent, gets its restart order and runs again.
    until(qtbot, lambda: running(win, since=t_back) and
          not any(k.startswith("job:") for k in alarm_keys(win)), timeout=60000)
    rgb = pixels(win, tmp_path / "agent-back.png")
    assert not veiled(win, win.frames["jobs"], rgb)


def test_no_spare_left_and_a_stuck_job_are_shown_until_fixed(qtbot, window, rig, tmp_path):
    win = window
    emu, rig_, path, tmp, procs = rig
    until(qtbot, lambda: running(win), timeout=60000)
    # The job's GPUs fail one by one until no healthy spare is free (the tests before this one
    # may have used some already).
    while win.model.spares():
        spare = win.model.spares()[0].name
        victim = next(g for r, g in sorted(win.model.jobs[JOB].rank_map.items())
                      if win.model.rack[g].role == "active")
        t_fail = time.time()
        emu.rack.rack.faults.fail_gpu(victim)
        until(qtbot, lambda: win.model.rack[spare].role == "in_use_spare")
        until(qtbot, lambda: running(win, since=t_fail), timeout=60000)
    until(qtbot, lambda: "spares" in alarm_keys(win))
    assert "no spare left" in win.alarms.label.text()
    # Another GPU fails: no spare, and a TP job cannot shrink: the agent stops it, and the
    # job waits for a restart order that does not come.
    other = next(g for r, g in sorted(win.model.jobs[JOB].rank_map.items())
                 if win.model.rack[g].role == "active")
    emu.rack.rack.faults.fail_gpu(other)
    until(qtbot, lambda: f"job:{JOB}" in alarm_keys(win) and
          "STUCK" in win.alarms.label.text())
    until(qtbot, lambda: "no healthy spare" in win.alarms.label.text())
    rgb = pixels(win, tmp_path / "stuck.png")
    assert near(banner_colour(win, rgb), QColor(ALARM_BG), 20)
    until(qtbot, lambda: win.jobs.table.item(win.jobs.row_of(JOB), 1).text() ==
          "STUCK (failed)")
    assert_not_blank(pixels(win.jobs, tmp_path / "stuck-jobs.png"), min_fraction=0.02)
    # Fixed by the operator: the job is stopped and released; its GPUs and spares are free.
    request(emu.endpoints["control"], {"cmd": "job_stop"}, timeout_s=20)
    with ServiceClient(rig_.agent_endpoints()[0], timeout=10) as agent:
        agent.call("release", job=JOB)
    # The job's "stopped" report, the spares and the job list are separate publications.
    until(qtbot, lambda: not ({"spares", f"job:{JOB}"} & alarm_keys(win)) and
          JOB not in win.model.jobs)
    rgb = pixels(win, tmp_path / "fixed.png")
    if not win.alarms.alarms:
        assert near(banner_colour(win, rgb), QColor(CLEAR_BG), 20)
