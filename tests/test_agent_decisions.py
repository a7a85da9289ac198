"""The agent's decisions, pinned: golden vectors recorded from the agent before its decisions
were made proportional to what changes (tests/agent_decisions.json). The same failures on the
lumion and opus racks, with DP, DP x TP, pipeline and all-to-all plans, must give the same
spares, rank maps, per-phase circuits and switch writes."""
from __future__ import annotations

import json
import pathlib

import pytest

from photonic_testbed.common.jobplan import JobPlan, PhaseSpec, dp_ring, dp_tp
from photonic_testbed.common.rack_layout import duplex_rack, lumion
from photonic_testbed.drivers.circuit_switch import ApplyReport, CircuitSwitch, check_circuits
from photonic_testbed.hil.agent.agent import Agent
from photonic_testbed.hil.agent.sqlite_journal import SqliteJournal

CASES = json.loads((pathlib.Path(__file__).parent / "agent_decisions.json").read_text())
PLANS = {"dp": lambda: dp_ring(8), "dp-tp": lambda: dp_tp(8),
         "a2a": lambda: JobPlan("a2a", 8, (PhaseSpec("ep", "all_to_all"),), min_world=2),
         "dp6": lambda: dp_ring(6),
         "pp": lambda: JobPlan("pp", 8, (PhaseSpec("pp", "chain"),
                                         PhaseSpec("dp", "ring", group=4, stride=2)))}
# the opus rack as it was when the vectors were recorded (0.2: no spares; it has two since)
RACKS = {"lumion": lumion, "opus": lambda: duplex_rack("opus", "ocs", 32, 8, 0, prefix="server")}


class Recorder(CircuitSwitch):
    """A switch that keeps what it was told to hold."""

    def __init__(self, name, n):
        self.name, self.n, self.c, self.log = name, n, {}, []

    @property
    def ports(self):
        return self.n

    def apply(self, circuits):
        circuits = check_circuits(circuits, self.n)
        self.log.append(sorted(circuits.items()))
        self.c = dict(circuits)
        return ApplyReport()

    def circuits(self):
        return dict(self.c)


def _pairs(x):
    return [list(p) for p in x]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c['rack']}-{c['plan']}-"
                         f"{'+'.join(c.get('failed', ['admit']))}")
def test_decisions_are_those_of_the_agent_before(case, tmp_path):
    lay = RACKS[case["rack"]]()
    switches = {s: Recorder(s, n) for s, n in lay.switches.items()}
    with SqliteJournal(tmp_path / "j.db") as journal:
        agent = Agent(lay, switches, journal, lambda s, p: -3.0,
                      clock=iter(range(10**9)).__next__)
        if "admit_error" in case:
            with pytest.raises(Exception, match=case["admit_error"][:30]):
                agent.admit(PLANS[case["plan"]]())
            return
        agent.admit(PLANS[case["plan"]]())
        agent.on_phase(*next(iter(agent.job().circuits.targets)))
        got = []
        for g in case["failed"]:
            o = agent.failover.run(agent.job(), [g], "test")
            got.append(None if o is None else {
                "swaps": o.swaps, "rank_map": {str(k): v for k, v in o.rank_map.items()},
                "degraded": o.degraded, "stopped": o.stopped})
        assert got == case["outcomes"]
        targets = {f"{k[0]}/{k[1]}": {s: _pairs(sorted(c.items())) for s, c in
                                      agent.job().circuits.refresh(k).items()}
                   for k in list(agent.job().circuits.targets)}
        assert targets == case["targets"]
        assert {s: [_pairs(x) for x in sw.log] for s, sw in switches.items()} == \
            case["applied"]
