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
fields (BLAKE2b, `_seal`), checked whenever it is read; a shared value is checked against its
digest, which is its key. A row that does not match is a `JournalError` naming it, never a
different value: a flipped byte reads back exactly as written or is refused. Reads never go
through an index SQLite keeps beside a table (`quick_check` does not compare the two, so a
damaged index could hide a row): entries are filtered by kind on the rows themselves. A journal
of schema 1 or 2 is brought to 3 when a writer opens it, its rows sealed as they are then: they
were written without a checksum, so they are trusted as far as they were checked before and are
still (SQLite's `quick_check`, their JSON, their type, shared values against their digests),
and from then on a change to them is caught. Read only (`ptb journal`), an older journal is read
as it is, with those checks alone.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import sqlite3
import stat
import threading
import time
import urllib.parse
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import msgspec
import orjson

from photonic_testbed.hil.agent.entries import KINDS, Details, Intent, Unread, decode
from photonic_testbed.hil.agent.journal import MAX_SEQ, Entry, JournalError

log = logging.getLogger(__name__)

SCHEMA_VERSION = 3           # 2: long lists kept once (`shared_values`, `events.shares`);
                             # 3: a checksum on every row; a journal of schema 1 or 2 is
                             # brought to 3 when a writer opens it

_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS events (
    seq        INTEGER PRIMARY KEY AUTOINCREMENT,
    ts         REAL    NOT NULL,
    kind       TEXT    NOT NULL,
    cause      TEXT    NOT NULL DEFAULT '',
    latency_s  REAL,
    details    TEXT    NOT NULL DEFAULT '{}',
    shares     INTEGER NOT NULL DEFAULT 0,
    checksum   TEXT    NOT NULL
);
CREATE TABLE IF NOT EXISTS intended (
    switch     TEXT PRIMARY KEY,
    circuits   TEXT NOT NULL,
    seq        INTEGER NOT NULL,
    checksum   TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS shared_values (digest TEXT PRIMARY KEY, value TEXT NOT NULL);
"""
_SHARED_TABLE = "CREATE TABLE shared_values (digest TEXT PRIMARY KEY, value TEXT NOT NULL)"

CHECKPOINT_S = 1.0            # the write-ahead log is copied into the database this often,
                              # off the writers' path (a checkpoint costs 10-20 ms)
_SQLITE_MAGIC = b"SQLite format 3\x00"
_TABLES = {"meta", "events", "intended"}     # (and `shared_values` from schema 2)
# the columns of each table the journal reads, by schema version
_COLUMNS = {
    1: {"events": ("seq", "ts", "kind", "cause", "latency_s", "details"),
        "intended": ("switch", "circuits", "seq")},
    2: {"events": ("seq", "ts", "kind", "cause", "latency_s", "details", "shares"),
        "intended": ("switch", "circuits", "seq"),
        "shared_values": ("digest", "value")},
    3: {"events": ("seq", "ts", "kind", "cause", "latency_s", "details", "shares", "checksum"),
        "intended": ("switch", "circuits", "seq", "checksum"),
        "shared_values": ("digest", "value")},
}
SHARE_ABOVE = 2048           # an entry's details longer than this (JSON characters) share lists
SHARED_ITEMS = 16            # ... of this many items or more
_SHARED = "$shared"          # {"$shared": digest} stands for a shared list in stored details
_KNOWN_KEPT = 100_000        # digests remembered as stored (past this, forgotten and asked)
_OPTS = orjson.OPT_NON_STR_KEYS


class _Unshareable(Exception):
    """The details hold a mapping with the key that marks a shared value: stored whole."""


def _shared_form(details: dict) -> tuple[str, dict[str, bytes]]:
    """The details as stored with each list of SHARED_ITEMS items or more replaced by
    {"$shared": digest}, and {digest: the list as JSON}; _Unshareable if a mapping in them
    already has that key (it would be read as a reference)."""
    values: dict[str, bytes] = {}

    def walk(v: Any) -> Any:
        if isinstance(v, dict):
            if _SHARED in v:
                raise _Unshareable
            return {k: walk(x) if isinstance(x, _NESTED) or type(x) is tuple else x
                    for k, x in v.items()}
        if len(v) >= SHARED_ITEMS:
            body = orjson.dumps(v, default=str, option=_OPTS)
            digest = _digest(body)
            values[digest] = body
            return {_SHARED: digest}
        return [walk(x) if isinstance(x, _NESTED) or type(x) is tuple else x for x in v]
    form = walk(details)
    return orjson.dumps(form, default=str, option=_OPTS).decode(), values


# what orjson writes as a JSON object or array: dicts and lists and their subclasses, and
# tuples (a tuple's subclass, a named tuple, it writes as its text)
_NESTED = (dict, list)


def _digest(body: bytes) -> str:
    return hashlib.blake2b(body, digest_size=16).hexdigest()


def _seal(*fields: str | int | float | None) -> str:
    """A row's checksum: BLAKE2b of its fields as MessagePack writes them, each with its type
    and length, so that no change to a field (its type included: the integer 1 is not the
    float 1.0, text that is not UTF-8 is not text) leaves it unchanged."""
    return hashlib.blake2b(msgspec.msgpack.encode(
        [bytes(f) if isinstance(f, _NotText) else f for f in fields]),
        digest_size=16).hexdigest()


class _NotText(bytes):
    """A TEXT value SQLite gives back that is not UTF-8 (damage): kept as its bytes, so that
    the row it is in is refused by name (its checksum, or its reader), not by a traceback."""


def _text(raw: bytes) -> str:
    """SQLite's text as Python's: UTF-8, or the bytes as `_NotText`."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return _NotText(raw)        # type: ignore[return-value]


def _event_seal(seq: int, ts: float, kind: str, cause: str, latency_s: float | None,
                details: str, shares: int) -> str:
    return _seal("event", seq, ts, kind, cause, latency_s, details, shares)


def _intended_seal(switch: str, circuits: str, seq: int) -> str:
    return _seal("intended", switch, circuits, seq)


def _real(x: float | None) -> float | None:
    """A REAL as SQLite keeps it: a float (an integer given is stored as its float), NaN as
    NULL (SQLite stores no NaN)."""
    if x is None:
        return None
    x = float(x)
    return None if x != x else x


def _references(value: Any, out: set[str]) -> None:
    """The digests of the shared values `value` (stored details, read) refers to, into `out`."""
    if type(value) is dict:
        if len(value) == 1 and type(value.get(_SHARED)) is str:
            out.add(value[_SHARED])
            return
        for v in value.values():
            _references(v, out)
    elif type(value) is list:
        for v in value:
            _references(v, out)


def _resolved(value: Any, texts: Mapping[str, str]) -> Any:
    """Stored details, read, with each reference replaced by the value it stands for (a new
    object each time: a reader may change what it is given)."""
    if type(value) is dict:
        if len(value) == 1 and type(value.get(_SHARED)) is str:
            return orjson.loads(texts[value[_SHARED]])
        return {k: _resolved(v, texts) for k, v in value.items()}
    if type(value) is list:
        return [_resolved(v, texts) for v in value]
    return value


def _details(text: str) -> dict:
    """An entry's details as stored (orjson writes them; a journal of an older version may hold
    what only the standard library reads, such as NaN)."""
    try:
        return orjson.loads(text)
    except orjson.JSONDecodeError:
        return json.loads(text)


# SQLite's failures: its errors (OperationalError, IntegrityError...), and a message of damage
# that quotes bytes that are not UTF-8, which Python cannot decode into the error
_FAILURES = (sqlite3.DatabaseError, UnicodeDecodeError)


def _said(e: Exception) -> str:
    """What SQLite said of a failure, on one line (it may quote a damaged name)."""
    if isinstance(e, UnicodeDecodeError):
        return f"damaged (SQLite's message quotes bytes that are not UTF-8: {e})"
    return _one_line(str(e))


def _one_line(text: str) -> str:
    """SQLite's words on one line: its lines joined, anything else unprintable escaped."""
    text = "; ".join(line.strip() for line in text.splitlines() if line.strip())
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


@contextlib.contextmanager
def _sqlite_errors(path: str, doing: str):
    """Turn SQLite's failures into a JournalError that names the file."""
    try:
        yield
    except _FAILURES as e:
        raise JournalError(f"{path}: {doing} failed: {_said(e)}") from e


def _refuse(path: str, why: str) -> JournalError:
    return JournalError(f"{path} is not a usable journal: {why}. A new journal is created only "
                        f"where no file exists: move this one aside to start afresh")


def _check_file(path: str) -> None:
    """Refuse what is plainly not a journal before SQLite opens it (SQLite would take an empty
    file for a new database, and report other damage only at the first read)."""
    try:
        mode = os.stat(path).st_mode
        if stat.S_ISDIR(mode):
            raise _refuse(path, "it is a directory")
        if not stat.S_ISREG(mode):
            raise _refuse(path, "it is not a regular file")
        with open(path, "rb") as f:
            head = f.read(len(_SQLITE_MAGIC))
    except OSError as e:
        raise JournalError(f"{path}: cannot read the journal: "
                           f"{(e.strerror or str(e)).lower()}") from None
    if not head:
        raise _refuse(path, "the file is empty (0 bytes; truncated?)")
    if head != _SQLITE_MAGIC:
        raise _refuse(path, "no SQLite header (overwritten or damaged)")


def _writable_folder(path: str) -> bool:
    """Whether the journal's folder takes new files (SQLite's log beside the journal)."""
    folder = os.path.dirname(os.path.abspath(path))
    return not _read_only_medium(path) and os.access(folder, os.W_OK | os.X_OK)


def _read_only_medium(path: str) -> bool:
    try:
        return bool(os.statvfs(os.path.dirname(os.path.abspath(path))).f_flag & os.ST_RDONLY)
    except OSError:
        return False


def _exists(path: str) -> bool:
    """Whether anything is at `path`; a path that cannot be looked at is an error, not absent
    (os.path.exists would say False, and a new journal would hide the old one)."""
    try:
        os.lstat(path)
        return True
    except FileNotFoundError:
        return False
    except OSError as e:
        raise JournalError(f"{path}: cannot reach the journal: "
                           f"{(e.strerror or str(e)).lower()}") from None


def _create(path: str) -> None:
    """Make a new, complete journal at `path` (which does not exist): written in a scratch file
    beside it and linked into place, so a crash leaves either no journal or a whole one."""
    folder = os.path.dirname(os.path.abspath(path))
    try:
        if not stat.S_ISDIR(os.stat(folder).st_mode):
            raise JournalError(f"{path}: cannot create the journal: {folder} is not a folder")
    except OSError as e:
        why = "no folder" if isinstance(e, (FileNotFoundError, NotADirectoryError)) else \
            (e.strerror or str(e)).lower() + " at"
        raise JournalError(f"{path}: cannot create the journal: {why} {folder}") from None
    if not _writable_folder(path):
        raise JournalError(f"{path}: cannot create the journal: {folder} is on a read-only "
                           f"medium or not writable")
    scratch = f"{path}.new-{os.getpid()}"
    for leftover in (scratch, scratch + "-wal", scratch + "-shm", scratch + "-journal"):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(leftover)
    try:
        db = sqlite3.connect(scratch, isolation_level=None)
        try:
            with _sqlite_errors(path, "creating the journal"):
                db.execute("PRAGMA journal_mode=WAL")
                db.executescript("BEGIN;" + _SCHEMA + "COMMIT;")
                db.execute("INSERT INTO meta VALUES ('schema', ?)", (str(SCHEMA_VERSION),))
        finally:
            db.close()                      # checkpoints and removes the scratch WAL
        try:
            os.link(scratch, path)          # fails if another process created it meanwhile
        except FileExistsError:
            pass
        except OSError:                     # a filesystem without hard links
            if not os.path.exists(path):
                os.replace(scratch, path)
        dir_fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
    except PermissionError:
        raise JournalError(f"{path}: cannot create the journal: permission denied in "
                           f"{folder}") from None
    except sqlite3.DatabaseError as e:
        raise JournalError(f"{path}: cannot create the journal: {e}") from None
    finally:
        for leftover in (scratch, scratch + "-wal", scratch + "-shm", scratch + "-journal"):
            with contextlib.suppress(OSError):
                os.unlink(leftover)


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


class SqliteJournal:
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
        if not _exists(self.path):
            if not create or read_only:
                raise JournalError(f"no journal at {self.path}")
            _create(self.path)
        _check_file(self.path)
        if not read_only and not _writable_folder(self.path):
            raise JournalError(f"{self.path}: cannot write the journal: its folder is on a "
                               f"read-only medium or not writable (`ptb journal` reads it)")
        try:
            self._db = self._connect()
        except _FAILURES as e:
            raise JournalError(f"{self.path}: cannot open the journal: {_said(e)}") from None
        try:
            self._check_contents()
            if not read_only:
                with _sqlite_errors(self.path, "opening the journal"):
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
        self._closing = threading.Event()
        self._checkpointer = threading.Thread(target=self._checkpoints, daemon=True,
                                              name=f"journal-checkpoint {self.path}")
        if not read_only:
            self._checkpointer.start()

    def _connect(self) -> sqlite3.Connection:
        db = self._open()
        db.text_factory = _text
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
            if not _read_only_medium(self.path):
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

    def _check_contents(self) -> None:
        """Integrity (quick_check: every page readable and well formed), then the journal's own
        tables and schema version, and the columns that version has."""
        try:
            problems = [r[0] for r in self._db.execute("PRAGMA quick_check").fetchall()]
            tables = {r[0] for r in self._db.execute(
                "SELECT name FROM sqlite_master WHERE type='table'")}
        except _FAILURES as e:
            raise _refuse(self.path, f"damaged ({_said(e)})") from None
        if problems != ["ok"]:
            raise _refuse(self.path, "damaged (integrity check: "
                          + "; ".join(_one_line(str(p)) for p in problems[:3])
                          + (f"; {len(problems) - 3} more" if len(problems) > 3 else "") + ")")
        if not _TABLES <= tables:
            raise _refuse(self.path, "an SQLite file without the journal's tables "
                          f"(missing {', '.join(sorted(_TABLES - tables))})")
        schema = self._schema_in_file()
        if schema >= 2 and "shared_values" not in tables:
            raise _refuse(self.path, f"a journal of schema {schema} without its shared_values "
                          "table")
        self._check_columns(schema)
        self._schema = schema
        if schema < SCHEMA_VERSION and not self.read_only:
            self._upgrade()

    def _schema_in_file(self) -> int:
        """The schema version the journal says it has (one this program reads)."""
        with _sqlite_errors(self.path, "reading the schema version"):
            rows = self._db.execute("SELECT value FROM meta WHERE +key='schema'").fetchall()
        if not rows:
            raise _refuse(self.path, "no schema version recorded")
        if len(rows) > 1:
            raise _refuse(self.path, f"damaged ({len(rows)} schema versions recorded)")
        value = rows[0][0]
        if type(value) is not str:
            raise _refuse(self.path, f"damaged (its schema version is not text: {value!r})")
        if value not in ("1", "2", str(SCHEMA_VERSION)):
            raise JournalError(f"{self.path} has journal schema {value!r}, this program "
                               f"reads schemas 1 to {SCHEMA_VERSION}")
        return int(value)

    def _check_columns(self, schema: int) -> None:
        """The tables have the columns of `schema`: a version changed by damage (a schema 3
        journal read as 2 would go unchecked) or a damaged table definition is refused."""
        with _sqlite_errors(self.path, "reading the tables' columns"):
            for table, want in _COLUMNS[schema].items():
                got = tuple(r[1] for r in self._db.execute(f"PRAGMA table_info({table})"))
                if got != want:
                    raise _refuse(self.path, f"damaged (schema {schema}, but table {table} "
                                  f"has columns {', '.join(map(str, got)) or 'none'})")

    def _upgrade(self) -> None:
        """Schema 1 or 2 -> 3 in one transaction: the columns of each version added, every row
        sealed as it is (none refers to a shared value before 2); the index by kind dropped
        (reads do not use it). A second process that opened the same journal meanwhile finds
        it done."""
        with _sqlite_errors(self.path, f"bringing the journal to schema {SCHEMA_VERSION}"):
            self._db.execute("BEGIN IMMEDIATE")
            try:
                was = self._schema_in_file()
                if was == 1:
                    self._db.execute("ALTER TABLE events ADD COLUMN shares INTEGER NOT NULL "
                                     "DEFAULT 0")
                    self._db.execute(_SHARED_TABLE)
                if was < 3:
                    self._check_columns(2)
                    self._db.execute("ALTER TABLE events ADD COLUMN checksum TEXT NOT NULL "
                                     "DEFAULT ''")
                    self._db.execute("ALTER TABLE intended ADD COLUMN checksum TEXT NOT NULL "
                                     "DEFAULT ''")
                    self._db.execute("DROP INDEX IF EXISTS events_kind")
                    self._seal_all()
                    self._db.execute("UPDATE meta SET value=? WHERE key='schema'",
                                     (str(SCHEMA_VERSION),))
                self._db.execute("COMMIT")
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
        self._schema = SCHEMA_VERSION
        if was < SCHEMA_VERSION:
            log.info("%s: journal brought from schema %d to %d", self.path, was,
                     SCHEMA_VERSION)

    def _seal_all(self) -> None:
        """Every row's checksum, from the row as it is (the upgrade to schema 3)."""
        db = self._db
        rows = db.execute("SELECT seq, ts, kind, cause, latency_s, details, shares "
                          "FROM events").fetchall()
        db.executemany("UPDATE events SET checksum=? WHERE seq=?",
                       [(_event_seal(*row), row[0]) for row in rows])
        rows = db.execute("SELECT rowid, switch, circuits, seq FROM intended").fetchall()
        db.executemany("UPDATE intended SET checksum=? WHERE rowid=?",
                       [(_intended_seal(*row[1:]), row[0]) for row in rows])

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
            self._db.execute("BEGIN IMMEDIATE")

    def _commit(self) -> None:
        if not self._db.in_transaction:
            return
        self._db.execute("COMMIT")
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
        except _FAILURES as e:
            lost = ""
            if not self._db.in_transaction:
                self._storing.clear()
                gone, self._deferred = self._deferred, []
                if gone:
                    lost = (f"; the transaction was rolled back and the {len(gone)} deferred "
                            f"entries before it (seq {gone[0]}..{gone[-1]}) are lost")
            raise JournalError(f"{self.path}: {doing} failed: {_said(e)}{lost}") from e

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
                stored, values = _shared_form(plain())
            except _Unshareable:
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
        worked out first, since the row's checksum covers it."""
        seq = self._db.execute(
            "SELECT MAX(COALESCE((SELECT seq FROM sqlite_sequence WHERE name='events'), 0), "
            "COALESCE((SELECT MAX(seq) FROM events), 0)) + 1").fetchone()[0]
        self._db.execute(
            "INSERT INTO events (seq, ts, kind, cause, latency_s, details, shares, checksum) "
            "VALUES (?,?,?,?,?,?,?,?)",
            (seq, ts, kind, cause, latency_s, details, shares,
             _event_seal(seq, ts, kind, cause, latency_s, details, shares)))
        return seq

    def listen(self, fn: Callable[[Entry, str], None]) -> None:
        """Call `fn(entry, its details as JSON)` for every entry written from now on, in order,
        when it is written (a deferred entry is on disk once `flush` returns). The entry's
        details are the writer's own: take what is needed before returning."""
        self._listeners.append(fn)

    def _tell(self, entry: Entry, text: str) -> None:
        for fn in self._listeners:
            try:
                fn(entry, text)
            except Exception:
                log.exception("%s: a journal listener failed on entry %d", self.path, entry.seq)

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
                                     (name, text, seq, _intended_seal(name, text, seq)))
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
        with self._lock, _sqlite_errors(self.path, "reading the intended circuits"):
            self.flush()
            sealed = self._current_schema() >= 3
            rows = self._db.execute(
                f"SELECT rowid, switch, circuits, seq, {'checksum' if sealed else 'NULL'} "
                "FROM intended").fetchall()
        out: dict[str, list[tuple[int, int]]] = {}
        for rowid, name, text, seq, checksum in rows:
            where = f"the intended circuits of switch {name!r} (row {rowid})"
            if sealed and checksum != _intended_seal(name, text, seq):
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
            now = self._schema_in_file()
            if now != self._schema:
                self._check_columns(now)
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
        with self._lock, _sqlite_errors(self.path, "reading the entries"):
            self.flush()
            schema = self._current_schema()
            query = query.format(shares="shares" if schema >= 2 else "0",
                                 checksum="checksum" if schema >= 3 else "NULL")
            rows = self._db.execute(query, args).fetchall()
            details = []
            for row in rows:
                if schema >= 3 and row[7] != _event_seal(*row[:7]):
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
            _references(details[i], refs.setdefault(i, set()))
        names = sorted(set().union(*refs.values()))
        texts: dict[str, str] = {}
        for k in range(0, len(names), 500):
            part = names[k:k + 500]
            texts.update(self._db.execute(
                f"SELECT digest, value FROM shared_values WHERE digest IN "
                f"({','.join('?' * len(part))})", part).fetchall())
        bad = {d for d, text in texts.items()
               if type(text) is not str or _digest(text.encode()) != d}
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
            details[i] = _resolved(details[i], texts)    # (as stored: JSON, its digest says)

    def __iter__(self) -> Iterator[Entry]:
        return iter(self.entries())
