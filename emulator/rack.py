"""The emulated rack: GPU nodes whose optical transceivers are cabled to switch ports.

Link state comes from the optics alone. Each switch's physics offers
`transfer(inputs_mw) -> outputs_mw`; the rack injects every live transmitter's light at its
TX port and reads what arrives at every receiver's RX port. Lasers of different GPUs are
mutually incoherent, so their powers add: the rack calls `transfer` once per transmitter and
sums (this also tells it who contributed what).

A link src -> dst is *up* when, at dst's receiver,
- the light from src is at least the receiver sensitivity (RECEIVER_SENSITIVITY_DBM, -12 dBm; the
  transmitters launch LAUNCH_DBM, 0 dBm, so 12 dB of budget for switch, fibres and connectors),
- and the signal-to-crosstalk ratio (src's power over everyone else's) is >= MIN_SXR_DB, 15 dB;
- and neither GPU has failed (a failed node's optical engine is dark and deaf).
An up link runs at LINE_RATE_GBPS; with less than HALF_RATE_MARGIN_DB of margin above the
sensitivity the transceiver falls back to half rate (a lower-order modulation), so a lossy
path slows the job down before it breaks it.

GPUs of one server (the layout's `servers`) talk over the server's scale-up fabric: for the
job (`link_map`) such a link is up at SCALE_UP_GBPS while neither GPU has failed, with no
switch (`switch == ""`) and no optics involved.

Faults (`rack.faults`): a GPU failed hard or flapping, a GPU degraded, a transceiver's TX or RX
dead, a fibre cut at a switch port. `truth()` reports who hears whom at what power, for tests
and the control endpoint; the agent never reads it (it measures light through power meters).
GPU health comes out as `hil.gpus.health.GpuHealth` values, the same the NVML monitor gives.
"""
from __future__ import annotations

import dataclasses
import logging
import math
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from photonic_testbed.common.rack_layout import RECEIVER_SENSITIVITY_DBM, Attachment, RackLayout
from photonic_testbed.emulator.clock import WallClock
from photonic_testbed.hil.gpus.health import GpuHealth, classify

log = logging.getLogger(__name__)

LAUNCH_DBM = 0.0
MIN_SXR_DB = 15.0
HALF_RATE_MARGIN_DB = 3.0
LINE_RATE_GBPS = 400.0
# GPUs of one server talk over its scale-up fabric, not the optics (NVLink 4 on an H100
# server: 900 GB/s per GPU both ways, 450 GB/s = 3,600 Gb/s each way)
SCALE_UP_GBPS = 3600.0
DARK_DBM = -99.0          # what a detector reports for no light at all
VISIBLE_DBM = -40.0       # truth() lists contributions at least this strong

GPU_MODES = ("hard", "flapping")
SIDES = ("tx", "rx", "both")


class RackError(ValueError):
    """A fault or query names a GPU, switch or port the rack does not have."""


class Physics(Protocol):
    def transfer(self, inputs: dict[int, float]) -> dict[int, float]: ...


def dbm(mw: float) -> float:
    return 10 * math.log10(mw) if mw > 0 else DARK_DBM


def mw(dbm_value: float) -> float:
    return 10 ** (dbm_value / 10)


@dataclass(frozen=True)
class LinkTruth:
    """What dst's receiver on `switch` gets from src: power, everyone else's, and the verdict."""
    src: str
    dst: str
    switch: str
    power_dbm: float
    crosstalk_dbm: float
    up: bool
    rate_gbps: float

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


class RackFaults:
    """Faults of the rack's GPUs, transceivers and fibres; each call returns `active()`."""

    def __init__(self, rack: EmulatedRack):
        self._rack = rack
        self.gpus: dict[str, dict[str, Any]] = {}          # gpu -> {"mode", "since", ...}
        self.transceivers: dict[tuple[str, str], set[str]] = {}
        self.fibres: set[tuple[str, int]] = set()

    def _gpu(self, gpu: str) -> str:
        if gpu not in self._rack.layout.gpus:
            raise RackError(f"no GPU {gpu!r} in rack {self._rack.layout.name!r}")
        return gpu

    def fail_gpu(self, gpu: str, mode: str = "hard", period_s: float = 1.0) -> dict[str, Any]:
        """Fail a GPU: "hard" (stays failed) or "flapping" (failed and back every period_s,
        starting failed)."""
        if mode not in GPU_MODES:
            raise RackError(f"GPU failure mode must be one of {GPU_MODES}, not {mode!r}")
        if not period_s > 0:
            raise RackError(f"flapping period must be > 0 s, not {period_s!r}")
        self.gpus[self._gpu(gpu)] = {"mode": mode, "since": self._rack.clock.now(),
                                     "period_s": float(period_s)}
        log.info("fault: GPU %s fails (%s)", gpu, mode)
        return self.active()

    def degrade_gpu(self, gpu: str, nvlink_errors: int = 10,
                    temperature_c: float | None = None) -> dict[str, Any]:
        """The GPU keeps running but reports errors (NVLink replays, heat)."""
        self.gpus[self._gpu(gpu)] = {"mode": "degraded", "since": self._rack.clock.now(),
                                     "nvlink_errors": int(nvlink_errors),
                                     "temperature_c": temperature_c}
        return self.active()

    def heal_gpu(self, gpu: str) -> dict[str, Any]:
        self.gpus.pop(self._gpu(gpu), None)
        return self.active()

    def _sides(self, gpu: str, switch: str | None) -> list[tuple[str, str]]:
        atts = self._rack.layout.gpus[self._gpu(gpu)]
        keys = [(gpu, a.switch) for a in atts if switch is None or a.switch == switch]
        if not keys:
            raise RackError(f"GPU {gpu!r} has no transceiver on switch {switch!r}")
        return keys

    def fail_transceiver(self, gpu: str, switch: str | None = None,
                         side: str = "both") -> dict[str, Any]:
        """Kill a transceiver's transmitter, receiver or both (on one switch, or all)."""
        if side not in SIDES:
            raise RackError(f"transceiver side must be one of {SIDES}, not {side!r}")
        for key in self._sides(gpu, switch):
            self.transceivers.setdefault(key, set()).update(("tx", "rx") if side == "both"
                                                            else (side,))
        return self.active()

    def repair_transceiver(self, gpu: str, switch: str | None = None) -> dict[str, Any]:
        for key in self._sides(gpu, switch):
            self.transceivers.pop(key, None)
        return self.active()

    def _port(self, switch: str, port: int) -> tuple[str, int]:
        n = self._rack.layout.switches.get(switch)
        if n is None:
            raise RackError(f"no switch {switch!r} in rack {self._rack.layout.name!r}")
        if not isinstance(port, int) or not 1 <= port <= 2 * n:
            raise RackError(f"switch {switch!r} has ports 1..{2 * n}, not {port!r}")
        return switch, port

    def cut_fibre(self, switch: str, port: int) -> dict[str, Any]:
        """Cut the fibre on a switch port: no light enters (input) or leaves (output) there."""
        self.fibres.add(self._port(switch, port))
        return self.active()

    def splice_fibre(self, switch: str, port: int) -> dict[str, Any]:
        self.fibres.discard(self._port(switch, port))
        return self.active()

    def clear(self) -> dict[str, Any]:
        self.gpus.clear()
        self.transceivers.clear()
        self.fibres.clear()
        return self.active()

    def active(self) -> dict[str, Any]:
        return {"gpus": {g: dict(f) for g, f in self.gpus.items()},
                "transceivers": [{"gpu": g, "switch": s, "dead": sorted(d)}
                                 for (g, s), d in sorted(self.transceivers.items())],
                "fibres": [{"switch": s, "port": p} for s, p in sorted(self.fibres)]}


class EmulatedRack:
    """GPUs, transceivers and fibres around switches whose physics the rack is given."""

    def __init__(self, layout: RackLayout, physics: Mapping[str, Physics], clock: Any = None, *,
                 launch_dbm: float = LAUNCH_DBM, sensitivity_dbm: float = RECEIVER_SENSITIVITY_DBM,
                 min_sxr_db: float = MIN_SXR_DB, line_rate_gbps: float = LINE_RATE_GBPS):
        missing = set(layout.switches) - set(physics)
        if missing:
            raise RackError(f"no physics for switch(es) {sorted(missing)} of rack {layout.name!r}")
        for name, p in physics.items():
            if not callable(getattr(p, "transfer", None)):
                raise RackError(f"physics of switch {name!r} has no transfer(inputs_mw)")
        self.layout = layout
        self.physics = dict(physics)
        self.clock = clock or WallClock()
        self.launch_dbm = launch_dbm
        self.sensitivity_dbm = sensitivity_dbm
        self.min_sxr_db = min_sxr_db
        self.line_rate_gbps = line_rate_gbps
        self.faults = RackFaults(self)
        self._listeners: list[Callable[[GpuHealth], None]] = []
        self._last: dict[str, str] = {g: "ok" for g in layout.gpus}
        # Only GPUs with a fault, or not ok when last looked at, can change state by
        # themselves: poll() looks at those, not the rack (2,048 GPUs every 10 ms otherwise).
        self._not_ok: set[str] = set()
        self._order = {g: i for i, g in enumerate(layout.gpus)}
        # switch -> the GPUs cabled to it with their transceiver there, in rack order: the
        # optics of one switch cost its own GPUs, not the rack's
        self._on_switch: dict[str, list[tuple[str, Attachment]]] = {s: [] for s in
                                                                    layout.switches}
        for gpu, atts in layout.gpus.items():
            for a in atts:
                self._on_switch[a.switch].append((gpu, a))
        self._lock = threading.Lock()
        self._monitor: threading.Thread | None = None
        self._stop = threading.Event()

    # --- GPU health -------------------------------------------------------------------------
    def gpu_state(self, gpu: str) -> str:
        """ok | degraded | failed, now."""
        f = self.faults.gpus.get(gpu)
        if gpu not in self.layout.gpus:
            raise RackError(f"no GPU {gpu!r} in rack {self.layout.name!r}")
        if f is None:
            return "ok"
        if f["mode"] == "hard":
            return "failed"
        if f["mode"] == "degraded":
            return "degraded"
        half = int((self.clock.now() - f["since"]) // f["period_s"])
        return "failed" if half % 2 == 0 else "ok"

    def gpu_health(self, gpu: str) -> GpuHealth:
        state = self.gpu_state(gpu)
        f = self.faults.gpus.get(gpu, {})
        if state == "failed":
            h = classify(gpu, temperature_c=None, ecc_uncorrected=0, pcie_replays=0,
                         nvlink_errors=0, xids=(79,), lost=True)
        elif state == "degraded":
            h = classify(gpu, temperature_c=f.get("temperature_c"), ecc_uncorrected=0,
                         pcie_replays=0, nvlink_errors=f.get("nvlink_errors", 0), xids=())
        else:
            h = classify(gpu, temperature_c=45.0, ecc_uncorrected=0, pcie_replays=0,
                         nvlink_errors=0, xids=())
        return dataclasses.replace(h, ts=self.clock.now())

    def health(self) -> list[GpuHealth]:
        return [self.gpu_health(g) for g in self.layout.gpus]

    def subscribe(self, listener: Callable[[GpuHealth], None]) -> None:
        """listener(GpuHealth) is called from poll() whenever a GPU's state changes."""
        self._listeners.append(listener)

    def unsubscribe(self, listener: Callable[[GpuHealth], None]) -> None:
        self._listeners.remove(listener)

    def poll(self) -> list[GpuHealth]:
        """Health of every GPU whose state changed since the last poll; tells the listeners."""
        changed = []
        with self._lock:
            look = set(self.faults.gpus) | self._not_ok
            for g in sorted(look, key=self._order.__getitem__):
                state = self.gpu_state(g)
                if state != self._last[g]:
                    self._last[g] = state
                    changed.append(self.gpu_health(g))
                if state == "ok":
                    self._not_ok.discard(g)
                else:
                    self._not_ok.add(g)
        for h in changed:
            log.info("GPU %s is %s: %s", h.gpu, h.state, "; ".join(h.reasons) or "-")
            for listener in list(self._listeners):
                listener(h)
        return changed

    def start_monitor(self, interval_s: float = 0.01) -> None:
        """Poll health in a thread (wall-clock demos); stopped by close()."""
        if self._monitor is not None:
            return
        self._stop.clear()

        def loop() -> None:
            while not self._stop.wait(interval_s):
                self.poll()
        self._monitor = threading.Thread(target=loop, name="rack-health", daemon=True)
        self._monitor.start()

    def close(self) -> None:
        self._stop.set()
        if self._monitor is not None:
            self._monitor.join(timeout=2.0)
            self._monitor = None

    # --- optics -----------------------------------------------------------------------------
    def failed_gpus(self) -> set[str]:
        """The GPUs failed now (only GPUs with a fault can be)."""
        return {g for g in list(self.faults.gpus) if self.gpu_state(g) == "failed"}

    def _dead(self, gpu: str, switch: str, side: str, failed: set[str] | None = None) -> bool:
        if failed is not None:
            if gpu in failed:
                return True
        elif self.gpu_state(gpu) == "failed":
            return True
        return side in self.faults.transceivers.get((gpu, switch), ())

    def _light(self, switch: str, failed: set[str] | None = None
               ) -> dict[int, dict[str, float]]:
        """{output port: {source GPU: mW arriving at the far end of that port's fibre}}: each
        transmitter's light alone (a physics that can give every input's share in one pass,
        `contributions`, is asked once; otherwise one `transfer` per transmitter)."""
        phys = self.physics[switch]
        cut = self.faults.fibres
        launch = mw(self.launch_dbm)
        live = [(gpu, a.tx) for gpu, a in self._on_switch[switch]
                if not self._dead(gpu, switch, "tx", failed) and (switch, a.tx) not in cut]
        each = getattr(phys, "contributions", None)
        if callable(each):
            shares = each({tx: launch for _, tx in live})
            per_input = [(gpu, shares.get(tx, {})) for gpu, tx in live]
        else:
            per_input = [(gpu, phys.transfer({tx: launch})) for gpu, tx in live]
        out: dict[int, dict[str, float]] = {}
        for gpu, outputs in per_input:
            for port, p in outputs.items():
                if p > 0 and (switch, port) not in cut:
                    heard = out.setdefault(port, {})
                    heard[gpu] = heard.get(gpu, 0.0) + p
        return out

    def launch_mw(self, switch: str) -> dict[int, float]:
        """{input port: mW} the live transmitters cabled to `switch` launch into it (a cut
        input fibre launches nothing)."""
        cut = self.faults.fibres
        inputs: dict[int, float] = {}
        for gpu, a in self._on_switch.get(switch, ()):
            if not self._dead(gpu, switch, "tx") and (switch, a.tx) not in cut:
                inputs[a.tx] = inputs.get(a.tx, 0.0) + mw(self.launch_dbm)
        return inputs

    def port_powers_dbm(self, switch: str, ports: list[int]) -> dict[int, float]:
        """Total light at the far end of several output fibres, with one `transfer`: the
        transmitters are mutually incoherent, so the power transfer is linear and lighting
        them all at once gives the sum of their contributions (what a receiver reads)."""
        for p in ports:
            self.faults._port(switch, p)
        cut = self.faults.fibres
        inputs = self.launch_mw(switch)
        out = self.physics[switch].transfer(inputs) if inputs else {}
        return {p: DARK_DBM if (switch, p) in cut else dbm(out.get(p, 0.0)) for p in ports}

    def port_power_dbm(self, switch: str, port: int) -> float:
        """Total light at the far end of an output port's fibre (what a tap there reads)."""
        self.faults._port(switch, port)
        return dbm(sum(self._light(switch).get(port, {}).values()))

    def _links(self, switch: str, light: dict[int, dict[str, float]],
               wanted: dict[str, set[str]] | None = None,
               failed: set[str] | None = None) -> list[LinkTruth]:
        """What every receiver on `switch` hears; with `wanted` ({dst: {src, ...}}) only
        those links (the others' light still counts as crosstalk)."""
        out = []
        for dst, a in self._on_switch[switch]:
            srcs = None if wanted is None else wanted.get(dst)
            if wanted is not None and srcs is None:
                continue
            heard = light.get(a.rx, {})
            total = sum(heard.values())
            deaf = self._dead(dst, switch, "rx", failed)
            for src, p in heard.items():
                if src == dst or (srcs is not None and src not in srcs):
                    continue
                xt = total - p
                sxr = math.inf if xt <= 0 else 10 * math.log10(p / xt)
                p_dbm = dbm(p)
                up = (not deaf and p_dbm >= self.sensitivity_dbm and sxr >= self.min_sxr_db)
                rate = 0.0
                if up:
                    margin = p_dbm - self.sensitivity_dbm
                    rate = self.line_rate_gbps * (1.0 if margin >= HALF_RATE_MARGIN_DB else 0.5)
                out.append(LinkTruth(src, dst, switch, round(p_dbm, 3), round(dbm(xt), 3), up,
                                     rate))
        return out

    def links(self) -> list[LinkTruth]:
        out = []
        for switch in self.layout.switches:
            out += self._links(switch, self._light(switch))
        return out

    def truth(self) -> list[LinkTruth]:
        """Who hears whom, at what power, whether the link is up: physics ground truth."""
        return [t for t in self.links() if t.power_dbm >= VISIBLE_DBM]

    def link(self, src: str, dst: str) -> LinkTruth | None:
        """The best link src -> dst over every switch (None if dst hears nothing of src)."""
        best = None
        for t in self.links():
            if t.src == src and t.dst == dst and (best is None or (t.up, t.rate_gbps, t.power_dbm)
                                                  > (best.up, best.rate_gbps, best.power_dbm)):
                best = t
        return best

    def link_map(self, pairs: list[tuple[str, str]]) -> dict[tuple[str, str], LinkTruth | None]:
        """The best link for each (src, dst) pair, computing the optics once, and only of
        the switches the pairs share and the receivers they name (a job's round on a
        2,048-GPU rack costs its own links, not every receiver of every switch)."""
        best: dict[tuple[str, str], LinkTruth | None] = {p: None for p in pairs}
        wanted: dict[str, dict[str, set[str]]] = {}      # switch -> dst -> its sources
        gpus = self.layout.gpus
        failed = self.failed_gpus()
        for src, dst in best:
            if src not in gpus or dst not in gpus:
                continue
            paths = self.layout.links_between(src, dst)      # worked out once per pair
            if paths == []:                                  # one server's scale-up fabric
                up = src not in failed and dst not in failed
                best[(src, dst)] = LinkTruth(src, dst, "", self.launch_dbm, DARK_DBM, up,
                                             SCALE_UP_GBPS if up else 0.0)
                continue
            for switch, _, _ in paths or ():
                wanted.setdefault(switch, {}).setdefault(dst, set()).add(src)
        for switch, these in wanted.items():
            for t in self._links(switch, self._light(switch, failed), these, failed):
                key = (t.src, t.dst)
                if key in best:
                    b = best[key]
                    if b is None or (t.up, t.rate_gbps) > (b.up, b.rate_gbps):
                        best[key] = t
        return best

    # --- control endpoint -------------------------------------------------------------------
    def control_handlers(self) -> dict[str, Callable[..., Any]]:
        """Named handlers (keyword arguments in, JSON-able out) for the control endpoint."""
        f = self.faults
        return {
            "fail_gpu": f.fail_gpu, "degrade_gpu": f.degrade_gpu, "heal_gpu": f.heal_gpu,
            "fail_transceiver": f.fail_transceiver, "repair_transceiver": f.repair_transceiver,
            "cut_fibre": f.cut_fibre, "splice_fibre": f.splice_fibre, "clear_faults": f.clear,
            "faults": f.active,
            "truth": lambda: [t.to_dict() for t in self.truth()],
            "health": lambda: [h.to_dict() for h in self.health()],
        }
