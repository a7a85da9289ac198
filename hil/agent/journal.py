"""The agent's journal: what a journal does, whatever keeps it (`Journal`), and its entries.

Every decision and every applied configuration is journaled before it is acted on, with the
*intended* circuits of every switch: after a restart the agent reads them back and repairs only
what differs on the hardware, and finishes what was in flight. An entry is a kind, a cause, a
latency and its details, one msgspec Struct per kind (`hil.agent.entries`): what is written
(`record(Swap(...), cause=...)`) is what is read back (`entries()`).

Write-ahead without a sync per entry: an entry recorded `defer=True` is written at once and
made durable with the next entry that must be (the intended circuits before a switch moves, the
restart order before the job hears it, an alarm), or any read of the journal.

`SqliteJournal` (`hil.agent.sqlite_journal`, one host) is the first backend; one on etcd, whose
writes hold only while their writer leads, is the next (docs/design.md, the control plane).
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Protocol

from photonic_testbed.hil.agent.entries import KINDS, Details, words

__all__ = ["KINDS", "MAX_SEQ", "Entry", "Journal", "JournalError", "Listeners"]

log = logging.getLogger(__name__)

MAX_SEQ = 2 ** 63 - 1         # the largest sequence number (SQLite's largest INTEGER)


class JournalError(Exception):
    """The journal cannot be used (missing folder, empty, damaged, not a journal, wrong schema
    version, unreadable, unwritable, an entry that does not read as its kind); the message
    says which and what to do."""


@dataclass(frozen=True)
class Entry:
    """One journal entry: its sequence number, time, kind, cause, latency (seconds, for a
    change), and its details in the type of its kind."""
    seq: int
    ts: float
    kind: str
    cause: str
    latency_s: float | None
    details: Details

    def line(self) -> str:
        """The entry on one line, as a person reads it (`ptb journal`)."""
        stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.ts))
        ms = f"{self.ts % 1:.3f}"[1:]
        latency = f" [{self.latency_s * 1e3:.1f} ms]" if self.latency_s is not None else ""
        cause = f" ({self.cause})" if self.cause else ""
        said = words(self.details)
        return f"{self.seq:6d} {stamp}{ms} {self.kind:<13}{cause}{latency}" + \
            (f"  {said}" if said else "")


class Listeners:
    """The listeners of a journal's entries (both backends'): `listen(fn)`, and `_tell` as an
    entry is written; a listener that fails is logged, never the writer's failure."""
    _listeners: list[Callable[[Entry, str], None]]

    def listen(self, fn: Callable[[Entry, str], None]) -> None:
        """Call `fn(entry, its details as JSON)` for every entry written from now on, in order,
        when it is written (a deferred entry: once `flush` returns). The entry's details are
        the writer's own: take what is needed before returning."""
        self._listeners.append(fn)

    def _tell(self, entry: Entry, text: str) -> None:
        for fn in self._listeners:
            try:
                fn(entry, text)
            except Exception:
                log.exception("%s: a journal listener failed on entry %d",
                              getattr(self, "path", "the journal"), entry.seq)


class Journal(Protocol):
    """What the agent asks of its journal; `SqliteJournal` is one."""

    def record(self, details: Details, cause: str = "", latency_s: float | None = None,
               ts: float | None = None, *, defer: bool = False) -> int:
        """Append an entry of `details`' kind; its sequence number once it is durable (with
        `defer`: once it is written, durable with the next entry that is not deferred)."""
        ...

    def set_intended_many(self, switches: Mapping[str, Iterable[tuple[int, int]]],
                          cause: str, *, event: bool = True) -> int:
        """What each switch is to hold, durably with everything deferred before it, each with
        an `Intent` entry that explains it (unless `event` is false: the caller journals the
        change in its own entry)."""
        ...

    def intended(self) -> dict[str, list[tuple[int, int]]]:
        """Every switch's intended circuits, as last set (checked as `entries` are)."""
        ...

    def entries(self, since: int = 0, kinds: tuple[str, ...] | None = None,
                limit: int | None = None) -> list[Entry]:
        """The entries after `since`, of `kinds` (all by default), oldest first, each exactly
        as written: one that is not (damage) is a JournalError naming it, never another
        value."""
        ...

    def listen(self, fn: Callable[[Entry, str], None]) -> None:
        """Call `fn(entry, its details as JSON)` for every entry written from now on."""
        ...

    def flush(self) -> None:
        """Make the deferred entries durable."""
        ...

    def close(self) -> None:
        ...
