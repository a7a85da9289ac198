"""`ptb replay SESSION`: play a recorded session's client side against devices and report every
answer that differs; or (`--as-device`) play its devices for a client under test.

Exit codes: 0 every exchange as recorded, 3 a difference (the report names the first), 1 the
session or a device could not be used. From a test, `replay_on_emulator(...)` replays a session
against a fresh emulated rig, and `session_fixture(...)` makes that a pytest fixture:

    from photonic_testbed.ptb.replay import session_fixture
    qontrol_session = session_fixture("sessions/qontrol.jsonl", rig="lumion", seed=3)

    def test_the_board_answers_as_recorded(qontrol_session):
        assert qontrol_session.ok, qontrol_session.describe()
"""
from __future__ import annotations

import json
import logging
import os
import signal
import threading
import time
from collections.abc import Callable

from photonic_testbed.hil.files import WAIT_S, write_atomic
from photonic_testbed.ptb.cli import CommandFailed, check_output

log = logging.getLogger(__name__)

DIFFERENT = 3                 # exit code: the replay found a difference


UNTIL_DONE_GRACE_S = 5.0      # --until-done: how long the clients have to read the last answers

def add_parser(sub) -> None:
    p = sub.add_parser(
        "replay", help="replay a recorded session against devices, or as the devices",
        description="Play a session's client side against devices (the emulator, another "
        "board) and report every answer that differs from the recording, the first named "
        "clearly (exit 3); or, with --as-device, answer a client under test as the recorded "
        "devices did and report where the client differs.")
    p.add_argument("session", metavar="SESSION", help="a session file (ptb record)")
    p.add_argument("devices", nargs="*", metavar="DEVICE=ADDRESS",
                   help="where a device of the session is now (default: its recorded "
                   "address, or --endpoints / --rig)")
    p.add_argument("--endpoints", metavar="FILE",
                   help="the devices of an emulator's endpoints file (ptb emulate --endpoints)")
    p.add_argument("--rig", metavar="FILE", help="the devices of a rig file, by name")
    p.add_argument("--timeout-s", type=float, default=2.0, metavar="S",
                   help="how long an answer may take (default 2; or 3x its recorded time)")
    p.add_argument("--ignore", action="append", default=[], metavar="REGEX",
                   help="leave out answer lines matching this (repeatable), e.g. '^E90:00$'")
    p.add_argument("--rel-tol", type=float, default=0.0, metavar="X",
                   help="numbers in answers within this relative tolerance are equal "
                   "(default 0: byte for byte)")
    p.add_argument("--pace", action="store_true",
                   help="keep the client's recorded gaps (default: as fast as answered)")
    p.add_argument("--report", metavar="FILE", help="also write the report as JSON")
    p.add_argument("--as-device", action="store_true",
                   help="play the devices instead: answer a client as recorded")
    p.add_argument("--write-endpoints", metavar="FILE",
                   help="with --as-device: write where each scripted device listens")
    p.add_argument("--until-done", action="store_true",
                   help="with --as-device: stop once every recorded exchange was played")
    p.add_argument("--link-dir", metavar="DIR",
                   help="with --as-device: where the serial devices' pty links are made")
    p.set_defaults(func=run)


def run(args) -> int:
    from photonic_testbed.hil.lab.replayer import ReplayError, replay
    from photonic_testbed.hil.lab.session import Comparison, Session, SessionError, device_wires
    for path, option in ((args.report, "--report"), (args.write_endpoints, "--write-endpoints")):
        check_output(path, option)
    check_output(args.link_dir, "--link-dir", folder=True)
    if not 0 < args.timeout_s <= 3600:
        raise CommandFailed(f"--timeout-s must be in (0, 3600], not {args.timeout_s:g}")
    try:
        session = Session.load(args.session)
        comparison = Comparison(tuple(args.ignore), args.rel_tol)
    except SessionError as e:
        raise CommandFailed(str(e)) from None
    if not session.complete:
        print(f"note: {args.session} has no end line (the recorder did not stop cleanly); "
              "replaying what it holds"
              + (f" (line {session.cut_line}, cut short, left out)" if session.cut_line else ""))
    if not session.exchanges():
        raise CommandFailed(f"{args.session} holds no exchange: nothing to replay")
    if args.as_device:
        return _as_device(session, args)
    try:
        given, _ = device_wires(args.endpoints, args.rig, args.devices, WAIT_S)
        wires = {}
        for name in session.used:
            # a rig file names the heater DAC "chip" or "heaters", an endpoints file "dac"
            names = [name, _RIG_NAMES.get(name, name)] + [k for k, v in _RIG_NAMES.items()
                                                          if v == name]
            found = next((given[n] for n in names if n in given), None)
            if found is None and given:
                raise CommandFailed(f"the session's device {name!r} is not among the devices "
                                    f"given ({', '.join(sorted(given))}): name it "
                                    f"{name}=ADDRESS")
            wires[name] = found or session.wire(name)
            print(f"  {name:<11} replayed against {wires[name].address}"
                  + ("" if found else " (the address it was recorded at)"), flush=True)
    except SessionError as e:
        raise CommandFailed(str(e)) from None
    try:
        report = replay(session, wires, comparison=comparison, timeout_s=args.timeout_s,
                        pace=args.pace)
    except ReplayError as e:
        raise CommandFailed(str(e)) from None
    return _finish(report, args)


def _finish(report, args) -> int:
    print(report.describe(), flush=True)
    if args.report:
        write_atomic(args.report, json.dumps(report.to_dict(), indent=2))
    return 0 if report.ok else DIFFERENT


def _as_device(session, args) -> int:
    from photonic_testbed.hil.lab.replayer import ReplayError, ScriptedDevices
    from photonic_testbed.hil.lab.session import SessionError
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):   # HUP: its terminal closed
        signal.signal(sig, lambda *_: stop.set())
    devices = ScriptedDevices(session, link_dir=args.link_dir)
    try:
        addresses = devices.start()
    except (ReplayError, SessionError, OSError) as e:
        devices.close()
        raise CommandFailed(str(e)) from None
    try:
        if args.write_endpoints:
            write_atomic(args.write_endpoints, json.dumps(addresses, indent=2))
        print(f"playing the devices of {args.session}")
        for name, address in addresses.items():
            print(f"  {name:<11} {address}")
        print("running; Ctrl-C to stop", flush=True)
        while not stop.wait(0.1):
            if args.until_done and devices.finished():
                # the last answers reach their clients before the devices go away
                if not devices.taken(UNTIL_DONE_GRACE_S):
                    print("note: a serial client had not read its last answer "
                          f"{UNTIL_DONE_GRACE_S:g} s after it was played", flush=True)
                stop.wait(0.2)
                break
    finally:
        report = devices.close()
    return _finish(report, args)


# ---- from tests ----------------------------------------------------------------------------------

# Device names of a rig file (ptb emulate --write-rig) -> the emulator's endpoint keys.
_RIG_NAMES = {"chip": "dac", "heaters": "dac"}


def replay_on_emulator(session_path: str | os.PathLike, *, rig: str = "lumion", seed: int = 0,
                       control: list[dict] | tuple[dict, ...] = (),
                       prepare: Callable[[dict], None] | None = None, timeout_s: float = 2.0,
                       ignore: tuple[str, ...] = (), rel_tol: float = 0.0):
    """Replay a session against a freshly started emulated rig (`rig`, `seed`), after
    `prepare(endpoints)` (what the recording's bench had that the session does not say, e.g.
    the laser on) and the `control` requests (faults, docs/control.md) to its control
    endpoint. The session's devices are found by endpoint key (dac, ocs, ...) or by the device
    names an emulated rig file gives them (chip, heaters, powermeter, ...). Returns the
    ReplayReport."""
    from photonic_testbed.emulator.rig import EmulatedRig
    from photonic_testbed.hil.lab.control_client import request
    from photonic_testbed.hil.lab.replayer import replay
    from photonic_testbed.hil.lab.session import Comparison, Session, parse_address
    from photonic_testbed.hil.rig import rig_spec
    session = Session.load(session_path)
    with EmulatedRig(rig_spec(rig), seed=seed) as emulated:
        if emulated.dac is not None:
            _wait_for_power_up(emulated.dac)
        endpoints = emulated.endpoints
        wires = {}
        for name in session.used:
            key = name if name in endpoints else _RIG_NAMES.get(name, name)
            if key not in endpoints:
                raise ValueError(f"the session's device {name!r} is not on the emulated rig "
                                 f"{rig} (it has {', '.join(endpoints)})")
            wires[name] = parse_address(endpoints[key], 5025)
        if prepare is not None:
            prepare(dict(endpoints))
        for req in control:
            request(endpoints["control"], req)
        return replay(session, wires, comparison=Comparison(tuple(ignore), rel_tol),
                      timeout_s=timeout_s)


def _wait_for_power_up(dac, timeout_s: float = 10.0) -> None:
    """A fresh board's power-up notice goes out before anyone listens (as a real board's does
    when it is plugged in): wait until it has, so that every open of the port finds the same."""
    deadline = time.monotonic() + timeout_s
    while dac.bytes_out == 0 and time.monotonic() < deadline:
        time.sleep(0.01)


def session_fixture(session_path: str | os.PathLike, **kwargs):
    """A pytest fixture that replays the session on a fresh emulated rig (replay_on_emulator's
    keyword arguments) and gives its ReplayReport."""
    import pytest

    @pytest.fixture
    def replayed():
        return replay_on_emulator(session_path, **kwargs)
    return replayed
