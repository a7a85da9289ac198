import pytest

from photonic_testbed.drivers.circuit_switch import CircuitConflict, check_circuits


def test_normalises_pairs_and_mappings():
    assert check_circuits({1: 5, 2: 6}, ports=4) == {1: 5, 2: 6}
    assert check_circuits([(1, 5), (2, 6)], ports=4) == {1: 5, 2: 6}
    assert check_circuits([(7, 3)], ports=8, split=False) == {3: 7}


@pytest.mark.parametrize("circuits, message", [
    ({1: 9}, "port 9 does not exist"),
    ({0: 5}, "port 0 does not exist"),
    ({5: 6}, "must join an input"),
    ([(1, 5), (2, 5)], "port 5 is in two circuits"),
    ([(1, 5), (1, 6)], "port 1 is in two circuits"),
    ([("a", 5)], "pair of port numbers"),
])
def test_refuses_impossible_circuits(circuits, message):
    with pytest.raises(CircuitConflict, match=message):
        check_circuits(circuits, ports=4)


def test_unsplit_switch_refuses_a_loop():
    with pytest.raises(CircuitConflict, match="itself"):
        check_circuits([(3, 3)], ports=8, split=False)
