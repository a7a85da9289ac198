"""What a rig is made of, as values: devices, the chip, GPUs, GPU monitors, the bus, and the
agent's settings.

`hil.rig.file` reads and writes these from the rig file (TOML, docs/rigfile.md);
`hil.rig.emulated` makes them for the emulated rigs.
"""
from __future__ import annotations

import dataclasses
import pathlib
from collections.abc import Iterable
from dataclasses import dataclass, field

from photonic_testbed.hil.agent.config import AgentConfig
from photonic_testbed.hil.bus.security import ClientKeys, client_keys
from photonic_testbed.hil.devices.service import ServiceSpec


class RigFileError(ValueError):
    """The rig file is missing, not TOML, or does not say what it must."""


@dataclass(frozen=True)
class DeviceConfig:
    name: str
    kind: str
    address: str
    driver: str = ""
    request: str = ""            # endpoint clients connect to for requests
    publish: str = ""            # endpoint subscribers connect to
    options: dict = field(default_factory=dict)
    telemetry_hz: float | None = None
    metrics: str = ""            # "HOST:PORT" where its service serves Prometheus metrics


@dataclass(frozen=True)
class ChipConfig:
    topology: str                # a topology name ("benes16") or a JSON file
    calibration: str = ""        # calibration file, "" when not calibrated yet
    heaters: str = ""            # the device that drives the chip's heaters
    switch: str = ""             # the device that offers the chip as a CircuitSwitch


@dataclass(frozen=True)
class GpuConfig:
    name: str
    switch: str
    port: int
    spare: bool = False
    host: str = ""
    # Which GPU of its host NVML calls it: an index (0, 1, ...) or a UUID ("GPU-8f3c...");
    # None when nothing monitors this GPU's health on its host (docs/gpu-monitor.md).
    nvml: int | str | None = None
    iface: str = ""              # the Linux interface of its transceiver on this switch (DDM)
    lane: int | None = None      # that transceiver's lane (1-based) on this port; None = all
    # The server whose scale-up fabric (NVLink) it shares with the server's other GPUs: links
    # between them need no circuit, and a failed GPU's server may move as a whole ("" = none).
    server: str = ""


@dataclass(frozen=True)
class BusConfig:
    host: str = "127.0.0.1"
    base_port: int = 5600
    bind: str = ""               # address services bind ("" = the endpoint's own host)
    curve: bool = True
    server_key: str = ""         # server secret certificate (.key_secret)
    server_public_key: str = ""  # server public certificate (.key), what clients check
    authorized_keys: str = ""    # folder of client public certificates
    client_key: str = ""         # this host's client secret certificate
    heartbeat_s: float = 0.5
    # The processes that are not device services: the agent (its state and its requests) and
    # the GPU health monitor of the rack. "" = the default BASE + 2 * (devices + k).
    agent_request: str = ""
    agent_publish: str = ""
    gpus_request: str = ""
    gpus_publish: str = ""


@dataclass(frozen=True)
class AgentGroup:
    """An agent group of a datacenter rig ([groups.NAME]): the replicas that elect its leader
    on an etcd journal of the group's name, and the devices (a failure domain's switches) whose
    GPUs it alone manages."""
    devices: tuple[str, ...]
    replicas: tuple[str, ...]


# The bus's non-device processes, in the order their default ports follow the devices'.
PROCESSES = ("agent", "gpus")


@dataclass(frozen=True)
class Rig:
    name: str
    path: pathlib.Path | None
    bus: BusConfig
    devices: dict[str, DeviceConfig]
    chip: ChipConfig | None = None
    gpus: tuple[GpuConfig, ...] = ()
    # host -> (request, publish) of that host's GPU monitor ([monitors.HOST]); empty: one
    # monitor (the bus's gpus endpoints) for every GPU, as the emulated rack has
    monitors: dict[str, tuple[str, str]] = field(default_factory=dict)
    agent: AgentConfig = field(default_factory=AgentConfig)     # the [agent] table
    # replica name -> (request, publish) of each of the agent's replicas ([replicas.NAME]: a
    # group on an etcd journal); empty: one agent, at the bus's agent endpoints
    replicas: dict[str, tuple[str, str]] = field(default_factory=dict)
    # agent groups, one per failure domain ([groups.NAME]); empty: one group of every replica
    groups: dict[str, AgentGroup] = field(default_factory=dict)
    group: str = ""         # the group this rig is the view of (`Rig.seen_by`), "" = none

    def seen_by(self, replica: str | None) -> Rig:
        """The rig as agent replica `replica` manages it: with [groups], its group's view (the
        group's devices, the GPUs on them, its replicas; `group` naming it); else the rig
        itself. A rig with groups needs the replica named."""
        if not self.groups:
            return self
        if replica is None:
            raise RigFileError(f"rig {self.name} has agent groups ({', '.join(self.groups)}): "
                               "name the replica (--replica) of the group it belongs to")
        group = next((n for n, g in self.groups.items() if replica in g.replicas), None)
        if group is None:
            raise RigFileError(f"rig {self.name} has no agent replica {replica!r} in its "
                               f"groups (replicas: {', '.join(self.replicas)})")
        return self.group_view(group)

    def group_view(self, name: str) -> Rig:
        """Group `name`'s part of the rig (`seen_by`)."""
        try:
            g = self.groups[name]
        except KeyError:
            raise RigFileError(f"rig {self.name} has no agent group {name!r} (its groups: "
                               f"{', '.join(self.groups) or 'none'})") from None
        return dataclasses.replace(
            self, devices={n: d for n, d in self.devices.items() if n in g.devices},
            gpus=tuple(x for x in self.gpus if x.switch in g.devices),
            replicas={n: self.replicas[n] for n in g.replicas}, groups={}, group=name)

    def group_of(self, gpus: Iterable[str]) -> str:
        """The agent group that manages every GPU of `gpus` (a job's): RigFileError if they
        span groups (a job lives inside one failure domain) or a GPU is not the rig's."""
        switch = {g.name: g.switch for g in self.gpus}
        owner = {d: n for n, g in self.groups.items() for d in g.devices}
        found: dict[str, list[str]] = {}
        for gpu in gpus:
            if gpu not in switch:
                raise RigFileError(f"rig {self.name} has no GPU {gpu!r}")
            found.setdefault(owner.get(switch[gpu], ""), []).append(gpu)
        if len(found) > 1:
            raise RigFileError(
                "a job's GPUs are managed by one agent group, each group its failure domain's: "
                + "; ".join(f"{', '.join(v[:3])}{' ...' if len(v) > 3 else ''} by "
                            f"{k or 'none'}" for k, v in found.items()))
        return next(iter(found), "")

    def agent_changes(self, device: str) -> bool:
        """Whether the agent makes the changes of `device` (an operator's go to it as manual
        changes): on a rig with GPUs, every device but a switch none of them is on (a lab's
        own switch, an input selector, is changed at its service, by a key whose role may)."""
        if not self.gpus:
            return False
        d = self.devices.get(device)
        if d is None:
            raise RigFileError(f"no device named {device!r} in the rig; it has: "
                               f"{', '.join(self.devices)}")
        return d.kind != "switch" or device in {g.switch for g in self.gpus}

    def endpoints(self) -> dict[str, tuple[str, str]]:
        """Device name -> (request endpoint, publish endpoint)."""
        return {d.name: (d.request, d.publish) for d in self.devices.values()}

    def process_endpoints(self) -> dict[str, tuple[str, str]]:
        """The agent's and the GPU health monitor's (request, publish) endpoints."""
        out = {}
        for k, name in enumerate(PROCESSES):
            base = self.bus.base_port + 2 * (len(self.devices) + k)
            out[name] = (getattr(self.bus, f"{name}_request")
                         or f"tcp://{self.bus.host}:{base}",
                         getattr(self.bus, f"{name}_publish")
                         or f"tcp://{self.bus.host}:{base + 1}")
        return out

    def agent_endpoints(self) -> tuple[str, str]:
        """Where the agent answers requests and publishes its state (device name `agent`);
        with [replicas], the first replica's (a client that follows whichever leads asks
        `agent_replicas()`)."""
        if self.replicas:
            return next(iter(self.replicas.values()))
        return self.process_endpoints()["agent"]

    def agent_replicas(self) -> dict[str, tuple[str, str]]:
        """Replica name -> (request, publish) of every replica of the agent: [replicas.NAME],
        or the one agent ("agent") at `agent_endpoints`. Clients try them in turn: a standby
        answers NotLeader, naming the leader. A rig of agent groups has no one agent: a client
        asks its group's (`group_view` of the `group_of` its GPUs)."""
        if self.groups:
            raise RigFileError(f"rig {self.name} has an agent group per failure domain "
                               f"({', '.join(self.groups)}): ask the replicas of the group of "
                               "the job's GPUs (Rig.group_of, Rig.group_view)")
        return dict(self.replicas) or {"agent": self.agent_endpoints()}

    def gpus_endpoints(self) -> tuple[str, str]:
        """Where the rack's GPU health monitor publishes (device name `gpus`)."""
        return self.process_endpoints()["gpus"]

    def gpu_monitors(self) -> dict[str, tuple[str, str]]:
        """Device name -> (request, publish) of every GPU health monitor: `gpus-HOST` per host
        of [monitors], or the one `gpus` of the whole rack."""
        if self.monitors:
            return {monitor_device(h): eps for h, eps in self.monitors.items()}
        return {"gpus": self.gpus_endpoints()}

    def monitor_of(self, gpu: str) -> str:
        """The device name of the monitor that reports `gpu`'s health and light."""
        if not self.monitors:
            return "gpus"
        host = next((g.host for g in self.gpus if g.name == gpu), None)
        if host not in self.monitors:
            raise RigFileError(f"GPU {gpu!r} is on no host of [monitors] "
                               f"({', '.join(self.monitors)})")
        return monitor_device(host)

    def bind_endpoint(self, endpoint: str) -> str:
        """What a process serving `endpoint` binds (the bus's `bind` address if set)."""
        return self._bind(endpoint)

    def _bind(self, endpoint: str) -> str:
        if not self.bus.bind:
            return endpoint
        port = endpoint.rsplit(":", 1)[1]
        return f"tcp://{self.bus.bind}:{port}"

    def state_dir(self) -> pathlib.Path | None:
        """Where the device services keep what must outlive them (each device's highest agent
        term) by default: `NAME-state/` beside the rig file `NAME.toml`; None for a rig
        without a file."""
        if self.path is None:
            return None
        return self.path.with_name(self.path.stem + "-state")

    def service_specs(self, names: list[str] | None = None,
                      state_dir: str | pathlib.Path | None = None) -> list[ServiceSpec]:
        """The device services of `names` (every device by default), keeping their state in
        `state_dir` (none: in memory only)."""
        names = list(self.devices) if not names else names
        unknown = [n for n in names if n not in self.devices]
        if unknown:
            raise RigFileError(f"no device named {', '.join(unknown)} in the rig; it has: "
                               f"{', '.join(self.devices)}")
        specs = []
        for n in names:
            d = self.devices[n]
            options = dict(d.options)
            if d.kind == "chip":
                if self.chip is None:
                    raise RigFileError(f"device {n} is a chip but the rig has no [chip] table "
                                       "(its topology and calibration)")
                options.setdefault("topology", self.chip.topology)
                if self.chip.calibration:
                    options.setdefault("calibration", self.chip.calibration)
            specs.append(ServiceSpec(
                name=d.name, kind=d.kind, address=d.address, driver=d.driver,
                request=self._bind(d.request), publish=self._bind(d.publish),
                options=options, heartbeat=self.bus.heartbeat_s,
                telemetry_hz=d.telemetry_hz, metrics=d.metrics,
                curve_secret=self.bus.server_key if self.bus.curve else None,
                curve_authorized=self.bus.authorized_keys if self.bus.curve else None,
                state_dir=None if state_dir is None else str(state_dir)))
        return specs

    def server_keys(self):
        """The keys a process serving on this rig's bus binds with (None without CURVE)."""
        if not self.bus.curve:
            return None
        from photonic_testbed.hil.bus.security import server_keys
        return server_keys(self.bus.server_key, self.bus.authorized_keys)

    def client_keys(self) -> ClientKeys | None:
        """This host's client keys (None when the bus runs without CURVE)."""
        if not self.bus.curve:
            return None
        return client_keys(self.bus.client_key, self.bus.server_public_key)


def host_port(text: str) -> tuple[str, int] | None:
    """`HOST:PORT` (a port 1..65535; an IPv6 host in brackets) as (host, port); None for
    anything else."""
    host, sep, port = str(text).rpartition(":")
    if not (sep and host and port.isascii() and port.isdigit() and 0 < int(port) < 65536):
        return None
    return host.strip("[]"), int(port)


def monitor_device(host: str) -> str:
    """The bus device name of a host's GPU monitor."""
    return f"gpus-{host}"
