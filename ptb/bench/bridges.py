"""The bridges' cost per reading against the bus alone, in one run: a power meter port of the
opus rig (its averaging time 0, so that the path is what is timed) read through

    bus        `read_power` from a ServiceClient (what every bridge stands on)
    facade     hil.bridges.devices.Meter over the bus (units, limits, the access's lock)
    ophyd      the ophyd-async MeterPort: `trigger()` then `read()`, awaited on an event loop
    bluesky    a RunEngine `count` of that port: one event (trigger, read, documents) per reading
    leco       a pyleco Director's `call_action("read", 1)` through a LECO coordinator to
               `ptb leco` (its own process, the coordinator in it) and on to the bus

in alternating rounds (a load that comes and goes meets every path alike), and beside them each
ecosystem's own cost with no device behind it: a RunEngine `count` of an ophyd-async soft
signal, and a LECO `get_parameters` of a value the actor holds (the meter's port count).

The device services run in their own processes, as `ptb serve` runs them, the meter's with its
Prometheus metrics on; the metrics' own cost: a scrape's time, and `read_power` while a scraper
asks 10 times a second against none.
"""
from __future__ import annotations

import asyncio
import dataclasses
import os
import pathlib
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from typing import Any

import numpy as np

from photonic_testbed.emulator.rig import EmulatedRig
from photonic_testbed.hil import rig as rigfile
from photonic_testbed.hil.bus.client import ServiceClient
from photonic_testbed.hil.devices.supervisor import Manager
from photonic_testbed.hil.rig import rig_spec
from photonic_testbed.hil.rig.emulated import free_port
from photonic_testbed.ptb.bench import SEED, integer
from photonic_testbed.ptb.cli import CommandFailed

NAME = "bridges"
HELP = ("a meter reading through the bus alone, the bridges' facade, ophyd-async, a Bluesky "
        "RunEngine and LECO (ptb leco): p50/p99 and the overhead over the bus; the metrics' "
        "own cost")
PATHS = ("bus", "facade", "ophyd", "bluesky", "leco", "bluesky, no device", "leco, no device")
ASK_S = 30.0            # a LECO request's deadline (pyleco's default, 0.1 s, is no deadline)


def add_arguments(p) -> None:
    p.add_argument("--readings", type=integer(10, 10 ** 6), default=400,
                   help="readings per path (default 400)")
    p.add_argument("--rounds", type=integer(1, 1000), default=8,
                   help="alternating rounds the readings are split into (default 8)")
    p.add_argument("--seed", type=SEED, default=0)


def _us(samples: list[float]) -> tuple[float, float]:
    a = np.asarray(samples) * 1e6
    return float(np.percentile(a, 50)), float(np.percentile(a, 99))


class _Paths:
    """One reading of meter port 1 by each path, timed."""

    def __init__(self, rig, endpoint: str, leco_port: int):
        from bluesky import RunEngine
        from bluesky import plans as bp
        from ophyd_async.core import soft_signal_r_and_setter
        from ophyd_async.plan_stubs import ensure_connected
        from pyleco.directors.director import Director

        from photonic_testbed.hil.bridges import bluesky as bridge
        from photonic_testbed.hil.bridges import devices as bridged
        from photonic_testbed.hil.bridges.access import open_rig
        self.client = ServiceClient(endpoint, timeout=10)
        self.facade = bridged.Meter(open_rig(rig, ["powermeter"])["powermeter"])
        self.devices = bridge.rig_devices(rig, ["powermeter"])
        meter = self.devices["powermeter"]
        assert isinstance(meter, bridge.PowerMeter)
        self.port = meter.port[1]
        self.RE = RunEngine({})
        self.RE(ensure_connected(self.devices["powermeter"]))
        self.count = bp.count
        self.soft, _ = soft_signal_r_and_setter(float, 1.0, name="soft")
        self.RE(ensure_connected(self.soft))
        self.loop = asyncio.new_event_loop()
        self.director = Director(actor="powermeter", name="bench-bridges", host="127.0.0.1",
                                 port=leco_port, timeout=ASK_S)

    async def _ophyd(self) -> None:
        await self.port.trigger()
        await self.port.read()

    def timed(self, path: str, n: int) -> list[float]:
        if path.startswith("bluesky"):      # one run of n events: the time per event
            events: list[float] = []
            self.RE(self.count([self.port if path == "bluesky" else self.soft], num=n),
                    lambda name, doc: events.append(time.perf_counter())
                    if name == "event" else None)
            return list(np.diff(events))
        read = {"bus": lambda: self.client.call("read_power", channels=[1]),
                "facade": lambda: self.facade.read(1),
                "ophyd": lambda: self.loop.run_until_complete(self._ophyd()),
                "leco": lambda: self.director.call_action("read", 1),
                "leco, no device": lambda: self.director.get_parameters(["ports"])}[path]
        out = []
        for _ in range(n):
            t = time.perf_counter()
            read()
            out.append(time.perf_counter() - t)
        return out

    def close(self) -> None:
        from photonic_testbed.hil.bridges import bluesky as bridge
        self.director.close()
        bridge.close(self.devices)
        self.facade.close()
        self.client.close()
        self.loop.close()


def _scrape(url: str) -> float:
    t = time.perf_counter()
    with urllib.request.urlopen(url, timeout=10) as r:
        r.read()
    return time.perf_counter() - t


def _metrics_cost(client: ServiceClient, url: str, n: int, rounds: int) -> dict[str, Any]:
    """A scrape's time; `read_power` with a scraper asking at 10 Hz against none."""
    scrapes = [_scrape(url) for _ in range(max(20, n // 10))]
    quiet: list[float] = []
    scraped: list[float] = []
    for _ in range(rounds):
        for got, scraping in ((quiet, False), (scraped, True)):
            stop = threading.Event()
            scraper = threading.Thread(
                target=lambda s=stop: [_scrape(url) for _ in iter(lambda: s.wait(0.1), True)],
                daemon=True)
            if scraping:
                scraper.start()
            for _ in range(n // rounds):
                t = time.perf_counter()
                client.call("read_power", channels=[1])
                got.append(time.perf_counter() - t)
            stop.set()
            if scraping:
                scraper.join(5)
    return {"scrape": scrapes, "quiet": quiet, "scraped": scraped}


def run(args) -> dict:
    try:
        import bluesky  # noqa: F401
        import ophyd_async  # noqa: F401
        import pyleco  # noqa: F401
    except ImportError as e:
        raise CommandFailed(f"ptb bench bridges needs the bridges' extras ({e.name} is not "
                            "installed): pip install 'photonic-testbed[bluesky,leco]'") from None
    work = pathlib.Path(tempfile.mkdtemp(prefix="ptb-bench-bridges-"))
    samples: dict[str, list[float]] = {p: [] for p in PATHS}
    with EmulatedRig(rig_spec("opus"), seed=args.seed, switching_s=0.0) as emulated:
        from photonic_testbed.drivers.power_meter import PowerMeter
        with PowerMeter(emulated.endpoints["powermeter"]) as meter:
            meter.set_averaging_time(1, 0.0)          # the path is timed, not the averaging
        rig = rigfile.for_emulator("opus", emulated.endpoints)
        rigfile.write(work / "rig.toml", rig)
        metrics_port = free_port()
        specs = [dataclasses.replace(s, telemetry_hz=0.0,
                                     metrics=f"127.0.0.1:{metrics_port}")
                 if s.name == "powermeter" else s for s in rig.service_specs()]
        manager = Manager(specs)
        leco = None
        paths = None
        try:
            endpoint = manager.start()["powermeter"][0]
            leco_port = free_port()
            leco = subprocess.Popen(
                [sys.executable, "-m", "photonic_testbed.ptb", "leco", "--rig",
                 str(work / "rig.toml"), "--device", "powermeter", "--serve-coordinator",
                 "--coordinator", f"127.0.0.1:{leco_port}"],
                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                env=dict(os.environ))
            assert leco.stdout is not None
            said: list[str] = []
            for line in leco.stdout:                  # until its actor is up, or it ended
                said.append(line)
                if "signed in" in line:
                    break
            else:
                raise CommandFailed(f"ptb leco did not start: {''.join(said)}")
            threading.Thread(target=leco.stdout.read, daemon=True).start()   # (drained)
            paths = _Paths(rig, endpoint, leco_port)
            for p in PATHS:                            # warm up every path
                paths.timed(p, 10)
            per_round = max(2, args.readings // args.rounds)
            for k in range(args.rounds):
                for p in (PATHS if k % 2 == 0 else PATHS[::-1]):
                    samples[p] += paths.timed(p, per_round)
            cost = _metrics_cost(paths.client, f"http://127.0.0.1:{metrics_port}/metrics",
                                 args.readings, args.rounds)
        finally:
            if paths is not None:
                paths.close()
            if leco is not None:
                leco.terminate()
                leco.wait(30)
            manager.close()
    bus50, bus99 = _us(samples["bus"])
    rows = []
    for p in PATHS:
        p50, p99 = _us(samples[p])
        alone = p.endswith("no device")
        rows.append({"path": p, "readings": len(samples[p]), "p50_us": f"{p50:.0f}",
                     "p99_us": f"{p99:.0f}", "over_bus_us": "" if alone else f"{p50 - bus50:+.0f}",
                     "ratio": "" if alone else f"{p50 / bus50:.2f}x"})
    s50, s99 = _us(cost["scrape"])
    q50, q99 = _us(cost["quiet"])
    b50, b99 = _us(cost["scraped"])
    rows.append({"path": "metrics scrape", "readings": len(cost["scrape"]),
                 "p50_us": f"{s50:.0f}", "p99_us": f"{s99:.0f}", "over_bus_us": "",
                 "ratio": ""})
    rows.append({"path": "bus, scraped at 10 Hz", "readings": len(cost["scraped"]),
                 "p50_us": f"{b50:.0f}", "p99_us": f"{b99:.0f}",
                 "over_bus_us": f"{b50 - q50:+.0f}", "ratio": f"{b50 / q50:.2f}x"})
    return {"rows": rows, "load": os.getloadavg(),
            "samples_us": {p: [round(x * 1e6, 1) for x in v] for p, v in samples.items()},
            "metrics_us": {k: [round(x * 1e6, 1) for x in v] for k, v in cost.items()},
            "notes": [f"bus alone without a scraper in the metrics rounds: p50 {q50:.0f} us "
                      f"(p99 {q99:.0f} us)",
                      f"load average at the end: {os.getloadavg()[0]:.2f}"]}
