"""Which replica of an agent group leads, decided by etcd (a lease and a transaction), not by a
consensus of ours.

- A replica `campaign`s: with a lease of its own (TTL `ttl_s`), it creates the group's leader
  key under that lease, in one transaction with the group's term counter raised by one, if no
  leader key exists. The term is the epoch every device service fences on (a change of a lower
  term is refused: `StaleTerm`), so a leader's term is above every earlier leader's.
- While it leads, a thread refreshes the lease every third of its TTL. `leading()` is true only
  while the lease is surely alive by this process's own clock: from the moment a refresh was
  sent, the TTL etcd answered, less a margin. A leader paused (SIGSTOP) or cut off past that
  stops acting by itself when it runs again, before etcd has even expired its lease; and every
  journal write is a transaction that holds only under the leader key's lease (`fence`), so a
  deposed leader can write nothing.
- A standby polls the leader key (`leader()` says who leads and where) and campaigns when it is
  gone: when the leader resigned, or etcd expired its lease (TTL after its last refresh).
"""
from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

from photonic_testbed.hil.agent.agent import AgentError
from photonic_testbed.hil.etcd.client import KV, Compare, Etcd, EtcdError, put_op

log = logging.getLogger(__name__)


def _clock() -> float:
    """Seconds that go on while the host is suspended (CLOCK_BOOTTIME where there is one;
    monotonic time stops then, and a leader resumed would believe its lease still alive)."""
    return time.clock_gettime(CLOCK) if CLOCK is not None else time.monotonic()


CLOCK = getattr(time, "CLOCK_BOOTTIME", None)

DEFAULT_TTL_S = 2           # etcd's shortest lease with its default election timeout (1 s)
MARGIN_S = 0.25             # a lease is taken as lapsed this long before its TTL runs out
POLL_S = 0.05               # a standby asks who leads this often
HEALTH_EVERY_S = 2.0        # a leader asks the etcd members how they are this often


class NotLeading(AgentError):
    """This replica does not lead its group (any more): it must not act."""


def group_prefix(group: str) -> str:
    if not group or "/" in group or not group.isprintable():
        raise ValueError(f"an agent group is a name without '/', not {group!r}")
    return f"/ptb/{group}/"


class Leadership:
    """One replica's part in its group's election (see the module's text). `me`: what the
    leader key says of the leader (its name, request and publish endpoints)."""

    def __init__(self, etcd: Etcd, group: str, me: Mapping[str, Any], *,
                 ttl_s: int = DEFAULT_TTL_S, on_lost: Callable[[str], None] | None = None):
        self.etcd = etcd
        self.prefix = group_prefix(group)
        self.group = group
        self.me = dict(me)
        self.ttl_s = int(ttl_s)
        self.on_lost = on_lost
        self.key = self.prefix + "leader"
        self.term_key = self.prefix + "term"
        self.lease = 0
        self.term = 0
        self._alive_until = 0.0          # monotonic: the lease is surely alive until then
        self._stop = threading.Event()
        self._keeper: threading.Thread | None = None
        self.lost_because = ""
        # each etcd member's word on its health, asked every HEALTH_EVERY_S while leading
        self.members: dict[str, str] = {}

    # --- who leads ------------------------------------------------------------------------
    def leader(self, timeout: float | None = None) -> dict | None:
        """The leader key's word (name, request, publish, term), None when no one leads."""
        kv = self.etcd.get(self.key, timeout=timeout)
        if kv is None:
            return None
        try:
            return json.loads(kv.value)
        except ValueError:
            return {"name": "?", "raw": kv.value.decode(errors="replace")}

    def leading(self) -> bool:
        return self.lease != 0 and not self._stop.is_set() and \
            _clock() < self._alive_until

    def check(self) -> int:
        """NotLeading unless this replica surely leads now; the lease it leads under."""
        lease = self.lease
        if not lease or not self.leading():
            if not self._stop.is_set() and lease:
                self.lose("its lease has surely lapsed by this process's clock")
            raise NotLeading(f"agent {self.me.get('name')} no longer leads group {self.group}"
                             + (f": {self.lost_because}" if self.lost_because else ""))
        return lease

    def fence(self, lease: int) -> dict:
        """The condition of every write of this leader: its key is held under `lease` (the
        one `check` returned: never 0, which etcd would take as "no key")."""
        if not lease:
            raise NotLeading(f"agent {self.me.get('name')} holds no lease")
        return Compare.lease(self.key, lease)

    # --- campaigning ----------------------------------------------------------------------
    def campaign(self, stop: threading.Event, on_standby: Callable[[dict | None], None]
                 | None = None) -> int:
        """Until this replica leads (its term) or `stop` is set (0). `on_standby(leader)`
        each time the leader seen changes while waiting. etcd unreachable is waited out."""
        seen: Any = object()
        while not stop.is_set():
            try:
                term = self._try()
                if term:
                    return term
                who = self.leader()
            except EtcdError as e:
                log.warning("group %s: etcd: %s", self.group, e)
                who = None
                stop.wait(0.5)
            if who != seen:
                seen = who
                if on_standby is not None:
                    on_standby(who)
            stop.wait(POLL_S)
        return 0

    def _try(self) -> int:
        """One attempt to lead: the term won, or 0 (someone leads)."""
        kv = self.etcd.get(self.key)
        if kv is not None:
            return 0
        counter = self.etcd.get(self.term_key)
        term = self._term_in(counter) + 1
        self.lease, _ = self.etcd.grant(self.ttl_s)
        me = {**self.me, "term": term}
        try:
            won, _ = self.etcd.txn(
                [Compare.absent(self.key),
                 Compare.mod(self.term_key, counter.mod_revision if counter else 0)],
                [put_op(self.key, json.dumps(me), self.lease),
                 put_op(self.term_key, str(term))])
        except EtcdError:
            won = False
        if not won:                     # another replica was quicker
            self._let_go()
            return 0
        sent = _clock()
        try:
            ttl = self.etcd.keepalive(self.lease)
        except EtcdError:
            ttl = 0
        if ttl <= 0:                    # won, but the lease cannot be kept: let it go
            self._let_go()
            return 0
        self._alive_until = sent + ttl - MARGIN_S
        self.term = term
        self.lost_because = ""
        self._stop = threading.Event()  # this term's own: an older keeper cannot end it
        self._keeper = threading.Thread(target=self._keep, args=(self._stop, self.lease),
                                        name=f"lease-{self.group}", daemon=True)
        self._keeper.start()
        threading.Thread(target=self._watch_members, args=(self._stop,),
                         name=f"etcd-health-{self.group}", daemon=True).start()
        log.info("agent %s leads group %s, term %d", self.me.get("name"), self.group, term)
        return term

    def _let_go(self) -> None:
        """The lease revoked (its key goes with it), or left to lapse when etcd cannot be
        told."""
        lease, self.lease = self.lease, 0
        if lease:
            try:
                self.etcd.revoke(lease, timeout=1.0)
            except EtcdError as e:
                log.warning("group %s: the lease was not revoked (%s): it lapses by itself",
                            self.group, e)

    def _term_in(self, kv: KV | None) -> int:
        """The group's term counter as etcd holds it (0: none yet); EtcdError when it is not a
        whole number (someone else wrote the key): no replica leads on a guess."""
        if kv is None:
            return 0
        try:
            return int(kv.value)
        except ValueError:
            raise EtcdError(f"the term counter {self.term_key} holds "
                            f"{kv.value[:40]!r}, not a number: fix or delete the key "
                            "(etcdctl) for the group to elect a leader") from None

    def _keep(self, stop: threading.Event, lease: int) -> None:
        """Refresh `lease` every third of its TTL until `stop` (its term's); on a refusal (the
        lease is gone) or once it has surely lapsed, leadership is lost (`on_lost`)."""
        while not stop.wait(self.ttl_s / 3):
            sent = _clock()
            try:
                ttl = self.etcd.keepalive(lease, timeout=max(0.2, self._alive_until - sent))
            except EtcdError as e:
                if _clock() >= self._alive_until and not stop.is_set():
                    self.lose(f"its lease could not be refreshed before it lapsed ({e})")
                    return
                continue
            if stop.is_set():
                return
            if ttl <= 0:
                self.lose("etcd says its lease has expired")
                return
            if _clock() - sent < ttl - MARGIN_S:
                self._alive_until = sent + ttl - MARGIN_S
            if _clock() >= self._alive_until:
                self.lose("its lease lapsed while it was not running")
                return

    def _watch_members(self, stop: threading.Event) -> None:
        """Each member's health (`members`), asked on a thread of its own (a member that hangs
        delays no refresh of the lease), until this term's `stop`."""
        while True:
            self.members = self.etcd.health(timeout=0.5)
            if stop.wait(HEALTH_EVERY_S):
                return

    def lose(self, why: str) -> None:
        """This replica no longer leads (`why`): it acts no more; `on_lost` is told."""
        if self._stop.is_set():
            return
        self.lost_because = why
        self._alive_until = 0.0
        self._stop.set()
        log.error("agent %s lost the lead of group %s: %s", self.me.get("name"), self.group,
                  why)
        if self.on_lost is not None:
            self.on_lost(why)

    def raise_term(self, at_least: int) -> None:
        """The group's term counter raised to `at_least` if it is below (compare-and-set: a
        campaigner meanwhile keeps its own)."""
        kv = self.etcd.get(self.term_key)
        now = self._term_in(kv)
        if now < at_least:
            self.etcd.txn([Compare.mod(self.term_key, kv.mod_revision if kv else 0)],
                          [put_op(self.term_key, str(at_least))])

    def resign(self) -> None:
        """Stop leading: the lease revoked (its key goes with it), so a standby takes over at
        once rather than after the TTL."""
        self._stop.set()
        self._alive_until = 0.0
        if self._keeper is not None and self._keeper is not threading.current_thread():
            self._keeper.join(2)
        self._let_go()
