"""`ptb bench NAME`: measured speed, printed as a table and written as JSON.

Each benchmark module has `NAME`, `HELP`, `add_arguments(parser)` and `run(args) -> dict`;
the dict holds a `rows` list (what the table prints) and anything else worth keeping.
Arguments are checked when they are parsed (`integer`, `number`, `SEED`: a bad value is a usage
error, never a crash minutes into a run), and so is the JSON file's folder.
"""
from __future__ import annotations

import argparse
import importlib
import json
import math
import os
import platform
import time

from photonic_testbed.hil.files import write_atomic
from photonic_testbed.ptb.cli import CommandFailed, check_output

BENCHMARKS = ("dac", "ocs", "bus", "mesh", "gui", "failover", "phase", "calibrate", "scale", "ha",
              "swap", "gray", "links", "soak", "record", "datacenter", "job", "watch", "bridges")


def integer(lo: int, hi: int):
    """An argparse type: an int in [lo, hi]."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
        if not lo <= value <= hi:
            raise argparse.ArgumentTypeError(f"must be {lo}..{hi}, not {text}")
        return value
    return parse


def number(lo: float, hi: float, *, above: bool = False):
    """An argparse type: a finite float in [lo, hi] (in (lo, hi] with `above`)."""
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
        if not math.isfinite(value) or value > hi or value < lo or (above and value == lo):
            raise argparse.ArgumentTypeError(
                f"must be {'>' if above else '>='} {lo:g} and <= {hi:g}, not {text}")
        return value
    return parse


SEED = integer(0, 2 ** 32 - 1)


def _module(name: str):
    return importlib.import_module(f"{__name__}.{name}")


def add_parser(sub) -> None:
    p = sub.add_parser("bench", help="measure speed (table on stdout, JSON file)",
                       description="Run a benchmark against the emulator and record it.")
    bench_sub = p.add_subparsers(dest="benchmark", metavar="BENCHMARK", required=True)
    for name in BENCHMARKS:
        mod = _module(name)
        bp = bench_sub.add_parser(name, help=mod.HELP, description=mod.HELP)
        bp.add_argument("--json", metavar="FILE", default=f"bench-{name}.json",
                        help="where to write the results (default %(default)s)")
        mod.add_arguments(bp)
        bp.set_defaults(func=lambda args, mod=mod: _run(mod, args))


def machine() -> dict:
    return {"python": platform.python_version(), "machine": platform.machine(),
            "processor": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
            "system": f"{platform.system()} {platform.release()}"}


def print_table(rows: list[dict]) -> None:
    if not rows:
        return
    keys = list(rows[0])
    cells = [[str(r.get(k, "")) for k in keys] for r in rows]
    widths = [max(len(k), *(len(c[i]) for c in cells)) for i, k in enumerate(keys)]
    print("  ".join(k.ljust(w) for k, w in zip(keys, widths, strict=True)))
    print("  ".join("-" * w for w in widths))
    for c in cells:
        print("  ".join(v.ljust(w) for v, w in zip(c, widths, strict=True)))


def _run(mod, args) -> int:
    check_output(args.json, "--json")
    started = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    result = mod.run(args)
    result = {"benchmark": mod.NAME, "started": started, "machine": machine(), **result}
    print_table(result["rows"])
    for line in result.get("notes", ()):
        print(line)
    try:
        write_atomic(args.json, json.dumps(result, indent=2))
    except OSError as e:
        raise CommandFailed(f"cannot write {args.json}: {e.strerror or e}") from None
    print(f"results written to {args.json}")
    return 0
