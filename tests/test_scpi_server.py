"""The SCPI server framework and each emulated instrument under bad input: unknown headers,
bad numbers, a megabyte without a newline, binary garbage, clients vanishing mid-command, and
hypothesis-generated and mutated lines. The server must keep answering *IDN?, and the switch's
state must change only through valid commands."""
from __future__ import annotations

import re
import socket
import threading
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from photonic_testbed.emulator import scpi_server
from photonic_testbed.emulator.ocs import OCSInstrument, OCSPhysics
from photonic_testbed.emulator.optical_instruments import LaserInstrument, PowerMeterInstrument
from photonic_testbed.emulator.scpi import (
    ERROR_QUEUE_LEN,
    Instrument,
    Session,
    compile_header,
    split_units,
)
from photonic_testbed.emulator.scpi_loop import SCPILoop
from photonic_testbed.emulator.scpi_server import MAX_CLIENTS, MAX_LINE, SCPIServer


class Client:
    """A raw socket client that reads `\\r\\n`-terminated replies."""

    def __init__(self, server: SCPIServer, timeout: float = 5.0):
        self.sock = socket.create_connection((server.host, server.port), timeout=timeout)
        self.buf = b""

    def send(self, data: bytes) -> None:
        self.sock.sendall(data)

    def line(self) -> str:
        while b"\r\n" not in self.buf:
            chunk = self.sock.recv(65536)
            if not chunk:
                raise ConnectionError("server closed the connection")
            self.buf += chunk
        out, _, self.buf = self.buf.partition(b"\r\n")
        return out.decode()

    def query(self, text: str) -> str:
        self.send(text.encode() + b"\n")
        return self.line()

    def close(self) -> None:
        self.sock.close()


@pytest.fixture
def ocs_server():
    phys = OCSPhysics(8, seed=1, switching_s=0.0)
    with SCPIServer(OCSInstrument(phys), name="ocs") as server:
        yield server


@pytest.fixture
def client(ocs_server):
    c = Client(ocs_server)
    yield c
    c.close()


def test_header_patterns():
    rx = compile_header(":OXC:SWITch:CONNect:STATe?")
    for h in (":OXC:SWIT:CONN:STAT?", "OXC:SWITCH:CONNECT:STATE?", ":OXC:SWIT:CONNECT:STAT?"):
        assert rx.fullmatch(h)
    for h in (":OXC:SWITC:CONN:STAT?", ":OXC:SWIT:CONN:STAT", ":OXC:SWIT:CONN:STATES?"):
        assert not rx.fullmatch(h)
    rx = compile_header(":READ#[:CHANnel#]:POWer?")
    assert rx.fullmatch(":READ2:CHAN1:POW?").groups() == ("2", "1")
    assert rx.fullmatch("READ:POWER?").groups() == ("", None)


def test_split_units_keeps_the_semicolon_list_form():
    assert split_units(":A (@1),(@33);(@2),(@34);*OPC?") == [":A (@1),(@33);(@2),(@34)", "*OPC?"]
    assert split_units('X "a;b";Y') == ['X "a;b"', "Y"]


def test_any_case_short_and_long_forms_and_both_terminators(client):
    assert client.query("*idn?").startswith("Polatis")
    client.send(b":oxc:switch:connect:add (@1),(@9)\r\n")
    assert client.query(":OXC:SWIT:CONN:STAT?") == "(@1),(@9)"
    assert client.query(":oxc:swit:conn:port? 9") == "1"
    assert client.query("*OPC?;:SYST:ERR?") == '1;0,"No error"'


def test_error_queue(client):
    client.send(b":NOPE\n:OXC:SWIT:CONN:PORT? 99\n:OXC:SWIT:CONN:PORT? x\n")
    assert client.query(":SYST:ERR?").startswith("-113,")
    assert client.query(":SYST:ERR?").startswith("-222,")
    assert client.query(":SYST:ERR?").startswith("-104,")
    assert client.query(":SYST:ERR?") == '0,"No error"'
    client.send(b":NOPE\n" * (ERROR_QUEUE_LEN + 5))
    entries = client.query(":SYST:ERR:ALL?")
    assert entries.count('"') == 2 * ERROR_QUEUE_LEN and entries.endswith('-350,"Queue overflow"')
    client.send(b":NOPE\n*CLS\n")
    assert client.query(":SYST:ERR?") == '0,"No error"'


def test_megabyte_without_newline_is_refused_and_the_stream_resyncs(client):
    client.send(b"A" * (1 << 20))
    client.send(b"still the same line\n*IDN?\n")
    assert client.line().startswith("Polatis")
    assert client.query(":SYST:ERR?").startswith("-363,")
    assert client.query(":SYST:ERR?") == '0,"No error"'
    assert MAX_LINE < (1 << 20)


def test_binary_garbage(client):
    client.send(bytes(range(256)) + b"\n\x00\xff\xfe*IDN?\n")
    assert client.query("*IDN?").startswith("Polatis")


def test_client_vanishing_mid_command_leaves_the_server_serving(ocs_server):
    for _ in range(5):
        c = Client(ocs_server)
        c.send(b":OXC:SWIT:CONN:ADD (@1),(@")
        c.close()
    c = Client(ocs_server)
    c.send(b"*IDN?\n")
    c.close()                                   # gone before its reply
    c = Client(ocs_server)
    assert c.query("*IDN?").startswith("Polatis")
    assert c.query(":OXC:SWIT:CONN:STAT?") == "(@),(@)"
    c.close()
    for _ in range(100):                        # bounded wait for the threads to notice
        if ocs_server.clients == 0:
            break
        time.sleep(0.02)
    assert ocs_server.clients == 0


def test_fixed_port_and_close_frees_it():
    inst = Instrument()
    with SCPIServer(inst) as first:
        port = first.port
        assert port > 0
    with SCPIServer(inst, port=port) as again:          # the port was freed by close()
        assert again.port == port
        c = Client(again)
        assert c.query("*IDN?") == inst.idn
        c.close()


def test_handler_fault_is_an_error_not_a_crash():
    inst = Instrument()
    inst.command(":BOOM", lambda s, x, a: 1 / 0)
    session = Session("test")
    assert inst.execute(session, ":BOOM;*IDN?") == inst.idn
    assert session.pop_error().startswith("-300,")


# ---- fuzzing -------------------------------------------------------------------------------

OCS_LINES = [
    ":OXC:SWIT:CONN:ADD (@1,2),(@9,10)", ":OXC:SWITch:CONNect:SUBtract (@1),(@9)",
    ":OXC:SWIT:CONN:ONLY (@3),(@12);(@4),(@13)", ":OXC:SWIT:DISC:ALL", ":oxc:swit:conn:stat?",
    ":OXC:SWIT:CONN:PORT? 3", ":PMON:POW? (@1,9)", ":OXC:SWIT:SIZE?", "*OPC?", "*RST", "*CLS",
    ":OXC:SWIT:CONN:ADD (@1:3),(@14:16)", ":OXC:SWIT:CONN:ONLY (@),(@)",
]
CHANGES = re.compile(r"^:?OXC:SWIT(CH)?:(CONN(ECT)?:(ADD|SUB(TRACT)?|ONLY)|DISC(ONNECT)?:ALL)$")


@st.composite
def mutated(draw, seeds):
    line = draw(st.sampled_from(seeds))
    for _ in range(draw(st.integers(0, 4))):
        op = draw(st.sampled_from(["del", "ins", "rep", "case", "cut", "dup"]))
        i = draw(st.integers(0, max(0, len(line) - 1)))
        c = draw(st.characters(min_codepoint=0, max_codepoint=255))
        if op == "del":
            line = line[:i] + line[i + 1:]
        elif op == "ins":
            line = line[:i] + c + line[i:]
        elif op == "rep":
            line = line[:i] + c + line[i + 1:]
        elif op == "case":
            line = line.swapcase()
        elif op == "cut":
            line = line[:i]
        else:
            line = line + line
    return line


def lines_for(seeds):
    return st.one_of(mutated(seeds), st.text(max_size=80), st.binary(max_size=80).map(
        lambda b: b.decode("latin-1")))


PM_LINES = [":READ1:CHAN1:POW?", ":SENS2:CHAN1:POW:WAV 1550nm", ":SENS1:POW:ATIM 0",
            ":SENS3:POW:UNIT W", ":FETC2:CHAN1:POW?", ":SENS1:CHAN1:POW:RANG:AUTO 1", "*IDN?"]
LASER_LINES = ["sour0:wav 1550nm", "sour0:pow 1mW", "sour0:pow -3dBm", "sour0:pow:stat 1",
               "sour0:pow:unit 1", "sour0:pow?", "*IDN?"]


@pytest.fixture(scope="module")
def fuzz_servers():
    phys = OCSPhysics(8, seed=2, switching_s=0.0)
    meter = PowerMeterInstrument(lambda ch: 0.5, channels=4)
    # Averaging times are accepted but not kept here, so that fuzzed READs never sleep.
    meter.command(":SENSe#[:CHANnel#]:POWer:ATIMe", lambda s, x, a: None)
    meter.commands.insert(0, meter.commands.pop())     # it shadows the real one
    servers = {"ocs": SCPIServer(OCSInstrument(phys), name="ocs-fuzz"),
               "powermeter": SCPIServer(meter, name="pm-fuzz"),
               "laser": SCPIServer(LaserInstrument(), name="laser-fuzz")}
    for s in servers.values():
        s.start()
    watchers = {k: Client(s) for k, s in servers.items()}
    yield {k: (servers[k], watchers[k]) for k in servers}
    for k, s in servers.items():
        watchers[k].close()
        s.close()


@pytest.mark.parametrize("name,seeds,idn", [("ocs", OCS_LINES, "Polatis"),
                                            ("powermeter", PM_LINES, "Keysight"),
                                            ("laser", LASER_LINES, "Keysight")])
@settings(max_examples=100, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_fuzz_socket_keeps_answering(fuzz_servers, name, seeds, idn, data):
    """Whatever one client sends (then vanishing), the server answers *IDN? to the next."""
    server, watcher = fuzz_servers[name]
    payload = data.draw(st.one_of(st.binary(max_size=200), st.lists(lines_for(seeds), max_size=3)
                                  .map(lambda ls: "\n".join(ls).encode("latin-1", "replace"))))
    c = Client(server)
    c.send(payload + b"\n")
    c.close()
    assert watcher.query("*IDN?").startswith(idn)
    for _ in range(250):               # let the server notice the departure (bounded)
        if server.clients <= 1:
            break
        time.sleep(0.004)


def _valid_matching(state: dict[int, int], n: int) -> bool:
    return (all(1 <= i <= n < e <= 2 * n for i, e in state.items())
            and len(set(state.values())) == len(state))


@settings(max_examples=400, deadline=None)
@given(lines=st.lists(lines_for(OCS_LINES), min_size=1, max_size=4))
def test_fuzz_ocs_state_changes_only_through_valid_commands(lines):
    phys = OCSPhysics(8, seed=3, switching_s=0.0)
    inst = OCSInstrument(phys)
    session = Session("fuzz")
    for line in lines:
        line = line.replace("\n", " ").replace("\r", " ")
        before = dict(phys.commanded)
        moves = phys.moves
        inst.execute(session, line)
        after = dict(phys.commanded)
        assert _valid_matching(after, phys.n)
        changed = after != before or phys.moves != moves
        units = [u.partition(" ")[0] for u in split_units(line)] \
            if all(32 <= ord(ch) < 127 or ch == "\t" for ch in line) else []
        if changed:
            assert any(CHANGES.match(u.upper()) for u in units), (line, before, after)
            if len(units) == 1:
                assert not session.errors, (line, session.errors)   # accepted, all or nothing
        elif len(units) == 1 and CHANGES.match(units[0].upper()) and not session.errors:
            # an accepted change that moved nothing asked for what was already there
            assert phys.moves == moves
        session.errors.clear()
    assert inst.execute(session, "*IDN?").startswith("Polatis")


@settings(max_examples=150, deadline=None)
@given(line=lines_for([":READ1:CHAN1:POW?", ":SENS2:CHAN1:POW:WAV 1550nm",
                       ":SENS1:POW:ATIM 0", ":SENS3:POW:UNIT W", ":FETC2:CHAN1:POW?",
                       ":SENS1:CHAN1:POW:RANG:AUTO 1", "*IDN?"]))
def test_fuzz_power_meter(line):
    meter = PowerMeterInstrument(lambda ch: 0.5, channels=4)
    session = Session("fuzz")
    meter.ch = [type(ch)(atim_s=0.0) for ch in meter.ch]
    text = line.replace("\n", " ").replace("\r", " ")
    if re.search(r"ATIM", text, re.I):
        text = re.sub(r"(?i)ATIM\S*\s+\S+", "ATIM 0", text)    # keep fuzzing fast
    meter.execute(session, text)
    assert meter.execute(session, "*IDN?").startswith("Keysight")
    assert all(0 <= ch.atim_s <= 10 and 1.25e-6 <= ch.wavelength_m <= 1.65e-6 for ch in meter.ch)


@settings(max_examples=150, deadline=None)
@given(line=lines_for(["sour0:wav 1550nm", "sour0:pow 1mW", "sour0:pow -3dBm",
                       "sour0:pow:stat 1", "sour0:pow:unit 1", "sour0:pow?", "*IDN?"]))
def test_fuzz_laser(line):
    laser = LaserInstrument()
    session = Session("fuzz")
    laser.execute(session, line.replace("\n", " ").replace("\r", " "))
    assert laser.execute(session, "*IDN?").startswith("Keysight")
    assert laser.MIN_MW * 0.99 <= laser.state.power_mw <= laser.MAX_MW * 1.01
    assert 1.48e-6 <= laser.state.wavelength_m <= 1.64e-6


def test_relative_headers_after_a_semicolon():
    laser = LaserInstrument()
    session = Session("t")
    assert laser.execute(session, ":SOUR0:POW:UNIT 1;STAT 1;:SOUR0:POW:STAT?") == "+1"
    assert laser.state.unit == 1 and laser.state.on
    assert laser.execute(session, ":SOUR0:WAV 1560nm;WAV?") == "+1.56000000E-006"
    assert not session.errors


# ---- idle and slow clients (issue 15, item 5) -----------------------------------------------

def _served(server: SCPIServer) -> str:
    """*IDN? on a fresh connection; generous timeout (the machine may be busy)."""
    c = Client(server)
    c.sock.settimeout(30)
    try:
        return c.query("*IDN?")
    finally:
        c.close()


def _closed_by_server(sock: socket.socket, within_s: float = 60.0) -> bool:
    """True once the server has closed `sock` (EOF or reset), polling up to `within_s`."""
    sock.settimeout(0.2)
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            if sock.recv(100) == b"":
                return True
        except TimeoutError:
            continue
        except ConnectionError:
            return True
    return False


def test_idle_connections_cannot_lock_out_another_client(ocs_server):
    """MAX_CLIENTS connections that send nothing: a newcomer is still served (the longest idle
    one makes room), as many times as newcomers come."""
    idle = [socket.create_connection((ocs_server.host, ocs_server.port), timeout=5)
            for _ in range(MAX_CLIENTS)]
    try:
        for _ in range(3):
            assert _served(ocs_server).startswith("Polatis")
        assert ocs_server.clients <= MAX_CLIENTS
        # the ones that made room were cut, the others are still open
        assert _closed_by_server(idle[0])
    finally:
        for s in idle:
            s.close()


def test_idle_and_trickling_connections_are_dropped_after_the_idle_timeout():
    """A silent client, and one that trickles bytes without ever ending a line, are both cut
    after the idle timeout; a client that keeps sending whole lines is not."""
    phys = OCSPhysics(8, seed=1, switching_s=0.0)
    idle_s = 2.0
    with SCPIServer(OCSInstrument(phys), name="ocs", idle_timeout_s=idle_s) as server:
        silent = socket.create_connection((server.host, server.port), timeout=5)
        trickle = socket.create_connection((server.host, server.port), timeout=5)
        active = Client(server)
        active.sock.settimeout(30)
        try:
            # a client that keeps talking is not idle, however long it stays connected
            trickling = True
            start = time.monotonic()
            while time.monotonic() - start < 2.5 * idle_s:
                assert active.query("*IDN?").startswith("Polatis")
                if trickling:
                    try:
                        trickle.sendall(b"*")     # a byte at a time: never a whole line
                    except OSError:
                        trickling = False         # cut by the server
                time.sleep(0.05)
            assert _closed_by_server(silent)
            assert _closed_by_server(trickle)
            assert active.query("*IDN?").startswith("Polatis")
        finally:
            for s in (silent, trickle):
                s.close()
            active.close()


class _GateInstrument(Instrument):
    """An instrument whose `WAIT?` waits until the test opens the gate (without the lock)."""

    def __init__(self):
        super().__init__()
        self.gate = threading.Event()
        self.command("WAIT?", self._wait, locked=False)

    def _wait(self, session, sfx, arg):
        give_up = time.monotonic() + 60
        while not self.gate.is_set() and time.monotonic() < give_up:
            yield time.monotonic() + 0.01
        return "1" if self.gate.is_set() else "0"


def test_busy_sessions_are_never_cut_to_make_room():
    """When every session is in the middle of a command, a newcomer is refused rather than one
    of them cut; once they are done the newcomer can connect."""
    inst = _GateInstrument()
    with SCPIServer(inst, name="gate") as server:
        busy = [Client(server) for _ in range(MAX_CLIENTS)]
        try:
            for c in busy:
                c.sock.settimeout(60)
                c.send(b"WAIT?\n")
            deadline = time.monotonic() + 30
            while server.busy_clients < MAX_CLIENTS and time.monotonic() < deadline:
                time.sleep(0.01)
            assert server.busy_clients == MAX_CLIENTS
            extra = socket.create_connection((server.host, server.port), timeout=5)
            assert _closed_by_server(extra)
            extra.close()
            inst.gate.set()
            assert [c.line() for c in busy] == ["1"] * MAX_CLIENTS
            assert _served(server) == inst.idn
        finally:
            inst.gate.set()
            for c in busy:
                c.close()


# ---- one serving thread: waits as timers, slow readers, shared loops -------------------------

def _nothing_yet(c: Client) -> bool:
    """True when no reply has reached the client yet."""
    c.sock.setblocking(False)
    try:
        return not c.sock.recv(1, socket.MSG_PEEK)
    except BlockingIOError:
        return True
    finally:
        c.sock.settimeout(30)


def test_a_waiting_command_holds_up_no_other_session():
    """A session waiting (its command yields until the gate opens) holds no thread: another
    session's queries are answered meanwhile, and the waiting one gets its reply once the gate
    opens."""
    inst = _GateInstrument()
    with SCPIServer(inst, name="gate") as server:
        waiting, other = Client(server), Client(server)
        waiting.sock.settimeout(30)
        other.sock.settimeout(30)
        try:
            waiting.send(b"WAIT?;*IDN?\n")
            for _ in range(20):
                assert other.query("*IDN?") == inst.idn
            deadline = time.monotonic() + 30    # `other` is busy until its reply is all sent
            while server.busy_clients > 1 and time.monotonic() < deadline:
                time.sleep(0.01)
            assert server.busy_clients == 1 and _nothing_yet(waiting)
            inst.gate.set()
            assert waiting.line() == f"1;{inst.idn}"
        finally:
            inst.gate.set()
            waiting.close()
            other.close()


def test_lines_sent_at_once_run_in_order_with_their_waits():
    """200 lines in one send (more than one turn of the serving thread), some of them waiting
    for a move: every reply comes, in order, and each line ran on what the one before left."""
    phys = OCSPhysics(8, seed=1, switching_s=0.002)
    lines, want = [], []
    for k in range(100):
        i = k % 8 + 1
        lines += [f":OXC:SWIT:CONN:ONLY (@{i}),(@{i + 8});*OPC?", ":OXC:SWIT:CONN:STAT?"]
        want += ["1", f"(@{i}),(@{i + 8})"]
    with SCPIServer(OCSInstrument(phys), name="ocs") as server:
        c = Client(server)
        c.sock.settimeout(30)
        try:
            c.send(("\n".join(lines) + "\n").encode())
            assert [c.line() for _ in want] == want
            assert c.query(":SYST:ERR?").startswith("0,")
        finally:
            c.close()


def test_a_client_that_reads_nothing_is_cut_and_holds_up_no_one(monkeypatch):
    """A reply bigger than the socket buffers, to a client that reads nothing: the others are
    served meanwhile, and it is cut once its reply has made no progress for SEND_TIMEOUT_S."""
    monkeypatch.setattr(scpi_server, "SEND_TIMEOUT_S", 0.5)
    inst = Instrument()
    inst.command("BIG?", lambda s, sfx, arg: "x" * 16_000_000)
    with SCPIServer(inst, name="big") as server:
        mute = socket.socket()
        mute.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        mute.connect((server.host, server.port))
        try:
            mute.sendall(b"BIG?\n")
            for _ in range(5):
                assert _served(server) == inst.idn
            deadline = time.monotonic() + 60
            while server.clients and time.monotonic() < deadline:
                time.sleep(0.02)
            assert server.clients == 0            # cut, not waiting forever on its reply
            assert server.bytes_out < 16_000_000
            got = 0
            mute.settimeout(30)
            try:
                while chunk := mute.recv(1 << 20):
                    got += len(chunk)
            except ConnectionError:
                pass
            assert got < 16_000_000               # its reply never completed
            assert _served(server) == inst.idn
        finally:
            mute.close()


def test_cutting_sessions_cuts_one_that_waits():
    """`drop_clients` while a session waits: it is cut at once (no reply), from a thread that
    holds the instrument's lock as the emulator's reboot does; newcomers are served."""
    inst = _GateInstrument()
    with SCPIServer(inst, name="gate") as server:
        c = Client(server)
        try:
            c.send(b"WAIT?\n")
            deadline = time.monotonic() + 30
            while server.busy_clients < 1 and time.monotonic() < deadline:
                time.sleep(0.01)
            with inst.lock:
                assert server.drop_clients() == 1
            assert server.clients == 0
            assert _closed_by_server(c.sock)
            assert _served(server) == inst.idn
        finally:
            inst.gate.set()
            c.close()


def test_servers_on_one_loop_share_its_thread():
    """Three instruments on one SCPILoop: one thread serves them all; closing one leaves the
    others serving; the thread ends with the last."""
    loop = SCPILoop("shared")
    before = {t.name for t in threading.enumerate()}
    servers = [SCPIServer(Instrument(), name=f"i{k}", loop=loop) for k in range(3)]
    for k, s in enumerate(servers):
        s.instrument.idn = f"Emulated,Instrument{k},0,1.0"
        s.start()
    try:
        started = {t.name for t in threading.enumerate()} - before
        assert started == {"shared-loop"}
        clients = [Client(s) for s in servers for _ in range(2)]
        for c in clients:
            c.sock.settimeout(30)
        assert [c.query("*IDN?").split(",")[1] for c in clients] == [
            f"Instrument{k}" for k in (0, 0, 1, 1, 2, 2)]
        assert {t.name for t in threading.enumerate()} - before == {"shared-loop"}
        servers[0].close()
        assert _closed_by_server(clients[0].sock)
        assert clients[2].query("*IDN?") == servers[1].instrument.idn
        assert _served(servers[2]) == servers[2].instrument.idn
        for c in clients:
            c.close()
    finally:
        for s in servers:
            s.close()
    deadline = time.monotonic() + 30
    while "shared-loop" in {t.name for t in threading.enumerate()} and \
            time.monotonic() < deadline:
        time.sleep(0.02)
    assert "shared-loop" not in {t.name for t in threading.enumerate()}
