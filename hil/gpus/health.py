"""GPU health from NVML: Xid events, ECC, temperature, PCIe replays and NVLink errors.

`NvmlHealth` reads the GPUs of this host through `nvidia-ml-py` (module `pynvml`) and turns
what it sees into `GpuHealth` values, the same values the emulated rack reports, so the agent
cannot tell one from the other. On a machine without a GPU or driver, opening it raises
`GpuHealthUnavailable` with the reason; nothing else in the stack needs NVML.
"""
from __future__ import annotations

import logging
import time
from dataclasses import asdict, dataclass, field
from typing import Any

log = logging.getLogger(__name__)

# Xid codes after which a GPU is not to be trusted with the job (NVIDIA's Xid catalogue):
# 13/31/43 are usually application faults and are reported, not fatal.
FATAL_XIDS = frozenset({48, 61, 62, 63, 64, 74, 79, 92, 94, 95, 119, 120, 140})
TEMPERATURE_DEGRADED_C = 87
LOST_REASON = "GPU is lost (fallen off the bus)"


class GpuHealthUnavailable(Exception):
    """NVML cannot be used here (no library, no driver, no GPU)."""


@dataclass(frozen=True)
class GpuHealth:
    """One GPU's health as the agent consumes it (from NVML or the emulated rack)."""
    gpu: str                      # stable id: NVML UUID, or the rig's GPU name
    state: str                    # "ok" | "degraded" | "failed"
    reasons: tuple[str, ...] = ()
    temperature_c: float | None = None
    ecc_uncorrected: int = 0
    pcie_replays: int = 0
    nvlink_errors: int = 0
    xids: tuple[int, ...] = ()
    ts: float = field(default_factory=time.time)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["reasons"], d["xids"] = list(self.reasons), list(self.xids)
        return d


def classify(gpu: str, *, temperature_c: float | None, ecc_uncorrected: int, pcie_replays: int,
             nvlink_errors: int, xids: tuple[int, ...], lost: bool = False) -> GpuHealth:
    """The health verdict from raw counters: failed beats degraded beats ok."""
    failed, degraded = [], []
    if lost:
        failed.append(LOST_REASON)
    fatal = [x for x in xids if x in FATAL_XIDS]
    if fatal:
        failed.append("fatal Xid " + ",".join(map(str, fatal)))
    if ecc_uncorrected:
        failed.append(f"{ecc_uncorrected} uncorrected ECC errors")
    other = [x for x in xids if x not in FATAL_XIDS]
    if other:
        degraded.append("Xid " + ",".join(map(str, other)))
    if nvlink_errors:
        degraded.append(f"{nvlink_errors} NVLink errors")
    if pcie_replays:
        degraded.append(f"{pcie_replays} PCIe replays")
    if temperature_c is not None and temperature_c >= TEMPERATURE_DEGRADED_C:
        degraded.append(f"temperature {temperature_c:.0f} C")
    state = "failed" if failed else "degraded" if degraded else "ok"
    return GpuHealth(gpu, state, tuple(failed + degraded), temperature_c, ecc_uncorrected,
                     pcie_replays, nvlink_errors, tuple(xids))


class NvmlHealth:
    """Poll the host's GPUs through NVML. `nvml` may be injected (tests pass a double)."""

    def __init__(self, nvml: Any = None):
        if nvml is None:
            try:
                import pynvml
            except ImportError as e:
                raise GpuHealthUnavailable("nvidia-ml-py is not installed") from e
            nvml = pynvml
        self.nvml = nvml
        try:
            nvml.nvmlInit()
        except nvml.NVMLError as e:
            raise GpuHealthUnavailable(f"NVML cannot start: {e}") from e
        self._handles = [nvml.nvmlDeviceGetHandleByIndex(i)
                         for i in range(nvml.nvmlDeviceGetCount())]
        if not self._handles:
            nvml.nvmlShutdown()
            raise GpuHealthUnavailable("NVML sees no GPU")
        self.uuids = [self._text(nvml.nvmlDeviceGetUUID(h)) for h in self._handles]
        self._events = nvml.nvmlEventSetCreate()
        for h in self._handles:
            try:
                nvml.nvmlDeviceRegisterEvents(h, nvml.nvmlEventTypeXidCriticalError, self._events)
            except nvml.NVMLError as e:   # e.g. not supported on this board or in a VM
                log.warning("NVML: no Xid events for a GPU: %s", e)
        self._pending_xids: dict[str, list[int]] = {u: [] for u in self.uuids}

    @staticmethod
    def _text(value: Any) -> str:
        return value.decode() if isinstance(value, bytes) else str(value)

    def close(self) -> None:
        try:
            self.nvml.nvmlEventSetFree(self._events)
        finally:
            self.nvml.nvmlShutdown()

    def __enter__(self) -> NvmlHealth:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def wait_xid(self, timeout_s: float) -> tuple[str, int] | None:
        """Block up to timeout_s for the next critical Xid; returns (uuid, xid) or None."""
        nvml = self.nvml
        try:
            data = nvml.nvmlEventSetWait_v2(self._events, int(timeout_s * 1000))
        except nvml.NVMLError_Timeout:
            return None
        uuid = self._text(nvml.nvmlDeviceGetUUID(data.device))
        xid = int(data.eventData)
        self._pending_xids.setdefault(uuid, []).append(xid)
        return uuid, xid

    def _counter(self, fn, *args) -> int | None:
        try:
            return int(fn(*args))
        except self.nvml.NVMLError_NotSupported:
            return None

    def poll(self) -> list[GpuHealth]:
        """Read every GPU's counters now (and any Xids seen since the last poll)."""
        nvml = self.nvml
        out = []
        for uuid, h in zip(self.uuids, self._handles, strict=True):
            xids = tuple(self._pending_xids.get(uuid, ()))
            self._pending_xids[uuid] = []
            try:
                temp = self._counter(nvml.nvmlDeviceGetTemperature, h, nvml.NVML_TEMPERATURE_GPU)
                ecc = self._counter(nvml.nvmlDeviceGetTotalEccErrors, h,
                                    nvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED,
                                    nvml.NVML_VOLATILE_ECC) or 0
                replays = self._counter(nvml.nvmlDeviceGetPcieReplayCounter, h) or 0
                nvlink = 0
                for link in range(nvml.NVML_NVLINK_MAX_LINKS):
                    for kind in (nvml.NVML_NVLINK_ERROR_DL_REPLAY,
                                 nvml.NVML_NVLINK_ERROR_DL_RECOVERY,
                                 nvml.NVML_NVLINK_ERROR_DL_CRC_FLIT):
                        try:
                            nvlink += int(nvml.nvmlDeviceGetNvLinkErrorCounter(h, link, kind))
                        except nvml.NVMLError:  # link absent, or counter not supported
                            break
                out.append(classify(uuid, temperature_c=temp, ecc_uncorrected=ecc,
                                    pcie_replays=replays, nvlink_errors=nvlink, xids=xids))
            except nvml.NVMLError_GpuIsLost:
                out.append(classify(uuid, temperature_c=None, ecc_uncorrected=0, pcie_replays=0,
                                    nvlink_errors=0, xids=xids, lost=True))
        return out
