"""Who may do what on the bus (docs/bus.md "Security", docs/agent-bus.md "Who may do what"):
keys bound to roles in the authorised folder, refused before anything moves; a job's name is
its admitting key's; revocation without restarts; the agent's term fences device writes, also
across a device service's restart. Through real sockets (CURVE), on the emulated lumion rig,
checked on the emulator's own truth of what moved."""
from __future__ import annotations

import contextlib
import dataclasses
import json
import threading
import time

import pytest
import zmq

from photonic_testbed.common.jobplan import dp_ring
from photonic_testbed.common.rack_layout import layout
from photonic_testbed.emulator.rig import EmulatedRig
from photonic_testbed.hil import rig as rigfile
from photonic_testbed.hil.agent.authority import MANUAL, job_owners, next_term
from photonic_testbed.hil.agent.bus import AgentProcess
from photonic_testbed.hil.agent.entries import Admit, Manual, Start
from photonic_testbed.hil.agent.sqlite_journal import SqliteJournal
from photonic_testbed.hil.bus import schema
from photonic_testbed.hil.bus.client import (
    BusError,
    RemoteError,
    ServiceClient,
    StaleTerm,
    Unauthorized,
)
from photonic_testbed.hil.bus.mirror import StateSubscriber
from photonic_testbed.hil.bus.security import (
    KeyTable,
    authorize,
    client_keys,
    generate,
    read_metadata,
)
from photonic_testbed.hil.bus.server import Server
from photonic_testbed.hil.devices.service import DeviceService
from photonic_testbed.hil.rig import rig_spec
from tests.timeouts import wait_until

KEYS = (("agent", "agent", ()), ("operator", "operator", ()), ("observer", "observer", ()),
        ("tenant-a", "tenant", ("a",)), ("tenant-b", "tenant", ("b", "a")),
        ("tenant-c", "tenant", ("c",)))
REFUSED_WITHIN_S = 5.0        # the bound of a wait for a refusal (the promise is 1 s)
TIMEOUT_S = 10.0


def make_keys(folder):
    generate(folder, "server")
    for name, role, jobs in KEYS:
        public, _ = generate(folder, name, role, jobs)
        authorize(public, folder / "authorized")
    return folder


def keys_of(folder, name):
    return client_keys(folder / f"{name}.key_secret", folder / "server.key")


def entries(path, kind):
    """The journal's entries of `kind`, read beside the agent that writes it."""
    with SqliteJournal(path, read_only=True) as j:
        return j.entries(kinds=(kind,))


def _until(cond, what, timeout=REFUSED_WITHIN_S, step=0.02):
    return wait_until(cond, what, timeout, step)


@dataclasses.dataclass
class SecureRig:
    emu: EmulatedRig
    rig: rigfile.Rig
    keys: object
    services: dict
    stops: dict
    agent: AgentProcess | None = None

    def client(self, key, device, **kw):
        endpoint = (self.rig.agent_endpoints()[0] if device == "agent"
                    else self.rig.devices[device].request)
        return ServiceClient(endpoint, keys=keys_of(self.keys, key), timeout=TIMEOUT_S, **kw)

    def truth(self):
        """What the emulated hardware holds: the chip's heater outputs, the OCS's mirrors,
        the laser's state."""
        laser = self.emu.optics.laser.state
        return {"heaters": list(self.emu.dac.outputs),
                "ocs": dict(self.emu.optics.physics.truth()["actual"]),
                "laser": (laser.on, laser.power_mw, laser.wavelength_m)}


def _serve(service):
    stop = threading.Event()
    thread = threading.Thread(target=service.serve, args=(stop,), daemon=True)
    thread.start()

    def close():
        stop.set()
        thread.join(5)
        service.close()
    return close


@contextlib.contextmanager
def secure_lumion(tmp_path, *, agent=True, journal=None, state_dir=None):
    """The lumion rig (ideal chip) with CURVE on: its chip, OCS and laser services and the
    rack's health monitor in this process, each on its own thread; the agent (in process, with
    the agent's key) when asked."""
    keys = make_keys(tmp_path / "keys")
    emu = EmulatedRig(rig_spec("lumion"), ideal_chip=True, switching_s=0.0)
    emu.start()
    closers = []
    try:
        lay = layout("lumion")
        gpus = tuple(rigfile.GpuConfig(g, a[0].switch, a[0].tx, g in lay.spares)
                     for g, a in lay.gpus.items())
        for attempt in range(3):      # (ports picked free may be taken before they are bound)
            bus = rigfile.for_emulator("lumion", emu.endpoints, gpus=gpus)
            bus = dataclasses.replace(bus, bus=dataclasses.replace(
                bus.bus, curve=True, server_key=str(keys / "server.key_secret"),
                server_public_key=str(keys / "server.key"),
                authorized_keys=str(keys / "authorized"),
                client_key=str(keys / "agent.key_secret")))
            rigfile.write(tmp_path / "rig.toml", bus)
            rig = rigfile.load(tmp_path / "rig.toml")
            services = {}
            try:
                for spec in rig.service_specs(["chip", "ocs", "laser"], state_dir):
                    services[spec.name] = DeviceService(spec)
                    services[spec.name].bind()
                emu.start_rack(rig.gpus_endpoints(), rig.agent_endpoints(),
                               keys=rig.server_keys())
                break
            except zmq.ZMQError:
                for s in services.values():
                    s.close()
                if emu.rack is not None:
                    emu.rack.close()
                    emu.rack = None
                if attempt == 2:
                    raise
        stops = {name: _serve(s) for name, s in services.items()}
        closers += [lambda: [stop() for stop in stops.values()]]
        got = SecureRig(emu, rig, keys, services, stops)
        if agent:
            got.agent = AgentProcess(rig, str(journal or tmp_path / "journal.db"),
                                     timeout=TIMEOUT_S)
            got.agent.start()
            stop = threading.Event()
            thread = threading.Thread(target=got.agent.run, args=(stop,), daemon=True)
            thread.start()

            def close_agent():
                stop.set()
                thread.join(10)
                got.agent.close()
            closers.append(close_agent)
        yield got
    finally:
        for close in reversed(closers):
            close()
        emu.close()


# ---- keys and roles ---------------------------------------------------------------------------

def test_a_key_names_its_role_in_its_certificate_and_the_folder_is_read_as_it_changes(tmp_path):
    keys = make_keys(tmp_path / "keys")
    assert read_metadata(keys / "authorized" / "tenant-b.key") == {"role": "tenant",
                                                                     "jobs": "b,a"}
    table = KeyTable(keys / "authorized")
    assert table.names == sorted(name for name, _, _ in KEYS)
    public = (keys / "observer.key").read_text().split('public-key = "')[1].split('"')[0]
    user = table.user_id(public.encode())
    assert user is not None and table.identity(user).role == "observer"
    # a role changed in the folder: the same connection is someone else now
    text = (keys / "authorized" / "observer.key").read_text()
    (keys / "authorized" / "observer.key").write_text(text.replace('"observer"', '"operator"'))
    assert table.refresh() and table.revocations == 1
    assert table.identity(user).role == "operator"
    # a certificate without a role (before roles) is an observer's; an unknown role is refused
    (keys / "authorized" / "observer.key").write_text(
        text.replace('    role = "observer"\n', ""))
    (keys / "authorized" / "operator.key").write_text(
        (keys / "operator.key").read_text().replace('"operator"', '"root"'))
    table.refresh()
    assert table.identity(user).role == "observer"
    assert "operator" not in table.names
    # a folder that cannot be read accepts no key (said once), and again once it can
    (keys / "authorized").rename(keys / "away")
    assert table.refresh() and table.names == []
    assert not table.refresh()
    (keys / "away").rename(keys / "authorized")
    table.refresh()
    assert "agent" in table.names
    with pytest.raises(ValueError, match="a tenant's key names the jobs"):
        generate(keys, "t", "tenant")
    with pytest.raises(ValueError, match="jobs are a tenant's"):
        generate(keys, "t", "operator", ["a"])


def test_each_operation_names_who_may_call_it():
    ops = schema.OPERATIONS
    for name in ("apply_circuits", "apply_circuits_together", "set_heaters", "set_laser",
                 "load_calibration"):
        assert ops[name].roles == {"agent"}, name
    for name in ("admit", "phase", "phase_done", "job_failure", "release", "job_report",
                 "rejoin"):
        assert ops[name].roles == {"tenant", "operator"}, name
    for name in ("swap", "clear_gpu", "manual_circuits", "manual_heaters", "manual_laser"):
        assert ops[name].roles == {"operator"}, name
    assert all(op.roles == set(schema.ROLES) for op in ops.values() if op.read_only)
    with pytest.raises(ValueError, match="not for observers"):
        schema.Operation("bump", schema.Args, False, roles=frozenset({"observer"}))


# ---- device services --------------------------------------------------------------------------

def test_a_gui_key_calling_a_devices_change_is_refused_and_nothing_moves(tmp_path):
    with secure_lumion(tmp_path, agent=False) as s:
        calls = [("chip", "apply_circuits", {"circuits": [[1, 20]]}),
                 ("chip", "set_heaters", {"volts": [2.5], "first": 3}),
                 ("chip", "load_calibration", {"calibration": "{}"}),
                 ("ocs", "apply_circuits", {"circuits": [[1, 17]]}),
                 ("ocs", "apply_circuits_together",
                  {"changes": [{"switch": "ocs", "circuits": [[2, 18]]}]}),
                 ("laser", "set_laser", {"on": True, "power_mw": 5.0})]
        before = s.truth()
        for key in ("observer", "operator", "tenant-a"):
            for device, op, args in calls:
                with s.client(key, device) as c:
                    assert c.call("ping")["device"] == device        # reads are for everyone
                    with pytest.raises(Unauthorized) as refused:
                        c.call(op, **args)
                    assert f"key {key!r}" in str(refused.value) and op in str(refused.value)
        assert s.truth() == before
        # the agent's key moves them: the truth above could have changed
        with s.client("agent", "ocs") as c:
            c.call("apply_circuits", circuits=[[1, 17]])
        with s.client("agent", "laser") as c:
            c.call("set_laser", on=True)
        assert s.truth()["ocs"] == {1: 17} and s.truth()["laser"][0] is True


def test_a_key_taken_out_of_the_folder_is_refused_within_a_second_and_loses_its_feed(tmp_path):
    with secure_lumion(tmp_path, agent=False) as s:
        ocs = s.rig.devices["ocs"]
        with s.client("observer", "ocs") as observer, s.client("agent", "ocs") as writer, \
                StateSubscriber({"ocs": (ocs.request, ocs.publish)},
                                keys=keys_of(s.keys, "observer")) as gone, \
                StateSubscriber({"ocs": (ocs.request, ocs.publish)},
                                keys=keys_of(s.keys, "operator")) as stays:
            for sub in (gone, stays):
                assert sub.wait_synced(TIMEOUT_S)
            writer.call("apply_circuits", circuits=[[1, 17]])
            for sub in (gone, stays):
                _until(lambda sub=sub: (sub.poll(0.02), sub.state("ocs")["circuits"])[1]
                       == [[1, 17]], "both subscribers see the first change")
            assert observer.call("read_circuits") == {"circuits": [[1, 17]]}
            (s.keys / "authorized" / "observer.key").unlink()
            t0 = time.monotonic()

            def refused() -> bool:
                try:
                    observer.call("ping", timeout=1.0)
                except Unauthorized:
                    return True
                return False
            _until(refused, "the removed key's requests refused", step=0.01)
            took = time.monotonic() - t0
            print(f"removed key refused after {took * 1e3:.0f} ms")
            # its subscription went with the publisher's new socket; the other one came back
            writer.call("apply_circuits", circuits=[[2, 18]])
            _until(lambda: (stays.poll(0.02), stays.state("ocs")["circuits"])[1] == [[2, 18]],
                   "the authorised subscriber sees the next change", timeout=TIMEOUT_S)
            end = time.monotonic() + 1.0
            while time.monotonic() < end:
                gone.poll(0.05)
            assert gone.state("ocs")["circuits"] == [[1, 17]]
            assert stays.mirror("ocs").resyncs >= 1


def test_an_agent_with_a_lower_term_is_refused_also_after_the_service_restarted(tmp_path):
    state = tmp_path / "state"
    with secure_lumion(tmp_path, agent=False, state_dir=state) as s:
        with s.client("agent", "ocs", term=5) as new, s.client("agent", "ocs", term=4) as old:
            new.call("apply_circuits", circuits=[[1, 17]])
            with pytest.raises(StaleTerm, match="term 5.*term 4"):
                old.call("apply_circuits", circuits=[[2, 18]])
            together = old.call("apply_circuits_together", changes=[
                {"switch": "ocs", "circuits": [[2, 18]]}])["changes"][0]
            assert together["error"] == "StaleTerm"
            assert s.truth()["ocs"] == {1: 17}
            assert json.loads((state / "ocs.term").read_text())["term"] == 5
            # the service restarts (a new process would read the same file)
            spec = s.services["ocs"].spec
            s.stops.pop("ocs")()
            restarted = DeviceService(dataclasses.replace(
                spec, request=s.rig.devices["ocs"].request,
                publish=s.rig.devices["ocs"].publish))
            restarted.bind()
            close = _serve(restarted)
            try:
                assert restarted.server.term == 5
                with pytest.raises(StaleTerm):
                    old.call("apply_circuits", circuits=[[2, 18]])
                assert s.truth()["ocs"] == {1: 17}
                new.call("apply_circuits", circuits=[[3, 19]])
                assert s.truth()["ocs"] == {3: 19}
            finally:
                close()


def test_a_damaged_term_file_stops_the_service_rather_than_lower_the_fence(tmp_path):
    spec = rigfile.for_emulator("opus", {"ocs": "tcp://127.0.0.1:1"}).service_specs(
        ["ocs"], tmp_path)[0]
    (tmp_path / "ocs.term").write_text('{"term": "five"}')
    with pytest.raises(Exception, match="ocs.term is damaged"):
        DeviceService(spec).bind()


# ---- the agent --------------------------------------------------------------------------------

def test_the_agent_journals_its_term_one_above_the_last(tmp_path):
    with SqliteJournal(tmp_path / "j.db") as j:
        assert next_term(j) == 1
        j.record(Start(term=4), "agent started")
        j.record(Start(), "agent started")          # (an agent before terms)
        assert next_term(j) == 5


def test_a_tenant_key_acting_as_another_job_is_refused_and_nothing_moves(tmp_path):
    with secure_lumion(tmp_path) as s:
        with s.client("tenant-a", "agent") as a, s.client("tenant-b", "agent") as b, \
                s.client("tenant-c", "agent") as c, s.client("operator", "agent") as op:
            got = a.call("admit", plan=dp_ring(4).to_dict(), job="a")
            a_map = got["rank_map"]
            b.call("admit", plan=dp_ring(4).to_dict(), job="b")
            a.call("phase", phase="dp", job="a")
            b.call("phase", phase="dp", job="b")
            before = s.truth()
            jobs = a.call("snapshot")["state"]["jobs"]
            rejoin = {"plan": dp_ring(4).to_dict(), "rank_map": a_map, "restart_seq": 0,
                      "state": "failed", "job": "a"}
            gpu = a_map["0"]
            asks = [("phase", {"phase": "dp", "job": "a"}),
                    ("phase_done", {"phase": "dp", "job": "a"}),
                    ("swap", {"gpu": gpu}),
                    ("job_failure", {"reason": "x", "gpus": [gpu], "job": "a"}),
                    ("release", {"job": "a"}),
                    ("job_report", {"state": "failed", "job": "a"}),
                    ("rejoin", rejoin),
                    ("admit", {"plan": dp_ring(4).to_dict(), "job": "a"})]
            for op_name, args in asks:
                # tenant-b's key names job a, but tenant-a's key admitted it; tenant-c's key
                # does not name it; a swap is an operator's
                for key, client, why in (("tenant-b", b, "it is the job of key 'tenant-a'"),
                                         ("tenant-c", c, "its key names c")):
                    with pytest.raises(Unauthorized) as refused:
                        client.call(op_name, **args)
                    said = str(refused.value)
                    assert f"key {key!r}" in said, said
                    assert ("may not call swap on agent: it is for operator keys"
                            if op_name == "swap" else f"job 'a': {why}"
                            if key == "tenant-b" else why) in said, said
            assert s.truth() == before
            assert a.call("snapshot")["state"]["jobs"] == jobs
            decisions = [e.details for e in entries(tmp_path / "journal.db", "decision")
                         if isinstance(e.details, Admit)]
            assert [(d.job, d.owner) for d in decisions] == [("a", "tenant-a"),
                                                            ("b", "tenant-b")]
            # the owner and an operator may
            a.call("job_report", state="running", step=3, job="a")
            op.call("job_report", state="running", step=4, job="a")
            assert op.call("release", job="b")["job"] == "b"


def test_owners_outlive_the_agent_and_an_unowned_job_is_the_operators(tmp_path):
    journal = tmp_path / "journal.db"
    with secure_lumion(tmp_path, journal=journal) as s:
        with s.client("tenant-a", "agent") as a:
            a.call("admit", plan=dp_ring(4).to_dict(), job="a")
        # a job admitted in the agent's own process (no key): no one's
        s.agent.in_loop(lambda: s.agent.agent.admit(dp_ring(4), job="b")).result(TIMEOUT_S * 3)
    with SqliteJournal(journal, read_only=True) as j:
        assert job_owners(j) == {"a": "tenant-a", "b": None}
    (tmp_path / "keys").rename(tmp_path / "old-keys")
    with secure_lumion(tmp_path, journal=journal) as s:      # the agent started again
        with s.client("tenant-a", "agent") as a, s.client("tenant-b", "agent") as b, \
                s.client("operator", "agent") as op:
            assert a.call("phase", phase="dp", job="a")["granted"]
            with pytest.raises(Unauthorized, match="job 'a': it is the job of key 'tenant-a'"):
                b.call("phase", phase="dp", job="a")
            with pytest.raises(Unauthorized, match="no key's job on record"):
                b.call("phase", phase="dp", job="b")
            assert op.call("phase", phase="dp", job="b")["granted"]


def test_an_agent_with_a_lower_term_than_its_switch_has_seen_is_refused(tmp_path):
    with secure_lumion(tmp_path, state_dir=tmp_path / "state") as s:
        assert s.agent.term == 1
        with s.client("agent", "chip", term=7) as newer:
            newer.call("read_circuits")
            newer.call("apply_circuits", circuits=[])        # another agent, of term 7
        before = s.truth()
        with s.client("tenant-a", "agent") as a:
            with pytest.raises(RemoteError, match="StaleTerm"):
                a.call("admit", plan=dp_ring(4).to_dict(), job="a")
        assert s.truth() == before
        assert any("StaleTerm" in e.cause and "term 7" in e.cause
                   for e in entries(tmp_path / "journal.db", "alarm"))


def test_an_operators_manual_circuits_are_journaled_and_kept_beside_the_jobs(tmp_path):
    journal = tmp_path / "journal.db"
    with secure_lumion(tmp_path, journal=journal) as s:
        with s.client("tenant-a", "agent") as a, s.client("operator", "agent") as op, \
                s.client("observer", "chip") as chip:
            a.call("admit", plan=dp_ring(4).to_dict(), job="a")
            a.call("phase", phase="dp", job="a")
            # ports 12 (in) and 29 (out) carry no GPU of the lumion rack
            got = op.call("manual_circuits", switch="chip", connect=[[12, 29]])
            assert got["circuits"] == [[12, 29]]
            on_chip = dict(map(tuple, chip.call("read_circuits")["circuits"]))
            assert on_chip[12] == 29
            # a port of a GPU a job holds is refused, before anything moves
            gpu_port = s.rig.gpus[0].port
            with pytest.raises(RemoteError, match="which job a holds"):
                op.call("manual_circuits", switch="chip", connect=[[gpu_port, 30]])
            with pytest.raises(Unauthorized, match="may not call manual_circuits"):
                a.call("manual_circuits", switch="chip", connect=[[13, 30]])
            a.call("release", job="a")
            a.call("admit", plan=dp_ring(4).to_dict(), job="a")
            a.call("phase", phase="dp", job="a")
            assert dict(map(tuple, chip.call("read_circuits")["circuits"]))[12] == 29
        manual = [e for e in entries(journal, "decision") if isinstance(e.details, Manual)]
        assert [(m.details.device, m.details.by, m.details.circuits) for m in manual] == \
            [("chip", "operator", [(12, 29)])]
    (tmp_path / "keys").rename(tmp_path / "old-keys")
    with secure_lumion(tmp_path, journal=journal) as s:      # the agent started again
        with s.client("tenant-a", "agent") as a, s.client("observer", "chip") as chip, \
                s.client("operator", "agent") as op:
            assert s.agent.agent.writer.current("chip").get(12) == 29
            a.call("phase", phase="dp", job="a")
            assert dict(map(tuple, chip.call("read_circuits")["circuits"]))[12] == 29
            got = op.call("manual_circuits", switch="chip", disconnect=[12])
            assert got["circuits"] == []
            assert 12 not in dict(map(tuple, chip.call("read_circuits")["circuits"]))
            assert MANUAL not in s.agent.agent.jobs


def test_an_operators_manual_heaters_and_laser_go_through_the_agent(tmp_path):
    with secure_lumion(tmp_path) as s:
        with s.client("operator", "agent") as op, s.client("observer", "chip") as chip:
            version = chip.call("ping")["version"]
            op.call("manual_heaters", device="chip", volts=[1.5], first=20, version=version)
            assert s.truth()["heaters"][20] == pytest.approx(1.5, abs=0.01)
            with pytest.raises(RemoteError, match="StaleState"):
                op.call("manual_heaters", device="chip", volts=[2.0], first=20,
                        version=version)
            op.call("manual_laser", device="laser", on=True, power_mw=2.0)
            assert s.truth()["laser"][:2] == (True, pytest.approx(2.0))
            with pytest.raises(RemoteError, match="not a device with a laser"):
                op.call("manual_laser", device="chip", on=False)
        assert s.services["chip"].server.term == s.agent.term == 1
        kinds = [(e.details.device, e.details.volts, e.details.laser)
                 for e in entries(tmp_path / "journal.db", "decision")
                 if isinstance(e.details, Manual)]
        assert kinds == [("chip", [1.5], None), ("chip", [2.0], None),
                         ("laser", None, {"on": True, "power_mw": 2.0})]


def test_without_curve_every_local_process_is_trusted(tmp_path):
    server = Server("ocs", {}, handlers={"apply_circuits": lambda args: {"ok": True}})
    request, _ = server.bind()
    stop = threading.Event()
    thread = threading.Thread(target=lambda: [server.poll(0.02) for _ in iter(stop.is_set,
                                                                                True)])
    thread.start()
    try:
        with ServiceClient(request, timeout=TIMEOUT_S) as c:
            assert c.call("apply_circuits", circuits=[[1, 2]]) == {"ok": True}
    except BusError:
        raise
    finally:
        stop.set()
        thread.join(5)
        server.close()


def test_the_demo_runs_with_curve_and_roles(tmp_path):
    """`ptb demo --secure`: each process with its own key; the wrong role's changes refused;
    the job recovers as without."""
    import os
    import pathlib
    import subprocess
    import sys
    root = pathlib.Path(__file__).resolve().parent.parent
    done = subprocess.run([sys.executable, "-m", "photonic_testbed.ptb", "demo", "--secure",
                           "--headless", "--ideal-chip", "--seconds", "0.5", "--workdir",
                           str(tmp_path)], cwd=root, env=dict(os.environ, PYTHONPATH=str(root)),
                          capture_output=True, text=True, timeout=400)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out
    for line in ("CURVE on, with roles",
                 "apply_circuits asked of chip with the observer's key: refused",
                 "swap asked of agent with the tenant's key: refused",
                 "phase asked of agent with the tenant's key: refused", "demo succeeded"):
        assert line in out, out
    rig = rigfile.load(tmp_path / "rig.toml")
    assert rig.bus.curve and rig.bus.client_key.endswith("agent.key_secret")
    assert read_metadata(tmp_path / "keys" / "authorized" / "tenant.key") == {
        "role": "tenant", "jobs": "dp"}
    assert json.loads((tmp_path / "rig-state" / "chip.term").read_text())["term"] == 1


def test_ptb_keys_makes_keys_for_a_role(capsys, tmp_path):
    from photonic_testbed.ptb.cli import main
    folder = tmp_path / "keys"
    assert main(["keys", "--dir", str(folder), "--role", "tenant", "--job", "train-a",
                 "--job", "train-b", "--authorize", "ta"]) == 0
    assert "ta (tenant of train-a, train-b)" in capsys.readouterr().out
    assert read_metadata(folder / "authorized" / "ta.key") == {"role": "tenant",
                                                               "jobs": "train-a,train-b"}
    assert KeyTable(folder / "authorized").names == ["ta"]
    for argv, said in ((["--role", "tenant", "t"], "names the jobs it may act on"),
                       (["--role", "agent", "--job", "x", "t"], "jobs are a tenant's"),
                       (["--job", "x", "t"], "jobs are a tenant's"),
                       (["--role", "tenant", "--job", "a,b", "t"], "no commas")):
        assert main(["keys", "--dir", str(folder), *argv]) == 1
        assert said in capsys.readouterr().err
    assert not (folder / "t.key").exists()
    assert main(["keys", "--dir", str(folder), "--authorize", "plain"]) == 0
    assert "as an observer's key (no --role)" in capsys.readouterr().out
    assert main(["demo", "--secure", "--job", "torch"]) == 1
    assert "--secure runs the emulated job" in capsys.readouterr().err


def test_services_of_one_process_share_its_key_checks(tmp_path):
    """`ptb serve --one-process` with CURVE: the services of one ZeroMQ context share its one
    ZAP handler (ZeroMQ asks one per context), which outlives all but the last to close."""
    from photonic_testbed.hil.devices.service import ServiceSpec
    from photonic_testbed.hil.devices.together import serve_together
    keys = make_keys(tmp_path / "keys")
    context = zmq.Context()
    services = [DeviceService(ServiceSpec(
        f"s{i}", "switch", "mem", driver="tests.bus_doubles:MemorySwitch", options={"ports": 8},
        curve_secret=str(keys / "server.key_secret"),
        curve_authorized=str(keys / "authorized")), context=context) for i in range(3)]
    stop = threading.Event()
    thread = None
    try:
        endpoints = [s.bind() for s in services]
        thread = threading.Thread(target=serve_together, args=(services, stop), daemon=True)
        thread.start()
        with ServiceClient(endpoints[0][0], keys=keys_of(keys, "agent"), timeout=TIMEOUT_S,
                           term=1) as c:
            got = c.call("apply_circuits_together", changes=[
                {"switch": f"s{i}", "circuits": [[1, 9 + i]]} for i in range(3)])
            assert [p["result"]["added"] for p in got["changes"]] == [[[1, 9]], [[1, 10]],
                                                                      [[1, 11]]]
        with ServiceClient(endpoints[2][0], keys=keys_of(keys, "observer"),
                           timeout=TIMEOUT_S) as c:
            assert c.call("read_circuits") == {"circuits": [[1, 11]]}
            with pytest.raises(Unauthorized):
                c.call("apply_circuits", circuits=[])
    finally:
        stop.set()
        if thread is not None:
            thread.join(10)
        for s in services:
            s.close()
        context.term()


def test_a_publisher_whose_port_is_taken_while_it_rebinds_says_so_and_binds_later(
        monkeypatch):
    from photonic_testbed.hil.bus import server as server_module
    from photonic_testbed.hil.bus.server import Publisher
    monkeypatch.setattr(server_module, "REBIND_S", 0.05)
    context = zmq.Context()
    pub = Publisher(context, "tcp://127.0.0.1:0", None)
    thief = None
    try:
        pub.sock.close(linger=0)
        thief = _until(lambda: _bound_or_none(context, pub.endpoint), "the port freed",
                       timeout=TIMEOUT_S)
        with pytest.raises(zmq.ZMQError):
            pub.rebind()
        assert not pub.bound
        thief.close(linger=0)
        _until(lambda: _bind_again(pub), "bound again once the port is free",
               timeout=TIMEOUT_S)
        assert pub.bound and pub.sock.getsockopt_string(zmq.LAST_ENDPOINT) == pub.endpoint
    finally:
        pub.close()
        context.term()


def _bound_or_none(context, endpoint):
    sock = context.socket(zmq.PUB)
    sock.linger = 0
    try:
        sock.bind(endpoint)
        return sock
    except zmq.ZMQError:
        sock.close()
        return None


def _bind_again(pub) -> bool:
    try:
        pub.bind_again()
        return True
    except zmq.ZMQError:
        return False


def test_a_key_whose_role_changed_is_held_to_the_new_one_on_the_same_connection(tmp_path):
    from photonic_testbed.hil.bus.security import server_keys
    keys = make_keys(tmp_path / "keys")
    changed: list = []
    server = Server("ocs", {}, keys=server_keys(keys / "server.key_secret",
                                               keys / "authorized"),
                    handlers={"apply_circuits": lambda args: changed.append(args) or {}})
    request, _ = server.bind()
    stop = threading.Event()

    def serve():
        while not stop.is_set():
            server.poll(0.02)
    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        with ServiceClient(request, keys=keys_of(keys, "observer"), timeout=TIMEOUT_S) as c:
            with pytest.raises(Unauthorized, match=r"key 'observer' \(observer\) may not"):
                c.call("apply_circuits", circuits=[[1, 2]])
            listed = keys / "authorized" / "observer.key"
            listed.write_text(listed.read_text().replace('"observer"', '"agent"'))

            def allowed() -> bool:
                try:
                    c.call("apply_circuits", circuits=[[1, 2]], timeout=1.0)
                    return True
                except Unauthorized:
                    return False
            _until(allowed, "the key's new role taken on its connection")
            listed.write_text(listed.read_text().replace('"agent"', '"observer"'))
            _until(lambda: not allowed(), "the key's role taken back")
            ran = len(changed)
            with pytest.raises(Unauthorized):
                c.call("apply_circuits", circuits=[[1, 2]])
        assert ran >= 1 and len(changed) == ran
    finally:
        stop.set()
        thread.join(5)
        server.close()
