"""What the agent sees of any optical switch: a set of port-to-port circuits.

A Polatis-class OCS and a programmable photonic chip are both a `CircuitSwitch`: the agent
asks for circuits and reads back what is set, and never learns which kind it talks to.

Ports are numbered the Polatis way on every switch: inputs (ingress) 1..N, outputs (egress)
N+1..2N. A circuit joins one input to one output; an input feeds at most one output and an
output hears at most one input. A switch whose ports are not split into inputs and outputs (a
recirculating mesh) still names each circuit (a, b) with a < b, and a port is in at most one
circuit.
"""
from __future__ import annotations

import abc
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, NoReturn

Circuits = dict[int, int]     # input port -> output port


class SwitchError(Exception):
    """A switch refused or failed a request; the message says which port and why."""


class CircuitConflict(SwitchError, ValueError):
    """The request joins a port to two others, or names a port the switch does not have."""


def check_circuits(circuits: Mapping[int, int] | Iterable[tuple[int, int]], ports: int,
                   split: bool = True) -> Circuits:
    """Normalise circuits to {input: output} and refuse impossible ones with a clear message.

    `ports` is N (the switch is N x N, ports 1..2N) when `split`, else the number of ports of an
    unsplit switch (ports 1..ports).
    """
    usual = _usual(circuits, ports) if split else None
    if usual is not None:
        return usual
    pairs = circuits.items() if isinstance(circuits, Mapping) else circuits
    out: Circuits = {}
    used: dict[int, int] = {}
    top = 2 * ports if split else ports
    for pair in pairs:
        try:
            a, b = pair
            a, b = int(a), int(b)
        except (TypeError, ValueError):
            raise CircuitConflict(f"a circuit is a pair of port numbers, not {pair!r}") from None
        if not split and a > b:
            a, b = b, a
        # the usual case in one test each; the message says which rule a refused pair broke
        if not (1 <= a <= top and 1 <= b <= top and (a <= ports < b if split else a != b)
                and a not in used and b not in used):
            _refuse(a, b, ports, top, split, used)
        used[a] = used[b] = a
        out[a] = b
    return out


_INT = {int}


def _usual(circuits: Any, ports: int) -> Circuits | None:
    """The usual request on a split switch, a dict or a list of pairs of ints with every input
    and output distinct and on the switch, accepted in a few passes of builtins (a 32-circuit
    request in half the time); None for anything else, which the full check looks at pair by
    pair (and says what is wrong)."""
    kind = type(circuits)
    if kind is not dict and kind is not list:
        return None
    try:
        out: dict = dict(circuits) if kind is list else circuits
    except (TypeError, ValueError):
        return None
    n = len(out)
    if not n or (kind is list and n != len(circuits)):
        return None                                              # (an input named twice)
    outs = out.values()
    if len(set(outs)) != n or set(map(type, out)) != _INT or set(map(type, outs)) != _INT:
        return None
    if not (1 <= min(out) and max(out) <= ports < min(outs) and max(outs) <= 2 * ports):
        return None
    return out if kind is list else dict(out)


def _refuse(a: int, b: int, ports: int, top: int, split: bool, used: dict[int, int]) -> NoReturn:
    for p in (a, b):
        if not 1 <= p <= top:
            raise CircuitConflict(f"port {p} does not exist on this switch (ports 1..{top})")
    if split and not (a <= ports < b):
        raise CircuitConflict(f"circuit ({a}, {b}) must join an input 1..{ports} "
                              f"to an output {ports + 1}..{2 * ports}")
    if a == b:
        raise CircuitConflict(f"circuit ({a}, {b}) joins a port to itself")
    for p in (a, b):
        if p in used:
            raise CircuitConflict(f"port {p} is in two circuits: ({used[p]}, ...) and "
                                  f"({a}, {b})")
    raise AssertionError(f"circuit ({a}, {b}) refused for no stated reason")


@dataclass(frozen=True)
class ApplyReport:
    """What one `apply` did: the circuits added and removed, and how long it took."""
    added: Circuits = field(default_factory=dict)
    removed: Circuits = field(default_factory=dict)
    seconds: float = 0.0

    def pairs(self, which: str) -> list[tuple[int, int]]:
        """`added` or `removed` as sorted (input, output) pairs of Python ints (as journaled;
        a driver's report may hold numpy integers)."""
        c = getattr(self, which)
        if set(map(type, c)) | set(map(type, c.values())) <= _INT:
            return sorted(c.items())                # the usual report: no conversion
        return sorted((int(a), int(b)) for a, b in c.items())


class CircuitSwitch(abc.ABC):
    """Apply a set of circuits, read back what is set."""

    name: str = "switch"

    @property
    @abc.abstractmethod
    def ports(self) -> int:
        """N for an N x N switch (ports 1..2N)."""

    @abc.abstractmethod
    def apply(self, circuits: Mapping[int, int]) -> ApplyReport:
        """Make exactly these circuits the switch's state (others are removed), changing only
        what differs from the current state; returns when the light has settled."""

    @abc.abstractmethod
    def circuits(self) -> Circuits:
        """The circuits the switch reports as set, read from the device."""

    @classmethod
    def apply_together(cls, work: list[tuple[CircuitSwitch, Mapping[int, int]]]
                       ) -> list[ApplyReport | Exception] | None:
        """Apply circuits to several switches of this class at once, from the calling thread
        (a class whose switches sit behind one message bus sends every request before waiting
        for any answer); in `work`'s order, each ApplyReport or the exception `apply` would
        have raised. None (the default): no such path, the caller applies them one by one."""
        return None

    @property
    def split(self) -> bool:
        """Whether the ports are inputs 1..N and outputs N+1..2N (a recirculating mesh's are
        not: it names each circuit (a, b) with a < b)."""
        return True

    def check(self, circuits: Mapping[int, int] | Iterable[tuple[int, int]]) -> Circuits:
        """`circuits` as {input: output} if this switch can make them all at once, else
        CircuitConflict: where a request enters (the wire's list of pairs), so that a port
        named twice is refused rather than merged."""
        return check_circuits(circuits, self.ports, split=self.split)

    def describe(self) -> dict:
        """What the switch is, as plain JSON-able data (kind, ports, and for a chip its
        topology)."""
        return {"name": self.name, "kind": type(self).__name__, "ports": self.ports}

    def close(self) -> None:  # noqa: B027 - not abstract: a switch with nothing to release
        """Release the connection (never done in __del__)."""
