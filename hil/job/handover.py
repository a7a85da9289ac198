"""The job's side of a planned swap: its ranks' timings to the agent, and a GPU the agent finds
slow handed over to a spare at a step boundary (hil.agent.gray decides; this carries it out).

The ranks already write each step's time and the part of it spent in collectives to their
event files (hil.job.worker: `step` events, `seconds` and `comm_s`). The controller reads them
from where it left off (no cost to the ranks) and sends them to the agent every REPORT_S as
`(gpu, generation, step, compute_s, wait_s)` rows (`Fabric.timings`). When the agent's answer
names a GPU to hand over:

1. the controller names the step at which the current generation stops (`pg<g>/hold` on the
   job's store: two steps past the newest step it has seen, so that every rank reads it before
   it gets there); each rank stops at that step boundary (no collective in flight, its state
   that of its last completed step) and counts itself in `pg<g>/held`;
2. once every rank holds (or one does and HOLD_GRACE_S passed: the others are blocked in the
   next step's collective, which cannot complete without it), it asks the agent `handover`:
   the agent changes and verifies the circuits now and orders the restart on the new rank map;
3. the new generation starts as after a failure (hil.job.worker: groups rebuilt, the spare
   given the state by its predecessor on its ring), from the held step: no step is redone.

The stall the job saw (the first step of the new generation done, less the held step's end,
less a step's usual time) is written to the controller's events (`handed_over`) and sent with
the next report: the agent's price of a planned swap. A handover the agent refuses, or one that
does not come, releases the hold (a new generation on the same rank map).
"""
from __future__ import annotations

import logging
import queue
import statistics
import threading
import time
from typing import Any

from photonic_testbed.hil.bus.client import BusError

log = logging.getLogger(__name__)

REPORT_S = 0.25            # how often the ranks' timings go to the agent
HOLD_GRACE_S = 0.5         # once one rank holds, how long the others are waited for
HOLD_AHEAD = 2             # the hold is this many steps past the newest step seen
STEPS_KEPT = 256           # step completion times kept (for the usual step time)


class Handovers:
    """Timings out, handovers in, for one job's controller (`hil.job.torch_job.Controller`)."""

    def __init__(self, controller: Any):
        self.c = controller
        self.rows: list[list] = []
        self.ends: dict[tuple[int, int], tuple[float, int]] = {}   # (gen, step) -> (t, ranks)
        self.asked: queue.Queue = queue.Queue()
        self.holding: dict | None = None          # the handover under way
        self.stall_s: float | None = None         # measured, not yet sent
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._report, name="timings", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._stop.set()

    # --- the controller's loop ------------------------------------------------------------
    def absorb(self, events: list[dict]) -> None:
        """New events of the ranks (the controller's tail): rows for the agent, step ends."""
        rows = []
        for e in events:
            if e.get("kind") != "step" or "comm_s" not in e:
                continue
            gen, step = int(e["gen"]), int(e["step"])
            compute = max(0.0, float(e["seconds"]) - float(e["comm_s"]))
            rows.append([str(e.get("gpu")), gen, step, round(compute, 6),
                         round(float(e["comm_s"]), 6)])
            t, n = self.ends.get((gen, step), (0.0, 0))
            self.ends[(gen, step)] = (max(t, float(e["t"])), n + 1)
        while len(self.ends) > STEPS_KEPT:
            del self.ends[min(self.ends)]
        with self.c.lock:
            self.rows += rows
        if self.holding is not None and self.holding.get("done_gen") is not None:
            self._measure()

    def poll(self) -> None:
        """Start a handover the agent asked for (one at a time)."""
        if self.holding is not None:
            return
        try:
            gpu, why = self.asked.get_nowait()
        except queue.Empty:
            return
        c = self.c
        if gpu not in c.rank_map.values():
            return
        newest = max((s for g, s in self.ends if g == c.gen), default=0)
        at = newest + HOLD_AHEAD
        self.holding = {"gen": c.gen, "gpu": gpu, "at": at, "why": why,
                        "world": len(c.rank_map), "t": time.time(), "done_gen": None}
        c.store.set(f"pg{c.gen}/hold", str(at))
        c.events.write("hold", gen=c.gen, gpu=gpu, step=at, why=why)
        threading.Thread(target=self._hand_over, args=(dict(self.holding),),
                         name="handover", daemon=True).start()

    def ordered(self, gen: int) -> None:
        """The controller published generation `gen`: the handover (if any) is done, or its
        hold released."""
        h = self.holding
        if h is not None and h.get("released"):
            self.holding = None
        elif h is not None and h["done_gen"] is None:
            h["done_gen"] = gen

    # --- threads --------------------------------------------------------------------------
    def _report(self) -> None:
        while not self._stop.wait(REPORT_S):
            with self.c.lock:
                rows, self.rows = self.rows, []
            stall, self.stall_s = self.stall_s, None
            if not rows and stall is None:
                continue
            try:
                got = self.c.fabric.timings(rows, stall)
            except BusError as e:
                log.warning("timings not taken by the agent: %s", e)
                continue
            if got and isinstance(got.get("gpu"), str) and self.holding is None \
                    and self.asked.empty():
                self.asked.put((got["gpu"], str(got.get("why", ""))))

    def _hand_over(self, h: dict) -> None:
        from photonic_testbed.hil.job import worker  # torch: the controller has it
        c = self.c
        host, port = c.spec.store
        client = worker.store_client(host, port, 30.0)
        deadline = time.monotonic() + c.spec.collective_timeout_s
        first = None
        while time.monotonic() < deadline and not self._stop.is_set():
            held = client.add(f"pg{h['gen']}/held", 0)
            if held >= h["world"]:
                break
            if held and first is None:
                first = time.monotonic()
            if first is not None and time.monotonic() - first > HOLD_GRACE_S:
                break
            if c.gen != h["gen"]:          # a failure's order came first: it is that one's
                self.holding = None
                return
            time.sleep(0.002)
        else:
            self._release(h, "no rank reached the hold")
            return
        h["t_held"] = time.time()
        try:
            c.fabric.handover(h["gpu"], c.warm_standbys())
        except BusError as e:
            self._release(h, f"the agent refused the handover: {e}")

    def _release(self, h: dict, why: str) -> None:
        log.warning("planned swap of %s not done: %s", h["gpu"], why)
        if self.holding is not None:
            self.holding["released"] = True
        self.c.events.write("hold_released", gen=h["gen"], gpu=h["gpu"], why=why)
        self.c.orders.put((dict(self.c.rank_map), f"hold released: {why}"))

    def _measure(self) -> None:
        """The stall of the handover just done, once its first step is done by every rank."""
        h = self.holding
        assert h is not None
        at = max((s for g, s in self.ends if g == h["gen"]), default=None)
        first = min((k for k in self.ends if k[0] >= h["done_gen"]), default=None)
        if at is None or first is None or self.ends[first][1] < h["world"]:
            return
        before = sorted(t for (g, s), (t, _) in self.ends.items() if g == h["gen"])
        gaps = [b - a for a, b in zip(before[-21:], before[-20:], strict=False)]
        usual = statistics.median(gaps) if gaps else 0.0
        held_end = self.ends[(h["gen"], at)][0]
        stall = max(0.0, self.ends[first][0] - held_end - usual)
        self.c.events.write("handed_over", gen=first[0], gpu=h["gpu"], step=at,
                            stall_s=round(stall, 6), step_s=round(usual, 6),
                            first_step=first[1])
        self.stall_s = stall
        self.holding = None
