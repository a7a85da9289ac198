"""The operator's GUI, offscreen: each view drawn from model data, screenshots inspected by
their pixels, deltas reaching the views, manual control's confirmations and refusals."""
from __future__ import annotations

import json
import os
import threading

os.environ["QT_QPA_PLATFORM"] = "offscreen"

import numpy as np  # noqa: E402
import pytest  # noqa: E402
from PySide6.QtCore import QPoint, QSettings, QTimer  # noqa: E402
from PySide6.QtGui import QColor, QImage  # noqa: E402
from PySide6.QtWidgets import QApplication, QMessageBox  # noqa: E402

from photonic_testbed.common.calibration import checksum  # noqa: E402
from photonic_testbed.common.topology import Topology, TopologyError  # noqa: E402
from photonic_testbed.gui.calibration import CalibrationFileError, CalibrationView, load_calibration  # noqa: E402
from photonic_testbed.gui.commands import (  # noqa: E402
    Command,
    CommandError,
    CommandResult,
    CommandRunner,
    Commands,
)
from photonic_testbed.gui.control import ManualControl, describe_change  # noqa: E402
from photonic_testbed.gui.demo import DemoCommands, DemoFabric, benes_topology, demo_calibration  # noqa: E402
from photonic_testbed.gui.events import EventsView  # noqa: E402
from photonic_testbed.gui.model import FabricModel, ModelError  # noqa: E402
from photonic_testbed.gui.paths import trace  # noqa: E402
from photonic_testbed.gui.portmap import FLASH, ChipView, OcsMatrixView, circuit_colour  # noqa: E402
from photonic_testbed.gui.rack import RackView  # noqa: E402
from photonic_testbed.gui.window import MainWindow  # noqa: E402
from photonic_testbed.hil.bus.schema import circuits_to_wire  # noqa: E402
from photonic_testbed.hil.bus.state import Set  # noqa: E402


# --- helpers ---------------------------------------------------------------------------------
def pixels(widget, path) -> np.ndarray:
    """Grab the widget, save the PNG (for people to look at), return it as an RGB array."""
    image = widget.grab().toImage().convertToFormat(QImage.Format.Format_RGB888)
    assert image.save(str(path))
    w, h, stride = image.width(), image.height(), image.bytesPerLine()
    raw = np.frombuffer(image.constBits(), dtype=np.uint8, count=stride * h).reshape(h, stride)
    return raw[:, : 3 * w].reshape(h, w, 3).copy()


def assert_not_blank(rgb: np.ndarray, min_colours=8, min_fraction=0.05) -> None:
    flat = rgb.reshape(-1, 3).astype(np.uint32)
    packed = (flat[:, 0] << 16) | (flat[:, 1] << 8) | flat[:, 2]    # 1-D: unique is fast
    colours, counts = np.unique(packed, return_counts=True)
    assert len(colours) >= min_colours, f"only {len(colours)} colours: a blank picture"
    background = colours[np.argmax(counts)]
    drawn = np.mean(packed != background)
    assert drawn >= min_fraction, f"only {drawn:.1%} of the pixels differ from the background"


def colour_at(rgb: np.ndarray, point) -> QColor:
    r, g, b = rgb[int(point.y()), int(point.x())]
    return QColor(int(r), int(g), int(b))


def near(a: QColor, b: QColor, tol=40) -> bool:
    return all(abs(x - y) <= tol for x, y in zip(a.getRgb()[:3], b.getRgb()[:3], strict=True))


# Devices' states as their services publish them (docs/bus.md, docs/agent-bus.md).
def ocs_state(ports=64, circuits=None) -> dict:
    return {"kind": "switch", "online": True, "ports": ports,
            "circuits": circuits_to_wire(circuits or {})}


def agent_state(rack=(), events=(), jobs=None, alarms=()) -> dict:
    return {"rack": [dict(g) for g in rack], "events": [dict(e) for e in events],
            "jobs": dict(jobs or {}), "alarms": list(alarms), "phase": None}


def show_ocs(model, name="ocs1", ports=64, circuits=None, power=None) -> None:
    model.apply_snapshot(name, "switch", ocs_state(ports, circuits))
    if power:
        model.set_power(name, power)


BENES = benes_topology(16, "benes16")


def show_chip(model, states=None, circuits=None, name="benes16", topology=BENES) -> None:
    cells = {c["id"]: {"state": "bar", "theta": 0.0, "phi": 0.0} for c in topology["cells"]}
    cells.update(states or {})
    model.set_topology(name, topology)
    model.apply_snapshot(name, "chip", {"kind": "chip", "ports": topology["ports"],
                                        "circuits": circuits_to_wire(circuits or {}),
                                        "cells": cells})


RACK = [{"name": f"gpu{i}", "port": i + 1, "switch": "ocs1", "health": "ok",
         "role": "active" if i < 6 else "spare", "rank": i if i < 6 else None} for i in range(8)]


class ScriptedCommands(Commands):
    """Test double of the bus adapter: records commands, answers from another thread."""

    def __init__(self, answer):
        self.answer, self.sent = answer, []

    def submit(self, command, done):
        self.sent.append(command)
        threading.Thread(target=lambda: done(self.answer(command)), daemon=True).start()


# --- pure parts ------------------------------------------------------------------------------
def test_light_paths_follow_cell_states():
    topo = Topology.from_dict(BENES)
    bar = {c.id: {"state": "bar"} for c in topo.cells}
    for port in range(1, 17):
        assert trace(topo, bar, port).ends == {16 + port}
    first = next(c.id for c in topo.cells if c.id.startswith("s0"))
    crossed = {**bar, first: {"state": "cross"}}
    assert trace(topo, crossed, 1).ends == {18} and trace(topo, crossed, 2).ends == {17}
    split = trace(topo, {**bar, first: {"state": "partial"}}, 1)
    assert split.split and split.ends == {17, 18}
    assert trace(topo, {}, 1).ends == set()          # unknown states are not guessed through


@pytest.mark.parametrize("mutate, message", [
    (lambda t: t["links"].append({"from": ["cell", "nope", 0], "to": ["port", 1]}), "nope"),
    (lambda t: t["links"].append({"from": ["cell", "s0r0", 7], "to": ["port", 1]}), "arm 7"),
    (lambda t: t["links"].append({"from": ["port", 99], "to": ["cell", "s0r0", 0]}), "port 99"),
    (lambda t: t.update(kind="spiral"), "spiral"),
    (lambda t: t.pop("cells"), "lacks cells"),
])
def test_bad_topologies_are_refused_with_the_reason(mutate, message):
    topo = json.loads(json.dumps(BENES))
    mutate(topo)
    with pytest.raises(TopologyError, match=message):
        Topology.from_dict(topo)


def test_commands_are_checked_before_they_are_sent():
    with pytest.raises(CommandError, match="needs output"):
        Command("connect", {"switch": "ocs1", "input": 1})
    with pytest.raises(CommandError, match="unknown action"):
        Command("reboot", {})


# --- model -----------------------------------------------------------------------------------
def test_model_applies_state_changes_posted_from_another_thread(qtbot):
    """The model takes each device's state and changes in the bus's vocabulary (Set, Delete)
    and shows what they touched; what does not fit is refused, saying why."""
    model = FabricModel()
    show_ocs(model, circuits={1: 65})
    model.apply_snapshot("agent", "agent", agent_state(rack=RACK))
    seq = model.seq
    with qtbot.waitSignal(model.switchChanged) as got:
        threading.Thread(target=model.post_change, args=(
            "ocs1", [Set(["circuits"], [[1, 66], [2, 65]])])).start()
    name, change, shown = got.args
    assert (name, shown) == ("ocs1", seq + 1)
    assert change.added == {1: 66, 2: 65} and change.removed == {1: 65}
    with qtbot.waitSignal(model.switchChanged):
        model.post_power("ocs1", {"66": -7.5})              # its port monitors' telemetry
    assert model.switches["ocs1"].power_dbm[66] == -7.5
    with qtbot.waitSignal(model.rackChanged) as gpus:
        model.post_change("agent", [Set(["rack", 2, "health"], "failed")])
    assert gpus.args == [{"gpu2"}] and model.rack["gpu2"].health == "failed"
    for ops, says in (([Set(["circuits"], [[1, 3]])], "circuit 1->3"),
                      ([Set(["cells", "s0r0"], {})], "does not exist"),
                      ([Set(["circuits"], [[1, "x"]])], "not two ports")):
        with qtbot.waitSignal(model.rejected) as bad:
            model.post_change("ocs1", ops)
        assert says in bad.args[0] and bad.args[0].startswith("apply_change of ocs1")
        assert model.switches["ocs1"].circuits == {1: 66, 2: 65}   # what is shown stayed
    with qtbot.waitSignal(model.rejected) as bad:
        model.post_change("ocs9", [Set(["circuits"], [])])
    assert "a change of 'ocs9' before its state" in bad.args[0]
    with pytest.raises(ModelError, match="health 'sick'"):
        model.apply_change("agent", [Set(["rack", 1, "health"], "sick")])


# --- views -----------------------------------------------------------------------------------
def test_ocs_matrix_shows_circuits_by_power_and_flashes_a_new_one(qtbot, tmp_path):
    model = FabricModel()
    circuits = {i: 64 + ((i * 7) % 64) + 1 for i in range(1, 41)}
    power = {p: -3.0 - (p % 30) for p in range(1, 129)}
    show_ocs(model, circuits=circuits, power=power)
    view = OcsMatrixView(model, "ocs1")
    qtbot.addWidget(view)
    view.resize(700, 700)
    view.show()
    qtbot.waitExposed(view)
    before = pixels(view, tmp_path / "ocs-before.png")
    assert_not_blank(before)
    target = view.cell_rect(50, 100).center()
    assert near(colour_at(before, target), QColor("#20232a"), 12)        # empty cell
    model.apply_change("ocs1", [Set(["circuits"], circuits_to_wire({**circuits, 50: 100}))])
    after = pixels(view, tmp_path / "ocs-after.png")
    assert near(colour_at(after, target), FLASH), colour_at(after, target).name()
    assert view.applied_seq == model.seq


def test_chip_view_draws_the_light_path_of_a_changed_circuit(qtbot, tmp_path):
    model = FabricModel()
    show_chip(model, circuits={1: 17})
    view = ChipView(model, "benes16")
    qtbot.addWidget(view)
    view.resize(900, 600)
    view.show()
    qtbot.waitExposed(view)
    before = pixels(view, tmp_path / "chip-before.png")
    assert_not_blank(before)
    topo = model.topologies["benes16"]
    lit = view.paths()[1].links
    assert len(lit) == 8 and trace(topo, model.cells["benes16"], 1).ends == {17}
    # Somewhere along each lit link the circuit's colour shows.
    assert near(colour_at(before, view.link_midpoint(sorted(lit)[3])), circuit_colour(1, 16))
    # Cross the first cell: input 1 now reaches output 18, drawn from the new cell states.
    first = "s0r0"
    with qtbot.waitSignal(view.painted, timeout=10000):
        model.apply_change("benes16", [Set(["cells", first], {"state": "cross", "theta": 3.14,
                                                              "phi": 0.0}),
                                       Set(["circuits"], [[1, 18]])])
    after = pixels(view, tmp_path / "chip-after.png")
    new_links = view.paths()[1].links
    assert view.paths()[1].ends == {18} and new_links != lit
    fresh = sorted(new_links - lit)
    assert any(near(colour_at(after, view.link_midpoint(i)), circuit_colour(1, 16))
               for i in fresh)
    # ... and a cell switched back to bar flashes (its centre carries no routing line).
    model.apply_change("benes16", [Set(["cells", first, "state"], "bar")])
    flashed = pixels(view, tmp_path / "chip-flash.png")
    assert near(colour_at(flashed, view.cell_center(first)), FLASH)
    assert view.applied_seq == model.seq


def test_rack_view_shows_health_role_rank_and_port(qtbot, tmp_path):
    model = FabricModel()
    model.apply_snapshot("agent", "agent", agent_state(rack=RACK))
    view = RackView(model)
    qtbot.addWidget(view)
    view.resize(600, 400)
    view.show()
    assert_not_blank(pixels(view, tmp_path / "rack.png"), min_fraction=0.02)
    model.apply_change("agent", [Set(["rack", 2, "health"], "failed"),
                                 Set(["rack", 2, "rank"], None)])
    model.apply_change("agent", [Set(["rack", 6, "role"], "in_use_spare"),
                                 Set(["rack", 6, "rank"], 2)])
    row = view.row_of("gpu2")
    assert view.table.item(row, 1).text() == "failed"
    assert view.table.item(row, 1).background().color() == QColor("#c62828")
    spare = view.row_of("gpu6")
    assert [view.table.item(spare, c).text() for c in range(5)] == \
        ["gpu6", "in use (spare)", "2", "ocs1", "7"]
    assert "1 failed" in view.summary.text() and "1 spare" in view.summary.text()
    rgb = pixels(view, tmp_path / "rack-after.png")
    rect = view.table.visualItemRect(view.table.item(row, 1))
    cell = view.table.viewport().mapTo(view, rect.topLeft() + QPoint(4, rect.height() // 2))
    assert near(colour_at(rgb, cell), QColor("#c62828"), 25)


def test_events_view_is_live_filterable_and_shows_latency(qtbot, tmp_path):
    model = FabricModel()
    entries = [{"seq": i, "ts": 1.7e9 + i, "kind": k, "cause": "gpu3 lost",
                "latency_s": 0.4213 if k == "applied" else None, "details": {"gpu": "gpu3"}}
               for i, k in enumerate(["failure", "detected", "decision", "applied", "verified"], 1)]
    model.apply_snapshot("agent", "agent", agent_state(events=entries))
    view = EventsView(model)
    qtbot.addWidget(view)
    view.resize(900, 400)
    view.show()
    assert_not_blank(pixels(view, tmp_path / "events.png"), min_fraction=0.02)
    assert view.visible_kinds() == ["failure", "detected", "decision", "applied", "verified"]
    assert view.proxy.index(3, 4).data() == "421.3"
    model.apply_change("agent", [Set(["events", 5], {"seq": 6, "ts": 1.7e9 + 6,
                                                     "kind": "alarm",
                                                     "cause": "powermeter down"})])
    assert view.visible_kinds()[-1] == "alarm"
    view.set_kinds({"alarm", "failure"})
    assert view.visible_kinds() == ["failure", "alarm"]
    view.set_kinds(None)
    view.search.setText("powermeter")
    assert view.visible_kinds() == ["alarm"]


def test_calibration_view_loads_a_file_and_refuses_bad_ones(qtbot, tmp_path):
    content = {**_file_v2(demo_calibration(BENES, seed=2)), "version": 3}
    text = json.dumps({**content, "checksum": checksum(content)}, indent=1)
    good = tmp_path / "cal.json"
    good.write_text(text)
    view = CalibrationView()
    qtbot.addWidget(view)
    view.resize(1000, 700)
    view.show()
    assert view.open(str(good)), view.error.text()
    assert view.cells.count() == 56 and "checksum verified" in view.source.text()
    view.cells.setCurrentRow(5)
    rgb = pixels(view, tmp_path / "calibration.png")
    assert_not_blank(rgb, min_colours=20)
    orange = np.all(np.abs(rgb.astype(int) - [0xff, 0x9f, 0x1c]) < 20, axis=2)
    assert orange.sum() > 200, "the fitted fringe is not drawn"
    bad = tmp_path / "bad.json"
    tampered = {**content, "crosstalk": [[1.0]]}
    edited = text.replace('"p_pi_mw": 22.01', '"p_pi_mw": 22.02')
    assert edited != text
    for data, message in ((b"{", "not JSON"), (b'{"version": 3\xff}', "not UTF-8"),
                          (edited.encode(), "checksum"),
                          (json.dumps({**tampered, "checksum": checksum(tampered)}).encode(),
                           "crosstalk: expected a 56 x 56 matrix")):
        bad.write_bytes(data)
        with pytest.raises(CalibrationFileError, match=message):
            load_calibration(bad)
        assert not view.open(str(bad)) and message in view.error.text()
    with pytest.raises(CalibrationFileError, match="cannot read"):
        load_calibration(tmp_path / "missing.json")


def _answer_dialog(qtbot, button, seen: list):
    def press():
        box = QApplication.activeModalWidget()
        if not isinstance(box, QMessageBox):
            QTimer.singleShot(10, press)
            return
        seen.append(box.text())
        box.button(button).click()
    QTimer.singleShot(0, press)


def test_manual_control_confirms_the_change_and_shows_a_refusal(qtbot, tmp_path):
    model = FabricModel()
    show_ocs(model, circuits={3: 66, 9: 70})
    model.apply_snapshot("agent", "agent", agent_state(rack=RACK))
    backend = ScriptedCommands(lambda c: CommandResult(
        c, False, "output 70 already carries input 9: disconnect it first"))
    panel = ManualControl(model, CommandRunner(backend))
    qtbot.addWidget(panel)
    panel.resize(900, 500)
    panel.show()
    panel.switch.setCurrentText("ocs1")
    panel.input.setValue(3)
    panel.output.setValue(70)
    seen: list[str] = []
    _answer_dialog(qtbot, QMessageBox.StandardButton.Cancel, seen)
    assert not panel.ask_connect()
    assert backend.sent == []                     # cancelled: nothing sent
    assert "connect input 3 to output 70" in seen[0]
    assert "Input 3 now goes to output 66: that circuit will be removed" in seen[0]
    assert "Output 70 now hears input 9" in seen[0]
    _answer_dialog(qtbot, QMessageBox.StandardButton.Ok, seen)
    with qtbot.waitSignal(panel.answered, timeout=3000) as got:
        assert panel.ask_connect()
    assert backend.sent[0].params == {"switch": "ocs1", "input": 3, "output": 70}
    assert not got.args[0].ok
    last = panel.log.item(panel.log.count() - 1).text()
    assert "refused" in last and "output 70 already carries input 9" in last
    assert_not_blank(pixels(panel, tmp_path / "control.png"), min_fraction=0.02)
    swap = Command("swap", {"gpu": "gpu2", "spare": "gpu7"})
    assert "Swap GPU gpu2 (rank 2, port 3 on ocs1) for spare gpu7" in describe_change(swap, model)


def test_demo_commands_apply_and_refuse_like_the_agent(qtbot):
    model = FabricModel()
    fabric = DemoFabric(model, seed=3)
    fabric.start()
    fabric.stop()
    qtbot.waitUntil(lambda: "ocs1" in model.switches)
    runner = CommandRunner(DemoCommands(fabric, delay_ms=1))
    results = []
    runner.finished.connect(results.append)
    runner.submit(Command("set_heater", {"switch": "benes16", "channel": 4, "volts": 9.0}))
    runner.submit(Command("swap", {"gpu": "gpu03", "spare": None}))
    qtbot.waitUntil(lambda: len(results) == 2)
    by_action = {r.command.action: r for r in results}
    refused, swapped = by_action["set_heater"], by_action["swap"]
    assert not refused.ok and "9 V is outside channel 4's limit" in refused.reason
    assert swapped.ok
    qtbot.waitUntil(lambda: model.rack["gpu14"].role == "in_use_spare")
    assert model.rack["gpu14"].rank == 3
    assert model.rack["gpu14"].port in model.switches["ocs1"].circuits


def test_main_window_demo_remembers_layout_and_labels_demo(qtbot, tmp_path):
    from photonic_testbed.gui.app import demo_window
    settings = QSettings(str(tmp_path / "gui.ini"), QSettings.Format.IniFormat)
    window, fabric = demo_window(seed=1, settings=settings)
    qtbot.addWidget(window)
    assert "DEMO DATA" in window.windowTitle()
    window.show()
    fabric.timer.setInterval(20)
    fabric.start()
    qtbot.waitUntil(lambda: len(window.portmap.views) == 2 and len(window.model.entries) > 3)
    fabric.stop()
    assert window.services.labels["agent"].text().endswith("agent: connected")
    assert_not_blank(pixels(window, tmp_path / "window.png"), min_colours=50, min_fraction=0.2)
    window.model.set_service("agent", "down", "no heartbeat for 3 s")
    label = window.services.labels["agent"]
    assert label.text().endswith("agent: down") and "no heartbeat" in label.toolTip()
    shortcuts = {a.shortcut().toString() for a in window.findChildren(type(
        window.docks["rack"].toggleViewAction()))}
    assert {"Ctrl+2", "Ctrl+K", "Ctrl+Shift+S", "Ctrl+Shift+R"} <= shortcuts
    window.docks["calibration"].hide()
    window.close()
    again = MainWindow(FabricModel(), DemoCommands(fabric), settings=settings)
    qtbot.addWidget(again)
    again.show()
    assert again.docks["calibration"].isHidden() and not again.docks["rack"].isHidden()
    again.reset_layout()
    assert not again.docks["calibration"].isHidden()
    again.close()


def test_demo_entry_point_runs_and_saves_a_screenshot(qapp, tmp_path):
    from photonic_testbed.gui.app import main
    shot = tmp_path / "demo.png"
    assert main(["--demo-data", "--quit-after", "1.5", "--screenshot", str(shot),
                 "--settings", str(tmp_path / "gui.ini")]) == 0
    assert (tmp_path / "gui.ini").exists()                     # the layout was saved there
    image = QImage(str(shot)).convertToFormat(QImage.Format.Format_RGB888)
    assert image.width() > 800
    raw = np.frombuffer(image.constBits(), dtype=np.uint8,
                        count=image.bytesPerLine() * image.height())
    raw = raw.reshape(image.height(), image.bytesPerLine())[:, : 3 * image.width()]
    assert_not_blank(raw.reshape(image.height(), image.width(), 3), min_colours=50)


def _file_v2(data: dict) -> dict:
    """The GUI's calibration dict as a version 2 calibration file (docs/calibration.md)."""
    cells = {c["id"]: c["channels"] for c in BENES["cells"]}
    channels = [{"channel": ch, "cell": cid, "offset_rad": 0.1 * ch, "offset_std": 0.001,
                 "p_pi_mw": 22.0 + ch / 100, "p_pi_std_mw": 0.01, "r_ohm": 1000.0}
                for cid, chs in cells.items() for ch in chs]
    return {"version": 2, "chip": "benes16", "chip_id": "lumion/benes16", "rig": "lumion",
            "date": "2026-11-23T08:00:00Z", "method": "monitors", "channels": channels,
            "crosstalk": data["crosstalk"], "crosstalk_std": data["crosstalk"],
            "cells": {cid: {**data["cells"][cid], "channels": chs, "detector": "pd",
                            "sweep_p_mw": data["cells"][cid]["sweep_v"],
                            "visibility": 0.998, "splitter_limited": cid == "s0r1",
                            "coupler_imbalance": 0.02, "residual_rms": 0.001,
                            "measurements": 28}
                      for cid, chs in cells.items()}}


def test_calibration_view_reads_the_calibration_file_format(qtbot, tmp_path):
    v2 = _file_v2(demo_calibration(BENES, seed=4))
    path = tmp_path / "chip.cal.json"
    path.write_text(json.dumps(v2))
    view = CalibrationView()
    qtbot.addWidget(view)
    view.resize(1000, 700)
    view.show()
    assert view.open(str(path)), view.error.text()
    assert view.cells.count() == 56 and "no checksum: unverified" in view.source.text()
    assert "chip_id lumion/benes16" in view.source.text() and "rig lumion" in view.source.text()
    view.cells.setCurrentRow(1)
    assert "ch 1: P_pi 22.01 ± 0.01 mW" in view.note.text()
    assert "splitter-limited" in view.note.text()
    rgb = pixels(view, tmp_path / "calibration-v2.png")
    assert_not_blank(rgb, min_colours=20)
    orange = np.all(np.abs(rgb.astype(int) - [0xff, 0x9f, 0x1c]) < 20, axis=2)
    assert orange.sum() > 200, "the fitted fringe is not drawn"
    # Version 1 (heater fits only): the crosstalk alone, said so.
    v1 = {"version": 1, "chip": "benes16", "crosstalk": v2["crosstalk"],
          "channels": [{k: c[k] for k in ("channel", "offset_rad", "p_pi_mw", "r_ohm")}
                       for c in v2["channels"]]}
    path.write_text(json.dumps(v1))
    assert view.open(str(path)) and view.cells.count() == 0
    assert "heater fits only" in view.source.text()
    for bad, message in (({**v2, "version": 7}, "version 7"),
                         ({**v2, "channels": []}, "non-empty list of heaters"),
                         ({**v2, "crosstalk": [[0.0]]}, "crosstalk: expected a 56 x 56"),
                         ({**v2, "cells": {"s0r0": {"sweep_v": [1]}}}, "a key 'channels'")):
        path.write_text(json.dumps(bad))
        with pytest.raises(CalibrationFileError, match=message):
            load_calibration(path)
