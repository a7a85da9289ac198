"""Links that fade or flap, for real: a waveguide of the rack's chip that loses light.

Control commands (registered by `emulator.rackhost.RackHost`):

- `fade_link` `{src, dst}` (GPUs: the waveguide in the middle of the path that carries src's
  light to dst now) or `{switch, cell, arm}` (that waveguide), with `db_per_s` (default 0.1)
  and `max_db` (default 20): the waveguide loses `db_per_s` more every second up to `max_db`.
  The receiver's power falls toward its sensitivity, the link drops to half rate with less than
  3 dB of margin (`emulator.rack`), then goes dark. The loss stays on the waveguide: a circuit
  routed by other cells no longer sees it.
- `flap_link`, the same places, with `period_s` (default 1) and `db` (default 30): the
  waveguide loses `db` for a period, nothing the next, and so on (a flapping link).
- `link_fades`: every fading waveguide, with what it loses now. `clear_faults` ends them.

Only a feed-forward chip's waveguides fade (`emulator.chip.EmulatedChip.fade`); an OCS's
fibres are cut with `cut_fibre`.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

from photonic_testbed.emulator.chip import ChipError
from photonic_testbed.emulator.control import ControlError, ControlServer
from photonic_testbed.emulator.rack import EmulatedRack


class LinkFaults:
    """Fading and flapping waveguides on the rack's switches that model them."""

    def __init__(self, rack: EmulatedRack):
        self.rack = rack

    def _faders(self) -> dict[str, Any]:
        return {s: p for s, p in self.rack.physics.items() if callable(getattr(p, "fade", None))}

    def _where(self, req: dict) -> tuple[Any, Any, Any]:
        """(the switch's physics, cell, arm) a request names, directly or by its link."""
        faders = self._faders()
        if not faders:
            raise ControlError("no switch of this rack has waveguides that can fade (an OCS's "
                               "fibres are cut with cut_fibre)")
        if "cell" in req or "arm" in req:
            switch = req.get("switch", next(iter(faders)) if len(faders) == 1 else None)
            if switch not in faders:
                raise ControlError(f'"switch" names one of {sorted(faders)}, not {switch!r}')
            return faders[switch], req.get("cell"), req.get("arm")
        src, dst = req.get("src"), req.get("dst")
        gpus = self.rack.layout.gpus
        if src not in gpus or dst not in gpus or src == dst:
            raise ControlError(f'"src" and "dst" name two GPUs of the rack (or give "cell" and '
                               f'"arm"), not {src!r} and {dst!r}')
        for switch, tx, rx in self.rack.layout.links_between(src, dst) or ():
            chip = faders.get(switch)
            if chip is None:
                continue
            out = chip.transfer({tx: 1.0})
            if max(out, key=out.__getitem__) != rx:
                continue
            path = chip.path(tx)
            cell, arm = path[len(path) // 2]           # the middle of the chip
            return chip, cell, arm
        raise ControlError(f"no circuit of a chip carries {src}'s light to {dst} now")

    def fade(self, req: dict, *, flap: bool = False) -> dict:
        chip, cell, arm = self._where(req)
        try:
            if flap:
                period = req.get("period_s", 1.0)
                if isinstance(period, bool) or not isinstance(period, (int, float)) \
                        or not period > 0:
                    raise ChipError(f"a flap's period_s is a number above 0 s, not {period!r}")
                fd = chip.fade(cell, arm, max_db=req.get("db", 30.0), period_s=period)
            else:
                fd = chip.fade(cell, arm, max_db=req.get("max_db", 20.0),
                               db_per_s=req.get("db_per_s", 0.1))
        except ChipError as e:
            raise ControlError(str(e)) from None
        return {"cell": fd.cell, "arm": fd.arm, "max_db": fd.max_db, "db_per_s": fd.db_per_s,
                "period_s": fd.period_s}

    def active(self) -> dict[str, list[dict]]:
        return {s: p.fades() for s, p in self._faders().items()}

    def clear(self) -> None:
        for p in self._faders().values():
            p.clear_fades()

    def register(self, control: ControlServer, clear: Callable[[dict], Any]) -> None:
        """The commands; `clear_faults` (the rack's `clear`) ends the fades too."""
        def clear_all(req: dict) -> Any:
            self.clear()
            return clear(req)
        control.register("fade_link", self.fade)
        control.register("flap_link", lambda req: self.fade(req, flap=True))
        control.register("link_fades", lambda req: self.active())
        control.register("clear_faults", clear_all)
