"""The GUI's port map under load, offscreen, with the cockpit around it (the alarm banner, the
trends and the job view, fed as the bus adapter feeds them: received power of every GPU link
and heater power twice a second, the job's report twice a second): frames per second of the
port map while state changes arrive from a background thread, the time from a change being
posted to the repaint that shows it, the trends' and job view's refresh times, and the
process's memory over the run."""
from __future__ import annotations

import collections
import os
import random
import threading
import time
from typing import Any

import numpy as np

from photonic_testbed.ptb.bench import SEED, integer, number

NAME = "gui"
HELP = ("port map fps and change-to-repaint latency under a stream of state changes, with the "
        "trends and the job view on screen (offscreen)")


def add_arguments(p) -> None:
    p.add_argument("--duration", type=number(0, 7 * 86400, above=True), default=10.0,
                   help="seconds of updates (default %(default)s; the issue's check is 600)")
    p.add_argument("--rate", type=number(0, 1e6, above=True), default=100.0,
                   help="state changes per second, split between the OCS and the chip")
    p.add_argument("--ocs-ports", type=integer(2, 1024), default=64)
    p.add_argument("--size", type=_size, default="1600x800", help="port map size in pixels, WxH")
    p.add_argument("--seed", type=SEED, default=0)
    p.add_argument("--portmap-only", action="store_true",
                   help="the port map alone, without the banner, trends and job view (the "
                   "measurement before the cockpit)")
    p.add_argument("--links", type=integer(0, 1024), default=16,
                   help="GPU links whose received power the trends draw (default 16)")


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
    from PySide6.QtWidgets import QApplication, QSplitter, QVBoxLayout, QWidget

    from photonic_testbed.common.topology import Topology
    from photonic_testbed.gui.alarms import AlarmBanner
    from photonic_testbed.gui.demo import benes_topology, chip_circuits
    from photonic_testbed.gui.jobs import JobsView
    from photonic_testbed.gui.model import FabricModel
    from photonic_testbed.gui.portmap import PortMapView
    from photonic_testbed.gui.trends import TrendsView
    from photonic_testbed.hil.bus.schema import circuits_to_wire
    from photonic_testbed.hil.bus.state import Set

    app = QApplication.instance() or QApplication([])
    rng = random.Random(args.seed)
    n = args.ocs_ports
    ocs = {i: n + o for i, o in zip(range(1, n + 1), rng.sample(range(1, n + 1), n), strict=True)}
    topo = benes_topology(16, "chip")
    cells = {c["id"]: {"state": rng.choice(["bar", "cross"]), "theta": 0.0, "phi": 0.0}
             for c in topo["cells"]}
    circuits = chip_circuits(Topology.from_dict(topo), cells)
    model = FabricModel()
    # the devices' states as the bus has them (gui/model.py)
    model.set_topology("chip", topo)
    model.apply_snapshot("ocs", "switch", {"ports": n, "circuits": circuits_to_wire(ocs)})
    model.set_power("ocs", {p: -5.0 for p in range(1, 2 * n + 1)})
    model.apply_snapshot("chip", "chip", {"ports": 16, "circuits": circuits_to_wire(circuits),
                                          "cells": cells})
    n_links = max(0, min(args.links, n))
    model.apply_snapshot("agent", "agent", {"rack": [
        {"name": f"gpu{i}", "switch": "ocs", "port": i + 1, "health": "ok", "role": "active",
         "rank": i, "job": "bench"} for i in range(n_links)], "events": [], "jobs": {},
        "alarms": []})
    model.set_service("agent", "connected")
    view = PortMapView(model)
    w, h = (int(x) for x in args.size.split("x"))
    cockpit = None
    trends = jobs = None
    if args.portmap_only:
        view.resize(w, h)
        view.show()
    else:
        # The window's parts as MainWindow lays them out: banner, port map, and below it
        # the trends beside the job view.
        cockpit = QWidget()
        box = QVBoxLayout(cockpit)
        box.setContentsMargins(0, 0, 0, 0)
        box.addWidget(AlarmBanner(model))
        view.setFixedSize(w, h)
        box.addWidget(view)
        below = QSplitter()
        trends = TrendsView(model)
        jobs = JobsView(model)
        below.addWidget(trends)
        below.addWidget(jobs)
        below.setSizes([w * 6 // 10, w * 4 // 10])
        below.setFixedHeight(380)
        box.addWidget(below)
        cockpit.resize(w, h + 420)
        cockpit.show()

    sent: dict[str, collections.deque] = {"ocs": collections.deque(),
                                          "chip": collections.deque()}
    # The benchmark's own records are allocated and touched up front, so that the RSS it
    # reports at the end is the GUI's, not the growth of these arrays.
    room = int(args.duration * max(args.rate, 200) * 1.2) + 1000
    latencies = {k: _Record(room) for k in ("ocs", "chip")}
    paint_s = {k: _Record(room) for k in ("ocs", "chip")}
    # count after warm-up, first, last
    frames: dict[str, list[Any]] = {"ocs": [0, None, None], "chip": [0, None, None]}
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

    refresh_s = {k: _Record(int(args.duration * 4) + 100) for k in ("trends", "jobs")}
    for key, widget in (("trends", trends), ("jobs", jobs)):
        if widget is not None:
            refresh = widget.refresh

            def timed_refresh(refresh=refresh, key=key):
                t = time.perf_counter()
                refresh()
                refresh_s[key].append(time.perf_counter() - t)
            widget.timer.timeout.disconnect()
            widget.timer.timeout.connect(timed_refresh)

    t_start = time.perf_counter()
    for name, sv in view.views.items():
        sv.painted.connect(on_painted)
        draw = sv.draw

        def timed(p, draw=draw, name=name):
            t = time.perf_counter()
            draw(p)
            paint_s[name].append(time.perf_counter() - t)
        sv.draw = timed                          # type: ignore[method-assign]  # timed here

    stop = threading.Event()
    posted = [0]

    def feed() -> None:
        """The bus adapter's thread: one state change every 1/rate s, alternating switches."""
        frng = random.Random(args.seed + 1)
        out = dict(ocs)
        chip_cells = {k: dict(v) for k, v in cells.items()}
        ids = sorted(chip_cells)
        seq, t0 = model.seq, time.perf_counter()   # (the model counts the changes it applies)
        next_cockpit, step = t0, 0
        while not stop.is_set():
            now = time.perf_counter()
            if not args.portmap_only and now >= next_cockpit:
                # What the bus adapter posts for the trends and the job view, twice a second.
                next_cockpit += 0.5
                step += 1
                wall = time.time()
                samples = {f"rx/gpu{i}": [[wall, -3.0 - 2 * frng.random()]]
                           for i in range(n_links)}
                samples["heater/chip"] = [[wall, 800 + 50 * frng.random()]]
                model.post_samples(samples)
                model.post_change("agent", [Set(["jobs"], {"bench": {
                    "plan": "dp", "world": n_links,
                    "rank_map": {str(i): f"gpu{i}" for i in range(n_links)},
                    "phase": "dp", "round": step, "restart": {"seq": 0},
                    "report": {"state": "running", "step": 10 * step,
                               "throughput": 9.5 + frng.random(), "loss": 2.0 / step,
                               "detail": "", "t": wall}}})])
                seq += 1
            seq += 1
            if posted[0] % 2 == 0:
                a, b = frng.sample(range(1, n + 1), 2)
                out[a], out[b] = out[b], out[a]
                target = "ocs"
                sent[target].append((seq, time.perf_counter()))
                model.post_change("ocs", [Set(["circuits"], circuits_to_wire(out))])
                model.post_power("ocs", {out[a]: frng.uniform(-20, -3),
                                         out[b]: frng.uniform(-20, -3)})
            else:
                cid = frng.choice(ids)
                state = "cross" if chip_cells[cid]["state"] == "bar" else "bar"
                chip_cells[cid] = {"state": state, "theta": 0.0, "phi": 0.0}
                target = "chip"
                sent[target].append((seq, time.perf_counter()))
                model.post_change("chip", [Set(["cells", cid], dict(chip_cells[cid]))])
            posted[0] += 1
            wait = t0 + posted[0] / args.rate - time.perf_counter()
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
    (cockpit or view).close()

    rows, result = [], {"duration_s": args.duration, "rate_per_s": args.rate,
                        "changes_posted": posted[0], "size": args.size, "views": {},
                        "cockpit": not args.portmap_only, "links": n_links}
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
    for key, rec in refresh_s.items():
        got = rec.done()
        if len(got):
            result[f"{key}_refresh_ms"] = {"count": len(got),
                                           "p50": float(np.percentile(got, 50)) * 1e3,
                                           "p99": float(np.percentile(got, 99)) * 1e3,
                                           "max": float(got.max()) * 1e3}
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
    for key in ("trends", "jobs"):
        timing = result.get(f"{key}_refresh_ms")
        if timing:
            result["notes"].append(f"{key} view refresh (once a second): "
                                   f"p50 {timing['p50']:.1f} ms, p99 {timing['p99']:.1f} ms, "
                                   f"max {timing['max']:.1f} ms over {timing['count']}")
    if not args.portmap_only:
        result["notes"].append(f"with the alarm banner, the trends ({n_links} links, heaters, "
                               "job throughput and loss) and the job view on screen")
    return result
