"""The emulated rigs: what each is made of (`RigSpec`), and the rig file that points at one.

A spec names the instruments a rig has (heater DAC modules, the chip on them, the OCS, the
power meter, the laser). The named rigs are `RIGS`; a TOML file with an `[emulator]` table
describes another (docs/rigfile.md, "Emulated rigs"). `emulator.rig.EmulatedRig` starts a
spec's instruments on their wires; `for_emulator(spec, endpoints)` is the rig file (a `Rig`)
whose devices are those instruments, chip included, so every command reads it like a lab's.
"""
from __future__ import annotations

import collections
import contextlib
import fcntl
import os
import pathlib
import random
import socket
import stat
import tempfile
import time
import tomllib
from dataclasses import dataclass, fields
from typing import Any

from photonic_testbed.common import nesting
from photonic_testbed.common.rack_layout import (
    CABLINGS,
    LAYOUTS,
    LayoutError,
    RackLayout,
    rail_rack,
)
from photonic_testbed.common.topology import TopologyError, build
from photonic_testbed.hil.rig.model import (
    PROCESSES,
    BusConfig,
    ChipConfig,
    DeviceConfig,
    GpuConfig,
    Rig,
    RigFileError,
)

DAC_MODULE_CHANNELS = 8           # a Q8iv module drives 8 heaters


@dataclass(frozen=True)
class RigSpec:
    name: str
    description: str
    dac_modules: int = 0          # Q8iv modules of 8 channels in the heater DAC chain
    ocs_ports: int = 0            # N of an N x N Polatis-class OCS (0: none)
    meter_channels: int = 0       # ports of the N774x power meter (read OCS egress N+1..)
    laser: bool = False           # an N7776C laser feeding OCS ingress 1
    chip_kind: str = ""           # the photonic chip on the DAC's heaters: benes, clements,
    #                               square, hexagonal ("" = none)
    chip_ports: int = 0           # N ports; nodes per side for square/hexagonal meshes
    # A datacenter rack of rail OCSes (Opus): `servers` servers of `rails` GPUs, one NIC per
    # GPU on its rail; rail l of pod k is served by the `pod` x `pod` OCS rail{l}-pod{k}, each a
    # SCPI endpoint of its own; the last `spare_servers` servers of every pod are spares
    # (common.rack_layout.rail_rack). 0 servers: no such rack.
    servers: int = 0
    rails: int = 8
    pod: int = 0
    spare_servers: int = 0
    # the GPUs of a named rack (lumion, opus) on its switch's ports: "consecutive" (1, 2, ...)
    # or "alternate" (1, 3, ... then 2, 4, ...: common.rack_layout.duplex_rack says why)
    cabling: str = "consecutive"

    @property
    def chip_topology(self) -> str:
        """The chip's topology name ("benes16", "hexagonal4x4"), "" without a chip."""
        return build(self.chip_kind, self.chip_ports).name if self.chip_kind else ""

    def rack_layout(self) -> RackLayout | None:
        """The rack of GPUs on this rig's switches: the rail rack of a datacenter rig, the
        built-in rack of a named rig that has one (lumion, opus), else None."""
        if self.servers:
            return self.rail_layout()
        return LAYOUTS[self.name](self.cabling) if self.name in LAYOUTS else None

    def rail_layout(self) -> RackLayout:
        """The rail rack of a datacenter rig (one with `servers`)."""
        return rail_rack(self.name, self.servers, self.rails, self.spare_servers,
                         self.pod or None, self.description)


RIGS = {
    "lumion": RigSpec("lumion", "16 x 16 Benes chip: 56 heaters on a chain of 7 Q8iv boards "
                      "with monitor photodiodes; laser through a 16 x 16 OCS (input selector) "
                      "into the chip; 16-port power meter on the chip's output taps",
                      dac_modules=7, chip_kind="benes", chip_ports=16, ocs_ports=16,
                      meter_channels=16, laser=True),
    "hexmesh": RigSpec("hexmesh", "recirculating hexagonal mesh of 4 x 4 nodes (18 cells, "
                       "16 edge ports) on a chain of 3 Q8iv boards with monitor photodiodes; "
                       "laser through a 16 x 16 OCS (input selector) into any edge port; "
                       "16-port power meter on the edge ports' taps",
                       dac_modules=3, chip_kind="hexagonal", chip_ports=4, ocs_ports=16,
                       meter_channels=16, laser=True),
    "opus": RigSpec("opus", "32 x 32 OCS, 4-port power meter on egress 33..36, laser into "
                    "ingress 1", ocs_ports=32, meter_channels=4, laser=True),
    "opus2048": RigSpec("opus2048", "2,048 GPUs in 256 servers of 8, one NIC per GPU on its "
                        "rail (8 rails); each rail's ports on 8 OCSes of 32 x 32 (64 OCSes, "
                        "pods of 32 servers), the last server of every pod a spare",
                        servers=256, rails=8, pod=32, spare_servers=1),
}


def rig_spec(name: str) -> RigSpec:
    """A named rig, or a TOML file describing one (docs/rigfile.md, "Emulated rigs")."""
    if name.endswith(".toml") or os.sep in name:
        return rig_spec_from_file(name)
    try:
        return RIGS[name]
    except KeyError:
        raise RigFileError(f"unknown rig {name!r}; known rigs: {', '.join(sorted(RIGS))}, "
                           "or a .toml file") from None


_SPEC_FIELDS: dict[str, type] = {f.name: {"str": str, "int": int, "bool": bool}[str(f.type)]
                                 for f in fields(RigSpec)}


def _read_toml(path: pathlib.Path) -> dict:
    try:
        return nesting.loads_toml(path.read_text(encoding="utf-8"), str(path))
    except nesting.NestingError as e:
        raise RigFileError(str(e)) from None
    except OSError as e:
        raise RigFileError(f"cannot read the rig file {path}: {e.strerror or e}") from None
    except UnicodeDecodeError as e:
        raise RigFileError(f"{path}: not UTF-8 text (byte {e.start})") from None
    except tomllib.TOMLDecodeError as e:
        raise RigFileError(f"{path}: not valid TOML: {e}") from None


def is_emulator_description(path: str | os.PathLike) -> bool:
    """Whether a TOML file describes an emulated rig (an [emulator] table) rather than being a
    rig file; False for a file that cannot be read as TOML (the rig file reader says why)."""
    try:
        return "emulator" in _read_toml(pathlib.Path(path))
    except RigFileError:
        return False


def rig_spec_from_file(path: str | os.PathLike) -> RigSpec:
    """Read an `[emulator]` table: `base = "lumion"` (optional) and any RigSpec field."""
    path = pathlib.Path(path)
    table = _read_toml(path).get("emulator")
    if not isinstance(table, dict):
        raise RigFileError(f"{path}: an emulated rig is described in an [emulator] table")
    spec_fields = {}
    base = table.get("base")
    if base is not None:
        if base not in RIGS:
            raise RigFileError(f"{path}: emulator.base must be one of "
                               f"{', '.join(sorted(RIGS))}, not {base!r}")
        spec_fields = {k: v for k, v in RIGS[base].__dict__.items()
                       if k not in ("name", "description")}
    for key, value in table.items():
        if key == "base":
            continue
        want = _SPEC_FIELDS.get(key)
        if want is None:
            raise RigFileError(f"{path}: emulator.{key} is not a rig field; known: base, "
                               f"{', '.join(_SPEC_FIELDS)}")
        if type(value) is not want:
            raise RigFileError(f"{path}: emulator.{key} must be {want.__name__}, "
                               f"not {type(value).__name__} {value!r}")
        if isinstance(value, int) and want is int and not 0 <= value <= 1024:
            raise RigFileError(f"{path}: emulator.{key} must be in 0..1024, not {value}")
        spec_fields[key] = value
    spec_fields.setdefault("name", path.stem)
    spec_fields.setdefault("description", f"emulated rig from {path.name}")
    spec = RigSpec(**spec_fields)
    if spec.cabling not in CABLINGS:
        raise RigFileError(f"{path}: emulator.cabling is one of {', '.join(CABLINGS)}, not "
                           f"{spec.cabling!r}")
    if spec.servers:
        _check_rails(spec, path)
    if spec.chip_kind:
        try:
            topology = build(spec.chip_kind, spec.chip_ports)
        except TopologyError as e:
            raise RigFileError(f"{path}: emulator.chip_kind and chip_ports: {e}") from None
        heaters = spec.dac_modules * DAC_MODULE_CHANNELS
        if heaters < topology.channels:
            need = -(-topology.channels // DAC_MODULE_CHANNELS)
            raise RigFileError(f"{path}: the chip {topology.name} has {topology.channels} "
                               f"heaters: set emulator.dac_modules to at least {need} (it "
                               f"drives {heaters})")
        if spec.ocs_ports and spec.ocs_ports != topology.ports:
            raise RigFileError(f"{path}: the OCS is the chip's input selector: "
                               f"emulator.ocs_ports must equal the chip's {topology.ports} "
                               "ports")
    return spec


def _check_rails(spec: RigSpec, path: pathlib.Path) -> None:
    """A datacenter rack: rail OCSes only, every pod holding its spares and a worker."""
    if spec.chip_kind or spec.ocs_ports or spec.dac_modules or spec.meter_channels or \
            spec.laser:
        raise RigFileError(f"{path}: a rack of rail OCSes (emulator.servers) has no chip, "
                           "bench OCS, heater DAC, meter or laser: leave those out")
    if spec.rails < 1:
        raise RigFileError(f"{path}: emulator.rails must be at least 1, not {spec.rails}")
    per_pod = spec.pod or spec.servers
    smallest = spec.servers - (-(-spec.servers // per_pod) - 1) * per_pod    # the last pod
    if spec.spare_servers >= smallest:
        raise RigFileError(f"{path}: emulator.spare_servers ({spec.spare_servers}) must leave "
                           f"a working server in every pod (the smallest has {smallest})")
    try:
        spec.rack_layout()
    except LayoutError as e:
        raise RigFileError(f"{path}: {e}") from None


# ---- the rig file of an emulated rig -----------------------------------------------------------

# Endpoint keys that `ptb emulate` reports -> (device name, kind, driver) in the rig file.
EMULATED_DEVICES = {
    "dac": ("heaters", "heater_dac", ""),         # a rig with a chip serves it as `chip`
    "ocs": ("ocs", "switch", "photonic_testbed.drivers.ocs:OpticalCircuitSwitch"),
    "powermeter": ("powermeter", "power_meter", ""),
    "laser": ("laser", "laser", ""),
}


# Where rig-file ports are drawn from: below the range the OS hands out for bind(0) and for
# outgoing connections, so that nothing takes one by chance between the writing of the rig file
# and the service binding it (an emulator reconnecting to an agent not yet up tries a new local
# port every 100 ms).
PORTS_FROM = 10_000


def _ephemeral_start() -> int:
    """The lowest port the OS hands out by itself (Linux says; elsewhere the IANA range)."""
    try:
        text = pathlib.Path("/proc/sys/net/ipv4/ip_local_port_range").read_text()
        return int(text.split()[0])
    except (OSError, ValueError, IndexError):
        return 49152


_GIVEN: collections.deque[int] = collections.deque(maxlen=4096)   # ports handed out lately
# Ports handed out by any process of this user on this machine lately: a file per port, made
# exclusively (the file system arbitrates), taken back once older than HOLD_S (by then its user
# has bound it, or never will)
RESERVED = pathlib.Path(tempfile.gettempdir()) / f"ptb-ports-{os.getuid()}"
HOLD_S = 600.0


def _reserved_folder() -> pathlib.Path | None:
    """RESERVED, made if need be: a folder of this user's alone (not a link, mode 0700), or None
    (ports are then not reserved across processes)."""
    try:
        RESERVED.mkdir(mode=0o700, exist_ok=True)
        st = os.lstat(RESERVED)
    except OSError:
        return None
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
        return None
    return RESERVED


def _reserve(port: int) -> bool:
    """Whether `port` is this process's to hand out: no process of this user was given it in
    the last HOLD_S (see RESERVED: the look, the taking back of a stale file and the making of
    a new one under one lock of the folder); a machine where the folder cannot be used reserves
    nothing."""
    folder = _reserved_folder()
    if folder is None:
        return True
    path = folder / str(port)
    try:
        with open(folder / ".lock", "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                if time.time() - path.stat().st_mtime < HOLD_S:
                    return False
            except FileNotFoundError:
                pass
            path.write_bytes(b"")
            os.utime(path)
            return True
    except OSError:
        return True


def free_ports(count: int, host: str = "127.0.0.1") -> list[int]:
    """`count` different TCP ports free now, for endpoints written into a rig file: drawn at
    random below the OS's ephemeral range (see PORTS_FROM) and each bound while the others are
    sought, so none repeats; from the OS's own choice (bind to port 0) if that range is full.
    None is one this process was given lately, nor (RESERVED) one another process of this user
    was: a port handed out is not bound until its user binds it, and two rigs written at once
    (by two tests, two `ptb emulate`) must not name the same one."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    top = _ephemeral_start()
    draw = random.Random()
    given = set(_GIVEN)
    with contextlib.ExitStack() as stack:
        ports: list[int] = []
        tries = 0
        while len(ports) < count:
            tries += 1
            port = draw.randrange(PORTS_FROM, top) if top > PORTS_FROM + 1000 and \
                tries <= 50 * count else 0
            if port and port in given:
                continue
            s = stack.enter_context(socket.socket(family))
            try:
                s.bind((host, port))
            except OSError:
                continue
            got = s.getsockname()[1]
            if got in given and tries <= 100 * count:
                continue
            if tries <= 100 * count and not _reserve(got):
                continue
            ports.append(got)
        _GIVEN.extend(ports)
        return ports


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port the OS says is free now."""
    return free_ports(1, host)[0]


# The rail OCSes of a datacenter rig: Polatis-class switches, one device each; their port
# power telemetry at 0.2 Hz (64 switches at the services' default 2 Hz would be 128 port
# scans a second for nobody: the agent verifies circuits through the GPUs' receivers).
RAIL_OCS_DRIVER = "photonic_testbed.drivers.ocs:OpticalCircuitSwitch"
RAIL_OCS_TELEMETRY_HZ = 0.2


def _rail_switches(spec: RigSpec, endpoints: dict[str, str]) -> dict[str, str]:
    """{switch: VISA resource} of a datacenter rig's rail OCSes (endpoints keyed by the
    switch's name, as `EmulatedRig` reports them); {} for other rigs."""
    if not spec.servers:
        return {}
    layout = spec.rail_layout()
    missing = [s for s in layout.switches if s not in endpoints]
    if missing:
        raise RigFileError(f"the emulated rig {spec.name} has no endpoint for its rail "
                           f"OCS(es) {', '.join(missing[:4])}{' ...' if len(missing) > 4 else ''}")
    return {s: endpoints[s] for s in layout.switches}


def for_emulator(spec: RigSpec | str, endpoints: dict[str, str], host: str = "127.0.0.1",
                 gpus: tuple[GpuConfig, ...] = ()) -> Rig:
    """A loopback rig (CURVE off) whose devices are the emulated instruments at `endpoints`
    (`spec` a RigSpec, or a name or file `rig_spec` reads). A rig with a chip offers it as one
    `chip` device (the mesh driver owns the heater DAC) and names its topology in [chip];
    `gpus` are the rack's GPUs (emulator's rack layout), with the agent's and the GPU health
    monitor's endpoints on free ports."""
    if not isinstance(spec, RigSpec):
        spec = rig_spec(spec)
    topology = spec.chip_topology
    served = {k: a for k, a in endpoints.items() if k in EMULATED_DEVICES}
    rails = _rail_switches(spec, endpoints)
    ports = iter(free_ports(2 * (len(served) + len(rails) + len(PROCESSES)), host))
    devices = {}
    for key, address in served.items():
        dev, kind, driver = EMULATED_DEVICES[key]
        if key == "dac" and topology:
            dev, kind = "chip", "chip"
        # the meter's port count is the rig's (the driver's default is an N7744A's 4)
        options = {"ports": spec.meter_channels} if kind == "power_meter" else {}
        devices[dev] = DeviceConfig(dev, kind, address, driver, f"tcp://{host}:{next(ports)}",
                                    f"tcp://{host}:{next(ports)}", options=options)
    for name, address in rails.items():
        devices[name] = DeviceConfig(name, "switch", address, RAIL_OCS_DRIVER,
                                     f"tcp://{host}:{next(ports)}", f"tcp://{host}:{next(ports)}",
                                     telemetry_hz=RAIL_OCS_TELEMETRY_HZ)
    if not devices:
        raise RigFileError(f"the emulated rig {spec.name} has no device the bus can serve")
    chip = None
    if topology:
        if "chip" not in devices:
            raise RigFileError(f"the emulated rig {spec.name} has a chip but no heater DAC "
                               "endpoint (dac) to drive it")
        chip = ChipConfig(topology, "", "", "chip")
    procs: dict[str, Any] = {f"{p}_{side}": f"tcp://{host}:{next(ports)}"
                             for p in PROCESSES for side in ("request", "publish")}
    return Rig(spec.name, None, BusConfig(host=host, curve=False, **procs), devices, chip,
               tuple(gpus))
