"""Phase rails: from the job's phase event on the bus (`Fabric.phase`) to the grant, i.e. the
circuits of that phase applied, over the bus, for a DP/TP job (`dp_tp(8)`: TP pairs, then DP
rings): on lumion's chip and on opus's OCS. The job computes `--gap-ms` (5 ms) between two
phase events, as a training step does between its phases: what is timed is the switch, not a
queue behind the previous switch's journal sync and state publication. Zero device delays,
then (`--realistic`) the OCS at 25 ms per move (measured: the emulated OCS holds *OPC? until
it has settled) and the chip with its modelled delays (1 ms of serial turnaround: the changed
heaters' lines go back to back in one write; 10 us heater settling) added.

On the chip, in the same run, interleaved with the phase switches: the bare process hops a
phase switch crosses (job -> agent -> chip service -> the DAC's pty and back: the agent relays
a `ping_device` to the chip service, which sends the board `id?`), and the ratio of the two;
then the job-visible stall of a phase set up ahead (`Fabric.done`, then `--gap-ms` of compute,
then `Fabric.phase`)."""
from __future__ import annotations

import statistics
import time

from photonic_testbed.common import heap
from photonic_testbed.common.jobplan import dp_tp
from photonic_testbed.hil.bus.client import ServiceClient
from photonic_testbed.hil.job.fabric_client import Fabric
from photonic_testbed.ptb.bench import integer, number
from photonic_testbed.ptb.bench.measure import agent_stack, percentile

NAME = "phase"
HELP = "phase event -> phase circuits applied (grant), over the bus, chip and OCS"
SERIAL_LINE_S = 1e-3
HEATER_SETTLE_S = 10e-6
HOPS_GOAL = 1.5               # a chip phase switch at most 1.5x its bare process hops
STALL_GOAL_S = 0.5e-3         # job-visible stall of a phase set up ahead


def add_arguments(p) -> None:
    p.add_argument("--runs", type=integer(1, 10 ** 6), default=200, help="phase switches per case "
                   "(default %(default)s)")
    p.add_argument("--realistic", action="store_true",
                   help="also measure the OCS at 25 ms per move")
    p.add_argument("--gap-ms", type=number(0, 10_000), default=5.0,
                   help="the job's compute between two phase events (default %(default)s ms;"
                   " 0: back to back)")


def _measure(rig: str, switching_ms: float, runs: int, sync: str = "full",
             gap_s: float = 0.005, hops: str = "") -> dict[str, list]:
    """Phase switch times (`phase`); with `hops` (the switch's device name) also, interleaved
    with them in the same run, the bare hops a phase switch crosses (the agent relays a
    `ping_device` to that switch's service, which asks the device itself) and the job-visible
    stall of a phase set up ahead (the job releases a round, computes `gap_s`, then asks for
    the next)."""
    stack = agent_stack(rig, switching_ms=switching_ms, journal_sync=sync)
    fabric = None
    try:
        fabric = Fabric(*stack.rig.agent_endpoints(), timeout=10)
        plan = dp_tp(8)
        fabric.admit(plan)
        seq = plan.sequence()
        times: list[float] = []
        bare: list[float] = []
        stall: list[float] = []
        for _ in range(2):                       # warm-up: every circuit set seen once
            for ph, rnd in seq:
                fabric.phase(ph, rnd)
        heap.settle("the warm-up")               # (this process is the job)
        with ServiceClient(stack.rig.agent_endpoints()[0], timeout=10) as agent:
            if hops:
                agent.call("relay_ping", device=hops)
            while len(times) < runs:
                for ph, rnd in seq:
                    time.sleep(gap_s)            # the job computes between phase events
                    t = time.perf_counter()
                    fabric.phase(ph, rnd)
                    times.append(time.perf_counter() - t)
                    if hops:
                        time.sleep(gap_s)
                        t = time.perf_counter()
                        agent.call("relay_ping", device=hops)
                        bare.append(time.perf_counter() - t)
        if not hops:
            return {"phase": times[:runs]}
        fabric.done(*seq[-1])                    # the last phase asked: the first goes up
        time.sleep(gap_s)
        while len(stall) < runs:
            for ph, rnd in seq:
                t = time.perf_counter()
                fabric.phase(ph, rnd)
                stall.append(time.perf_counter() - t)
                fabric.done(ph, rnd)             # its links are free: the next goes up
                time.sleep(gap_s)                # while the job computes
        return {"phase": times[:runs], "bare": bare[:runs], "stall": stall[:runs],
                "ahead": [fabric.ahead]}
    finally:
        if fabric is not None:
            fabric.close()
        stack.close()


def _row(case: str, xs: list[float], extra: float = 0.0) -> dict:
    return {"case": case, "runs": len(xs),
            "p50_ms": f"{1e3 * (statistics.median(xs) + extra):.3f}",
            "p99_ms": f"{1e3 * (percentile(xs, 0.99) + extra):.3f}",
            "max_ms": f"{1e3 * (max(xs) + extra):.3f}"}


def run(args) -> dict:
    gap = args.gap_ms / 1e3
    chip_all = _measure("lumion", 0.0, args.runs, gap_s=gap, hops="chip")
    chip = chip_all["phase"]
    ocs = _measure("opus", 0.0, args.runs, gap_s=gap)["phase"]
    chip_n_all = _measure("lumion", 0.0, args.runs, "normal", gap, hops="chip")
    chip_n = chip_n_all["phase"]
    ocs_n = _measure("opus", 0.0, args.runs, "normal", gap)["phase"]
    rows = [_row("chip (lumion), zero delays", chip), _row("OCS (opus), zero delays", ocs),
            _row("chip, zero delays, journal sync normal", chip_n),
            _row("OCS, zero delays, journal sync normal", ocs_n),
            _row("chip, realistic (+1 ms serial, +10 us heaters)", chip,
                 SERIAL_LINE_S + HEATER_SETTLE_S)]
    samples = {"chip": chip, "ocs": ocs, "chip_normal": chip_n, "ocs_normal": ocs_n}
    notes = []
    for label, got in (("full", chip_all), ("normal", chip_n_all)):
        rows.append(_row(f"chip, bare hops (job -> agent -> chip service -> DAC pty and "
                         f"back), journal {label}", got["bare"]))
        rows.append(_row(f"chip, job-visible stall, set up ahead ({args.gap_ms:g} ms of "
                         f"compute between), journal {label}", got["stall"]))
        samples[f"chip_bare_{label}"] = got["bare"]
        samples[f"chip_stall_{label}"] = got["stall"]
        ratios = [percentile(got["phase"], q) / percentile(got["bare"], q) for q in (0.5, 0.99)]
        notes.append(f"journal {label}: chip phase switch over its bare hops, measured in the "
                     f"same run: {ratios[0]:.2f}x at p50, {ratios[1]:.2f}x at p99 (goal <= "
                     f"{HOPS_GOAL:g}x: {'met' if max(ratios) <= HOPS_GOAL else 'NOT met'})")
        p99 = percentile(got["stall"], 0.99)
        notes.append(f"journal {label}: job-visible stall with phases set up ahead, "
                     f"{args.gap_ms:g} ms of compute between: p99 {1e3 * p99:.3f} ms (goal <= "
                     f"{1e3 * STALL_GOAL_S:g} ms: {'met' if p99 <= STALL_GOAL_S else 'NOT met'}"
                     f"; {got['ahead'][0]} of {len(got['stall'])} found set up ahead)")
    if args.realistic:
        slow = _measure("opus", 25.0, args.runs, gap_s=gap)["phase"]
        rows.append(_row("OCS, realistic (25 ms per move, measured)", slow))
        samples["ocs_25ms"] = slow
    for label, a, b in (("full", chip, ocs), ("normal", chip_n, ocs_n)):
        p99 = max(percentile(a, 0.99), percentile(b, 0.99))
        notes.append(f"journal {label}: goal phase switch p99 <= 2 ms with zero device delays "
                     f"{'met' if p99 <= 0.002 else 'NOT met'} ({1e3 * p99:.3f} ms)")
    return {"rows": rows, "notes": notes,
            "samples_ms": {k: [round(1e3 * x, 4) for x in v] for k, v in samples.items()}}
