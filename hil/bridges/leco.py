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

import functools
import inspect
import logging
import os
import secrets
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

try:
    import zmq
    from pyleco.actors.actor import Actor
    from pyleco.coordinators.coordinator import Coordinator
    from pyleco.core.serialization import JsonContentTypes, get_json_content_type
    from pyleco.json_utils.errors import INVALID_PARAMS, JSONRPCError, JsonRpcError
    from pyleco.utils.communicator import Communicator
    from pyleco.utils.coordinator_utils import ZmqMultiSocket
except ImportError as e:             # an optional extra
    raise ImportError(f"the LECO bridge needs pyleco ({e.name} is not installed): "
                      "pip install 'photonic-testbed[leco]'") from None

from photonic_testbed.drivers.power_meter import dbm_to_mw, mw_to_dbm
from photonic_testbed.hil.bridges import devices as bridged
from photonic_testbed.hil.bridges.access import Access, BridgeError
from photonic_testbed.hil.bus.errors import BadRequest

log = logging.getLogger(__name__)

COORDINATOR_PORT = 12300            # LECO's default
SIGN_IN_S = 5.0                     # how long the coordinator may take to answer a sign-in
# the device refused or failed what was asked (a JSON-RPC server error, -32000..-32099)
DEVICE_ERROR = JsonRpcError(code=-32000, message="Device error")


class LecoHeaters(bridged.Heaters):
    PARAMETERS = {"channels": False, "vfull": False, "voltages": True}   # name: settable
    ACTIONS = ("voltage", "voltages", "set_voltage", "set_voltages")

    def get_voltages(self) -> list[float]:
        return self.voltages()

    def set_many(self, values: Mapping[str, Any]) -> None:
        if "voltages" in values:
            v = values["voltages"]
            if isinstance(v, Mapping):
                raise ValueError(f"{self.name}: voltages is a list of volts from channel 0 "
                                 "(set_voltages takes {channel: volts})")
            self.set_voltages(v)


class LecoMeter(bridged.Meter):
    PARAMETERS = {"ports": False, "power_mw": False, "power_dbm": False}
    ACTIONS = ("read_power", "read")

    def get_power_mw(self) -> list[float]:
        got = self.read_power()
        return [got[p] for p in range(1, self.ports + 1)]

    def get_power_dbm(self) -> list[float]:
        return [mw_to_dbm(mw) for mw in self.get_power_mw()]

    def set_many(self, values: Mapping[str, Any]) -> None:
        """(nothing of a meter is set)"""


class LecoLaser(bridged.Laser):
    PARAMETERS = {"output": True, "power_mw": True, "power_dbm": True, "wavelength_nm": True}
    ACTIONS = ("on", "off", "set_power_dbm", "set_power_mw", "set_wavelength_nm")

    def get_output(self) -> bool:
        return self.state()["on"]

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

    def _dbm_as_mw(self, dbm: Any) -> float:
        value = bridged.Quantity("power_dbm", "dBm").check(dbm, self.name)
        try:
            return dbm_to_mw(value)
        except OverflowError:
            raise ValueError(f"{self.name}: power_dbm {value:g} dBm is beyond any laser's") \
                from None

    def set_power_dbm(self, dbm: float) -> None:
        self.set(power_mw=self._dbm_as_mw(dbm))

    def get_wavelength_nm(self) -> float:
        return self.state()["wavelength_nm"]

    def set_wavelength_nm(self, nm: float) -> None:
        self.set(wavelength_nm=nm)

    def set_many(self, values: Mapping[str, Any]) -> None:
        """The settings in one change of the laser (each checked first: one refused, none
        made)."""
        if "power_mw" in values and "power_dbm" in values:
            raise ValueError(f"{self.name}: power_mw or power_dbm, not both")
        args: dict[str, Any] = {}
        if "output" in values:
            args["on"] = values["output"]
        if "power_mw" in values:
            args["power_mw"] = values["power_mw"]
        if "power_dbm" in values:
            args["power_mw"] = self._dbm_as_mw(values["power_dbm"])
        if "wavelength_nm" in values:
            args["wavelength_nm"] = values["wavelength_nm"]
        if args:
            self.set(**args)


class LecoSwitch(bridged.Switch):
    PARAMETERS = {"ports": False, "circuits": True, "port_map": True}
    ACTIONS = ("connect", "disconnect", "apply")

    def get_circuits(self) -> dict[str, int]:
        return {str(a): b for a, b in sorted(self.circuits().items())}

    def get_port_map(self) -> list[int]:
        return self.port_map()

    def set_many(self, values: Mapping[str, Any]) -> None:
        if "circuits" in values and "port_map" in values:
            raise ValueError(f"{self.name}: circuits or port_map, not both")
        if "circuits" in values:
            self.apply(values["circuits"])
        elif "port_map" in values:
            self.apply_port_map(values["port_map"])

    def connect(self, ingress: int, egress: int) -> dict:
        a = bridged.whole(ingress, f"{self.name}: an input")
        b = bridged.whole(egress, f"{self.name}: an output")
        now = self.circuits()
        now[a] = b
        return self.apply(now)

    def disconnect(self, ingress: int) -> dict:
        a = bridged.whole(ingress, f"{self.name}: an input")
        now = self.circuits()
        if now.pop(a, None) is None:
            raise ValueError(f"{self.name}: input {ingress} has no circuit")
        return self.apply(now)


LECO_FAMILIES: dict[str, type[bridged.Instrument]] = {
    "heater_dac": LecoHeaters, "chip": LecoHeaters, "power_meter": LecoMeter,
    "laser": LecoLaser, "switch": LecoSwitch}


def _answering(method: Callable[..., Any]) -> Callable[..., Any]:
    """An actor's RPC method whose refusals answer as JSON-RPC errors saying why: bad input
    (arguments the method does not take, values out of their limits, what the bus's schema
    refuses) as "Invalid params" (-32602), the device's refusal or failure as -32000; each
    logged in one line. Anything else is a fault of ours: logged with its traceback, answered
    "Internal error". The actor goes on serving either way."""
    signature = inspect.signature(method)

    @functools.wraps(method)
    def answer(self: DeviceActor, *args: Any, **kwargs: Any) -> Any:
        try:
            signature.bind(self, *args, **kwargs)
        except TypeError as e:
            log.info("%s: refused %s: %s", self.name, method.__name__, e)
            raise JSONRPCError(INVALID_PARAMS.with_data(
                f"TypeError: {self.name}.{method.__name__}: {e}")) from None
        try:
            return method(self, *args, **kwargs)
        except ValueError as e:
            log.info("%s: refused: %s", self.name, e)
            raise JSONRPCError(INVALID_PARAMS.with_data(f"ValueError: {e}")) from None
        except BridgeError as e:
            log.info("%s: %s", self.name, e)
            bad_input = isinstance(e.__cause__, BadRequest)
            raise JSONRPCError((INVALID_PARAMS if bad_input else DEVICE_ERROR).with_data(
                f"BridgeError: {e}")) from None
        except Exception:
            log.exception("%s: %s failed", self.name, method.__name__)
            raise
    return answer


# pyleco's own RPC methods of an actor that `ptb leco` does not offer: a client of the
# coordinator stops nothing, polls nothing, changes no logging and opens no device
NOT_OFFERED = ("shut_down", "set_log_level", "start_polling", "stop_polling",
               "get_polling_interval", "set_polling_interval", "connect", "disconnect")

LOGGED_CHARACTERS = 200      # of a message dropped: what is logged of it


class DeviceActor(Actor):
    """A LECO actor serving one instrument: only the parameters and actions it declares.
    pyleco's own `shut_down`, `set_log_level`, polling, `connect` and `disconnect` are not
    offered (`NOT_OFFERED`: a client of the coordinator stops nothing and changes no logging of
    the command); a message that cannot be read, or is no request, is logged in one short line
    and dropped, never the end of the actor."""

    def __init__(self, name: str, device: Any, **kwargs: Any):
        super().__init__(name, device_class=type(device), **kwargs)
        self.device = device

    def register_rpc_methods(self) -> None:
        super().register_rpc_methods()
        for name in NOT_OFFERED:          # (answered "Method not found")
            self.rpc.unregister_method(name)

    def read_and_handle_message(self) -> None:
        try:
            super().read_and_handle_message()
        except Exception as e:            # malformed bytes, JSON nested too deep, ...
            log.warning("%s: a message dropped: %s: %s", self.name, type(e).__name__,
                        str(e)[:LOGGED_CHARACTERS])

    def handle_json_message(self, message: Any) -> None:
        """A request is answered; anything else (a result, an error, JSON that is no
        request) is dropped, logged in one short line."""
        data = message.data
        if JsonContentTypes.REQUEST in get_json_content_type(data):
            self.handle_json_request(message=message)
        else:
            log.warning("%s: a message that is no request dropped: %s", self.name,
                        repr(data)[:LOGGED_CHARACTERS])

    def handle_unknown_message_type(self, message: Any) -> None:
        log.warning("%s: a message of an unknown type dropped: %s", self.name,
                    repr(message.payload)[:LOGGED_CHARACTERS])

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

    @_answering
    def get_parameters(self, parameters: list[str] | tuple[str, ...]) -> dict[str, Any]:
        if isinstance(parameters, str) or not isinstance(parameters, (list, tuple)):
            raise ValueError(f"{self.name}: parameters are a list of names, not {parameters!r}")
        # each name once: a list naming `power_mw` a thousand times is one measurement
        return {k: self._value(self._parameter(k, False)) for k in dict.fromkeys(parameters)}

    @_answering
    def set_parameters(self, parameters: dict[str, Any]) -> None:
        """Every name and value checked, then the values set at once (`set_many`): one
        refused, none set."""
        if not isinstance(parameters, dict):
            raise ValueError(f"{self.name}: parameters to set are {{name: value}}, "
                             f"not {parameters!r}")
        for k, v in parameters.items():
            self._parameter(k, True)
            if v is None:
                raise ValueError(f"{self.name}: {k} needs a value (null given)")
        self.device.set_many(parameters)

    @_answering
    def call_action(self, action: str, args: Sequence | None = None,
                    kwargs: dict[str, Any] | None = None) -> Any:
        if not isinstance(action, str) or action not in self.device.ACTIONS:
            raise ValueError(f"{self.name} has no action {action!r}; it has "
                             f"{', '.join(self.device.ACTIONS)}")
        if args is not None and not isinstance(args, (list, tuple)):
            raise ValueError(f"{self.name}.{action}: args are a list, not {args!r}")
        if kwargs is not None and not isinstance(kwargs, dict):
            raise ValueError(f"{self.name}.{action}: kwargs are an object, not {kwargs!r}")
        do = getattr(self.device, action)
        try:
            inspect.signature(do).bind(*(args or ()), **(kwargs or {}))
        except TypeError as e:             # wrong number or names of arguments
            raise ValueError(f"{self.name}.{action}: {e}") from None
        return do(*(args or ()), **(kwargs or {}))

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


def coordinator_answers(host: str, port: int, within_s: float = SIGN_IN_S,
                        stop: threading.Event | None = None) -> bool:
    """Whether a LECO coordinator at host:port answers a sign-in within `within_s` (asked
    every second until then, or until `stop` is set)."""
    deadline = time.monotonic() + within_s
    while True:
        ask_s = max(0.1, min(1.0, deadline - time.monotonic()))
        # (a name of its own: another component signed in as the probe would look like no
        # coordinator)
        probe = Communicator(name=f"ptb-leco-probe-{os.getpid()}-{secrets.token_hex(4)}",
                             host=host, port=port, timeout=ask_s)
        try:
            probe.sign_in()
        except ConnectionRefusedError:      # no answer (pyleco logs the sign-in's time-out)
            probe.socket.close(linger=0)    # nobody to sign out from
            if time.monotonic() >= deadline or (stop is not None and stop.is_set()):
                return False
            continue
        probe.close()
        return True


class Actors:
    """Every device's actor, each listening on a thread of its own until `close`. An actor
    whose loop ends otherwise sets `ended` (its name in `lost`): the command stops with it."""

    def __init__(self, devices: Mapping[str, Access], host: str, port: int):
        # pyleco logs every error answered with its traceback: the actors log each refusal
        # in one line, and a fault of theirs with its traceback, themselves
        logging.getLogger("pyleco.json_utils.rpc_server").setLevel(logging.CRITICAL)
        self.ended = threading.Event()
        self.lost: list[str] = []
        self._closing = False
        self.actors: dict[str, DeviceActor] = {}
        self._stops: dict[str, threading.Event] = {}
        self.threads: list[threading.Thread] = []
        for name, access in devices.items():
            family = LECO_FAMILIES.get(access.kind)
            if family is None:
                continue
            actor = DeviceActor(name, family(access), host=host, port=port)
            self.actors[name] = actor
            self._stops[name] = threading.Event()
            t = threading.Thread(target=self._listen, args=(actor,), name=f"leco-{name}",
                                 daemon=True)
            self.threads.append(t)
            t.start()

    def not_signed_in(self, within_s: float = SIGN_IN_S,
                      stop: threading.Event | None = None) -> list[str]:
        """The actors the coordinator has not taken within `within_s` (another component
        signed in under the same name, or no coordinator answers), or by `stop`."""
        deadline = time.monotonic() + within_s
        while time.monotonic() < deadline and any(
                a.namespace is None for a in self.actors.values()):
            if (stop is not None and stop.is_set()) or self.ended.is_set():
                break
            time.sleep(0.05)
        return [n for n, a in self.actors.items() if a.namespace is None]

    def _listen(self, actor: DeviceActor) -> None:
        try:
            actor.listen(stop_event=self._stops[actor.name])
        except Exception:
            log.exception("LECO actor %s stopped", actor.name)
        if not self._closing:
            self.lost.append(actor.name)
            self.ended.set()

    def close(self) -> None:
        self._closing = True
        for stop in self._stops.values():
            stop.set()
        for t in self.threads:
            t.join(5)
        for actor in self.actors.values():
            actor.device.close()
