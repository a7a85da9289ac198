"""Test doubles for bus tests: a CircuitSwitch and a power meter held in memory.

Services load them by name (`driver = "tests.bus_doubles:MemorySwitch"`), in their own
processes, exactly as they load a real driver.
"""
from __future__ import annotations

import time

from photonic_testbed.drivers.circuit_switch import ApplyReport, CircuitSwitch, check_circuits


class MemorySwitch(CircuitSwitch):
    name = "memory-switch"

    def __init__(self, address: str, ports: int = 16, settle_s: float = 0.0):
        self.address = address
        self._ports = ports
        self.settle_s = settle_s
        self._circuits: dict[int, int] = {}

    @property
    def ports(self) -> int:
        return self._ports

    def apply(self, circuits):
        t = time.monotonic()
        want = check_circuits(circuits, self._ports)
        added = {a: b for a, b in want.items() if self._circuits.get(a) != b}
        removed = {a: b for a, b in self._circuits.items() if want.get(a) != b}
        if self.settle_s:
            time.sleep(self.settle_s)
        self._circuits = want
        return ApplyReport(added, removed, time.monotonic() - t)

    def circuits(self):
        return dict(self._circuits)

    def describe(self):
        return {**super().describe(), "address": self.address}


class MemoryPowerMeter:
    def __init__(self, address: str, channels: int = 4):
        self.channels = channels

    def read_power(self, channels):
        chosen = range(1, self.channels + 1) if channels is None else channels
        for ch in chosen:
            if not 1 <= ch <= self.channels:
                raise ValueError(f"channel {ch} does not exist (1..{self.channels})")
        return {ch: 0.001 * ch for ch in chosen}


class HangingSwitch(MemorySwitch):
    """A switch whose apply never returns in useful time (a wedged instrument)."""

    def apply(self, circuits):
        time.sleep(30)
        return super().apply(circuits)
