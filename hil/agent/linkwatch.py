"""Links that fade or flap: found from the light their receivers report, moved to another path
through the chip while the job runs, with no rank changed.

A waveguide that loses light a little more every minute (a contaminated cladding, a bend
relaxing) takes the link's margin before it takes the link: the transceiver falls back to half
rate with less than HALF_RATE_MARGIN_DB above its sensitivity, then goes dark. About every
PERIOD_S (jittered, so that a flap of that period is not sampled at one phase) the agent reads
every circuit's received power (the transceivers' DDM, as it verifies circuits) and keeps each
circuit's readings of the last KEPT_S, whatever phases come and go.

- A circuit fades when, over one of the WINDOWS_S (the last 4 s for a fast fade, up to the last
  128 s for a slow one), its power fell in each quarter of the window below the one before, by
  more than three standard errors (a step, a circuit set again by other cells, falls once: not
  a fade), by at least MIN_FALL_DB in all, and, at the fitted slope, comes within GUARD_DB of
  the half-rate threshold within HORIZON_S (or is there already).
- It flaps when it went dark and came back FLAPS times within FLAP_S (dark below the
  verification threshold less HYSTERESIS_DB, lit above it plus as much: noise at the threshold
  is neither).
- A reading that could not be had (a monitor that did not answer) is no reading, not a dark one;
  a switch whose monitor did not answer is skipped for BACKOFF_S. A steady circuit with little
  margin is not acted on.

Acting is cheap and changes no rank: the switch routes the circuit by other cells
(`move(inputs, healthy)`, on a Benes chip `drivers.mesh.Mesh.move`: every waveguide it crossed
is avoided from then on, but those of circuits whose light is full, which narrows what is
avoided to where the loss can be). The journal says why (`LinkFade` entries, `moved`, with the
power and its slope, or the flaps counted). SETTLE_S after the move the readings since say
whether it helped: if so the circuit is watched afresh; if not (the loss is in a fibre or a
transceiver, which no routing avoids) the journal says so (`still fading`) and the circuit is
left to the fail-stop path for GIVE_UP_S, as after a move refused (`not moved`: the cabling
leaves no other path), and as when a circuit would be moved a third time within LATELY_S (a
flap in a fibre can look helped for a while); a move that got no answer is asked again at the
next reading, MOVE_TRIES times in all. Only switches that can move a circuit are watched (a
chip's service offers `move_circuits`; an OCS's does not).

Everything runs on the agent's loop (`tick`, called each step, works about every PERIOD_S and
never raises: what goes wrong is logged, the agent goes on).
"""
from __future__ import annotations

import logging
import math
import random
import statistics
import time
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from photonic_testbed.hil.agent.entries import LinkFade
from photonic_testbed.hil.bus.errors import BadRequest, BusError

if TYPE_CHECKING:
    from photonic_testbed.hil.agent.agent import Agent

log = logging.getLogger(__name__)

PERIOD_S = 1.0            # the circuits' power is read about this often (+-30 %)
KEPT_S = 130.0            # a circuit's readings are kept this long
WINDOWS_S = (4.0, 8.0, 16.0, 32.0, 64.0, 128.0)   # a fade is looked for over each of these
MIN_POINTS, MIN_SPAN = 4, 0.6     # ... with this many readings at least, over this share of it
MIN_FALL_DB = 1.0         # a fade lost at least this much over its window
MIN_STEP_DB = 0.05        # ... and at least this much from each quarter to the next
HORIZON_S = 60.0          # act when the half-rate threshold is this near at the fitted slope
GUARD_DB = 1.0            # ... or the power within this of it
HALF_RATE_MARGIN_DB = 3.0  # a transceiver with less margin than this runs at half rate
FLAPS, FLAP_S = 3, 30.0   # this many dark <-> light changes within this long: a flap
HYSTERESIS_DB = 1.0       # dark below the threshold less this, lit above it plus this
SETTLE_S = 3.0            # after a move, the readings this long after tell whether it helped
GIVE_UP_S = 600.0         # a circuit a move did not help (or was refused for) is left this long
LATELY_S = 120.0          # a third move of a circuit within this long is not made
MOVE_TRIES = 3            # a move that got no answer is asked again, this many times in all
BACKOFF_S = 10.0          # a switch whose monitor did not answer is not read for this long
FLOOR_DBM, CEILING_DBM = -60.0, 10.0     # readings are read as dark below; above: not readings

Point = tuple[str, int, int]      # (switch, input, output)


class LinkWatch:
    """Each circuit's recent power, the fade and flap tests, and the moves (module doc).
    `read(switch, port)`: dBm, or None where there is no reading (the agent's received power;
    by default its diagnosis's, whose unanswered reads are dark)."""

    def __init__(self, agent: Agent, read: Callable[[str, int], float | None] | None = None,
                 clock: Callable[[], float] = time.monotonic, seed: int = 0):
        self.agent = agent
        self.read = read or agent.diagnosis.read_power
        self.clock = clock
        self.rng = random.Random(seed)
        self.readings: dict[Point, deque[tuple[float, float]]] = {}
        # circuit -> (when it was moved, its power then, its power before it faded; None for
        # a flap), until the readings after it say whether it helped
        self.moved: dict[Point, tuple[float, float, float | None]] = {}
        self.moves: dict[Point, list[float]] = {}    # circuit -> when it was moved, lately
        self.given_up: dict[Point, float] = {}       # circuit -> until when it is left alone
        self.tries: dict[Point, int] = {}            # moves that got no answer, in a row
        self.skip_until: dict[str, float] = {}       # switch -> not read before
        self._next = 0.0
        agent.diagnosis.on_moved = self.moved_elsewhere   # a job's failure moved one

    def moved_elsewhere(self, p: Point) -> None:
        """A circuit the diagnosis of a job's failure moved off its path: judged from now on
        as a move of the watch's own (steady light after it, or it is said and left)."""
        now = self.clock()
        got = self.readings.get(p)
        self.moved[p] = (now, got[-1][1] if got else FLOOR_DBM, None)
        self.moves.setdefault(p, []).append(now)

    @property
    def half_rate_dbm(self) -> float:
        return self.agent.config.verify_dbm + HALF_RATE_MARGIN_DB

    @staticmethod
    def movable(switch: Any) -> bool:
        """Whether the switch can route a circuit by other paths (a chip; not an OCS, whose
        circuits are watched as any circuit is, by the fail-stop path)."""
        return callable(getattr(switch, "move", None)) and getattr(switch, "can_move", True)

    def tick(self) -> None:
        """Read the circuits' power and act on fades and flaps, about every PERIOD_S; never
        raises (what goes wrong is logged)."""
        now = self.clock()
        if now < self._next or not self.agent.config.link_moves:
            return
        self._next = now + PERIOD_S * self.rng.uniform(0.7, 1.3)
        try:
            self._tick(now)
        except Exception:
            log.exception("link watch: a reading or a move went wrong; watching on")

    def _tick(self, now: float) -> None:
        agent = self.agent
        for p in [p for p, got in self.readings.items() if not got or got[-1][0] < now - KEPT_S]:
            del self.readings[p]
        seen: dict[Point, float] = {}
        for s, sw in agent.switches.items():
            if not self.movable(sw) or self.skip_until.get(s, 0.0) > now:
                continue
            for i, o in sorted(agent.writer.current(s).items()):
                dbm = self._reading(s, o)
                if dbm is None:
                    self.skip_until[s] = now + BACKOFF_S
                    break
                seen[(s, i, o)] = dbm
        for p, dbm in seen.items():
            got = self.readings.setdefault(p, deque())
            got.append((now, dbm))
            while got[0][0] < now - KEPT_S:
                got.popleft()
        for p in seen:
            self._judge(p, now, seen)

    def _reading(self, switch: str, port: int) -> float | None:
        got = self.read(switch, port)
        if got is None:
            return None
        dbm = float(got)
        if math.isnan(dbm) or dbm > CEILING_DBM:
            log.warning("link watch: %s:%d reports %r dBm: not a reading", switch, port, got)
            return None
        return max(dbm, FLOOR_DBM)

    # --- verdicts -------------------------------------------------------------------------
    def _judge(self, p: Point, now: float, seen: dict[Point, float]) -> None:
        got = self.readings[p]
        if self.given_up.get(p, -math.inf) > now:
            return
        moved = self.moved.get(p)
        if moved is not None:
            if now - moved[0] >= SETTLE_S:
                self._after_move(p, moved, now)
            return
        flaps = self.flaps(got, now)
        if flaps >= FLAPS:
            self._move(p, now, seen, flaps=flaps)
            return
        fade = self.fade(got, now)
        if fade is not None:
            self._move(p, now, seen, fade=fade)

    def _after_move(self, p: Point, moved: tuple[float, float, float | None],
                    now: float) -> None:
        """Whether the move helped: a flap's light steady, a fade's at least half of what it
        had lost back. If so the circuit is watched afresh; if not it is said and left."""
        at, level, before = moved
        got = self.readings[p]
        after = [d for t, d in got if t > at + SETTLE_S / 2]
        if not after:
            return
        del self.moved[p]
        lit = self.agent.config.verify_dbm + HYSTERESIS_DB
        helped = min(after) >= lit if before is None else \
            statistics.fmean(after) >= level + 0.5 * (before - level)
        if helped:
            self.readings[p] = deque((t, d) for t, d in got if t > at)
            return
        self.given_up[p] = now + GIVE_UP_S
        self._say(p, "still fading", now, dbm=after[-1])

    def flaps(self, got: deque[tuple[float, float]], now: float) -> int:
        """Dark <-> light changes of a circuit's readings within FLAP_S (with hysteresis)."""
        dark = self.agent.config.verify_dbm - HYSTERESIS_DB
        lit = self.agent.config.verify_dbm + HYSTERESIS_DB
        state, changes = None, 0
        for t, d in got:
            if t < now - FLAP_S:
                continue
            new = True if d >= lit else False if d < dark else state
            if state is not None and new is not None and new != state:
                changes += 1
            state = new if new is not None else state
        return changes

    def fade(self, got: deque[tuple[float, float]], now: float
             ) -> tuple[float, float, float] | None:
        """(power fitted now dBm, slope dB/s, window s) of a fade found over one of WINDOWS_S
        (the shortest that shows one), or None."""
        dark = self.agent.config.verify_dbm - HYSTERESIS_DB
        for window in WINDOWS_S:
            pts = [(t - now, d) for t, d in got if t >= now - window and d >= dark]
            if len(pts) < MIN_POINTS or pts[-1][0] - pts[0][0] < MIN_SPAN * window:
                continue
            t = np.array([x for x, _ in pts])
            d = np.array([y for _, y in pts])
            slope, level = np.polyfit(t, d, 1)
            if slope >= 0 or -slope * (t[-1] - t[0]) < MIN_FALL_DB:
                continue
            sigma = float(np.std(d - (slope * t + level))) or 1e-3
            quarters = np.array_split(d, 4)
            falling = all(
                a.mean() - b.mean() >= max(MIN_STEP_DB,
                                           3 * sigma * math.sqrt(1 / len(a) + 1 / len(b)))
                for a, b in zip(quarters, quarters[1:], strict=False))
            if not falling:
                continue
            to_half = (level - self.half_rate_dbm - GUARD_DB) / -slope
            if to_half <= HORIZON_S:
                return float(level), float(slope), window
        return None

    # --- acting ---------------------------------------------------------------------------
    def _move(self, p: Point, now: float, seen: dict[Point, float],
              flaps: int | None = None, fade: tuple[float, float, float] | None = None) -> None:
        switch, i, _ = p
        lately = self.moves[p] = [t for t in self.moves.get(p, []) if t > now - LATELY_S]
        if len(lately) >= 2:          # moved twice lately and at it again: not the chip's path
            self.given_up[p] = now + GIVE_UP_S
            self._say(p, "still fading", now, flaps=flaps, fade=fade)
            return
        healthy = [q[1] for q, d in seen.items() if q[0] == switch and q != p
                   and d >= self.half_rate_dbm + GUARD_DB and q not in self.moved
                   and q not in self.given_up]
        sw: Any = self.agent.switches[switch]        # (a switch that can: `movable`)
        try:
            done = sw.move([i], healthy)
        except Exception as e:        # a refusal (no other path), or no answer (asked again)
            tries = self.tries[p] = self.tries.get(p, 0) + 1
            refused = not isinstance(e.__cause__, BusError) or \
                isinstance(e.__cause__, BadRequest)
            if refused or tries >= MOVE_TRIES:
                self.tries.pop(p, None)
                self.given_up[p] = now + GIVE_UP_S
                self._say(p, "not moved", now, flaps=flaps, fade=fade, why=str(e))
            else:
                log.warning("link watch: moving %s got no answer (%s): asked again", p, e)
            return
        self.tries.pop(p, None)
        got = self.readings[p]
        level = fade[0] if fade else got[-1][1]
        before = max(d for t, d in got if t >= now - fade[2]) if fade else None
        self.moved[p] = (now, level, before)
        lately.append(now)
        off = done.get("off", []) if isinstance(done, dict) else []
        self._say(p, "moved", now, flaps=flaps, fade=fade,
                  avoided=[(str(c), int(a)) for c, a in off])

    def _say(self, p: Point, action: str, now: float, dbm: float | None = None,
             flaps: int | None = None, fade: tuple[float, float, float] | None = None,
             why: str = "", avoided: list | None = None) -> None:
        switch, i, o = p
        src, dst = self._ends(switch, i, o)
        got = self.readings.get(p)
        if dbm is None:
            dbm = fade[0] if fade else (got[-1][1] if got else None)
        slope = fade[1] if fade else None
        what = (f"flapping ({flaps} dark/light changes in {FLAP_S:g} s)" if flaps else
                f"fading ({slope:+.3f} dB/s over {fade[2]:g} s, {dbm:.2f} dBm now)"
                if fade and slope is not None and dbm is not None else "fading")
        link = f"{src}->{dst} on {switch} ({i}->{o})"
        text = {"moved": f"{link} {what}: moved to other cells, no rank changed",
                "not moved": f"{link} {what}: not moved: {why}",
                "still fading": f"{link} moved and still losing light ({dbm:.2f} dBm): the loss "
                                "is not on the switch's path (a fibre, a transceiver)"}[action]
        log.warning("link watch: %s", text)
        self.agent.journal.record(LinkFade(
            action=action, switch=switch, circuit=(i, o), src=src, dst=dst,
            dbm=None if dbm is None else round(dbm, 3),
            db_per_s=None if slope is None else round(slope, 4), flaps=flaps,
            avoided=avoided or []), text)

    def _ends(self, switch: str, i: int, o: int) -> tuple[str, str]:
        src = dst = "?"
        for g, atts in self.agent.layout.gpus.items():
            for a in atts:
                if a.switch == switch and a.tx == i:
                    src = g
                if a.switch == switch and a.rx == o:
                    dst = g
        return src, dst

    def state(self) -> dict[str, Any]:
        """What the watch holds (for tests and the agent's describe)."""
        now = self.clock()
        return {"watched": len(self.readings), "moved": sorted(self.moved),
                "given_up": sorted(p for p, t in self.given_up.items() if t > now),
                "median_readings": statistics.median([len(g) for g in self.readings.values()])
                if self.readings else 0}
