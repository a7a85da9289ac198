"""The emulated job's side of gray failures (hil/agent/gray.py): its ranks' step timings sent to
the agent, the planned swap it asks for at a step boundary, and the stall it saw.

The emulator's `slow_gpu` makes a GPU of the emulated job compute `factor` times slower
(`TrainingJob.slowdown`): every collective waits for it, and each step's event carries each
rank's compute and wait (`timings`). `JobTimings` sends them to the agent (`Fabric.timings`,
every SEND_EVERY_S, as the PyTorch job's controller does); when the agent answers with a
`handover` the job, at its next step boundary (in its own thread, so nothing is in flight),
asks `handover {gpu}` and waits for the restart order that follows: the new generation goes on
from the step reached, the spare in the slow GPU's place (`TrainingJob.restart(planned=True)`:
nothing reloaded, no step redone). The stall it saw (from the hold to the first step of the new
generation, less that step's own time) goes with the next timings: the price of the next swap.
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Any

from photonic_testbed.emulator.job import JobEvent, TrainingJob
from photonic_testbed.hil.bus.client import BusError

log = logging.getLogger(__name__)

SEND_EVERY_S = 0.25
ORDER_WAIT_S = 10.0          # how long the held job waits for the restart order of its handover


class JobTimings:
    def __init__(self, job: TrainingJob, fabric: Any):
        self.job, self.fabric = job, fabric
        self._lock = threading.Lock()
        self._rows: list[list] = []
        self._stall: float | None = None       # the last planned swap's, not yet sent
        self.decided: str | None = None        # the GPU the agent decided to swap
        self._swapping: str | None = None      # the GPU handed over, its order awaited
        self._held: tuple[float, int] | None = None     # (when held, generation then)
        self._ordered = threading.Event()
        self.stalls: list[float] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # --- the job's thread -----------------------------------------------------------------
    def on_event(self, ev: JobEvent) -> None:
        if ev.kind != "step" or "timings" not in ev.details:
            return
        gen = int(ev.details.get("generation", 0))
        rows = [[g, gen, ev.step, round(c, 6), round(w, 6)]
                for g, (c, w) in ev.details["timings"].items()]
        held = self._held
        with self._lock:
            self._rows += rows
            if held is not None and gen > held[1]:
                stall = max(0.0, time.monotonic() - held[0] - float(ev.details["seconds"]))
                self._stall, self._held = stall, None
                self.stalls.append(stall)
                log.info("planned swap: the job stalled %.1f ms", stall * 1000)
        gpu, self.decided = self.decided, None
        if gpu and self._held is None and gpu in self.job.rank_map.values():
            self._hand_over(gpu)

    def _hand_over(self, gpu: str) -> None:
        """At a step boundary: the agent swaps `gpu` now; the restart order is waited for."""
        self._ordered.clear()
        self._swapping = gpu
        self._held = (time.monotonic(), self.job.generation)
        try:
            self.fabric.handover(gpu, [])
        except BusError as e:
            log.warning("planned swap of %s not made: %s", gpu, e)
            self._swapping = self._held = None
            return
        if not self._ordered.wait(ORDER_WAIT_S):
            log.warning("planned swap of %s: no restart order within %g s", gpu, ORDER_WAIT_S)

    def planned(self, rank_map: dict[int, str]) -> bool:
        """Whether a restart order is the one of the planned swap under way (its GPU gone);
        said once (the order that ends the hold)."""
        gpu = self._swapping
        if gpu is None or gpu in rank_map.values():
            return False
        self._swapping = None
        self._ordered.set()
        return True

    # --- the sender -----------------------------------------------------------------------
    def send(self) -> None:
        with self._lock:
            rows, self._rows = self._rows[-16384:], []
            stall, self._stall = self._stall, None
        if not rows and stall is None:
            return
        try:
            got = self.fabric.timings(rows, swap_stall_s=stall)
        except BusError as e:
            log.debug("timings not delivered: %s", e)
            return
        if got and got.get("gpu"):
            self.decided = str(got["gpu"])

    def start(self) -> None:
        def run() -> None:
            while not self._stop.wait(SEND_EVERY_S):
                self.send()
        self._thread = threading.Thread(target=run, name="job-timings", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        self._ordered.set()
        if self._thread is not None:
            self._thread.join(5.0)
            self._thread = None
