"""`ptb leco --rig FILE`: the rig's instruments as LECO actors (hil.bridges.leco), for PyMoDAQ
and any LECO client, until Ctrl-C. Through the rig's bus by default (the device services must
run: `ptb serve`), or with --direct through the drivers (a bench without the bus).

    ptb leco --rig lumion.toml                          # a coordinator runs on localhost:12300
    ptb leco --rig lumion.toml --serve-coordinator      # ... or this command runs one
"""
from __future__ import annotations

import signal
import threading

from photonic_testbed.ptb.cli import CommandFailed

DEFAULT_COORDINATOR = "localhost:12300"


def add_parser(sub) -> None:
    p = sub.add_parser("leco", help="the rig's instruments as LECO actors (PyMoDAQ, pyleco)",
                       description="Serve each instrument of the rig (heater DACs and chips, "
                       "power meters, lasers, switches) as a LECO actor named after the "
                       "device, signed in to a LECO coordinator, until Ctrl-C (docs/leco.md).")
    p.add_argument("--rig", required=True, metavar="FILE", help="the rig file (TOML)")
    p.add_argument("--device", action="append", metavar="NAME",
                   help="only this device (repeatable); default every instrument")
    p.add_argument("--direct", action="store_true",
                   help="open the devices' drivers here instead of asking their services on "
                   "the bus (nothing else may have them open)")
    p.add_argument("--coordinator", default=DEFAULT_COORDINATOR, metavar="HOST:PORT",
                   help=f"the LECO coordinator to sign in to (default {DEFAULT_COORDINATOR})")
    p.add_argument("--serve-coordinator", action="store_true",
                   help="run the coordinator in this process, bound to HOST:PORT of "
                   "--coordinator only")
    p.add_argument("--namespace", default="ptb", metavar="NAME",
                   help="the node's name, with --serve-coordinator (default ptb)")
    p.add_argument("--wait", type=float, default=10.0, metavar="S",
                   help="how long the devices and the coordinator may take to answer at "
                   "start (default 10)")
    p.set_defaults(func=run)


def run(args) -> int:
    from photonic_testbed.hil.rig.model import host_port
    where = host_port(args.coordinator)
    if where is None:
        raise CommandFailed(f"--coordinator is HOST:PORT (a port 1..65535), not "
                            f"{args.coordinator!r}")
    host, port = where
    if not 0 < args.wait <= 3600:
        raise CommandFailed(f"--wait must be in (0, 3600] s, not {args.wait:g}")
    try:
        from photonic_testbed.hil.bridges import leco
    except ImportError as e:
        raise CommandFailed(str(e)) from None
    from photonic_testbed.hil.bridges.access import BridgeError, open_rig, wait_until_up
    from photonic_testbed.hil.rig import RigFileError
    from photonic_testbed.ptb.calibrate import read_rig
    rig = read_rig(args.rig)
    stop = threading.Event()                 # Ctrl-C
    routing = threading.Event()              # set: this process's coordinator stops
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    if args.serve_coordinator:
        try:
            leco.start_coordinator(host, port, args.namespace, routing)
        except Exception as e:            # the address taken, a host not ours
            raise CommandFailed(f"cannot run a LECO coordinator on {host}:{port}: {e}") from None
    if not leco.coordinator_answers(host, port, args.wait, stop):
        routing.set()
        if stop.is_set():
            print("stopped before the actors were up", flush=True)
            return 0
        raise CommandFailed(f"no LECO coordinator answers at {host}:{port} (start one, e.g. "
                            "pyleco's `coordinator`, or give --serve-coordinator)")
    try:
        devices = open_rig(rig, args.device, direct=args.direct)
    except (RigFileError, BridgeError) as e:
        routing.set()
        raise CommandFailed(str(e)) from None
    except Exception as e:                # a driver that cannot open its device
        routing.set()
        raise CommandFailed(f"cannot open the devices: {e}") from None
    actors = None
    try:
        try:
            if not wait_until_up(devices, args.wait, stop):
                print("stopped before the actors were up", flush=True)
                return 0
            actors = leco.Actors(devices, host, port)
        except BridgeError as e:
            raise CommandFailed(f"{e} (are the rig's services up? `ptb serve --rig "
                                f"{args.rig}`, or --direct)") from None
        missing = actors.not_signed_in(args.wait, stop)
        if stop.is_set():
            print("stopped before the actors were up", flush=True)
            return 0
        if missing:
            raise CommandFailed(f"the coordinator at {host}:{port} did not take "
                                f"{', '.join(missing)} (a component of that name is signed "
                                "in already?)")
        print(f"LECO actors {', '.join(actors.actors)} signed in at {host}:{port}; "
              "Ctrl-C to stop", flush=True)
        while not stop.wait(0.2):
            if actors.ended.is_set():
                raise CommandFailed(f"the LECO actor {', '.join(actors.lost)} stopped (see "
                                    "the log): ptb leco stops with it")
    finally:
        if actors is not None:              # (they sign out before the coordinator stops)
            actors.close()
        else:
            for a in devices.values():
                a.close()
        routing.set()
    return 0
