"""`ptb`: one command, a subcommand per job. Each subcommand lives in its own module with
`add_parser(subparsers)` that registers it and sets `func(args) -> exit code`."""
from __future__ import annotations

import argparse
import importlib
import logging
import sys

SUBCOMMANDS = ("emulate", "demo", "bench", "journal", "serve", "keys", "agent", "gui",
               "calibrate", "gpus")


class CommandFailed(Exception):
    """A subcommand's clear, expected failure: printed without a traceback, exit code 1."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ptb", description="Photonic testbed: firmware, drivers, emulator and tools.")
    parser.add_argument("-v", "--verbose", action="count", default=0,
                        help="more log output (-vv for debug)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name in SUBCOMMANDS:
        importlib.import_module(f"{__package__}.{name}").add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
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
