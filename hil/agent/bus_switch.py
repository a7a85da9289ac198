"""A switch service on the bus as a `CircuitSwitch` (`BusSwitch`), for the agent process.

Every change is sent with `expect` = the state version last seen (compare-and-set); a
`StaleState` (someone else changed the switch) re-reads and retries once, since the agent's
intent is the fabric's. The switches one services process serves together (its `describe`
says which) are changed with one `apply_circuits_together` request, each with its own
`expect`; the others each with its own `apply_circuits`; every request is sent before any
answer is awaited (docs/bus.md, "Served together"). A switch's report is read off the wire
when the journal first looks at it, once the job has its grant.
"""
from __future__ import annotations

import functools
import logging
import time
from collections.abc import Mapping, Sequence
from typing import Any

import msgspec

from photonic_testbed.drivers.circuit_switch import (
    ApplyReport,
    CircuitConflict,
    Circuits,
    CircuitSwitch,
    SwitchError,
    check_circuits,
)
from photonic_testbed.hil.bus import schema
from photonic_testbed.hil.bus.client import (
    BadRequest,
    BusError,
    ServiceClient,
    StaleState,
    UnknownOperation,
    call_many,
    from_wire,
)

log = logging.getLogger(__name__)


class _AnsweredReport(ApplyReport):
    """A switch service's report of an `apply_circuits` (its answer's result), its circuit
    lists read off the wire (and checked, `circuits_from_wire`) when first looked at: by the
    agent's journal, once the job has the grant the change was for, not while it waits for it
    (a phase switch on 64 OCSes: 128 lists of 32 circuits, 1.5 ms). A list that cannot be
    read raises then (`Agent._reported` journals it as such)."""

    _result: Any

    def __init__(self, result: Any, seconds: float):
        object.__setattr__(self, "seconds", seconds)
        object.__setattr__(self, "_result", result)

    @functools.cached_property
    def added(self) -> Circuits:                                  # type: ignore[override]
        return schema.circuits_from_wire(self._result["added"])

    @functools.cached_property
    def removed(self) -> Circuits:                                # type: ignore[override]
        return schema.circuits_from_wire(self._result["removed"])

    def pairs(self, which: str) -> list[tuple[int, int]]:
        """The list as it came, checked in one pass in C (pairs of two integers, no input or
        output named twice) and sorted; a list that fails is read as `added`/`removed` are,
        which says what is wrong (a 64-OCS phase switch's journal entry: 128 lists, half the
        time of making each a dict first)."""
        raw = self._result[which]
        try:
            got = msgspec.convert(raw, _WIRE_PAIRS, strict=True)
        except (msgspec.ValidationError, TypeError):
            got = None
        if got is None or len({a for a, _ in got}) != len(got) \
                or len({b for _, b in got}) != len(got):
            return super().pairs(which)
        got.sort()
        return got


_WIRE_PAIRS = list[tuple[int, int]]


class BusSwitch(CircuitSwitch):
    """A switch service on the bus, as a CircuitSwitch."""

    # A switch whose service refused a request together is sent its own requests; it asks its
    # service again (describe) this long after, and rejoins a group the service says it is in
    # (the services restarted together again, say).
    REGROUP_S = 30.0

    def __init__(self, name: str, client: ServiceClient):
        self.name = name
        self.client = client
        snap = client.call("snapshot")
        self._ports = int(snap["state"]["ports"])
        self.version = snap["state"]["version"]
        self._regroup_at: float | None = None
        self.group: tuple[str, frozenset] | None = None
        self.can_move = False
        # the circuits, in wire form, the agent last wrote or read (None: not known)
        self.wire: list | None = None
        self._learn_group()

    def _learn_group(self) -> None:
        """The switches served with this one, which one apply_circuits_together sent here may
        change (describe's `together`); None: none, or a service that does not say."""
        described = self.client.call("describe")
        ops = described.get("operations") if isinstance(described, dict) else None
        # a chip's service routes a circuit by other cells (`move`); an OCS's does not
        self.can_move = isinstance(ops, list) and "move_circuits" in ops
        together = described.get("together") if isinstance(described, dict) else None
        self.group = None
        if together is None:
            return
        switches = together.get("switches") if isinstance(together, dict) else None
        group = together.get("group") if isinstance(together, dict) else None
        if not (isinstance(switches, list) and all(isinstance(s, str) for s in switches)
                and isinstance(group, str)):
            log.warning("%s: its service describes `together` as %.80r, not {group: an id, "
                        "switches: [names]}: sent its own requests", self.name, together)
            return
        if self.name in switches and len(set(switches)) > 1:
            self.group = (group, frozenset(switches))

    def _regroup(self, now: float) -> None:
        """Ask the service again whether it serves this switch together with others, when a
        refusal together set it apart REGROUP_S ago."""
        if self.group is not None or self._regroup_at is None or now < self._regroup_at:
            return
        try:
            self._learn_group()
        except BusError as e:
            self.group = None
            log.info("%s: cannot ask whether it is served together (%s)", self.name, e)
        self._regroup_at = None if self.group is not None else now + self.REGROUP_S
        if self.group is not None:
            log.info("%s is served together again (%d switches)", self.name, len(self.group[1]))

    @property
    def ports(self) -> int:
        return self._ports

    def move(self, inputs: Sequence[int], healthy: Sequence[int] = ()) -> dict:
        """The circuits from these inputs moved off the waveguides they cross now (the chip
        service's `move_circuits`, with the version last seen; `healthy`: inputs whose light is
        full): the same circuits, by other cells. SwitchError if the service cannot or refuses
        (it says why). A switch changed since the agent looked (StaleState) is read: if its
        circuits are still what the agent last wrote (a heater or routing change), the move is
        sent once more on the version read; if not, it is not (the change is the agent's to
        put back, which it does once it sees it published)."""
        if not self.can_move:
            raise SwitchError(f"{self.name} cannot route a circuit by other paths (its service "
                              "offers no move_circuits)")
        for attempt in (0, 1):
            try:
                got = self.client.call("move_circuits", inputs=list(inputs),
                                       healthy=list(healthy), expect=self.version)
            except StaleState as e:
                if attempt:
                    raise SwitchError(f"{self.name} keeps changing under the agent") from e
                try:
                    read = self.client.call("read_circuits")
                except BusError as e2:
                    raise SwitchError(f"{self.name}: {e2}") from e2
                if self.wire is None or {tuple(c) for c in read.get("circuits", ())} != \
                        {tuple(c) for c in self.wire}:
                    raise SwitchError(f"{self.name}: its circuits changed under the agent: "
                                      "not moved before they are put back") from e
                self.version = self.client.version
                continue
            except BusError as e:
                raise SwitchError(f"{self.name}: {e}") from e
            self.version = self.client.version
            return got
        raise SwitchError(f"{self.name}: not moved")      # (not reached: the loop returns)

    def apply(self, circuits: Mapping[int, int]) -> ApplyReport:
        got = self.apply_together([(self, circuits)])[0]
        if isinstance(got, Exception):
            raise got
        return got

    @classmethod
    def apply_together(cls, work):
        """Every switch's `apply_circuits` sent before any answer is waited for (one thread,
        each request retried with its own id), each with the state version the agent last saw
        (`expect`). A switch that changed under the agent is read again and asked once more;
        refused again, or any other error: a SwitchError for that switch alone."""
        out: list = [None] * len(work)
        wires: dict[int, list] = {}
        now = time.monotonic()
        for sw, _ in work:
            sw._regroup(now)
        for i, (sw, circuits) in enumerate(work):
            try:
                wires[i] = schema.circuits_to_wire(check_circuits(circuits, sw._ports))
            except CircuitConflict as e:
                out[i] = e
        timeout = max(sw.client.timeout for sw, _ in work)
        t0 = time.perf_counter()
        pending = list(wires)
        for attempt in (0, 1):
            answers = cls._send([work[i][0] for i in pending], [wires[i] for i in pending],
                                timeout)
            stale = []
            for i, got in zip(pending, answers, strict=True):
                sw = work[i][0]
                if isinstance(got, StaleState) and not attempt:
                    stale.append(i)
                elif isinstance(got, StaleState):
                    sw.wire = None
                    out[i] = SwitchError(f"{sw.name} keeps changing under the agent")
                elif isinstance(got, BusError):
                    sw.wire = None
                    out[i] = SwitchError(f"{sw.name}: {got}")
                else:
                    sw.wire = wires[i]
                    out[i] = _AnsweredReport(got, time.perf_counter() - t0)
            pending = []
            for i in stale:
                sw = work[i][0]
                log.warning("%s changed under the agent; re-reading", sw.name)
                try:
                    sw.client.call("read_circuits")
                    sw.version = sw.client.version
                    pending.append(i)
                except BusError as e:
                    out[i] = SwitchError(f"{sw.name}: {e}")
            if not pending:
                break
        return out

    @staticmethod
    def _send(switches: list[BusSwitch], wires: list[list], timeout: float) -> list:
        """Each switch's circuits sent, every request before any answer is awaited: the
        switches served together (`group`) in one `apply_circuits_together` to one of them,
        the others each in its own `apply_circuits`; each with the version the agent last
        saw. Returns, per switch, its result or its BusError; each switch written has its new
        version. A service that refuses a request together (restarted apart from the others,
        say) is sent each switch's own request, and asks again after REGROUP_S."""
        groups: dict[tuple, list[int]] = {}
        for i, sw in enumerate(switches):
            key = sw.group if sw.group is not None else ("", i)
            groups.setdefault(key, []).append(i)
        calls, members = [], []
        for idx in groups.values():
            sw = switches[idx[0]]
            if len(idx) == 1:
                calls.append((sw.client, "apply_circuits", {"circuits": wires[idx[0]]},
                              sw.version))
            else:
                calls.append((sw.client, "apply_circuits_together", {"changes": [
                    {"switch": switches[i].name, "circuits": wires[i],
                     "expect": switches[i].version} for i in idx]}, None))
            members.append(idx)
        out: list = [None] * len(switches)
        apart: list[int] = []
        for idx, got in zip(members, call_many(calls, timeout), strict=True):
            if len(idx) == 1:
                if not isinstance(got, BusError):
                    switches[idx[0]].version = switches[idx[0]].client.version
                out[idx[0]] = got
            elif isinstance(got, (BadRequest, UnknownOperation)):
                log.warning("%s refused the switches' changes together (%s); sending each "
                            "its own", switches[idx[0]].name, got)
                for i in idx:
                    switches[i].group = None
                    switches[i]._regroup_at = time.monotonic() + switches[i].REGROUP_S
                apart += idx
            elif isinstance(got, BusError):
                for i in idx:
                    out[i] = got
            elif _switches_answered(got) != [switches[i].name for i in idx]:
                for i in idx:                   # (a service at odds with the contract)
                    out[i] = BusError(f"{switches[idx[0]].name} answered the changes together "
                                      "for other switches than those asked")
            else:
                for i, part in zip(idx, got["changes"], strict=True):
                    sw = switches[i]
                    sw.version = part["version"]
                    out[i] = (part["result"] if "result" in part else
                              from_wire(part["error"], part["message"], part["version"]))
        if apart:
            for i, got in zip(apart, BusSwitch._send([switches[i] for i in apart],
                                                     [wires[i] for i in apart], timeout),
                                 strict=True):
                out[i] = got
        return out

    def circuits(self) -> Circuits:
        try:
            got = self.client.call("read_circuits")
        except BusError as e:
            raise SwitchError(f"{self.name}: {e}") from e
        self.version = self.client.version
        circuits = dict(schema.circuits_from_wire(got["circuits"]))
        self.wire = got["circuits"]
        return circuits

    def published(self, state: dict) -> Circuits | None:
        """The circuits a publication of the service's state says the switch holds; None when
        it says none, is older than what the agent's own last request of it answered (on its
        way as the agent changed the switch), or says what the agent last wrote or read (its
        own change: on 64 OCSes, a phase switch's 64 publications are compared as they came,
        not read)."""
        if "circuits" not in state or _older(state.get("version"), self.version) or \
                state["circuits"] == self.wire:
            return None
        try:
            return dict(schema.circuits_from_wire(state["circuits"]))
        except (BusError, TypeError, ValueError) as e:
            log.warning("%s publishes circuits that cannot be read (%s): not compared",
                        self.name, e)
            return None

    def describe(self) -> dict:
        return {"name": self.name, "kind": "BusSwitch", "endpoint": self.client.endpoint,
                "ports": self._ports}

    def close(self) -> None:
        self.client.close()


def _older(version: Any, than: Any) -> bool:
    """Whether state version `version` ("INCARNATION:N") comes before `than`: of the same
    incarnation with a lower N (a service started again begins a new one: not older)."""
    if not (isinstance(version, str) and isinstance(than, str)):
        return False
    inc, _, n = version.rpartition(":")
    inc2, _, n2 = than.rpartition(":")
    return inc == inc2 and n.isdigit() and n2.isdigit() and int(n) < int(n2)


def _switches_answered(got: Any) -> list | None:
    """The switches an `apply_circuits_together` answer has an entry for, in order (None: not
    such an answer)."""
    parts = got.get("changes") if isinstance(got, dict) else None
    if not isinstance(parts, list) or not all(isinstance(p, dict) for p in parts):
        return None
    return [p.get("switch") for p in parts]


