"""Time series the trends view draws: a fixed-size ring of (time, value) per series, so that a
GUI left open for days holds the same memory as after an hour. No Qt here.

Series are named `KIND/WHAT`: `rx/gpu4` (power at gpu4's receiver, dBm), `heater/chip` (the
chip's total heater power, mW), `throughput/dp` and `loss/dp` (what job dp reports).
"""
from __future__ import annotations

import math

import numpy as np

CAPACITY = 8192           # an hour at 2 samples a second, with room


class Ring:
    """The newest `capacity` samples of one series, oldest first when read."""

    def __init__(self, capacity: int = CAPACITY):
        if capacity < 2:
            raise ValueError(f"a ring holds at least 2 samples, not {capacity}")
        self.t = np.zeros(capacity)
        self.v = np.zeros(capacity)
        self.n = 0              # samples ever appended
        self.version = 0        # bumped on every append (the view redraws what changed)

    @property
    def capacity(self) -> int:
        return len(self.t)

    def __len__(self) -> int:
        return min(self.n, self.capacity)

    def append(self, t: float, v: float) -> None:
        i = self.n % self.capacity
        self.t[i], self.v[i] = t, v
        self.n += 1
        self.version += 1

    def last(self) -> tuple[float, float] | None:
        if not self.n:
            return None
        i = (self.n - 1) % self.capacity
        return float(self.t[i]), float(self.v[i])

    def first(self) -> float | None:
        """Time of the oldest sample kept."""
        if not self.n:
            return None
        return float(self.t[self.n % self.capacity if self.n > self.capacity else 0])

    def since(self, t0: float) -> tuple[np.ndarray, np.ndarray]:
        """Samples with time >= t0, oldest first (copies)."""
        n, cap = len(self), self.capacity
        if n < cap:
            t, v = self.t[:n], self.v[:n]
        else:
            start = self.n % cap
            t = np.concatenate((self.t[start:], self.t[:start]))
            v = np.concatenate((self.v[start:], self.v[:start]))
        # Appended in time order per series, so the window is one slice.
        k = int(np.searchsorted(t, t0, side="left"))
        return t[k:].copy(), v[k:].copy()


class SeriesStore:
    """Every series by name; a sample with a non-finite value or time is refused."""

    def __init__(self, capacity: int = CAPACITY):
        self.capacity = capacity
        self.series: dict[str, Ring] = {}

    def add(self, name: str, t: float, v: float) -> bool:
        """Append one sample; False (nothing kept) when it is not a finite number, or older
        than the series' newest (the ring is read as sorted)."""
        try:
            t, v = float(t), float(v)
        except (TypeError, ValueError):
            return False
        if not (math.isfinite(t) and math.isfinite(v)):
            return False
        ring = self.series.get(name)
        if ring is None:
            ring = self.series[name] = Ring(self.capacity)
        last = ring.last()
        if last is not None and t < last[0]:
            return False
        ring.append(t, v)
        return True

    def last(self, name: str) -> tuple[float, float] | None:
        ring = self.series.get(name)
        return ring.last() if ring is not None else None

    def names(self, kind: str) -> list[str]:
        """Names of the series of one kind (`rx`, `heater`, ...), sorted."""
        prefix = kind + "/"
        return sorted(n for n in self.series if n.startswith(prefix))

    def clear(self) -> None:
        self.series.clear()
