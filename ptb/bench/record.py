"""What `ptb record` adds to a round trip: `id?` to the heater DAC (serial) and `*IDN?` to the OCS
(pyvisa, raw socket), directly and through the recorder, interleaved in the same run.

Two identical emulated lumion rigs run as `ptb emulate` processes (a serial port has one
reader, so the recorded and the direct client cannot share one board); `ptb record` relays the
second one and writes its session; the clients run in this process and alternate, one direct
round trip then one recorded (the order swapped every round), so that the machine's load falls
on both alike."""
from __future__ import annotations

import contextlib
import json
import pathlib
import statistics
import tempfile
import time

from photonic_testbed.ptb.bench import integer
from photonic_testbed.ptb.cli import CommandFailed
from photonic_testbed.ptb.stack import Stack

NAME = "record"
HELP = "round trips of id? (DAC) and *IDN? (OCS) through ptb record vs direct"


def add_arguments(p) -> None:
    p.add_argument("--rounds", type=integer(10, 10 ** 6), default=2000,
                   help="round trips per device and path (default %(default)s)")


class _Board:
    """`id?` round trips on a heater DAC's serial port (skipping the power-up notice)."""

    def __init__(self, path: str):
        import serial
        self.port = serial.Serial(path, 115200, timeout=5)
        self.buf = b""

    def ask(self) -> float:
        t = time.perf_counter()
        self.port.write(b"id?\n")
        while True:
            while b"\n" not in self.buf:
                chunk = self.port.read(self.port.in_waiting or 1)
                if not chunk:
                    raise RuntimeError("the board did not answer id?")
                self.buf += chunk
            line, self.buf = self.buf.split(b"\n", 1)
            if not line.startswith(b"E90"):
                break
        return time.perf_counter() - t

    def close(self) -> None:
        self.port.close()


class _Switch:
    """`*IDN?` round trips with plain pyvisa (explicit terminations)."""

    def __init__(self, resource: str):
        import pyvisa
        from pyvisa.resources import MessageBasedResource
        inst = pyvisa.ResourceManager("@py").open_resource(
            resource, read_termination="\n", write_termination="\n", timeout=5000)
        if not isinstance(inst, MessageBasedResource):
            inst.close()
            raise CommandFailed(f"{resource} is not a message-based VISA resource")
        self.inst = inst

    def ask(self) -> float:
        t = time.perf_counter()
        self.inst.query("*IDN?")
        return time.perf_counter() - t

    def close(self) -> None:
        self.inst.close()


def _stats(ts: list[float]) -> tuple[float, float]:
    s = sorted(ts)
    return statistics.median(s), s[min(len(s) - 1, int(0.99 * len(s)))]


def run(args) -> dict:
    with contextlib.ExitStack() as stacks:
        work = pathlib.Path(stacks.enter_context(tempfile.TemporaryDirectory(
            prefix="ptb-bench-record-")))
        sides = {side: stacks.enter_context(Stack(work / side)) for side in ("direct", "recorded")}
        for stack in sides.values():
            stack.emulate("lumion", "--seed", "0")
        recorded, relays, session = sides["recorded"], work / "relays.json", work / "session.jsonl"
        recorded.ptb("record", "record", "--endpoints", str(recorded.workdir / "emulator.json"),
                     "--write-endpoints", str(relays), "--out", str(session))
        recorded.wait("the recorder's relays", relays.exists, log="record")
        direct = json.loads((sides["direct"].workdir / "emulator.json").read_text())
        relayed = json.loads(relays.read_text())
        rows, results = [], {}
        for device, client, label in (("dac", _Board, "heater DAC, id? (serial)"),
                                      ("ocs", _Switch, "OCS, *IDN? (pyvisa, socket)")):
            a, b = client(direct[device]), client(relayed[device])
            times: dict[str, list[float]] = {"direct": [], "recorded": []}
            try:
                for _ in range(20):                      # warm both paths up
                    a.ask()
                    b.ask()
                for k in range(args.rounds):
                    pair = ((a, "direct"), (b, "recorded"))
                    for c, name in (pair if k % 2 == 0 else pair[::-1]):
                        times[name].append(c.ask())
            finally:
                a.close()
                b.close()
            (d50, d99), (r50, r99) = _stats(times["direct"]), _stats(times["recorded"])
            results[device] = {"direct_median_s": d50, "direct_p99_s": d99,
                               "recorded_median_s": r50, "recorded_p99_s": r99,
                               "added_median_s": r50 - d50, "ratio": r50 / d50}
            rows.append({"device": label, "direct median ms": f"{d50 * 1e3:.3f}",
                         "recorded median ms": f"{r50 * 1e3:.3f}",
                         "added ms": f"{(r50 - d50) * 1e3:.3f}", "ratio": f"{r50 / d50:.2f}",
                         "direct p99 ms": f"{d99 * 1e3:.3f}",
                         "recorded p99 ms": f"{r99 * 1e3:.3f}"})
        recorded.stop("record")               # the session file finished
        lines = sum(1 for _ in open(session))
    worst = max(r["added_median_s"] for r in results.values())
    return {"rounds": args.rounds, "rig": "lumion", "results": results, "rows": rows,
            "session_lines": lines,
            "notes": [f"worst added median: {worst * 1e3:.3f} ms per exchange (goal <= 1 ms); "
                      f"the session held {lines} lines"]}
