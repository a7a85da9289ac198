"""The cyclic garbage collector in the long-running processes (emulator, services, agent).

CPython's collector runs after every 700 net allocations of container objects, and every
hundredth run scans every object the process holds: the rack's layout, a 2,048-GPU job's phase
plan, the switches' states, whatever was built at start-up and is kept for the process's life.
In `ptb bench datacenter` that was a pause of 15-80 ms in the agent and in the services' process
every dozen phase switches (the p99 of the 64-OCS phase switch; BENCHMARKS.md, "datacenter").

`settle()`, once a process has built what it serves with (start-up, a job's admission): one
full collection (what was frozen before included, so nothing freed since is kept), then
everything alive moved out of the collector's sight (`gc.freeze`), and the young generation
collected after THRESHOLD allocations rather than 700. Objects freed by their reference count go
at once as always; only garbage in reference cycles waits longer (bounded by THRESHOLD, or till
the next `settle` for what was frozen)."""
from __future__ import annotations

import gc
import logging
import time

log = logging.getLogger(__name__)

THRESHOLD = (20_000, 10, 10)      # gc.set_threshold: young generation, then every 10th, 100th


def settle(what: str = "") -> float:
    """Collect once, then freeze what is alive (see the module's docstring); returns the
    seconds it took."""
    t0 = time.perf_counter()
    gc.unfreeze()
    gc.collect()
    gc.freeze()
    gc.set_threshold(*THRESHOLD)
    took = time.perf_counter() - t0
    log.debug("heap settled%s: %d objects frozen in %.1f ms", f" after {what}" if what else "",
              gc.get_freeze_count(), 1e3 * took)
    return took
