"""A leader cut off for real (ptb/bench/partition.py): each replica of the agent group on a host
of its own (a network namespace this test makes, joined to this one by a veth pair), the etcd
cluster, the opus rig's OCS service and the GPU monitor on this side, CURVE on (the endpoints are
off loopback). The link is cut while the leader runs: the other replica takes the lead, swaps a
failed GPU's spare in, and once the link is back the cut-off one has moved nothing: it took
itself as deposed when its lease lapsed by its own clock, and the OCS has taken the new term.
Needs root and `ip`; skipped (with the reason) elsewhere."""
from __future__ import annotations

import random

import pytest

from photonic_testbed.ptb.bench.partition import (
    Unavailable,
    admitted,
    cut_off,
    cut_trial,
    stop_process,
)


@pytest.fixture
def cut(tmp_path):
    try:
        with cut_off(tmp_path) as setup:
            yield setup
    except Unavailable as e:
        pytest.skip(str(e))


def test_a_leader_cut_off_from_etcd_and_the_services_moves_nothing(cut):
    fabric = admitted(cut)
    try:
        rank_map = fabric.rank_map
        trial = cut_trial(cut, fabric, random.Random(3))
    finally:
        fabric.close()
    assert trial.new["term"] == trial.cut["term"] + 1
    assert trial.new["name"] != trial.cut["name"]
    assert trial.order is not None
    new_map, _ = trial.order
    swapped = [r for r in rank_map if rank_map[r] != new_map[r]]
    assert len(swapped) == 1 and new_map[swapped[0]].startswith("spare")
    assert trial.moves_after == 0 and not trial.circuits_changed, \
        "the cut-off leader moved a switch"
    assert trial.ocs_term == trial.new["term"]
    assert cut.leader()["name"] == trial.new["name"]
    out = stop_process(cut.procs.pop(trial.cut["name"]))
    assert "lost the lead" in out, out
