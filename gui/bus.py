"""The GUI on a rig's bus: the services' mirrored state into `FabricModel`, commands out.

`BusFabric(model, rig)` subscribes (hil.bus.mirror) to every device of the rig file and to the
agent, on a thread of its own, and hands the model what arrives, which the model queues to the
Qt main thread:

    every device's state   -> as the bus has it: its snapshot, then each change (`Set`,
                              `Delete`), with the device's kind (the model shows switches,
                              chips and the agent: gui/model.py)
    a chip, a heater DAC   -> its topology and heater budget (the service's `describe`, asked
                              once per service incarnation)
    GPU monitors (`gpus`)  -> every `rx_period_s` one `rx_power` request per monitor reads the
                              GPUs' receivers (the trends), except on switches whose own port
                              monitors publish power
    telemetry              -> `total_power_mw` of a chip or heater DAC (heater power trend),
                              an OCS's `power_dbm` (its matrix, and its GPUs' receivers)
    every device           -> its connection state in the status bar (the agent's with its
                              alarms)

It never waits on the network on the Qt thread. Mirrors resynchronise by themselves (snapshot +
deltas, gap recovery), so a service that restarts, or comes up after the GUI, is picked up
without the operator doing anything.

As `Commands`, it sends the operator's commands from one worker thread, each through a
`ServiceClient` (one per service, used only on that thread). On a rig with an agent (one that
lists GPUs) every command of a device the agent drives goes to it (`Rig.agent_changes`): a
swap, and the manual changes (`manual_circuits`, `manual_heaters`), which the agent journals
and makes itself, the circuits as the operator's part of the switch beside the jobs' (devices
take changes from the agent alone). A switch no GPU is on (an input selector), and every device
of a rig without an agent, takes a change at its own service. A heater change carries the state
version the GUI shows (`expect`, compare-and-set), and so does a circuit change sent to a
device, so a command computed from a stale picture is refused (`StaleState`) rather than
applied; every refusal comes back with its reason (`Unauthorized` for a key whose role may not
ask it).
"""
from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from photonic_testbed.gui.commands import Command, CommandResult, Commands
from photonic_testbed.gui.model import FabricModel
from photonic_testbed.hil.bus.client import BusError, RemoteError, ServiceClient, StaleState
from photonic_testbed.hil.bus.mirror import StateSubscriber, clone
from photonic_testbed.hil.bus.security import ClientKeys
from photonic_testbed.hil.bus.state import StateOp, touched
from photonic_testbed.hil.rig import Rig, RigFileError

log = logging.getLogger(__name__)

AGENT = "agent"
REPLICA = "agent-replica"        # one replica of a replicated agent (docs/control-plane.md)
MONITOR = "gpu_monitor"
DOWN_AFTER_S = 3.0          # a service not reached this long after start shows as down
RX_PERIOD_S = 1.0           # how often the GPUs' receivers are read for the trends
PORT_TELEMETRY_S = 5.0      # a switch whose port powers came this recently reports its own
HEATER_KINDS = ("chip", "heater_dac")


def link_sources(rig: Rig) -> list[str]:
    """The services the received-power trend comes from: the GPU monitors, and the OCSes
    (kind `switch`) that GPUs are cabled to, whose port monitors publish power."""
    out = set()
    for g in rig.gpus:
        device = rig.devices.get(g.switch)
        if device is not None and device.kind == "switch":
            out.add(g.switch)
        try:
            out.add(rig.monitor_of(g.name))
        except RigFileError:
            pass
    return sorted(out)


def _circuits(wire: Any) -> dict[int, int]:
    """[[in, out], ...] (the bus's circuits) -> {in: out}; malformed pairs are skipped (a
    command computed from them is checked by the service)."""
    out = {}
    for pair in wire or ():
        if isinstance(pair, (list, tuple)) and len(pair) == 2:
            out[int(pair[0])] = int(pair[1])
    return out


class BusFabric(Commands):
    """State from the bus into a `FabricModel`, and operator commands onto the bus."""

    def __init__(self, model: FabricModel, rig: Rig, *, timeout: float = 5.0,
                 keys: ClientKeys | None = None, poll_s: float = 0.05,
                 down_after_s: float = DOWN_AFTER_S, rx_period_s: float = RX_PERIOD_S):
        self.model = model
        self.rig = rig
        self.timeout = timeout
        self.keys = keys if keys is not None else rig.client_keys()
        self.poll_s = poll_s
        self.down_after_s = down_after_s
        self.endpoints: dict[str, tuple[str, str]] = dict(rig.endpoints())
        self.kinds: dict[str, str] = {n: d.kind for n, d in rig.devices.items()}
        # a replicated agent ([replicas]): each replica subscribed to as `agent@NAME`, the one
        # that leads (in the highest term seen) shown as `agent` and sent the commands
        self.replicas: dict[str, tuple[str, str]] = dict(rig.replicas) if rig.gpus else {}
        self._leader: str | None = None
        self._term = 0
        if rig.gpus:            # a rig without GPUs runs no agent (`ptb agent` refuses it)
            self.endpoints[AGENT] = rig.agent_endpoints()
            self.kinds[AGENT] = AGENT
            for name, eps in self.replicas.items():
                self.endpoints[f"{AGENT}@{name}"] = eps
                self.kinds[f"{AGENT}@{name}"] = REPLICA
        if rig.gpus:
            for name, eps in rig.gpu_monitors().items():
                self.endpoints[name] = eps
                self.kinds[name] = MONITOR
        self.rx_period_s = rx_period_s
        self._port_power_at: dict[str, float] = {}      # switch -> last port power telemetry
        self._rx_thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._states: dict[str, dict] = {}            # latest mirrored state per device
        self._described: dict[str, str | None] = {}
        self._alarms: list[str] | None = None
        self._etcd: dict[str, str] = {}            # the leading replica's word on etcd
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._started = 0.0
        # what the subscriber follows: with replicas, each of them rather than `agent`
        self._followed = {n: eps for n, eps in self.endpoints.items()
                          if not (n == AGENT and self.replicas)}
        self._alive: dict[str, bool] = {n: False for n in self._followed}
        self._marked_down: set[str] = set()
        self._worker = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="gui-bus")
        self._clients: dict[str, ServiceClient] = {}  # only touched on the worker thread
        self.error: BaseException | None = None

    # ---- subscribing ----------------------------------------------------------------------
    def start(self) -> BusFabric:
        for name, (request, _) in self.endpoints.items():
            self._service(name, "connecting", f"waiting for {request}")
        self._started = time.monotonic()
        self._thread = threading.Thread(target=self._run, name="gui-bus-subscriber",
                                        daemon=True)
        self._thread.start()
        if self.rx_period_s > 0 and self.rig.gpus:
            self._rx_thread = threading.Thread(target=self._poll_rx, name="gui-bus-rx",
                                               daemon=True)
            self._rx_thread.start()
        return self

    def _run(self) -> None:
        try:
            sub = StateSubscriber(self._followed, on_state=self._on_state,
                                  on_online=self._on_online, on_telemetry=self._on_telemetry,
                                  keys=self.keys)
        except Exception as e:      # bad keys, bad endpoint: say so in the status bar
            self.error = e
            log.error("cannot subscribe to the rig's bus: %s", e)
            for name in self._followed:
                self._service(name, "down", f"cannot subscribe: {e}")
            return
        try:
            while not self._stop.is_set():
                sub.poll(self.poll_s)
                self._watch()
        except Exception as e:
            self.error = e
            log.exception("the GUI's bus subscriber stopped")
            for name in self._followed:
                self._service(name, "down", f"subscriber stopped: {e}")
        finally:
            sub.close()

    def _watch(self) -> None:
        if time.monotonic() - self._started < self.down_after_s:
            return
        for name, alive in self._alive.items():
            if not alive and name not in self._marked_down:
                self._marked_down.add(name)
                self._service(name, "down", f"no answer from {self.endpoints[name][0]} yet; "
                                            "still trying")

    def _on_online(self, device: str, alive: bool) -> None:
        self._alive[device] = alive
        if not alive and device == f"{AGENT}@{self._leader}":
            self._unmanaged(f"replica {self._leader} (term {self._term}) lost")
        if alive:
            self._marked_down.discard(device)
            self._service(device, "connected", f"{self.endpoints[device][0]}")
        else:
            self._marked_down.add(device)
            self._service(device, "down", "heartbeats lost; reconnecting by itself")

    def _service(self, name: str, state: str, detail: str) -> None:
        self.model.post_service(name, state, detail)

    def _unmanaged(self, why: str) -> None:
        """No replica leads (as far as the GUI hears): the agent's row says so."""
        self._leader = None
        self._service(AGENT, "down", f"{why}; no agent replica leads: the fabric is "
                      "unmanaged, its circuits held as they are until a replica leads")

    def _on_replica(self, device: str, state: dict, ops: list[StateOp] | None) -> None:
        """A replica's state: the leader's is shown as the agent's (a new leader's whole)."""
        name = device.split("@", 1)[1]
        term = int(state.get("term") or 0)
        if state.get("role") != "leader":
            if name == self._leader:
                self._unmanaged(f"replica {name} stands by now")
            return
        if term < self._term:
            return                          # a deposed leader's late word
        if name != self._leader or term != self._term or ops is None:
            self._leader, self._term = name, term
            self.endpoints[AGENT] = self.replicas[name]
            self._worker.submit(self._forget_client, AGENT)
            ops = None
        self._on_state(AGENT, state, ops)

    def _forget_client(self, device: str) -> None:
        """(on the worker thread) the next command to `device` goes to where it is now."""
        client = self._clients.pop(device, None)
        if client is not None:
            client.close()

    def _on_state(self, device: str, state: dict, ops: list[StateOp] | None) -> None:
        if self.kinds.get(device) == REPLICA:
            self._on_replica(device, state, ops)
            return
        with self._lock:
            self._states[device] = clone(state)
        kind = self.kinds.get(device, "")
        if ops is None:
            self.model.post_snapshot(device, kind, clone(state))
        else:
            self.model.post_change(device, ops)
        if kind in HEATER_KINDS:
            self._describe_once(device, state)
        if kind == AGENT and (ops is None or {"alarms", "etcd"} & touched(ops)):
            alarms = [str(a) for a in state.get("alarms") or ()]
            etcd = state.get("etcd") or {}
            if alarms != self._alarms or etcd != self._etcd or ops is None:
                self._alarms, self._etcd = alarms, dict(etcd)
                detail = ("ALARM: " + "; ".join(alarms)) if alarms else "no alarms"
                if self._leader is not None:
                    sick = [f"{m} {why}" for m, why in etcd.items() if why != "ok"]
                    detail = (f"replica {self._leader} leads (term {self._term}); etcd "
                              f"{len(etcd) - len(sick)} of {len(etcd)} members healthy"
                              + (f" ({'; '.join(sick)})" if sick else "") + f"; {detail}")
                self._service(AGENT, "connected", detail)

    def _on_telemetry(self, device: str, msg: dict) -> None:
        """An OCS's port power monitors colour its matrix (after its first state) and give
        its GPUs' received power; a chip's or DAC's total heater power goes to its trend."""
        values = msg.get("values", {})
        kind = self.kinds.get(device)
        t = msg.get("t", time.time())
        if kind in HEATER_KINDS and isinstance(values.get("total_power_mw"), (int, float)):
            self.model.post_samples({f"heater/{device}": [[t, values["total_power_mw"]]]})
        power = values.get("power_dbm")
        with self._lock:
            state = self._states.get(device)
        if kind != "switch" or state is None or not isinstance(power, dict) or not power:
            return
        self.model.post_power(device, power)
        self._port_power_at[device] = time.monotonic()
        n = int(state.get("ports", 0))
        rx = {f"rx/{g.name}": [[t, power[str(n + g.port)]]] for g in self.rig.gpus
              if g.switch == device and isinstance(power.get(str(n + g.port)), (int, float))}
        if rx:
            self.model.post_samples(rx)

    def _describe_once(self, device: str, state: dict) -> None:
        """Ask `describe` once per service incarnation (topology, heater budget)."""
        incarnation = str(state.get("version", "")).split(":")[0] or None
        if self._described.get(device, "?") != incarnation:
            self._described[device] = incarnation
            self._worker.submit(self._fetch_describe, device)

    def _fetch_describe(self, device: str) -> None:
        try:
            described = self._client(device).call("describe")
        except BusError as e:
            log.warning("%s: no answer to describe: %s", device, e)
            self._described[device] = None        # ask again with the next state
            return
        # The service's describe wraps the driver's under "device".
        device_described = described.get("device")
        inner = device_described if isinstance(device_described, dict) else {}
        if self.kinds.get(device) == "chip":
            topology = described.get("topology") or inner.get("topology")
            if topology is None:
                log.warning("%s: describe gives no topology", device)
                self._described[device] = None
            else:
                self.model.post_topology(device, topology)
        heaters_described = inner.get("heaters")
        heaters = heaters_described if isinstance(heaters_described, dict) else inner
        budget = heaters.get("power_budget_mw", described.get("power_budget_mw"))
        if isinstance(budget, (int, float)) and not isinstance(budget, bool):
            self.model.post_budget(device, float(budget))
        else:
            self.model.post_budget(device, None, "not in its describe")

    # ---- received power ------------------------------------------------------------------
    def _poll_rx(self) -> None:
        """The GPUs' receivers, read every `rx_period_s` for the trends: one `rx_power` per
        monitor and switch (what the agent reads per event), on a thread and clients of its
        own so that a monitor that is down delays no command."""
        clients: dict[str, ServiceClient] = {}
        try:
            while not self._stop.wait(self.rx_period_s):
                self._read_rx(clients)
        except Exception:
            log.exception("the GUI's receiver reading stopped")
        finally:
            for c in clients.values():
                c.close()

    def _read_rx(self, clients: dict[str, ServiceClient]) -> None:
        asks: dict[tuple[str, str], list[tuple[str, int]]] = {}
        now = time.monotonic()
        for g in self.rig.gpus:
            if now - self._port_power_at.get(g.switch, -1e9) < PORT_TELEMETRY_S:
                continue                    # that switch's own port monitors report it
            state = self.state(g.switch)
            if state is None or "ports" not in state:
                continue
            try:
                monitor = self.rig.monitor_of(g.name)
            except RigFileError:
                continue
            if not self._alive.get(monitor):
                continue
            asks.setdefault((monitor, g.switch), []).append((g.name, int(state["ports"]) + g.port))
        samples = {}
        for (monitor, switch), items in asks.items():
            client = clients.get(monitor)
            if client is None:
                client = clients[monitor] = ServiceClient(
                    self.endpoints[monitor][0], timeout=min(self.timeout, 2.0), keys=self.keys)
            try:
                got = client.call("rx_power", switch=switch, ports=[p for _, p in items])
            except BusError as e:
                log.info("no received power from %s for %s: %s", monitor, switch, e)
                continue
            t = time.time()
            dbm = got.get("dbm", {})              # by port (hil.bus.schema.RxPowerByPort)
            for gpu, port in items:
                v = dbm.get(port)
                if isinstance(v, (int, float)) and not isinstance(v, bool):
                    samples[f"rx/{gpu}"] = [[t, v]]
        if samples:
            self.model.post_samples(samples)

    def state(self, device: str) -> dict | None:
        """A copy of the latest mirrored state of `device` (any thread)."""
        with self._lock:
            s = self._states.get(device)
            return clone(s) if s is not None else None

    # ---- commands -------------------------------------------------------------------------
    def submit(self, command: Command, done: Callable[[CommandResult], None]) -> None:
        try:
            self._worker.submit(self._execute, command, done)
        except RuntimeError:                # closed
            done(CommandResult(command, False, "the GUI's bus connection is closed"))

    @property
    def has_agent(self) -> bool:
        """Whether the rig has an agent (it lists GPUs): the one that changes its devices."""
        return AGENT in self.endpoints

    def _client(self, device: str) -> ServiceClient:
        client = self._clients.get(device)
        if client is None:
            client = self._clients[device] = ServiceClient(
                self.endpoints[device][0], timeout=self.timeout, keys=self.keys)
        return client

    def _execute(self, command: Command, done: Callable[[CommandResult], None]) -> None:
        try:
            ok, reason, details = self._run_command(command)
        except StaleState as e:
            ok, reason, details = False, (f"{e.remote_message} — the GUI showed an older "
                                          "state; look again and retry"), {}
        except RemoteError as e:
            ok, reason, details = False, f"{e.kind}: {e.remote_message}", {}
        except BusError as e:
            ok, reason, details = False, str(e), {}
        except (ValueError, TypeError, KeyError) as e:
            ok, reason, details = False, f"cannot send: {e}", {}
        done(CommandResult(command, ok, reason, details))

    def _run_command(self, c: Command) -> tuple[bool, str, dict]:
        p = c.params
        if c.action == "swap":
            if p.get("spare"):
                return (False, f"the agent chooses the spare itself; ask for the swap of "
                               f"{p['gpu']} with '(agent picks)'", {})
            result = self._client(AGENT).call("swap", gpu=str(p["gpu"]))
            swaps = ", ".join(f"{a} -> {b}" for a, b in result.get("swaps", {}).items())
            lat = result.get("latency_s")
            return True, f"swapped {swaps or 'nothing'}" + (
                f" in {lat * 1e3:.0f} ms" if isinstance(lat, (int, float)) else ""), result
        device = str(p["switch"])
        if self.kinds.get(device) not in ("switch", "chip"):
            return False, f"{device} is not a switch of this rig", {}
        state = self.state(device)
        if state is None:
            return False, f"{device}: no state from its service yet (is it up?)", {}
        version = state.get("version")
        if c.action == "set_heater":
            if self.kinds[device] != "chip":
                return False, f"{device} has no heaters (it is not a chip)", {}
            ch, volts = int(p["channel"]), float(p["volts"])
            if self.has_agent and self.rig.agent_changes(device):
                result = self._client(AGENT).call("manual_heaters", device=device,
                                                  volts=[volts], first=ch, version=version)
            else:
                result = self._client(device).call("set_heaters", volts=[volts], first=ch,
                                                   expect=version)
            return True, f"{device}: heater {ch} set to {volts:.3f} V", result
        circuits = _circuits(state.get("circuits"))
        a = int(p["input"])
        if c.action == "disconnect":
            if a not in circuits:
                return False, f"{device}: input {a} has no circuit to disconnect", {}
            b = circuits.pop(a)
            what = f"{device}: input {a} disconnected from output {b}"
            change: dict[str, Any] = {"disconnect": [a]}
        else:
            b = int(p["output"])
            circuits[a] = b
            what = f"{device}: input {a} connected to output {b}"
            change = {"connect": [[a, b]]}
        if self.has_agent and self.rig.agent_changes(device):
            # the operator's part of a switch of the GPUs, kept by the agent
            result = self._client(AGENT).call("manual_circuits", switch=device, **change)
            return True, f"{what} (by the agent, journaled)", result
        result = self._client(device).call(
            "apply_circuits", circuits=[[x, y] for x, y in sorted(circuits.items())],
            expect=version)
        return True, what, result

    # ---- closing --------------------------------------------------------------------------
    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2.0)
        if self._rx_thread is not None:
            self._rx_thread.join(timeout=5.0)
        try:
            self._worker.submit(self._close_clients)
        except RuntimeError:
            return                          # closed already
        self._worker.shutdown(wait=True)

    def _close_clients(self) -> None:
        for client in self._clients.values():
            client.close()
        self._clients.clear()

