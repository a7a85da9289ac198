"""Test doubles for bus tests: a CircuitSwitch and power meters held in memory.

Services load them by name (`driver = "tests.bus_doubles:MemorySwitch"`), in their own
processes, exactly as they load a real driver.
"""
from __future__ import annotations

import queue
import threading
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


class GatedPowerMeter:
    """A power meter whose every read waits until the test lets it end (`release`); `started`
    says, in order, which ports each read was for as it began."""

    def __init__(self, address: str = "", ports: int = 4):
        self.ports = ports
        self.started: queue.Queue[list[int]] = queue.Queue()
        self._go = threading.Semaphore(0)

    def read_power(self, channels: list[int] | None) -> dict[int, float]:
        chosen = list(range(1, self.ports + 1) if channels is None else channels)
        self.started.put(chosen)
        if not self._go.acquire(timeout=60):
            raise TimeoutError("the test never let the read end")
        return {ch: 0.001 * ch for ch in chosen}

    def release(self, reads: int = 1) -> None:
        self._go.release(reads)

    def describe(self) -> dict:
        return {"kind": "power_meter", "ports": self.ports}


class TimedPowerMeter:
    """A power meter whose reads take `read_s` a port, each read's (start, end, ports) kept."""

    def __init__(self, address: str = "", ports: int = 4, read_s: float = 0.02):
        self.ports = ports
        self.read_s = read_s
        self.reads: list[tuple[float, float, list[int]]] = []

    def read_power(self, channels: list[int] | None) -> dict[int, float]:
        chosen = list(range(1, self.ports + 1) if channels is None else channels)
        start = time.monotonic()
        time.sleep(self.read_s * len(chosen))
        self.reads.append((start, time.monotonic(), chosen))
        return {ch: 0.001 * ch for ch in chosen}
