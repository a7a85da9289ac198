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

import functools
from dataclasses import dataclass, field
from typing import Any


class LayoutError(ValueError):
    """The rack description is inconsistent (a port used twice, an unknown switch...)."""


# The weakest light a transceiver's receiver decodes: the emulated rack's receivers hear down
# to it, and the agent verifies a circuit by it (its default verification threshold).
RECEIVER_SENSITIVITY_DBM = -12.0


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
    # GPU -> its server: GPUs of one server talk over the server's own scale-up fabric
    # (NVLink), so a link between them needs no circuit. Empty: every GPU on its own.
    servers: dict[str, str] = field(default_factory=dict)

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

    @functools.cached_property
    def _ports(self) -> dict[tuple[str, int], str]:
        """(switch, port) -> the GPU cabled there: one dict, so that a lookup does not cost
        the rack (a 2,048-GPU rack asks it once per circuit of a decision)."""
        return {(a.switch, port): gpu for gpu, atts in self.gpus.items() for a in atts
                for port in (a.tx, a.rx)}

    @functools.cached_property
    def _attachments(self) -> dict[tuple[str, str], Attachment]:
        return {(gpu, a.switch): a for gpu, atts in self.gpus.items() for a in atts}

    def attachment(self, gpu: str, switch: str) -> Attachment | None:
        if gpu not in self.gpus:
            raise LayoutError(f"no GPU {gpu!r} in rack {self.name!r}")
        return self._attachments.get((gpu, switch))

    def owner(self, switch: str, port: int) -> str | None:
        """The GPU whose fibre is on this port, or None."""
        return self._ports.get((switch, port))

    @functools.cached_property
    def wiring(self) -> tuple[dict[str, str | None], dict[str, tuple[tuple[str, int], ...]],
                              dict[str, dict[str, int]]]:
        """Per GPU: its server (None: on its own), its (switch, TX port)s and {switch: RX
        port}: what working out many circuits looks up, without a call per lookup."""
        return ({g: self.servers.get(g) for g in self.gpus},
                {g: tuple((a.switch, a.tx) for a in atts) for g, atts in self.gpus.items()},
                {g: {a.switch: a.rx for a in atts} for g, atts in self.gpus.items()})

    @functools.cached_property
    def server_gpus(self) -> dict[str, tuple[str, ...]]:
        """server -> its GPUs, in rack order."""
        out: dict[str, list[str]] = {}
        for g in self.gpus:
            if g in self.servers:
                out.setdefault(self.servers[g], []).append(g)
        return {k: tuple(v) for k, v in out.items()}

    @functools.cached_property
    def links_between(self) -> _LinkTable:
        return _LinkTable(self)

    @functools.cached_property
    def _switch_sets(self) -> dict[str, frozenset[str]]:
        return {g: frozenset(a.switch for a in atts) for g, atts in self.gpus.items()}

    def reaches(self, a: str, b: str) -> bool:
        """Whether GPU a's light can reach GPU b: over their server's own fabric, or through a
        switch both are cabled to."""
        sets = self._switch_sets
        return not sets[a].isdisjoint(sets[b]) or self.same_server(a, b)

    def same_server(self, a: str, b: str) -> bool:
        """Whether two GPUs share a server (and talk without the optical fabric)."""
        server = self.servers.get(a)
        return server is not None and server == self.servers.get(b)

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "description": self.description,
                "switches": dict(self.switches),
                "gpus": {g: [{"switch": a.switch, "tx": a.tx, "rx": a.rx} for a in atts]
                         for g, atts in self.gpus.items()},
                "spares": list(self.spares),
                **({"servers": dict(self.servers)} if self.servers else {})}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> RackLayout:
        try:
            return cls(name=str(d["name"]), description=str(d.get("description", "")),
                       switches={str(k): int(v) for k, v in d["switches"].items()},
                       gpus={str(g): tuple(Attachment(str(a["switch"]), int(a["tx"]), int(a["rx"]))
                                           for a in atts) for g, atts in d["gpus"].items()},
                       spares=tuple(str(s) for s in d.get("spares", ())),
                       servers={str(g): str(v) for g, v in d.get("servers", {}).items()})
        except (KeyError, TypeError, AttributeError, ValueError) as e:
            if isinstance(e, LayoutError):
                raise
            raise LayoutError(f"not a rack description: {e!r}") from None


class _LinkTable:
    """The circuits that carry one GPU's light to another, {(ga, gb): [(switch, tx, rx)]},
    worked out once per pair ([] inside a server; None when they share no switch)."""

    def __init__(self, layout: RackLayout):
        self._layout = layout
        self._by_gpu = {g: {a.switch: a for a in atts} for g, atts in layout.gpus.items()}
        self._cache: dict[tuple[str, str], list[tuple[str, int, int]] | None] = {}

    def __call__(self, ga: str, gb: str) -> list[tuple[str, int, int]] | None:
        key = (ga, gb)
        if key in self._cache:
            return self._cache[key]
        got: list[tuple[str, int, int]] | None
        if self._layout.same_server(ga, gb):
            got = []
        else:
            peer = self._by_gpu[gb]
            got = [(s, a.tx, peer[s].rx) for s, a in self._by_gpu[ga].items() if s in peer]
            got = got or None
        if len(self._cache) > 1_000_000:       # a rack's pairs in use stay far below this
            self._cache.clear()
        self._cache[key] = got
        return got


CABLINGS = ("consecutive", "alternate")


def duplex_rack(name: str, switch: str, ports: int, workers: int, spares: int = 0,
                description: str = "", prefix: str = "gpu", spare_prefix: str = "spare",
                cabling: str = "consecutive") -> RackLayout:
    """GPUs on duplex ports of one switch, spares after the workers: on consecutive ports 1,
    2, ..., or ("alternate") on the odd ports 1, 3, ... first, then the even ones. On a Benes
    chip the two differ: with the GPUs on the first ports, which waveguides carry their light
    is the same for every routing (each cell of the first and last stages takes two of them,
    and so on inwards), so no routing can take a link off a waveguide that fades; on
    alternate ports each of those cells takes one, and every inner waveguide of a link's path
    can be avoided (`drivers.routing.avoiding`)."""
    if cabling not in CABLINGS:
        raise LayoutError(f"cabling is one of {', '.join(CABLINGS)}, not {cabling!r}")
    names = [f"{prefix}{i}" for i in range(workers)] + [f"{spare_prefix}{i}" for i in range(spares)]
    if len(names) > ports:
        raise LayoutError(f"{len(names)} GPUs do not fit on a {ports} x {ports} switch")
    order = list(range(1, ports + 1))
    if cabling == "alternate":
        order = order[::2] + order[1::2]
    gpus: dict[str, tuple[Attachment, ...]] = {
        g: (Attachment(switch, p, ports + p),) for g, p in zip(names, order, strict=False)}
    return RackLayout(name, {switch: ports}, gpus, tuple(names[workers:]), description)


def rail_rack(name: str, servers: int, rails: int = 8, spare_servers: int = 1,
              pod: int | None = None, description: str = "") -> RackLayout:
    """Servers of `rails` GPUs each, GPU l of every server on rail l (Opus's rail-optimised
    fabric): rail l's ports are served by OCSes `rail{l}` (one, large enough for every server)
    or, with `pod` (ports per OCS), `rail{l}-pod{k}`, each serving `pod` consecutive servers
    (a server's NIC is cabled to its pod's OCS). The last `spare_servers` servers of every pod
    (of the rack without pods) are spares. GPUs are named `s{server}g{l}`; GPUs of one server
    share its scale-up fabric (`servers`)."""
    if servers < 1 or rails < 1 or spare_servers < 0:
        raise LayoutError("a rail rack needs servers >= 1, rails >= 1, spare_servers >= 0")
    per_pod = pod or servers
    pods = -(-servers // per_pod)
    switches: dict[str, int] = {}
    gpus: dict[str, tuple[Attachment, ...]] = {}
    owners: dict[str, str] = {}
    spares: list[str] = []
    for k in range(pods):
        members = range(k * per_pod, min(servers, (k + 1) * per_pod))
        for lane in range(rails):
            sw = f"rail{lane}" if pod is None else f"rail{lane}-pod{k}"
            switches[sw] = pod or servers
            for p, srv in enumerate(members, start=1):
                g = f"s{srv}g{lane}"
                gpus[g] = (Attachment(sw, p, switches[sw] + p),)
                owners[g] = f"s{srv}"
        spare_ids = set(list(members)[len(members) - spare_servers:]) if spare_servers else set()
        spares += [f"s{srv}g{lane}" for srv in sorted(spare_ids) for lane in range(rails)]
    order = sorted(gpus, key=lambda g: (g in spares, int(g[1:].split("g")[0]),
                                        int(g.split("g")[1])))
    return RackLayout(name, switches, {g: gpus[g] for g in order}, tuple(spares),
                      description or f"{servers} servers of {rails} GPUs on {rails} rails",
                      owners)


def lumion(cabling: str = "consecutive") -> RackLayout:
    """8 GPUs and 2 spares on the 16 x 16 chip (LUMION's rack-scale failover set-up)."""
    return duplex_rack("lumion", "chip", 16, 8, 2,
                       f"8 GPUs + 2 spares, one duplex transceiver each on the 16 x 16 chip"
                       f"{', on alternate ports' if cabling == 'alternate' else ''}",
                       cabling=cabling)


def opus(cabling: str = "consecutive") -> RackLayout:
    """8 servers with one rail port each on the 32 x 32 OCS (Opus's time-multiplexed rails),
    and 2 spare servers on the next ports."""
    return duplex_rack("opus", "ocs", 32, 8, 2,
                       "8 servers and 2 spares, one rail port each (ingress p, egress 32+p) on "
                       "the 32 x 32 OCS", prefix="server", cabling=cabling)


LAYOUTS = {"lumion": lumion, "opus": opus}


def layout(name: str) -> RackLayout:
    try:
        return LAYOUTS[name]()
    except KeyError:
        raise LayoutError(f"no rack layout {name!r}; known: {', '.join(sorted(LAYOUTS))}") from None
