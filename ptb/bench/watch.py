"""A switch changed behind the agent, put back: the opus rig's OCS emptied by a request sent
straight to its service (`apply_circuits []`, as a script or a rogue client would), or power
cycled through the emulator's control endpoint (it loses every circuit; its service sees it at
its next read-back, twice a second). Timed from the change made (the request's answer) to the
emulator's own OCS holding the job's circuits again, read from its control endpoint every
millisecond. The stack runs as processes (emulator, OCS service, agent), zero device delays
unless `--switching-ms`.
"""
from __future__ import annotations

import statistics
import time

from photonic_testbed.common.jobplan import dp_tp
from photonic_testbed.hil.bus.client import ServiceClient
from photonic_testbed.hil.job.fabric_client import Fabric
from photonic_testbed.hil.lab.control_client import request
from photonic_testbed.ptb.bench import integer, number
from photonic_testbed.ptb.bench.measure import agent_stack, percentile, wait_for

NAME = "watch"
HELP = "a switch changed behind the agent -> its circuits put back (opus, over the bus)"
GOAL_S = 1.0


def add_arguments(p) -> None:
    p.add_argument("--runs", type=integer(1, 10 ** 5), default=20,
                   help="changes of each kind (default %(default)s)")
    p.add_argument("--switching-ms", type=number(0.0, 1000.0), default=0.0,
                   help="the emulated OCS's move time (default %(default)s)")


def _ocs(control: str) -> dict[int, int]:
    """The circuits the emulated OCS's mirrors make."""
    return {int(k): int(v) for k, v in request(control, {"cmd": "truth"})["ocs"]["actual"].items()}


def _put_back(control: str, want: dict[int, int], what: str) -> float:
    """Seconds until the OCS holds `want` again, from now."""
    t0 = time.perf_counter()
    while _ocs(control) != want:
        if time.perf_counter() - t0 > 60:
            raise RuntimeError(f"{what}: the circuits were not put back within 60 s")
        time.sleep(0.001)
    return time.perf_counter() - t0


def run(args) -> dict:
    stack = agent_stack("opus", switching_ms=args.switching_ms)
    times: dict[str, list[float]] = {"apply_circuits []": [], "power cycle": []}
    fabric = None
    try:
        fabric = Fabric(*stack.rig.agent_endpoints(), timeout=10)
        with ServiceClient(stack.rig.endpoints()["ocs"][0], timeout=10) as rogue:
            fabric.admit(dp_tp(8))
            fabric.phase("dp")
            want = wait_for(lambda: _ocs(stack.control) or None, "the job's circuits")
            for _ in range(args.runs):
                rogue.call("apply_circuits", circuits=[])
                times["apply_circuits []"].append(_put_back(stack.control, want, "emptied"))
                request(stack.control, {"cmd": "reboot", "device": "ocs"})
                times["power cycle"].append(_put_back(stack.control, want, "power cycled"))
                time.sleep(0.05)        # the service's session to the OCS is back
            fabric.release()
    finally:
        if fabric is not None:
            fabric.close()
        stack.close()
    rows, notes = [], []
    for what, xs in times.items():
        p99 = percentile(xs, 0.99)
        rows.append({"change": what, "runs": len(xs),
                     "p50_ms": f"{1e3 * statistics.median(xs):.1f}",
                     "p99_ms": f"{1e3 * p99:.1f}", "max_ms": f"{1e3 * max(xs):.1f}"})
        notes.append(f"{what}: goal put back within {GOAL_S:g} s: "
                     f"{'met' if max(xs) <= GOAL_S else 'NOT met'} (max {1e3 * max(xs):.0f} ms)")
    return {"rows": rows, "notes": notes,
            "samples_ms": {k: [round(1e3 * x, 2) for x in v] for k, v in times.items()}}
