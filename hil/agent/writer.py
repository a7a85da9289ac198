"""The switches as the agent writes them: each job's part of every switch, and their union.

Several jobs share a switch: each holds its own part (its circuits), and the switch is told the
union of the parts. A job's change rewrites its own part only, so it never moves another job's
circuits. Every change is journaled before it is made (write-ahead: the intended circuits of
each switch that changes, in one sync), then written to the switches, different switches at
once (an OCS moving its mirrors does not wait for another), and what each switch reports is
journaled. `reconcile` reads every switch back and repairs only what differs from the
journal's intended circuits.
"""
from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from photonic_testbed.common.rack_layout import RackLayout
from photonic_testbed.drivers.circuit_switch import (
    ApplyReport,
    Circuits,
    CircuitSwitch,
    SwitchError,
)
from photonic_testbed.hil.agent import policies
from photonic_testbed.hil.agent.entries import (
    Alarm,
    Applied,
    Details,
    Reconcile,
    SwitchReport,
)
from photonic_testbed.hil.agent.jobs import AgentError
from photonic_testbed.hil.agent.journal import Journal
from photonic_testbed.hil.agent.policies import Targets

log = logging.getLogger(__name__)

Took = dict[str, tuple[ApplyReport, float]]     # switch -> (its report, seconds)
Written = tuple[ApplyReport, float] | SwitchError    # what writing one switch gave


class SwitchWriter:
    """Each job's part of every switch, the union written, the intended circuits journaled
    first, writes to different switches at once, their reports, and reconciliation."""

    def __init__(self, layout: RackLayout, switches: Mapping[str, CircuitSwitch],
                 journal: Journal, clock: Callable[[], float],
                 alarm: Callable[[str, Alarm], None]):
        self.layout = layout
        self.switches = dict(switches)
        self.journal = journal
        self.clock = clock
        self.alarm = alarm
        self._held: dict[str, dict[str, Circuits]] = {s: {} for s in layout.switches}
        self._current: dict[str, Circuits] = {}      # what each switch holds, as last known
        self._owned: set[str] = set()       # switches the journal holds intended circuits of
        self._pool: ThreadPoolExecutor | None = None     # writes to several switches at once

    # --- what the switches hold -------------------------------------------------------------
    def current(self, switch: str) -> Circuits:
        """The circuits `switch` holds, as last known (empty if unknown); not to be changed."""
        return self._current.get(switch, {})

    def hold(self, job: str, targets: Targets) -> None:
        """`job`'s part of each switch is `targets`, already written (read from the journal)."""
        for s, c in targets.items():
            self._held.setdefault(s, {})[job] = dict(c)

    def drop(self, job: str) -> None:
        """`job` holds no part of any switch any more."""
        for parts in self._held.values():
            parts.pop(job, None)

    def drop_all(self) -> None:
        self._held = {s: {} for s in self.layout.switches}

    # --- writing ----------------------------------------------------------------------------
    def apply(self, job: str, targets: Targets, cause: str, record: bool = True,
              decisions: Sequence[Details] = ()) -> Took:
        """Make `job`'s part of every switch `targets`, leaving every other job's part alone:
        journal, then apply, every switch whose circuits (the union of the jobs' parts) differ;
        {switch: (its report, seconds)}. With record=False the caller journals the change and
        its outcome in its own entry (phase rails: one entry per phase switch), with
        `reported`, once the job has its grant. `decisions`: journaled first, durable with
        the intended circuits (the one sync they pay for), or at once when no switch moves."""
        todo: dict[str, Circuits] = {}
        for s, c in targets.items():
            parts = self._held.setdefault(s, {})
            if parts.get(job) != c:
                parts[job] = dict(c)
            if len(parts) == 1:
                union = parts[job]
            else:
                union = {}
                for part in parts.values():
                    union.update(part)
            if self._current.get(s) != union:
                todo[s] = union
        for k, decision in enumerate(decisions):
            self.journal.record(decision, cause, defer=bool(todo) or k < len(decisions) - 1)
        if todo:                                # write-ahead: intended state first, one sync
            self.journal.set_intended_many({s: c.items() for s, c in todo.items()}, cause,
                                           event=record)
            self._owned.update(todo)
        took: Took = {}
        failed: list[tuple[str, SwitchError]] = []
        for s, c, rep in self._write(todo):
            if isinstance(rep, SwitchError):
                self._current.pop(s, None)        # unknown now: read back at reconcile
                failed.append((s, rep))
                continue
            took[s] = rep
            self._current[s] = dict(c)
            if record:
                r = self.reported({s: rep}, cause)[s]
                self.journal.record(Applied(switch=s, job=job, seconds=r.seconds, added=r.added,
                                            removed=r.removed, unreadable=r.unreadable),
                                    cause, rep[1], defer=True)
        for s, e in failed:
            self.alarm(f"switch {s} refused the circuits: {e}", Alarm(switch=s, during=cause))
        if failed:
            s, e = failed[0]
            raise AgentError(f"switch {s} refused the circuits for {cause}: {e}") from e
        return took

    def reported(self, took: Took, cause: str) -> dict[str, SwitchReport]:
        """{switch: what its report says changed, for the journal}. A report that cannot be
        read (a service at odds with the contract) is journaled as such, with an alarm: the
        switch said it made the circuits, which the agent holds it to."""
        out: dict[str, SwitchReport] = {}
        for s, (rep, seconds) in took.items():
            try:
                out[s] = SwitchReport(seconds=seconds, added=rep.pairs("added"),
                                      removed=rep.pairs("removed"))
            except Exception as e:
                why = str(e) if str(e).startswith(type(e).__name__) else \
                    f"{type(e).__name__}: {e}"
                out[s] = SwitchReport(seconds=seconds, unreadable=why)
                self.alarm(f"switch {s} made the circuits for {cause} but its report of "
                           f"them cannot be read: {e}", Alarm(switch=s, during=cause))
        return out

    def _write(self, todo: dict[str, Circuits]) -> Iterator[tuple[str, Circuits, Written]]:
        """Apply each switch's circuits; different switches at once. Yields (switch, circuits,
        (report, seconds) or the SwitchError it raised), in `todo`'s order."""
        def one(s: str, c: Circuits) -> tuple[ApplyReport, float] | SwitchError:
            t0 = self.clock()
            try:
                return self.switches[s].apply(c), self.clock() - t0
            except SwitchError as e:
                return e
        if len(todo) < 2:
            for s, c in todo.items():
                yield s, c, one(s, c)
            return
        done: dict[str, Any] = {}
        kinds: dict[type[CircuitSwitch], list[str]] = {}
        for s in todo:
            kinds.setdefault(type(self.switches[s]), []).append(s)
        rest = []
        for kind, names in kinds.items():
            t0 = self.clock()
            got = kind.apply_together([(self.switches[s], todo[s]) for s in names]) \
                if len(names) > 1 else None
            if got is None:
                rest += names
                continue
            took = self.clock() - t0
            for s, rep in zip(names, got, strict=True):
                if isinstance(rep, SwitchError):
                    done[s] = rep
                elif isinstance(rep, Exception):
                    raise rep
                else:
                    done[s] = (rep, took)
        if len(rest) > 1:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(max_workers=min(32, len(self.switches)),
                                                thread_name_prefix="switch-write")
            futures = {s: self._pool.submit(one, s, todo[s]) for s in rest}
            for s, f in futures.items():
                done[s] = f.result()
        else:
            done.update((s, one(s, todo[s])) for s in rest)
        for s, c in todo.items():
            yield s, c, done[s]

    def probe(self, switch: str, circuits: Circuits) -> None:
        """Set `circuits` on `switch` for a test, without journaling them as intended (a probe
        is not a decision: an agent restarted mid-probe puts the switch back)."""
        try:
            self.switches[switch].apply(circuits)
        except SwitchError as e:
            self._current.pop(switch, None)
            raise AgentError(f"loopback test on {switch} refused: {e}") from e
        self._current[switch] = dict(circuits)

    def noticed(self, found: Mapping[str, Circuits]) -> dict[str, int]:
        """Each switch of `found` holds its circuits (its service published them, changed by
        someone else or by itself: a rogue request, a power cycle): believed, and where they
        differ from the parts the jobs (and the operator) hold of it those are written again,
        several switches at once, each journaled as a reconcile; a switch that refuses raises
        an alarm and is unknown (the next change of it writes it whole). A switch the
        journal intends nothing of is left as it is. Returns {switch: circuits moved back}."""
        todo: dict[str, Circuits] = {}
        moves: dict[str, int] = {}
        for switch, actual in found.items():
            self._current[switch] = dict(actual)
            if switch not in self._owned:
                continue
            want: Circuits = {}
            for part in self._held.get(switch, {}).values():
                want.update(part)
            moves[switch] = policies.changes(actual, want)
            if moves[switch]:
                todo[switch] = want
        for s, c, rep in self._write(todo):
            cause = f"switch {s} changed behind the agent ({moves[s]} circuits moved)"
            if isinstance(rep, SwitchError):
                self._current.pop(s, None)
                self.alarm(f"{cause}; they cannot be put back: {rep}",
                           Alarm(switch=s, during=cause))
                continue
            self._current[s] = dict(c)
            r = self.reported({s: rep}, cause)[s]
            self.journal.record(Reconcile(switch=s, added=r.added, removed=r.removed),
                                cause, r.seconds)
        return {s: m for s, m in moves.items() if m}

    def reconcile(self, cause: str = "reconcile") -> dict[str, int]:
        """Read every switch, repair only what differs from the journal's intended circuits.
        Returns {switch: circuits added + removed}."""
        t0 = self.clock()
        intended = self.journal.intended()
        self._owned.update(intended)
        moves: dict[str, int] = {}
        for name, sw in self.switches.items():
            try:
                actual = sw.circuits()
            except SwitchError as e:
                self._current.pop(name, None)
                self.alarm(f"cannot read switch {name}: {e}", Alarm(switch=name))
                continue
            if name not in intended:
                self._current[name] = dict(actual)
                continue
            want = dict(intended[name])
            moves[name] = policies.changes(actual, want)
            if moves[name]:
                t1 = self.clock()
                rep = sw.apply(want)
                self.journal.record(Reconcile(switch=name, added=rep.pairs("added"),
                                              removed=rep.pairs("removed")),
                                    cause, self.clock() - t1)
            self._current[name] = want
        self.journal.record(Reconcile(moves=moves), cause, self.clock() - t0)
        return moves

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
