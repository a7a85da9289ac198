"""The job's side of a planned swap: its ranks' timings to the agent, and a GPU the agent finds
slow handed over to a spare at a step boundary (hil.agent.gray decides; this carries it out).

The ranks already write each step's time and the part of it spent waiting in collectives and
phase barriers to their event files (hil.job.worker: `step` events, `seconds` and `wait_s`).
The controller reads them from where it left off (no cost to the ranks) and sends them to the
agent every REPORT_S as `(gpu, generation, step, compute_s, wait_s)` rows (`Fabric.timings`;
kept and sent again while the agent cannot be reached). When the agent's answer names a GPU to
hand over, and a step of the current generation has been seen:

1. the controller names the step at which the current generation stops (`pg<g>/hold` on the
   job's store: two steps past the newest step it has seen, so that the ranks read it before
   they get there); each rank stops at its first step boundary at or past it (no collective in
   flight, its state that of its last completed step) and counts itself in `pg<g>/held`.
   Meanwhile, when the spare the agent will take keeps a warm standby, the state is streamed
   to it ahead (`stream/<g>`, `stream-to/<gpu>`): a donor (the slow rank's predecessor on its
   ring) sends its state once, then each step's averaged gradients; the standby applies them as
   the donor's optimizer does and holds the held step's state before the swap;
2. once every rank holds (or one does and HOLD_GRACE_S passed: the others are blocked in the
   next step's collective, which cannot complete without it), it asks the agent `handover`:
   the agent changes and verifies the circuits now and orders the restart on the new rank map;
3. the new generation starts as after a failure (hil.job.worker: groups rebuilt, the spare
   given the state by its predecessor on its ring unless it streamed it already), from the
   held step: no step is redone.

The stall the job saw (the first step of the new generation done, less the end of the step the
ranks held at, less a step's usual time) is written to the controller's events (`handed_over`)
and sent with the next report: the agent's price of this job's planned swaps. A handover the
agent refuses, or whose restart order does not come (waited for even after a timed-out
request: the agent may have swapped), releases the hold: a new generation on the same rank
map. A failure's order during a handover ends it unmeasured.
"""
from __future__ import annotations

import json
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
ROWS_KEPT = 16384          # rows kept for the agent while it cannot be reached (the newest)


class Handovers:
    """Timings out, handovers in, for one job's controller (`hil.job.torch_job.Controller`).
    The handover under way (`holding`) is changed under `lock` only; the threads (the reports,
    a handover's) post what they learn, and the controller's loop acts on it."""

    def __init__(self, controller: Any):
        self.c = controller
        self.lock = threading.Lock()
        self.rows: list[list] = []
        self.ends: dict[tuple[int, int], tuple[float, int]] = {}   # (gen, step) -> (t, ranks)
        self.held: dict[int, int] = {}            # generation -> the step its ranks held at
        self.ready: set[int] = set()              # the processes that said they are ready
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
        """New events of the ranks (the controller's tail): rows for the agent, step ends,
        the steps held at."""
        rows = []
        for e in events:
            if e.get("kind") == "ready":
                self.ready.add(int(e.get("pid", 0)))
            if e.get("kind") == "held":
                self.held[int(e["gen"])] = int(e["step"])
            if e.get("kind") != "step" or "comm_s" not in e:
                continue
            gen, step = int(e["gen"]), int(e["step"])
            wait = float(e.get("wait_s", e["comm_s"]))
            compute = max(0.0, float(e["seconds"]) - wait)
            rows.append([str(e.get("gpu")), gen, step, round(compute, 6), round(wait, 6)])
            t, n = self.ends.get((gen, step), (0.0, 0))
            self.ends[(gen, step)] = (max(t, float(e["t"])), n + 1)
        if len(self.ends) > STEPS_KEPT:
            for key in sorted(self.ends)[:-STEPS_KEPT]:
                del self.ends[key]
        with self.lock:
            self.rows = (self.rows + rows)[-ROWS_KEPT:]
            h = self.holding
        if h is None:
            return
        if h.get("done_gen") is not None:
            self._measure(h)
        if time.time() > h["deadline"]:
            if h.get("done_gen") is not None:      # done, but never measured: left so
                with self.lock:
                    if self.holding is h:
                        self.holding = None
            else:
                self._release(h, "the handover did not end in time")

    def poll(self) -> None:
        """Start a handover the agent asked for (one at a time, once a step of the current
        generation has been seen: the hold is named from it)."""
        with self.lock:
            if self.holding is not None:
                return
        try:
            gpu, why, to = self.asked.get_nowait()
        except queue.Empty:
            return
        c = self.c
        if gpu not in c.rank_map.values():
            return
        seen = [s for g, s in self.ends if g == c.gen]
        if not seen:
            self.asked.put((gpu, why, to))      # (asked again at the next look)
            return
        at = max(seen) + HOLD_AHEAD
        streaming = isinstance(to, str) and to in c.warm_standbys()
        if streaming:
            self._stream(gpu, to, at)
        h = {"gen": c.gen, "gpu": gpu, "at": at, "why": why, "world": len(c.rank_map),
             "t": time.time(), "done_gen": None, "to": to if streaming else None,
             "deadline": time.time() + c.spec.collective_timeout_s + c.spec.restart_timeout_s}
        with self.lock:
            self.holding = h
        c.store.set(f"pg{c.gen}/hold", str(at))
        c.events.write("hold", gen=c.gen, gpu=gpu, step=at, why=why)
        threading.Thread(target=self._hand_over, args=(h,), name="handover",
                         daemon=True).start()

    def _stream(self, gpu: str, to: str, at: int) -> None:
        """The spare the agent will take is told to follow a donor (the slow rank's
        predecessor on its data-parallel ring: the same shard) from now to the held step: it
        then holds that step's state when the new generation starts (no transfer)."""
        from photonic_testbed.hil.job import worker  # torch: the controller has it
        c = self.c
        rank = next(r for r, g in c.rank_map.items() if g == gpu)
        roles = worker.roles(c.plan, len(c.rank_map), rank)
        ring = roles.dp_group
        order = json.dumps({"gen": c.gen, "at": at, "to": to, "tp": roles.tp_index,
                            "donor": ring[(ring.index(rank) - 1) % len(ring)]})
        c.store.set(f"stream/{c.gen}", order)
        c.store.set(f"stream-to/{to}", order)
        c.events.write("stream", gen=c.gen, gpu=gpu, to=to, step=at)

    def ordered(self, gen: int, rank_map: dict[int, str]) -> None:
        """The controller published generation `gen`: the handover under way is done when
        the slow GPU is out of its rank map; any other order (a failure's, a release) ends it
        unmeasured."""
        with self.lock:
            h = self.holding
            if h is None or h["done_gen"] is not None:
                return
            if h.get("released") or h["gpu"] in rank_map.values() or \
                    "t_held" not in h:             # (a failure's order, before any hold)
                self.holding = None
            else:
                h["done_gen"] = gen
                h["world_after"] = len(rank_map)
        self._forget_stream(h)

    def _forget_stream(self, h: dict) -> None:
        """A handover's stream keys are deleted once its generation is over (the spare
        deletes what it read; this, whatever it did not)."""
        to = h.get("to")
        if not to:
            return
        store = self.c.store
        for key in (f"stream/{h['gen']}", f"stream-to/{to}", f"stream{h['gen']}/step",
                    f"stream{h['gen']}/state",
                    *(f"stream{h['gen']}/grad/{k}" for k in range(h["at"] - 8, h["at"] + 8))):
            try:
                store.delete_key(key)
            except (RuntimeError, ValueError):
                pass

    # --- threads --------------------------------------------------------------------------
    def _report(self) -> None:
        while not self._stop.wait(REPORT_S):
            with self.lock:
                rows, self.rows = self.rows, []
                stall, self.stall_s = self.stall_s, None
                idle = self.holding is None
            if not rows and stall is None:
                continue
            try:
                got = self.c.fabric.timings(rows, stall, self.c.warm_standbys())
            except BusError as e:
                log.warning("timings not taken by the agent (sent again): %s", e)
                with self.lock:                # nothing lost: sent with the next report
                    self.rows = (rows + self.rows)[-ROWS_KEPT:]
                    self.stall_s = stall if self.stall_s is None else self.stall_s
                continue
            if got and isinstance(got.get("gpu"), str) and idle and self.asked.empty():
                self.asked.put((got["gpu"], str(got.get("why", "")), got.get("to")))

    def _hand_over(self, h: dict) -> None:
        from photonic_testbed.hil.job import worker  # torch: the controller has it
        c = self.c
        host, port = c.spec.store
        client = worker.store_client(host, port, 30.0)
        deadline = time.monotonic() + c.spec.collective_timeout_s
        first = None
        while not self._stop.is_set():
            if c.gen != h["gen"]:          # a failure's order came first: it is that one's
                return
            held = client.add(f"pg{h['gen']}/held", 0)
            if held >= h["world"] or first is not None and \
                    time.monotonic() - first > HOLD_GRACE_S:
                break
            if held and first is None:
                first = time.monotonic()
            if time.monotonic() > deadline:
                self._release(h, "no rank reached the hold")
                return
            time.sleep(0.002)
        if self._stop.is_set():            # the job ended meanwhile: nothing to release
            return
        h["t_held"] = time.time()
        error = None
        try:
            got = c.fabric.handover(h["gpu"], c.warm_standbys())
            if not got.get("swaps"):
                error = f"the agent swapped nothing: {got}"
        except BusError as e:
            error = f"the agent refused the handover: {e}"
        # the restart order comes through the agent's state (a timed-out handover may still
        # have been made): waited for, then the hold is released
        deadline = time.monotonic() + (5.0 if error else c.spec.restart_timeout_s)
        while time.monotonic() < deadline and not self._stop.is_set():
            if c.gen != h["gen"]:
                return
            time.sleep(0.01)
        if not self._stop.is_set():
            self._release(h, error or "no restart order came")

    def _release(self, h: dict, why: str) -> None:
        with self.lock:
            if self.holding is not h or h.get("released"):
                return
            h["released"] = True
        log.warning("planned swap of %s not done: %s", h["gpu"], why)
        self.c.events.write("hold_released", gen=h["gen"], gpu=h["gpu"], why=why)
        self.c.orders.put((dict(self.c.rank_map), f"hold released: {why}"))

    def _measure(self, h: dict) -> None:
        """The stall of the handover just done, once its first step is done by every rank."""
        at = self.held.get(h["gen"])
        first = min((k for k in self.ends if k[0] >= h["done_gen"]), default=None)
        if at is None or first is None or self.ends[first][1] < h["world_after"] or \
                (h["gen"], at) not in self.ends:
            return
        before = sorted(t for (g, s), (t, _) in self.ends.items() if g == h["gen"])
        gaps = [b - a for a, b in zip(before[-21:], before[-20:], strict=False)]
        usual = statistics.median(gaps) if gaps else 0.0
        held_end = self.ends[(h["gen"], at)][0]
        stall = max(0.0, self.ends[first][0] - held_end - usual)
        self.c.events.write("handed_over", gen=first[0], gpu=h["gpu"], step=at,
                            stall_s=round(stall, 6), step_s=round(usual, 6),
                            first_step=first[1])
        with self.lock:
            self.stall_s = stall
            if self.holding is h:
                self.holding = None
