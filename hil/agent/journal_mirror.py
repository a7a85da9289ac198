"""A replica's copy of its group's journal on etcd, kept by watch (`JournalMirror`).

Every replica of a group, standing by or leading, reads the journal's keys (its entries, the
intended circuits, the shared values) whole once, then follows them with an etcd watch from the
revision it read them at: a standby is a watch event behind the leader at most, and a replica
that takes the lead reads the journal from memory, not again from etcd.

A read is served from the copy only once the copy holds every write etcd had made to the
journal when the read began: the last entry's and the intended circuits' revisions are asked
of etcd (one linearizable round trip, two keys) and the copy waited for until it has applied
them. A copy that cannot catch up in time (its watch cut, etcd compacted the revisions it
needs) is not used: the read goes to etcd as before, and the copy reads the keys whole again.
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
    range_op,
)

log = logging.getLogger(__name__)

CATCH_UP_S = 1.0            # how long a read waits for the copy before it reads etcd itself


class JournalMirror:
    """The keys under `base` (a group's journal), as etcd has them, kept by a thread of its own
    (see the module). `entries_from(key)`, `get(key)`, `under(prefix)`: what the copy holds, or
    None when it cannot be trusted now. `listeners` are called (on the thread) after each change
    applied."""

    def __init__(self, etcd: Etcd, base: str, entries: str, intended: str):
        self.etcd = etcd
        self.base = base.encode()
        self._entries = entries.encode()            # the entries' key prefix
        self._intended = intended.encode()
        self._kvs: dict[bytes, KV] = {}
        self._entry_keys: list[bytes] = []          # sorted
        self._applied = 0           # every write of the journal up to this revision is in here
        self._from = 0              # the revision to watch from; 0: read the keys whole first
        self._cond = threading.Condition()
        self._stop = threading.Event()
        self._watch: Watch | None = None
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
                                                      self._from, avoid=lost)
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
            except EtcdCompacted as e:
                log.warning("%s: %s; reading the journal whole again", self.base.decode(), e)
                self._from = 0
                self.resyncs += 1
            except EtcdError as e:
                # (a watch silent for a while ends too: asked again from where it was, at once;
                # one cut or refused is asked of another member)
                log.debug("%s: watch: %s", self.base.decode(), e)
                lost = None if isinstance(e, WatchSilent) or self._watch is None \
                    else self._watch.member
                self._stop.wait(quiet)
                quiet = min(1.0, quiet * 2 or 0.05)

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
        """Whether the copy holds every write etcd had made to the journal just now (asked of
        etcd: the last entry's and the intended circuits' revisions), waiting a while for it."""
        ops = [range_op(self._entries, prefix_end(self._entries), limit=1, last_first=True,
                        keys_only=True),
               range_op(self._intended, keys_only=True)]
        try:
            _, answer = self.etcd.txn([], ops)
        except EtcdError:
            return False
        target = 0
        for r in answer.get("responses", ()):
            for kv in r.get("response_range", {}).get("kvs", ()):
                target = max(target, int(kv.get("mod_revision", 0)))
        with self._cond:
            return self._cond.wait_for(lambda: self._applied >= target, CATCH_UP_S)

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
