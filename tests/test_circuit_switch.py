import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

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


_PORT = st.one_of(st.integers(1, 8), st.sampled_from([0, 9, -1, 4, 5]), st.booleans(),
                  st.sampled_from([1.0, 5.5, "3", None]))       # (0, 9: just off the switch)


@st.composite
def _requests(draw) -> list:
    """A valid request on a 4 x 4 switch (pairs as tuples or lists), then up to three flaws:
    a port replaced by any value (often another valid port: two circuits sharing one), an
    input's pair repeated, a pair of one or three items, a pair of anything."""
    n = draw(st.integers(0, 4))
    ins = draw(st.permutations([1, 2, 3, 4]))[:n]
    outs = draw(st.permutations([5, 6, 7, 8]))[:n]
    pairs: list = [[a, b] if draw(st.booleans()) else (a, b)
                   for a, b in zip(ins, outs, strict=True)]
    for _ in range(draw(st.integers(0, 3))):
        flaw = draw(st.sampled_from(["port", "repeat", "odd", "any"]))
        if flaw == "port" and pairs:
            k = draw(st.integers(0, len(pairs) - 1))
            pair = list(pairs[k])
            pair[draw(st.integers(0, len(pair) - 1))] = draw(_PORT)
            pairs[k] = pair
        elif flaw == "repeat" and pairs:
            pairs.append(draw(st.sampled_from(pairs)))
        elif flaw == "odd":
            pairs.append(draw(st.lists(_PORT, min_size=1, max_size=3).filter(
                lambda x: len(x) != 2)))
        elif flaw == "any":
            pairs.append((draw(_PORT), draw(_PORT)))
    return pairs


@settings(max_examples=600, deadline=None)
@given(pairs=_requests(), as_dict=st.booleans())
@example(pairs=[(0, 5)], as_dict=True)                 # each a request one step off the usual
@example(pairs=[(1, 9)], as_dict=True)
@example(pairs=[(1, 4), (2, 6)], as_dict=False)
@example(pairs=[(5, 6)], as_dict=True)
@example(pairs=[(1, 5), (2, 5)], as_dict=True)
@example(pairs=[(1, 5), (1, 6)], as_dict=False)
@example(pairs=[(True, 5)], as_dict=True)
@example(pairs=[(1, 5.0)], as_dict=False)
def test_the_quick_check_of_the_usual_request_agrees_with_the_full_one(pairs, as_dict):
    """A dict or list of pairs takes the quick check when it is the usual request; a generator
    of the same pairs always takes the pair-by-pair check: both accept the same circuits (ints,
    whatever they came as), or both refuse with the same message."""
    if as_dict:
        try:
            request: object = dict(pairs)
        except (TypeError, ValueError):
            return
        reference = iter(list(request.items()))   # type: ignore[attr-defined]
    else:
        request, reference = pairs, iter(list(pairs))

    def outcome(circuits):
        try:
            got = check_circuits(circuits, ports=4)
            return "ok", got, [(type(a), type(b)) for a, b in got.items()]
        except CircuitConflict as e:
            return "refused", str(e)
    assert outcome(request) == outcome(reference)


def test_the_quick_check_returns_a_copy():
    request = {1: 5, 2: 6}
    got = check_circuits(request, ports=4)
    assert got == request and got is not request
