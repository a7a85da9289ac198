"""The journal's SQLite file, as `SqliteJournal` (hil.agent.sqlite_journal) keeps it: its
schema and the columns each version has, a new file made whole, an existing one checked before
anything reads it and brought to the current schema, and the checksum that seals each row.

A row is sealed by a checksum of its fields (`seal`: BLAKE2b over them as MessagePack writes
them, each with its type and length), written with it and checked whenever it is read, so that
damage reads back as a refusal naming the row, never as a different value.
"""
from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import sqlite3
import stat

import msgspec

from photonic_testbed.hil.agent.journal import JournalError

log = logging.getLogger(__name__)

SCHEMA_VERSION = 3           # 2: long lists kept once (`shared_values`, `events.shares`);
                             # 3: a checksum on every row; a journal of schema 1 or 2 is
                             # brought to 3 when a writer opens it

SCHEMA = """
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
SHARED_TABLE = "CREATE TABLE shared_values (digest TEXT PRIMARY KEY, value TEXT NOT NULL)"

SQLITE_MAGIC = b"SQLite format 3\x00"
TABLES = {"meta", "events", "intended"}     # (and `shared_values` from schema 2)
# the columns of each table the journal reads, by schema version
COLUMNS = {
    1: {"events": ("seq", "ts", "kind", "cause", "latency_s", "details"),
        "intended": ("switch", "circuits", "seq")},
    2: {"events": ("seq", "ts", "kind", "cause", "latency_s", "details", "shares"),
        "intended": ("switch", "circuits", "seq"),
        "shared_values": ("digest", "value")},
    3: {"events": ("seq", "ts", "kind", "cause", "latency_s", "details", "shares", "checksum"),
        "intended": ("switch", "circuits", "seq", "checksum"),
        "shared_values": ("digest", "value")},
}


def seal(*fields: str | int | float | None) -> str:
    """A row's checksum: BLAKE2b of its fields as MessagePack writes them, each with its type
    and length, so that no change to a field (its type included: the integer 1 is not the
    float 1.0, text that is not UTF-8 is not text) leaves it unchanged."""
    return hashlib.blake2b(msgspec.msgpack.encode(
        [bytes(f) if isinstance(f, NotText) else f for f in fields]),
        digest_size=16).hexdigest()


class NotText(bytes):
    """A TEXT value SQLite gives back that is not UTF-8 (damage): kept as its bytes, so that
    the row it is in is refused by name (its checksum, or its reader), not by a traceback."""


def text_from_sqlite(raw: bytes) -> str:
    """SQLite's text as Python's: UTF-8, or the bytes as `NotText`."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return NotText(raw)        # type: ignore[return-value]


def event_seal(seq: int, ts: float, kind: str, cause: str, latency_s: float | None,
               details: str, shares: int) -> str:
    """An entry's checksum (a row of `events`)."""
    return seal("event", seq, ts, kind, cause, latency_s, details, shares)


def intended_seal(switch: str, circuits: str, seq: int) -> str:
    """A switch's intended circuits' checksum (a row of `intended`)."""
    return seal("intended", switch, circuits, seq)


# SQLite's failures: its errors (OperationalError, IntegrityError...), and a message of damage
# that quotes bytes that are not UTF-8, which Python cannot decode into the error
FAILURES = (sqlite3.DatabaseError, UnicodeDecodeError)


def said(e: Exception) -> str:
    """What SQLite said of a failure, on one line (it may quote a damaged name)."""
    if isinstance(e, UnicodeDecodeError):
        return f"damaged (SQLite's message quotes bytes that are not UTF-8: {e})"
    return one_line(str(e))


def one_line(text: str) -> str:
    """SQLite's words on one line: its lines joined, anything else unprintable escaped."""
    text = "; ".join(line.strip() for line in text.splitlines() if line.strip())
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


@contextlib.contextmanager
def sqlite_errors(path: str, doing: str):
    """Turn SQLite's failures into a JournalError that names the file."""
    try:
        yield
    except FAILURES as e:
        raise JournalError(f"{path}: {doing} failed: {said(e)}") from e


def refuse(path: str, why: str) -> JournalError:
    return JournalError(f"{path} is not a usable journal: {why}. A new journal is created only "
                        f"where no file exists: move this one aside to start afresh")


def check_file(path: str) -> None:
    """Refuse what is plainly not a journal before SQLite opens it (SQLite would take an empty
    file for a new database, and report other damage only at the first read)."""
    try:
        mode = os.stat(path).st_mode
        if stat.S_ISDIR(mode):
            raise refuse(path, "it is a directory")
        if not stat.S_ISREG(mode):
            raise refuse(path, "it is not a regular file")
        with open(path, "rb") as f:
            head = f.read(len(SQLITE_MAGIC))
    except OSError as e:
        raise JournalError(f"{path}: cannot read the journal: "
                           f"{(e.strerror or str(e)).lower()}") from None
    if not head:
        raise refuse(path, "the file is empty (0 bytes; truncated?)")
    if head != SQLITE_MAGIC:
        raise refuse(path, "no SQLite header (overwritten or damaged)")


def writable_folder(path: str) -> bool:
    """Whether the journal's folder takes new files (SQLite's log beside the journal)."""
    folder = os.path.dirname(os.path.abspath(path))
    return not read_only_medium(path) and os.access(folder, os.W_OK | os.X_OK)


def read_only_medium(path: str) -> bool:
    try:
        return bool(os.statvfs(os.path.dirname(os.path.abspath(path))).f_flag & os.ST_RDONLY)
    except OSError:
        return False


def exists(path: str) -> bool:
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


def create_file(path: str) -> None:
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
    if not writable_folder(path):
        raise JournalError(f"{path}: cannot create the journal: {folder} is on a read-only "
                           f"medium or not writable")
    scratch = f"{path}.new-{os.getpid()}"
    for leftover in (scratch, scratch + "-wal", scratch + "-shm", scratch + "-journal"):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(leftover)
    try:
        db = sqlite3.connect(scratch, isolation_level=None)
        try:
            with sqlite_errors(path, "creating the journal"):
                db.execute("PRAGMA journal_mode=WAL")
                db.executescript("BEGIN;" + SCHEMA + "COMMIT;")
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


def check_contents(db: sqlite3.Connection, path: str) -> int:
    """Integrity (quick_check: every page readable and well formed), then the journal's own
    tables and schema version, and the columns that version has; returns the version. Read in
    one transaction: another process bringing the journal to a new schema meanwhile is seen
    wholly or not at all (its version and its columns never from two moments)."""
    own = not db.in_transaction
    try:
        if own:
            db.execute("BEGIN")
        return _check_contents(db, path)
    except FAILURES as e:
        raise refuse(path, f"damaged ({said(e)})") from None
    finally:
        if own and db.in_transaction:           # (it only read: nothing to keep)
            with contextlib.suppress(*FAILURES):
                db.execute("ROLLBACK")


def _check_contents(db: sqlite3.Connection, path: str) -> int:
    try:
        problems = [r[0] for r in db.execute("PRAGMA quick_check").fetchall()]
        tables = {r[0] for r in db.execute(
            "SELECT name FROM sqlite_master WHERE type='table'")}
    except FAILURES as e:
        raise refuse(path, f"damaged ({said(e)})") from None
    if problems != ["ok"]:
        raise refuse(path, "damaged (integrity check: "
                     + "; ".join(one_line(str(p)) for p in problems[:3])
                     + (f"; {len(problems) - 3} more" if len(problems) > 3 else "") + ")")
    if not TABLES <= tables:
        raise refuse(path, "an SQLite file without the journal's tables "
                     f"(missing {', '.join(sorted(TABLES - tables))})")
    schema = schema_in_file(db, path)
    if schema >= 2 and "shared_values" not in tables:
        raise refuse(path, f"a journal of schema {schema} without its shared_values table")
    check_columns(db, path, schema)
    return schema


def schema_in_file(db: sqlite3.Connection, path: str) -> int:
    """The schema version the journal says it has (one this program reads)."""
    with sqlite_errors(path, "reading the schema version"):
        rows = db.execute("SELECT value FROM meta WHERE +key='schema'").fetchall()
    if not rows:
        raise refuse(path, "no schema version recorded")
    if len(rows) > 1:
        raise refuse(path, f"damaged ({len(rows)} schema versions recorded)")
    value = rows[0][0]
    if type(value) is not str:
        raise refuse(path, f"damaged (its schema version is not text: {value!r})")
    if value not in ("1", "2", str(SCHEMA_VERSION)):
        raise JournalError(f"{path} has journal schema {value!r}, this program reads "
                           f"schemas 1 to {SCHEMA_VERSION}")
    return int(value)


def check_columns(db: sqlite3.Connection, path: str, schema: int) -> None:
    """The tables have the columns of `schema`: a version changed by damage (a schema 3
    journal read as 2 would go unchecked) or a damaged table definition is refused."""
    with sqlite_errors(path, "reading the tables' columns"):
        for table, want in COLUMNS[schema].items():
            got = tuple(r[1] for r in db.execute(f"PRAGMA table_info({table})"))
            if got != want:
                raise refuse(path, f"damaged (schema {schema}, but table {table} "
                             f"has columns {', '.join(map(str, got)) or 'none'})")


def upgrade(db: sqlite3.Connection, path: str) -> None:
    """Schema 1 or 2 -> 3 in one transaction: the columns of each version added, every row
    sealed as it is (none refers to a shared value before 2); the index by kind dropped
    (reads do not use it). A second process that opened the same journal meanwhile finds
    it done."""
    with sqlite_errors(path, f"bringing the journal to schema {SCHEMA_VERSION}"):
        db.execute("BEGIN IMMEDIATE")
        try:
            was = schema_in_file(db, path)
            if was == 1:
                db.execute("ALTER TABLE events ADD COLUMN shares INTEGER NOT NULL DEFAULT 0")
                db.execute(SHARED_TABLE)
            if was < 3:
                check_columns(db, path, 2)
                db.execute("ALTER TABLE events ADD COLUMN checksum TEXT NOT NULL DEFAULT ''")
                db.execute("ALTER TABLE intended ADD COLUMN checksum TEXT NOT NULL DEFAULT ''")
                db.execute("DROP INDEX IF EXISTS events_kind")
                _seal_all(db)
                db.execute("UPDATE meta SET value=? WHERE key='schema'", (str(SCHEMA_VERSION),))
            db.execute("COMMIT")
        except BaseException:
            db.execute("ROLLBACK")
            raise
    if was < SCHEMA_VERSION:
        log.info("%s: journal brought from schema %d to %d", path, was, SCHEMA_VERSION)


def _seal_all(db: sqlite3.Connection) -> None:
    """Every row's checksum, from the row as it is (the upgrade to schema 3)."""
    rows = db.execute("SELECT seq, ts, kind, cause, latency_s, details, shares "
                      "FROM events").fetchall()
    db.executemany("UPDATE events SET checksum=? WHERE seq=?",
                   [(event_seal(*row), row[0]) for row in rows])
    rows = db.execute("SELECT rowid, switch, circuits, seq FROM intended").fetchall()
    db.executemany("UPDATE intended SET checksum=? WHERE rowid=?",
                   [(intended_seal(*row[1:]), row[0]) for row in rows])

