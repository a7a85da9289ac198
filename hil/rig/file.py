"""The rig file: one TOML file that says what a lab (or an emulated one) is made of.

It names every device (its kind, driver and address: a serial port or a VISA resource), the
chip (topology and calibration file), the GPUs and spares and the switch ports they attach to,
the bus (endpoints, heartbeat, CurveZMQ keys) and the agent's settings. Every command that
takes `--rig FILE` reads it with `load()`, which refuses a bad file with the key, the line and
what was expected;
`dumps()` and `write()` give the text that `parse()` reads back as the same rig.
docs/rigfile.md describes every key.
"""
from __future__ import annotations

import dataclasses
import ipaddress
import os
import pathlib
import re
import tomllib
from typing import Any

from photonic_testbed.common import nesting
from photonic_testbed.common.topology import TopologyError, topology_named
from photonic_testbed.hil import files
from photonic_testbed.hil.agent.config import SETTINGS, AgentConfig, expected
from photonic_testbed.hil.devices.kinds import KINDS
from photonic_testbed.hil.rig.model import (
    PROCESSES,
    AgentGroup,
    BusConfig,
    ChipConfig,
    DeviceConfig,
    GpuConfig,
    Rig,
    RigFileError,
    host_port,
)

GROUP_NAME = re.compile(r"[A-Za-z0-9._-]{1,64}")
ENDPOINT = re.compile(r"^tcp://(\[[0-9a-fA-F:.]+\]|[A-Za-z0-9_.\-*]+):(\d{1,5})$")
NVML_UUID = re.compile(r"^GPU-[0-9a-fA-F]{8}(-[0-9a-fA-F]{4}){3}-[0-9a-fA-F]{12}$")
# A Linux interface name: at most 15 bytes, no slash or blank, not "." or "..".
IFACE = re.compile(r"^(?!\.\.?$)[A-Za-z0-9_.:@-]{1,15}$")


# ---- reading and checking ---------------------------------------------------------------------

def _line_of(text: str, table: str, key: str | None = None, index: int = 0) -> int | None:
    """The line of `key` in `[table]` (or of the table's header), 1-based, when findable."""
    lines = text.splitlines()
    header = re.compile(r"^\s*\[\[?\s*" + re.escape(table).replace(r"\.", r"\s*\.\s*")
                        + r"\s*\]\]?\s*(#.*)?$")
    seen = -1
    start = None
    for i, line in enumerate(lines):
        if header.match(line):
            seen += 1
            if seen == index:
                start = i
                break
    if start is None:
        if key is None:
            return None
        start = -1          # top-level keys
    if key is None:
        return start + 1
    pat = re.compile(r"^\s*" + re.escape(key) + r"\s*=")
    for i in range(start + 1, len(lines)):
        if lines[i].lstrip().startswith("[") and i > start + 0:
            break
        if pat.match(lines[i]):
            return i + 1
    return start + 1 if start >= 0 else None


class _Checker:
    def __init__(self, text: str, where: str):
        self.text = text
        self.where = where

    def fail(self, table: str, key: str | None, expected: str, got=None, index: int = 0):
        line = _line_of(self.text, table, key, index)
        at = f"{self.where}:{line}" if line else self.where
        dotted = f"{table}.{key}" if key and table else (key or table)
        got_text = "" if got is None else f", got {got!r}"
        raise RigFileError(f"{at}: {dotted}: expected {expected}{got_text}")

    def table(self, data: dict, table: str, known: dict, index: int = 0) -> dict:
        """Check a table's keys against `known` (key -> (type, required, description))."""
        if not isinstance(data, dict):
            self.fail(table, None, "a table", data, index)
        for key in data:
            if key not in known:
                self.fail(table, key, f"one of the keys {', '.join(known)}",
                          index=index, got=key)
        out = {}
        for key, (types, required, what) in known.items():
            if key not in data:
                if required:
                    self.fail(table, None, f"a key {key!r} ({what})", index=index)
                continue
            value = data[key]
            types = types if isinstance(types, tuple) else (types,)
            if isinstance(value, bool) and bool not in types or not isinstance(value, types):
                self.fail(table, key, what, value, index)
            out[key] = value
        return out


def _check_endpoint(c: _Checker, table: str, key: str, value: str) -> str:
    m = ENDPOINT.match(value)
    if m is None or not 0 <= int(m.group(2)) <= 65535:
        c.fail(table, key, "an endpoint tcp://HOST:PORT", value)
    return value


def _is_loopback(endpoint: str) -> bool:
    m = ENDPOINT.match(endpoint)
    if m is None:                   # (checked before: not an endpoint is not a loopback one)
        return False
    host = m.group(1).strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def parse(text: str, where: str = "<rig>", base: pathlib.Path | None = None) -> Rig:
    """Parse and check rig TOML text; relative file paths are taken from `base`."""
    try:
        data = nesting.loads_toml(text, where)
    except nesting.NestingError as e:
        raise RigFileError(str(e)) from None
    except tomllib.TOMLDecodeError as e:
        raise RigFileError(f"{where}: not valid TOML: {e}") from None
    c = _Checker(text, where)
    top = c.table(data, "", {
        "rig": (dict, True, "a [rig] table with the rig's name"),
        "bus": (dict, False, "a [bus] table"),
        "devices": (dict, True, "a [devices.NAME] table per device"),
        "chip": (dict, False, "a [chip] table"),
        "gpus": (list, False, "an array of [[gpus]] tables"),
        "monitors": (dict, False, "a [monitors.HOST] table per host that runs a GPU monitor"),
        "replicas": (dict, False, "a [replicas.NAME] table per replica of the agent (a "
                     "group on an etcd journal: docs/control-plane.md)"),
        "groups": (dict, False, "a [groups.NAME] table per agent group (one per failure "
                   "domain: docs/control-plane.md)"),
        "agent": (dict, False, "an [agent] table of the agent's settings"),
    })
    base = base or pathlib.Path.cwd()

    def path(value: str) -> str:
        return str(value) if not value or os.path.isabs(value) else str(base / value)

    rig = c.table(top["rig"], "rig", {"name": (str, True, "the rig's name (a string)"),
                                      "description": (str, False, "a string")})
    b = c.table(top.get("bus", {}), "bus", {
        "host": (str, False, "the host clients reach the services at (a string)"),
        "base_port": (int, False, "a TCP port number 1..65000 (a device takes two)"),
        "bind": (str, False, "the address services bind, e.g. \"*\" (a string)"),
        "curve": (bool, False, "true or false (false only when every endpoint is loopback)"),
        "server_key": (str, False, "the server's secret certificate file"),
        "server_public_key": (str, False, "the server's public certificate file"),
        "authorized_keys": (str, False, "the folder of authorised client certificates"),
        "client_key": (str, False, "this host's client secret certificate file"),
        "heartbeat_s": ((int, float), False, "seconds between heartbeats (> 0)"),
        **{f"{p}_{s}": (str, False, f"the {p} process's {s} endpoint tcp://HOST:PORT")
           for p in PROCESSES for s in ("request", "publish")},
    })
    bus = BusConfig(host=b.get("host", "127.0.0.1"), base_port=b.get("base_port", 5600),
                    bind=b.get("bind", ""), curve=b.get("curve", True),
                    server_key=path(b.get("server_key", "")),
                    server_public_key=path(b.get("server_public_key", "")),
                    authorized_keys=path(b.get("authorized_keys", "")),
                    client_key=path(b.get("client_key", "")),
                    heartbeat_s=float(b.get("heartbeat_s", 0.5)),
                    **{k: b[k] for k in b if k.split("_")[0] in PROCESSES})
    for k in b:
        if k.split("_")[0] in PROCESSES:
            _check_endpoint(c, "bus", k, b[k])
    if not 1 <= bus.base_port <= 65000:
        c.fail("bus", "base_port", "a TCP port number 1..65000", bus.base_port)
    if bus.heartbeat_s <= 0:
        c.fail("bus", "heartbeat_s", "a positive number of seconds", bus.heartbeat_s)

    devices: dict[str, DeviceConfig] = {}
    if not top["devices"]:
        c.fail("devices", None, "at least one [devices.NAME] table")
    for i, (name, d) in enumerate(top["devices"].items()):
        table = f"devices.{name}"
        d = c.table(d, table, {
            "kind": (str, True, f"the device kind, one of {', '.join(sorted(KINDS))}"),
            "address": (str, True, "the device's address (serial port or VISA resource)"),
            "driver": (str, False, "the driver class as 'module:Class'"),
            "request": (str, False, "the request endpoint tcp://HOST:PORT"),
            "publish": (str, False, "the publish endpoint tcp://HOST:PORT"),
            "options": (dict, False, "a table of keyword arguments for the driver"),
            "telemetry_hz": ((int, float), False, "telemetry messages per second (>= 0)"),
            "metrics": (str, False, "where its service serves Prometheus metrics, HOST:PORT"),
        })
        if d["kind"] not in KINDS:
            c.fail(table, "kind", f"one of {', '.join(sorted(KINDS))}", d["kind"])
        if not KINDS[d["kind"]].driver and not d.get("driver"):
            c.fail(table, "driver", f"the driver class ('module:Class') for a {d['kind']}")
        if d.get("driver") and not re.match(r"^[\w.]+:\w+$", d["driver"]):
            c.fail(table, "driver", "'module:Class'", d["driver"])
        if d.get("telemetry_hz", 0) < 0:
            c.fail(table, "telemetry_hz", "a rate >= 0", d["telemetry_hz"])
        if "metrics" in d and host_port(d["metrics"]) is None:
            c.fail(table, "metrics", "HOST:PORT (a port 1..65535)", d["metrics"])
        request = d.get("request") or f"tcp://{bus.host}:{bus.base_port + 2 * i}"
        publish = d.get("publish") or f"tcp://{bus.host}:{bus.base_port + 2 * i + 1}"
        _check_endpoint(c, table, "request", request)
        _check_endpoint(c, table, "publish", publish)
        devices[name] = DeviceConfig(name, d["kind"], d["address"], d.get("driver", ""),
                                     request, publish, d.get("options", {}),
                                     d.get("telemetry_hz"), d.get("metrics", ""))
    used: dict[str, str] = {}

    def claim(table: str, key: str, ep: str) -> None:
        """Every endpoint is used once (`:0`, any free port, is resolved when bound)."""
        if ep.endswith(":0"):
            return
        if ep in used:
            c.fail(table, key, f"an endpoint of its own ({used[ep]} has it)", ep)
        used[ep] = f"{table}.{key}"
    for d in devices.values():
        for key in ("request", "publish"):
            claim(f"devices.{d.name}", key, getattr(d, key))
    for key in b:
        if key.split("_")[0] in PROCESSES:
            claim("bus", key, b[key])

    if bus.curve:
        for key in ("server_key", "server_public_key", "authorized_keys", "client_key"):
            if not getattr(bus, key):
                c.fail("bus", key, "a key file (CURVE is on; `ptb keys` makes them) or "
                       "curve = false for a loopback-only rig")

    chip = None
    if "chip" in top:
        ch = c.table(top["chip"], "chip", {
            "topology": (str, True, "a topology name (e.g. \"benes16\") or a JSON file"),
            "calibration": (str, False, "the calibration file"),
            "heaters": (str, False, "the name of the heater DAC device"),
            "switch": (str, False, "the name of the device that switches the chip"),
        })
        for key in ("heaters", "switch"):
            if ch.get(key) and ch[key] not in devices:
                c.fail("chip", key, f"a device name ({', '.join(devices)})", ch[key])
        topo = ch["topology"]
        if topo.endswith(".json"):
            topo = path(topo)
        else:
            try:
                topology_named(topo)
            except TopologyError as e:
                c.fail("chip", "topology", f"a topology name or a .json file ({e})")
        chip = ChipConfig(topo, path(ch.get("calibration", "")), ch.get("heaters", ""),
                          ch.get("switch", ""))

    gpus: list[GpuConfig] = []
    seen_ports: dict[tuple[str, int], str] = {}
    names: set[str] = set()
    for i, g in enumerate(top.get("gpus", [])):
        g = c.table(g, "gpus", {
            "name": (str, True, "the GPU's name"),
            "switch": (str, True, "the device its link goes through"),
            "port": (int, True, "the switch input port it attaches to (>= 1)"),
            "spare": (bool, False, "true for a spare"),
            "host": (str, False, "the host it sits in"),
            "nvml": ((int, str), False, "the GPU's NVML index (0, 1, ...) or UUID "
                     "(\"GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx\", as `nvidia-smi -L` prints)"),
            "iface": (str, False, "the Linux network interface of its transceiver (e.g. "
                      "\"ens1f0\"), whose DDM `ethtool -m` reads"),
            "lane": (int, False, "the transceiver lane (>= 1) on this port; without it every "
                     "lane's power is summed"),
            "server": (str, False, "the server whose scale-up fabric (NVLink) it shares with "
                       "the server's other GPUs"),
        }, index=i)
        if g["switch"] not in devices:
            c.fail("gpus", "switch", f"a device name ({', '.join(devices)})", g["switch"], i)
        if g["port"] < 1:
            c.fail("gpus", "port", "a port number >= 1", g["port"], i)
        port_key = (g["switch"], g["port"])
        if port_key in seen_ports:
            c.fail("gpus", "port", f"a port no other GPU uses ({seen_ports[port_key]} has it)",
                   g["port"], i)
        if g["name"] in names:
            c.fail("gpus", "name", "a name no other GPU has", g["name"], i)
        if "server" in g and not g["server"]:
            c.fail("gpus", "server", "a server name (not empty)", g["server"], i)
        names.add(g["name"])
        seen_ports[port_key] = g["name"]
        _check_gpu_monitoring(c, g, i, gpus)
        gpus.append(GpuConfig(g["name"], g["switch"], g["port"], g.get("spare", False),
                              g.get("host", ""), g.get("nvml"), g.get("iface", ""),
                              g.get("lane"), g.get("server", "")))
    def process_tables(name: str, who: str) -> dict[str, tuple[str, str]]:
        """Each [NAME.KEY] table of a process's two endpoints (`who` answers requests at
        `request`), their endpoints checked and claimed: KEY -> (request, publish)."""
        out: dict[str, tuple[str, str]] = {}
        for key, t in top.get(name, {}).items():
            table = f"{name}.{key}"
            t = c.table(t, table, {
                "request": (str, True, f"the endpoint tcp://HOST:PORT where {who} answers "
                            "requests"),
                "publish": (str, True, "the endpoint tcp://HOST:PORT where it publishes"),
            })
            for end in ("request", "publish"):
                claim(table, end, _check_endpoint(c, table, end, t[end]))
            out[key] = (t["request"], t["publish"])
        return out
    monitors = process_tables("monitors", "the host's GPU monitor")
    replicas = process_tables("replicas", "this agent replica")
    if monitors:
        for i, g in enumerate(gpus):
            if g.host not in monitors:
                c.fail("gpus", "host", f"one of the hosts of [monitors] "
                       f"({', '.join(monitors)}): every GPU's health comes from its host's "
                       "monitor", g.host or None, i)
        for host in monitors:
            if not any(g.host == host for g in gpus):
                c.fail(f"monitors.{host}", None,
                       f"a host some [[gpus]] sits on (host = {host!r})")
    if not bus.curve:
        remote = [ep for eps in [*[(d.request, d.publish) for d in devices.values()],
                                 *monitors.values(), *replicas.values()]
                  for ep in eps if not _is_loopback(ep)]
        if remote:
            c.fail("bus", "curve", "true: endpoints off loopback need CURVE", remote[0])
    return Rig(rig["name"], None, bus, devices, chip, tuple(gpus), monitors,
               _agent_config(c, top.get("agent", {})), replicas,
               _groups(c, top.get("groups", {}), devices, replicas, gpus))


def _groups(c: _Checker, data: dict, devices: dict[str, DeviceConfig],
            replicas: dict[str, tuple[str, str]], gpus: list[GpuConfig]
            ) -> dict[str, AgentGroup]:
    """The [groups.NAME] tables: each group's `devices` and `replicas`, each device and
    replica in one group at most, every replica and every switch a GPU is cabled to in one."""
    if not isinstance(data, dict):
        c.fail("groups", None, "tables [groups.NAME]", data)
    out: dict[str, AgentGroup] = {}
    owner: dict[tuple[str, str], str] = {}
    for name, t in data.items():
        table = f"groups.{name}"
        if not GROUP_NAME.fullmatch(name):
            c.fail(table, None, "a group name of letters, digits and . _ - (its journal is "
                   "etcd://MEMBERS/NAME)", name)
        t = c.table(t, table, {
            "devices": (list, True, "the names of the devices (switches) whose GPUs this "
                        "group's agent alone manages, its failure domain"),
            "replicas": (list, True, "the names of its agent replicas ([replicas.NAME])")})
        for key, known in (("devices", devices), ("replicas", replicas)):
            if not t[key]:
                c.fail(table, key, f"at least one {key[:-1]}", t[key])
            for item in t[key]:
                if not isinstance(item, str) or item not in known:
                    c.fail(table, key, f"names from [{key}] ({', '.join(known) or 'none'})",
                           item)
                if (key, item) in owner:
                    c.fail(table, key, f"{key} of no other group ({item} is in group "
                           f"{owner[key, item]})", item)
                owner[key, item] = name
        if not any(g.switch in t["devices"] for g in gpus):
            c.fail(table, "devices", "a switch some [[gpus]] are cabled to (a group manages "
                   "GPUs)", t["devices"])
        out[name] = AgentGroup(tuple(t["devices"]), tuple(t["replicas"]))
    if out:
        for name in replicas:
            if ("replicas", name) not in owner:
                c.fail(f"replicas.{name}", None, "a replica of one of the [groups] (a rig "
                       "with agent groups has no replica outside them)")
        for i, g in enumerate(gpus):
            if ("devices", g.switch) not in owner:
                c.fail("gpus", "switch", "a device of one of the [groups] (its GPUs would be "
                       "managed by no agent)", g.switch, i)
    return out


def _agent_config(c: _Checker, data: dict) -> AgentConfig:
    """The [agent] table: each key a setting of `AgentConfig` (those left out keep their
    defaults), its type and value checked where the setting says."""
    types: dict[type, type | tuple[type, ...]] = {bool: bool, int: int, float: (int, float),
                                                  str: str}
    got = c.table(data, "agent", {name: (types[type(f.default)], False, f.metadata["expected"])
                                  for name, f in SETTINGS.items()})
    values: dict[str, Any] = {}
    for key, value in got.items():
        why = expected(key, value)
        if why is not None:
            c.fail("agent", key, why, value)
        values[key] = float(value) if isinstance(SETTINGS[key].default, float) else value
    return AgentConfig(**values)


def _check_gpu_monitoring(c: _Checker, g: dict, i: int, before: list[GpuConfig]) -> None:
    """A [[gpus]] table's `nvml`, `iface` and `lane` keys (what the host's GPU monitor reads):
    well formed, and no two GPUs of one host on the same NVML GPU or transceiver lane."""
    host = g.get("host", "")
    nvml = g.get("nvml")
    if isinstance(nvml, int):
        if nvml < 0:
            c.fail("gpus", "nvml", "an NVML index >= 0 or a UUID", nvml, i)
    elif isinstance(nvml, str):
        if NVML_UUID.match(nvml) is None:
            c.fail("gpus", "nvml", "an NVML index (0, 1, ...) or a GPU UUID "
                   "\"GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx\" (`nvidia-smi -L` lists them)",
                   nvml, i)
        nvml = nvml.lower()
    if nvml is not None:
        for other in before:
            theirs = other.nvml.lower() if isinstance(other.nvml, str) else other.nvml
            same_host = isinstance(nvml, str) or other.host == host
            if theirs == nvml and same_host:
                c.fail("gpus", "nvml", f"an NVML GPU no other rig GPU of host {host or '(any)'} "
                       f"is mapped to ({other.name} has it)", g["nvml"], i)
    iface = g.get("iface")
    if iface is not None and IFACE.match(iface) is None:
        c.fail("gpus", "iface", "a Linux interface name (1..15 characters of letters, digits "
               "and _ . : @ -)", iface, i)
    lane = g.get("lane")
    if lane is not None:
        if iface is None:
            c.fail("gpus", "lane", "an `iface` too: a lane is a lane of that interface's "
                   "transceiver", lane, i)
        if lane < 1:
            c.fail("gpus", "lane", "a lane number >= 1", lane, i)
    if iface is not None:
        for other in before:
            if other.iface == iface and other.host == host and (
                    lane is None or other.lane is None or other.lane == lane):
                c.fail("gpus", "iface", f"a transceiver lane of its own ({other.name} reads "
                       f"{iface}" + (f" lane {other.lane}" if other.lane else "") + ")",
                       iface, i)


def load(path: str | os.PathLike, wait_s: float = 0.0) -> Rig:
    """Read and check a rig file; with `wait_s`, wait that long for it to be written (another
    command may be writing it: hil.files)."""
    try:
        found = files.wait_for(path, wait_s, "rig file")
        text = found.read_text(encoding="utf-8")
    except files.FileNotWritten as e:
        raise RigFileError(str(e)) from None
    except (OSError, UnicodeDecodeError) as e:
        raise RigFileError(f"cannot read the rig file {path}: {e}") from None
    rig = parse(text, str(found), found.parent.resolve())
    return dataclasses.replace(rig, path=found)


def _toml_key(k: str) -> str:
    return k if re.fullmatch(r"[A-Za-z0-9_-]+", k) else _toml_value(k)


def _toml_value(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, dict):
        return "{ " + ", ".join(f"{k} = {_toml_value(x)}" for k, x in v.items()) + " }"
    s = str(v).replace("\\", "\\\\").replace('"', '\\"')
    return f'"{s}"'


def dumps(rig: Rig) -> str:
    """A rig as TOML text that `parse` reads back to the same rig (paths as stored)."""
    out = ["[rig]", f"name = {_toml_value(rig.name)}", "", "[bus]"]
    b = rig.bus
    out.append(f"host = {_toml_value(b.host)}")
    # devices' endpoints are written out; the base port only where a process's is derived from it
    if not all(getattr(b, f"{p}_{side}") for p in PROCESSES for side in ("request", "publish")):
        out.append(f"base_port = {b.base_port}")
    out += [f"curve = {_toml_value(b.curve)}", f"heartbeat_s = {b.heartbeat_s!r}"]
    if b.bind:
        out.append(f"bind = {_toml_value(b.bind)}")
    for p in PROCESSES:
        for side in ("request", "publish"):
            if getattr(b, f"{p}_{side}"):
                out.append(f"{p}_{side} = {_toml_value(getattr(b, f'{p}_{side}'))}")
    for key in ("server_key", "server_public_key", "authorized_keys", "client_key"):
        if getattr(b, key):
            out.append(f"{key} = {_toml_value(getattr(b, key))}")
    for d in rig.devices.values():
        out += ["", f"[devices.{d.name}]", f"kind = {_toml_value(d.kind)}",
                f"address = {_toml_value(d.address)}"]
        if d.driver:
            out.append(f"driver = {_toml_value(d.driver)}")
        out += [f"request = {_toml_value(d.request)}", f"publish = {_toml_value(d.publish)}"]
        if d.options:
            out.append(f"options = {_toml_value(d.options)}")
        if d.telemetry_hz is not None:
            out.append(f"telemetry_hz = {d.telemetry_hz!r}")
        if d.metrics:
            out.append(f"metrics = {_toml_value(d.metrics)}")
    if rig.chip:
        out += ["", "[chip]", f"topology = {_toml_value(rig.chip.topology)}"]
        for key in ("calibration", "heaters", "switch"):
            if getattr(rig.chip, key):
                out.append(f"{key} = {_toml_value(getattr(rig.chip, key))}")
    for g in rig.gpus:
        out += ["", "[[gpus]]", f"name = {_toml_value(g.name)}",
                f"switch = {_toml_value(g.switch)}", f"port = {g.port}",
                f"spare = {_toml_value(g.spare)}"]
        if g.host:
            out.append(f"host = {_toml_value(g.host)}")
        if g.nvml is not None:
            out.append(f"nvml = {_toml_value(g.nvml)}")
        if g.iface:
            out.append(f"iface = {_toml_value(g.iface)}")
        if g.lane is not None:
            out.append(f"lane = {g.lane}")
        if g.server:
            out.append(f"server = {_toml_value(g.server)}")
    for host, (request, publish) in rig.monitors.items():
        out += ["", f"[monitors.{_toml_key(host)}]", f"request = {_toml_value(request)}",
                f"publish = {_toml_value(publish)}"]
    for name, (request, publish) in rig.replicas.items():
        out += ["", f"[replicas.{_toml_key(name)}]", f"request = {_toml_value(request)}",
                f"publish = {_toml_value(publish)}"]
    for name, group in rig.groups.items():
        out += ["", f"[groups.{_toml_key(name)}]",
                f"devices = [{', '.join(map(_toml_value, group.devices))}]",
                f"replicas = [{', '.join(map(_toml_value, group.replicas))}]"]
    default = AgentConfig()
    changed = [f"{name} = {_toml_value(getattr(rig.agent, name))}" for name in SETTINGS
               if getattr(rig.agent, name) != getattr(default, name)]
    if changed:                     # (the settings left at their defaults are not written)
        out += ["", "[agent]", *changed]
    return "\n".join(out) + "\n"


def write(path: str | os.PathLike, rig: Rig) -> None:
    """Write a rig file whole or not at all (hil.files)."""
    files.write_atomic(path, dumps(rig))
