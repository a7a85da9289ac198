"""`ptb bench NAME`: measured speed, printed as a table and written as JSON.

Each benchmark module has `NAME`, `HELP`, `add_arguments(parser)` and `run(args) -> dict`;
the dict holds a `rows` list (what the table prints) and anything else worth keeping.
"""
from __future__ import annotations

import importlib
import json
import os
import platform
import time

BENCHMARKS = ("dac", "ocs", "bus", "mesh", "gui", "failover", "phase", "calibrate", "scale",
              "swap", "record")


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
    print("  ".join(k.ljust(w) for k, w in zip(keys, widths)))
    print("  ".join("-" * w for w in widths))
    for c in cells:
        print("  ".join(v.ljust(w) for v, w in zip(c, widths)))


def _run(mod, args) -> int:
    started = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    result = mod.run(args)
    result = {"benchmark": mod.NAME, "started": started, "machine": machine(), **result}
    print_table(result["rows"])
    for line in result.get("notes", ()):
        print(line)
    tmp = args.json + ".tmp"
    with open(tmp, "w") as f:
        json.dump(result, f, indent=2)
    os.replace(tmp, args.json)
    print(f"results written to {args.json}")
    return 0
