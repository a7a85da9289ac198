"""DEMO MODE ONLY: synthetic fabric data so an operator can see the GUI without a rig.

Nothing here talks to hardware or to the bus. `python -m photonic_testbed.gui --demo-data` feeds a
`FabricModel` from `DemoFabric`, and the window title says DEMO DATA. The demo's devices keep
their states as the bus's services do (`StatePublisher`: an OCS, a chip, the agent), and the
model gets them in the bus's own vocabulary: a snapshot, then each change. The Benes topology
generator is also used by `ptb bench gui` to have a 16 x 16 chip to draw.
"""
from __future__ import annotations

import functools
import math
import random
import time
from collections.abc import Callable
from typing import Any

from PySide6.QtCore import QObject, QTimer

from photonic_testbed.common.topology import Topology, benes
from photonic_testbed.gui.commands import Command, CommandResult, Commands
from photonic_testbed.gui.model import FabricModel
from photonic_testbed.gui.paths import trace
from photonic_testbed.hil.bus import schema
from photonic_testbed.hil.bus.mirror import StatePublisher
from photonic_testbed.hil.bus.state import Delete, Set, StateOp

VMAX = 7.0           # the demo heaters' voltage limit
V_PI = 5.0           # volts for a pi phase shift in the demo's made-up heaters
EVENTS_KEPT = 200    # journal entries in the demo agent's state (the agent's own number)


def benes_topology(ports: int = 16, name: str | None = None) -> dict[str, Any]:
    """A Benes network of 2x2 cells, drawn in 2 log2(N) - 1 columns, as a topology dict."""
    return benes(ports, name).describe()


def chip_circuits(topology: dict | Topology, cells: dict) -> dict[int, int]:
    """Circuits that the cells' states make: inputs whose light reaches exactly one output."""
    topo = topology if isinstance(topology, Topology) else Topology.from_dict(topology)
    out = {}
    for a in range(1, topo.ports + 1):
        ends = trace(topo, cells, a).ends
        if len(ends) == 1 and not trace(topo, cells, a).split:
            out[a] = next(iter(ends))
    return out


def cell_state(theta: float) -> str:
    theta = theta % (2 * math.pi)
    if min(theta, 2 * math.pi - theta) < 0.15:
        return "bar"
    if abs(theta - math.pi) < 0.15:
        return "cross"
    return "partial"


def demo_calibration(topology: dict, seed: int = 0) -> dict[str, Any]:
    """A synthetic calibration in the GUI's calibration-dict shape (fringes, fits, crosstalk)."""
    import numpy as np
    rng = np.random.default_rng(seed)
    cells = {}
    ids = [c["id"] for c in topology["cells"]]
    v = np.linspace(0.0, 7.0, 60)
    fine = np.linspace(0.0, 7.0, 300)
    for cid in ids:
        offset, vpi2 = rng.uniform(0, 2 * np.pi), rng.uniform(20, 28)
        ext = rng.uniform(18, 32)
        floor = 10 ** (-ext / 10)

        def model(x, floor=floor, offset=offset, vpi2=vpi2):
            return floor + (1 - floor) * 0.5 * (1 + np.cos(offset + np.pi * x ** 2 / vpi2))
        cells[cid] = {"sweep_v": v.tolist(),
                      "power": (model(v) + rng.normal(0, 0.01, v.size)).tolist(),
                      "fit_v": fine.tolist(), "fit_power": model(fine).tolist(),
                      "extinction_db": float(ext)}
    n = len(ids)
    xt = np.zeros((n, n))
    pos = {c["id"]: (c["x"], c["y"]) for c in topology["cells"]}
    for i, a in enumerate(ids):
        for j, b in enumerate(ids):
            d = math.dist(pos[a], pos[b])
            xt[i, j] = 1.0 if i == j else 0.04 * math.exp(-d) * rng.uniform(0.7, 1.3)
    return {"cells": cells, "crosstalk": xt.tolist()}


class DemoFabric(QObject):
    """A made-up 64-port OCS, a 16 x 16 Benes chip, 16 GPUs and an agent that acts on its own.

    It feeds `model` through the same calls a bus adapter makes: each device's state as a
    snapshot, then its changes (`post_change`); connections, samples, port powers, the chip's
    topology and budget through theirs.
    """

    OCS, CHIP = "ocs1", "benes16"

    def __init__(self, model: FabricModel, seed: int = 1, interval_ms: int = 250,
                 parent: QObject | None = None):
        super().__init__(parent)
        self.model = model
        self.rng = random.Random(seed)
        self.t = 0
        self.topology = benes_topology(16, self.CHIP)
        self._topo = Topology.from_dict(self.topology)
        self.cells = {c["id"]: {"state": "bar", "theta": 0.0, "phi": 0.0}
                      for c in self.topology["cells"]}
        for cid in self.rng.sample(sorted(self.cells), 24):
            self.cells[cid] = {"state": "cross", "theta": math.pi, "phi": 0.0}
        self.ocs_ports = 64
        self.ocs: dict[int, int] = {i: 64 + (i % 14) + 1 for i in range(1, 15)}
        outs = list(range(64 + 17, 129))
        self.rng.shuffle(outs)
        for i, o in zip(range(17, 65), outs[:40], strict=False):      # 40 of the 48
            self.ocs[i] = o
        self.power = {p: self.rng.uniform(-12, -3) for p in range(1, 129)}
        self.rack: list[dict[str, Any]] = [
            {"name": f"gpu{i:02d}", "port": i + 1, "switch": self.OCS, "health": "ok",
             "role": "active" if i < 14 else "spare", "rank": i if i < 14 else None,
             "job": "dp" if i < 14 else None}
            for i in range(16)]
        self.journal_seq = 0
        self.journal: list[dict] = []
        self.services = {s: {"state": "connected", "detail": "demo"} for s in
                         ("bus", "agent", "gpus", self.OCS, self.CHIP, "powermeter")}
        # Which demo services the views' data comes from (MainWindow's `sources`).
        self.sources = {"trend:links": [self.OCS], "trend:heaters": [self.CHIP]}
        self.step_count = 0
        self.outage = 0                 # ticks left of the job's outage after a swap
        self.restart_seq = 0
        self.heater_mw = 900.0
        self._devices: dict[str, tuple[str, StatePublisher]] = {}   # name -> (kind, state)
        self.timer = QTimer(self)
        self.timer.setInterval(interval_ms)
        self.timer.timeout.connect(self.step)

    # --- feeding the model --------------------------------------------------------------
    def start(self) -> None:
        self._note("start", "demo data: nothing here is real")
        for name, s in self.services.items():
            self.model.post_service(name, s["state"], s["detail"])
        self.model.post_topology(self.CHIP, self.topology)
        for name, kind, state in ((self.OCS, "switch", self._ocs_state()),
                                  (self.CHIP, "chip", self._chip_state()),
                                  ("agent", "agent", self._agent_state())):
            publisher = StatePublisher(name, state, functools.partial(self._published, name))
            self._devices[name] = (kind, publisher)
            self.model.post_snapshot(name, kind, publisher.snapshot()["state"])
        self.model.post_power(self.OCS, dict(self.power))
        self.model.post_power(self.CHIP, {p: self.power[p] - 3 for p in range(1, 33)})
        self.model.post_budget(self.CHIP, 1500.0)
        self.timer.start()

    def stop(self) -> None:
        self.timer.stop()

    def _published(self, device: str, delta: dict[str, Any]) -> None:
        """A change a demo device published, to the model as a bus adapter hands it on."""
        self.model.post_change(device, delta["ops"])

    def _publish(self, device: str, values: dict[str, Any]) -> None:
        """New values of a device's state: published as a change of what differs."""
        if device in self._devices:
            self._devices[device][1].update(values)

    def _change(self, device: str, ops: list[StateOp]) -> None:
        if device in self._devices:
            self._devices[device][1].change(ops)

    def _agent_state(self) -> dict[str, Any]:
        return {"rack": [dict(g) for g in self.rack], "events": self.journal[-EVENTS_KEPT:],
                "jobs": self._jobs(), "alarms": []}

    def _jobs(self) -> dict[str, Any]:
        """The demo's one job as the agent publishes it, with the job's own report."""
        if self.outage > 3:
            state, rate = "failed", None
        elif self.outage > 0:
            state, rate = "restarting", None
        else:
            state, rate = "running", max(0.0, 9.7 + self.rng.gauss(0, 0.25))
        ranks = {str(g["rank"]): g["name"] for g in self.rack if g["rank"] is not None}
        return {"dp": {"plan": "dp", "world": len(ranks), "rank_map": ranks, "phase": "dp",
                       "round": 0,
                       "restart": {"seq": self.restart_seq, "rank_map": ranks,
                                   "cause": "demo: a GPU swapped out"},
                       "report": {"state": state, "step": self.step_count, "throughput": rate,
                                  "loss": 2.5 * math.exp(-self.step_count / 4000) + 0.3
                                  + self.rng.gauss(0, 0.01),
                                  "detail": "demo job", "t": time.time()}}}

    def _samples(self) -> None:
        """Readings of the GPUs' receivers (the OCS's egress monitors) and the heaters."""
        t = time.time()
        values: dict[str, list] = {}
        for g in self.rack:
            out = self.ocs.get(g["port"])
            if out is not None and g["health"] != "failed":
                receiver = next((x["name"] for x in self.rack
                                 if self.ocs_ports + x["port"] == out), None)
                if receiver is not None:
                    values[f"rx/{receiver}"] = [[t, self.power[out]]]
        self.heater_mw = min(1450.0, max(300.0, self.heater_mw + self.rng.gauss(0, 15)))
        values[f"heater/{self.CHIP}"] = [[t, self.heater_mw]]
        self.model.post_samples(values)

    def _ocs_state(self) -> dict:
        return {"kind": "switch", "online": True, "ports": self.ocs_ports,
                "circuits": schema.circuits_to_wire(self.ocs)}

    def _chip_state(self) -> dict:
        return {"kind": "chip", "online": True, "ports": 16,
                "circuits": schema.circuits_to_wire(self._chip_circuits()),
                "cells": {k: dict(v) for k, v in self.cells.items()}}

    def publish_ocs(self) -> None:
        """The OCS's circuits as they now are."""
        self._publish(self.OCS, {"circuits": schema.circuits_to_wire(self.ocs)})

    def _publish_rack(self) -> None:
        self._publish("agent", {"rack": [dict(g) for g in self.rack]})

    def _note(self, kind: str, cause: str = "", latency_s: float | None = None, **details):
        self.journal_seq += 1
        e = {"seq": self.journal_seq, "ts": time.time(), "kind": kind, "cause": cause,
             "latency_s": latency_s, "details": details}
        self.journal.append(e)
        del self.journal[:-500]
        return e

    def _journal(self, *entries: dict) -> None:
        """Entries appended to the agent's `events`, the oldest dropped past EVENTS_KEPT, as
        the agent publishes them."""
        if "agent" not in self._devices:
            return
        events = self._devices["agent"][1].state["events"]
        ops: list[StateOp] = []
        kept = len(events)
        for e in entries:
            ops.append(Set(["events", kept], dict(e)))
            kept += 1
            if kept > EVENTS_KEPT:
                ops.append(Delete(["events", 0]))
                kept -= 1
        self._change("agent", ops)

    # --- what happens by itself ---------------------------------------------------------
    def step(self) -> None:
        self.t += 1
        if self.outage:
            self.outage -= 1
        else:
            self.step_count += 2
        if self.t % 2 == 0:
            self._publish("agent", {"jobs": self._jobs()})
        if self.t % 4 == 0:
            self._samples()
        for p in self.rng.sample(range(1, 129), 6):
            self.power[p] = min(0.0, max(-40.0, self.power[p] + self.rng.gauss(0, 0.4)))
        self.model.post_power(self.OCS, dict(self.power))
        if self.t % 4 == 0:
            a, b = self.rng.sample(range(17, 65), 2)
            if a in self.ocs and b in self.ocs:
                self.ocs[a], self.ocs[b] = self.ocs[b], self.ocs[a]
                self.publish_ocs()
        if self.t % 6 == 0:
            cid = self.rng.choice(sorted(self.cells))
            theta = math.pi if self.cells[cid]["state"] == "bar" else 0.0
            self._set_cell(cid, theta)
        if self.t % 20 == 0:
            self._journal(self._note("phase", "job phase change",
                                     phase=self.rng.choice(["data", "tensor", "pipeline"])))
        if self.t % 60 == 30:
            failing = [g for g in self.rack if g["role"] != "spare" and g["health"] == "ok"]
            if failing and self.spares():
                self.swap(self.rng.choice(failing)["name"], None, cause="demo: injected Xid 79")
        if self.t % 60 == 50:
            self._repair()
        if self.t % 90 == 45:
            self._service("powermeter", "connecting", "reconnecting after a dropped socket")
        if self.t % 90 == 50:
            self._service("powermeter", "connected", "demo")

    def _repair(self) -> None:
        """A failed GPU is replaced by a technician: the new one joins the spares."""
        broken = next((g for g in self.rack if g["health"] == "failed"), None)
        if broken is not None:
            broken.update(health="ok", role="spare", rank=None, job=None)
            self._publish_rack()
            self._journal(self._note("note", f"{broken['name']} replaced: a spare again",
                                     gpu=broken["name"]))

    def _service(self, name: str, state: str, detail: str) -> None:
        self.services[name] = {"state": state, "detail": detail}
        self.model.post_service(name, state, detail)
        self._journal(self._note("alarm" if state != "connected" else "note",
                                 f"{name} {state}", service=name))

    def _set_cell(self, cid: str, theta: float) -> None:
        self.cells[cid] = {"state": cell_state(theta), "theta": theta, "phi": 0.0}
        self._change(self.CHIP, [Set(["cells", cid], dict(self.cells[cid]))])
        self._publish(self.CHIP, {"circuits": schema.circuits_to_wire(self._chip_circuits())})

    def _chip_circuits(self) -> dict[int, int]:
        # The agent uses 10 of the chip's 16 inputs in this demo; the rest carry no circuit.
        return {a: b for a, b in chip_circuits(self._topo, self.cells).items() if a <= 10}

    def spares(self) -> list[dict]:
        return [g for g in self.rack if g["role"] == "spare" and g["health"] == "ok"]

    def swap(self, gpu: str, spare: str | None, cause: str) -> str:
        """Move `gpu`'s rank and circuits to a spare; returns what was done."""
        g = next(x for x in self.rack if x["name"] == gpu)
        s = next(x for x in self.rack if x["name"] == spare) if spare else self.spares()[0]
        t0 = time.time()
        g["health"] = "failed" if "Xid" in cause else g["health"]
        self._journal(self._note("failure", cause, gpu=gpu),
                      self._note("detected", cause, gpu=gpu, port=g["port"]))
        old_out = self.ocs.pop(g["port"], None)
        if old_out is not None:
            self.ocs[s["port"]] = old_out
        for a, b in list(self.ocs.items()):
            if b == self.ocs_ports + g["port"]:
                self.ocs[a] = self.ocs_ports + s["port"]
        s["role"], s["rank"], s["job"] = "in_use_spare", g["rank"], g["job"]
        g["rank"], g["job"] = None, None
        self.outage = 6                         # the job restarts: 1.5 s without steps
        self.restart_seq += 1
        lat = 0.35 + self.rng.uniform(0, 0.5)
        self._journal(self._note("decision", cause, gpu=gpu, spare=s["name"]))
        self.publish_ocs()
        self._publish_rack()
        self._journal(self._note("applied", cause, latency_s=lat, switch=self.OCS),
                      self._note("verified", cause, latency_s=lat + 0.05 + time.time() - t0),
                      self._note("rank_map", cause, rank=s["rank"], gpu=s["name"]))
        return f"{gpu} replaced by {s['name']} (rank {s['rank']})"


class DemoCommands(Commands):
    """Demo-mode answers to the operator's commands, applied to the synthetic fabric after a
    short delay; refusals mimic what the agent and the firmware would say."""

    def __init__(self, fabric: DemoFabric, delay_ms: int = 150):
        self.fabric, self.delay_ms = fabric, delay_ms

    def submit(self, command: Command, done: Callable[[CommandResult], None]) -> None:
        QTimer.singleShot(self.delay_ms, self.fabric, lambda: done(self._run(command)))

    def _run(self, c: Command) -> CommandResult:
        f, p = self.fabric, c.params
        if c.action in ("connect", "disconnect"):
            if p["switch"] != f.OCS:
                return CommandResult(c, False, f"{p['switch']}: the chip's circuits are set by "
                                     "the agent's router in this demo; set heaters instead")
            a = int(p["input"])
            if not 1 <= a <= f.ocs_ports:
                return CommandResult(c, False, f"input {a} does not exist (1..{f.ocs_ports})")
            if c.action == "disconnect":
                if a not in f.ocs:
                    return CommandResult(c, False, f"input {a} has no circuit to disconnect")
                del f.ocs[a]
            else:
                b = int(p["output"])
                if not f.ocs_ports < b <= 2 * f.ocs_ports:
                    return CommandResult(c, False, f"output {b} does not exist "
                                         f"({f.ocs_ports + 1}..{2 * f.ocs_ports})")
                holder = next((x for x, y in f.ocs.items() if y == b and x != a), None)
                if holder is not None:
                    return CommandResult(c, False, f"output {b} already carries input {holder}: "
                                         "disconnect it first")
                f.ocs[a] = b
            f.publish_ocs()
            f._journal(f._note("applied", f"operator {c.action}", switch=f.OCS))
            return CommandResult(c, True, "done")
        if c.action == "set_heater":
            ch, volts = int(p["channel"]), float(p["volts"])
            cell = next((x["id"] for x in f.topology["cells"] if ch in x["channels"]), None)
            if cell is None:
                return CommandResult(c, False, f"{f.CHIP} has no heater channel {ch}")
            if not 0.0 <= volts <= VMAX:
                return CommandResult(c, False, f"firmware refused: {volts:g} V is outside "
                                     f"channel {ch}'s limit 0..{VMAX:g} V (E02:{ch})")
            f._set_cell(cell, math.pi * volts ** 2 / V_PI ** 2)
            return CommandResult(c, True, f"cell {cell} now {f.cells[cell]['state']}")
        gpu, spare = p["gpu"], p.get("spare")
        names = {g["name"]: g for g in f.rack}
        if gpu not in names:
            return CommandResult(c, False, f"no GPU named {gpu!r} in the rack")
        if names[gpu]["role"] == "spare":
            return CommandResult(c, False, f"{gpu} is a spare: it holds no rank to move")
        if spare is not None and (spare not in names or names[spare] not in f.spares()):
            return CommandResult(c, False, f"{spare} is not a healthy free spare")
        if not f.spares():
            return CommandResult(c, False, "agent refused: no healthy spare left in the rack")
        return CommandResult(c, True, f.swap(gpu, spare, cause="operator swap"))
