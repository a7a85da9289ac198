"""The journal's entries, typed: one msgspec Struct per kind of entry, written and read back as
the same type (`Journal.record(Admit(...), cause=...)`, `Journal.entries()`).

An entry's kind is its own column of the journal; its details are the Struct's fields, as JSON
(the fields left at their defaults are not written). Decisions come in five forms: `Admit`,
`Swap`, `Release` and `PhaseIntent` say which in their `action`; `Intent` (the circuits a switch
is to hold, written by the journal itself before the switch moves) has none. The types read
every journal the agent has written, those of version 0.2 and of schema 1 included: what older
agents left out has a default here (a job's name, the whole rank map of an early `rank_map`
entry).

`words(details)` gives an entry's details as a person reads them (`ptb journal`, the GUI's
events view): `swaps: gpu3 → spare0; added: 1 → 18`.
"""
from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, ClassVar

import msgspec

Pairs = list[tuple[int, int]]       # circuits: (input, output), sorted
Point = tuple[str, int, int]        # a circuit of a switch: (switch, input, output)


class Details(msgspec.Struct, kw_only=True, omit_defaults=True):
    """An entry's details; each kind of entry is a subclass naming its `kind`."""
    kind: ClassVar[str] = ""


class Start(Details):
    """An agent started (its switches are reconciled next), with its term: every change it
    sends a device carries it, and a device refuses one below the highest it has taken (None:
    an agent before terms, or one that sends no device changes over the bus)."""
    kind: ClassVar[str] = "start"
    term: int | None = None


class JobFailure(Details):
    """A job reported a failure: the GPUs it lost and the links it found down."""
    kind: ClassVar[str] = "failure"
    gpus: list[str] = []
    links: list[tuple[str, str]] = []
    job: str | None = None


class Detected(Details):
    """A GPU is taken for failed: by its health, the job's report, a loopback or an operator
    (`gpu` is left out by agents before 0.3: the cause names it)."""
    kind: ClassVar[str] = "detected"
    gpu: str = ""
    reasons: list[str] = []
    reason: str = ""


class Decision(Details, tag_field="action"):
    """A decision about a job, before it is acted on; `action` says which."""
    kind: ClassVar[str] = "decision"


class Admit(Decision, tag="admit"):
    """A job taken on: its plan (`JobPlan.to_dict()`), the GPU of each rank, and the key that
    admitted it, whose job it is (None: no one's: admitted on a bus without CURVE, or by an
    agent before owners; then only an operator may act on it)."""
    job: str | None = None          # (None: a journal before jobs had names: the plan's)
    plan: dict[str, Any] = {}
    rank_map: dict[int, str] = {}
    owner: str | None = None

    def name(self) -> str:
        return self.job or str(self.plan.get("name", ""))


class Swap(Decision, tag="swap"):
    """Failed GPUs replaced: by whom, the job's new rank map, and its phase then."""
    job: str | None = None
    failed: list[str] = []
    swaps: dict[str, str] = {}
    rank_map: dict[int, str] = {}
    phase: tuple[str, int] | None = None
    degraded: bool = False


class Release(Decision, tag="release"):
    """A job is done: its GPUs and circuits are freed."""
    job: str | None = None


class Manual(Decision, tag="manual"):
    """An operator's manual change, journaled before the agent makes it: a switch's circuits
    of the operator's own part (`circuits`: the whole part after the change), a device's heater
    volts from channel `first`, or its laser settings; `by`, the key that asked."""
    device: str = ""
    by: str | None = None
    circuits: Pairs | None = None
    first: int | None = None
    volts: list[float] | None = None
    laser: dict[str, Any] | None = None


class PhaseIntent(Decision, tag="phase"):
    """A job's (phase, round) decided, before its circuits are made: durable with their
    intended circuits (one sync), so that a restarted agent names the phase the job was last
    granted exactly. `ahead`: set up while the job computes (it takes the grant from the
    agent's state, `ready`)."""
    job: str | None = None
    phase: str = ""
    round: int = 0
    ahead: bool = False


class Intent(Details):
    """The circuits a switch is to hold, journaled before it is told (a decision without an
    action: the journal writes it with the switch's intended circuits)."""
    kind: ClassVar[str] = "decision"
    switch: str
    circuits: Pairs = []


class SwitchReport(msgspec.Struct, kw_only=True, omit_defaults=True):
    """What a switch reported it changed, and how long it took; `unreadable` says why a report
    could not be read (the switch said it made the circuits)."""
    seconds: float = 0.0
    added: Pairs = []
    removed: Pairs = []
    unreadable: str | None = None


class Applied(Details):
    """A switch's circuits for a job written, as the switch reported."""
    kind: ClassVar[str] = "applied"
    switch: str = ""
    job: str | None = None
    seconds: float = 0.0
    added: Pairs = []
    removed: Pairs = []
    unreadable: str | None = None


class Verified(Details):
    """Light read at circuits' outputs (dBm by "switch:port"): every one bright enough."""
    kind: ClassVar[str] = "verified"
    dbm: dict[str, float] = {}
    dark: list[Point] = []


class VerifyFailed(Verified):
    """Light read at circuits' outputs: those in `dark` too weak."""
    kind: ClassVar[str] = "verify_failed"


class RankMapAnnounced(Details):
    """A job's rank map announced: the ranks that changed (agents before 0.2 wrote the whole
    map as `rank_map`)."""
    kind: ClassVar[str] = "rank_map"
    job: str | None = None
    world: int = 0
    changed: dict[int, str] = {}
    rank_map: dict[int, str] | None = None


class RestartOrder(Details):
    """The job is told to restart on this rank map."""
    kind: ClassVar[str] = "restart"
    job: str | None = None
    rank_map: dict[int, str] = {}


class PhaseSwitched(Details):
    """A job's (phase, round) circuits made (after its grant), or set up ahead while it
    computed (`ahead`), and the switches handed the next phase's circuits (`prestaged`)."""
    kind: ClassVar[str] = "phase"
    phase: str = ""
    round: int = 0
    job: str | None = None
    applied: dict[str, SwitchReport] = {}
    prestaged: list[str] = []
    ahead: bool = False


class Alarm(Details):
    """Something a person has to look at (the text is the entry's cause); what it concerns."""
    kind: ClassVar[str] = "alarm"
    switch: str | None = None
    during: str | None = None
    job: str | None = None
    gpus: list[str] | None = None
    world: int | None = None
    phase: str | None = None
    round: int | None = None
    event: str | None = None
    circuit: list[int] | None = None
    dark: list[list[Any]] | None = None       # [switch, input, output(, dBm)]
    tested: dict[str, bool] | None = None
    recent: int | None = None


class Reconcile(Details):
    """A switch repaired to its intended circuits (`switch`, `added`, `removed`), or the
    reconciliation done (`moves`: circuits changed per switch)."""
    kind: ClassVar[str] = "reconcile"
    switch: str | None = None
    added: Pairs = []
    removed: Pairs = []
    moves: dict[str, int] | None = None


class Note(Details):
    """Something the agent noticed and acted on without a decision of its own."""
    kind: ClassVar[str] = "note"
    job: str | None = None
    gpus: list[str] | None = None
    links: list[tuple[str, str]] | None = None
    swaps: dict[str, str] | None = None
    reasons: list[str] | None = None
    state: str | None = None
    rejoin: dict[str, Any] | None = None      # a job's rejoin request, as it came


class Slow(Details):
    """A GPU of a job computes slower than its peers (hil.agent.gray): a `suspect`, then what
    was decided: a planned `swap`, or none (`no spare`, `watch`: planned swaps are off)."""
    kind: ClassVar[str] = "slow"
    action: str                      # (no default: written in every entry)
    job: str | None = None
    gpu: str = ""
    ratio: float | None = None       # the job's step over its step without this GPU
    steps: int | None = None         # steps since the slowness began
    lost_s: float | None = None      # the job's time it cost since
    price_s: float | None = None     # a planned swap's cost, as last measured


class LinkFade(Details):
    """A circuit whose received light fades or flaps (hil.agent.linkwatch), and what was done:
    `moved` (the chip routes it by other cells: no rank changes), `not moved` (the switch
    cannot, or refused), `still fading` (moved, and the light did not come back: the loss is
    not on the chip's path)."""
    kind: ClassVar[str] = "link"
    action: str                      # (no default: written in every entry)
    switch: str = ""
    circuit: tuple[int, int] | None = None
    src: str = ""                    # the GPUs at its ends
    dst: str = ""
    dbm: float | None = None         # the received power, as fitted now
    db_per_s: float | None = None    # its trend (negative: fading)
    flaps: int | None = None         # dark <-> light changes in the flap window
    avoided: list[tuple[str, int]] = []   # the waveguides the circuit was moved off


class Loopback(Details):
    """A loopback test: whether each GPU hears its own light through the switch."""
    kind: ClassVar[str] = "diagnosis"
    loopback: dict[str, bool] = {}


class Unread(Details):
    """Details not read in their type: an entry of a kind this program does not know, or
    details shortened for publication (`hil.agent.bus`); kept as they came."""
    fields: dict[str, Any] = {}


AnyDecision = Admit | Swap | Release | Manual | PhaseIntent
_TYPES: dict[str, type[Details]] = {t.kind: t for t in (
    Start, JobFailure, Detected, Decision, Applied, Verified, VerifyFailed, RankMapAnnounced,
    RestartOrder, PhaseSwitched, Alarm, Reconcile, Note, Loopback, Slow, LinkFade)}
KINDS = tuple(_TYPES)                # what the agent writes, in this order; the GUI filters on it


def decode(kind: str, details: Mapping[str, Any]) -> Details:
    """Stored details (as JSON has them) in their type; msgspec.ValidationError if they do not
    read as one of that kind, ValueError for a kind not known here."""
    if kind not in _TYPES:
        raise ValueError(f"{kind!r} is not a kind of journal entry "
                         f"({', '.join(KINDS)})")
    if kind == "decision":
        return msgspec.convert(details, AnyDecision if "action" in details else Intent,
                               strict=False)
    return msgspec.convert(details, _TYPES[kind], strict=False)


def builtins(details: Details) -> dict[str, Any]:
    """The details as plain values (what is written), keys in field order."""
    if isinstance(details, Unread):
        return dict(details.fields)
    return msgspec.to_builtins(details)


def _value(v: Any, depth: int = 0) -> str:
    """A value in a few words: pairs as arrows, numbers short."""
    if isinstance(v, bool) or v is None:
        return str(v).lower()
    if isinstance(v, float):
        return f"{v:.4g}" if math.isfinite(v) else str(v)
    if isinstance(v, Mapping):
        if not v:
            return "none"
        if depth >= 1:
            return "{" + ", ".join(f"{k}: {_value(x, depth + 1)}" for k, x in v.items()) + "}"
        return ", ".join(f"{k} → {_value(x, depth + 1)}" if not isinstance(x, Mapping)
                         else f"{k}: {_value(x, depth + 1)}" for k, x in v.items())
    if isinstance(v, (list, tuple)):
        if not v:
            return "none"
        if all(isinstance(x, (list, tuple)) and len(x) == 2 for x in v):
            return ", ".join(f"{_value(a, depth + 1)} → {_value(b, depth + 1)}" for a, b in v)
        return ", ".join(_value(x, depth + 1) for x in v)
    return str(v)


def words(details: Details | Mapping[str, Any], sep: str = "; ") -> str:
    """An entry's details as a person reads them: `swaps: gpu3 → spare0; added: 1 → 18`
    (not raw JSON); a decision's action first."""
    fields = builtins(details) if isinstance(details, Details) else details
    return sep.join(f"{k.replace('_', ' ')}: {_value(v)}" for k, v in fields.items())
