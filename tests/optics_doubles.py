"""In-process switch doubles for agent and rack tests: a `CircuitSwitch` whose physics is a
permutation with per-path loss and a little leakage, and that counts its moves."""
from __future__ import annotations

import random
from collections.abc import Callable, Mapping

from photonic_testbed.drivers.circuit_switch import (
    ApplyReport,
    Circuits,
    CircuitSwitch,
    check_circuits,
)


class PermutationSwitch(CircuitSwitch):
    """N x N permutation switch: light at input i leaves at circuits[i] after loss_db[i];
    every output also gets `leak_db` of every input's light (crosstalk)."""

    def __init__(self, name: str, n: int, *, clock=None, latency_s: float = 0.0, seed: int = 0,
                 loss_db: Mapping[int, float] | None = None, leak_db: float = -50.0):
        self.name = name
        self._n = n
        self.clock = clock
        self.latency_s = latency_s
        rng = random.Random(seed)
        self.loss_db = {i: rng.uniform(0.5, 3.0) for i in range(1, n + 1)}
        self.loss_db.update(loss_db or {})
        self.leak_db = leak_db
        self._state: Circuits = {}
        self.moves = 0                  # circuits added + removed, over the switch's life
        self.applies = 0
        self.before_apply: list[Callable[[Circuits], None]] = []
        self.after_apply: list[Callable[[Circuits], None]] = []
        self.history: list[Circuits] = []

    @property
    def ports(self) -> int:
        return self._n

    def apply(self, circuits: Mapping[int, int]) -> ApplyReport:
        want = check_circuits(circuits, self._n)
        for hook in list(self.before_apply):
            hook(want)
        added = {i: o for i, o in want.items() if self._state.get(i) != o}
        removed = {i: o for i, o in self._state.items() if want.get(i) != o}
        self.moves += len(added) + len(removed)
        self.applies += 1
        if (added or removed) and self.clock is not None and self.latency_s:
            self.clock.sleep(self.latency_s)
        self._state = dict(want)
        self.history.append(dict(want))
        for hook in list(self.after_apply):
            hook(want)
        return ApplyReport(added, removed, self.latency_s if (added or removed) else 0.0)

    def circuits(self) -> Circuits:
        return dict(self._state)

    def path_loss_db(self, i: int, o: int) -> float:
        return self.loss_db[i]

    def transfer(self, inputs: dict[int, float]) -> dict[int, float]:
        n = self._n
        out = {o: 0.0 for o in range(n + 1, 2 * n + 1)}
        leak = 10 ** (self.leak_db / 10)
        for i, p in inputs.items():
            if not 1 <= i <= n:
                raise ValueError(f"input port {i} is not 1..{n}")
            for o in out:
                out[o] += p * leak
            if i in self._state:
                out[self._state[i]] += p * 10 ** (-self.loss_db[i] / 10)
        return out
