"""Adversarial tests of the SCPI serving loop (`emulator.scpi`): clients that vanish or
half-close while a command waits, `drop_clients` racing a line in flight or a reply half sent,
servers closed and started again on a shared `SCPILoop`, `drop_on` fault rules, byte counters,
and handlers that fail inside a wait. After every abuse the serving thread must still answer
*IDN? to a fresh client.

Everything is bounded: loopback only, every wait polls against a generous deadline (the machine
may be busy), and no assertion is about how short something took."""
from __future__ import annotations

import math
import re
import socket
import struct
import threading
import time
from collections import defaultdict

import pytest
import test_scpi_server as scpi_client

from photonic_testbed.emulator import scpi_loop
from photonic_testbed.emulator.ocs import OCSInstrument, OCSPhysics
from photonic_testbed.emulator.scpi import Instrument, Session
from photonic_testbed.emulator.scpi_loop import SCPILoop
from photonic_testbed.emulator.scpi_server import MAX_CLIENTS, SCPIServer
from photonic_testbed.hil.rig import free_port

WAIT_S = 30.0          # a bound for what normally takes milliseconds


# ---- helpers --------------------------------------------------------------------------------

class Client(scpi_client.Client):
    """The raw socket client of tests/test_scpi_server.py, with a generous timeout, reading
    to the end and closing with a reset."""

    def __init__(self, server: SCPIServer, timeout: float = WAIT_S):
        super().__init__(server, timeout)

    def drain(self, within_s: float = WAIT_S) -> tuple[bytes, bool]:
        """Everything the server sends until it closes the connection (EOF or reset), and
        whether it did close it within `within_s`."""
        data, self.buf = self.buf, b""
        self.sock.settimeout(0.2)
        deadline = time.monotonic() + within_s
        try:
            while time.monotonic() < deadline:
                try:
                    chunk = self.sock.recv(1 << 20)
                except TimeoutError:
                    continue
                except ConnectionError:
                    return data, True
                if not chunk:
                    return data, True
                data += chunk
            return data, False
        finally:
            self.sock.settimeout(WAIT_S)

    def reset(self) -> None:
        """Close with a reset (RST), as a client process killed mid-session."""
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        self.sock.close()


def _served(server: SCPIServer) -> str:
    """*IDN? on a fresh connection."""
    c = Client(server)
    try:
        return c.query("*IDN?")
    finally:
        c.close()


def _until(pred, within_s: float = WAIT_S) -> bool:
    """Poll `pred` until it is true or `within_s` has passed; its last value."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.01)
    return bool(pred())


def _loop_threads(name: str) -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == f"{name}-loop" and t.is_alive()]


def _nothing_yet(c: Client) -> bool:
    """True while the server has neither sent to nor closed `c`."""
    c.sock.setblocking(False)
    try:
        c.sock.recv(1, socket.MSG_PEEK)         # a byte, or EOF: it was sent or closed
        return False
    except BlockingIOError:
        return True
    except ConnectionError:
        return False
    finally:
        c.sock.settimeout(WAIT_S)


def _free_port() -> int:
    return free_port()


class _Lab(Instrument):
    """Commands to abuse the loop with.

    `ECHO? k` answers k (and records that it ran, per session); `NAP? k` waits `nap_s` then
    answers k; `SET v` / `GET?` a value; `TICK?` waits in 20 ms steps until cut (recording each
    resume and the thread it ran on, and its closing); `HOLD?` blocks the serving thread, holding
    the instrument's lock, until the test releases it; `BOOM?` raises after a wait; `BAD?`
    yields `bad_value` as its resume time; `BIG?` a reply of `big_len` bytes."""

    def __init__(self, nap_s: float = 0.01):
        super().__init__()
        self.idn = "Emulated,Lab,0,1.0"
        self.nap_s = nap_s
        self.ran: dict[str, list[int]] = defaultdict(list)
        self.naps_done = 0
        self.value = ""
        self.ticks: list[str] = []
        self.tick_started = threading.Event()
        self.tick_closed = threading.Event()
        self.hold_entered = threading.Event()
        self.hold_release = threading.Event()
        self.bad_value: object = None
        self.big_len = 16_000_000
        self.gate = threading.Event()
        self.command("ECHO?", self._echo)
        self.command("NAP?", self._nap, locked=False)
        self.command("SET", self._set)
        self.command("GET?", lambda s, x, a: self.value)
        self.command("TICK?", self._tick, locked=False)
        self.command("HOLD?", self._hold)
        self.command("BOOM?", self._boom, locked=False)
        self.command("BAD?", self._bad, locked=False)
        self.command("BIG?", lambda s, x, a: "x" * self.big_len)
        self.command("GATE?", self._gate, locked=False)

    def _echo(self, session, sfx, arg):
        self.ran[session.peer].append(int(arg))
        return arg

    def _nap(self, session, sfx, arg):
        yield time.monotonic() + self.nap_s
        with self.lock:
            self.naps_done += 1
        return arg

    def _set(self, session, sfx, arg):
        self.value = arg

    def _tick(self, session, sfx, arg):
        self.tick_started.set()
        give_up = time.monotonic() + 60
        try:
            while time.monotonic() < give_up:
                yield time.monotonic() + 0.02
                self.ticks.append(threading.current_thread().name)
            return "gave up"
        except GeneratorExit:
            self.tick_closed.set()
            raise

    def _hold(self, session, sfx, arg):
        self.hold_entered.set()
        self.hold_release.wait(WAIT_S)
        self.value = "held"
        return "held"

    def _boom(self, session, sfx, arg):
        yield time.monotonic() + 0.01
        raise RuntimeError("a handler bug after its wait")

    def _gate(self, session, sfx, arg):
        give_up = time.monotonic() + 60
        while not self.gate.is_set() and time.monotonic() < give_up:
            yield time.monotonic() + 0.01
        return "1" if self.gate.is_set() else "0"

    def _bad(self, session, sfx, arg):
        yield self.bad_value
        return "late"


# ---- clients that vanish while a command waits ----------------------------------------------

def test_clients_vanishing_while_their_opc_waits_are_cleaned_up():
    """Eight clients each make a circuit and ask *OPC? on a switch that takes 2 s to move, then
    vanish mid-wait (half with FIN, half with RST): every move is kept, every session is closed
    once its wait ends, and the switch keeps serving."""
    phys = OCSPhysics(8, seed=1, switching_s=2.0)
    with SCPIServer(OCSInstrument(phys), name="ocs-vanish") as server:
        clients = [Client(server) for _ in range(8)]
        for k, c in enumerate(clients, start=1):
            c.send(f":OXC:SWIT:CONN:ADD (@{k}),(@{k + 8});*OPC?\n".encode())
        assert _until(lambda: phys.moves == 8), phys.moves
        for k, c in enumerate(clients):
            if k % 2:
                c.reset()
            else:
                c.close()
        assert _until(lambda: server.clients == 0), server.clients
        assert phys.commanded == {k: k + 8 for k in range(1, 9)}
        assert _served(server).startswith("Polatis")
        c = Client(server)
        try:
            assert c.query(":OXC:SWIT:CONN:PORT? 9") == "1"
            assert c.query(":SYST:ERR?").startswith("0,")
        finally:
            c.close()


def test_a_dropped_waiting_command_is_closed_and_never_resumed():
    """`drop_clients` while a command waits: its generator is closed (GeneratorExit), the client
    is cut with no reply, and no later timer resumes the closed generator; every resume ran on
    the serving thread."""
    inst = _Lab()
    with SCPIServer(inst, name="tick-drop") as server:
        c = Client(server)
        try:
            c.send(b"TICK?\n")
            assert _until(lambda: len(inst.ticks) >= 3)
            assert server.drop_clients() == 1
            assert inst.tick_closed.wait(WAIT_S)
            data, closed = c.drain()
            assert closed and data == b""
            after = len(inst.ticks)
            time.sleep(0.3)                     # 15 of its 20 ms steps: none may run now
            assert len(inst.ticks) == after
            assert set(inst.ticks) == {"tick-drop-loop"}
            assert server.clients == 0 and server.busy_clients == 0
            assert _served(server) == inst.idn
        finally:
            c.close()


def test_a_waiting_command_of_a_closed_server_is_closed_too():
    """close() while a session waits: its generator is closed and never resumed."""
    inst = _Lab()
    server = SCPIServer(inst, name="tick-close")
    server.start()
    c = Client(server)
    try:
        c.send(b"TICK?\n")
        assert _until(lambda: len(inst.ticks) >= 2)
        server.close()
        assert inst.tick_closed.is_set()        # close() returns once the serving thread shut
        data, closed = c.drain()
        assert closed and data == b""
        after = len(inst.ticks)
        time.sleep(0.3)
        assert len(inst.ticks) == after
        assert _until(lambda: not _loop_threads("tick-close"))
    finally:
        server.close()
        c.close()


# ---- drop_clients racing lines in flight ------------------------------------------------------

def test_drop_clients_while_a_locked_line_runs_on_the_serving_thread():
    """The serving thread is inside a handler holding the instrument's lock when another thread
    cuts every client: drop_clients returns at once (it needs neither the lock nor the serving
    thread); the line then finishes whole, its reply is not sent, and the thread serves on."""
    inst = _Lab()
    with SCPIServer(inst, name="hold-drop") as server:
        c, idle = Client(server), Client(server)
        try:
            c.send(b"HOLD?\n")
            assert inst.hold_entered.wait(WAIT_S)
            got: list[int] = []
            t = threading.Thread(target=lambda: got.append(server.drop_clients()), daemon=True)
            t.start()
            t.join(WAIT_S)
            assert not t.is_alive(), "drop_clients blocked behind the line in flight"
            assert got == [2] and server.clients == 0
            inst.hold_release.set()
            data, closed = c.drain()
            assert closed and data == b""       # the line ran, its reply was not sent
            assert inst.value == "held"
            assert idle.drain()[1]
            assert _served(server) == inst.idn
        finally:
            inst.hold_release.set()
            c.close()
            idle.close()


def test_drop_clients_from_a_handler_on_the_serving_thread():
    """A command whose handler cuts every client (as a reboot does), run on the serving thread
    while it holds the instrument's lock: both sessions are cut, the one that asked gets no
    reply to anything after it, and newcomers are served."""
    inst = _Lab()
    server = SCPIServer(inst, name="self-drop")
    inst.command(":REBoot", lambda s, x, a: server.drop_clients())
    with server:
        asker, other = Client(server), Client(server)
        try:
            assert other.query("*IDN?") == inst.idn
            asker.send(b":REB;ECHO? 1\nECHO? 2\n")
            data, closed = asker.drain()
            assert closed and data == b""
            assert other.drain()[1]
            assert _until(lambda: server.clients == 0)
            # the rest of the line in flight may run (its reply is not sent); the next line not
            assert all(2 not in v for v in inst.ran.values())
            assert _served(server) == inst.idn
        finally:
            asker.close()
            other.close()


def test_drop_clients_while_a_reply_is_half_sent():
    """A 16 MB reply half read when every client is cut: the client gets a prefix of it then
    the reset, the counters say no more than was sent, and the thread serves on."""
    inst = _Lab()
    with SCPIServer(inst, name="half-sent") as server:
        slow = socket.socket()
        slow.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        slow.settimeout(WAIT_S)
        slow.connect((server.host, server.port))
        try:
            slow.sendall(b"BIG?\n")
            got = b""
            while len(got) < 100_000:
                chunk = slow.recv(65536)
                assert chunk
                got += chunk
            assert server.busy_clients == 1
            assert server.drop_clients() == 1
            assert server.clients == 0
            slow.settimeout(0.2)
            deadline = time.monotonic() + WAIT_S
            closed = False
            while time.monotonic() < deadline and not closed:
                try:
                    chunk = slow.recv(1 << 20)
                except TimeoutError:
                    continue
                except ConnectionError:
                    closed = True
                    break
                closed = not chunk
                got += chunk
            assert closed
            assert len(got) < inst.big_len and set(got) == {ord("x")}
            assert len(got) <= server.bytes_out < inst.big_len + 2
            assert _served(server) == inst.idn
        finally:
            slow.close()


def test_drop_clients_racing_pipelined_lines_keeps_order_and_runs_nothing_after():
    """Clients pipeline 200 lines (some waiting) and are cut at some point while they run: what
    each got is a prefix of its replies in order, whatever ran for it ran in order and
    includes every reply it got, nothing runs for it once it is cut, and the thread serves on.
    The cutting thread sometimes holds the instrument's lock."""
    inst = _Lab(nap_s=0.002)
    with SCPIServer(inst, name="race-drop") as server:
        for rnd in range(15):
            inst.ran.clear()
            clients = [Client(server) for _ in range(3)]
            try:
                lines = [f"NAP? {k}" if k % 7 == 3 else f"ECHO? {k}" for k in range(200)]
                payload = ("\n".join(lines) + "\n").encode()
                for c in clients:
                    c.send(payload)
                assert clients[rnd % 3].line() == "0"     # some of it ran
                if rnd % 2:
                    with inst.lock:
                        server.drop_clients()
                else:
                    server.drop_clients()
                for c in clients:
                    data, closed = c.drain()
                    assert closed
                    replies = [int(x) for x in data.split(b"\r\n")[:-1]]
                    if c is clients[rnd % 3]:
                        replies.insert(0, 0)
                    assert replies == list(range(len(replies)))
                assert _until(lambda: server.clients == 0)
                snapshot = {p: list(v) for p, v in inst.ran.items()}
                for ran in snapshot.values():
                    assert ran == sorted(ran) and len(set(ran)) == len(ran)
                time.sleep(0.05)
                assert {p: list(v) for p, v in inst.ran.items()} == snapshot
            finally:
                for c in clients:
                    c.close()
            assert _served(server) == inst.idn


def test_drop_clients_racing_connections_and_admission():
    """One thread keeps cutting every client while others connect and query: every query is
    either answered correctly or its connection cut, the slot count stays within bounds, and
    afterwards every session is accounted for."""
    inst = _Lab()
    with SCPIServer(inst, name="race-admit") as server:
        stop = threading.Event()
        errors: list[str] = []
        answered = [0]

        def cutter() -> None:
            while not stop.is_set():
                server.drop_clients()
                n = server.clients
                if n > MAX_CLIENTS:
                    errors.append(f"{n} clients")
                time.sleep(0.001)

        def talker(k: int) -> None:
            for j in range(40):
                try:
                    c = Client(server)
                except OSError:
                    continue
                try:
                    if c.query(f"ECHO? {k * 1000 + j}") != str(k * 1000 + j):
                        errors.append("wrong reply")
                    else:
                        answered[0] += 1
                except TimeoutError:
                    errors.append("neither answered nor cut")
                except OSError:
                    pass
                finally:
                    c.close()

        cut = threading.Thread(target=cutter, daemon=True)
        talkers = [threading.Thread(target=talker, args=(k,), daemon=True) for k in range(4)]
        cut.start()
        for t in talkers:
            t.start()
        for t in talkers:
            t.join(120)
        stop.set()
        cut.join(WAIT_S)
        assert not any(t.is_alive() for t in talkers) and not cut.is_alive()
        assert not errors, errors[:5]
        assert _until(lambda: server.clients == 0)
        assert _served(server) == inst.idn


# ---- servers sharing one loop: close, start again ---------------------------------------------

def test_closing_one_server_leaves_the_waits_of_the_others_on_the_loop():
    """Two switches and a lab instrument on one loop, each with a session mid-wait: closing the
    lab instrument cuts its session (its wait closed, no reply) and refuses new connections;
    the switches' sessions get their *OPC? replies and the switches keep serving."""
    loop = SCPILoop("shared-close")
    physics = [OCSPhysics(4, seed=k, switching_s=1.0) for k in range(2)]
    switches = [SCPIServer(OCSInstrument(p), name=f"ocs{k}", loop=loop)
                for k, p in enumerate(physics)]
    inst = _Lab()
    lab = SCPIServer(inst, name="lab", loop=loop)
    for s in (*switches, lab):
        s.start()
    clients: list[Client] = []
    try:
        waiting = [Client(s) for s in switches]
        ticking = Client(lab)
        clients += [*waiting, ticking]
        for c in waiting:
            c.send(b":OXC:SWIT:CONN:ADD (@1),(@5);*OPC?\n")
        ticking.send(b"TICK?\n")
        assert _until(lambda: len(inst.ticks) >= 2)
        assert _until(lambda: all(p.moves == 1 for p in physics))
        lab_port = lab.port
        lab.close()
        assert inst.tick_closed.is_set()
        data, closed = ticking.drain()
        assert closed and data == b""
        with pytest.raises(OSError):
            socket.create_connection(("127.0.0.1", lab_port), timeout=5).close()
        assert [c.line() for c in waiting] == ["1", "1"]
        for s in switches:
            assert _served(s).startswith("Polatis")
        assert len(_loop_threads("shared-close")) == 1
    finally:
        for c in clients:
            c.close()
        for s in (*switches, lab):
            s.close()
    assert _until(lambda: not _loop_threads("shared-close"))


def test_a_server_closed_and_started_again_on_its_port():
    """close() then start() on the same server (a fixed port), five times, with a client left
    connected each time: it is cut, the port is served again, and one serving thread at most
    is alive."""
    inst = _Lab()
    port = _free_port()
    server = SCPIServer(inst, port=port, name="restart-own")
    try:
        for _ in range(5):
            assert server.start().endswith(f"::{port}::SOCKET")
            left = Client(server)
            assert left.query("NAP? 7") == "7"
            left.send(b"TICK?\n")
            assert inst.tick_started.wait(WAIT_S)
            assert _served(server) == inst.idn
            assert len(_loop_threads("restart-own")) == 1
            server.close()
            assert left.drain()[1]
            left.close()
            inst.tick_started.clear()
            assert _until(lambda: not _loop_threads("restart-own"))
    finally:
        server.close()


def test_a_shared_loop_starts_again_after_its_last_server_closed():
    """Two servers on one loop, on fixed ports: both closed (the thread ends), then started
    again, three times over; after each start both serve, waits included (the timers work on
    the new thread), and one thread serves them."""
    loop = SCPILoop("restart-shared")
    phys = OCSPhysics(4, seed=1, switching_s=0.05)
    inst = _Lab()
    a = SCPIServer(inst, port=_free_port(), name="lab", loop=loop)
    b = SCPIServer(OCSInstrument(phys), port=_free_port(), name="ocs", loop=loop)
    try:
        for k in range(3):
            a.start()
            b.start()
            assert len(_loop_threads("restart-shared")) == 1
            ca, cb = Client(a), Client(b)
            try:
                assert ca.query(f"NAP? {k}") == str(k)
                pair = f"(@{k + 1}),(@{k + 5})"
                assert cb.query(f":OXC:SWIT:CONN:ONLY {pair};*OPC?") == "1"
                assert cb.query(":OXC:SWIT:CONN:STAT?") == pair
            finally:
                ca.close()
                cb.close()
            a.close()
            assert _served(b).startswith("Polatis")       # still served with a closed
            b.close()
            assert _until(lambda: not _loop_threads("restart-shared"))
    finally:
        a.close()
        b.close()


def test_a_server_closed_from_two_threads_at_once_releases_the_shared_loop_once():
    """Two threads close the same server at the same time (a teardown and a control-plane
    handler, say) while the serving thread is held: one closes it, the other finds it closed;
    the other server on the shared loop keeps serving."""
    loop = SCPILoop("double-close")
    a = SCPIServer(_Lab(), name="a", loop=loop)
    b = SCPIServer(_Lab(), name="b", loop=loop)
    a.start()
    b.start()
    gate = threading.Event()
    try:
        loop.call(lambda: gate.wait(WAIT_S))    # hold the serving thread a moment
        closers = [threading.Thread(target=a.close, daemon=True) for _ in range(2)]
        for t in closers:
            t.start()
        time.sleep(0.2)                          # (both are in close() by now, or about to be)
        gate.set()
        for t in closers:
            t.join(WAIT_S)
        assert not any(t.is_alive() for t in closers)
        assert _loop_threads("double-close"), "the loop stopped under the other server"
        assert _served(b) == b.instrument.idn
        with pytest.raises(OSError):
            socket.create_connection((a.host, a.port), timeout=5).close()
    finally:
        gate.set()
        b.close()


# ---- pipelining and half-close -----------------------------------------------------------------

def test_a_half_closed_client_gets_the_reply_of_its_waiting_line():
    """A client sends two lines, the first waiting, and shuts its sending side: both replies
    still arrive, then the server closes."""
    inst = _Lab(nap_s=0.2)
    with SCPIServer(inst, name="halfclose-few") as server:
        c = Client(server)
        try:
            c.send(b"NAP? 1;ECHO? 2\nECHO? 3\n")
            c.sock.shutdown(socket.SHUT_WR)
            data, closed = c.drain()
            assert closed
            assert data == b"1;2\r\n3\r\n"
            assert _served(server) == inst.idn
        finally:
            c.close()


def test_a_client_that_pipelines_hundreds_of_lines_then_half_closes_gets_every_reply():
    """300 lines in one send behind a line that waits, then shutdown(SHUT_WR): every reply
    arrives, in order, before the server closes the connection."""
    inst = _Lab(nap_s=0.3)
    with SCPIServer(inst, name="halfclose-many") as server:
        c = Client(server)
        try:
            lines = ["NAP? 0"] + [f"ECHO? {k}" for k in range(1, 300)]
            c.send(("\n".join(lines) + "\n").encode())
            c.sock.shutdown(socket.SHUT_WR)
            data, closed = c.drain()
            assert closed
            replies = data.split(b"\r\n")
            assert replies[-1] == b""
            assert [int(r) for r in replies[:-1]] == list(range(300))
        finally:
            c.close()
        assert _served(server) == inst.idn


def test_pipelined_lines_interleaved_across_clients_stay_in_order():
    """Four clients each pipeline 250 lines (every fifth one waiting) at once: each gets its
    own replies, in order, and every line ran once."""
    inst = _Lab(nap_s=0.001)
    with SCPIServer(inst, name="pipeline") as server:
        clients = [Client(server) for _ in range(4)]
        try:
            for k, c in enumerate(clients):
                lines = [f"{'NAP' if j % 5 == 0 else 'ECHO'}? {k * 1000 + j}"
                         for j in range(250)]
                c.send(("\n".join(lines) + "\n").encode())
            for k, c in enumerate(clients):
                assert [c.line() for _ in range(250)] == [str(k * 1000 + j) for j in range(250)]
            assert inst.naps_done == 4 * 50
            assert sorted(len(v) for v in inst.ran.values()) == [200] * 4
        finally:
            for c in clients:
                c.close()
        assert _served(server) == inst.idn


# ---- drop_on fault rules ------------------------------------------------------------------------

def test_drop_on_before_cuts_without_running_the_line_or_the_ones_after():
    inst = _Lab()
    with SCPIServer(inst, name="drop-before") as server:
        server.drop_on(r"set\s+2", "before")           # case-insensitive regex
        c = Client(server)
        try:
            assert c.query("ECHO? 1") == "1"             # no match: served
            c.send(b"SET 1\nSET 2\nSET 3\nGET?\n")
            data, closed = c.drain()
            assert closed and data == b""
            assert inst.value == "1"                     # SET 2 never ran, nor SET 3
        finally:
            c.close()
        again = Client(server)                           # the rule was used up
        try:
            assert again.query("SET 2;GET?") == "2"
        finally:
            again.close()
        assert _served(server) == inst.idn


def test_drop_on_after_runs_the_line_then_cuts_without_its_reply():
    inst = _Lab(nap_s=0.2)
    with SCPIServer(inst, name="drop-after") as server:
        server.drop_on("NAP", "after")
        c = Client(server)
        try:
            c.send(b"SET 1\nNAP? 5;SET 2\nSET 3\n")
            data, closed = c.drain()
            assert closed and data == b""
            assert inst.naps_done == 1 and inst.value == "2"   # ran whole, after its wait
        finally:
            c.close()
        again = Client(server)
        try:
            assert again.query("NAP? 6") == "6"
        finally:
            again.close()


def test_drop_on_rules_are_taken_once_each_in_order():
    """A 'before' and an 'after' rule on the same header: the first matching line is cut
    before it runs, the second after, the third is served."""
    inst = _Lab()
    with SCPIServer(inst, name="drop-both") as server:
        server.drop_on("SET", "after")
        server.drop_on("SET", "before")
        first = Client(server)
        first.send(b"SET a\n")
        assert first.drain() == (b"", True)
        first.close()
        assert inst.value == ""
        second = Client(server)
        second.send(b"SET b\nGET?\n")
        assert second.drain() == (b"", True)
        second.close()
        assert inst.value == "b"
        third = Client(server)
        try:
            assert third.query("SET c;GET?") == "c"
        finally:
            third.close()
    with pytest.raises(ValueError):
        server.drop_on("(", "after")
    with pytest.raises(ValueError):
        server.drop_on("SET", "during")


# ---- counters ---------------------------------------------------------------------------------

def test_bytes_in_and_out_are_counted_per_server_on_a_shared_loop():
    """Every byte read and every byte of reply sent is counted, on the server it belongs to:
    refused lines, lines with no reply and a line split across sends included."""
    loop = SCPILoop("bytes")
    a = SCPIServer(_Lab(), name="a", loop=loop)
    b = SCPIServer(_Lab(), name="b", loop=loop)
    with a, b:
        ca, cb = Client(a), Client(b)
        try:
            chunks = [b"ECHO? 12;NAP? 3\r\n", b"SET x\n:NOPE\n\x01\xff\n", b"GE", b"T?\n",
                      b"BOOM?;ECHO? 4\n", b"\n\n"]
            for ch in chunks:
                ca.send(ch)
            assert ca.line() == "12;3"
            assert ca.line() == "x"
            assert ca.line() == "4"
            last = b"*IDN?\n"
            ca.send(last)
            assert ca.line() == a.instrument.idn
            sent_in = sum(map(len, chunks)) + len(last)
            sent_out = sum(len(r) + 2 for r in ("12;3", "x", "4", a.instrument.idn))
            assert _until(lambda: a.bytes_out == sent_out)
            assert a.bytes_in == sent_in
            assert (b.bytes_in, b.bytes_out) == (0, 0)
            assert cb.query("ECHO? 99") == "99"
            assert _until(lambda: b.bytes_out == 4)
            assert b.bytes_in == len(b"ECHO? 99\n")
            assert (a.bytes_in, a.bytes_out) == (sent_in, sent_out)
            assert re.fullmatch(r'-113,"[^"]*",-101,"[^"]*",-300,"[^"]*"',
                                ca.query(":SYST:ERR:ALL?"))
        finally:
            ca.close()
            cb.close()


# ---- handlers failing inside a wait -------------------------------------------------------------

def test_a_handler_raising_after_its_wait_is_an_error_not_a_cut():
    inst = _Lab()
    with SCPIServer(inst, name="boom") as server:
        c = Client(server)
        try:
            assert c.query("BOOM?;ECHO? 1") == "1"
            assert c.query(":SYST:ERR?").startswith("-300,")
            assert c.query("ECHO? 2") == "2"
        finally:
            c.close()
        assert _served(server) == inst.idn


@pytest.mark.parametrize("bad", [None, math.inf, math.nan, True, "1"],
                         ids=["None", "inf", "nan", "bool", "str"])
def test_a_handler_yielding_a_bad_resume_time_stops_no_other_instrument(bad):
    """A buggy handler yields a bad resume time (a bare `yield`, infinity, NaN, ...): it gets an
    internal fault (-300) where it yielded, the rest of its line runs, and the other
    instruments on the same loop keep serving, their waits included; the same through
    `Instrument.execute`."""
    loop = SCPILoop(f"bad-yield-{bad}")
    inst = _Lab()
    inst.bad_value = bad
    phys = OCSPhysics(4, seed=1, switching_s=0.05)
    lab = SCPIServer(inst, name="lab", loop=loop, idle_timeout_s=1.0)
    ocs = SCPIServer(OCSInstrument(phys), name="ocs", loop=loop)
    with lab, ocs:
        c = Client(lab)
        try:
            assert c.query("BAD?;ECHO? 7") == "7"
            assert c.query(":SYST:ERR?").startswith('-300,"Device-specific error; internal')
            assert c.query(":SYST:ERR?").startswith("0,")
        finally:
            c.close()
        assert _loop_threads(loop.name), "the serving thread died"
        o = Client(ocs)
        try:
            assert o.query(":OXC:SWIT:CONN:ADD (@1),(@5);*OPC?") == "1"
        finally:
            o.close()
        assert _served(lab) == inst.idn
    session = Session("direct")
    assert inst.execute(session, "BAD?;ECHO? 8") == "8"
    assert session.pop_error().startswith("-300,")


def test_a_waiting_line_that_does_not_close_cleanly_still_lets_drop_clients_cut_everyone():
    inst = _Lab(nap_s=0.01)

    waiting = threading.Event()

    def cleanup_fails(session, sfx, arg):
        try:
            waiting.set()
            yield time.monotonic() + 60
        finally:
            raise ValueError("cleanup failed")

    inst.command("CLEANFAIL?", cleanup_fails, locked=False)
    with SCPIServer(inst, name="cleanfail") as server:
        bad, good = Client(server), Client(server)     # `bad` is cut first
        try:
            assert good.query("ECHO? 1") == "1"
            bad.send(b"CLEANFAIL?;NAP? 2\n")
            assert waiting.wait(WAIT_S)
            assert server.drop_clients() == 2
            assert bad.drain()[1], "the session with the bad generator was never closed"
            assert good.drain()[1], "a session after it was never closed"
            assert _served(server) == inst.idn
        finally:
            bad.close()
            good.close()


# ---- admission against waits --------------------------------------------------------------------

def test_a_full_server_cuts_an_idle_session_never_the_one_waiting():
    """MAX_CLIENTS sessions, the oldest of them waiting: newcomers take the slots of the idle
    ones, oldest first, and the waiting one still gets its reply."""
    inst = _Lab()
    with SCPIServer(inst, name="full") as server:
        waiting = Client(server)
        waiting.send(b"GATE?\n")
        assert _until(lambda: server.busy_clients == 1)
        idle = []
        try:
            for _ in range(MAX_CLIENTS - 1):
                c = Client(server)
                assert c.query("*IDN?") == inst.idn
                idle.append(c)
            assert server.clients == MAX_CLIENTS
            for k in range(3):
                newcomer = Client(server)
                idle.append(newcomer)
                assert newcomer.query("*IDN?") == inst.idn
                assert idle[k].drain()[1]             # the longest idle made room
                assert server.clients == MAX_CLIENTS
            assert _nothing_yet(idle[3])              # the next one was left alone
            inst.gate.set()
            assert waiting.line() == "1"              # the waiting one was never cut
        finally:
            inst.gate.set()
            waiting.close()
            for c in idle:
                c.close()


def test_sessions_that_come_and_go_leave_no_timers_behind():
    """A client reconnecting in a loop: each session's idle timer (300 s) is let go when the
    session closes, so the loop's heap stays the size of what is open, not of every session
    of the last idle timeout; a session cut mid-wait (`drop_clients`) takes its resume timer
    with it."""
    loop = SCPILoop("churn")
    lab = _Lab(nap_s=60.0)
    with SCPIServer(lab, name="churn", loop=loop) as server:
        for k in range(300):
            c = Client(server)
            assert c.query(f"ECHO? {k}") == str(k)
            c.reset() if k % 2 else c.close()
        waiting = Client(server)
        waiting.send(b"NAP? 1\n")                       # waits 60 s on the serving thread
        assert _until(lambda: server.busy_clients == 1), server.busy_clients
        assert server.drop_clients() == 1
        assert _until(lambda: server.clients == 0), server.clients
        waiting.close()
        pending = loop.call_wait(lambda: [t for t in loop._timers if t[2] is not None])
        assert pending == [], pending
        held = loop.call_wait(lambda: len(loop._timers))
        assert held <= 2 * scpi_loop.CANCELLED_KEPT + 2, held
        assert _served(server) == lab.idn


def test_a_client_reset_while_its_command_waits_frees_its_slot_at_once():
    """A client that resets its connection while its command waits is gone: its session is
    closed then (the command closed with it), not when the wait ends, so 16 such clients do
    not lock newcomers out for the wait. One that half-closes, or pipelines a line, still gets
    its replies."""
    lab = _Lab(nap_s=60.0)
    with SCPIServer(lab, name="reset-wait") as server:
        gone = [Client(server) for _ in range(MAX_CLIENTS)]
        for c in gone:
            c.send(b"TICK?\n")                          # waits until cut (60 s at most)
        assert _until(lambda: server.busy_clients == MAX_CLIENTS), server.busy_clients
        for c in gone:
            c.reset()
        assert _until(lambda: server.clients == 0), server.clients
        assert lab.tick_closed.is_set()
        lab.nap_s = 0.2
        half = Client(server)
        half.send(b"NAP? 1\nECHO? 2\n")                  # a wait, with a line pipelined
        assert _until(lambda: server.busy_clients == 1), server.busy_clients
        half.sock.shutdown(socket.SHUT_WR)
        data, closed = half.drain()
        assert data.split() == [b"1", b"2"] and closed
        assert _served(server) == lab.idn
