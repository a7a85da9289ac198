"""The agent's journal: every decision and every applied configuration, durably, in SQLite.

One row per event, in WAL mode with full sync, so a `kill -9` of the agent loses nothing that
was reported as written. The journal also holds the *intended* circuits of every switch: after
a restart the agent reads them back and repairs only what differs on the hardware.

Write-ahead without a disk sync per row: an entry may be recorded `defer=True` (a detection, a
decision, an applied change, a verification): it is written at once but made durable together
with the next entry that must be, in one transaction, one sync: the intended circuits before a
switch moves (`set_intended`), the restart order before the job hears it, an alarm, or any
read of the journal (`entries`, `intended`, `flush`, `close`). Nothing acts on a deferred entry
before that commit, so a `kill -9` in between loses only entries whose effect never left the
process.
"""
from __future__ import annotations

import json
import os
import sqlite3
import threading
import time
from dataclasses import dataclass, field
from collections.abc import Iterable, Mapping
from typing import Any, Iterator

import orjson

SCHEMA_VERSION = 1

_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS events (
    seq        INTEGER PRIMARY KEY AUTOINCREMENT,
    ts         REAL    NOT NULL,
    kind       TEXT    NOT NULL,
    cause      TEXT    NOT NULL DEFAULT '',
    latency_s  REAL,
    details    TEXT    NOT NULL DEFAULT '{}'
);
CREATE INDEX IF NOT EXISTS events_kind ON events(kind);
CREATE TABLE IF NOT EXISTS intended (
    switch     TEXT PRIMARY KEY,
    circuits   TEXT NOT NULL,
    seq        INTEGER NOT NULL
);
"""

# What the agent writes; the GUI filters on these.
KINDS = ("start", "failure", "detected", "decision", "applied", "verified", "verify_failed",
         "rank_map", "restart", "phase", "alarm", "reconcile", "note", "diagnosis")


class JournalError(Exception):
    """The journal file cannot be used (wrong schema version, not a journal, unwritable)."""


@dataclass(frozen=True)
class Entry:
    seq: int
    ts: float
    kind: str
    cause: str
    latency_s: float | None
    details: dict[str, Any] = field(default_factory=dict)

    def line(self) -> str:
        stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.ts))
        ms = f"{self.ts % 1:.3f}"[1:]
        latency = f" [{self.latency_s * 1e3:.1f} ms]" if self.latency_s is not None else ""
        details = (" " + json.dumps(self.details, sort_keys=True)) if self.details else ""
        cause = f" ({self.cause})" if self.cause else ""
        return f"{self.seq:6d} {stamp}{ms} {self.kind:<13}{cause}{latency}{details}"


class Journal:
    """Append-only event log plus the intended circuits per switch. Thread-safe."""

    def __init__(self, path: str | os.PathLike, synchronous: str = "FULL"):
        """`synchronous` FULL (default) syncs every commit to the disk; NORMAL (WAL) still
        survives a kill -9 of the process (the commit is in the OS's hands) but may lose the
        last commits on a power loss or OS crash, for a fsync less per event."""
        if synchronous not in ("FULL", "NORMAL"):
            raise JournalError(f"synchronous is FULL or NORMAL, not {synchronous!r}")
        self.path = os.fspath(path)
        self._lock = threading.RLock()
        try:
            self._db = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False,
                                       timeout=5.0)
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute(f"PRAGMA synchronous={synchronous}")
            self._db.executescript(_SCHEMA)
            row = self._db.execute("SELECT value FROM meta WHERE key='schema'").fetchone()
            if row is None:
                self._db.execute("INSERT INTO meta VALUES ('schema', ?)", (str(SCHEMA_VERSION),))
            elif row[0] != str(SCHEMA_VERSION):
                raise JournalError(f"{self.path} has journal schema {row[0]}, this program "
                                   f"reads schema {SCHEMA_VERSION}")
        except sqlite3.DatabaseError as e:
            raise JournalError(f"{self.path} is not a usable journal: {e}") from e

    def close(self) -> None:
        with self._lock:
            if self._db.in_transaction:
                self._db.execute("COMMIT")
            self._db.close()

    def __enter__(self) -> "Journal":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def flush(self) -> None:
        """Make the deferred entries durable (one transaction, one sync)."""
        with self._lock:
            if self._db.in_transaction:
                self._db.execute("COMMIT")

    def _begin(self) -> None:
        if not self._db.in_transaction:
            self._db.execute("BEGIN IMMEDIATE")

    def record(self, kind: str, cause: str = "", latency_s: float | None = None,
               ts: float | None = None, *, defer: bool = False, **details: Any) -> int:
        """Append one event; returns its sequence number once it is on disk (with `defer`,
        once it is written: on disk with the next entry that is not deferred)."""
        if kind not in KINDS:
            raise ValueError(f"unknown journal kind {kind!r}; one of {', '.join(KINDS)}")
        text = orjson.dumps(details, default=str, option=orjson.OPT_NON_STR_KEYS).decode()
        with self._lock:
            self._begin()
            try:
                cur = self._db.execute(
                    "INSERT INTO events (ts, kind, cause, latency_s, details) VALUES (?,?,?,?,?)",
                    (time.time() if ts is None else ts, kind, cause, latency_s, text))
            finally:
                if not defer:
                    self._db.execute("COMMIT")
            return cur.lastrowid

    def set_intended(self, switch: str, circuits: list[tuple[int, int]], cause: str, *,
                     event: bool = True) -> int:
        """Record what a switch should hold, with a `decision` event that explains it (unless
        `event` is false: the caller journals the change in its own entry, as a phase switch
        does), atomically and durably (with the deferred entries before it). Returns the
        event's sequence number (the last one written without an event)."""
        return self.set_intended_many({switch: circuits}, cause, event=event)

    def set_intended_many(self, switches: Mapping[str, Iterable[tuple[int, int]]], cause: str,
                          *, event: bool = True) -> int:
        """`set_intended` for several switches in one transaction and one sync (a phase switch
        that moves every rail's OCS)."""
        rows = {name: sorted(circuits) for name, circuits in switches.items()}
        with self._lock:
            self._begin()
            self._db.execute("SAVEPOINT intended")
            try:
                seq = None
                for name, pairs in rows.items():
                    text = orjson.dumps(pairs).decode()     # [[input, output], ...]
                    if event:
                        seq = self._db.execute(
                            "INSERT INTO events (ts, kind, cause, details) VALUES (?,?,?,?)",
                            (time.time(), "decision", cause,
                             f'{{"circuits": {text}, "switch": {json.dumps(name)}}}')
                        ).lastrowid
                    elif seq is None:
                        seq = self._db.execute("SELECT COALESCE(MAX(seq), 0) FROM events"
                                               ).fetchone()[0]
                    self._db.execute("INSERT OR REPLACE INTO intended VALUES (?,?,?)",
                                     (name, text, seq))
                self._db.execute("RELEASE intended")
            except BaseException:
                self._db.execute("ROLLBACK TO intended")
                self._db.execute("RELEASE intended")
                raise
            finally:
                self._db.execute("COMMIT")
            return seq if seq is not None else 0

    def intended(self) -> dict[str, list[tuple[int, int]]]:
        with self._lock:
            self.flush()
            rows = self._db.execute("SELECT switch, circuits FROM intended").fetchall()
        return {name: [tuple(p) for p in json.loads(text)] for name, text in rows}

    def entries(self, since: int = 0, kinds: tuple[str, ...] | None = None,
                limit: int | None = None) -> list[Entry]:
        query = "SELECT seq, ts, kind, cause, latency_s, details FROM events WHERE seq > ?"
        args: list[Any] = [since]
        if kinds:
            query += f" AND kind IN ({','.join('?' * len(kinds))})"
            args += list(kinds)
        query += " ORDER BY seq"
        if limit is not None:
            query += " LIMIT ?"
            args.append(int(limit))
        with self._lock:
            self.flush()
            rows = self._db.execute(query, args).fetchall()
        return [Entry(seq, ts, kind, cause, lat, json.loads(det))
                for seq, ts, kind, cause, lat, det in rows]

    def __iter__(self) -> Iterator[Entry]:
        return iter(self.entries())
