"""`ptb agent`: the host agent on the bus (spare swap, phase rails, journal)."""
from __future__ import annotations

import signal
import threading

from photonic_testbed.hil.agent.agent import AgentError
from photonic_testbed.hil.agent.bus import AgentProcess
from photonic_testbed.hil.bus.security import KeyFileError
from photonic_testbed.hil.agent.journal import JournalError
from photonic_testbed.hil.files import WAIT_S
from photonic_testbed.hil.rig import RigFileError, load
from photonic_testbed.ptb.cli import CommandFailed, check_output


def add_parser(sub) -> None:
    p = sub.add_parser("agent", help="run the host agent of a rig on the bus",
                       description="Watch the rack's GPU health and the job, swap in spares "
                       "and switch the phase rails through the rig's switch services; publish "
                       "the agent's state as device `agent` (docs/agent.md).")
    p.add_argument("--rig", required=True, metavar="FILE", help="the rig file (TOML)")
    p.add_argument("--journal", required=True, metavar="PATH",
                   help="the journal (SQLite); an existing one is resumed")
    p.add_argument("--quarantine", type=float, default=60.0, metavar="S",
                   help="seconds a failed GPU stays out of the spares (default 60)")
    p.add_argument("--journal-sync", choices=("full", "normal"), default="full",
                   help="full: every journal entry synced to disk (default); normal: survives "
                   "a kill -9 of the agent but not a power loss, one fsync less per event")
    p.set_defaults(func=run)


def run(args) -> int:
    check_output(args.journal, "--journal")
    try:
        rig = load(args.rig, wait_s=WAIT_S)
    except RigFileError as e:
        raise CommandFailed(str(e)) from None
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        proc = AgentProcess(rig, args.journal, quarantine_s=args.quarantine,
                            journal_sync=args.journal_sync.upper(), settle_heap=True)
    except JournalError as e:
        raise CommandFailed(str(e)) from None
    try:
        try:
            request, publish = proc.start()
        except (AgentError, RigFileError, KeyFileError, JournalError, OSError) as e:
            raise CommandFailed(str(e)) from None
        print(f"agent of rig {rig.name}: requests {request}  publishes {publish}")
        print("running; Ctrl-C to stop", flush=True)
        proc.run(stop)
    finally:
        proc.close()
    print("stopped", flush=True)
    return 0
