"""Which GPU sits on which port of which switch: the rack's cabling, as plain data.

Every GPU (or server) has one optical transceiver per switch it is cabled to. A transceiver is
a duplex pair of fibres: its transmitter (TX) feeds an *input* port of the switch (1..N) and
its receiver (RX) hears an *output* port (N+1..2N). A rail port p of a Polatis-style OCS is the
pair (ingress p, egress N+p); we cable a server's TX to ingress p and its RX to egress N+p, so
that one "port" in the lab's words is one duplex transceiver.

A link from GPU a to GPU b on a switch is then the circuit a.tx -> b.rx; a bidirectional link
is the two circuits a.tx -> b.rx and b.tx -> a.rx. A ring is a permutation of the transceivers,
so one phase of a job fits any switch that can realise permutations.

The same data serves the emulated rack (which GPU's light enters where), the agent (which
circuits give rank r's GPU its peers) and the rig file (issue 6 reads it as JSON).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any


class LayoutError(ValueError):
    """The rack description is inconsistent (a port used twice, an unknown switch...)."""


@dataclass(frozen=True)
class Attachment:
    """One transceiver of a GPU: its TX on input port `tx`, its RX on output port `rx`."""
    switch: str
    tx: int
    rx: int


@dataclass(frozen=True)
class RackLayout:
    name: str
    switches: dict[str, int]                       # switch name -> N (ports 1..2N)
    gpus: dict[str, tuple[Attachment, ...]]        # every GPU, spares included
    spares: tuple[str, ...] = ()                   # GPUs held back to replace a failed one
    description: str = ""

    def __post_init__(self) -> None:
        used: dict[tuple[str, int], str] = {}
        for spare in self.spares:
            if spare not in self.gpus:
                raise LayoutError(f"spare {spare!r} is not a GPU of rack {self.name!r}")
        for gpu, atts in self.gpus.items():
            seen = set()
            for a in atts:
                if a.switch not in self.switches:
                    raise LayoutError(f"GPU {gpu!r} is cabled to unknown switch {a.switch!r}")
                if a.switch in seen:
                    raise LayoutError(f"GPU {gpu!r} has two transceivers on switch {a.switch!r}")
                seen.add(a.switch)
                n = self.switches[a.switch]
                if not 1 <= a.tx <= n:
                    raise LayoutError(f"GPU {gpu!r}: TX port {a.tx} is not an input 1..{n} "
                                      f"of {a.switch!r}")
                if not n < a.rx <= 2 * n:
                    raise LayoutError(f"GPU {gpu!r}: RX port {a.rx} is not an output "
                                      f"{n + 1}..{2 * n} of {a.switch!r}")
                for port in (a.tx, a.rx):
                    other = used.setdefault((a.switch, port), gpu)
                    if other != gpu:
                        raise LayoutError(f"port {port} of {a.switch!r} is cabled to both "
                                          f"{other!r} and {gpu!r}")

    @property
    def workers(self) -> tuple[str, ...]:
        """GPUs that are not spares, in rack order (rank r starts on workers[r])."""
        return tuple(g for g in self.gpus if g not in self.spares)

    def attachment(self, gpu: str, switch: str) -> Attachment | None:
        try:
            atts = self.gpus[gpu]
        except KeyError:
            raise LayoutError(f"no GPU {gpu!r} in rack {self.name!r}") from None
        for a in atts:
            if a.switch == switch:
                return a
        return None

    def owner(self, switch: str, port: int) -> str | None:
        """The GPU whose fibre is on this port, or None."""
        for gpu, atts in self.gpus.items():
            for a in atts:
                if a.switch == switch and port in (a.tx, a.rx):
                    return gpu
        return None

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "description": self.description,
                "switches": dict(self.switches),
                "gpus": {g: [{"switch": a.switch, "tx": a.tx, "rx": a.rx} for a in atts]
                         for g, atts in self.gpus.items()},
                "spares": list(self.spares)}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "RackLayout":
        try:
            return cls(name=str(d["name"]), description=str(d.get("description", "")),
                       switches={str(k): int(v) for k, v in d["switches"].items()},
                       gpus={str(g): tuple(Attachment(str(a["switch"]), int(a["tx"]), int(a["rx"]))
                                           for a in atts) for g, atts in d["gpus"].items()},
                       spares=tuple(str(s) for s in d.get("spares", ())))
        except (KeyError, TypeError, AttributeError, ValueError) as e:
            if isinstance(e, LayoutError):
                raise
            raise LayoutError(f"not a rack description: {e!r}") from None


def duplex_rack(name: str, switch: str, ports: int, workers: int, spares: int = 0,
                description: str = "", prefix: str = "gpu", spare_prefix: str = "spare"
                ) -> RackLayout:
    """GPUs on consecutive duplex ports 1, 2, ... of one switch, spares after the workers."""
    names = [f"{prefix}{i}" for i in range(workers)] + [f"{spare_prefix}{i}" for i in range(spares)]
    if len(names) > ports:
        raise LayoutError(f"{len(names)} GPUs do not fit on a {ports} x {ports} switch")
    gpus: dict[str, tuple[Attachment, ...]] = {
        g: (Attachment(switch, i + 1, ports + i + 1),) for i, g in enumerate(names)}
    return RackLayout(name, {switch: ports}, gpus, tuple(names[workers:]), description)


def lumion() -> RackLayout:
    """8 GPUs and 2 spares on the 16 x 16 chip (LUMION's rack-scale failover set-up)."""
    return duplex_rack("lumion", "chip", 16, 8, 2,
                       "8 GPUs + 2 spares, one duplex transceiver each on the 16 x 16 chip")


def opus() -> RackLayout:
    """8 servers with one rail port each on the 32 x 32 OCS (Opus's time-multiplexed rails)."""
    return duplex_rack("opus", "ocs", 32, 8, 0,
                       "8 servers, one rail port each (ingress p, egress 32+p) on the 32 x 32 OCS",
                       prefix="server")


LAYOUTS = {"lumion": lumion, "opus": opus}


def layout(name: str) -> RackLayout:
    try:
        return LAYOUTS[name]()
    except KeyError:
        raise LayoutError(f"no rack layout {name!r}; known: {', '.join(sorted(LAYOUTS))}") from None
