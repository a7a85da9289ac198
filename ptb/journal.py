"""`ptb journal`: print the agent's journal (optionally following it as it grows): a readable
line per entry, or with `--json` each entry as one JSON object, its details as stored."""
from __future__ import annotations

import argparse
import json
import time

from photonic_testbed.hil.agent.journal import KINDS, MAX_SEQ, JournalError
from photonic_testbed.hil.agent.sqlite_journal import SqliteJournal, StoredEntry
from photonic_testbed.ptb.cli import CommandFailed


def add_parser(sub) -> None:
    p = sub.add_parser("journal", help="print the agent's journal",
                       description="Print the agent's journal: decisions, applied "
                       "configurations, verifications and alarms, with causes and latencies.")
    p.add_argument("path", help="journal database (the agent's --journal file)")
    p.add_argument("--kind", action="append", choices=KINDS, help="only these kinds (repeatable)")
    p.add_argument("--since", type=_seq, default=0, metavar="SEQ",
                   help="only entries after this sequence number")
    p.add_argument("--follow", action="store_true", help="keep printing new entries (Ctrl-C)")
    p.add_argument("--json", action="store_true",
                   help="each entry as one JSON object (seq, ts, kind, cause, latency_s, "
                   "details as stored), not a readable line")
    p.set_defaults(func=run)


def _seq(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a sequence number: {text!r}") from None
    if not 0 <= value <= MAX_SEQ:
        raise argparse.ArgumentTypeError(f"a sequence number is 0..{MAX_SEQ}, not {text}")
    return value


def _json(entry: StoredEntry) -> str:
    return json.dumps({"seq": entry.seq, "ts": entry.ts, "kind": entry.kind,
                       "cause": entry.cause, "latency_s": entry.latency_s,
                       "details": entry.details})


def run(args) -> int:
    try:
        journal = SqliteJournal(args.path, read_only=True)
    except JournalError as e:
        raise CommandFailed(str(e)) from None
    kinds = tuple(args.kind) if args.kind else None
    last = args.since
    try:
        with journal:
            while True:
                if args.json:
                    for stored in journal.stored_entries(since=last, kinds=kinds):
                        print(_json(stored), flush=True)
                        last = stored.seq
                else:
                    for entry in journal.entries(since=last, kinds=kinds):
                        print(entry.line(), flush=True)
                        last = entry.seq
                if not args.follow:
                    return 0
                time.sleep(0.2)
    except JournalError as e:          # damaged while being read
        raise CommandFailed(str(e)) from None
