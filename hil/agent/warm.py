"""What a standby replica works out ahead, so that taking the lead costs little (`Warm`).

The rack (`layout_from_rig`: the rig's GPUs on its switches, their port counts as the switch
services say) is read once; then, each time the journal the standby follows by watch changes
(hil.agent.journal_mirror), the jobs it holds are read as a new leader would read them
(`read_jobs`) and their circuits worked out, kept in a `CircuitsAhead`. A replica that takes the
lead takes those circuits rather than working them out again (on opus2048 a 1,024-rank job of
960 (phase, round)s takes 0.6 s of CPU to work out), or waits for those being worked out.
Nothing here writes or moves anything: a standby reads.
"""
from __future__ import annotations

import logging
import threading
from collections.abc import Mapping

from photonic_testbed.common import heap
from photonic_testbed.common.rack_layout import Attachment, RackLayout
from photonic_testbed.hil.agent.etcd_journal import EtcdJournal
from photonic_testbed.hil.agent.failover import round_robin_matchings
from photonic_testbed.hil.agent.journal import JournalError
from photonic_testbed.hil.agent.recovery import CircuitsAhead, read_jobs
from photonic_testbed.hil.bus.client import BusError, ServiceClient
from photonic_testbed.hil.bus.security import ClientKeys
from photonic_testbed.hil.rig import Rig, RigFileError

log = logging.getLogger(__name__)

READ_EVERY_S = 0.1          # a standby reads its journal ahead at most this often


def layout_from_rig(rig: Rig, ports: Mapping[str, int]) -> RackLayout:
    """The rack from the rig's [[gpus]]: GPU on port p has TX on input p, RX on output N+p;
    GPUs naming a `server` share that server's scale-up fabric."""
    if not rig.gpus:
        raise RigFileError(f"rig {rig.name} lists no [[gpus]]: the agent has nothing to manage")
    switches = {g.switch: int(ports[g.switch]) for g in rig.gpus}
    gpus: dict[str, tuple[Attachment, ...]] = {
        g.name: (Attachment(g.switch, g.port, switches[g.switch] + g.port),) for g in rig.gpus}
    return RackLayout(rig.name, switches, gpus, tuple(g.name for g in rig.gpus if g.spare),
                      servers={g.name: g.server for g in rig.gpus if g.server})


def switch_ports(rig: Rig, keys: ClientKeys | None, timeout: float) -> dict[str, int]:
    """Each switch a GPU is cabled to: its port count, as its service says (a read)."""
    endpoints = rig.endpoints()
    out = {}
    for name in sorted({g.switch for g in rig.gpus}):
        with ServiceClient(endpoints[name][0], keys=keys, timeout=timeout) as c:
            out[name] = int(c.call("snapshot")["state"]["ports"])
    return out


class Warm:
    """A standby's work ahead (see the module), on a thread of its own from `start` to
    `close`; `ahead` is what a takeover takes."""

    def __init__(self, rig: Rig, journal: EtcdJournal, keys: ClientKeys | None,
                 timeout: float, settle_heap: bool = False):
        """`settle_heap` (a `ptb agent` process): the heap is settled (`common.heap`) after a
        reading that worked circuits out, so that the collector of the replica taking the lead
        does not scan them again and again."""
        self.rig = rig
        self.settle_heap = settle_heap
        self.journal = journal.reader()     # (its reads never write the leader's entries)
        self.keys = keys
        self.timeout = timeout
        self.ahead = CircuitsAhead()
        self.readings = 0           # readings of the journal done ahead
        self._layout: RackLayout | None = None
        self._changed = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if journal.mirror is not None:
            journal.mirror.listeners.append(self._changed.set)
        self._changed.set()                         # (a first reading, at once)

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="warm", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            if not self._changed.wait(0.5):
                continue
            self._changed.clear()
            try:
                self.read()
                self._stop.wait(READ_EVERY_S)        # (a busy journal: one reading a while)
                continue
            except (BusError, JournalError, RigFileError, KeyError, ValueError) as e:
                log.debug("standby: nothing worked out ahead now: %s", e)
            except Exception:               # (ahead of need only: the takeover works it out)
                log.exception("standby: working the jobs' circuits out ahead")
            self._stop.wait(1.0)
            self._changed.set()             # (tried again, the journal changed or not)

    def read(self) -> None:
        """One reading of the journal, as a new leader would read it."""
        if self._layout is None:
            self._layout = layout_from_rig(self.rig, switch_ports(self.rig, self.keys,
                                                                  self.timeout))
        self.ahead.reading(self._layout)
        made = self.ahead.made
        read_jobs(self.journal, self._layout, round_robin_matchings, self.ahead, mine=False)
        self.ahead.read()
        self.readings += 1
        if self.settle_heap and self.ahead.made > made:
            heap.settle("circuits worked out ahead")

    def close(self) -> None:
        """Stop reading ahead (a reading under way ends by itself: what it works out is still
        taken)."""
        self._stop.set()
        self._changed.set()
