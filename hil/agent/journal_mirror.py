"""A replica's copy of its group's journal on etcd, kept by watch (`JournalMirror`).

Every replica of a group, standing by or leading, reads the journal's keys (its entries, the
intended circuits, the shared values) whole once, then follows them with an etcd watch from the
revision it read them at: a standby is a watch event behind the leader at most, and a replica
that takes the lead reads the journal from memory, not again from etcd.

A read is served from the copy only once the copy holds every write etcd had made to the
journal when the read began: every journal write (one transaction of the leader's) also puts the
journal's `head` key, so the copy has caught up when it holds the `head` etcd holds (asked
linearizably, one key; waited for a while). A copy that does not catch up in time has its watch
moved to another member, and the read goes to etcd as before; so does one of a journal without a
`head` (written before it had one, or wiped: a journal is written by its leader alone, and wiped
only with every replica stopped). A watch silent for a while is checked the same way: the
journal idle, it is asked again from the store's revision (so that an idle group is not sent
back to revisions etcd has compacted meanwhile); the journal moved on without it, its member is
left.
"""
from __future__ import annotations

import bisect
import logging
import threading
from collections.abc import Callable

from photonic_testbed.hil.etcd.client import (
    KV,
    Etcd,
    EtcdCompacted,
    EtcdError,
    Watch,
    WatchSilent,
    prefix_end,
)

log = logging.getLogger(__name__)

CATCH_UP_S = 1.0            # how long a read waits for the copy before it reads etcd itself
SILENT_S = 10.0             # a watch this long without a word is checked (module text)


class JournalMirror:
    """The keys under `base` (a group's journal), as etcd has them, kept by a thread of its own
    (see the module). `entries_from(key)`, `get(key)`, `under(prefix)`: what the copy holds, or
    None when it cannot be trusted now. `listeners` are called (on the thread) after each change
    applied."""

    def __init__(self, etcd: Etcd, base: str, entries: str, head: str):
        self.etcd = etcd
        self.base = base.encode()
        self._entries = entries.encode()            # the entries' key prefix
        self._head = head.encode()
        self._kvs: dict[bytes, KV] = {}
        self._entry_keys: list[bytes] = []          # sorted
        self._applied = 0           # every write of the journal up to this revision is in here
        self._from = 0              # the revision to watch from; 0: read the keys whole first
        self._cond = threading.Condition()
        self._stop = threading.Event()
        self._watch: Watch | None = None
        self._suspected: Watch | None = None        # a watch a reader found behind
        self.listeners: list[Callable[[], None]] = []
        self.resyncs = 0                            # whole reads after the first
        self._thread = threading.Thread(target=self._follow, name="journal-mirror",
                                        daemon=True)
        self._thread.start()

    # --- following ------------------------------------------------------------------------
    def _follow(self) -> None:
        quiet = 0.0
        lost: tuple[str, int] | None = None         # the member whose watch failed last
        while not self._stop.is_set():
            try:
                if not self._from:
                    kvs, revision = self.etcd.range(self.base, prefix_end(self.base),
                                                    timeout=max(self.etcd.timeout, 10.0))
                    with self._cond:
                        self._kvs = {kv.key: kv for kv in kvs}
                        self._entry_keys = sorted(k for k in self._kvs
                                                  if k.startswith(self._entries))
                        self._applied = revision
                        self._cond.notify_all()
                    self._from = revision + 1
                    self._told()
                watch = self._watch = self.etcd.watch(self.base, prefix_end(self.base),
                                                      self._from, avoid=lost,
                                                      silent_s=SILENT_S)
                lost = None
                if self._stop.is_set():
                    break
                for _, events in watch:
                    quiet = 0.0
                    with self._cond:
                        for e in events:
                            self._apply(e.kv, e.deleted)
                            self._from = max(self._from, e.kv.mod_revision + 1)
                        self._applied = max(self._applied, self._from - 1)
                        self._cond.notify_all()
                    if events:
                        self._told()
                if self._suspected is watch:
                    lost = watch.member
            except EtcdCompacted as e:
                log.warning("%s: %s; reading the journal whole again", self.base.decode(), e)
                self._from = 0
                self.resyncs += 1
            except WatchSilent as e:
                lost = self._idle_or_lost(e)
            except EtcdError as e:
                # a watch cut or refused: asked again of another member
                log.debug("%s: watch: %s", self.base.decode(), e)
                lost = self._watch.member if self._watch is not None else None
                self._stop.wait(quiet)
                quiet = min(1.0, quiet * 2 or 0.05)

    def _idle_or_lost(self, silent: WatchSilent) -> tuple[str, int] | None:
        """A silent watch (see the module): the member to leave, or None (the journal is idle:
        watched again from the store's revision)."""
        member = self._watch.member if self._watch is not None else None
        try:
            kvs, revision = self.etcd.range(self._head)
        except EtcdError as e:
            log.debug("%s: %s; and etcd: %s", self.base.decode(), silent, e)
            return member
        with self._cond:
            held = self._kvs.get(self._head)
            if kvs and held is not None and held.mod_revision == kvs[0].mod_revision:
                self._from = max(self._from, revision + 1)
                self._applied = max(self._applied, revision)
                return None
        if not kvs:
            return None                             # (no head: as it was)
        log.info("%s: the watch on %s fell behind; asking another member",
                 self.base.decode(), member)
        return member

    def _apply(self, kv: KV, deleted: bool) -> None:
        is_entry = kv.key.startswith(self._entries)
        if deleted:
            if self._kvs.pop(kv.key, None) is not None and is_entry:
                i = bisect.bisect_left(self._entry_keys, kv.key)
                if i < len(self._entry_keys) and self._entry_keys[i] == kv.key:
                    del self._entry_keys[i]
            return
        if kv.key not in self._kvs and is_entry:
            if not self._entry_keys or kv.key > self._entry_keys[-1]:
                self._entry_keys.append(kv.key)
            else:
                bisect.insort(self._entry_keys, kv.key)
        self._kvs[kv.key] = kv

    def _told(self) -> None:
        for listener in list(self.listeners):
            try:
                listener()
            except Exception:           # (a listener's failure is its own)
                log.exception("journal mirror listener")

    # --- reading --------------------------------------------------------------------------
    def _caught_up(self) -> bool:
        """Whether the copy holds every write etcd had made to the journal just now (its
        `head`, asked of etcd), waiting a while for it (see the module); never once stopped."""
        if self._stop.is_set():
            return False
        try:
            kvs, _ = self.etcd.range(self._head, keys_only=True)
        except EtcdError:
            return False
        if not kvs:
            return False
        target = kvs[0].mod_revision
        with self._cond:
            if self._cond.wait_for(lambda: (held := self._kvs.get(self._head)) is not None
                                   and held.mod_revision >= target, CATCH_UP_S):
                return True
            watch = self._watch
        if watch is not None:                       # behind: its member is left
            self._suspected = watch
            watch.close()
        return False

    def entries_from(self, key: bytes) -> list[KV] | None:
        """The entries from `key` on, in order; None: read etcd."""
        if not self._caught_up():
            return None
        with self._cond:
            i = bisect.bisect_left(self._entry_keys, key)
            return [self._kvs[k] for k in self._entry_keys[i:]]

    def get(self, key: str) -> tuple[KV | None] | None:
        """(`key` as the copy holds it, or None) ; None: read etcd."""
        if not self._caught_up():
            return None
        with self._cond:
            return (self._kvs.get(key.encode()),)

    def under(self, prefix: str) -> list[KV] | None:
        """Every key under `prefix`; None: read etcd."""
        if not self._caught_up():
            return None
        p = prefix.encode()
        with self._cond:
            return [kv for k, kv in self._kvs.items() if k.startswith(p)]

    def close(self) -> None:
        self._stop.set()
        if self._watch is not None:
            self._watch.close()
        self._thread.join(5)
