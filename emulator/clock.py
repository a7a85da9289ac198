"""Time for the emulated rack and job: simulated (deterministic, for tests) or wall.

Both offer `now()` and `sleep(dt)`. `SimClock.sleep` advances simulated time at once and then
runs what was scheduled up to the new time and every tick hook (the rack's health poll), so a
test drives a whole failover in a few milliseconds, the same way every run.
"""
from __future__ import annotations

import heapq
import itertools
import threading
import time
from collections.abc import Callable


class WallClock:
    """Real time: `now()` is time.monotonic(); sleep blocks the calling thread."""

    def now(self) -> float:
        return time.monotonic()

    def sleep(self, dt: float) -> None:
        if dt > 0:
            time.sleep(dt)


class SimClock:
    """Simulated seconds. Not for several threads at once: one thread drives it."""

    def __init__(self, start: float = 0.0):
        self._t = float(start)
        self._queue: list[tuple[float, int, Callable[[], None]]] = []
        self._seq = itertools.count()
        self._hooks: list[Callable[[], None]] = []
        self._lock = threading.RLock()

    def now(self) -> float:
        return self._t

    def call_at(self, t: float, fn: Callable[[], None]) -> None:
        """Run fn once simulated time reaches t (during a later sleep)."""
        with self._lock:
            heapq.heappush(self._queue, (float(t), next(self._seq), fn))

    def on_tick(self, fn: Callable[[], None]) -> None:
        """Run fn after every sleep (e.g. the rack polling its GPUs' health)."""
        self._hooks.append(fn)

    def sleep(self, dt: float) -> None:
        if dt < 0:
            raise ValueError(f"cannot sleep a negative time ({dt} s)")
        end = self._t + dt
        while True:
            with self._lock:
                if not self._queue or self._queue[0][0] > end:
                    break
                t, _, fn = heapq.heappop(self._queue)
            self._t = max(self._t, t)
            fn()
        self._t = end
        for hook in list(self._hooks):
            hook()
