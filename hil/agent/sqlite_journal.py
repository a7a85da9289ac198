"""The agent's journal in SQLite (`SqliteJournal`, the one-host `Journal` of hil.agent.journal):
every decision and every applied configuration, durably.

One row per event (its kind, cause, latency and details: the entry's Struct as JSON), in WAL
mode with full sync, so a `kill -9` of the agent loses nothing that was reported as written.
The journal also holds the *intended* circuits of every switch: after a restart the agent reads
them back and repairs only what differs on the hardware.

Write-ahead without a disk sync per row: an entry may be recorded `defer=True` (a detection, a
decision, an applied change, a verification): it is written at once but made durable together
with the next entry that must be, in one transaction, one sync: the intended circuits before a
switch moves (`set_intended`), the restart order before the job hears it, an alarm, or any
read of the journal (`entries`, `intended`, `flush`, `close`). Nothing acts on a deferred entry
before that commit, so a `kill -9` in between loses only entries whose effect never left the
process.

Long lists are kept once: an entry whose details run past `SHARE_ABOVE` characters of JSON (a
phase switch on 64 OCSes names each switch's circuits added and removed, 35 KB) has each list
of `SHARED_ITEMS` or more items stored in `shared_values` under its digest and referred to by
it; a job's phases come back round after round and with them the same lists, so such an entry
costs a few KB instead of its whole text. Readers (`entries`) get the details whole, each
shared value checked against its digest. `read_only` opens a journal to read it only (`ptb
journal`): never written, on a read-only medium too.

Opening: a journal is created only where no file exists, and created whole (in a scratch file
beside it, linked into place once its schema is written), so a file at the path is always a
complete journal or damage. An existing file is checked before anything reads it: an SQLite
header, `PRAGMA quick_check`, the journal's tables and schema version. An empty, truncated,
overwritten or unreadable file, or a directory, is refused with `JournalError`, never re-created:
the journal is the agent's memory of what the switches should hold, and an empty one would make
it forget silently. Any later SQLite failure is a `JournalError` too.

Rows that cannot lie (schema 3): every row of `events` and `intended` carries a checksum of its
fields (`hil.agent.sqlite_file`, which also makes, checks and upgrades the file), checked
whenever it is read; a shared value is checked against its digest, which is its key. A row that
does not match is a `JournalError` naming it, never a different value: a flipped byte reads back
exactly as written or is refused. Reads never go through an index SQLite keeps beside a table
(`quick_check` does not compare the two, so a damaged index could hide a row): entries are
filtered by kind on the rows themselves. A journal of schema 1 or 2 is brought to 3 when a
writer opens it, its rows sealed as they are then: they were written without a checksum, so
they are trusted as far as they were checked before and are still (SQLite's `quick_check`,
their JSON, their type, shared values against their digests), and from then on a change to them
is caught. Read only (`ptb journal`), an older journal is read as it is, with those checks alone.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import sqlite3
import threading
import time
import urllib.parse
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import msgspec
import orjson

from photonic_testbed.hil.agent.entries import KINDS, Details, Intent, Unread, decode
from photonic_testbed.hil.agent.journal import MAX_SEQ, Entry, JournalError, Listeners
from photonic_testbed.hil.agent.sqlite_file import (
    FAILURES,
    SCHEMA_VERSION,
    check_columns,
    check_contents,
    check_file,
    create_file,
    event_seal,
    exists,
    intended_seal,
    read_only_medium,
    said,
    schema_in_file,
    sqlite_errors,
    text_from_sqlite,
    upgrade,
    writable_folder,
)

log = logging.getLogger(__name__)

CHECKPOINT_S = 1.0            # the write-ahead log is copied into the database this often,
                              # off the writers' path (a checkpoint costs 10-20 ms)
SHARE_ABOVE = 2048           # an entry's details longer than this (JSON characters) share lists
SHARED_ITEMS = 16            # ... of this many items or more
SHARED = "$shared"          # {"$shared": digest} stands for a shared list in stored details
_KNOWN_KEPT = 100_000        # digests remembered as stored (past this, forgotten and asked)
_OPTS = orjson.OPT_NON_STR_KEYS


class Unshareable(Exception):
    """The details hold a mapping with the key that marks a shared value: stored whole."""


def shared_form(details: dict) -> tuple[str, dict[str, bytes]]:
    """The details as stored with each list of SHARED_ITEMS items or more replaced by
    {"$shared": digest}, and {digest: the list as JSON}; Unshareable if a mapping in them
    already has that key (it would be read as a reference)."""
    values: dict[str, bytes] = {}

    def walk(v: Any) -> Any:
        if isinstance(v, dict):
            if SHARED in v:
                raise Unshareable
            return {k: walk(x) if isinstance(x, _NESTED) or type(x) is tuple else x
                    for k, x in v.items()}
        if len(v) >= SHARED_ITEMS:
            body = orjson.dumps(v, default=str, option=_OPTS)
            digest = digest_of(body)
            values[digest] = body
            return {SHARED: digest}
        return [walk(x) if isinstance(x, _NESTED) or type(x) is tuple else x for x in v]
    form = walk(details)
    return orjson.dumps(form, default=str, option=_OPTS).decode(), values


# what orjson writes as a JSON object or array: dicts and lists and their subclasses, and
# tuples (a tuple's subclass, a named tuple, it writes as its text)
_NESTED = (dict, list)


def digest_of(body: bytes) -> str:
    return hashlib.blake2b(body, digest_size=16).hexdigest()


def _real(x: float | None) -> float | None:
    """A REAL as SQLite keeps it: a float (an integer given is stored as its float), NaN as
    NULL (SQLite stores no NaN)."""
    if x is None:
        return None
    x = float(x)
    return None if x != x else x


def references(value: Any, out: set[str]) -> None:
    """The digests of the shared values `value` (stored details, read) refers to, into `out`."""
    if type(value) is dict:
        if len(value) == 1 and type(value.get(SHARED)) is str:
            out.add(value[SHARED])
            return
        for v in value.values():
            references(v, out)
    elif type(value) is list:
        for v in value:
            references(v, out)


def resolved(value: Any, texts: Mapping[str, str]) -> Any:
    """Stored details, read, with each reference replaced by the value it stands for (a new
    object each time: a reader may change what it is given)."""
    if type(value) is dict:
        if len(value) == 1 and type(value.get(SHARED)) is str:
            return orjson.loads(texts[value[SHARED]])
        return {k: resolved(v, texts) for k, v in value.items()}
    if type(value) is list:
        return [resolved(v, texts) for v in value]
    return value


def _details(text: str) -> dict:
    """An entry's details as stored (orjson writes them; a journal of an older version may hold
    what only the standard library reads, such as NaN)."""
    try:
        return orjson.loads(text)
    except orjson.JSONDecodeError:
        return json.loads(text)


@dataclass(frozen=True)
class StoredEntry:
    """An entry as stored: its details as JSON has them (`ptb journal --json`; the storage's
    own tests), not read in their type."""
    seq: int
    ts: float
    kind: str
    cause: str
    latency_s: float | None
    details: dict[str, Any] = field(default_factory=dict)


class SqliteJournal(Listeners):
    """Append-only event log plus the intended circuits per switch, in SQLite. Thread-safe."""

    def __init__(self, path: str | os.PathLike, synchronous: str = "FULL", *,
                 create: bool = True, read_only: bool = False):
        """`synchronous` FULL (default) syncs every commit to the disk; NORMAL (WAL) still
        survives a kill -9 of the process (the commit is in the OS's hands) but may lose the
        last commits on a power loss or OS crash, for a fsync less per event. `create`: make a
        new journal if no file is at `path` (else that is a JournalError too). `read_only`: to
        read it (`ptb journal`), never to write it: a journal on a read-only medium reads, and
        one of schema 1 is read as it is."""
        if synchronous not in ("FULL", "NORMAL"):
            raise JournalError(f"synchronous is FULL or NORMAL, not {synchronous!r}")
        self.path = os.fspath(path)
        if not self.path:
            raise JournalError("the journal's path is empty")
        self._lock = threading.RLock()
        self.read_only = read_only
        self._schema = SCHEMA_VERSION
        if not exists(self.path):
            if not create or read_only:
                raise JournalError(f"no journal at {self.path}")
            create_file(self.path)
        check_file(self.path)
        if not read_only and not writable_folder(self.path):
            raise JournalError(f"{self.path}: cannot write the journal: its folder is on a "
                               f"read-only medium or not writable (`ptb journal` reads it)")
        try:
            self._db = self._connect()
        except FAILURES as e:
            raise JournalError(f"{self.path}: cannot open the journal: {said(e)}") from None
        try:
            self._schema = check_contents(self._db, self.path)
            if self._schema < SCHEMA_VERSION and not read_only:
                upgrade(self._db, self.path)
                self._schema = SCHEMA_VERSION
            if not read_only:
                with sqlite_errors(self.path, "opening the journal"):
                    self._db.execute("PRAGMA journal_mode=WAL")
                    self._db.execute(f"PRAGMA synchronous={synchronous}")
                    # SQLite checkpoints inside the commit that fills the log past 1,000
                    # pages: a decision paying 10-20 ms now and then. A thread of ours does it.
                    self._db.execute("PRAGMA wal_autocheckpoint=0")
        except BaseException:
            self._db.close()
            raise
        self._listeners: list[Callable[[Entry, str], None]] = []
        self._stored: set[str] = set()        # digests of shared values known to be stored
        self._storing: set[str] = set()       # ... written in the transaction under way
        self._deferred: list[int] = []        # entries written deferred, not yet committed
        self._next_seq: int | None = None     # the next entry's number, in this transaction
        self._closing = threading.Event()
        self._checkpointer = threading.Thread(target=self._checkpoints, daemon=True,
                                              name=f"journal-checkpoint {self.path}")
        if not read_only:
            self._checkpointer.start()

    def _connect(self) -> sqlite3.Connection:
        db = self._open()
        db.text_factory = text_from_sqlite
        return db

    def _open(self) -> sqlite3.Connection:
        if not self.read_only:
            return sqlite3.connect(self.path, isolation_level=None, check_same_thread=False,
                                   timeout=5.0)
        uri = "file:" + urllib.parse.quote(os.path.abspath(self.path)) + "?mode=ro"
        db = sqlite3.connect(uri, uri=True, isolation_level=None, check_same_thread=False,
                             timeout=5.0)
        try:
            db.execute("SELECT COUNT(*) FROM sqlite_master").fetchone()
            return db
        except sqlite3.OperationalError:
            if not read_only_medium(self.path):
                raise
        db.close()
        # a write-ahead-log database on a read-only medium without the log's shared-memory
        # index (-shm), which SQLite cannot make there: read as immutable, which reads the
        # database alone, so only when no log holds entries not yet copied into it
        try:
            log_bytes = os.path.getsize(self.path + "-wal")
        except OSError:
            log_bytes = 0
        if log_bytes:
            raise JournalError(f"{self.path}: its write-ahead log ({log_bytes} bytes of "
                               f"entries) is on a read-only medium without SQLite's index "
                               f"(-shm): copy the journal's folder somewhere writable to "
                               f"read it")
        return sqlite3.connect(uri + "&immutable=1", uri=True, isolation_level=None,
                               check_same_thread=False, timeout=5.0)

    def _checkpoints(self) -> None:
        """Every CHECKPOINT_S, copy what the log holds into the database (PASSIVE: never
        waits for, nor blocks, a writer; the log starts over once all of it is copied)."""
        try:
            db = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False,
                                 timeout=0.5)
        except sqlite3.Error:
            return                   # the writer's connection checkpoints when it closes
        try:
            while not self._closing.wait(CHECKPOINT_S):
                try:
                    db.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchall()
                except sqlite3.Error:
                    pass             # busy or gone: the next round, or the writer's close
        finally:
            db.close()

    def close(self) -> None:
        self._closing.set()
        if self._checkpointer.is_alive() and self._checkpointer is not threading.current_thread():
            self._checkpointer.join(5.0)
        with self._lock:
            try:
                with self._writing("committing the last entries"):
                    self._commit()
            finally:
                self._db.close()

    def __enter__(self) -> SqliteJournal:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def flush(self) -> None:
        """Make the deferred entries durable (one transaction, one sync)."""
        with self._lock, self._writing("committing"):
            self._commit()

    def _begin(self) -> None:
        if self.read_only:
            raise JournalError(f"{self.path}: opened to be read, not written")
        if not self._db.in_transaction:
            self._storing.clear()
            self._deferred.clear()
            self._next_seq = None
            self._db.execute("BEGIN IMMEDIATE")

    def _commit(self) -> None:
        if not self._db.in_transaction:
            return
        self._db.execute("COMMIT")
        self._next_seq = None
        self._deferred.clear()
        if self._storing:
            if len(self._stored) + len(self._storing) > _KNOWN_KEPT:
                self._stored.clear()
            self._stored |= self._storing
            self._storing.clear()

    @contextlib.contextmanager
    def _writing(self, doing: str):
        """`_sqlite_errors` for a write; when the failure made SQLite roll the transaction
        back (a full disk, an I/O error), the shared values it wrote are not taken as stored,
        and the deferred entries it held, lost, are named."""
        try:
            yield
        except FAILURES as e:
            lost = ""
            self._next_seq = None
            if not self._db.in_transaction:
                self._storing.clear()
                gone, self._deferred = self._deferred, []
                if gone:
                    lost = (f"; the transaction was rolled back and the {len(gone)} deferred "
                            f"entries before it (seq {gone[0]}..{gone[-1]}) are lost")
            raise JournalError(f"{self.path}: {doing} failed: {said(e)}{lost}") from e

    def record(self, details: Details, cause: str = "", latency_s: float | None = None,
               ts: float | None = None, *, defer: bool = False) -> int:
        """Append one entry of `details`' kind; returns its sequence number once it is on disk
        (with `defer`, once it is written: on disk with the next entry that is not deferred)."""
        if not details.kind or isinstance(details, Unread):
            raise ValueError(f"{type(details).__name__} is not a kind of journal entry")
        text = msgspec.json.encode(details).decode()
        return self._append(details.kind, details, text, lambda: msgspec.to_builtins(details),
                            cause, latency_s, ts, defer)

    def record_stored(self, kind: str, cause: str = "", latency_s: float | None = None,
                      ts: float | None = None, *, defer: bool = False, **details: Any) -> int:
        """Append an entry given as stored details (JSON-able values, read back by
        `stored_entries`): for tools that copy or mend a journal and the storage's own tests.
        The agent records typed entries (`record`)."""
        if kind not in KINDS:
            raise ValueError(f"unknown journal kind {kind!r}; one of {', '.join(KINDS)}")
        text = orjson.dumps(details, default=str, option=_OPTS).decode()
        try:
            typed: Details = decode(kind, orjson.loads(text))
        except msgspec.ValidationError:
            typed = Unread(fields=details)
        return self._append(kind, typed, text, lambda: details, cause, latency_s, ts, defer)

    def _append(self, kind: str, typed: Details, text: str, plain: Callable[[], dict],
                cause: str, latency_s: float | None, ts: float | None, defer: bool) -> int:
        """Write an entry: `text` its details as JSON, `plain()` them as plain values (asked
        only when they are long enough to share their lists)."""
        stored, values = text, dict[str, bytes]()
        if len(text) > SHARE_ABOVE:
            try:
                stored, values = shared_form(plain())
            except Unshareable:
                pass
        ts = time.time() if ts is None else float(ts)
        latency_s = _real(latency_s)
        with self._lock, self._writing(f"recording {kind!r}"):
            self._begin()
            try:
                for digest, body in values.items():
                    if digest not in self._stored and digest not in self._storing:
                        self._db.execute("INSERT OR IGNORE INTO shared_values VALUES (?,?)",
                                         (digest, body.decode()))
                        self._storing.add(digest)
                seq = self._insert_event(ts, kind, cause, latency_s, stored, int(bool(values)))
            finally:
                if not defer:
                    self._commit()
            if defer:
                self._deferred.append(seq)
            self._tell(Entry(seq, ts, kind, cause, latency_s, typed), text)
            return seq

    def _insert_event(self, ts: float, kind: str, cause: str, latency_s: float | None,
                      details: str, shares: int) -> int:
        """Insert an event row, sealed, in the transaction under way; its sequence number.
        The number is the one SQLite would give (AUTOINCREMENT: past every number used),
        worked out first, since the row's checksum covers it: asked of SQLite once a
        transaction (which holds the file's write lock: no other writer meanwhile)."""
        seq = self._next_seq
        if seq is None:
            seq = self._db.execute(
                "SELECT MAX(COALESCE((SELECT seq FROM sqlite_sequence WHERE name='events'), 0), "
                "COALESCE((SELECT MAX(seq) FROM events), 0)) + 1").fetchone()[0]
        self._db.execute(
            "INSERT INTO events (seq, ts, kind, cause, latency_s, details, shares, checksum) "
            "VALUES (?,?,?,?,?,?,?,?)",
            (seq, ts, kind, cause, latency_s, details, shares,
             event_seal(seq, ts, kind, cause, latency_s, details, shares)))
        self._next_seq = seq + 1
        return seq

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
        with self._lock, self._writing("recording intended circuits"):
            self._begin()
            self._db.execute("SAVEPOINT intended")
            try:
                seq = None
                written = []
                for name, pairs in rows.items():
                    text = orjson.dumps(pairs).decode()     # [[input, output], ...]
                    if event:
                        ts = time.time()
                        details = f'{{"circuits": {text}, "switch": {json.dumps(name)}}}'
                        seq = self._insert_event(ts, "decision", cause, None, details, 0)
                        written.append((Entry(seq, ts, "decision", cause, None, Intent(
                            switch=name, circuits=[(int(a), int(b)) for a, b in pairs])),
                            details))
                    elif seq is None:
                        seq = self._db.execute("SELECT COALESCE(MAX(seq), 0) FROM events"
                                               ).fetchone()[0]
                    self._db.execute("INSERT OR REPLACE INTO intended VALUES (?,?,?,?)",
                                     (name, text, seq, intended_seal(name, text, seq)))
                self._db.execute("RELEASE intended")
            except BaseException:
                if self._db.in_transaction:        # (else SQLite rolled it all back)
                    self._db.execute("ROLLBACK TO intended")
                    self._db.execute("RELEASE intended")
                raise
            finally:
                self._commit()
            for entry, details in written:          # on disk now
                self._tell(entry, details)
            return seq if seq is not None else 0

    def intended(self) -> dict[str, list[tuple[int, int]]]:
        """Every switch's intended circuits, as last set; a row that does not match its
        checksum, names a switch twice or does not hold circuits is a JournalError."""
        with self._lock, sqlite_errors(self.path, "reading the intended circuits"):
            self.flush()
            sealed = self._current_schema() >= 3
            rows = self._db.execute(
                f"SELECT rowid, switch, circuits, seq, {'checksum' if sealed else 'NULL'} "
                "FROM intended").fetchall()
        out: dict[str, list[tuple[int, int]]] = {}
        for rowid, name, text, seq, checksum in rows:
            where = f"the intended circuits of switch {name!r} (row {rowid})"
            if sealed and checksum != intended_seal(name, text, seq):
                raise JournalError(f"{self.path}: damaged: {where} do not match their "
                                   "checksum")
            if type(name) is not str or name in out:
                raise JournalError(f"{self.path}: damaged: {where}: the switch is named "
                                   + ("twice" if name in out else "by no text"))
            try:
                pairs = msgspec.json.decode(text, type=list[tuple[int, int]])
            except (msgspec.DecodeError, TypeError) as e:
                raise JournalError(f"{self.path}: damaged: {where} are not a list of "
                                   f"circuits ({e})") from None
            if len({i for i, _ in pairs}) != len(pairs):
                raise JournalError(f"{self.path}: damaged: {where} name an input twice")
            out[name] = pairs
        return out

    def _current_schema(self) -> int:
        """The schema to read with: a writer may have brought the journal to schema 3 since
        it was opened to be read."""
        if self._schema < SCHEMA_VERSION:
            now = schema_in_file(self._db, self.path)
            if now != self._schema:
                check_columns(self._db, self.path, now)
                self._schema = now
        return self._schema

    def entries(self, since: int = 0, kinds: tuple[str, ...] | None = None,
                limit: int | None = None) -> list[Entry]:
        """The entries after `since` (of `kinds`, at most `limit`), oldest first, each in the
        type of its kind; an entry that does not read as its kind is a JournalError naming it
        (the journal is the agent's memory: nothing of it is skipped)."""
        out = []
        for seq, ts, kind, cause, lat, details in self._read(since, kinds, limit):
            try:
                typed = decode(kind, details)
            except (msgspec.ValidationError, ValueError) as e:
                raise JournalError(f"{self.path}: entry {seq} does not read as a {kind!r} "
                                   f"entry: {e}") from None
            out.append(Entry(seq, ts, kind, cause, lat, typed))
        return out

    def stored_entries(self, since: int = 0, kinds: tuple[str, ...] | None = None,
                       limit: int | None = None) -> list[StoredEntry]:
        """`entries` as stored: their details as JSON has them, not read in their types."""
        return [StoredEntry(*row) for row in self._read(since, kinds, limit)]

    def _read(self, since: int, kinds: tuple[str, ...] | None, limit: int | None
              ) -> list[tuple[int, float, str, str, float | None, dict[str, Any]]]:
        if not isinstance(since, int) or not 0 <= since <= MAX_SEQ:
            raise ValueError(f"since is a sequence number 0..{MAX_SEQ}, not {since!r}")
        if limit is not None and (not isinstance(limit, int) or not 0 <= limit <= MAX_SEQ):
            raise ValueError(f"limit is a count 0..{MAX_SEQ}, not {limit!r}")
        # every row from the start (`since` 0): not `seq > 0`, which would pass over a first
        # row whose number damage made 0 or less (still in order, quick_check sees nothing)
        query = ("SELECT seq, ts, kind, cause, latency_s, details, {shares}, {checksum} "
                 "FROM events WHERE " + ("seq > ?" if since else "1"))
        args: list[Any] = [since] if since else []
        if kinds:
            # `+kind`: filtered on the rows themselves, not through an index (none is kept from
            # schema 3; an older journal's could be damaged without quick_check seeing it)
            query += f" AND +kind IN ({','.join('?' * len(kinds))})"
            args += list(kinds)
        query += " ORDER BY seq"
        if limit is not None:
            query += " LIMIT ?"
            args.append(int(limit))
        with self._lock, sqlite_errors(self.path, "reading the entries"):
            self.flush()
            schema = self._current_schema()
            query = query.format(shares="shares" if schema >= 2 else "0",
                                 checksum="checksum" if schema >= 3 else "NULL")
            rows = self._db.execute(query, args).fetchall()
            details = []
            for row in rows:
                if schema >= 3 and row[7] != event_seal(*row[:7]):
                    raise JournalError(f"{self.path}: damaged: entry {row[0]} does not match "
                                       "its checksum")
                try:
                    if not isinstance(row[5], str):
                        raise ValueError(f"{type(row[5]).__name__}, not text")
                    details.append(_details(row[5]))
                except ValueError as e:            # (JSONDecodeError, either library's)
                    raise JournalError(f"{self.path}: damaged: the details of entry {row[0]} "
                                       f"are not JSON ({e})") from None
            sharing = [i for i, row in enumerate(rows) if row[6]]
            if sharing:
                self._resolve(rows, details, sharing)
        return [(seq, ts, kind, cause, lat, d)
                for (seq, ts, kind, cause, lat, *_), d in zip(rows, details, strict=True)]

    def _resolve(self, rows: list, details: list[dict], sharing: list[int]) -> None:
        """Put in place the shared values that the details of rows `sharing` refer to (read
        in one go)."""
        refs: dict[int, set[str]] = {}
        for i in sharing:
            references(details[i], refs.setdefault(i, set()))
        names = sorted(set().union(*refs.values()))
        texts: dict[str, str] = {}
        for k in range(0, len(names), 500):
            part = names[k:k + 500]
            texts.update(self._db.execute(
                f"SELECT digest, value FROM shared_values WHERE digest IN "
                f"({','.join('?' * len(part))})", part).fetchall())
        bad = {d for d, text in texts.items()
               if type(text) is not str or digest_of(text.encode()) != d}
        for i in sharing:
            missing = refs[i] - texts.keys()
            if refs[i] & bad:
                raise JournalError(f"{self.path}: damaged: a shared value entry {rows[i][0]} "
                                   f"refers to does not match its digest "
                                   f"({min(refs[i] & bad)})")
            if missing:
                raise JournalError(f"{self.path}: damaged: entry {rows[i][0]} refers to "
                                   f"{len(missing)} shared value(s) the journal does not "
                                   f"hold ({min(missing)})")
            details[i] = resolved(details[i], texts)    # (as stored: JSON, its digest says)

    def __iter__(self) -> Iterator[Entry]:
        return iter(self.entries())
