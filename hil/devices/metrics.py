"""The device services' figures as Prometheus metrics (`prometheus-client`, the `metrics` extra;
docs/metrics.md): read from each service when Prometheus scrapes, never from its driver (a
driver's calls are its device thread's): the requests its server ran by operation, refused by
the caller's role, failed by error type, the last telemetry pass's values, and a heater board's
power against the budget read from it when it opened. `ptb serve --metrics-port`.
"""
from __future__ import annotations

import logging
import math
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

log = logging.getLogger(__name__)


def _number(v: Any) -> float | None:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    v = float(v)
    return v if math.isfinite(v) else None


class ServiceMetrics:
    """A collector over device services (`hil.devices.service.DeviceService`), in a registry
    of its own."""

    def __init__(self, services: Sequence[Any], registry: CollectorRegistry | None = None):
        self.services = list(services)
        self.registry = registry if registry is not None else CollectorRegistry()
        self.registry.register(self)

    def describe(self) -> list[Metric]:
        return []            # (the families depend on the services: collected at each scrape)

    def collect(self) -> Iterator[Metric]:
        requests = CounterMetricFamily("ptb_device_requests", "requests a device service "
                                       "received", labels=["device"])
        served = CounterMetricFamily("ptb_device_operations", "requests run, by operation",
                                     labels=["device", "op"])
        refused = CounterMetricFamily("ptb_device_refused", "requests refused to a caller's "
                                      "role", labels=["device", "op", "role"])
        failed = CounterMetricFamily("ptb_device_failures", "requests that failed, by error",
                                     labels=["device", "error"])
        telemetry = GaugeMetricFamily("ptb_device_telemetry", "the last telemetry pass's "
                                      "values (a map's entries by key)",
                                      labels=["device", "name", "key"])
        power = GaugeMetricFamily("ptb_heater_power_mw", "heater power delivered now, as last "
                                  "reported", labels=["device"])
        budget = GaugeMetricFamily("ptb_heater_power_budget_mw", "the board's heater power "
                                   "budget, as read when it opened", labels=["device"])
        for s in self.services:
            name, server = s.name, s.server
            requests.add_metric([name], server.requests)
            for op, n in sorted(server.served.items()):
                served.add_metric([name, op], n)
            for (op, role), n in sorted(server.refused.items()):
                refused.add_metric([name, op, role], n)
            for error, n in sorted(server.failures.items()):
                failed.add_metric([name, error], n)
            for key, value in self._flat(s.telemetry):
                telemetry.add_metric([name, *key], value)
            mw = _number(s.telemetry.get("total_power_mw"))
            if mw is not None:
                power.add_metric([name], mw)
            cap = _number(s.facts.get("power_budget_mw"))
            if cap is not None:
                budget.add_metric([name], cap)
        yield from (requests, served, refused, failed, telemetry, power, budget)

    @staticmethod
    def _flat(values: dict) -> Iterable[tuple[tuple[str, str], float]]:
        """(name, key) -> number of a telemetry pass: its numbers, and its maps' numbers."""
        for name, v in sorted(values.items()):
            number = _number(v)
            if number is not None:
                yield (str(name), ""), number
            elif isinstance(v, dict):
                for key, w in sorted(v.items()):
                    number = _number(w)
                    if number is not None:
                        yield (str(name), str(key)), number

    def serve_at(self, where: str) -> tuple[str, int]:
        """`serve` on `where`, HOST:PORT (a rig file's `metrics`); ValueError for another
        text."""
        from photonic_testbed.hil.rig.model import host_port
        got = host_port(where)
        if got is None:
            raise ValueError(f"metrics are served on HOST:PORT, not {where!r}")
        return self.serve(*got)

    def serve(self, host: str, port: int) -> tuple[str, int]:
        """The HTTP endpoint Prometheus scrapes (`/metrics`), on a thread; returns where."""
        server, _ = start_http_server(port, addr=host, registry=self.registry)
        where = server.server_address[:2]
        log.info("metrics of %s on http://%s:%d/metrics",
                 ", ".join(s.name for s in self.services), *where)
        return str(where[0]), int(where[1])
