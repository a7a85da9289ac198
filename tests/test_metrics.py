"""The agent's Prometheus metrics (hil/agent/metrics.py): a live lumion stack scraped during a
failover, read back with prometheus-client's own parser; the Grafana dashboard in docs/ names
only metrics the agent exports."""
from __future__ import annotations

import json
import pathlib
import urllib.request

from prometheus_client.parser import text_string_to_metric_families
from test_agent_bus import _rig_on_bus, agent_on_thread

from photonic_testbed.common.jobplan import dp_ring
from photonic_testbed.hil.agent.metrics import AgentMetrics
from photonic_testbed.hil.job.fabric_client import Fabric

ROOT = pathlib.Path(__file__).resolve().parent.parent
TIMEOUT_S = 10.0


def scrape(port: int) -> dict[str, list]:
    """{sample name: [(labels, value)]} of what the endpoint serves now."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=TIMEOUT_S) as r:
        text = r.read().decode()
    out: dict[str, list] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out.setdefault(s.name, []).append((s.labels, s.value))
    return out


def value(samples: dict, metric: str, **labels) -> float:
    return sum(v for got, v in samples.get(metric, []) if labels.items() <= got.items())


def test_a_failover_is_counted_timed_and_its_link_powers_exported(tmp_path):
    with _rig_on_bus(tmp_path, "lumion", "chip", ideal_chip=True) as (emu, rig, _):
        with agent_on_thread(rig, tmp_path / "journal.db", TIMEOUT_S) as agent:
            metrics = AgentMetrics()
            metrics.attach(agent)
            _, port = metrics.serve("127.0.0.1", 0)
            fabric = Fabric(*rig.agent_endpoints(), timeout=TIMEOUT_S)
            try:
                rank_map = fabric.admit(dp_ring(8))
                fabric.phase("dp")
                before = scrape(port)
                assert value(before, "ptb_agent_failovers_total") == 0
                assert value(before, "ptb_agent_phase_switches_total") >= 1
                assert value(before, "ptb_agent_leading") == 1
                assert value(before, "ptb_agent_term") >= 1
                emu.rack.rack.faults.fail_gpu(rank_map[3])
                assert fabric.wait_restart(timeout=20) is not None
                after = scrape(port)
            finally:
                fabric.close()
    assert value(after, "ptb_agent_failovers_total", outcome="swapped") == 1
    # the failover's decision and its verification, timed
    assert value(after, "ptb_agent_latency_seconds_count", kind="decision") >= 1
    assert value(after, "ptb_agent_latency_seconds_count", kind="verified") >= 1
    assert value(after, "ptb_agent_latency_seconds_sum", kind="decision") > 0
    # the phase's 8 circuits, and those the swap added (the spare's)
    assert value(after, "ptb_agent_circuits_moved_total", switch="chip", change="added") >= 10
    powers = after["ptb_link_received_power_dbm"]
    assert powers and all(got["switch"] == "chip" and -12.0 <= v <= 1.0 for got, v in powers)
    assert value(after, "ptb_agent_alarms_active") == 0


def test_the_grafana_dashboard_is_grafana_json_over_the_stacks_metrics():
    board = json.loads((ROOT / "docs" / "grafana-agent.json").read_text(encoding="utf-8"))
    assert isinstance(board["title"], str) and isinstance(board["schemaVersion"], int)
    assert board["panels"] and len({p["id"] for p in board["panels"]}) == len(board["panels"])
    from photonic_testbed.hil.devices.metrics import ServiceMetrics
    names = {f.name for f in AgentMetrics().registry.collect()} | \
        {f.name for f in ServiceMetrics([]).registry.collect()}
    for panel in board["panels"]:
        assert {"type", "title", "gridPos", "targets"} <= set(panel)
        assert {"x", "y", "w", "h"} <= set(panel["gridPos"])
        for target in panel["targets"]:
            used = {n for n in names if n in target["expr"]}
            assert used, f"panel {panel['title']!r} names no metric the stack exports"


def test_device_services_count_their_requests_refusals_and_failures_and_report_heater_power(
        tmp_path):
    """A switch service with CURVE (an observer's change refused, a bad request failed) and the
    lumion chip's service (its heater power and budget), scraped through one ServiceMetrics."""
    import threading

    import pytest
    import zmq
    from test_roles import keys_of, make_keys

    from photonic_testbed.emulator.rig import EmulatedRig
    from photonic_testbed.hil.bus.client import RemoteError, ServiceClient, Unauthorized
    from photonic_testbed.hil.devices.metrics import ServiceMetrics
    from photonic_testbed.hil.devices.service import DeviceService, ServiceSpec
    from photonic_testbed.hil.devices.together import serve_together
    from photonic_testbed.hil.rig import rig_spec

    keys = make_keys(tmp_path / "keys")
    context = zmq.Context()
    stop = threading.Event()
    with EmulatedRig(rig_spec("lumion"), ideal_chip=True) as emu:
        services = [
            DeviceService(ServiceSpec("ocs", "switch", "mem", driver="tests.bus_doubles:"
                                      "MemorySwitch", options={"ports": 8},
                                      curve_secret=str(keys / "server.key_secret"),
                                      curve_authorized=str(keys / "authorized")),
                          context=context),
            DeviceService(ServiceSpec("chip", "chip", emu.endpoints["dac"], telemetry_hz=20.0,
                                      options={"topology": "benes16"}), context=context)]
        thread = None
        try:
            endpoints = [s.bind() for s in services]
            thread = threading.Thread(target=serve_together, args=(services, stop),
                                      daemon=True)
            thread.start()
            _, port = ServiceMetrics(services).serve("127.0.0.1", 0)
            with ServiceClient(endpoints[0][0], keys=keys_of(keys, "agent"),
                               timeout=TIMEOUT_S, term=1) as c:
                c.call("apply_circuits", circuits=[[1, 9]])
                with pytest.raises(RemoteError, match="CircuitConflict"):
                    c.call("apply_circuits", circuits=[[1, 9], [2, 9]])
            with ServiceClient(endpoints[0][0], keys=keys_of(keys, "observer"),
                               timeout=TIMEOUT_S) as c:
                c.call("read_circuits")
                with pytest.raises(Unauthorized):
                    c.call("apply_circuits", circuits=[])
            with ServiceClient(endpoints[1][0], timeout=TIMEOUT_S) as c:
                c.call("set_heaters", volts=[2.0, 3.0], first=0)
            from tests.timeouts import wait_until
            # a telemetry pass after the heaters were set (one before reports 0 mW)
            got = wait_until(lambda: value(s := scrape(port), "ptb_heater_power_mw",
                                           device="chip") > 10 and s,
                             "the chip's telemetry of the heaters set", TIMEOUT_S)
        finally:
            stop.set()
            if thread is not None:
                thread.join(5)
            for s in services:
                s.close()
            context.term()
    assert value(got, "ptb_device_operations_total", device="ocs", op="apply_circuits") == 2
    assert value(got, "ptb_device_operations_total", device="ocs", op="read_circuits") == 1
    assert value(got, "ptb_device_refused_total", device="ocs", op="apply_circuits",
                 role="observer") == 1
    assert value(got, "ptb_device_failures_total", device="ocs", error="CircuitConflict") == 1
    assert value(got, "ptb_device_failures_total", device="ocs", error="Unauthorized") == 1
    # 2 V and 3 V on two heaters of about 1 kOhm: about 13 mW, against the board's budget
    assert 10 < value(got, "ptb_heater_power_mw", device="chip") < 16
    assert value(got, "ptb_heater_power_budget_mw", device="chip") > 0
    assert value(got, "ptb_device_telemetry", device="chip", name="total_power_mw") > 10


def test_the_rig_file_names_where_each_device_service_serves_its_metrics(tmp_path):
    """`metrics = "HOST:PORT"` in a device's table: `ptb serve` serves that service's metrics
    there, in its own process and with --one-process alike; a value that is no address is
    refused with the rig file's line."""
    import dataclasses
    import os
    import subprocess
    import sys

    import pytest

    from photonic_testbed.emulator.rig import EmulatedRig
    from photonic_testbed.hil import rig as rigfile
    from photonic_testbed.hil.bus.client import ServiceClient
    from photonic_testbed.hil.rig import RigFileError, rig_spec
    from photonic_testbed.hil.rig.emulated import free_ports

    with EmulatedRig(rig_spec("opus"), seed=1) as emu:
        rig = rigfile.for_emulator("opus", emu.endpoints)
        for one_process in (False, True):
            ports = free_ports(2)
            devices = dict(rig.devices)
            for name, port in zip(("laser", "powermeter"), ports, strict=True):
                devices[name] = dataclasses.replace(devices[name], metrics=f"127.0.0.1:{port}")
            path = tmp_path / f"rig{int(one_process)}.toml"
            rigfile.write(path, dataclasses.replace(rig, devices=devices))
            assert rigfile.load(path).service_specs(["laser"])[0].metrics == \
                f"127.0.0.1:{ports[0]}"
            proc = subprocess.Popen(
                [sys.executable, "-m", "photonic_testbed.ptb", "serve", "--rig", str(path),
                 "--device", "laser", "--device", "powermeter",
                 *(["--one-process"] if one_process else [])],
                cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            try:
                said = []
                for line in proc.stdout:
                    said.append(line)
                    if "Ctrl-C" in line:
                        break
                assert any(f"metrics on http://127.0.0.1:{ports[1]}/metrics" in s
                           for s in said), "".join(said)
                with ServiceClient(devices["laser"].request, timeout=TIMEOUT_S) as c:
                    c.call("read_laser")
                laser, meter = scrape(ports[0]), scrape(ports[1])
            finally:
                proc.terminate()
                proc.wait(30)
            assert value(laser, "ptb_device_operations_total", device="laser",
                         op="read_laser") == 1
            assert [s[0] for s in meter["ptb_device_requests_total"]] == [
                {"device": "powermeter"}]
            assert not [s for s in laser.get("ptb_device_requests_total", [])
                        if s[0].get("device") != "laser"]      # its own service's alone
    text = path.read_text().replace(f'metrics = "127.0.0.1:{ports[0]}"',
                                    'metrics = "9464"')
    (tmp_path / "bad.toml").write_text(text)
    with pytest.raises(RigFileError, match=r"devices\.laser.*metrics.*HOST:PORT"):
        rigfile.load(tmp_path / "bad.toml")
