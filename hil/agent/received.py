"""Received power at a switch's output ports, as the agent verifies circuits by it: asked of
the GPU monitors (`rx_power`: each GPU's transceiver's DDM), one request per monitor for every
receiver of the switch it knows, the requests to several monitors sent together (`call_many`).
"""
from __future__ import annotations

import logging
from collections.abc import Mapping

from photonic_testbed.hil.agent.bus_switch import BusSwitch
from photonic_testbed.hil.bus.client import BusError, ServiceClient, call_many

log = logging.getLogger(__name__)

DARK_DBM = -99.0


class ReceivedPower:
    """`read(switch, port)`, dBm; what one event read is kept while the switch is unchanged
    (a verification reads several ports) until `clear()` (the next event reads afresh).
    `receivers`: switch -> monitor -> the output ports of its GPUs' receivers."""

    def __init__(self, monitors: Mapping[str, ServiceClient],
                 receivers: Mapping[str, Mapping[str, set[int]]],
                 switches: Mapping[str, BusSwitch], timeout: float):
        self.monitors, self.receivers = monitors, receivers
        self.switches, self.timeout = switches, timeout
        self._rx: dict[str, tuple[str | None, dict]] = {}
        self._unread: dict[str, set[int]] = {}     # switch -> ports no monitor answered for

    def clear(self) -> None:
        self._rx.clear()

    def read(self, switch: str, port: int) -> float:
        sw = self.switches.get(switch)
        cached = self._rx.get(switch)
        if cached is None or sw is None or cached[0] != sw.version or port not in cached[1]:
            asks = {m: set(ports) for m, ports in self.receivers.get(switch, {}).items()}
            if not any(int(port) in ports for ports in asks.values()):
                # no GPU's receiver: asked of the first monitor, which answers it dark
                asks.setdefault(next(iter(self.monitors)), set()).add(int(port))
            monitors = list(asks)
            answers = call_many([(self.monitors[m], "rx_power",
                                  {"switch": switch, "ports": sorted(asks[m])})
                                 for m in monitors], self.timeout)
            dbm: dict[int, float] = {}
            unread = self._unread[switch] = set()
            for m, got in zip(monitors, answers, strict=True):
                if isinstance(got, BusError):
                    # its ports read dark for this event, asked again at the next
                    log.warning("no received power from %s for %s %s: %s", m, switch,
                                sorted(asks[m]), got)
                    dbm.update(dict.fromkeys(asks[m], DARK_DBM))
                    unread.update(asks[m])
                else:
                    dbm.update(got["dbm"])
            cached = self._rx[switch] = (sw.version if sw else None, dbm)
        return float(cached[1].get(port, DARK_DBM))

    def reading(self, switch: str, port: int) -> float | None:
        """`read`, but None where no monitor answered (not a dark receiver: no reading)."""
        got = self.read(switch, port)
        return None if int(port) in self._unread.get(switch, ()) else got
