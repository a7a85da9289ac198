"""`ptb gpus`: this host's GPU health monitor on the bus (device `gpus`), from NVML and the
transceivers' DDM, the real-host counterpart of the emulated rack's (docs/gpu-monitor.md)."""
from __future__ import annotations

import signal
import threading

import zmq

from photonic_testbed.hil.bus.security import KeyFileError
from photonic_testbed.hil.files import WAIT_S
from photonic_testbed.hil.gpus.ddm import ETHTOOL_TIMEOUT_S, DdmReader
from photonic_testbed.hil.gpus.health import GpuHealthUnavailable, NvmlHealth
from photonic_testbed.hil.gpus.monitor import POLL_S, GpuMonitor, GpuMonitorError
from photonic_testbed.hil.rig import RigFileError, load
from photonic_testbed.ptb.cli import CommandFailed


def add_parser(sub) -> None:
    p = sub.add_parser("gpus", help="run this host's GPU health monitor (NVML + DDM) on the bus",
                       description="Publish the health of this host's GPUs (NVML: Xid events, "
                       "ECC, temperature, PCIe replays, NVLink errors) as device `gpus`, and "
                       "answer rx_power from the transceivers' DDM (`ethtool -m`), as the "
                       "emulated rack does (docs/gpu-monitor.md).")
    p.add_argument("--rig", required=True, metavar="FILE", help="the rig file (TOML)")
    p.add_argument("--host", metavar="NAME",
                   help="only the rig's [[gpus]] with host = NAME (default: all of them)")
    p.add_argument("--no-nvml", action="store_true",
                   help="no GPU health (a host without NVML): answer rx_power from DDM only")
    p.add_argument("--poll", type=float, default=POLL_S, metavar="S",
                   help=f"seconds between full reads of the GPUs' counters (default {POLL_S:g}"
                   "; Xid events are taken as they come)")
    p.add_argument("--ethtool", default="ethtool", metavar="PATH",
                   help="the ethtool program (default: ethtool on PATH)")
    p.add_argument("--ethtool-timeout", type=float, default=ETHTOOL_TIMEOUT_S, metavar="S",
                   help=f"time limit of one `ethtool -m` (default {ETHTOOL_TIMEOUT_S:g} s)")
    p.set_defaults(func=run)


def run(args) -> int:
    if args.poll <= 0 or args.ethtool_timeout <= 0:
        raise CommandFailed("--poll and --ethtool-timeout take a positive number of seconds")
    try:
        rig = load(args.rig, wait_s=WAIT_S)
    except RigFileError as e:
        raise CommandFailed(str(e)) from None
    nvml = None
    if not args.no_nvml:
        try:
            nvml = NvmlHealth()
        except GpuHealthUnavailable as e:
            raise CommandFailed(f"no GPU health here: {e}. On a host without NVML, "
                                "--no-nvml serves only the transceivers' power (DDM)") from None
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    ddm = DdmReader(ethtool=args.ethtool, timeout_s=args.ethtool_timeout)
    monitor = None
    try:
        try:
            monitor = GpuMonitor(rig, nvml=nvml, ddm=ddm, host=args.host, poll_s=args.poll)
            request, publish = monitor.start()
        except (GpuMonitorError, KeyFileError, OSError) as e:
            raise CommandFailed(str(e)) from None
        except zmq.ZMQError as e:              # address in use, no such interface, ...
            raise CommandFailed(f"cannot bind the rig's gpus endpoints: {e}") from None
        print(f"GPU monitor of rig {rig.name}: {len(monitor.names)} GPU(s), "
              f"{len(monitor.transceivers)} transceiver(s); requests {request}  "
              f"publishes {publish}")
        print("running; Ctrl-C to stop", flush=True)
        monitor.run(stop)
    finally:
        if monitor is not None:
            monitor.close()                 # with the DDM reader it was given
        else:
            ddm.close()
        if nvml is not None:
            nvml.close()
    print("stopped", flush=True)
    return 0
