"""`ptb`: one command, a subcommand per job. Each subcommand lives in its own module with
`add_parser(subparsers)` that registers it and sets `func(args) -> exit code`.

The parser is built lazily: `ptb --help` lists the subcommands from `COMMANDS` alone, and only
the module of the subcommand given is imported (the emulator, scipy and Qt take about a second
to import; `ptb --help` or `ptb keys` should not wait for them). tests/test_cli.py checks that
`COMMANDS` says what each module registers."""
from __future__ import annotations

import argparse
import importlib
import logging
import sys

from photonic_testbed import __version__

# Subcommand name -> the one-line help `ptb --help` shows; ptb/NAME.py registers the rest.
COMMANDS = {
    "emulate": "run an emulated rig (pty and loopback sockets)",
    "demo": "run the stack's main job on the built-in emulator",
    "bench": "measure speed (table on stdout, JSON file)",
    "journal": "print the agent's journal",
    "serve": "run the device services of a rig on the bus",
    "keys": "make CurveZMQ key pairs for the bus",
    "agent": "run the host agent of a rig on the bus",
    "gui": "open the operator's desktop GUI",
    "calibrate": "calibrate a chip (heater offsets, efficiencies, crosstalk)",
    "gpus": "run this host's GPU health monitor (NVML + DDM) on the bus",
    "discover": "find a bench's devices and write a rig file skeleton",
    "record": "record a session between clients and devices (pty and TCP relays)",
    "replay": "replay a recorded session against devices, or as the devices",
    "status": "ask every process of a rig's bus (or every instrument) whether it answers",
    "etcd": "run a local etcd cluster for a replicated agent group",
    "leco": "the rig's instruments as LECO actors (PyMoDAQ, pyleco)",
}


class CommandFailed(Exception):
    """A subcommand's clear, expected failure: printed without a traceback, exit code 1."""


def check_output(path, option: str, suffixes: tuple[str, ...] = (),
                 folder: bool = False) -> None:
    """Refuse, before any work, a file (or with `folder`, a folder) a command would write where
    it cannot be written: no such folder, a folder or a file in the way, a folder that refuses
    a new file (read-only, full, not ours: tried, not guessed), a file that cannot be replaced,
    or a name whose suffix is not one of `suffixes` (where the format follows the name)."""
    if path is None:
        return
    import os
    import pathlib
    import tempfile
    p = pathlib.Path(path)
    if folder:            # made with its parents if need be: the nearest one there is tried
        place = next(q for q in (p, *p.absolute().parents) if q.exists())
        if not place.is_dir():
            raise CommandFailed(f"{option} {p}: a file is there ({place}), not a folder")
    else:
        if p.is_dir():
            raise CommandFailed(f"{option} {p}: a folder is there, not a file")
        if suffixes and p.suffix.lower() not in suffixes:
            raise CommandFailed(f"{option} {p}: the file's name must end in "
                                f"{' or '.join(suffixes)} (its format follows the name)")
        place = p.parent
    if not place.is_dir():
        raise CommandFailed(f"{option} {p}: no folder {place}")
    try:
        fd, probe = tempfile.mkstemp(dir=place, prefix=".ptb-write-check-")
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise CommandFailed(f"{option} {p}: cannot write in {place}: "
                            f"{e.strerror or e}") from None
    if not folder and p.exists() and not os.access(p, os.W_OK):
        raise CommandFailed(f"{option} {p}: the file there cannot be replaced (read-only)")


def chosen_command(argv: list[str]) -> str | None:
    """The subcommand named in `argv`: the first word that is not an option of `ptb` itself
    (they take no values), when it is one of ours."""
    for word in argv:
        if word == "--":
            return None
        if not word.startswith("-"):
            return word if word in COMMANDS else None
    return None


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    """The parser for `argv`: the chosen subcommand in full, the others as their name and help
    (enough to list them, or to refuse an unknown one). `argv=None` reads sys.argv."""
    chosen = chosen_command(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(
        prog="ptb", description="Photonic testbed: firmware, drivers, emulator and tools.")
    parser.add_argument("-v", "--verbose", action="count", default=0,
                        help="more log output (-vv for debug)")
    parser.add_argument("--version", action="version", version=f"ptb {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, help_line in COMMANDS.items():
        if name == chosen:
            importlib.import_module(f"{__package__}.{name}").add_parser(sub)
        else:
            sub.add_parser(name, help=help_line)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser(argv)
    args, extra = parser.parse_known_args(argv)
    # A command's DEVICE=ADDRESS list may be split by options (`ptb record dac=... --out f
    # ocs=...`): argparse takes the first run only and calls the rest unrecognised.
    if extra and isinstance(getattr(args, "devices", None), list) and \
            not any(a.startswith("-") for a in extra):
        args.devices += extra
    elif extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    level = (logging.WARNING, logging.INFO, logging.DEBUG)[min(args.verbose, 2)]
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args) or 0
    except CommandFailed as e:
        print(f"ptb {args.command}: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"ptb {args.command}: interrupted", file=sys.stderr)
        return 130
