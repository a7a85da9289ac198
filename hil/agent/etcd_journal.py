"""The agent's journal on etcd (`EtcdJournal`, a `Journal` of hil.agent.journal): the same
entries as the SQLite file, kept by a replicated store, written only by the group's leader.

Keys, under the group's prefix (`/ptb/GROUP/`):

- `journal/head`: `SEQ:NAME`, the last entry's sequence number and a name of the write, put by
  every write, which is conditioned on it (a write applies once or never: `EtcdJournal._write`);
  its revision says when the journal last changed (what a replica's copy waits for,
  hil.agent.journal_mirror);
- `journal/e/SEQ` (SEQ in 20 digits, so that keys sort as numbers): one entry, JSON of its time,
  kind, cause, latency and details (its kind's Struct as JSON, as written);
- `journal/intended`: every switch's intended circuits and the entry that set them, one value
  (a phase switch on 64 OCSes writes one key, not 64);
- `journal/shared/DIGEST`: a long list kept once (as the SQLite file keeps it: an entry whose
  details run past `SHARE_ABOVE` characters has each list of `SHARED_ITEMS` or more items
  stored under its digest and referred to by it, and so has a switch's intended circuits), so
  that a phase switch of 64 OCSes, whose lists come back round after round, writes a few KB
  rather than its whole 100 KB to the cluster. A shared value is checked against its digest
  when read.

Every write is one etcd transaction conditioned on the writer's lease still holding the group's
leader key (`Leadership.fence`): a replica that no longer leads (deposed, paused past its
lease, cut off) writes nothing, and its write fails with `NotLeading`. An entry recorded
`defer=True` is kept in the process and written with the next entry that must be durable, in
the same transaction (the intended circuits before a switch moves, an alarm, a restart order),
or at any read: the same promise as the file's, one round trip to the cluster per durable
write. Sequence numbers are the leader's: it reads the last one when it takes the lead, and no
one else writes.

etcd keeps its own checksums (its WAL and database pages are checked) and answers a read from
the majority's log: what is read back is what was written. An entry that does not read as its
kind is a JournalError naming it, never another value.
"""
from __future__ import annotations

import json
import logging
import secrets
import threading
import time
from collections.abc import Callable, Iterable, Mapping

import msgspec
import orjson

from photonic_testbed.hil.agent.entries import Details, Intent, Unread, decode
from photonic_testbed.hil.agent.journal import MAX_SEQ, Entry, JournalError, Listeners
from photonic_testbed.hil.agent.journal_mirror import JournalMirror
from photonic_testbed.hil.agent.leadership import Leadership, NotLeading
from photonic_testbed.hil.agent.sqlite_journal import (
    SHARE_ABOVE,
    SHARED,
    SHARED_ITEMS,
    Unshareable,
    digest_of,
    references,
    resolved,
    shared_form,
)
from photonic_testbed.hil.etcd.client import (
    KV,
    Compare,
    Etcd,
    EtcdError,
    EtcdUnavailable,
    prefix_end,
    put_op,
)

log = logging.getLogger(__name__)

SEQ_DIGITS = 20


def parse_url(url: str) -> tuple[str, str]:
    """`etcd://HOST:PORT[,HOST:PORT...]/GROUP` as (members, group); ValueError saying what is
    wrong."""
    if not url.startswith("etcd://"):
        raise ValueError(f"an etcd journal is etcd://HOST:PORT[,HOST:PORT...]/GROUP, not {url!r}")
    members, sep, group = url[len("etcd://"):].partition("/")
    if not sep or not group or "/" in group:
        raise ValueError(f"{url!r}: name the agent group after the members: "
                         "etcd://HOST:PORT[,...]/GROUP")
    return members, group


class EtcdJournal(Listeners):
    """The journal of agent group `leadership.group` on etcd (see the module's text). Reads work
    for any replica; writes only while `leadership` leads."""

    def __init__(self, etcd: Etcd, leadership: Leadership, *, follow: bool = False,
                 mirror: JournalMirror | None = None):
        """`follow` (a replica's journal): the journal is copied and followed by watch
        (`JournalMirror`), and read from the copy once it has caught up; `mirror`: that copy,
        another journal's (`reader`)."""
        self.etcd = etcd
        self.leadership = leadership
        self.path = f"etcd://{','.join(f'{h}:{p}' for h, p in etcd.members)}/" \
            f"{leadership.group}"
        base = leadership.prefix + "journal/"
        self._entries = base + "e/"
        self._intended = base + "intended"
        self._head = base + "head"          # the last entry's seq, put by every write
        # every switch's row of `intended` as etcd holds it (the leader's: None until read)
        self._rows: dict[str, dict] | None = None
        self._shared = base + "shared/"
        self._stored: set[str] = set()          # digests known to be in etcd
        self._storing: set[str] = set()         # ... written with the pending transaction
        self._texts: dict[str, str] = {}        # digest -> its list as JSON, read and checked
        self._lock = threading.RLock()
        self._pending: list[dict] = []          # deferred puts, written with the next durable
        self._told: list[tuple[Entry, str]] = []
        self._next_seq: int | None = None
        self._head_rev: int | None = None       # the head's revision as this replica wrote it
        self._listeners: list[Callable[[Entry, str], None]] = []
        self.mirror = mirror if mirror is not None else \
            JournalMirror(etcd, base, self._entries, self._head) if follow else None
        self._owns_mirror = mirror is None
        # key -> (its revision, the entry; or its kind alone, not decoded yet)
        self._decoded: dict[bytes, tuple[int, Entry | str]] = {}

    def __enter__(self) -> EtcdJournal:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _key(self, seq: int) -> str:
        return f"{self._entries}{seq:0{SEQ_DIGITS}d}"

    def _seq(self) -> int:
        """The next sequence number: one past the last entry's (asked of etcd once: the head,
        or in a journal written before it had one, the last entry's key)."""
        if self._next_seq is None:
            try:
                head = self.etcd.get(self._head)
                self._head_rev = head.mod_revision if head is not None else 0
                seq = head.value.split(b":")[0] if head is not None else b""
                if seq.isdigit():
                    self._next_seq = int(seq) + 1
                    return self._next_seq
                kvs, _ = self.etcd.range(self._entries, prefix_end(self._entries), limit=1,
                                         last_first=True, keys_only=True)
            except EtcdError as e:
                raise JournalError(f"{self.path}: reading the last entry: {e}") from None
            self._next_seq = (int(kvs[0].key[len(self._entries):]) + 1) if kvs else 1
        return self._next_seq

    # --- writing --------------------------------------------------------------------------
    def record(self, details: Details, cause: str = "", latency_s: float | None = None,
               ts: float | None = None, *, defer: bool = False) -> int:
        if not details.kind or isinstance(details, Unread):
            raise ValueError(f"{type(details).__name__} is not a kind of journal entry")
        text = msgspec.json.encode(details).decode()
        ts = time.time() if ts is None else float(ts)
        if latency_s is not None and latency_s != latency_s:
            latency_s = None
        with self._lock:
            seq = self._add(ts, details.kind, cause, latency_s, text, details)
            if not defer:
                self._write([])
            return seq

    def _share(self, digest: str, body: bytes) -> None:
        """A shared value written with the pending transaction, unless etcd has it."""
        if digest not in self._stored and digest not in self._storing:
            self._pending.append(put_op(self._shared + digest, body))
            self._storing.add(digest)

    def _add(self, ts: float, kind: str, cause: str, latency_s: float | None, text: str,
             typed: Details) -> int:
        seq = self._seq()
        row: dict = {"ts": ts, "kind": kind, "cause": cause, "latency_s": latency_s,
                     "details": orjson.Fragment(text)}
        if len(text) > SHARE_ABOVE:
            try:
                form, values = shared_form(msgspec.to_builtins(typed))
            except Unshareable:
                values = {}
            if values:
                for digest, value in values.items():
                    self._share(digest, value)
                row.update(details=orjson.Fragment(form), shares=True)
        body = orjson.dumps(row)
        self._pending.append(put_op(self._key(seq), body))
        self._next_seq = seq + 1
        self._told.append((Entry(seq, ts, kind, cause, latency_s, typed), text))
        return seq

    def _write(self, more: list[dict]) -> None:
        """Everything pending and `more` in one transaction held by the leader's lease and
        conditioned on the journal's head being the one this replica last wrote (or read); the
        listeners told once it is written. On failure nothing pending was written: it is
        dropped (its effect never left this process) and the failure named.

        The head's condition makes a write apply once or never: the same transaction asked of
        another member after a timeout, or sent late by a member that was stopped with it, finds
        the head moved and does nothing (the head names each write: a write that finds the head
        moved to its own name was written, by its first attempt)."""
        ops, self._pending = self._pending + more, []
        told, self._told = self._told, []
        storing, self._storing = self._storing, set()
        if not ops:
            return
        try:
            seq = self._seq() - 1
            head = f"{seq}:{secrets.token_hex(8)}"      # (what a copy waits for: module text)
            ops.append(put_op(self._head, head))
            lease = self.leadership.check()
            won, answer = self.etcd.txn([self.leadership.fence(lease),
                                         Compare.mod(self._head, self._head_rev or 0)], ops)
            if won:
                self._head_rev = Etcd.revision_of(answer)
            else:
                now = self.etcd.get(self._head)
                won = now is not None and now.value.decode(errors="replace") == head
                if won and now is not None:
                    self._head_rev = now.mod_revision
        except NotLeading:
            self._forget()
            raise
        except EtcdUnavailable as e:
            # The outcome is unknown (the transaction may have committed after the timeout):
            # this replica steps down, so that the next leader works from what etcd holds.
            self._forget()
            self.leadership.lose(f"a journal write's outcome is unknown ({e})")
            raise NotLeading(f"agent {self.leadership.me.get('name')} stepped down from the "
                             f"lead of group {self.leadership.group}: a journal write of "
                             f"{len(told)} entries may or may not have been written ({e}); "
                             "the next leader reads what was") from None
        except EtcdError as e:         # refused (too big, ...): known not written
            self._forget()
            self._rows = None
            raise JournalError(f"{self.path}: etcd refused a write of {len(told)} entries "
                               f"(nothing of it written): {e}") from None
        if not won:
            self._forget()
            self.leadership.lose("its journal write was refused: its lease no longer holds "
                                 "the leader key, or another wrote the journal")
            self.leadership.check()        # (says so)
        self._stored |= storing
        for entry, text in told:
            self._tell(entry, text)

    def _forget(self) -> None:
        """What this replica knew of the journal's end, read again at its next write."""
        self._next_seq = self._head_rev = None

    def flush(self) -> None:
        with self._lock:
            self._write([])

    def set_intended(self, switch: str, circuits: list[tuple[int, int]], cause: str, *,
                     event: bool = True) -> int:
        return self.set_intended_many({switch: circuits}, cause, event=event)

    def set_intended_many(self, switches: Mapping[str, Iterable[tuple[int, int]]], cause: str,
                          *, event: bool = True) -> int:
        rows = {name: sorted((int(a), int(b)) for a, b in circuits)
                for name, circuits in switches.items()}
        with self._lock:
            held = dict(self._read_rows()) if self._rows is None else dict(self._rows)
            seq = None
            for name, pairs in rows.items():
                if event:
                    details = Intent(switch=name, circuits=pairs)
                    seq = self._add(time.time(), "decision", cause, None,
                                    msgspec.json.encode(details).decode(), details)
                elif seq is None:
                    seq = self._seq() - 1
                value: dict = {"circuits": pairs, "seq": seq}
                if len(pairs) >= SHARED_ITEMS:
                    body = orjson.dumps(pairs)
                    value = {"circuits": {SHARED: digest_of(body)}, "seq": seq}
                    self._share(digest_of(body), body)
                held[name] = value
            self._rows = None                   # (known again once written)
            self._write([put_op(self._intended, json.dumps(held, sort_keys=True))])
            self._rows = held
            return seq if seq is not None else 0

    def _read_rows(self) -> dict[str, dict]:
        """The intended circuits' rows as etcd holds them (a switch's circuits a list, or a
        shared value's reference)."""
        copied = self.mirror.get(self._intended) if self.mirror is not None else None
        try:
            kv = copied[0] if copied is not None else self.etcd.get(self._intended)
        except EtcdError as e:
            raise JournalError(f"{self.path}: reading the intended circuits: {e}") from None
        if kv is None:
            return {}
        try:
            rows = orjson.loads(kv.value)
        except orjson.JSONDecodeError as e:
            raise JournalError(f"{self.path}: the intended circuits are not JSON: {e}") from None
        if not isinstance(rows, dict) or not all(isinstance(r, dict) for r in rows.values()):
            raise JournalError(f"{self.path}: the intended circuits are not a table of "
                               "switches")
        return rows

    # --- reading --------------------------------------------------------------------------
    def intended(self) -> dict[str, list[tuple[int, int]]]:
        with self._lock:
            if self._pending and self.leadership.leading():
                self._write([])
            rows = self._read_rows()
        out: dict[str, list[tuple[int, int]]] = {}
        refs: set[str] = set()
        for got in rows.values():
            references(got, refs)
        texts = self._shared_texts(refs)
        for name, got in rows.items():
            try:
                got = resolved(got, texts)
                pairs = msgspec.convert(got["circuits"], list[tuple[int, int]])
            except (msgspec.ValidationError, TypeError, KeyError) as e:
                raise JournalError(f"{self.path}: the intended circuits of switch {name!r} "
                                   f"are not a list of circuits ({e})") from None
            if len({i for i, _ in pairs}) != len(pairs):
                raise JournalError(f"{self.path}: the intended circuits of switch {name!r} "
                                   "name an input twice")
            out[name] = pairs
        return out

    def entries(self, since: int = 0, kinds: tuple[str, ...] | None = None,
                limit: int | None = None) -> list[Entry]:
        if not isinstance(since, int) or not 0 <= since <= MAX_SEQ:
            raise ValueError(f"since is a sequence number 0..{MAX_SEQ}, not {since!r}")
        if limit is not None and (not isinstance(limit, int) or not 0 <= limit <= MAX_SEQ):
            raise ValueError(f"limit is a count 0..{MAX_SEQ}, not {limit!r}")
        if limit == 0:
            return []
        with self._lock:
            if self._pending and self.leadership.leading():
                self._write([])
            first = self._key(since + 1)
            kvs = self.mirror.entries_from(first.encode()) if self.mirror is not None else None
            try:
                if kvs is None:
                    kvs, _ = self.etcd.range(first, prefix_end(self._entries),
                                             timeout=max(self.etcd.timeout, 10.0))
            except EtcdError as e:
                raise JournalError(f"{self.path}: reading the entries: {e}") from None
        out: list[Entry | tuple[int, dict, KV]] = []
        refs: set[str] = set()
        for kv in kvs:
            known = self._decoded.get(kv.key)
            if known is not None and known[0] == kv.mod_revision:
                if isinstance(known[1], Entry):
                    if not kinds or known[1].kind in kinds:
                        out.append(known[1])
                    continue
                if kinds and known[1] not in kinds:
                    continue            # (an entry of another kind, not decoded yet)
            seq = int(kv.key[len(self._entries):])
            try:
                row = orjson.loads(kv.value)
            except orjson.JSONDecodeError as e:
                raise JournalError(f"{self.path}: entry {seq} is not JSON: {e}") from None
            if kinds and row.get("kind") not in kinds:
                if self.mirror is not None:
                    self._decoded[kv.key] = (kv.mod_revision, str(row.get("kind")))
                continue
            if row.get("shares"):
                references(row.get("details"), refs)
            out.append((seq, row, kv))
        texts = self._shared_texts(refs)
        read = []
        for got in out:
            read.append(got if isinstance(got, Entry) else self._entry(*got, texts))
            if limit is not None and len(read) >= limit:
                break
        return read

    def _entry(self, seq: int, row: dict, kv: KV, texts: dict[str, str]) -> Entry:
        """Entry `seq` as etcd holds it (`row`, read from `kv`), its shared values `texts`;
        kept decoded (an entry is written once) while the journal is followed."""
        try:
            kind = row["kind"]
            typed = decode(kind, resolved(row["details"], texts) if row.get("shares")
                           else row["details"])
            entry = Entry(seq, float(row["ts"]), kind, str(row["cause"]), row["latency_s"],
                          typed)
        except (orjson.JSONDecodeError, KeyError, TypeError, ValueError,
                msgspec.ValidationError) as e:
            raise JournalError(f"{self.path}: entry {seq} does not read as a journal "
                               f"entry: {e}") from None
        if self.mirror is not None:
            self._decoded[kv.key] = (kv.mod_revision, entry)
        return entry

    def _shared_texts(self, digests: set[str]) -> dict[str, str]:
        """The shared values of `digests` (read once, kept: a value is its digest's for
        good), each checked against its digest; JournalError for one missing or damaged."""
        missing = digests - self._texts.keys()
        if missing:
            copied = self.mirror.under(self._shared) if self.mirror is not None else None
            try:
                kvs = copied if copied is not None else \
                    self.etcd.prefix(self._shared, timeout=max(self.etcd.timeout, 10.0))[0]
            except EtcdError as e:
                raise JournalError(f"{self.path}: reading the shared values: {e}") from None
            for kv in kvs:
                digest = kv.key[len(self._shared):].decode(errors="replace")
                if digest in self._texts:
                    continue
                if digest_of(kv.value) != digest:
                    raise JournalError(f"{self.path}: damaged: the shared value {digest} does "
                                       "not match its digest")
                self._texts[digest] = kv.value.decode()
                self._stored.add(digest)
            gone = sorted(missing - self._texts.keys())
            if gone:
                raise JournalError(f"{self.path}: entries refer to shared values etcd does not "
                                   f"hold: {', '.join(gone[:3])}")
        return {d: self._texts[d] for d in digests}

    def stop_following(self) -> None:
        """Read etcd from now on, and drop the copy (a replica that leads: see `started` in
        hil.agent.bus)."""
        with self._lock:
            mirror, self.mirror = self.mirror, None
        if mirror is not None and self._owns_mirror:
            mirror.close()

    def reader(self) -> EtcdJournal:
        """The same journal to read from another thread: it never writes (a read of this one
        writes its leader's deferred entries first), its copy this one's."""
        reader = EtcdJournal(self.etcd, Leadership(
            self.etcd, self.leadership.group,
            {"name": f"{self.leadership.me.get('name')} (reader)"}), mirror=self.mirror)
        reader._decoded, reader._texts = self._decoded, self._texts    # (read once, for both)
        return reader

    def close(self) -> None:
        if self.mirror is not None and self._owns_mirror:
            self.mirror.close()
        with self._lock:
            if self._pending and self.leadership.leading():
                try:
                    self._write([])
                except (JournalError, NotLeading) as e:
                    log.warning("%s: deferred entries not written at close: %s", self.path, e)
            self._pending, self._told = [], []

