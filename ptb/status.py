"""`ptb status`: is the rig up? Every process of a rig's bus asked for `ping` (device services,
the agent, GPU monitors), or every instrument of an emulator's endpoints file asked what it is;
with `--wait S`, asked again until all answer or S seconds pass.

A script that starts the stack in the background waits for it with this before it uses it
(docs/agent-bus.md): what is up and what is not is printed either way, and the exit code says
whether everything answered (0) or not (1).
"""
from __future__ import annotations

import functools
import time
from collections.abc import Callable
from dataclasses import dataclass

from photonic_testbed.hil.files import FileNotWritten, wait_for
from photonic_testbed.ptb.cli import CommandFailed

ASK_S = 1.0          # one ping or one probe: a process up and serving answers well within it
AGAIN_S = 0.2        # between rounds of asking what did not answer


@dataclass
class Answer:
    name: str
    what: str           # the device's kind, or the instrument's identity
    up: bool
    detail: str         # round trip, or why not


def add_parser(sub) -> None:
    p = sub.add_parser("status", help="ask every process of a rig's bus (or every instrument) "
                       "whether it answers",
                       description="Ask every device service, the agent and the GPU monitors "
                       "of a rig's bus for `ping` (--rig), or every instrument of an emulator's "
                       "endpoints file what it is (--endpoints: id? on the serial link, *IDN? "
                       "on sockets). Exit 0 when all answer, 1 otherwise.")
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--rig", metavar="FILE", help="the rig file (TOML)")
    where.add_argument("--endpoints", metavar="FILE",
                       help="an emulator's endpoints file (ptb emulate --endpoints)")
    p.add_argument("--device", action="append", default=[], metavar="NAME",
                   help="ask only this one (repeatable; with --rig: a device, and where the rig "
                   "has GPUs `agent` and its GPU monitors)")
    p.add_argument("--wait", type=float, default=0.0, metavar="S",
                   help="ask again until all answer or S seconds pass; the file, too, is "
                   "waited for (default 0: ask once)")
    p.set_defaults(func=run)


def run(args) -> int:
    if not 0 <= args.wait <= 3600:
        raise CommandFailed(f"--wait must be in 0..3600 s, not {args.wait:g}")
    deadline = time.monotonic() + args.wait
    path = args.rig or args.endpoints
    try:
        wait_for(path, args.wait, "rig file" if args.rig else "endpoints file",
                 say=lambda text: print(text, flush=True))
    except FileNotWritten as e:
        raise CommandFailed(str(e)) from None
    askers = _rig_askers(args.rig, args.device) if args.rig else \
        _instrument_askers(args.endpoints, args.device)
    answers: dict[str, Answer] = {}
    while True:
        for name, ask in askers.items():
            if name not in answers or not answers[name].up:
                answers[name] = ask()
        if all(a.up for a in answers.values()) or time.monotonic() >= deadline:
            break
        time.sleep(AGAIN_S)
    for a in answers.values():
        print(f"{a.name:<14} {a.what:<12} {'up' if a.up else 'DOWN':<5} {a.detail}")
    down = [a.name for a in answers.values() if not a.up]
    if down:
        print(f"{len(down)} of {len(answers)} did not answer"
              + (f" within {args.wait:g} s" if args.wait else "") + f": {', '.join(down)}")
        return 1
    print(f"all {len(answers)} answered")
    return 0


def _chosen(names: list[str], wanted: list[str], where: str) -> list[str]:
    unknown = [w for w in wanted if w not in names]
    if unknown:
        raise CommandFailed(f"--device {unknown[0]}: {where} has {', '.join(names)}")
    return wanted or names


def _rig_askers(path: str, wanted: list[str]) -> dict[str, Callable[[], Answer]]:
    from photonic_testbed.hil.bus.security import KeyFileError
    from photonic_testbed.hil.rig import RigFileError, load
    try:
        rig = load(path)
        keys = rig.client_keys()
    except (RigFileError, KeyFileError) as e:
        raise CommandFailed(str(e)) from None
    endpoints = {name: (d.kind, d.request) for name, d in rig.devices.items()}
    if rig.gpus:            # a rig without GPUs runs no agent and no GPU monitor
        if rig.replicas:    # each replica of a replicated agent (one leads, the others stand by)
            endpoints.update((f"agent-{name}", ("agent", ends[0]))
                             for name, ends in rig.replicas.items())
        else:
            endpoints["agent"] = ("agent", rig.agent_endpoints()[0])
        endpoints.update((name, ("gpus", ends[0])) for name, ends in rig.gpu_monitors().items())
    names = _chosen(list(endpoints), wanted, f"rig {rig.name}")
    return {n: functools.partial(_ping, n, *endpoints[n], keys) for n in names}


def _ping(name: str, kind: str, endpoint: str, keys) -> Answer:
    from photonic_testbed.hil.bus.client import BusError, ServiceClient
    client = ServiceClient(endpoint, timeout=ASK_S, keys=keys)
    t0 = time.perf_counter()
    try:
        got = client.call("ping")
    except BusError as e:
        return Answer(name, kind, False, str(e))
    finally:
        client.close()
    online = got.get("online", True) if isinstance(got, dict) else True
    rtt = f"{(time.perf_counter() - t0) * 1000:.1f} ms"
    return Answer(name, kind, True, rtt if online else f"{rtt}, its device offline")


def _instrument_askers(path: str, wanted: list[str]) -> dict[str, Callable[[], Answer]]:
    from photonic_testbed.hil.lab.discover import SCPI_PORT, probe_scpi, probe_serial
    from photonic_testbed.hil.lab.session import (
        ENDPOINT_DEVICES,
        SessionError,
        parse_address,
        read_endpoints,
    )
    try:
        wires = {k: parse_address(a, SCPI_PORT) for k, a in read_endpoints(path).items()
                 if k in ENDPOINT_DEVICES}
    except SessionError as e:
        raise CommandFailed(str(e)) from None
    names = _chosen(list(wires), wanted, path)

    def ask(name: str) -> Answer:
        wire = wires[name]
        t0 = time.perf_counter()
        probe = probe_serial(wire.address, ASK_S) if wire.kind == "serial" else \
            probe_scpi(wire.address, "tcp", ASK_S)
        if probe.status != "found":
            why = probe.detail or f"{probe.status}: {probe.answer!r}"
            return Answer(name, wire.kind, False, f"{wire.address}: {why}")
        return Answer(name, probe.kind, True,
                      f"{(time.perf_counter() - t0) * 1000:.1f} ms  {probe.answer}")
    return {n: functools.partial(ask, n) for n in names}

