"""Driver for a Polatis-class optical circuit switch (SCPI over a raw socket, via pyvisa).

`OpticalCircuitSwitch` is a `CircuitSwitch`: `apply()` makes a whole port map the switch's state
in one line and one round trip,

    :OXC:SWIT:CONN:ONLY (@1,2,...),(@33,34,...);*OPC?;:SYST:ERR?

which the switch carries out by moving only the circuits that differ, answers once the light has
settled (`*OPC?`), and confirms (`:SYST:ERR?`). Refusals are raised as typed `SCPIError`s from
the drained error queue.

If the session drops in the middle of a change, the driver reopens it, reads the map back and
sends only what is still missing (nothing if the switch already did it), so a reconfiguration is
never applied twice.
"""
from __future__ import annotations

import logging
import re
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Generic, TypeVar

from photonic_testbed.drivers.circuit_switch import (
    ApplyReport,
    Circuits,
    CircuitSwitch,
    SwitchError,
    check_circuits,
)
from photonic_testbed.drivers.scpi import (
    ERROR_ENTRY,
    ConnectionLost,
    InstrumentDisconnected,
    ProtocolError,
    SCPIInstrument,
    parse_error,
    scpi_error,
)

log = logging.getLogger(__name__)

_LIST = re.compile(r"\(@([^()]*)\)")
SETTLE_TIMEOUT_S = 10.0      # the longest a move may take before *OPC? is late


_PORT_TEXT = tuple(map(str, range(4097)))      # port numbers as written (a 64-switch phase
                                               # change writes 4,096 of them)


def format_circuits(circuits: Mapping[int, int]) -> str:
    """{1: 33, 2: 34} -> `(@1,2),(@33,34)` (ingress ascending)."""
    ins = sorted(circuits)
    outs = [circuits[i] for i in ins]
    text = _PORT_TEXT
    if ins and 0 <= ins[0] and ins[-1] < len(text) and 0 <= min(outs) and max(outs) < len(text):
        return f"(@{','.join([text[i] for i in ins])}),(@{','.join([text[o] for o in outs])})"
    return f"(@{','.join(map(str, ins))}),(@{','.join(map(str, outs))})"


def parse_circuits(text: str) -> Circuits:
    """`(@1,2),(@33,34)` (or `(@),(@)`, or `(@1),(@33);(@2),(@34)`) -> {1: 33, 2: 34}."""
    out: Circuits = {}
    for group in text.strip().split(";"):
        lists = _LIST.findall(group)
        if len(lists) != 2 or _LIST.sub("", group).replace(",", "").strip():
            raise ProtocolError(f"not a connection state: {text[:80]!r}")
        try:
            ins = [int(x) for x in lists[0].split(",") if x.strip()]
            outs = [int(x) for x in lists[1].split(",") if x.strip()]
        except ValueError:
            raise ProtocolError(f"not a connection state: {text[:80]!r}") from None
        if len(ins) != len(outs):
            raise ProtocolError(f"unpaired connection state: {text[:80]!r}")
        out.update(zip(ins, outs, strict=True))
    return out


class OpticalCircuitSwitch(SCPIInstrument, CircuitSwitch):
    """A Polatis-class N x N OCS on `TCPIP::host::port::SOCKET` (ingress 1..N, egress N+1..2N).

    The driver remembers the map it last read or set (`known`) so that `apply()` of an
    unchanged map sends nothing and a changed one costs one round trip; after a dropped session
    it forgets it and reads the map back.
    """

    name = "ocs"

    def __init__(self, resource: str, *, settle_timeout_s: float = SETTLE_TIMEOUT_S, **kwargs):
        self.settle_timeout_s = settle_timeout_s
        super().__init__(resource, **kwargs)
        size = self.query(":OXC:SWIT:SIZE?")
        try:
            n_in, n_out = (int(x) for x in size.split(","))
        except ValueError:
            raise ProtocolError(f"size query answered {size!r}") from None
        if n_in != n_out or n_in < 1:
            raise ProtocolError(f"not an N x N switch: {size!r}")
        self._n = n_in
        self.known: Circuits | None = None

    @property
    def ports(self) -> int:
        return self._n

    def describe(self) -> dict:
        return {**super().describe(), "identity": self.identity,
                "resource": self.resource_name}

    def _on_reconnect(self) -> None:
        self.known = None

    # ---- reading ---------------------------------------------------------------------------

    def circuits(self) -> Circuits:
        self.known = parse_circuits(self.query(":OXC:SWIT:CONN:STAT?"))
        return dict(self.known)

    def connected_port(self, port: int) -> int | None:
        """The port joined to `port`, or None."""
        self._check_port(port)
        reply = self.query(f":OXC:SWIT:CONN:PORT? {port}")
        try:
            peer = int(reply)
        except ValueError:
            raise ProtocolError(f"port query answered {reply[:40]!r}") from None
        return peer or None

    def port_power(self, ports: Iterable[int]) -> dict[int, float]:
        """Optical power at each port in dBm, from the switch's own monitors (`:PMON:POW?`)."""
        ports = list(ports)
        for p in ports:
            self._check_port(p)
        if not ports:
            return {}
        reply = self.query(f":PMON:POW? (@{','.join(map(str, ports))})")
        try:
            values = [float(v) for v in reply.strip("()").split(",")]
        except ValueError:
            raise ProtocolError(f"power monitor answered {reply[:80]!r}") from None
        if len(values) != len(ports):
            raise ProtocolError(f"asked {len(ports)} ports, got {len(values)} powers")
        return dict(zip(ports, values, strict=True))

    def _check_port(self, port: int) -> None:
        if not isinstance(port, int) or not 1 <= port <= 2 * self._n:
            raise SwitchError(f"port {port!r} does not exist on this switch (1..{2 * self._n})")

    # ---- changing ----------------------------------------------------------------------------

    def apply(self, circuits: Mapping[int, int]) -> ApplyReport:
        got = self.begin_apply(circuits)
        return got.wait() if isinstance(got, PendingChange) else got

    def begin_apply(self, circuits: Mapping[int, int] | Iterable[tuple[int, int]]
                    ) -> ApplyReport | PendingChange[ApplyReport]:
        """`apply` in two halves: the change sent and its answer read later (a
        `PendingChange`), or the report at once when the switch already holds `circuits`.
        Reads the map first when the driver does not know it (`can_begin` says it will not
        have to)."""
        t0 = time.perf_counter()
        want = check_circuits(circuits, self._n)
        before = self.known if self.known is not None else self.circuits()

        def report() -> ApplyReport:
            return ApplyReport(added={i: e for i, e in want.items() if before.get(i) != e},
                               removed={i: e for i, e in before.items() if want.get(i) != e},
                               seconds=time.perf_counter() - t0)

        if before == want:
            return report()
        line = f":OXC:SWIT:CONN:ONLY {format_circuits(want)}"
        return PendingChange(self, line, lambda now: None if now == want else line,
                             lambda now: want, report).send()

    def can_begin(self) -> bool:
        """Whether `begin_apply` sends at once (the map is known) and its answer can be
        waited for on the session's socket (`session_socket`)."""
        return self.known is not None and self.session_socket() is not None

    def connect(self, ingress: int, egress: int) -> None:
        """Add one circuit (refused by the switch if either port is in use)."""
        self.connect_many({ingress: egress})

    def connect_many(self, circuits: Mapping[int, int]) -> None:
        """Add circuits in one `:CONN:ADD` (all or nothing); existing ones stay."""
        pairs = check_circuits(circuits, self._n)
        if not pairs:
            return
        self._change(f":OXC:SWIT:CONN:ADD {format_circuits(pairs)}",
                     lambda now: self._missing_line("ADD", {i: e for i, e in pairs.items()
                                                            if now.get(i) != e}),
                     lambda now: {**now, **pairs})

    def disconnect(self, ingress: int, egress: int | None = None) -> None:
        """Remove the circuit from `ingress` (to `egress`, read from the switch if not given)."""
        if egress is None:
            egress = self.connected_port(ingress)
            if egress is None:
                return
        self.disconnect_many({ingress: egress})

    def disconnect_many(self, circuits: Mapping[int, int]) -> None:
        """Remove circuits in one `:CONN:SUB`; the switch refuses ones that are not set."""
        pairs = check_circuits(circuits, self._n)
        if not pairs:
            return
        self._change(f":OXC:SWIT:CONN:SUB {format_circuits(pairs)}",
                     lambda now: self._missing_line("SUB", {i: e for i, e in pairs.items()
                                                            if now.get(i) == e}),
                     lambda now: {i: e for i, e in now.items() if pairs.get(i) != e})

    def disconnect_all(self) -> None:
        self._change(":OXC:SWIT:DISC:ALL", lambda now: ":OXC:SWIT:DISC:ALL" if now else None,
                     lambda now: {})

    def reconcile(self, circuits: Mapping[int, int]) -> ApplyReport:
        """Read the map back, then apply only the difference to `circuits`."""
        self.known = None
        return self.apply(circuits)

    @staticmethod
    def _missing_line(verb: str, pairs: Circuits) -> str | None:
        return f":OXC:SWIT:CONN:{verb} {format_circuits(pairs)}" if pairs else None

    def _change(self, line: str, redo: Callable[[Circuits], str | None],
                after: Callable[[Circuits], Circuits]) -> None:
        """Send a state change with `*OPC?;:SYST:ERR?` on the same line and wait for it
        (PendingChange: reconciled after a dropped session)."""
        PendingChange(self, line, redo, after, lambda: None).send().wait()


Outcome = TypeVar("Outcome")     # what a concluded change gives: `apply`'s report, or nothing


class PendingChange(Generic[Outcome]):
    """A state change sent to the switch (with `*OPC?;:SYST:ERR?` on the same line) whose
    answer is still to be read.

    `wait()` reads it: blocking, and if the session drops before the answer, it reopens the
    session, reads the map back and sends `redo(map)` (what is still missing), or nothing
    when `redo` says it is done, so a change is never applied twice. A caller waiting for many
    switches at once instead waits for `switch.session_socket()` to be readable and asks
    `state()`: 'line': `take()` the answer and `conclude(answer)` (at once when `clean`; a
    refusal drains the switch's error queue); 'lost' (a dropped session, or no answer by
    `deadline`): `recover()` (blocking)."""

    def __init__(self, switch: OpticalCircuitSwitch, line: str,
                 redo: Callable[[Circuits], str | None], after: Callable[[Circuits], Circuits],
                 report: Callable[[], Outcome]):
        self.switch = switch
        self.line = line
        self._redo, self._after, self._report = redo, after, report
        self.base = switch.known
        self.lost: ConnectionLost | None = None
        self.deadline = time.monotonic() + switch.settle_timeout_s

    def send(self) -> PendingChange[Outcome]:
        self.deadline = time.monotonic() + self.switch.settle_timeout_s
        try:
            self.switch._res_io_write(f"{self.line};*OPC?;:SYST:ERR?")
        except ConnectionLost as e:
            self.lost = e
        return self

    def state(self) -> str:
        """'line', 'wait' or 'lost' (see the class), without reading."""
        if self.lost is not None:
            return "lost"
        state = self.switch.reply_state()
        if state == "wait" and time.monotonic() > self.deadline:
            return "lost"
        return state

    def take(self) -> str:
        """The answer, once `state()` says a line waits."""
        return self.switch.take_waiting(self.switch.settle_timeout_s)

    def wait(self) -> Outcome:
        if self.lost is None:
            try:
                return self.conclude(self.take())
            except ConnectionLost as e:
                self.lost = e
        return self.recover()

    def recover(self) -> Outcome:
        """The session dropped (or went silent) before the answer: reopen it, read the map
        back and send what is still missing."""
        sw = self.switch
        log.warning("%s: session lost during a change (%s); reopening to reconcile",
                    sw.resource_name, self.lost or "no answer in time")
        sw._reconnect()
        now = sw.circuits()
        line = self._redo(now)
        if line is None:
            log.info("%s: the switch had already made the change", sw.resource_name)
            return self._report()
        self.base, self.line = now, line
        try:
            reply = sw._exchange(f"{line};*OPC?;:SYST:ERR?", sw.settle_timeout_s)
        except ConnectionLost as e2:
            sw.known = None
            raise InstrumentDisconnected(f"{sw.resource_name}: lost again while "
                                         f"reconciling: {e2}") from e2
        return self.conclude(reply)

    @staticmethod
    def clean(reply: str) -> bool:
        """Whether the answer says done with no error (`conclude` then asks nothing more)."""
        opc, _, entry = reply.partition(";")
        m = ERROR_ENTRY.match(entry)
        return opc.strip() == "1" and m is not None and int(m.group(1)) == 0

    def conclude(self, reply: str) -> Outcome:
        sw = self.switch
        opc, _, entry = reply.partition(";")
        if opc.strip() != "1":
            sw.known = None
            raise ProtocolError(f"{self.line[:60]!r}: expected '1;<error>', got {reply[:80]!r}")
        code, msg = parse_error(entry)
        if code != 0:
            sw.known = None
            raise scpi_error(code, msg, self.line, [(code, msg)] + sw.errors())
        sw.known = self._after(self.base) if self.base is not None else None
        return self._report()
