"""Verification by light and diagnosis: which circuits are dark, and whose fault that is.

A circuit is verified by the light at its output (`read_power(switch, port) -> dBm`, a power
meter or the receiving transceiver): at least the verification threshold. A dark circuit is
diagnosed end by end with a loopback test (each end's own light sent back to it through the
switch): an end that cannot hear itself is at fault; both ends hearing themselves blame the
switch's path; every GPU deaf, an idle control GPU included, blames the switch or the light.
A dark circuit whose ends both hear themselves is the switch path's fault: on a switch that
routes a circuit by other paths (a chip) it is moved off the waveguides it crossed, no rank
changed (a link that flaps darker for longer than the job waits fails the job before the link
watch sees it flap). Evictions on the fabric's evidence alone are bounded, per incident and
per window: beyond the bounds nobody is evicted and a person is called, so a fault of the
fabric cannot cascade through the rack.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

from photonic_testbed.common.rack_layout import RackLayout
from photonic_testbed.hil.agent.config import AgentConfig
from photonic_testbed.hil.agent.entries import Alarm, LinkFade, Loopback, Verified, VerifyFailed
from photonic_testbed.hil.agent.journal import Journal
from photonic_testbed.hil.agent.policies import Targets
from photonic_testbed.hil.agent.pool import GpuPool
from photonic_testbed.hil.agent.writer import SwitchWriter

Point = tuple[str, int, int]                    # a circuit: (switch, input, output)


class Diagnosis:
    """Verify circuits by light, loopback-test GPUs, diagnose dark circuits, bound evictions."""

    def __init__(self, layout: RackLayout, read_power: Callable[[str, int], float],
                 journal: Journal, clock: Callable[[], float], writer: SwitchWriter,
                 pool: GpuPool, alarm: Callable[[str, Alarm], None], config: AgentConfig):
        self.layout = layout
        self.read_power = read_power
        self.journal = journal
        self.clock = clock
        self.writer = writer
        self.pool = pool
        self.alarm = alarm
        self.verify_dbm = config.verify_dbm
        self.per_incident = config.diagnosed_per_incident
        self.per_window = config.diagnosed_per_window
        self.window_s = config.eviction_window_s
        self._diagnosed_at: list[float] = []      # when GPUs were evicted on diagnosis alone
        # told of each circuit moved off its path here (the link watch starts it afresh)
        self.on_moved: Callable[[Point], None] | None = None

    def points(self, targets: Targets, gpus: list[str] | None) -> list[Point]:
        """Circuits to verify: those touching `gpus` (all circuits when None), found from the
        GPUs' own ports rather than by reading every circuit of the rack."""
        if gpus is None:
            return [(s, i, o) for s, c in targets.items() for i, o in sorted(c.items())]
        out = set()
        for g in gpus:
            for att in self.layout.gpus.get(g, ()):
                c = targets.get(att.switch)
                if not c:
                    continue
                if att.tx in c:
                    out.add((att.switch, att.tx, c[att.tx]))
                out.update((att.switch, i, o) for i, o in c.items() if o == att.rx)
        order = {s: k for k, s in enumerate(targets)}
        return sorted(out, key=lambda p: (order[p[0]], p[1]))

    def verify(self, points: list[Point], cause: str, since: float
               ) -> list[tuple[str, int, int, float]]:
        """Read light at each (switch, in, out) circuit's output; returns the dark ones."""
        bad, seen = [], {}
        for s, i, o in points:
            p = float(self.read_power(s, o))
            seen[f"{s}:{o}"] = round(p, 2)
            if not p >= self.verify_dbm:
                bad.append((s, i, o, p))
        kind = VerifyFailed if bad else Verified
        self.journal.record(kind(dbm=seen, dark=[(s, i, o) for s, i, o, _ in bad]),
                            cause, self.clock() - since, defer=True)
        return bad

    def dark_links(self, links: list[tuple[str, str]]) -> list[Point]:
        """The circuits of the (src GPU, dst GPU) links that are set now and whose receiver
        reads dark."""
        dark = []
        for src, dst in links:
            for att in self.layout.gpus.get(dst, ()):
                src_att = self.layout.gpus.get(src) and self.layout.attachment(src, att.switch)
                if not src_att or self.writer.current(att.switch).get(src_att.tx) != att.rx:
                    continue
                if not float(self.read_power(att.switch, att.rx)) >= self.verify_dbm:
                    dark.append((att.switch, src_att.tx, att.rx))
        return dark

    def loopback(self, gpus: list[str], cause: str) -> dict[str, bool]:
        """Each GPU's own light sent back to it (its TX to its RX through each switch it is
        cabled to): {gpu: its receivers hear it}. Only those GPUs' ports move; the journal's
        intended circuits stay as they were (a probe is not a decision: an agent restarted
        mid-probe puts the switches back)."""
        loops: dict[str, dict[int, int]] = {}
        sender: dict[tuple[str, int], str] = {}      # (switch, input) -> the GPU sending there
        for g in gpus:
            for att in self.layout.gpus.get(g, ()):
                loops.setdefault(att.switch, {})[att.tx] = att.rx
                sender[att.switch, att.tx] = g
        heard = {g: True for g in gpus}
        for s, pairs in loops.items():
            ports = set(pairs) | set(pairs.values())
            probe = {i: o for i, o in self.writer.current(s).items()
                     if i not in ports and o not in ports}
            probe.update(pairs)
            self.writer.probe(s, probe)
            for i, o in pairs.items():
                g = sender[s, i]
                heard[g] = heard[g] and float(self.read_power(s, o)) >= self.verify_dbm
        self.journal.record(Loopback(loopback=dict(heard)), cause, defer=True)
        return heard

    def diagnose(self, dark: list[Point], cause: str) -> list[str]:
        """Which end of each dark circuit is at fault, found by a loopback test of both ends
        (and of an idle GPU, as a control): the end that cannot hear itself. Both ends hearing
        themselves blames the switch's path; every GPU deaf, the control included, blames
        the switch or the light: nobody is evicted then, and a person is called."""
        ends = list(dict.fromkeys(g for s, i, o in dark for g in (self.layout.owner(s, i),
                                                                   self.layout.owner(s, o))
                                  if g is not None))
        switches = {s for s, _, _ in dark}
        control = next((g for g in self.pool.spares() if g not in ends and
                        any(a.switch in switches for a in self.layout.gpus[g])), None)
        heard = self.loopback(ends + ([control] if control else []), cause)
        if not any(heard.values()) and (control is not None or len(ends) > 1):
            self.alarm(f"{cause}: no GPU hears its own light through the switch "
                       f"({', '.join(heard)}): the switch or the light is at fault, nobody "
                       "is evicted", Alarm(tested=dict(heard)))
            return []
        blamed = [g for g in ends if not heard[g]]
        for s, i, o in dark:
            src, dst = self.layout.owner(s, i), self.layout.owner(s, o)
            if src is not None and dst is not None and heard.get(src) and heard.get(dst):
                why = self.move_off_path(s, i, o, f"{cause}: {src} -> {dst} is dark on {s} "
                                         f"({i} -> {o}) although both hear themselves")
                if why is not None:
                    self.alarm(f"{cause}: {src} -> {dst} is dark on {s} ({i} -> {o}) although "
                               f"both hear themselves: the switch's path is at fault{why}",
                               Alarm(switch=s, circuit=[i, o]))
        return self.bound_evictions(blamed, cause)

    def move_off_path(self, s: str, i: int, o: int, cause: str) -> str | None:
        """A dark circuit whose ends are sound, moved off every waveguide it crosses where the
        switch routes by other paths (a chip: `move`), set again first (the loopback test took
        its ends); journaled as the link watch journals a move. None when moved, else what to
        add to the alarm ("" for a switch that cannot move a circuit). No circuit is taken as
        healthy: a loopback that heard itself may have crossed a flapping waveguide in a light
        phase."""
        sw: Any = self.writer.switches.get(s)      # (a chip's BusSwitch can `move`)
        if not callable(getattr(sw, "move", None)) or not getattr(sw, "can_move", True):
            return ""
        try:
            now = self.writer.current(s)
            self.writer.probe(s, {**{a: b for a, b in now.items() if a != i and b != o}, i: o})
            done = sw.move([i], [])
        except Exception as e:            # no other path, or no answer
            return f" (not moved by other cells: {e})"
        off = done.get("off", []) if isinstance(done, dict) else []
        src, dst = self.layout.owner(s, i) or "?", self.layout.owner(s, o) or "?"
        self.journal.record(LinkFade(action="moved", switch=s, circuit=(i, o), src=src,
                                     dst=dst, avoided=[(str(c), int(a)) for c, a in off]),
                            f"{cause}: moved to other cells, no rank changed", defer=True)
        if self.on_moved is not None:
            self.on_moved((s, i, o))
        return None

    def bound_evictions(self, blamed: list[str], cause: str) -> list[str]:
        """At most `diagnosed_per_incident` GPUs per incident and `diagnosed_per_window` in
        `eviction_window_s` on the fabric's evidence alone; beyond that, none, and an alarm:
        a cascade through the rack is not possible."""
        now = self.clock()
        self._diagnosed_at = [t for t in self._diagnosed_at if now - t < self.window_s]
        if len(blamed) > self.per_incident or \
                len(self._diagnosed_at) + len(blamed) > self.per_window:
            self.alarm(f"{cause}: diagnosis blames {', '.join(blamed)}; evicting them would "
                       f"exceed {self.per_incident} per incident or "
                       f"{self.per_window} per {self.window_s:.0f} s: nobody is "
                       "evicted, a person is needed",
                       Alarm(gpus=list(blamed), recent=len(self._diagnosed_at)))
            return []
        self._diagnosed_at += [now] * len(blamed)
        return blamed
