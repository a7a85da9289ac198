"""Update every channel of a 56-channel heater chain, through the real pty: our driver
versus the vendor's `qontrol` client writing channel by channel."""
from __future__ import annotations

import statistics
import time

import numpy as np

from photonic_testbed.drivers.heater_dac import HeaterDAC
from photonic_testbed.emulator.rig import EmulatedRig
from photonic_testbed.hil.rig import rig_spec
from photonic_testbed.ptb.bench import SEED, integer

NAME = "dac"
HELP = "all-channel heater updates: our driver vs the qontrol client (wall time, bytes)"
# qontrol waits this long for each reply; its default (0.1 s) fails on a busy machine. A reply
# that comes sooner ends the wait, so the timed path is unchanged.
QONTROL_RESPONSE_TIMEOUT_S = 2.0


def add_arguments(p) -> None:
    p.add_argument("--updates", type=integer(1, 10 ** 6), default=50,
                   help="full updates per client")
    p.add_argument("--seed", type=SEED, default=0)


def _measure(rig, apply, vectors):
    board = rig.dac
    times = []
    before = board.bytes_in + board.bytes_out
    for v in vectors:
        t = time.perf_counter()
        apply(v)
        times.append(time.perf_counter() - t)
    wire = board.bytes_in + board.bytes_out - before
    return statistics.median(times), wire / len(vectors)


def run(args) -> dict:
    try:
        import qontrol
    except ImportError:
        qontrol = None
    rng = np.random.default_rng(args.seed)
    with EmulatedRig(rig_spec("lumion"), seed=args.seed) as rig:
        port = rig.endpoints["dac"]
        with HeaterDAC(port) as dac:
            n = dac.channels
            # Voltages as a calibration computes them: full-precision floats in 0..7 V.
            vectors = [[float(x) for x in rng.uniform(0.0, 7.0, n)] for _ in range(args.updates)]
            ours_t, ours_b = _measure(rig, dac.set_voltages, vectors)
        rows = [{"client": "ptb HeaterDAC (VHEX, changed runs)", "channels": n,
                 "median_ms": f"{ours_t * 1e3:.3f}", "bytes_per_update": f"{ours_b:.0f}"}]
        result = {"channels": n, "updates": args.updates,
                  "ours": {"median_s": ours_t, "bytes": ours_b}}
        if qontrol is not None:
            q = qontrol.QXOutput(serial_port_name=port,
                                 response_timeout=QONTROL_RESPONSE_TIMEOUT_S)
            try:
                def per_channel(v):
                    for ch, x in enumerate(v):
                        q.v[ch] = x
                q_t, q_b = _measure(rig, per_channel, vectors)
            finally:
                q.close()
            rows.append({"client": "qontrol 1.1.20 QXOutput per-channel", "channels": n,
                         "median_ms": f"{q_t * 1e3:.3f}", "bytes_per_update": f"{q_b:.0f}"})
            result["qontrol"] = {"median_s": q_t, "bytes": q_b}
            result["speedup"] = q_t / ours_t
            result["byte_ratio"] = q_b / ours_b
            result["notes"] = [f"ours is {q_t / ours_t:.1f}x faster and sends "
                               f"{q_b / ours_b:.1f}x fewer bytes (both directions counted)"]
        else:
            result["notes"] = ["qontrol is not installed: only our driver was measured"]
    result["rows"] = rows
    return result
