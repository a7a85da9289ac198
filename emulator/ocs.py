"""A Polatis-class optical circuit switch, emulated: beam-steering physics and its SCPI persona.

Physics (`OCSPhysics`): an N x N switch, ingress ports 1..N, egress N+1..2N. Each port has a
hidden insertion loss drawn from the seed (0.5-0.75 dB, so a path loses ~1-1.5 dB). A move takes
`switching_s` (default 25 ms), during which the ports it touches carry no light. A stuck port
ignores moves: the controller still reports what it was told, but the light keeps its old path.
`reboot()` loses the volatile state (every circuit). `moves` counts circuits made or broken,
`port_moves` how many of them touched each port.

SCPI (`OCSInstrument`): the Polatis dialect; see docs/instruments.md.
"""
from __future__ import annotations

import collections
import itertools
import logging
import math
import re
import threading
import time
from collections.abc import Callable

import numpy as np
import orjson

from photonic_testbed.emulator.scpi import Instrument, SCPIError, without_arg

log = logging.getLogger(__name__)

DARK_DBM = -60.0       # what the port power monitor reports with no light (its floor)


class OCSPhysics:
    """The switch's hidden state and the light through it."""

    def __init__(self, n: int = 32, seed: int = 0, switching_s: float = 0.025,
                 light_in: Callable[[], dict[int, float]] | None = None):
        if n < 1:
            raise ValueError("an OCS has at least one port pair")
        if not 0 <= switching_s <= 10:
            raise ValueError(f"switching time {switching_s} s is not in 0..10 s")
        self.n = n
        self.switching_s = switching_s
        self.light_in = light_in or (lambda: {})
        rng = np.random.default_rng([seed, 0x0C5])
        self.loss_db = {p: float(x) for p, x in zip(range(1, 2 * n + 1),
                                                      rng.uniform(0.5, 0.75, 2 * n), strict=True)}
        self.lock = threading.RLock()
        self.commanded: dict[int, int] = {}     # what the controller reports
        self.actual: dict[int, int] = {}        # where the light goes
        self.stuck: set[int] = set()
        self._dark_until: dict[int, float] = {}
        self.moves = 0
        self.port_moves: collections.Counter[int] = collections.Counter()   # moves per port

    # ---- state changes (all-or-nothing; callers validated the ports) -------------------------

    def _move(self, remove: dict[int, int], add: dict[int, int]) -> None:
        commanded, actual, stuck = self.commanded, self.actual, self.stuck
        for i in remove:
            del commanded[i]
        commanded.update(add)
        self.moves += len(remove) + len(add)
        self.port_moves.update(itertools.chain(remove.keys(), remove.values(), add.keys(),
                                               add.values()))
        if stuck:       # a stuck port at either end: the light keeps its old path
            remove = {i: e for i, e in remove.items() if i not in stuck and e not in stuck}
            add = {i: e for i, e in add.items() if i not in stuck and e not in stuck}
        for i, e in remove.items():
            if actual.get(i) == e:
                del actual[i]
        # A new light path needs both its ends free of light (a stuck circuit, or one the
        # controller forgot across a fault, can hold either); `add` names each egress once.
        lit = set(actual.values())
        if not (actual.keys().isdisjoint(add.keys()) and lit.isdisjoint(add.values())):
            add = {i: e for i, e in add.items() if i not in actual and e not in lit}
        actual.update(add)
        if self.switching_s:    # the ports of every path made or broken: dark while it moves
            self._dark_until.update(dict.fromkeys(itertools.chain(
                remove.keys(), remove.values(), add.keys(), add.values()),
                time.monotonic() + self.switching_s))

    def connect(self, pairs: dict[int, int]) -> None:
        with self.lock:
            for i, e in pairs.items():
                if self.commanded.get(i) == e:
                    continue
                if i in self.commanded:
                    raise SCPIError(-224, f"ingress {i} is already connected to "
                                          f"{self.commanded[i]}")
                held = self.egress_owner(e)
                if held is not None:
                    raise SCPIError(-224, f"egress {e} is already connected to {held}")
            self._move({}, {i: e for i, e in pairs.items() if self.commanded.get(i) != e})

    def disconnect(self, pairs: dict[int, int]) -> None:
        with self.lock:
            for i, e in pairs.items():
                if self.commanded.get(i) != e:
                    raise SCPIError(-224, f"{i} is not connected to {e}")
            self._move(dict(pairs), {})

    def replace(self, pairs: dict[int, int]) -> None:
        """The whole map becomes `pairs`; circuits in both stay untouched (no move)."""
        with self.lock:
            had = self.commanded
            self._move({i: e for i, e in had.items() if pairs.get(i) != e},
                       {i: e for i, e in pairs.items() if had.get(i) != e})

    def egress_owner(self, e: int) -> int | None:
        for i, x in self.commanded.items():
            if x == e:
                return i
        return None

    def peer(self, port: int) -> int:
        with self.lock:
            if port <= self.n:
                return self.commanded.get(port, 0)
            owner = self.egress_owner(port)
            return owner or 0

    def reboot(self) -> None:
        """Power cycle: the volatile state (every circuit) is lost."""
        with self.lock:
            self.commanded.clear()
            self.actual.clear()
            self._dark_until.clear()
        log.info("ocs rebooted: every circuit lost")

    def pending_until(self) -> float:
        with self.lock:
            return max(self._dark_until.values(), default=0.0)

    # ---- light -----------------------------------------------------------------------------

    def transfer(self, inputs: dict[int, float]) -> dict[int, float]:
        """mW injected at ingress ports -> mW arriving at every egress port, right now."""
        out = {e: 0.0 for e in range(self.n + 1, 2 * self.n + 1)}
        for _, e, mw in self._paths(inputs):
            out[e] += mw
        return out

    def contributions(self, inputs: dict[int, float]) -> dict[int, dict[int, float]]:
        """{ingress: {egress: mW}}: what each input alone delivers, right now (the switch is
        linear in power, so these add up to `transfer(inputs)`), in one pass over the inputs
        rather than one `transfer` per input."""
        return {i: {e: mw} for i, e, mw in self._paths(inputs)}

    def _paths(self, inputs: dict[int, float]) -> list[tuple[int, int, float]]:
        """(ingress, egress, mW arriving) for each lit input whose light gets through now: its
        circuit made and neither end's mirror still moving."""
        now = time.monotonic()
        lit = []
        with self.lock:
            for i, mw in inputs.items():
                e = self.actual.get(i)
                if e is None or mw <= 0:
                    continue
                if self._dark_until.get(i, 0.0) > now or self._dark_until.get(e, 0.0) > now:
                    continue
                lit.append((i, e, mw * 10 ** (-(self.loss_db[i] + self.loss_db[e]) / 10)))
        return lit

    def port_power_mw(self, port: int) -> float:
        """Light at a port: what arrives at an ingress, what leaves an egress."""
        inputs = self.light_in()
        if port <= self.n:
            return max(0.0, inputs.get(port, 0.0))
        return self.transfer(inputs)[port]

    def truth(self) -> dict:
        inputs = self.light_in()
        out = self.transfer(inputs)
        with self.lock:
            return {"n": self.n, "commanded": dict(self.commanded), "actual": dict(self.actual),
                    "stuck": sorted(self.stuck), "moves": self.moves,
                    "switching_s": self.switching_s,
                    "power_mw": {**{p: inputs.get(p, 0.0) for p in range(1, self.n + 1)}, **out},
                    "loss_db": dict(self.loss_db)}


# ---- channel lists ------------------------------------------------------------------------

_LIST = re.compile(r"\(@([^()]*)\)")
# a list of whole numbers orjson reads as ints (up to 18 digits; longer ones it makes floats)
_PLAIN = re.compile(r"(?:[ ,-]|[0-9]{1,18}(?![0-9]))*")


def port_list(text: str) -> list[int]:
    """`1,2,5:7` -> [1, 2, 5, 6, 7]."""
    if _PLAIN.fullmatch(text):  # the common case, a plain list: one pass in C
        try:
            return orjson.loads(f"[{text}]")
        except orjson.JSONDecodeError:
            pass                 # an empty entry, a leading zero, a lone sign: said below
    ports: list[int] = []
    for item in text.split(","):
        item = item.strip()
        if not item:
            if text.strip():
                raise SCPIError(-104, "empty entry in a port list")
            continue
        lo, _, hi = item.partition(":")
        try:
            a = int(lo)
            b = int(hi) if hi else a
        except ValueError:
            raise SCPIError(-104, f"not a port number: {item[:20]!r}") from None
        if b < a or b - a > 4096:
            raise SCPIError(-222, f"bad port range {item[:20]!r}")
        ports.extend(range(a, b + 1))
    return ports


def parse_pairs(arg: str, n: int) -> dict[int, int]:
    """`(@1,2),(@33,34)` or `(@1),(@33);(@2),(@34)` -> {ingress: egress}, validated."""
    if not arg.strip():
        raise SCPIError(-109, "port lists are needed: (@ingress,...),(@egress,...)")
    pairs: dict[int, int] = {}
    egress: set[int] = set()
    for group in arg.split(";"):
        g = group.strip()
        lists = _LIST.findall(g)
        if len(lists) != 2 or _LIST.sub("", g).replace(",", "").strip():
            raise SCPIError(-104, "expected (@ingress,...),(@egress,...)")
        ins, outs = port_list(lists[0]), port_list(lists[1])
        if len(ins) != len(outs):
            raise SCPIError(-224, f"{len(ins)} ingress ports but {len(outs)} egress ports")
        for i, e in zip(ins, outs, strict=True):
            if not 1 <= i <= n:
                raise SCPIError(-222, f"ingress port {i} is not in 1..{n}")
            if not n < e <= 2 * n:
                raise SCPIError(-222, f"egress port {e} is not in {n + 1}..{2 * n}")
            if i in pairs:
                raise SCPIError(-224, f"ingress {i} named twice")
            if e in egress:
                raise SCPIError(-224, f"egress {e} named twice")
            pairs[i] = e
            egress.add(e)
    return pairs


def format_pairs(pairs: dict[int, int]) -> str:
    ins = sorted(pairs)
    return f"(@{','.join(map(str, ins))}),(@{','.join(str(pairs[i]) for i in ins)})"


class OCSInstrument(Instrument):
    """The Polatis SCPI persona of an `OCSPhysics`."""

    def __init__(self, physics: OCSPhysics, serial: str = "001234"):
        super().__init__()
        self.physics = physics
        n = physics.n
        self.idn = f"Polatis (emulated),N-OST-{n}x{n}-HU1-DMHNS,{serial},6.5.2.18"
        p = physics
        self.command(":OXC:SWITch:SIZE?", without_arg(lambda: f"{n},{n}"))
        self.command(":OXC:SWITch:CONNect:ADD",
                     lambda s, x, a: p.connect(parse_pairs(a, n)))
        self.command(":OXC:SWITch:CONNect:SUBtract",
                     lambda s, x, a: p.disconnect(parse_pairs(a, n)))
        self.command(":OXC:SWITch:CONNect:ONLY", self._only)
        self.command(":OXC:SWITch:DISConnect:ALL", without_arg(lambda: p.replace({})))
        self.command(":OXC:SWITch:CONNect:STATe?", without_arg(lambda: format_pairs(p.commanded)))
        self.command(":OXC:SWITch:CONNect:PORT?", self._port)
        self.command(":PMONitor:POWer?", self._pmon)

    def pending_until(self) -> float:
        return self.physics.pending_until()

    def reset(self) -> None:
        # *RST leaves the circuits in place (disturbing light paths is not a "reset" on an OCS).
        pass

    def reboot(self) -> None:
        self.physics.reboot()

    def _only(self, session, sfx, arg) -> None:
        if arg.replace(" ", "") == "(@),(@)":
            self.physics.replace({})
        else:
            self.physics.replace(parse_pairs(arg, self.physics.n))

    def _one_port(self, arg: str) -> int:
        a = arg.strip()
        if a.startswith("(@") and a.endswith(")"):
            a = a[2:-1]
        try:
            port = int(a)
        except ValueError:
            raise SCPIError(-104 if a else -109, f"a port number is needed, not {arg[:20]!r}") \
                from None
        if not 1 <= port <= 2 * self.physics.n:
            raise SCPIError(-222, f"port {port} is not in 1..{2 * self.physics.n}")
        return port

    def _port(self, session, sfx, arg) -> str:
        return str(self.physics.peer(self._one_port(arg)))

    def _pmon(self, session, sfx, arg) -> str:
        a = arg.strip()
        m = _LIST.fullmatch(a)
        ports = port_list(m.group(1)) if m else [self._one_port(a)]
        if not ports:
            raise SCPIError(-109, "no ports named")
        top = 2 * self.physics.n
        for q in ports:
            if not 1 <= q <= top:
                raise SCPIError(-222, f"port {q} is not in 1..{top}")
        inputs = self.physics.light_in()
        out = self.physics.transfer(inputs)
        vals = []
        for q in ports:
            mw = inputs.get(q, 0.0) if q <= self.physics.n else out[q]
            vals.append(f"{max(DARK_DBM, 10 * math.log10(mw)) if mw > 0 else DARK_DBM:.2f}")
        return ",".join(vals)
