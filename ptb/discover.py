"""`ptb discover`: find a bench's devices, ask each what it is, write a rig file skeleton.

How it looks and what it recognises: hil.lab.discover.
"""
from __future__ import annotations

import os
import pathlib
import re
import time

from photonic_testbed.hil.lab.discover import (
    DEFAULT_TIMEOUT_S,
    SCPI_PORT,
    DiscoveryError,
    discover,
    endpoint_addresses,
    host_resource,
    listed_serial_ports,
    listed_visa_resources,
    skeleton,
)
from photonic_testbed.ptb.cli import CommandFailed, check_output

# ---- the command ---------------------------------------------------------------------------------

def add_parser(sub) -> None:
    p = sub.add_parser(
        "discover", help="find a bench's devices and write a rig file skeleton",
        description="List serial ports and VISA resources, ask each what it is (id? on "
        "serial, *IDN? on sockets and VISA instruments; nothing else is written), and write "
        "a rig file skeleton with the devices found.")
    p.add_argument("hosts", nargs="*", metavar="HOST[:PORT]",
                   help=f"instruments on raw SCPI sockets (port {SCPI_PORT} by default)")
    p.add_argument("--serial", action="append", default=[], metavar="PORT",
                   help="also ask this serial port (repeatable), e.g. a by-id link")
    p.add_argument("--endpoints", metavar="FILE",
                   help="also ask the instruments of an emulator's endpoints file "
                   "(ptb emulate --endpoints)")
    p.add_argument("--no-scan", action="store_true",
                   help="ask only what is named here: do not list serial ports and VISA "
                   "resources")
    p.add_argument("--timeout-s", type=float, default=DEFAULT_TIMEOUT_S, metavar="S",
                   help=f"how long each device may take to answer (default {DEFAULT_TIMEOUT_S:g})")
    p.add_argument("--out", default="rig.toml", metavar="FILE",
                   help="the rig file to write (default rig.toml)")
    p.add_argument("--force", action="store_true", help="replace --out if it exists")
    p.add_argument("--name", default="bench", help="the rig's name (default bench)")
    p.add_argument("--chip", metavar="TOPOLOGY",
                   help="the chip on the heater DAC (e.g. benes16): offer the board as the "
                   "chip device, with [chip] topology")
    p.add_argument("--base-port", type=int, metavar="PORT",
                   help="bus endpoints PORT, PORT+1, ... in device order (default: free ports)")
    p.set_defaults(func=run)


def run(args) -> int:
    try:
        return _run(args)
    except DiscoveryError as e:
        raise CommandFailed(str(e)) from None


def _run(args) -> int:
    if not 0 < args.timeout_s <= 60:
        raise CommandFailed(f"--timeout-s must be in (0, 60], not {args.timeout_s:g}")
    if args.base_port is not None and not 1024 <= args.base_port <= 64000:
        raise CommandFailed(f"--base-port must be in 1024..64000, not {args.base_port}")
    if args.chip:
        from photonic_testbed.common.topology import TopologyError, topology_named
        try:
            topology_named(args.chip)
        except TopologyError as e:
            raise CommandFailed(f"--chip {args.chip}: {e}") from None
    out = pathlib.Path(args.out)
    check_output(out, "--out")
    if not re.fullmatch(r"[A-Za-z0-9_.\-]{1,64}", args.name or "x"):
        raise CommandFailed(f"--name {args.name!r}: letters, digits, '_', '-' and '.'")
    if out.exists() and not args.force:
        raise CommandFailed(f"{out} exists: give --force to replace it, or another --out")
    serial_ports = list(args.serial)
    resources = [host_resource(h) for h in args.hosts]
    if args.endpoints:
        links, sockets = endpoint_addresses(args.endpoints)
        serial_ports += links
        resources += sockets
    started = time.monotonic()
    if not args.no_scan:
        import pyvisa
        serial_ports += listed_serial_ports()
        try:
            visa_serial, visa_other = listed_visa_resources(pyvisa.ResourceManager("@py"))
        except (OSError, ValueError) as e:
            print(f"no VISA listing: {e}")
            visa_serial, visa_other = [], []
        known = {os.path.realpath(p) for p in serial_ports}
        serial_ports += [p for p in visa_serial if os.path.realpath(p) not in known]
        resources += visa_other
    if not serial_ports and not resources:
        raise CommandFailed("nothing to ask: no serial port or VISA resource is listed and "
                            "none was named (HOST[:PORT], --serial, --endpoints)")
    probes = discover(serial_ports=_dedupe_serial(serial_ports), resources=resources,
                      timeout_s=args.timeout_s)
    print(f"asked {len(probes)} address(es) in {time.monotonic() - started:.1f} s:")
    for p in probes:
        print(p.line())
    rig = skeleton(probes, args.name, args.chip or "", args.base_port)
    from photonic_testbed.hil import rig as rigfile
    rigfile.write(out, rig)
    rigfile.load(out)              # what is written reads back (the writer's own promise)
    names = ", ".join(f"{d.name} ({d.kind})" for d in rig.devices.values())
    print(f"wrote {out}: {names}")
    left = [p for p in probes if p.status != "found"]
    if left:
        print(f"{len(left)} address(es) gave no device: see above")
    return 0


def _dedupe_serial(ports: list[str]) -> list[str]:
    """One probe per port, however many names it has (a by-id link and its device)."""
    seen: set[str] = set()
    out = []
    for p in ports:
        real = os.path.realpath(p)
        if real not in seen:
            seen.add(real)
            out.append(p)
    return out

