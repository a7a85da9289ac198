"""How a bridge reaches one instrument: through the rig's bus, or through its driver directly.

Either way it speaks the device services' operations (`hil.bus.schema.OPERATIONS`: `read_power`,
`set_heaters`, `set_laser`, `apply_circuits`, ...) with their checked arguments and their
answers, so a bridge works the same on a bench without the bus as on a rig:

- `BusAccess`: requests to the device's service (`ServiceClient`, at most once, CURVE keys from
  the rig). On a rig with an agent (one that lists GPUs) the devices the agent drives (heaters,
  lasers, the GPUs' switches: `Rig.agent_changes`) take changes from it alone, so a change goes to
  the agent as an operator's manual change (`manual_heaters`, `manual_laser`,
  `manual_circuits`), which the agent journals and makes itself; reads still go to the device.
- `DriverAccess`: the same operations run on a driver this process opened (`hil.devices.kinds`,
  the code the device service runs), one at a time.

Every failure is a `BridgeError` naming the device, the operation and why (the service's
refusal, the driver's error, no answer in time); nothing is retried behind the caller's back but
what the bus client itself resends under the same request id.
"""
from __future__ import annotations

import threading
import time
from collections.abc import Mapping
from typing import Any

from photonic_testbed.hil.bus import schema
from photonic_testbed.hil.bus.client import NotLeader, ServiceClient, ServiceUnavailable
from photonic_testbed.hil.devices.kinds import KINDS, DeviceKind, open_driver
from photonic_testbed.hil.rig import Rig, RigFileError

TIMEOUT_S = 5.0          # one request's deadline (a meter read takes its averaging time)
BRIDGED_KINDS = ("heater_dac", "chip", "power_meter", "laser", "switch")


class BridgeError(RuntimeError):
    """A device could not be read or changed: which, what was asked, and why."""


class Access:
    """One device's operations, one at a time (its subclasses say through what)."""

    def __init__(self, name: str, kind: str):
        self.name, self.kind = name, kind
        self._lock = threading.Lock()
        self._described: dict | None = None
        self.calls = 0                  # operations run (the bench counts them)

    def read(self, op: str, *, within_s: float | None = None, **args: Any) -> Any:
        """A read-only operation's answer (`within_s`: its deadline, if not the access's)."""
        return self._run(op, args, False, within_s)

    def change(self, op: str, **args: Any) -> Any:
        """A changing operation's answer."""
        return self._run(op, args, True, None)

    def describe(self) -> dict:
        """What the device is (its service's description: ports, channels, full scale), asked
        once."""
        if self._described is None:
            with self._lock:
                self._described = self._guarded("describe", lambda: self._describe())
        return dict(self._described)

    def _run(self, op: str, args: dict, change: bool, within_s: float | None) -> Any:
        declared = schema.OPERATIONS.get(op)
        if declared is None or declared.read_only == change:
            raise BridgeError(f"{self.name}: {op!r} is not a {'changing' if change else 'read'}"
                              " operation of the bus")
        with self._lock:
            self.calls += 1
            return self._guarded(op, lambda: self._call(op, args, change, within_s))

    def _guarded(self, op: str, fn) -> Any:
        try:
            return fn()
        except BridgeError:
            raise
        except Exception as e:     # the bus's, the schema's, a driver's own (DACError, SCPI)
            said = str(e)
            raise BridgeError(f"{self.name}: {said if said.startswith(op) else f'{op}: {said}'}"
                              ) from e

    def _call(self, op: str, args: dict, change: bool, within_s: float | None) -> Any:
        raise NotImplementedError

    def _describe(self) -> dict:
        raise NotImplementedError

    def close(self) -> None:
        """Release the connection (or the driver), once the operation under way is done."""
        with self._lock:
            self._close()

    def _close(self) -> None:
        raise NotImplementedError


class BusAccess(Access):
    """A device served on the bus; `agent`: the agent's replicas' request endpoints, in the
    order to try them, on a rig with an agent (its changes go there)."""

    def __init__(self, name: str, kind: str, endpoint: str, *, keys=None,
                 agent: list[str] | None = None, timeout: float = TIMEOUT_S):
        super().__init__(name, kind)
        self.client = ServiceClient(endpoint, timeout=timeout, keys=keys)
        self._agents = [ServiceClient(ep, timeout=timeout, keys=keys) for ep in agent or ()]
        self._leading = 0

    def _describe(self) -> dict:
        return dict(self.client.call("describe").get("device", {}))

    def _call(self, op: str, args: dict, change: bool, within_s: float | None) -> Any:
        if not change or not self._agents:
            return self.client.call(op, timeout=within_s, **args)
        return self._by_agent(*self._manual(op, args))

    def _manual(self, op: str, args: dict) -> tuple[str, dict]:
        """A change of this device as the operator's manual change the agent makes."""
        if op == "set_heaters":
            return "manual_heaters", {"device": self.name, **args}
        if op == "set_laser":
            return "manual_laser", {"device": self.name, **args}
        if op == "apply_circuits":
            now = schema.circuits_from_wire(self.client.call("read_circuits")["circuits"])
            want = schema.circuits_from_wire(args["circuits"])
            return "manual_circuits", {
                "switch": self.name,
                "connect": [[a, b] for a, b in sorted(want.items()) if now.get(a) != b],
                "disconnect": sorted(a for a in now if a not in want)}
        raise BridgeError(f"{self.name}: {op} is not a change an operator makes through the "
                          "agent on this rig (it has GPUs: the agent alone changes devices)")

    def _by_agent(self, op: str, args: dict) -> Any:
        """`op` to the agent replica that leads: a standby's refusal, or no answer, sends it to
        the next, each replica asked once."""
        last: Exception | None = None
        for k in range(len(self._agents)):
            i = (self._leading + k) % len(self._agents)
            try:
                got = self._agents[i].call(op, **args)
            except (NotLeader, ServiceUnavailable) as e:
                last = e
                continue
            self._leading = i
            return got
        raise BridgeError(f"{self.name}: no agent replica took {op} ({last})")

    def _close(self) -> None:
        for c in (self.client, *self._agents):
            c.close()


class DriverAccess(Access):
    """A device whose driver this process opened: the device service's operations run here."""

    def __init__(self, name: str, kind: DeviceKind, driver: Any):
        super().__init__(name, kind.name)
        self._kind, self.driver = kind, driver

    def _describe(self) -> dict:
        return dict(self._kind.describe(self.driver, self._kind.facts(self.driver)))

    def _call(self, op: str, args: dict, change: bool, within_s: float | None) -> Any:
        fn = self._kind.ops.get(op)
        if fn is None:
            raise BridgeError(f"{self.name} (a {self.kind}) has no operation {op!r}; it has "
                              f"{', '.join(sorted(self._kind.ops))}")
        result, _ = fn(self.driver, schema.check_args(schema.OPERATIONS[op], args))
        return schema.read_result(op, result)      # as the bus client reads an answer

    def _close(self) -> None:
        close = getattr(self.driver, "close", None)
        if callable(close):
            close()


def open_rig(rig: Rig, names: list[str] | None = None, *, direct: bool = False,
             timeout: float = TIMEOUT_S) -> dict[str, Access]:
    """The rig's devices that a bridge can offer (`names`, or all of kinds it knows), through
    the bus, or with `direct` through drivers opened here (a bench without the bus: nothing
    else may have them open)."""
    wanted = list(rig.devices) if names is None else list(names)
    unknown = [n for n in wanted if n not in rig.devices]
    if unknown:
        raise RigFileError(f"no device named {', '.join(unknown)} in the rig; it has: "
                           f"{', '.join(rig.devices)}")
    if names is not None:
        odd = [n for n in wanted if rig.devices[n].kind not in BRIDGED_KINDS]
        if odd:
            raise RigFileError(f"{', '.join(odd)}: no bridge for the kind "
                               f"{rig.devices[odd[0]].kind!r}")
    wanted = [n for n in wanted if rig.devices[n].kind in BRIDGED_KINDS]
    out: dict[str, Access] = {}
    try:
        if direct:
            for spec in rig.service_specs(wanted):
                kind = KINDS[spec.kind]
                out[spec.name] = DriverAccess(spec.name, kind, open_driver(
                    kind, spec.driver, spec.address, spec.options))
        else:
            keys = rig.client_keys()
            agent = [ep for ep, _ in rig.agent_replicas().values()] if rig.gpus else []
            for n in wanted:
                d = rig.devices[n]
                out[n] = BusAccess(n, d.kind, d.request, keys=keys, timeout=timeout,
                                   agent=agent if rig.agent_changes(n) else None)
    except BaseException:
        for a in out.values():
            a.close()
        raise
    return out


def wait_until_up(devices: Mapping[str, Access], within_s: float,
                  stop: threading.Event | None = None) -> bool:
    """Each device described (its service answers) within `within_s`, else BridgeError naming
    the first that did not answer; False when `stop` was set meanwhile."""
    deadline = time.monotonic() + within_s
    stop = stop or threading.Event()
    for a in devices.values():
        while not stop.is_set():
            try:
                a.describe()
                break
            except BridgeError:
                if time.monotonic() >= deadline:
                    raise
                stop.wait(0.2)
    return not stop.is_set()
