"""Links that fade or flap: found from the light their receivers report, moved to another path
through the chip while the job runs, with no rank changed.

A waveguide that loses light a little more every minute (a contaminated cladding, a bend
relaxing) takes the link's margin before it takes the link: the transceiver falls back to half
rate with less than HALF_RATE_MARGIN_DB above its sensitivity, then goes dark. The agent reads
every circuit's received power (the transceivers' DDM, as it verifies circuits) every PERIOD_S,
and fits each one's trend over the last TREND_S (least squares). A circuit is fading when its
power fell by at least MIN_FALL_DB over that window and, at the fitted slope, would be within
GUARD_DB of the half-rate threshold within HORIZON_S (or is already there); it flaps when it
went dark and came back FLAPS times within FLAP_S. A steady circuit with little margin is not
acted on: nothing changes for it (the verification at its phase says whether it is usable).

Acting is cheap and changes no rank: the switch routes the circuit by other cells
(`move(inputs)`, on a Benes chip `drivers.mesh.Mesh.move`: every waveguide it crossed is
avoided from then on), the same circuits, the same GPUs. The journal says why (`LinkFade`
entries, `moved`, with the power and its trend). If the light does not come back after the
move (the loss is in a fibre or a transceiver, which no routing avoids), it says so once
(`still fading`) and leaves the circuit to the fail-stop path (a dark link is a failure the
agent handles); a move refused (`not moved`: the cabling leaves no other path) likewise. Only
switches that can move a circuit are watched (a chip's service offers `move_circuits`; an
OCS's does not).

Everything runs on the agent's loop (`tick`, called each step, works at most every PERIOD_S).
"""
from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from photonic_testbed.hil.agent.entries import LinkFade

if TYPE_CHECKING:
    from photonic_testbed.hil.agent.agent import Agent

log = logging.getLogger(__name__)

PERIOD_S = 1.0            # the circuits' power is read this often
TREND_S = 20.0            # a trend is fitted over this long
MIN_POINTS, MIN_SPAN_S = 5, 4.0     # ... from at least this many readings over this long
MIN_FALL_DB = 1.0         # a fade lost at least this much over the window (DDM reads 0.1 dB)
HORIZON_S = 60.0          # act when the half-rate threshold is this near at the fitted slope
GUARD_DB = 1.0            # ... or the power within this of it
HALF_RATE_MARGIN_DB = 3.0  # a transceiver with less margin than this runs at half rate
FLAPS, FLAP_S = 3, 30.0   # this many dark <-> light changes within this long: a flap
SETTLE_S = 3.0            # after a move, the readings this long after tell whether it helped

Point = tuple[str, int, int]      # (switch, input, output)


class LinkWatch:
    """Each circuit's recent power, the fade and flap tests, and the moves (module doc)."""

    def __init__(self, agent: Agent, clock: Callable[[], float] = time.monotonic):
        self.agent = agent
        self.clock = clock
        self.readings: dict[Point, deque[tuple[float, float]]] = {}
        self.moved: dict[Point, float] = {}      # circuit -> when it was moved
        self.given_up: set[Point] = set()        # moved, still fading: left to the fail path
        self._next = 0.0

    @property
    def dark_dbm(self) -> float:
        return self.agent.config.verify_dbm

    @property
    def half_rate_dbm(self) -> float:
        return self.agent.config.verify_dbm + HALF_RATE_MARGIN_DB

    def tick(self) -> None:
        """Read the circuits' power and act on fades and flaps; at most every PERIOD_S."""
        now = self.clock()
        if now < self._next or not self.agent.config.link_moves:
            return
        self._next = now + PERIOD_S
        agent = self.agent
        points = [(s, i, o) for s, sw in agent.switches.items() if self.movable(sw)
                  for i, o in sorted(agent.writer.current(s).items())]
        for p in set(self.readings) - set(points):          # circuits gone: forgotten
            self.readings.pop(p, None)
            self.moved.pop(p, None)
            self.given_up.discard(p)
        for p in points:
            try:
                dbm = float(agent.diagnosis.read_power(p[0], p[2]))
            except Exception as e:        # a monitor that cannot say: no reading, no verdict
                log.warning("link watch: no power for %s:%d: %s", p[0], p[2], e)
                continue
            got = self.readings.setdefault(p, deque())
            got.append((now, dbm))
            while got and got[0][0] < now - max(TREND_S, FLAP_S):
                got.popleft()
            self._judge(p, got, now)

    @staticmethod
    def movable(switch: Any) -> bool:
        """Whether the switch can route a circuit by other paths (a chip; not an OCS, whose
        circuits are only watched as any circuit is, by the fail-stop path)."""
        return callable(getattr(switch, "move", None)) and getattr(switch, "can_move", True)

    def _judge(self, p: Point, got: deque[tuple[float, float]], now: float) -> None:
        if p in self.given_up:
            return
        moved_at = self.moved.get(p)
        if moved_at is not None:
            if now - moved_at < SETTLE_S:
                return
            after = [d for t, d in got if t >= moved_at + SETTLE_S / 2]
            if after and max(after) < self.half_rate_dbm + GUARD_DB:
                self.given_up.add(p)
                self._say(p, "still fading", got, now, dbm=after[-1])
            return
        flaps = self.flaps(got, now)
        if flaps >= FLAPS:
            self._move(p, got, now, flaps=flaps)
            return
        trend = self.trend(got, now)
        if trend is None:
            return
        level, slope, fall = trend
        if fall < MIN_FALL_DB or slope >= 0:
            return
        to_half = (level - self.half_rate_dbm - GUARD_DB) / -slope
        if to_half <= HORIZON_S:
            self._move(p, got, now)

    def flaps(self, got: deque[tuple[float, float]], now: float) -> int:
        """Dark <-> light changes of a circuit's readings within FLAP_S."""
        lit = [d >= self.dark_dbm for t, d in got if t >= now - FLAP_S]
        return sum(a != b for a, b in zip(lit, lit[1:], strict=False))

    def trend(self, got: deque[tuple[float, float]], now: float
              ) -> tuple[float, float, float] | None:
        """(power fitted now dBm, slope dB/s, dB lost over the window) of the lit readings of
        the last TREND_S; None with too few of them to say."""
        pts = [(t, d) for t, d in got if t >= now - TREND_S and d >= self.dark_dbm]
        if len(pts) < MIN_POINTS or pts[-1][0] - pts[0][0] < MIN_SPAN_S:
            return None
        t = np.array([x for x, _ in pts]) - now
        d = np.array([y for _, y in pts])
        slope, level = np.polyfit(t, d, 1)
        return float(level), float(slope), float(-slope * (t[-1] - t[0]))

    def _move(self, p: Point, got: deque[tuple[float, float]], now: float,
              flaps: int | None = None) -> None:
        switch, i, _ = p
        self.moved[p] = now
        try:
            sw: Any = self.agent.switches[switch]        # (a switch that can: `movable`)
            done = sw.move([i])
        except Exception as e:         # a refusal (the cabling leaves no other path), no answer
            self.given_up.add(p)
            self._say(p, "not moved", got, now, flaps=flaps, why=str(e))
            return
        self._say(p, "moved", got, now, flaps=flaps,
                  avoided=[tuple(x) for x in done.get("off", [])])

    def _say(self, p: Point, action: str, got: deque[tuple[float, float]], now: float,
             dbm: float | None = None, flaps: int | None = None, why: str = "",
             avoided: list | None = None) -> None:
        switch, i, o = p
        trend = self.trend(got, now)
        src, dst = self._ends(switch, i, o)
        if dbm is None:
            dbm = trend[0] if trend is not None else (got[-1][1] if got else None)
        slope = trend[1] if trend is not None else None
        what = (f"flapping ({flaps} dark/light changes in {FLAP_S:g} s)" if flaps else
                f"fading ({slope:+.3f} dB/s, {dbm:.2f} dBm now)" if slope is not None
                and dbm is not None else "fading")
        text = {"moved": f"{src}->{dst} on {switch} ({i}->{o}) {what}: moved to other cells, "
                         "no rank changed",
                "not moved": f"{src}->{dst} on {switch} ({i}->{o}) {what}: not moved: {why}",
                "still fading": f"{src}->{dst} on {switch} ({i}->{o}) moved and still "
                                f"losing light ({dbm:.2f} dBm): the loss is not on the "
                                "switch's path (a fibre, a transceiver)"}[action]
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
        return {"watched": len(self.readings), "moved": sorted(self.moved),
                "given_up": sorted(self.given_up)}
