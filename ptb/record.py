"""`ptb record`: sit between clients and devices, pass every byte through, write the session."""
from __future__ import annotations

import dataclasses
import json
import logging
import signal
import subprocess
import threading

from photonic_testbed.hil.files import WAIT_S, write_atomic
from photonic_testbed.ptb.cli import CommandFailed, check_output

log = logging.getLogger(__name__)

READY_LINE = "running; Ctrl-C to stop"


def add_parser(sub) -> None:
    p = sub.add_parser(
        "record", help="record a session between clients and devices (pty and TCP relays)",
        description="Relay clients to devices and write every byte that passes, timed, to a "
        "session file (docs/lab.md). A serial device gets a pseudo-terminal for its client; a "
        "socket device a loopback port. Runs until SIGINT or SIGTERM.")
    p.add_argument("devices", nargs="*", metavar="DEVICE=ADDRESS",
                   help="a device to relay: a serial port (dac=/dev/ttyACM0) or a raw socket "
                   "(ocs=TCPIP::10.0.0.9::5025::SOCKET or ocs=10.0.0.9:5025)")
    p.add_argument("--endpoints", metavar="FILE",
                   help="relay the instruments of an emulator's endpoints file "
                   "(ptb emulate --endpoints): dac, ocs, powermeter, laser")
    p.add_argument("--rig", metavar="FILE",
                   help="relay every device of a rig file on a serial port or a raw socket")
    p.add_argument("--out", required=True, metavar="SESSION",
                   help="the session file to write (JSON lines)")
    p.add_argument("--write-endpoints", metavar="FILE",
                   help="write the endpoints file clients use: the relays in place of the "
                   "devices (other keys of --endpoints kept)")
    p.add_argument("--write-rig", metavar="FILE",
                   help="write the --rig file with the relays as the devices' addresses")
    p.add_argument("--listen", default="127.0.0.1", metavar="HOST",
                   help="where the socket relays listen (default 127.0.0.1)")
    p.add_argument("--run", metavar="COMMAND",
                   help="run this shell command (the client) once the relays are up, and "
                   "stop recording when it ends; exit with its exit code")
    p.add_argument("--link-dir", metavar="DIR",
                   help="where the serial relays' pty links are made (default: a temporary "
                   "folder, removed on exit)")
    p.set_defaults(func=run)


def run(args) -> int:
    from photonic_testbed.hil.lab.recorder import Recorder, RecorderError
    from photonic_testbed.hil.lab.session import SessionError, device_wires, read_endpoints
    for path, option in ((args.out, "--out"), (args.write_endpoints, "--write-endpoints"),
                         (args.write_rig, "--write-rig")):
        check_output(path, option)
    check_output(args.link_dir, "--link-dir", folder=True)
    if args.write_rig and not args.rig:
        raise CommandFailed("--write-rig rewrites the --rig file: give --rig too")
    try:
        wires, notes = device_wires(args.endpoints, args.rig, args.devices, WAIT_S)
    except SessionError as e:
        raise CommandFailed(str(e)) from None
    for note in notes:
        print(f"not relayed: {note}")
    if not wires:
        raise CommandFailed("nothing to record: name devices (DEVICE=ADDRESS), --endpoints or "
                            "--rig")
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):   # HUP: its terminal closed
        signal.signal(sig, lambda *_: stop.set())
    recorder = Recorder(args.out, wires, listen=args.listen, link_dir=args.link_dir)
    try:
        addresses = recorder.start()
    except (RecorderError, OSError) as e:
        raise CommandFailed(str(e)) from None
    writer = recorder.writer
    assert writer is not None

    def stop_on_failure() -> None:          # a write error stops the recording
        if writer.failed.wait():
            stop.set()
    threading.Thread(target=stop_on_failure, daemon=True, name="session-failed").start()
    try:
        if args.write_endpoints:
            out = read_endpoints(args.endpoints) if args.endpoints else {}
            out.update(addresses)
            write_atomic(args.write_endpoints, json.dumps(out, indent=2) + "\n")
        if args.write_rig:
            from photonic_testbed.hil.rig import load, write
            rig = load(args.rig)
            devices = {name: dataclasses.replace(d, address=addresses.get(name, d.address))
                       for name, d in rig.devices.items()}
            write(args.write_rig, dataclasses.replace(rig, devices=devices))
        print(f"recording to {args.out}")
        for name, address in addresses.items():
            print(f"  {name:<11} {address}  (relays {wires[name].address})")
        if args.run:
            code = _run_client(args.run, stop)
        else:
            print(READY_LINE, flush=True)
            while not stop.wait(0.2):
                pass
            code = 0
    finally:
        try:
            recorder.close()
        except SessionError as e:
            raise CommandFailed(f"{e}; recording stopped") from None
    counts = writer.counts
    print(f"stopped: {counts['client']} bytes from clients, {counts['device']} from devices, "
          f"written to {args.out}", flush=True)
    return code


def _run_client(command: str, stop: threading.Event) -> int:
    """Run the client's command to its end (Ctrl-C passes it on); its exit code."""
    print(f"running the client: {command}", flush=True)
    proc = subprocess.Popen(["bash", "-c", command])
    while proc.poll() is None:
        if stop.wait(0.1):
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    if proc.returncode:
        print(f"the client exited {proc.returncode}", flush=True)
    return proc.returncode

