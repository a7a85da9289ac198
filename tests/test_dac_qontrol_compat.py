"""The unmodified `qontrol` client from PyPI drives our emulated board over the pty."""
from __future__ import annotations

import time

import pytest

qontrol = pytest.importorskip("qontrol")

# qontrol waits this long for each reply (its default, 0.1 s, fails on a busy machine); a
# command the board answers with an error (no OK) waits all of it, and so does the client's
# start (it drains the port for this long), so it is generous but not huge.
RESPONSE_TIMEOUT_S = 2.0


@pytest.fixture
def q(dac_board):
    client = qontrol.QXOutput(serial_port_name=str(dac_board.link),
                              response_timeout=RESPONSE_TIMEOUT_S)
    yield client
    client.close()


def errors_logged(client):
    return [(e["id"], e["ch"]) for e in client.log if e["type"] == "err"]


def wait_for_error(client, error: tuple[int, int], within_s: float = 30.0) -> bool:
    """Watch the port until the board's error `(id, channel)` is logged (bounded)."""
    deadline = time.monotonic() + within_s
    while error not in errors_logged(client) and time.monotonic() < deadline:
        client.wait(0.05)
    return error in errors_logged(client)


def test_it_discovers_the_chain(q):
    assert q.n_chs == 56
    assert q.v_full == 12.0 and q.i_full == 24.0
    assert [d["device_type"] for d in q.chain] == ["Q8iv"] * 7
    assert [d["index"] for d in q.chain] == list(range(7))


def test_per_channel_set_and_get(q, dac_board):
    q.v[3] = 1.5
    q.v[55] = 0.25
    assert q.v[3] == 1.5
    assert q.v[55] == pytest.approx(0.25, abs=2e-4)  # 16-bit quantisation
    assert dac_board.outputs[3] == pytest.approx(1.5, abs=2e-4)
    assert q.i[3] == pytest.approx(1500.0 / dac_board.resistances[3], abs=2e-3)


def test_set_all_and_get_all(q, dac_board):
    values = [round(0.1 * c, 1) for c in range(56)]
    q.set_all_values("V", values)
    assert q.get_all_values("V") == pytest.approx(values, abs=2e-4)
    assert dac_board.outputs == pytest.approx(values, abs=2e-4)


def test_vmax_is_enforced_and_reported_as_qontrol_errors(q, dac_board):
    q.vmax[2] = 3.0
    assert q.vmax[2] == 3.0
    q.v[2] = 1.0
    q.v[2] = 4.0                 # refused by the board: E01 on channel 2
    assert wait_for_error(q, (1, 2))
    assert q.v[2] == 1.0
    assert dac_board.outputs[2] == pytest.approx(1.0, abs=2e-4)


def test_bad_channel_and_unknown_command(q):
    q.issue_command("v", ch=99, operator="=", value=1.0)
    q.issue_command("frobnicate", operator="?", n_lines_requested=1)
    assert wait_for_error(q, (12, 99))
    assert wait_for_error(q, (10, 0))
    assert q.v[0] == 0.0         # still talking
