"""The emulated rack: link state from the optics, faults, health, truth."""
from __future__ import annotations

import json

import pytest
from optics_doubles import PermutationSwitch

from photonic_testbed.common.rack_layout import (
    Attachment,
    LayoutError,
    RackLayout,
    layout,
    lumion,
    opus,
)
from photonic_testbed.emulator.clock import SimClock
from photonic_testbed.emulator.rack import EmulatedRack, RackError
from photonic_testbed.hil.gpus.health import GpuHealth

RING = {i: 17 + (i % 8) for i in range(1, 9)}     # gpu(i-1).tx -> gpu(i % 8).rx


@pytest.fixture
def rack():
    clock = SimClock()
    chip = PermutationSwitch("chip", 16, seed=1, loss_db={i: 1.0 for i in range(1, 17)})
    chip.apply(RING)
    return EmulatedRack(lumion(), {"chip": chip}, clock)


def test_layouts_are_consistent_and_round_trip():
    lu, op = lumion(), opus()
    assert lu.workers == tuple(f"gpu{i}" for i in range(8)) and lu.spares == ("spare0", "spare1")
    assert op.switches == {"ocs": 32} and op.gpus["server7"] == (Attachment("ocs", 8, 40),)
    assert RackLayout.from_dict(json.loads(json.dumps(lu.to_dict()))) == lu
    assert lu.owner("chip", 18) == "gpu1" and lu.owner("chip", 16) is None
    with pytest.raises(LayoutError, match="cabled to both"):
        RackLayout("x", {"s": 4}, {"a": (Attachment("s", 1, 5),), "b": (Attachment("s", 1, 6),)})
    with pytest.raises(LayoutError, match="not an output"):
        RackLayout("x", {"s": 4}, {"a": (Attachment("s", 1, 4),)})
    with pytest.raises(LayoutError, match="unknown switch"):
        RackLayout("x", {"s": 4}, {"a": (Attachment("t", 1, 5),)})
    with pytest.raises(LayoutError, match="no rack layout"):
        layout("nope")
    with pytest.raises(LayoutError, match="not a rack description"):
        RackLayout.from_dict({"name": "x"})


def test_links_follow_the_circuits(rack):
    up = {(t.src, t.dst) for t in rack.truth() if t.up}
    assert up == {(f"gpu{i}", f"gpu{(i + 1) % 8}") for i in range(8)}
    t = rack.link("gpu0", "gpu1")
    assert t.power_dbm == pytest.approx(-1.0, abs=0.01) and t.rate_gbps == 400.0
    assert rack.link("gpu1", "gpu0") is None or not rack.link("gpu1", "gpu0").up
    # the leakage of the other transmitters is seen as crosstalk, far below the signal
    assert t.crosstalk_dbm < t.power_dbm - 30
    assert rack.port_power_dbm("chip", 18) == pytest.approx(-1.0, abs=0.01)
    assert rack.port_power_dbm("chip", 32) < -30          # nobody is switched there


def test_power_budget_and_half_rate():
    clock = SimClock()
    chip = PermutationSwitch("chip", 16, loss_db={1: 10.0, 2: 12.5, 3: 5.0})
    chip.apply({1: 18, 2: 19, 3: 17})
    rack = EmulatedRack(lumion(), {"chip": chip}, clock)
    weak, dark, good = (rack.link("gpu0", "gpu1"), rack.link("gpu1", "gpu2"),
                        rack.link("gpu2", "gpu0"))
    assert weak.up and weak.rate_gbps == 200.0             # 2 dB margin: half rate
    assert not dark.up and dark.power_dbm < -12            # below the sensitivity
    assert good.up and good.rate_gbps == 400.0


def test_crosstalk_breaks_a_link_with_enough_light():
    chip = PermutationSwitch("chip", 16, loss_db={i: 1.0 for i in range(1, 17)}, leak_db=-20.0)
    chip.apply(RING)
    rack = EmulatedRack(lumion(), {"chip": chip}, SimClock())
    t = rack.link("gpu0", "gpu1")
    assert t.power_dbm > -12 and t.power_dbm - t.crosstalk_dbm < 15 and not t.up


def test_faults(rack):
    f = rack.faults
    f.fail_gpu("gpu3")
    assert rack.gpu_state("gpu3") == "failed"
    assert not rack.link("gpu2", "gpu3").up            # deaf
    assert rack.link("gpu3", "gpu4") is None           # dark
    f.heal_gpu("gpu3")
    assert rack.link("gpu3", "gpu4").up
    f.fail_transceiver("gpu3", side="tx")
    assert rack.link("gpu3", "gpu4") is None and rack.link("gpu2", "gpu3").up
    f.fail_transceiver("gpu3", "chip", side="rx")
    assert not rack.link("gpu2", "gpu3").up
    f.repair_transceiver("gpu3")
    f.cut_fibre("chip", 1)                             # gpu0's TX fibre
    assert rack.link("gpu0", "gpu1") is None
    f.cut_fibre("chip", 19)                            # gpu2's RX fibre
    assert rack.link("gpu1", "gpu2") is None and rack.port_power_dbm("chip", 19) < -90
    assert f.active()["fibres"] == [{"switch": "chip", "port": 1}, {"switch": "chip", "port": 19}]
    f.splice_fibre("chip", 1)
    assert rack.link("gpu0", "gpu1").up
    f.clear()
    assert all(t.up for t in rack.truth() if t.power_dbm > -20)
    for bad, match in [(lambda: f.fail_gpu("gpu9"), "no GPU"),
                       (lambda: f.fail_gpu("gpu1", mode="sometimes"), "mode"),
                       (lambda: f.fail_gpu("gpu1", "flapping", period_s=0), "period"),
                       (lambda: f.cut_fibre("chip", 33), "ports 1..32"),
                       (lambda: f.cut_fibre("ocs", 1), "no switch"),
                       (lambda: f.fail_transceiver("gpu1", side="up"), "side"),
                       (lambda: f.fail_transceiver("gpu1", "ocs"), "no transceiver")]:
        with pytest.raises(RackError, match=match):
            bad()


def test_health_events_and_flapping(rack):
    seen: list[GpuHealth] = []
    rack.subscribe(seen.append)
    assert rack.poll() == []
    rack.faults.fail_gpu("gpu5", mode="flapping", period_s=1.0)
    rack.faults.degrade_gpu("gpu6", nvlink_errors=4)
    rack.poll()
    assert [(h.gpu, h.state) for h in seen] == [("gpu5", "failed"), ("gpu6", "degraded")]
    assert 79 in seen[0].xids and "NVLink" in seen[1].reasons[0]
    rack.clock.sleep(1.5)
    rack.poll()
    rack.clock.sleep(1.0)
    rack.poll()
    assert [h.state for h in seen if h.gpu == "gpu5"] == ["failed", "ok", "failed"]
    assert all(isinstance(h, GpuHealth) for h in seen)


def test_control_handlers_are_json(rack):
    h = rack.control_handlers()
    h["fail_gpu"](gpu="gpu1")
    h["cut_fibre"](switch="chip", port=20)
    out = {name: h[name]() for name in ("truth", "health", "faults")}
    text = json.dumps(out)
    assert "gpu1" in text and out["faults"]["fibres"] == [{"switch": "chip", "port": 20}]
    assert {t["src"] for t in out["truth"]} == {f"gpu{i}" for i in range(8)} - {"gpu1", "gpu2"}


def test_rack_refuses_missing_physics():
    with pytest.raises(RackError, match="no physics"):
        EmulatedRack(lumion(), {}, SimClock())
    with pytest.raises(RackError, match="transfer"):
        EmulatedRack(lumion(), {"chip": object()}, SimClock())
