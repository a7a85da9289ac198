"""Gray failures: a GPU that goes slow without failing, found from the job's own timings and
replaced by a planned swap at a step boundary, when that costs less than the slowness.

A data-parallel step is as slow as its slowest rank: the others wait for it in the gradient
all-reduce. The job sends the agent each rank's seconds a step computing and waiting in
collectives (`job_timings`). Whatever makes a GPU late (its kernels slower, its process held
between steps, its part of a collective slower), the sign is the same: it waits less than its
peers, who wait for it. A whole job that gets slower (a bigger batch, a loaded host) moves
every rank together: nobody waits for anyone more than before, nothing is done.

Detection is an online change test per GPU that a loaded CPU cannot fool: each step, every
GPU's wait is compared with the job's median wait for that step. A healthy GPU waits less than
the median in half of the steps, whatever the load does to all of them (the ranks are alike); a
slow one in nearly every step. Over the last WINDOW steps a GPU is a suspect when it waited
less in at least ABOVE of them (a sign test: a healthy GPU does so by chance with probability
about 1.5e-6 per window), or, for a milder slowdown, in LONG_ABOVE of the last LONG steps
(about 5e-4), and when it made the job's steps at least MIN_RATIO longer than they would be
without it (the step's time over the step less what the others waited for it; median over the
window): a real slowdown, not a GPU a hair slower than its peers. The sign test ignores how far
one step is off, so one rank descheduled for a step counts no more than a step of a slow GPU.
How many steps it takes, and how often a healthy GPU is suspected, on the PyTorch job and in
tests/test_gray.py's noise (the ranks' steps varying by tens of percent, stalls, the whole job
slowing): BENCHMARKS.md (`ptb bench gray`).

Acting is decided as a ski rental: the time the slowness has cost since its onset (what the
others waited for it, summed over the steps) is the rent; the planned swap's stall, as last
measured (the job reports each one), is the price. Once the rent paid reaches the price, and a
spare is there, the agent decides to swap: it journals why (`Slow` entries: the suspect, then the
decision or why not) and answers the job's next report with a `handover`. The job brings its
ranks to a step boundary, then asks `handover` for that GPU: the failover runs then (circuits
changed and verified while no collective is in flight), and the restart order starts the
generation in which the spare holds the rank. The slow GPU stays out of the spares for the
quarantine, as a failed one.
"""
from __future__ import annotations

import logging
import math
import statistics
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from photonic_testbed.hil.agent.entries import Slow

if TYPE_CHECKING:
    from photonic_testbed.hil.agent.agent import Agent

log = logging.getLogger(__name__)

WINDOW, ABOVE = 24, 23     # waited less than the step's median in ABOVE of WINDOW steps
LONG, LONG_ABOVE = 96, 64  # or in LONG_ABOVE of the last LONG steps (a milder slowdown)
MIN_RATIO = 1.1            # a suspect made the job's steps this much longer, at least
MAX_RATIO = 100.0
MIN_RANKS = 3              # fewer ranks give no median to judge one by
KEPT_STEPS = 64            # steps waiting for their last rank's row, at most
STALLS_KEPT = 5            # the price of a swap: the median of the last few measured
MAX_STALL_S = 60.0         # a stall reported longer is taken as this
SAID_EVERY_S = 60.0        # a GPU's suspicion is journaled at most this often


class GrayError(ValueError):
    """A handover asked of a GPU the agent has not decided to swap."""


def _kept() -> deque:
    return deque(maxlen=LONG)


@dataclass
class _Gpu:
    below: deque = field(default_factory=_kept)      # 1: waited less than the step's median
    ratios: deque = field(default_factory=_kept)     # the job's step over the step without it
    late: deque = field(default_factory=_kept)       # seconds the others waited for it
    waits: deque = field(default_factory=_kept)
    peers_wait: deque = field(default_factory=_kept)
    lost_s: float = 0.0         # the job's time it cost since it became a suspect
    steps: int = 0              # steps since then (the window's included)
    episode: int = 0            # how many times it became a suspect


@dataclass
class Verdict:
    """What one step's timings made of a GPU: a suspect, and whether to swap it now."""
    gpu: str
    ratio: float           # the job's step over the step it would take without it
    steps: int             # steps since the onset
    below: int             # steps of the window it waited less than the median in
    lost_s: float
    wait_s: float          # its median wait in collectives, recent steps
    peers_wait_s: float    # the job's median wait, the same steps
    window: int = WINDOW
    episode: int = 0       # the GPU's how-manieth time as a suspect

    def why(self, price_s: float) -> str:
        return (f"the job waits for {self.gpu} in its collectives: it waits "
                f"{self.wait_s * 1e3:.0f} ms a step where the job waits "
                f"{self.peers_wait_s * 1e3:.0f} ms, less than the job in {self.below} of the "
                f"last {self.window} steps (a healthy GPU: half); its steps take "
                f"{self.ratio:.2f}x what they would without it: this GPU is slow, not the job; "
                f"it has cost "
                f"{self.lost_s:.2f} s since its onset, against "
                f"{price_s:.3f} s for a planned swap")


class Detector:
    """The change test of one job's GPUs (no I/O: rows in, verdicts out)."""

    def __init__(self, above: int = ABOVE):
        self.needed = above
        self.gpus: dict[str, _Gpu] = {}
        self._steps: dict[tuple[int, int], dict[str, tuple[float, float]]] = {}

    def feed(self, rows: Iterable[Sequence[Any]], members: Sequence[str]) -> list[Verdict]:
        """Rows `(gpu, generation, step, compute_s, wait_s)` of the GPUs in `members` (the
        job's rank map now; others' rows are dropped); a verdict for each suspect of each
        step that every member has reported."""
        out: list[Verdict] = []
        want = set(members)
        for name in [g for g in self.gpus if g not in want]:
            del self.gpus[name]               # swapped out: its series ends
        for gpu, gen, step, compute, wait in rows:
            if gpu in want:
                self._steps.setdefault((int(gen), int(step)), {})[gpu] = (float(compute),
                                                                         float(wait))
        for key in sorted(self._steps):
            got = self._steps[key]
            if want <= set(got):
                del self._steps[key]
                out += self._judge({g: got[g] for g in want})
        if len(self._steps) > KEPT_STEPS:            # a rank's rows never came: let go
            for key in sorted(self._steps)[:-KEPT_STEPS]:
                del self._steps[key]
        return out

    def _judge(self, step: dict[str, tuple[float, float]]) -> list[Verdict]:
        if len(step) < MIN_RANKS:
            return []
        waits = {g: w for g, (_, w) in step.items()}
        median_wait = statistics.median(waits.values())
        took = statistics.median(c + w for c, w in step.values())    # the job's step
        if not took > 0:
            return []
        out = []
        for gpu, wait in waits.items():
            s = self.gpus.setdefault(gpu, _Gpu())
            late = median_wait - wait           # what the others waited for it, this step
            s.below.append(1 if wait < median_wait else 0)
            s.ratios.append(took / max(took - late, took / MAX_RATIO))
            s.late.append(late)
            s.waits.append(wait)
            s.peers_wait.append(median_wait)
            n = self._window(s)
            if n is None:
                if s.steps:
                    s.lost_s, s.steps = 0.0, 0
                continue
            tail = slice(len(s.below) - n, None)
            if s.steps == 0:                   # the window's cost is the rent paid so far
                s.lost_s = sum(max(0.0, x) for x in list(s.late)[tail])
                s.steps = n
                s.episode += 1
            else:
                s.lost_s += max(0.0, late)
                s.steps += 1
            out.append(Verdict(gpu, statistics.median(list(s.ratios)[tail]), s.steps,
                               sum(list(s.below)[tail]), s.lost_s,
                               statistics.median(list(s.waits)[tail]),
                               statistics.median(list(s.peers_wait)[tail]), window=n,
                               episode=s.episode))
        return out

    def _window(self, s: _Gpu) -> int | None:
        """The window (steps) over which `s` is a suspect, short first; None: it is not."""
        for n, needed in ((WINDOW, self.needed), (LONG, LONG_ABOVE)):
            if len(s.below) >= n and sum(list(s.below)[-n:]) >= needed and \
                    statistics.median(list(s.ratios)[-n:]) >= MIN_RATIO:
                return n
        return None


class GrayWatch:
    """The agent's side: each job's detector, the ski-rental decision, the journal, and the
    `job_timings` / `handover` operations (their callers checked by `job_of`). Runs on the
    agent's loop (the server's handlers)."""

    def __init__(self, agent: Agent, job_of: Callable[[str | None, str], str | None]):
        self.agent = agent
        self.job_of = job_of
        self.detectors: dict[str, tuple[Any, Detector]] = {}   # job -> (its Job, detector)
        self.decided: dict[str, tuple[str, str, str]] = {}   # job -> (gpu, why, to whom)
        self.warm: dict[str, set[str]] = {}       # job -> where it keeps warm standbys
        self.stalls: dict[str, deque[float]] = {}         # job -> its planned swaps' stalls
        self.priced: set[str] = set()        # jobs whose last handover's stall is awaited
        # (job, gpu) -> {action: (episode, when)}: what the journal said of a GPU's slowness
        self.said: dict[tuple[str, str], dict[str, tuple[int, float]]] = {}

    def price_s(self, job: str) -> float:
        """A planned swap's cost to `job`: the median of its last stalls measured (one swap
        whose spare had to wait is not the price of the next), or the setting until one is."""
        got = self.stalls.get(job)
        return statistics.median(got) if got else self.agent.config.gray_swap_cost_s

    def handlers(self) -> dict[str, Callable[[Any], dict]]:
        return {"job_timings": self.timings, "handover": self.handover}

    def _detector(self, job: Any) -> Detector:
        """The job's detector; a new one (and nothing decided) for a job admitted anew."""
        got = self.detectors.get(job.name)
        if got is None or got[0] is not job:
            got = self.detectors[job.name] = (job, Detector(self.agent.config.gray_above))
            self.decided.pop(job.name, None)
            self.said = {k: v for k, v in self.said.items() if k[0] != job.name}
        return got[1]

    def timings(self, args: Any) -> dict:
        job = self.agent.job(self.job_of(args.job, "report the timings of"))
        if args.swap_stall_s is not None and job.name in self.priced:
            self.priced.discard(job.name)        # (one stall per handover it asked for)
            self.stalls.setdefault(job.name, deque(maxlen=STALLS_KEPT)).append(
                min(float(args.swap_stall_s), MAX_STALL_S))
        det = self._detector(job)
        self.warm[job.name] = set(args.warm)
        members = [g for _, g in sorted(job.rank_map.items())]
        for v in det.feed(args.rows, members):
            self._consider(job.name, v)
        got = self.decided.get(job.name)
        if got is not None and got[0] not in job.rank_map.values():
            del self.decided[job.name]          # (swapped out by a failure meanwhile)
            got = None
        return {"job": job.name,
                "handover": {"gpu": got[0], "why": got[1], "to": got[2]} if got else None}

    def _say(self, job: str, v: Verdict, action: str, text: str, **extra: Any) -> None:
        """Journal `action` for this GPU once an episode (a suspect only first), and the same
        action but a swap at most once every SAID_EVERY_S (a slowness that comes and goes
        says so once, not at every turn)."""
        now = time.monotonic()
        said = self.said.setdefault((job, v.gpu), {})
        episode, when = said.get(action, (-1, -math.inf))
        if episode == v.episode or action == "suspect" and any(
                e == v.episode for e, _ in said.values()) or \
                action != "swap" and now - when < SAID_EVERY_S:
            return
        said[action] = (v.episode, now)
        self.agent.journal.record(Slow(job=job, gpu=v.gpu, action=action,
                                       ratio=round(v.ratio, 3), steps=v.steps,
                                       lost_s=round(v.lost_s, 4), **extra), text)

    def _consider(self, job: str, v: Verdict) -> None:
        price = self.price_s(job)
        why = v.why(price)
        self._say(job, v, "suspect", why)
        if job in self.decided or v.lost_s < price:
            return
        if not self.agent.config.gray_swaps:
            action, text = "watch", f"{why}; planned swaps are off (--gray-swaps false)"
        elif not (usable := self._usable(job, v.gpu)):
            action, text = "no spare", f"{why}; no spare can take its place: the job runs slow"
        else:
            warm = self.warm.get(job, set())
            to = next((g for g in usable if g in warm), usable[0])
            action, text = "swap", f"{why}: a planned swap at the job's next step boundary, " \
                f"to {to}"
            self.decided[job] = (v.gpu, text, to)
        self._say(job, v, action, text, price_s=round(price, 4))

    def _usable(self, job: str, gpu: str) -> list[str]:
        """The spares that can take `gpu`'s place in `job` alone (no shrinking, no server
        moved), in the agent's order."""
        j = self.agent.jobs.get(job)
        if j is None:
            return []
        return [s for s in self.agent.spares()
                if self.agent.failover.cost(j, gpu, s) is not None]

    def handover(self, args: Any) -> dict:
        """The job stands at a step boundary: the GPU the agent decided to swap is swapped
        now, for a spare that can take its place alone (one where the job keeps a warm
        standby first), circuits changed and verified; the restart order follows. Refused
        when the GPU is not the one decided for this job, no longer this job's, or no spare
        can take its place: the job then releases its ranks."""
        job = self.agent.job(self.job_of(args.job, "hand over a GPU of"))
        self._detector(job)                      # (a job admitted anew decided nothing)
        got = self.decided.get(job.name)
        if got is None or got[0] != args.gpu:
            raise GrayError(f"{args.gpu} of job {job.name} is not to be swapped: the agent "
                            "decided no planned swap of it" +
                            (f" (it decided one of {got[0]})" if got else ""))
        del self.decided[job.name]
        gpu, why, to = got
        holder = self.agent.holder(gpu)
        if holder is not job:
            raise GrayError(f"{gpu} holds no rank of job {job.name} any more")
        usable = self._usable(job.name, gpu)
        if not usable:
            raise GrayError(f"no spare can take {gpu}'s place in job {job.name} now: the "
                            "job runs on, slow")
        warm = set(args.warm)
        among = [to] if to in usable and to in warm else \
            [s for s in usable if s in warm] or usable
        out = self.agent.swap_out(gpu, f"planned swap of slow {gpu}", why=why, among=among)
        if out is None or not out.swaps:
            raise GrayError(f"{gpu} of job {job.name} was not swapped")
        self.priced.add(job.name)
        return {"job": job.name, "swaps": dict(out.swaps), "latency_s": out.latency_s,
                "rank_map": {str(r): g for r, g in out.rank_map.items()}}
