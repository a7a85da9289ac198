"""The rig's instruments as LECO actors (pyleco), for PyMoDAQ dashboards and any LECO client
(docs/leco.md). `ptb leco --rig FILE` runs them.

Each device is an actor named after it (`powermeter`, `laser`, ...; `NAMESPACE.powermeter` seen
from another node) that signs in to a LECO coordinator and answers the LECO actor's calls:
`get_parameters`, `set_parameters` and `call_action`, with parameters and actions named as in
the project's drivers:

    heater DAC, chip   parameters channels, vfull (read-only), voltages (V, settable)
                       actions voltage(ch), set_voltage(ch, volts), set_voltages(values)
    power meter        parameters ports (read-only), power_mw, power_dbm (every port, one new
                       measurement each; read-only)
                       actions read_power(ports=None) -> {port: mW}, read(port) -> [mW, dBm]
    laser              parameters output (on/off), power_mw, power_dbm, wavelength_nm
                       actions on(), off(), set_power_dbm(dbm)
    switch (OCS)       parameters ports (read-only), circuits ({input: output}), port_map
                       (output per input, 0 = none), both settable
                       actions connect(input, output), disconnect(input), apply(circuits)

A name an actor does not offer, a value out of its limits (`hil.bridges.devices`), or the
device's refusal answers the caller with an error saying which; the actor keeps serving.
"""
from __future__ import annotations

import logging
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

try:
    import zmq
    from pyleco.actors.actor import Actor
    from pyleco.coordinators.coordinator import Coordinator
    from pyleco.utils.communicator import Communicator
    from pyleco.utils.coordinator_utils import ZmqMultiSocket
except ImportError as e:             # an optional extra
    raise ImportError(f"the LECO bridge needs pyleco ({e.name} is not installed): "
                      "pip install 'photonic-testbed[leco]'") from None

from photonic_testbed.drivers.power_meter import dbm_to_mw, mw_to_dbm
from photonic_testbed.hil.bridges import devices as bridged
from photonic_testbed.hil.bridges.access import Access

log = logging.getLogger(__name__)

COORDINATOR_PORT = 12300            # LECO's default
SIGN_IN_S = 5.0                     # how long the coordinator may take to answer a sign-in


class LecoHeaters(bridged.Heaters):
    PARAMETERS = {"channels": False, "vfull": False, "voltages": True}   # name: settable
    ACTIONS = ("voltage", "voltages", "set_voltage", "set_voltages")

    def get_voltages(self) -> list[float]:
        return self.voltages()

    def set_voltages_param(self, value: Sequence[float]) -> None:
        if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
            raise ValueError(f"{self.name}: voltages is a list of volts from channel 0, "
                             f"not {value!r}")
        self.set_voltages(list(value))


class LecoMeter(bridged.Meter):
    PARAMETERS = {"ports": False, "power_mw": False, "power_dbm": False}
    ACTIONS = ("read_power", "read")

    def get_power_mw(self) -> list[float]:
        got = self.read_power()
        return [got[p] for p in range(1, self.ports + 1)]

    def get_power_dbm(self) -> list[float]:
        return [mw_to_dbm(mw) for mw in self.get_power_mw()]


class LecoLaser(bridged.Laser):
    PARAMETERS = {"output": True, "power_mw": True, "power_dbm": True, "wavelength_nm": True}
    ACTIONS = ("on", "off", "set_power_dbm", "set_power_mw", "set_wavelength_nm")

    def get_output(self) -> bool:
        return self.state()["on"]

    def set_output(self, on: bool) -> None:
        self.set(on=on)

    def on(self) -> None:
        self.set(on=True)

    def off(self) -> None:
        self.set(on=False)

    def get_power_mw(self) -> float:
        return self.state()["power_mw"]

    def set_power_mw(self, mw: float) -> None:
        self.set(power_mw=mw)

    def get_power_dbm(self) -> float:
        return mw_to_dbm(self.get_power_mw())

    def set_power_dbm(self, dbm: float) -> None:
        self.set(power_mw=dbm_to_mw(bridged.Quantity("power_dbm", "dBm").check(dbm, self.name)))

    def get_wavelength_nm(self) -> float:
        return self.state()["wavelength_nm"]

    def set_wavelength_nm(self, nm: float) -> None:
        self.set(wavelength_nm=nm)


class LecoSwitch(bridged.Switch):
    PARAMETERS = {"ports": False, "circuits": True, "port_map": True}
    ACTIONS = ("connect", "disconnect", "apply")

    def get_circuits(self) -> dict[str, int]:
        return {str(a): b for a, b in sorted(self.circuits().items())}

    def set_circuits(self, value: Mapping[str, int]) -> None:
        if not isinstance(value, Mapping):
            raise ValueError(f"{self.name}: circuits are {{input: output}}, not {value!r}")
        self.apply({_port(a): _port(b) for a, b in value.items()})

    def get_port_map(self) -> list[int]:
        return self.port_map()

    def set_port_map(self, value: Sequence[int]) -> None:
        self.apply_port_map([_port(b, zero=True) for b in value])

    def connect(self, ingress: int, egress: int) -> dict:
        now = self.circuits()
        now[_port(ingress)] = _port(egress)
        return self.apply(now)

    def disconnect(self, ingress: int) -> dict:
        now = self.circuits()
        if now.pop(_port(ingress), None) is None:
            raise ValueError(f"{self.name}: input {ingress} has no circuit")
        return self.apply(now)


def _port(value: Any, zero: bool = False) -> int:
    """A port number as JSON carries it (an integer, or a dict key's digits)."""
    if isinstance(value, str) and value.isdigit():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < (0 if zero else 1):
        raise ValueError(f"a port is a whole number from {0 if zero else 1}, not {value!r}")
    return value


LECO_FAMILIES: dict[str, type[bridged.Instrument]] = {
    "heater_dac": LecoHeaters, "chip": LecoHeaters, "power_meter": LecoMeter,
    "laser": LecoLaser, "switch": LecoSwitch}


class DeviceActor(Actor):
    """A LECO actor serving one instrument: only the parameters and actions it declares."""

    def __init__(self, name: str, device: Any, **kwargs: Any):
        super().__init__(name, device_class=type(device), **kwargs)
        self.device = device

    def _parameter(self, key: Any, setting: bool) -> str:
        declared = self.device.PARAMETERS
        if not isinstance(key, str) or key not in declared:
            raise ValueError(f"{self.name} has no parameter {key!r}; it has "
                             f"{', '.join(declared)}")
        if setting and not declared[key]:
            raise ValueError(f"{self.name}: {key} is read-only")
        return key

    def _value(self, key: str) -> Any:
        getter = getattr(self.device, f"get_{key}", None)
        return getter() if callable(getter) else getattr(self.device, key)

    def get_parameters(self, parameters: list[str] | tuple[str, ...]) -> dict[str, Any]:
        if isinstance(parameters, str) or not isinstance(parameters, (list, tuple)):
            raise ValueError(f"{self.name}: parameters are a list of names, not {parameters!r}")
        return {k: self._value(self._parameter(k, False)) for k in parameters}

    def set_parameters(self, parameters: dict[str, Any]) -> None:
        if not isinstance(parameters, dict):
            raise ValueError(f"{self.name}: parameters to set are {{name: value}}, "
                             f"not {parameters!r}")
        for k, v in parameters.items():
            self._parameter(k, True)
            setter = getattr(self.device, f"set_{k}_param", None) or \
                getattr(self.device, f"set_{k}")
            setter(v)

    def call_action(self, action: str, args: Sequence | None = None,
                    kwargs: dict[str, Any] | None = None) -> Any:
        if not isinstance(action, str) or action not in self.device.ACTIONS:
            raise ValueError(f"{self.name} has no action {action!r}; it has "
                             f"{', '.join(self.device.ACTIONS)}")
        if args is not None and not isinstance(args, (list, tuple)):
            raise ValueError(f"{self.name}.{action}: args are a list, not {args!r}")
        if kwargs is not None and not isinstance(kwargs, dict):
            raise ValueError(f"{self.name}.{action}: kwargs are an object, not {kwargs!r}")
        try:
            return getattr(self.device, action)(*(args or ()), **(kwargs or {}))
        except TypeError as e:             # wrong number or names of arguments
            raise ValueError(f"{self.name}.{action}: {e}") from None

    def connect(self, *args: Any, **kwargs: Any) -> None:
        """LECO's `connect` opens nothing here: the device is the bridge's, opened already."""
        raise ValueError(f"{self.name} is connected to its device by `ptb leco`")

    def disconnect(self) -> None:
        """LECO's `disconnect` stops nothing here: the device is the bridge's to release."""


class LoopbackSocket(ZmqMultiSocket):
    """A coordinator's socket bound to one address (pyleco binds every interface)."""

    def __init__(self, host: str, context: zmq.Context):
        super().__init__(context=context)
        self._host = host

    def bind(self, host: str = "", port: int | str = COORDINATOR_PORT) -> None:
        super().bind(host=self._host, port=port)


def start_coordinator(host: str, port: int, namespace: str, stop: threading.Event
                      ) -> threading.Thread:
    """A LECO coordinator on `host:port` (that address only), routing on a thread until
    `stop` is set."""
    context: zmq.Context = zmq.Context.instance()
    coordinator = Coordinator(namespace=namespace, host=host, port=port,
                              multi_socket=LoopbackSocket(host, context), context=context)

    def route() -> None:
        try:
            coordinator.routing(stop_event=stop)
        finally:
            coordinator.close()
    thread = threading.Thread(target=route, name="leco-coordinator", daemon=True)
    thread.start()
    return thread


def coordinator_answers(host: str, port: int, within_s: float = SIGN_IN_S) -> bool:
    """Whether a LECO coordinator at host:port answers a sign-in within `within_s`."""
    probe = Communicator(name="ptb-leco-probe", host=host, port=port, timeout=within_s)
    try:
        probe.sign_in()
    except ConnectionRefusedError:      # no answer (pyleco logs the sign-in's time-out)
        probe.socket.close(linger=0)    # nobody to sign out from
        return False
    probe.close()
    return True


class Actors:
    """Every device's actor, each listening on a thread of its own until `close`."""

    def __init__(self, devices: Mapping[str, Access], host: str, port: int):
        self.stop = threading.Event()
        self.actors: dict[str, DeviceActor] = {}
        self.threads: list[threading.Thread] = []
        for name, access in devices.items():
            family = LECO_FAMILIES.get(access.kind)
            if family is None:
                continue
            actor = DeviceActor(name, family(access), host=host, port=port)
            self.actors[name] = actor
            t = threading.Thread(target=self._listen, args=(actor,), name=f"leco-{name}",
                                 daemon=True)
            self.threads.append(t)
            t.start()

    def not_signed_in(self, within_s: float = SIGN_IN_S) -> list[str]:
        """The actors the coordinator has not taken within `within_s` (another component
        signed in under the same name, or no coordinator answers)."""
        deadline = time.monotonic() + within_s
        while time.monotonic() < deadline and any(
                a.namespace is None for a in self.actors.values()):
            self.stop.wait(0.05)
        return [n for n, a in self.actors.items() if a.namespace is None]

    def _listen(self, actor: DeviceActor) -> None:
        try:
            actor.listen(stop_event=self.stop)
        except Exception:
            log.exception("LECO actor %s stopped", actor.name)

    def close(self) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(5)
        for actor in self.actors.values():
            actor.device.close()
