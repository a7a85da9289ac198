"""The GUI's port map under load, offscreen: frames per second while state changes arrive
from a background thread (as the bus adapter will deliver them), the time from a change being
posted to the repaint that shows it, and the process's memory at the start and end."""
from __future__ import annotations

import collections
import os
import random
import threading
import time

import numpy as np

from photonic_testbed.ptb.bench import SEED, integer, number

NAME = "gui"
HELP = "port map fps and change-to-repaint latency under a stream of state changes (offscreen)"


def add_arguments(p) -> None:
    p.add_argument("--duration", type=number(0, 7 * 86400, above=True), default=10.0,
                   help="seconds of updates (default %(default)s; the issue's check is 600)")
    p.add_argument("--rate", type=number(0, 1e6, above=True), default=100.0,
                   help="state changes per second, split between the OCS and the chip")
    p.add_argument("--ocs-ports", type=integer(2, 1024), default=64)
    p.add_argument("--size", type=_size, default="1600x800", help="port map size in pixels, WxH")
    p.add_argument("--seed", type=SEED, default=0)


def _size(text: str) -> str:
    """--size WxH, each side 100..8000 pixels."""
    import argparse
    try:
        w, h = (int(x) for x in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"a size is WxH in pixels, not {text!r}") from None
    if not (100 <= w <= 8000 and 100 <= h <= 8000):
        raise argparse.ArgumentTypeError(f"each side must be 100..8000 pixels, not {text}")
    return f"{w}x{h}"


def rss_mib() -> float:
    """Resident memory of this process now (Linux /proc), in MiB."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


class _Record:
    """A preallocated, pre-touched float array that is appended to (extra values dropped)."""

    def __init__(self, room: int):
        self.values = np.full(room, np.nan)
        self.n = 0

    def append(self, x: float) -> None:
        if self.n < len(self.values):
            self.values[self.n] = x
            self.n += 1

    def __len__(self) -> int:
        return self.n

    def done(self) -> np.ndarray:
        return self.values[: self.n]


def run(args) -> dict:
    os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")
    from PySide6.QtCore import QTimer
    from PySide6.QtWidgets import QApplication

    from photonic_testbed.gui.demo import benes_topology, chip_circuits
    from photonic_testbed.gui.model import FabricModel
    from photonic_testbed.common.topology import Topology
    from photonic_testbed.gui.portmap import PortMapView

    app = QApplication.instance() or QApplication([])
    rng = random.Random(args.seed)
    n = args.ocs_ports
    ocs = {i: n + o for i, o in zip(range(1, n + 1), rng.sample(range(1, n + 1), n))}
    topo = benes_topology(16, "chip")
    cells = {c["id"]: {"state": rng.choice(["bar", "cross"]), "theta": 0.0, "phi": 0.0}
             for c in topo["cells"]}
    circuits = chip_circuits(Topology.from_dict(topo), cells)
    model = FabricModel()
    model.apply_snapshot({
        "seq": 0, "topologies": {"chip": topo}, "cells": {"chip": cells},
        "switches": [{"name": "ocs", "kind": "ocs", "ports": n, "circuits": ocs,
                      "power_dbm": {p: -5.0 for p in range(1, 2 * n + 1)}},
                     {"name": "chip", "kind": "chip", "ports": 16, "circuits": circuits,
                      "power_dbm": {}}]})
    view = PortMapView(model)
    w, h = (int(x) for x in args.size.split("x"))
    view.resize(w, h)
    view.show()

    sent: dict[str, collections.deque] = {"ocs": collections.deque(),
                                          "chip": collections.deque()}
    # The benchmark's own records are allocated and touched up front, so that the RSS it
    # reports at the end is the GUI's, not the growth of these arrays.
    room = int(args.duration * max(args.rate, 200) * 1.2) + 1000
    latencies = {k: _Record(room) for k in ("ocs", "chip")}
    paint_s = {k: _Record(room) for k in ("ocs", "chip")}
    frames = {"ocs": [0, None, None], "chip": [0, None, None]}   # count after warm-up, first, last
    warm_s = min(5.0, args.duration / 10)                          # leave out the first repaints

    def on_painted(name: str, seq: int) -> None:
        now = time.perf_counter()
        if now - t_start >= warm_s:
            f = frames[name]
            f[0] += 1
            f[1] = now if f[1] is None else f[1]
            f[2] = now
        queue = sent[name]
        while queue and queue[0][0] <= seq:
            latencies[name].append(now - queue.popleft()[1])

    t_start = time.perf_counter()
    for name, sv in view.views.items():
        sv.painted.connect(on_painted)
        draw = sv.draw

        def timed(p, draw=draw, name=name):
            t = time.perf_counter()
            draw(p)
            paint_s[name].append(time.perf_counter() - t)
        sv.draw = timed

    stop = threading.Event()
    posted = [0]

    def feed() -> None:
        """The bus adapter's thread: one state change every 1/rate s, alternating switches."""
        frng = random.Random(args.seed + 1)
        out = dict(ocs)
        chip_cells = {k: dict(v) for k, v in cells.items()}
        ids = sorted(chip_cells)
        seq, t0 = 0, time.perf_counter()
        while not stop.is_set():
            seq += 1
            if seq % 2:
                a, b = frng.sample(range(1, n + 1), 2)
                out[a], out[b] = out[b], out[a]
                delta = {"seq": seq, "op": "switch",
                         "value": {"name": "ocs", "circuits": dict(out),
                                   "power_dbm": {out[a]: frng.uniform(-20, -3),
                                                 out[b]: frng.uniform(-20, -3)}}}
                target = "ocs"
            else:
                cid = frng.choice(ids)
                state = "cross" if chip_cells[cid]["state"] == "bar" else "bar"
                chip_cells[cid] = {"state": state, "theta": 0.0, "phi": 0.0}
                delta = {"seq": seq, "op": "cells", "name": "chip",
                         "value": {cid: dict(chip_cells[cid])}}
                target = "chip"
            sent[target].append((seq, time.perf_counter()))
            model.post_delta(delta)
            posted[0] = seq
            wait = t0 + seq / args.rate - time.perf_counter()
            if wait > 0:
                stop.wait(wait)

    rss: list[tuple[float, float]] = []

    def sample() -> None:
        rss.append((time.perf_counter() - t_start, rss_mib()))

    sampler = QTimer()
    sampler.timeout.connect(sample)
    sampler.start(max(1000, int(args.duration * 1000 / 60)))
    feeder = threading.Thread(target=feed, name="bench-feed", daemon=True)
    QTimer.singleShot(0, sample)
    QTimer.singleShot(0, feeder.start)
    QTimer.singleShot(int(args.duration * 1000), app.quit)
    app.exec()
    stop.set()
    feeder.join(timeout=2)
    sample()
    view.close()

    rows, result = [], {"duration_s": args.duration, "rate_per_s": args.rate,
                        "changes_posted": posted[0], "size": args.size, "views": {}}
    for name in ("ocs", "chip"):
        count, first, last = frames[name]
        fps = (count - 1) / (last - first) if count > 1 and last > first else 0.0
        lat, paint = latencies[name].done(), paint_s[name].done()
        per = {"fps": fps, "frames_after_warmup": count, "changes_shown": len(lat),
               "latency_p50_ms": float(np.percentile(lat, 50)) * 1e3 if len(lat) else None,
               "latency_p99_ms": float(np.percentile(lat, 99)) * 1e3 if len(lat) else None,
               "latency_max_ms": float(lat.max()) * 1e3 if len(lat) else None,
               "paint_p50_ms": float(np.percentile(paint, 50)) * 1e3,
               "paint_p99_ms": float(np.percentile(paint, 99)) * 1e3}
        result["views"][name] = per
        label = f"{n}-port OCS matrix" if name == "ocs" else "16x16 Benes chip"
        rows.append({"view": label, "fps": f"{fps:.1f}", "changes": len(lat),
                     "latency_p50_ms": f"{per['latency_p50_ms']:.1f}",
                     "latency_p99_ms": f"{per['latency_p99_ms']:.1f}",
                     "paint_p50_ms": f"{per['paint_p50_ms']:.2f}"})
    settled = next((m for t, m in rss if t >= min(30.0, args.duration / 5)), rss[-1][1])
    result["rss_mib"] = {"start": rss[0][1], "settled": settled, "end": rss[-1][1],
                         "samples": rss}
    result["rows"] = rows
    fps_ok = all(v["fps"] >= 30 for v in result["views"].values())
    p99_ok = all((v["latency_p99_ms"] or 1e9) <= 50 for v in result["views"].values())
    result["notes"] = [
        f"{posted[0]} changes posted in {args.duration:g} s from a background thread; "
        f"goals: >= 30 fps ({'met' if fps_ok else 'NOT met'}), "
        f"p99 change-to-repaint <= 50 ms ({'met' if p99_ok else 'NOT met'})",
        f"RSS {rss[0][1]:.1f} MiB at start, {settled:.1f} MiB once warm "
        f"({min(30.0, args.duration / 5):g} s), {rss[-1][1]:.1f} MiB at the end "
        f"({rss[-1][1] - settled:+.1f} MiB since warm)"]
    return result
