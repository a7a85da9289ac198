"""The GPU health monitor of a real host (`ptb gpus`): the counterpart of the emulated rack's.

It publishes exactly what the emulator's monitor publishes (emulator/rackhost.py), so the
agent runs unchanged on a real host:

- device `gpus` on the rig's gpus endpoints (or, for a rig with one monitor per host in
  [monitors], device `gpus-HOST` on that host's), with `Server`: state `{"gpus": {name:
  GpuHealth.to_dict()}}`, one delta whenever a GPU's state (or its reasons) changes. Names are
  the rig's [[gpus]] names; each says which NVML GPU it is with `nvml = INDEX` or
  `nvml = "GPU-uuid"`. Health comes from `hil.gpus.health.NvmlHealth`: Xid events (waited for
  between requests, so a fatal Xid is published within a tick), and every `poll_s` the
  temperature, uncorrected ECC, PCIe replays and NVLink errors.
- request `rx_power` `{"switch": s, "ports": [output ports]}` -> `{"dbm": {"port": dBm}}`: the
  received power that the transceiver on each output port reports through DDM (`hil.gpus.ddm`,
  `ethtool -m` on the GPU's `iface`). A port whose transceiver cannot be read is reported dark
  (DARK_DBM) and named with the reason under `"errors"` (the agent then sees no light).
- request `clear_gpu` `{"gpu": name}`: forget a GPU's fatal Xids (after the GPU was reset);
  `describe`: which NVML GPU and which transceiver each monitored rig GPU is.

What a real host needs beyond the raw NVML counters, and the emulator does not:

- A fatal Xid is kept: the GPU stays failed until `clear_gpu` or a restart of the monitor
  (NVML reports each event once; a GPU after Xid 79 does not heal by itself). Other Xids are
  shown for `xid_hold_s`.
- PCIe replays and NVLink errors are cumulative counters since boot; a healthy GPU may carry a
  few. The monitor reports their increase over the last `window_s`, so a GPU is degraded while
  the counters grow, not forever.
- The output ports: GPU on input port p hears output N + p (common/rack_layout.py). N is the
  switch's port count, asked from the switch's service (`snapshot`) the first time, unless
  given (`switch_ports`).
"""
from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from photonic_testbed.hil.bus import schema
from photonic_testbed.hil.bus.client import BusError, ServiceClient
from photonic_testbed.hil.bus.server import Server
from photonic_testbed.hil.bus.state import Set
from photonic_testbed.hil.gpus.ddm import DARK_DBM, DdmError, DdmReader
from photonic_testbed.hil.gpus.health import (
    FATAL_XIDS,
    LOST_REASON,
    GpuHealth,
    NvmlHealth,
    classify,
)
from photonic_testbed.hil.rig import GpuConfig, Rig, monitor_device

log = logging.getLogger(__name__)

TICK_S = 0.01          # longest wait between looks for Xid events
POLL_S = 1.0           # full read of every GPU's counters
XID_HOLD_S = 60.0      # a non-fatal Xid is shown this long
WINDOW_S = 60.0        # PCIe replays / NVLink errors count over this window


class GpuMonitorError(Exception):
    """The monitor cannot run as the rig says (a GPU mapping that does not match this host,
    nothing to monitor), or a request it cannot answer."""


@dataclass(frozen=True)
class Transceiver:
    """The transceiver that a GPU's receiver is, on one switch's port."""
    gpu: str
    switch: str
    port: int                 # the switch input port of the GPU (its RX is output N + port)
    iface: str
    lane: int | None = None


def map_nvml(gpus: tuple[GpuConfig, ...], uuids: list[str]) -> dict[str, str]:
    """NVML UUID -> rig GPU name for the rig GPUs that name an NVML GPU of this host.
    GpuMonitorError when one names an index or UUID that NVML does not see here, or two name
    the same GPU."""
    out: dict[str, str] = {}
    known = {u.lower(): u for u in uuids}
    for g in gpus:
        if g.nvml is None:
            continue
        if isinstance(g.nvml, int):
            if not 0 <= g.nvml < len(uuids):
                raise GpuMonitorError(
                    f"rig GPU {g.name}: nvml = {g.nvml}, but NVML sees {len(uuids)} GPU(s) "
                    f"here, indices 0..{len(uuids) - 1}")
            uuid = uuids[g.nvml]
        else:
            if g.nvml.lower() not in known:
                raise GpuMonitorError(
                    f"rig GPU {g.name}: nvml = {g.nvml!r} is not a GPU of this host; NVML sees "
                    + ", ".join(f"{i}: {u}" for i, u in enumerate(uuids)))
            uuid = known[g.nvml.lower()]
        if uuid in out:
            raise GpuMonitorError(f"rig GPUs {out[uuid]} and {g.name} are both NVML GPU {uuid}")
        out[uuid] = g.name
    return out


class _Track:
    """One GPU's history: kept Xids and counter samples."""

    def __init__(self) -> None:
        self.fatal: list[int] = []
        self.recent: list[tuple[float, int]] = []
        self.samples: collections.deque[tuple[float, int, int]] = collections.deque()
        self.last: GpuHealth | None = None

    def counts(self, now: float, replays: int, nvlink: int, window_s: float) -> tuple[int, int]:
        """Increase of the cumulative counters over the window (a counter that went down,
        after a driver reload, starts afresh)."""
        s = self.samples
        if s and (replays < s[-1][1] or nvlink < s[-1][2]):
            s.clear()
        s.append((now, replays, nvlink))
        while len(s) > 1 and s[1][0] <= now - window_s:
            s.popleft()
        return replays - s[0][1], nvlink - s[0][2]


class GpuMonitor:
    """Health of this host's GPUs and power of their transceivers, on the bus as `gpus`.

    `nvml` is an open NvmlHealth (None: publish no health, only answer rx_power); `ddm` reads
    transceivers (None: a DdmReader running ethtool). `host` keeps only the rig's GPUs of that
    host. `switch_ports` gives switches' port counts N instead of asking their services."""

    def __init__(self, rig: Rig, *, nvml: NvmlHealth | None, ddm: DdmReader | None = None,
                 host: str | None = None, switch_ports: Mapping[str, int] | None = None,
                 poll_s: float = POLL_S, tick_s: float = TICK_S, xid_hold_s: float = XID_HOLD_S,
                 window_s: float = WINDOW_S, clock=time.monotonic):
        self.rig = rig
        gpus = tuple(g for g in rig.gpus if host is None or g.host == host)
        if host is not None and not gpus:
            raise GpuMonitorError(f"no [[gpus]] of rig {rig.name} has host = {host!r}; hosts: "
                                  + ", ".join(sorted({g.host or '(none)' for g in rig.gpus})))
        hosts = sorted({g.host for g in gpus if g.nvml is not None or g.iface})
        if host is None and len(hosts) > 1:
            raise GpuMonitorError(f"the [[gpus]] of rig {rig.name} sit on hosts "
                                  f"{', '.join(h or '(none)' for h in hosts)}: say which one "
                                  "this is (--host NAME); each host runs its own monitor")
        if rig.monitors:
            if host not in rig.monitors:
                raise GpuMonitorError(
                    f"rig {rig.name} runs one GPU monitor per host ([monitors]: "
                    f"{', '.join(rig.monitors)}): say which one this is (--host NAME)"
                    + ("" if host is None else f", not {host!r}"))
            self.device = monitor_device(host)
            default_request, default_publish = rig.monitors[host]
        else:
            self.device = "gpus"
            default_request, default_publish = rig.gpus_endpoints()
        self.health = nvml
        self.names = map_nvml(gpus, nvml.uuids) if nvml is not None else {}
        if nvml is not None:
            unmapped = [g.name for g in gpus if g.nvml is None]
            if not self.names:
                raise GpuMonitorError(
                    f"no [[gpus]] of rig {rig.name} says which NVML GPU it is: add "
                    "nvml = INDEX or nvml = \"GPU-uuid\" (`nvidia-smi -L` lists them)")
            if unmapped:
                log.info("no health for %s (no nvml key)", ", ".join(unmapped))
            ignored = [u for u in nvml.uuids if u not in self.names]
            if ignored:
                log.info("NVML GPUs not in the rig, not monitored: %s", ", ".join(ignored))
        self.transceivers = {(g.switch, g.port): Transceiver(g.name, g.switch, g.port, g.iface,
                                                             g.lane)
                             for g in gpus if g.iface}
        if nvml is None and not self.transceivers:
            raise GpuMonitorError(f"nothing to monitor: no NVML, and no [[gpus]] of rig "
                                  f"{rig.name} names its transceiver's iface")
        self.switches = sorted({g.switch for g in gpus})      # those of this host's GPUs
        self.ddm = ddm if ddm is not None else DdmReader()
        self._ports = dict(switch_ports or {})
        self._reader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rx-power")
        self.poll_s, self.tick_s = poll_s, tick_s
        self.xid_hold_s, self.window_s = xid_hold_s, window_s
        self.clock = clock
        self._tracks = {name: _Track() for name in self.names.values()}
        try:
            first = self._check() if nvml is not None else []
        except Exception as e:
            if nvml is None or not isinstance(e, nvml.nvml.NVMLError):
                raise
            raise GpuMonitorError(f"cannot read the GPUs through NVML: {e}") from None
        self.server = Server(
            self.device, {"gpus": {h.gpu: h.to_dict() for h in first}}, kind="gpu_monitor",
            request=rig.bind_endpoint(default_request),
            publish=rig.bind_endpoint(default_publish),
            keys=rig.server_keys(), heartbeat=rig.bus.heartbeat_s,
            handlers={"rx_power": self._rx_power, "clear_gpu": self._clear_gpu,
                      "describe": self._describe})
        self.endpoints: tuple[str, str] | None = None
        self._next_poll = self.clock() + poll_s
        self._nvml_errors = 0

    # --- lifecycle --------------------------------------------------------------------------
    def start(self) -> tuple[str, str]:
        """Bind the bus sockets; returns the (request, publish) endpoints bound."""
        self.endpoints = self.server.bind()
        log.info("GPU monitor of rig %s: %d GPU(s) by NVML, %d transceiver(s) by DDM, on %s",
                 self.rig.name, len(self.names), len(self.transceivers), self.endpoints[1])
        return self.endpoints

    def run(self, stop: threading.Event) -> None:
        while not stop.is_set():
            self.step()

    def close(self) -> None:
        """Stop answering and close the transceiver reader (given or made here)."""
        self._reader.shutdown(wait=False, cancel_futures=True)
        self.server.close()
        self.ddm.close()

    def __enter__(self) -> GpuMonitor:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # --- the loop ---------------------------------------------------------------------------
    def step(self) -> None:
        """Answer requests (waiting at most a tick), take in Xid events, and read every GPU
        when an Xid came or a poll is due; publish the GPUs whose state changed."""
        self.server.poll(self.tick_s)
        if self.health is None:
            return
        xid = False
        try:
            for _ in range(64):                 # bounded: a storm of events waits a tick
                got = self.health.wait_xid(0)
                if got is None:
                    break
                log.warning("Xid %d on %s (%s)", got[1], self.names.get(got[0], "not in the "
                            "rig"), got[0])
                xid = True
        except self.health.nvml.NVMLError as e:
            self._nvml_failed("waiting for Xid events", e)
        if xid or self.clock() >= self._next_poll:
            self._next_poll = self.clock() + self.poll_s
            try:
                changed = self._check()
            except self.health.nvml.NVMLError as e:
                self._nvml_failed("reading the GPUs", e)
                return
            if changed:
                self.server.change([Set(["gpus", h.gpu], h.to_dict()) for h in changed])

    def _nvml_failed(self, what: str, e: Exception) -> None:
        self._nvml_errors += 1
        if self._nvml_errors <= 3 or self._nvml_errors % 100 == 0:
            log.warning("NVML error %s (%d so far): %s", what, self._nvml_errors, e)

    def _check(self) -> list[GpuHealth]:
        """Read every mapped GPU; returns the health of those whose state or reasons changed
        (every one, the first time; none without NVML)."""
        if self.health is None:
            return []
        now = self.clock()
        changed = []
        for raw in self.health.poll():
            name = self.names.get(raw.gpu)
            if name is None:
                continue
            t = self._tracks[name]
            t.fatal += [x for x in raw.xids if x in FATAL_XIDS and x not in t.fatal]
            t.recent = [(at, x) for at, x in t.recent if at > now - self.xid_hold_s]
            t.recent += [(now, x) for x in raw.xids if x not in FATAL_XIDS]
            replays, nvlink = t.counts(now, raw.pcie_replays, raw.nvlink_errors, self.window_s)
            xids = tuple(t.fatal) + tuple(dict.fromkeys(x for _, x in t.recent))
            h = classify(name, temperature_c=raw.temperature_c,
                         ecc_uncorrected=raw.ecc_uncorrected, pcie_replays=replays,
                         nvlink_errors=nvlink, xids=xids, lost=LOST_REASON in raw.reasons)
            if t.last is None or (h.state, h.reasons) != (t.last.state, t.last.reasons):
                if t.last is not None:
                    log.info("GPU %s is %s: %s", name, h.state, "; ".join(h.reasons) or "-")
                t.last = h
                changed.append(h)
        return changed

    # --- requests ---------------------------------------------------------------------------
    def _clear_gpu(self, args: schema.GpuArgs) -> dict:
        name = args.gpu
        if name not in self._tracks:
            raise GpuMonitorError(f"clear_gpu takes a GPU this monitor watches "
                                  f"({', '.join(sorted(self._tracks)) or 'none'}), not {name!r}")
        t = self._tracks[name]
        cleared, t.fatal, t.recent = list(t.fatal), [], []
        log.info("GPU %s: Xids %s cleared by request", name, cleared or "(none)")
        self._next_poll = self.clock()          # re-read and publish at the next step
        return {"gpu": name, "cleared_xids": cleared}

    def _describe(self, args: schema.Args) -> dict:
        """Which NVML GPU and which transceiver each monitored rig GPU is."""
        uuid_of = {name: uuid for uuid, name in self.names.items()}
        out: dict[str, dict] = {name: {"nvml": uuid} for name, uuid in uuid_of.items()}
        for t in self.transceivers.values():
            out.setdefault(t.gpu, {"nvml": None}).update(
                {"switch": t.switch, "port": t.port, "iface": t.iface, "lane": t.lane})
        return {"kind": "gpu_monitor", "rig": self.rig.name, "nvml": self.health is not None,
                "gpus": out}

    def switch_ports(self, switch: str) -> int:
        """N of a switch (inputs 1..N, outputs N+1..2N): given, or asked from its service."""
        n = self._ports.get(switch)
        if n is not None:
            return n
        endpoints = self.rig.endpoints()
        if switch not in endpoints:
            raise GpuMonitorError(f"switch {switch} is not a device of rig {self.rig.name}")
        try:
            with ServiceClient(endpoints[switch][0], keys=self.rig.client_keys(),
                               timeout=1.0) as client:
                n = int(client.call("snapshot")["state"]["ports"])
        except (BusError, KeyError, TypeError, ValueError) as e:
            raise GpuMonitorError(f"cannot learn how many ports switch {switch} has (its "
                                  f"service's snapshot): {e}") from None
        self._ports[switch] = n
        return n

    def _rx_power(self, args: schema.RxPower) -> Future:
        switch, ports = args.switch, args.ports      # checked: a name, port numbers
        if switch not in self.switches:
            raise GpuMonitorError(f"rx_power takes a switch of {self.switches}, not {switch!r}")
        # ethtool may take up to its timeout, and the switch's port count may have to be
        # asked of its service: on a worker, answered when done (Server sends a future's
        # answer), so Xid events and heartbeats do not wait for it
        return self._reader.submit(self._rx_power_read, switch, ports)

    def _rx_power_read(self, switch: str, ports: list[int]) -> dict:
        n = self.switch_ports(switch)
        bad = [p for p in ports if not n < p <= 2 * n]
        if bad:
            raise GpuMonitorError(f"rx_power: ports {bad} are not outputs {n + 1}..{2 * n} of "
                                  f"switch {switch}")
        wanted = {p: self.transceivers.get((switch, p - n)) for p in ports}
        readings = self.ddm.read_many(t.iface for t in wanted.values() if t is not None)
        dbm: dict[str, float] = {}
        errors: dict[str, str] = {}
        for p, t in wanted.items():
            if t is None:
                dbm[str(p)] = DARK_DBM
                errors[str(p)] = (f"no transceiver of this monitor on output {p} of {switch} "
                                  f"(no [[gpus]] with an iface on input {p - n})")
                continue
            got = readings[t.iface]
            if not isinstance(got, DdmError):
                try:
                    dbm[str(p)] = round(got.dbm(t.lane), 2)
                    continue
                except DdmError as e:
                    got = e
            dbm[str(p)] = DARK_DBM
            errors[str(p)] = f"{t.gpu}: {got}"
        if errors:
            log.warning("rx_power on %s: %s", switch, "; ".join(f"{p}: {m}"
                                                              for p, m in errors.items()))
        out: dict[str, Any] = {"dbm": dbm}
        if errors:
            out["errors"] = errors
        return out

