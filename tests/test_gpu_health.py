"""GPU health: the verdicts, the NVML adapter against an NVML double, and real NVML if present."""
from __future__ import annotations

import types

import pytest

from photonic_testbed.hil.gpus.health import GpuHealthUnavailable, NvmlHealth, classify


def test_verdicts():
    ok = classify("g0", temperature_c=60, ecc_uncorrected=0, pcie_replays=0, nvlink_errors=0,
                  xids=())
    assert ok.state == "ok" and ok.reasons == ()
    hot = classify("g0", temperature_c=90, ecc_uncorrected=0, pcie_replays=3, nvlink_errors=0,
                   xids=(13,))
    assert hot.state == "degraded"
    assert hot.reasons == ("Xid 13", "3 PCIe replays", "temperature 90 C")
    dead = classify("g0", temperature_c=60, ecc_uncorrected=2, pcie_replays=0, nvlink_errors=0,
                    xids=(79, 13))
    assert dead.state == "failed"
    assert dead.reasons[:2] == ("fatal Xid 79", "2 uncorrected ECC errors")
    assert dead.to_dict()["xids"] == [79, 13]


def fake_nvml(temps, ecc, lost=()):
    """An NVML double with the calls NvmlHealth makes; GPU i has uuid GPU-i."""
    class NVMLError(Exception):
        pass

    class NotSupported(NVMLError):
        pass

    class Timeout(NVMLError):
        pass

    class GpuIsLost(NVMLError):
        pass

    xid_queue = []

    def check(h):
        if h in lost:
            raise GpuIsLost()
        return h

    def event_wait(events, timeout_ms):
        if not xid_queue:
            raise Timeout()
        h, xid = xid_queue.pop(0)
        return types.SimpleNamespace(device=h, eventData=xid)

    def nvlink_counter(h, link, kind):
        if link >= 2:
            raise NotSupported()
        return 1 if h == 1 else 0

    nvml = types.SimpleNamespace(
        NVMLError=NVMLError, NVMLError_NotSupported=NotSupported, NVMLError_Timeout=Timeout,
        NVMLError_GpuIsLost=GpuIsLost, NVML_TEMPERATURE_GPU=0,
        NVML_MEMORY_ERROR_TYPE_UNCORRECTED=1, NVML_VOLATILE_ECC=0, NVML_NVLINK_MAX_LINKS=18,
        NVML_NVLINK_ERROR_DL_REPLAY=0, NVML_NVLINK_ERROR_DL_RECOVERY=1,
        NVML_NVLINK_ERROR_DL_CRC_FLIT=2, nvmlEventTypeXidCriticalError=8,
        nvmlInit=lambda: None, nvmlShutdown=lambda: None,
        nvmlDeviceGetCount=lambda: len(temps), nvmlDeviceGetHandleByIndex=lambda i: i,
        nvmlDeviceGetUUID=lambda h: f"GPU-{h}".encode(),
        nvmlEventSetCreate=lambda: "events", nvmlEventSetFree=lambda e: None,
        nvmlDeviceRegisterEvents=lambda h, kind, events: None,
        nvmlEventSetWait_v2=event_wait,
        nvmlDeviceGetTemperature=lambda h, sensor: temps[check(h)],
        nvmlDeviceGetTotalEccErrors=lambda h, kind, counter: ecc[check(h)],
        nvmlDeviceGetPcieReplayCounter=lambda h: 0,
        nvmlDeviceGetNvLinkErrorCounter=nvlink_counter,
    )
    return nvml, xid_queue


def test_nvml_adapter_reads_counters_and_xid_events():
    nvml, xids = fake_nvml(temps=[50, 55, 60], ecc=[0, 0, 0], lost=(2,))
    with NvmlHealth(nvml) as health:
        assert health.uuids == ["GPU-0", "GPU-1", "GPU-2"]
        assert health.wait_xid(0.01) is None
        xids.append((0, 79))
        assert health.wait_xid(0.01) == ("GPU-0", 79)
        report = {h.gpu: h for h in health.poll()}
        assert report["GPU-0"].state == "failed" and report["GPU-0"].xids == (79,)
        assert report["GPU-1"].state == "degraded" and report["GPU-1"].nvlink_errors == 6
        assert report["GPU-2"].state == "failed" and "lost" in report["GPU-2"].reasons[0]
        # Xids are reported once
        assert {h.gpu: h.xids for h in health.poll()}["GPU-0"] == ()


def test_real_nvml_or_a_clean_skip():
    try:
        health = NvmlHealth()
    except GpuHealthUnavailable as e:
        pytest.skip(f"no NVML here: {e}")
    with health:
        report = health.poll()
    assert report and all(h.state in ("ok", "degraded", "failed") for h in report)
    assert all(h.temperature_c is None or 0 < h.temperature_c < 130 for h in report)
