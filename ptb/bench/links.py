"""Links that fade or flap under the emulated job, found from the receivers' power and moved to
other cells of the chip (hil/agent/linkwatch.py), on lumion with its GPUs on alternate ports.

One stack (emulator with `--cabling alternate` and the transceivers' reports spread by
`--ddm-noise` dB, the chip service, the agent), the emulated job (dp ring of 8) running
throughout. Then:

1. Healthy: `--healthy-s` seconds of the job with nothing injected, beside `--load` CPU-bound
   processes: every `link` entry the agent journals is a false move.
2. Events in a seeded order: fades at each of `--rates` dB/s (up to 20 dB) and flaps of each of
   `--periods` s (30 dB lost every other period), each on a link of the job's ring drawn at
   random (not one of the last two events'). A flap dark for longer than the job's collective
   timeout (2 s) is a failure to the job, taken by the failure path before a flap can be seen.
   Per event: found or not (recall: a `moved` entry for that link within `--give-up` seconds),
   the seconds from the injection to the move, the received power when moved (a fade moved
   above the half-rate threshold cost the job no bandwidth), whether the job ran a communication
   over a slowed or dark link meanwhile, and whether its rank map changed (it must not). A
   `link` entry naming another link is a false one (precision). After each event the fault is
   cleared and the chip told to forget the waveguides it avoided.
"""
from __future__ import annotations

import random
import statistics
import subprocess
import sys
import time

from photonic_testbed.hil.bus.client import ServiceClient
from photonic_testbed.hil.lab.control_client import request
from photonic_testbed.ptb.bench import SEED, integer, number
from photonic_testbed.ptb.bench.measure import agent_stack, journal_reader
from photonic_testbed.ptb.stack import Stack

NAME = "links"
HELP = ("links that fade or flap under the emulated job: detection (precision, recall, seconds), "
        "the power when moved, false moves, ranks unchanged")
HALF_RATE_DBM = -9.0          # the receivers' sensitivity (-12 dBm) + 3 dB (emulator.rack)


def add_arguments(p) -> None:
    p.add_argument("--rates", type=number(0.001, 10.0), nargs="*",
                   default=[0.05, 0.1, 0.2, 0.5, 1.0], metavar="DB_PER_S",
                   help="fades injected, dB/s (default 0.05 0.1 0.2 0.5 1)")
    p.add_argument("--periods", type=number(0.1, 60.0), nargs="*", default=[0.5, 1.0, 1.5],
                   metavar="S", help="flaps injected, their period (default 0.5 1 1.5: a link "
                   "dark longer than the emulated job's 2 s collective timeout fails the job "
                   "before it can be seen to flap, and the failure path takes it)")
    p.add_argument("--healthy-s", type=number(0.0, 86400.0), default=120.0,
                   help="seconds of the job with nothing injected (default 120)")
    p.add_argument("--load", type=integer(0, 64), default=2,
                   help="CPU-bound processes beside the healthy seconds (default 2)")
    p.add_argument("--ddm-noise", type=number(0.0, 3.0), default=0.15, metavar="DB",
                   help="the spread of the transceivers' power reports (default 0.15 dB)")
    p.add_argument("--give-up", type=integer(10, 3600), default=180, metavar="S",
                   help="an event not moved within this many seconds is a miss (default 180)")
    p.add_argument("--seed", type=SEED, default=0)
    p.add_argument("--workdir", help="keep the stack's logs and journal here")


def _links(stack: Stack, t0: float) -> list:
    with journal_reader(stack) as j:
        return [e for e in j.entries(kinds=("link",)) if e.ts >= t0]


def _status(stack: Stack) -> dict:
    return request(stack.control, {"cmd": "job_status"})




def _event(stack: Stack, kind: str, value: float, src: str, dst: str, args) -> dict:
    t0 = time.time()
    before = _status(stack)
    cmd = ({"cmd": "fade_link", "db_per_s": value, "max_db": 20.0} if kind == "fade" else
           {"cmd": "flap_link", "period_s": value, "db": 30.0})
    request(stack.control, {**cmd, "src": src, "dst": dst})
    try:
        stack.wait(f"{src}->{dst} moved", lambda: _links(stack, t0) or
                   time.time() > t0 + args.give_up, args.give_up + 30, log="agent")
    finally:
        request(stack.control, {"cmd": "clear_faults"})
    got = _links(stack, t0)
    after = _status(stack)
    mine = [e for e in got if (e.details.src, e.details.dst) == (src, dst)]
    moved = next((e for e in mine if e.details.action == "moved"), None)
    with ServiceClient(stack.rig.endpoints()["chip"][0], timeout=10) as chip:
        chip.call("move_circuits", forget=True)
    time.sleep(5.0)        # the watch's readings of the cleared link: not the next event's
    return {"event": f"{kind} {value:g}{' dB/s' if kind == 'fade' else ' s'}",
            "link": f"{src}->{dst}", "found": moved is not None,
            "said": mine[0].details.action if mine else "-",
            "seconds": None if moved is None else round(moved.ts - t0, 1),
            "dbm_at_move": None if moved is None else moved.details.dbm,
            "others": len(got) - len(mine),
            "slowed": after["slow_communications"] - before["slow_communications"],
            "down": after["down_communications"] - before["down_communications"],
            "ranks_same": after.get("rank_map") == before.get("rank_map"),
            "restarts": after.get("restarts", 0) - before.get("restarts", 0)}


def run(args) -> dict:
    rng = random.Random(args.seed)
    events = [("fade", r) for r in args.rates] + [("flap", p) for p in args.periods]
    rng.shuffle(events)
    stack = agent_stack("lumion", cabling="alternate", ddm_noise_db=args.ddm_noise,
                        workdir=args.workdir)
    rows: list[dict] = []
    try:
        started = request(stack.control, {"cmd": "job_start", "plan": "dp", "steps": 10**7,
                                          "checkpoint_every": 1000})
        ranks = {int(r): g for r, g in started["rank_map"].items()}
        ring = [(ranks[r], ranks[(r + 1) % len(ranks)]) for r in sorted(ranks)]
        t0 = time.time()
        burners = [subprocess.Popen([sys.executable, "-c", "while True: pass"])
                   for _ in range(args.load)]
        try:
            time.sleep(args.healthy_s)
        finally:
            for b in burners:
                b.kill()
                b.wait(10)
        false_healthy = len(_links(stack, t0))
        recent: list[tuple[str, str]] = []
        for kind, value in events:     # each on a link not among the last two events'
            src, dst = rng.choice([link for link in ring if link not in recent] or ring)
            recent = [*recent[-1:], (src, dst)]
            rows.append(_event(stack, kind, value, src, dst, args))
    finally:
        stack.close()
    found = [r for r in rows if r["found"]]
    fades = [r for r in found if r["event"].startswith("fade")]
    others = sum(r["others"] for r in rows)
    notes = [
        f"healthy: {args.healthy_s:g} s of the job beside {args.load} CPU-bound processes "
        f"({args.healthy_s:g} s x 8 circuits read about once a second): {false_healthy} false "
        "moves",
        f"recall {len(found)}/{len(rows)}; precision {len(found)}/{len(found) + others}",
        f"seconds to move: median {statistics.median([r['seconds'] for r in found]):g}"
        if found else "nothing moved",
        f"fades moved above the half-rate threshold ({HALF_RATE_DBM:g} dBm): "
        f"{sum(1 for r in fades if r['dbm_at_move'] > HALF_RATE_DBM)}/{len(fades)}",
        f"rank maps unchanged: {sum(r['ranks_same'] for r in rows)}/{len(rows)}; restarts: "
        f"{sum(r['restarts'] for r in rows)}"]
    return {"rows": rows, "notes": notes,
            "config": {"rates": args.rates, "periods": args.periods, "seed": args.seed,
                       "healthy_s": args.healthy_s, "ddm_noise_db": args.ddm_noise,
                       "load": args.load,
                       "false_healthy": false_healthy}}
