"""A service is never deaf behind its own device: `ping`, `describe` and `snapshot` are answered
without device I/O while the device works; a telemetry pass yields to requests between its
channels; and passes are spaced by what they cost, never back to back. Checked with power meter
doubles whose reads the test holds, and on the emulated lumion rig, every device served in its
own process over real sockets (its 16-port meter reads each port for 0.1 s)."""
from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator

import pytest

from photonic_testbed.emulator.rig import EmulatedRig
from photonic_testbed.hil import rig as rigfile
from photonic_testbed.hil.bus.client import ServiceClient
from photonic_testbed.hil.bus.mirror import StateSubscriber
from photonic_testbed.hil.devices.service import TELEMETRY_SHARE, DeviceService, ServiceSpec
from photonic_testbed.hil.rig import rig_spec
from tests.bus_doubles import GatedPowerMeter, TimedPowerMeter
from tests.test_bus import Supervised

WAIT_S = 10.0          # a bound for what should come at once (it says what it waited for)
PINGS = 200
PING_P99_S = 0.020     # issue 30: ping p99 within 20 ms, over 200 pings, to every service
SNAPSHOT_S = 0.5       # the GUI's deadline for a snapshot


@contextlib.contextmanager
def serving(driver: object, **spec: object) -> Iterator[tuple[DeviceService, str, str]]:
    """A power meter service around `driver`, served on a thread; yields (service, request
    endpoint, publish endpoint)."""
    service = DeviceService(ServiceSpec("meter", "power_meter", "memory", **spec),
                            driver=driver)
    request, publish = service.bind()
    stop = threading.Event()
    thread = threading.Thread(target=service.serve, args=(stop,), daemon=True)
    thread.start()
    try:
        yield service, request, publish
    finally:
        stop.set()
        thread.join(WAIT_S)
        service.close()


def _started(meter: GatedPowerMeter, what: str) -> list[int]:
    try:
        return meter.started.get(timeout=WAIT_S)
    except Exception:
        raise AssertionError(f"no read began within {WAIT_S} s ({what})") from None


def test_ping_describe_and_snapshot_are_answered_while_the_meter_reads():
    """A telemetry read held by the test (a meter averaging for as long as you like): the
    service answers its own operations meanwhile. Before, the loop called the driver itself
    and answered nothing until the read ended."""
    meter = GatedPowerMeter(ports=4)
    with serving(meter, telemetry_hz=50.0, health=3600.0) as (_, request, _), \
            ServiceClient(request, timeout=WAIT_S) as c:
        _started(meter, "the first telemetry pass")
        assert c.call("ping")["device"] == "meter"
        assert c.call("describe")["device"] == {"kind": "power_meter", "ports": 4}
        assert c.call("snapshot")["device"] == "meter"
        assert meter.started.empty()             # the read still holds the device
        meter.release(100)                       # (the rest of the test's reads)


def test_a_request_goes_between_the_ports_of_a_telemetry_pass():
    """A `read_power` that comes while a pass reads port 1 is the device's next read, before
    port 2 of the pass; the pass then goes on and its values are published whole."""
    meter = GatedPowerMeter(ports=4)
    seen: list[dict] = []
    with serving(meter, telemetry_hz=50.0, health=3600.0) as (service, request, publish), \
            ServiceClient(request, timeout=WAIT_S) as c, \
            StateSubscriber({"meter": (request, publish)},
                            on_telemetry=lambda d, m: seen.append(m)) as sub:
        assert _started(meter, "the first telemetry pass") == [1]
        answer: list = []
        asking = threading.Thread(target=lambda: answer.append(c.call("read_power",
                                                                      channels=[3])))
        asking.start()
        deadline = time.monotonic() + WAIT_S
        while not service.server.answering:      # the request is in the device's queue
            assert time.monotonic() < deadline, f"read_power not taken in within {WAIT_S} s"
            time.sleep(0.005)
        meter.release()                          # port 1 of the pass ends
        assert _started(meter, "the request's read") == [3]
        meter.release()
        asking.join(WAIT_S)
        assert answer == [{"power": {3: 0.003}}]
        for port in (2, 3, 4):
            assert _started(meter, f"port {port} of the pass") == [port]
            meter.release()
        deadline = time.monotonic() + WAIT_S
        while not seen and time.monotonic() < deadline:
            sub.poll(0.05)
        assert seen, f"no telemetry published within {WAIT_S} s"
        assert seen[0]["values"] == {"power": {"1": 0.001, "2": 0.002, "3": 0.003,
                                               "4": 0.004}}
        meter.release(100)


def test_telemetry_passes_are_spaced_by_what_they_cost():
    """A pass of 4 ports at 20 ms each, asked for at 1 kHz: each next pass begins at least as
    long after the last ended as the pass took (TELEMETRY_SHARE of the device's time at most),
    never back to back as before."""
    meter = TimedPowerMeter(ports=4, read_s=0.02)
    with serving(meter, telemetry_hz=1000.0, health=3600.0):
        deadline = time.monotonic() + 2 * WAIT_S
        while sum(1 for *_, ports in meter.reads if 4 in ports) < 4:
            assert time.monotonic() < deadline, f"4 passes not read in {2 * WAIT_S} s"
            time.sleep(0.05)
    reads = list(meter.reads)
    # each pass: from the start of its read of port 1 to the end of its read of port 4
    starts = [start for start, _, ports in reads if 1 in ports]
    ends = [end for _, end, ports in reads if 4 in ports]
    gap = (1.0 - TELEMETRY_SHARE) / TELEMETRY_SHARE
    for k in range(min(len(starts), len(ends)) - 1):
        took, rested = ends[k] - starts[k], starts[k + 1] - ends[k]
        assert rested >= took * gap, f"pass {k}: took {took:.3f} s, rested {rested:.3f} s"


@pytest.fixture(scope="module")
def lumion_served(tmp_path_factory):
    """The emulated lumion rig, each of its devices served in its own process (`ptb serve`);
    yields the rig file's rig."""
    path = tmp_path_factory.mktemp("rig") / "rig.toml"
    with EmulatedRig(rig_spec("lumion"), ideal_chip=True, switching_s=0.0) as emulated:
        rigfile.write(path, rigfile.for_emulator("lumion", emulated.endpoints))
        rig = rigfile.load(path)
        with Supervised(rig.service_specs()):
            yield rig


def test_every_lumion_service_answers_at_once_across_its_meter_passes(lumion_served):
    """200 pings to each service, spread over the meter's telemetry passes (16 ports at
    0.1 s averaging): p99 within 20 ms for each, and a snapshot within the GUI's 500 ms.
    Before, the meter answered behind its pass (ping 1.6 s, snapshot 1.4 s). On a machine busy
    with other work every process waits for the CPU alike: a service is then held to 3 times the
    others' (what the machine gives them all), which a meter answering behind its 1.6 s passes
    is still far above."""
    rig = lumion_served
    names = sorted(rig.devices)
    assert "powermeter" in names, names
    clients = {n: ServiceClient(rig.devices[n].request, timeout=WAIT_S) for n in names}
    passes: list[dict] = []
    meter = rig.devices["powermeter"]
    sub = StateSubscriber({"powermeter": (meter.request, meter.publish)},
                          on_telemetry=lambda d, m: passes.append(m))
    took: dict[str, list[float]] = {n: [] for n in names}
    snapshots: dict[str, list[float]] = {n: [] for n in names}
    try:
        for c in clients.values():
            c.call("ping")                       # connected, and the service up
        deadline = time.monotonic() + 30 * WAIT_S
        rounds = 0
        while min(len(t) for t in took.values()) < PINGS or len(passes) < 2:
            assert time.monotonic() < deadline, (
                f"{PINGS} pings to each service across 2 meter passes not done in "
                f"{30 * WAIT_S} s ({len(passes)} passes seen)")
            for n, c in clients.items():
                t0 = time.perf_counter()
                c.call("ping")
                took[n].append(time.perf_counter() - t0)
            if rounds % 25 == 0:
                for n, c in clients.items():
                    t0 = time.perf_counter()
                    assert c.call("snapshot")["device"] == n
                    snapshots[n].append(time.perf_counter() - t0)
            rounds += 1
            sub.poll(0)
            time.sleep(0.005)
    finally:
        sub.close()
        for c in clients.values():
            c.close()
    assert all(len(m["values"]["power"]) == 16 for m in passes)
    p99 = {n: sorted(t)[int(0.99 * len(t)) - 1] for n, t in took.items()}
    worst_snapshot = {n: max(t) for n, t in snapshots.items()}
    for n in names:
        others = sorted(v for k, v in p99.items() if k != n)
        bound = max(PING_P99_S, 3 * others[len(others) // 2])
        assert p99[n] <= bound, f"{n}: ping p99 {p99[n] * 1e3:.1f} ms, others {p99}"
        others = sorted(v for k, v in worst_snapshot.items() if k != n)
        bound = max(SNAPSHOT_S, 3 * others[len(others) // 2])
        assert worst_snapshot[n] <= bound, f"{n}: snapshot {worst_snapshot[n]:.3f} s"
