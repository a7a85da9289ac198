"""`ptb emulate`: run a rig's emulated instruments on their real wires until told to stop."""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import pathlib
import signal
import threading

import zmq

from photonic_testbed.common import heap
from photonic_testbed.common.rack_layout import CABLINGS, LAYOUTS
from photonic_testbed.emulator.chip import ChipError
from photonic_testbed.emulator.rack import RackError
from photonic_testbed.emulator.rig import EmulatedRig
from photonic_testbed.hil.rig import RIGS, AgentGroup, Rig, free_ports, rig_spec
from photonic_testbed.ptb.cli import CommandFailed, check_output

log = logging.getLogger(__name__)


def add_parser(sub) -> None:
    p = sub.add_parser("emulate", help="run an emulated rig (pty and loopback sockets)",
                       description="Start every instrument of an emulated rig, print where "
                       "each listens, and run until SIGINT or SIGTERM.")
    p.add_argument("--rig", default="lumion",
                   help=f"rig name ({', '.join(sorted(RIGS))}) or a TOML file with an "
                   "[emulator] table (docs/rigfile.md); default lumion")
    p.add_argument("--seed", type=int, default=0, help="seed of the hidden physical truth")
    p.add_argument("--endpoints", metavar="FILE", help="also write the endpoints as JSON here")
    p.add_argument("--port-base", type=int, metavar="PORT",
                   help="fixed TCP ports: OCS PORT, power meter PORT+1, laser PORT+2 "
                   "(default: ephemeral); the control endpoint is an ipc:// socket in a "
                   "folder only this user can enter, removed on exit")
    p.add_argument("--switching-ms", type=float, default=25.0,
                   help="OCS switching time in ms (default 25)")
    p.add_argument("--ideal-chip", action="store_true",
                   help="a chip without fabrication errors (its ideal calibration fits): "
                   "what the demo runs until the chip is calibrated")
    p.add_argument("--chip-from", metavar="CALIBRATION",
                   help="a digital twin: the chip's hidden truth from a measured calibration "
                   "file (offsets, P_pi, resistances, crosstalk, extinctions); the rig file "
                   "written names it as the chip's calibration")
    p.add_argument("--job", metavar="PLAN", choices=("dp", "dp-tp"),
                   help="start the emulated training job (dp or dp-tp) once the agent "
                   "answers; otherwise the control endpoint's job_start starts it")
    p.add_argument("--replicas", type=int, default=0, metavar="N",
                   help="the rig file names N replicas of the agent ([replicas.r0] ...: a "
                   "group on an etcd journal, docs/control-plane.md), and the emulated job "
                   "finds the one that leads")
    p.add_argument("--groups", choices=("one", "pods"), default="one",
                   help="with --replicas: one group of them (default), or, on a datacenter rig, "
                   "one agent group per pod ([groups.podK]: the pod's rail OCSes and N replicas "
                   "podK-r0 ..., each group's journal its own)")
    p.add_argument("--cabling", choices=CABLINGS,
                   help="the rack's GPUs on its switch's consecutive ports (the default) or "
                   "on alternate ones (1, 3, ..., then 2, 4, ...): on a Benes chip only the "
                   "latter leaves a fading link other waveguides to be moved to")
    p.add_argument("--ddm-noise-db", type=float, default=0.0, metavar="DB",
                   help="the standard deviation of the received powers the GPUs' transceivers "
                   "report (their DDM), dB (default 0: exact)")
    p.add_argument("--write-rig", metavar="FILE",
                   help="also write a rig file (TOML) pointing at the emulated instruments")
    p.add_argument("--keys", metavar="DIR",
                   help="CURVE on the bus, with the keys `ptb keys` wrote in DIR: the rack's "
                   "GPU monitor serves with server.key_secret (clients from DIR/authorized), "
                   "the emulated job asks the agent with tenant.key_secret, and the rig file "
                   "written names them, agent.key_secret as its client key")
    p.set_defaults(func=run)


def _twin_calibration(spec, path: str):
    """The calibration a twin's chip is built from, checked against the rig's chip."""
    from photonic_testbed.drivers.mesh import CalibrationError, read_calibration
    if not spec.chip_topology:
        raise CommandFailed(f"--chip-from: the rig {spec.name} has no chip")
    try:
        cal = read_calibration(path)
        cal.check_chip(spec.chip_topology)
    except CalibrationError as e:
        raise CommandFailed(f"--chip-from: {e}") from None
    return cal


def _start(spec, args) -> EmulatedRig:
    cal = _twin_calibration(spec, args.chip_from) if getattr(args, "chip_from", None) else None
    rig = EmulatedRig(spec, seed=args.seed, port_base=args.port_base,
                      switching_s=args.switching_ms / 1000,
                      ideal_chip=getattr(args, "ideal_chip", False), chip_calibration=cal)
    try:
        rig.start()
    except (OSError, zmq.ZMQError, ChipError) as e:
        hint = (f" (is a port in {args.port_base}..{args.port_base + 2} already in use?)"
                if args.port_base is not None else "")
        raise CommandFailed(f"cannot start the {spec.name} rig: {e}{hint}") from None
    return rig


def _start_job(rack, plan: str, stop: threading.Event) -> None:
    """Start the job as soon as the agent admits it (it may start after the emulator)."""
    from photonic_testbed.hil.lab.control_client import ControlError
    while not stop.is_set():
        try:
            got = rack.start_job(plan, 1_000_000)
            print(f"job {got['plan']} started on {got['rank_map']}", flush=True)
            return
        except ControlError as e:
            log.info("job not started yet: %s", e)
            stop.wait(0.5)


def _secure(bus_rig, folder: str):
    """The rig with CURVE on, with the keys in `folder` (`--keys`): the rig itself, and the
    rack's monitor's server keys and the job's client keys."""
    from photonic_testbed.hil.bus.security import KeyFileError, client_keys
    keys = pathlib.Path(folder).resolve()
    bus = dataclasses.replace(
        bus_rig.bus, curve=True, server_key=str(keys / "server.key_secret"),
        server_public_key=str(keys / "server.key"), authorized_keys=str(keys / "authorized"),
        client_key=str(keys / "agent.key_secret"))
    rig = dataclasses.replace(bus_rig, bus=bus)
    try:
        return rig, rig.server_keys(), client_keys(keys / "tenant.key_secret",
                                                   keys / "server.key")
    except KeyFileError as e:
        raise CommandFailed(f"--keys {folder}: {e}") from None


def with_replicas(rig: Rig, count: int, pods: bool) -> Rig:
    """`rig` with `count` agent replicas on free loopback ports: one group of them (r0, r1,
    ...), or with `pods` `count` in each pod's group (podK-r0, ...: [groups.podK], the switches
    named `*-podK`, rail_rack's)."""
    groups: dict[str, list[str]] = {"": list(rig.devices)}
    if pods:
        groups = {}
        for name in rig.devices:
            groups.setdefault(name.rpartition("-")[2], []).append(name)
    names = {g: [f"{g}-r{i}" if g else f"r{i}" for i in range(count)] for g in groups}
    ports = iter(free_ports(2 * count * len(groups)))
    replicas = {n: (f"tcp://127.0.0.1:{next(ports)}", f"tcp://127.0.0.1:{next(ports)}")
                for ns in names.values() for n in ns}
    return dataclasses.replace(rig, replicas=replicas, groups={
        g: AgentGroup(tuple(devices), tuple(names[g])) for g, devices in groups.items() if g})


def run(args) -> int:
    try:
        spec = rig_spec(args.rig)
    except ValueError as e:
        raise CommandFailed(str(e)) from None
    if args.cabling:
        if spec.name not in LAYOUTS or spec.servers:
            raise CommandFailed(f"--cabling: the rig {spec.name} has no rack of GPUs on one "
                                f"switch's ports (those of {', '.join(sorted(LAYOUTS))})")
        spec = dataclasses.replace(spec, cabling=args.cabling)
    if not 0 <= args.ddm_noise_db <= 3:
        raise CommandFailed(f"--ddm-noise-db must be in 0..3 dB, not {args.ddm_noise_db:g}")
    if not 0 <= args.switching_ms <= 10_000:
        raise CommandFailed(f"--switching-ms must be in 0..10000, not {args.switching_ms:g}")
    if args.port_base is not None and not 1024 <= args.port_base <= 65532:
        raise CommandFailed(f"--port-base must be in 1024..65532, not {args.port_base}")
    check_output(args.endpoints, "--endpoints")
    check_output(args.write_rig, "--write-rig")
    if not 0 <= args.replicas <= 7:
        raise CommandFailed(f"--replicas must be in 0..7, not {args.replicas}")
    if args.groups == "pods" and not (args.replicas and spec.servers and spec.pod):
        raise CommandFailed("--groups pods makes one agent group per pod of a datacenter rig "
                            "(one with pods: opus2048), each of --replicas N replicas")
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    rig = _start(spec, args)
    with contextlib.closing(rig):
        from photonic_testbed.hil import rig as rigfile
        gpus: tuple = ()
        lay = spec.rack_layout()
        if lay is not None:
            spares = set(lay.spares)
            gpus = tuple(rigfile.GpuConfig(g, atts[0].switch, atts[0].tx, g in spares,
                                           server=lay.servers.get(g, ""))
                         for g, atts in lay.gpus.items())
        bus_rig = rigfile.for_emulator(spec, rig.endpoints, gpus=gpus)
        keys = job_keys = None
        if args.keys:
            bus_rig, keys, job_keys = _secure(bus_rig, args.keys)
        if gpus:
            try:
                host = rig.start_rack(bus_rig.gpus_endpoints(), bus_rig.agent_endpoints(),
                                      keys=keys, job_keys=job_keys)
                rig.endpoints["gpus"] = bus_rig.gpus_endpoints()[1]
                host.ddm_noise_db = args.ddm_noise_db
            except RackError as e:
                log.warning("no rack of GPUs: %s", e)
                bus_rig = rigfile.for_emulator(spec, rig.endpoints)
                if args.keys:
                    bus_rig = _secure(bus_rig, args.keys)[0]
        if args.replicas:
            bus_rig = with_replicas(bus_rig, args.replicas, args.groups == "pods")
            if rig.rack is not None:        # (with a group per pod: the job runs in the first)
                rig.rack.agent_replicas = bus_rig.group_view(next(iter(bus_rig.groups))) \
                    .agent_replicas() if bus_rig.groups else bus_rig.agent_replicas()
        if rig.chip_calibration is not None and bus_rig.chip is not None:
            bus_rig = dataclasses.replace(bus_rig, chip=dataclasses.replace(
                bus_rig.chip, calibration=os.path.abspath(args.chip_from)))
        if args.endpoints:
            rig.write_endpoints(args.endpoints)
        if args.write_rig:
            rigfile.write(args.write_rig, bus_rig)
        print(f"rig {spec.name} (seed {args.seed}): {spec.description}")
        if rig.chip is not None and rig.chip_calibration is not None:
            print(f"  chip: the twin of {args.chip_from} ({len(rig.chip.channels)} heaters)")
        for name, where in rig.endpoints.items():
            if name == "dac" and rig.dac is not None:
                # the pty itself, and the stable link (like /dev/serial/by-id) that the
                # endpoints file holds: it survives an unplug/replug, the pty name does not
                print(f"  dac: {rig.dac.pty} (link: {where})")
            else:
                print(f"  {name:<11} {where}")
        heap.settle("start-up")
        print("running; Ctrl-C to stop", flush=True)
        if args.job and rig.rack is not None:
            threading.Thread(target=_start_job, args=(rig.rack, args.job, stop),
                             name="job-start", daemon=True).start()
        while not stop.wait(0.2):
            pass
    print("stopped; every port and pty freed")
    return 0
