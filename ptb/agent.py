"""`ptb agent`: the host agent on the bus (spare swap, phase rails, journal)."""
from __future__ import annotations

import argparse
import dataclasses
import signal
import threading
from collections.abc import Callable
from typing import Any

from photonic_testbed.hil.agent.agent import AgentError
from photonic_testbed.hil.agent.bus import AgentProcess
from photonic_testbed.hil.agent.config import ALLOCATIONS, SETTINGS, AgentConfig, expected
from photonic_testbed.hil.agent.journal import JournalError
from photonic_testbed.hil.agent.leadership import NotLeading
from photonic_testbed.hil.bus.security import KeyFileError
from photonic_testbed.hil.files import WAIT_S
from photonic_testbed.hil.rig import Rig, RigFileError, load
from photonic_testbed.ptb.cli import CommandFailed, check_output


def add_parser(sub) -> None:
    p = sub.add_parser("agent", help="run the host agent of a rig on the bus",
                       description="Watch the rack's GPU health and the job, swap in spares "
                       "and switch the phase rails through the rig's switch services; publish "
                       "the agent's state as device `agent` (docs/agent.md).")
    p.add_argument("--rig", required=True, metavar="FILE", help="the rig file (TOML)")
    p.add_argument("--journal", required=True, metavar="PATH|URL",
                   help="the journal: a SQLite file (an existing one is resumed), or "
                   "etcd://HOST:PORT[,HOST:PORT...]/GROUP, the journal of an agent group on an "
                   "etcd cluster whose replicas elect one leader (docs/control-plane.md)")
    p.add_argument("--replica", metavar="NAME", default=None,
                   help="with an etcd journal: which of the rig's [replicas.NAME] this process "
                   "is (default: the first)")
    settings = p.add_argument_group(
        "the agent's settings", "each overrides the rig file's [agent] table "
        "(docs/rigfile.md); the defaults are those of a rig file without it")
    for name, f in SETTINGS.items():
        help = f"{f.metadata['what']} (default {_text(f.default)})"
        if isinstance(f.default, bool):
            settings.add_argument(f.metadata["flag"], dest=name, default=None, help=help,
                                  action=argparse.BooleanOptionalAction)
        elif name == "allocation":
            settings.add_argument(f.metadata["flag"], dest=name, default=None, help=help,
                                  choices=ALLOCATIONS)
        else:
            settings.add_argument(f.metadata["flag"], dest=name, default=None, help=help,
                                  type=_setting(name, type(f.default)),
                                  metavar="S" if name.endswith("_s") else
                                  "DBM" if name.endswith("_dbm") else
                                  "HOST" if name.endswith("_host") else "N")
    p.add_argument("--journal-sync", choices=("full", "normal"), default="full",
                   help="full: every journal entry synced to disk (default); normal: survives "
                   "a kill -9 of the agent but not a power loss, one fsync less per event")
    p.set_defaults(func=run)


def _text(value: Any) -> str:
    return str(value).lower() if isinstance(value, bool) else f"{value:g}" \
        if isinstance(value, float) else str(value)


def _setting(name: str, kind: type) -> Callable[[str], Any]:
    """The argparse type of a numeric setting: read as `kind`, then checked as the setting
    says (one line naming what it expects, never a traceback)."""
    def read(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            value = None
        why = SETTINGS[name].metadata["expected"] if value is None else expected(name, value)
        if why is not None:
            raise argparse.ArgumentTypeError(f"expected {why}, got {text!r}")
        return value
    return read


def config_of(rig: Rig, args: argparse.Namespace) -> AgentConfig:
    """The rig file's [agent] settings, with those given as flags in their place."""
    given = {name: getattr(args, name) for name in SETTINGS if getattr(args, name) is not None}
    return dataclasses.replace(rig.agent, **given)


def _metrics(config: AgentConfig) -> Any:
    """The agent's Prometheus metrics served where the settings say (None: not asked)."""
    if not config.metrics_port:
        return None
    try:
        from photonic_testbed.hil.agent.metrics import AgentMetrics
    except ImportError as e:
        raise CommandFailed(f"--metrics-port needs prometheus-client (pip install "
                            f"'photonic-testbed[metrics]'): {e}") from None
    metrics = AgentMetrics()
    try:
        host, port = metrics.serve(config.metrics_host, config.metrics_port)
    except OSError as e:
        raise CommandFailed(f"cannot serve the metrics on {config.metrics_host}:"
                            f"{config.metrics_port}: {e.strerror or e}") from None
    print(f"metrics on http://{host}:{port}/metrics", flush=True)
    return metrics


def run(args) -> int:
    replicated = args.journal.startswith("etcd://")
    if not replicated:
        if args.replica is not None:
            raise CommandFailed("--replica names a replica of an agent group, whose journal "
                                "is on etcd: give --journal etcd://HOST:PORT[,...]/GROUP")
        check_output(args.journal, "--journal")
    try:
        rig = load(args.rig, wait_s=WAIT_S)
    except RigFileError as e:
        raise CommandFailed(str(e)) from None
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    config = config_of(rig, args)
    metrics = _metrics(config)
    while not stop.is_set():
        try:
            proc = AgentProcess(rig, args.journal, config=config,
                                journal_sync=args.journal_sync.upper(), settle_heap=True,
                                replica=args.replica)
        except (AgentError, JournalError, RigFileError) as e:
            raise CommandFailed(str(e)) from None
        if metrics is not None:
            metrics.attach(proc)
        lead = proc.leadership
        try:
            try:
                if lead is not None:
                    print(f"agent replica {lead.me['name']} of group {lead.group}: standing "
                          f"by on {proc.endpoints[0]}", flush=True)
                if not proc.campaign(stop):
                    break
                request, publish = proc.start()
            except (NotLeading, JournalError) as e:
                if lead is None:
                    raise CommandFailed(str(e)) from None
                print(f"{e}; standing by again", flush=True)
                continue
            except (AgentError, RigFileError, KeyFileError, OSError) as e:
                raise CommandFailed(str(e)) from None
            leading = f", leading group {lead.group} in term {proc.term}" if lead else ""
            print(f"agent of rig {rig.name}: requests {request}  publishes {publish}{leading}")
            print("running; Ctrl-C to stop", flush=True)
            proc.run(stop)
            if lead is None or stop.is_set():
                break
            print(f"lost the lead of group {lead.group} "
                  f"({lead.lost_because or 'its lease lapsed'}): nothing more is moved by "
                  "this replica; standing by again", flush=True)
        finally:
            proc.close()
    print("stopped", flush=True)
    return 0
