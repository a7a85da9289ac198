"""Writes journal-0.2.db with the agent of version 0.2 (commit 83296fb): a run on the lumion
rack that makes it write every kind of entry it has (tests/data/README.md says how to run it;
tests/test_journal_typed.py reads the result in today's types)."""
from __future__ import annotations

import pathlib
import sys

from optics_doubles import PermutationSwitch

import photonic_testbed
from photonic_testbed.hil.agent import Agent
from photonic_testbed.hil.emulator.clock import SimClock
from photonic_testbed.hil.emulator.rack import EmulatedRack
from photonic_testbed.hil.jobplan import dp_tp
from photonic_testbed.hil.journal import Journal
from photonic_testbed.hil.rack_layout import lumion

if photonic_testbed.__version__ != "0.2.0":
    sys.exit(f"this is photonic_testbed {photonic_testbed.__version__} from "
             f"{photonic_testbed.__file__}, not 0.2.0: put the 0.2 tree first on the path")
out = pathlib.Path(sys.argv[1])
clock = SimClock()
switch = PermutationSwitch("chip", 16, clock=clock, seed=0)
rack = EmulatedRack(lumion(), {"chip": switch}, clock)


def agent(journal: Journal) -> Agent:
    return Agent(lumion(), {"chip": switch}, journal, rack.port_power_dbm, clock=clock.now,
                 verify_phases=True)


with Journal(out) as journal:
    a = agent(journal)
    a.start()                                         # start, reconcile (nothing to repair)
    ranks = a.admit(dp_tp(8))                         # decision (admit, intended), applied...
    a.on_phase("dp", 0)                               # verified, phase
    a.on_phase_done("dp", 0)                          # the next phase set up ahead
    rack.faults.fail_gpu("gpu3")
    a.on_health(rack.gpu_health("gpu3"))              # detected, decision (swap), verified,
                                                      # rank_map, restart
    a.on_health({"gpu": "gpu1", "state": "degraded", "reasons": ["ecc"]})       # note
    victim = ranks[5]
    peer = a.rank_map[4]
    rack.faults.cut_fibre("chip", lumion().gpus[victim][0].rx)
    a.on_job_failure("link down", links=[(peer, victim)])     # failure, diagnosis, swap
    switch.apply({})                                  # someone clears the switch behind it
    a.reconcile()                                     # reconcile: the repair, then the sum
    rack.faults.cut_fibre("chip", lumion().gpus[a.rank_map[0]][0].rx)
    a.on_phase("tp", 0)                               # verify_failed, alarm: no grant
    a.release()                                       # decision (release)
    a.on_health({"gpu": "gpu6", "state": "failed", "reasons": ["xid 79"]})      # note
with Journal(out) as journal:
    agent(journal).start()                            # a restarted agent: start, reconcile
