"""Find a bench's devices, ask each what it is, and make a rig file skeleton of them
(`ptb discover`).

Where it looks: the serial ports pyserial lists, the resources pyvisa's resource manager lists
(pyvisa-py backend), the hosts named on the command line (`host[:port]`, SCPI's raw socket port
5025 by default), and the instruments of an emulator's endpoints file. What it asks: `id?` on a
serial port (the heater DAC's dialect: 115200 8N1, `\\n`), `*IDN?` on a socket or a VISA
instrument (explicit `\\n` terminations). Nothing else is ever written to a device, and a
serial port another program holds (its exclusive lock) is left alone. Every probe has its own
timeout; they run in parallel.

What it recognises: a Qontrol-style board id (`Q8iv-0001`) is a `heater_dac`; an `*IDN?` from
Polatis is a `switch` (our OCS driver), a Keysight N774x a `power_meter`, an N777x a `laser`.
The rig file (hil.rig's writer) names them heaters, ocs, powermeter, laser (ocs2, ... for
more), on a loopback bus without CURVE; docs/lab.md says what to edit before the lab uses it.
"""
from __future__ import annotations

import concurrent.futures
import logging
import os
import pathlib
import re
import threading
import time
import warnings
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger(__name__)


class DiscoveryError(ValueError):
    """What to ask, or what was found, cannot make a rig (the message says why)."""

SCPI_PORT = 5025
DEFAULT_TIMEOUT_S = 1.0
MAX_PROBES_AT_ONCE = 16

# A Qontrol-style board id (the qontrol client's own pattern): type with its channel count,
# dash, serial; `*` for a board not yet numbered.
DAC_ID = re.compile(r"^([A-Za-z]+\d+\w*)-([0-9A-Fa-f*]+)$")
DAC_NOTICE = re.compile(r"^E\d\d:\d\d$")       # an error or the power-up notice (E90:00)

# (rule on the *IDN? reply's manufacturer and model, kind, driver)
SCPI_KINDS = (
    (lambda maker, model: "polatis" in maker.lower(), "switch",
     "photonic_testbed.drivers.ocs:OpticalCircuitSwitch"),
    (lambda maker, model: re.match(r"^N774\d", model) is not None, "power_meter", ""),
    (lambda maker, model: re.match(r"^N777\d", model) is not None, "laser", ""),
)
# The ports of Keysight's N774x meters, by model (what the driver's `ports` option must say; it
# defaults to an N7744A's 4): known from the *IDN? reply, so nothing more is asked.
METER_PORTS = {"N7744A": 4, "N7745A": 8, "N7747A": 2, "N7748A": 4}
DEVICE_NAMES = {"heater_dac": "heaters", "switch": "ocs", "power_meter": "powermeter",
                "laser": "laser"}


@dataclass
class Probe:
    """One address asked what it is, and what came of it."""
    via: str                   # "serial", "visa" or "tcp"
    address: str               # as a rig file holds it (a port's path or a VISA resource)
    status: str = ""           # found, silent, unknown, in use, error
    answer: str = ""
    kind: str = ""
    driver: str = ""
    detail: str = ""
    options: dict = field(default_factory=dict)     # the driver's, as far as the answer says

    def line(self) -> str:
        asked = "id?" if self.via == "serial" else "*IDN?"
        if self.status == "found":
            what = f"{asked} -> {self.answer}"
            if "ports" in self.options:
                what += f" ({self.options['ports']} ports, by its model)"
        elif self.status == "unknown":
            what = f"{asked} -> {self.answer!r}: not a device this stack drives"
        else:
            what = self.detail
        return f"  {self.status:<8} {self.kind or '-':<12} {self.address:<40} {what}"


# ---- what to ask ---------------------------------------------------------------------------------

def _by_id_links() -> dict[str, str]:
    """/dev/ttyACM0 -> /dev/serial/by-id/usb-...: the names that survive a replug."""
    out: dict[str, str] = {}
    folder = pathlib.Path("/dev/serial/by-id")
    if folder.is_dir():
        for link in sorted(folder.iterdir()):
            out.setdefault(os.path.realpath(link), str(link))
    return out


def listed_serial_ports() -> list[str]:
    from serial.tools import list_ports
    stable = _by_id_links()
    return [stable.get(os.path.realpath(p.device), p.device) for p in list_ports.comports()]


def listed_visa_resources(rm) -> tuple[list[str], list[str]]:
    """The VISA resources the backend lists: (serial ports among them, the others)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            resources = list(rm.list_resources("?*::INSTR"))
        except Exception as e:          # a backend's listing fails in its own ways
            log.warning("VISA resources not listed: %s", e)
            resources = []
    for w in caught:
        log.info("VISA listing: %s", w.message)
    serial, other = [], []
    for r in resources:
        m = re.match(r"^ASRL(.+)::INSTR$", r, re.I)
        if m and m.group(1).startswith("/"):
            serial.append(m.group(1))
        elif not m:
            other.append(r)
    return serial, other


def host_resource(text: str) -> str:
    """`host[:port]` (IPv6 in brackets) -> the VISA raw socket resource."""
    m = re.fullmatch(r"(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9_.\-]+)(?::(\d{1,5}))?", text.strip())
    if m is None:
        raise DiscoveryError(f"{text!r} is not a host: give HOST or HOST:PORT (port "
                             f"{SCPI_PORT} by default)")
    port = int(m.group(2) or SCPI_PORT)
    if not 1 <= port <= 65535:
        raise DiscoveryError(f"{text!r}: port {port} is not in 1..65535")
    return f"TCPIP::{m.group(1).strip('[]')}::{port}::SOCKET"


def endpoint_addresses(path: str) -> tuple[list[str], list[str]]:
    """An emulator's endpoints file: (its serial link, its instruments' socket resources)."""
    from photonic_testbed.hil import files
    from photonic_testbed.hil.lab.session import (
        ENDPOINT_DEVICES,
        SessionError,
        parse_address,
        read_endpoints,
    )
    try:
        endpoints = read_endpoints(path, wait_s=files.WAIT_S)
        wires = [parse_address(a, SCPI_PORT) for k, a in endpoints.items()
                 if k in ENDPOINT_DEVICES]
    except SessionError as e:
        raise DiscoveryError(str(e)) from None
    return ([w.address for w in wires if w.kind == "serial"],
            [w.address for w in wires if w.kind == "tcp"])


# ---- asking --------------------------------------------------------------------------------------

def probe_serial(path: str, timeout_s: float) -> Probe:
    """Open the port (115200 8N1, exclusively), write `id?\\n`, read lines until a board id."""
    import serial
    probe = Probe("serial", path)
    try:
        port = serial.Serial(path, 115200, bytesize=8, parity="N", stopbits=1,
                             timeout=min(0.1, timeout_s), write_timeout=timeout_s,
                             exclusive=True)
    except (serial.SerialException, OSError) as e:
        text = str(e)
        if "exclusively lock" in text:
            probe.status, probe.detail = "in use", "another program holds it (its lock)"
        elif "ermission denied" in text:
            probe.status, probe.detail = "error", ("permission denied: join the dialout "
                                                   "group (docs/lab.md)")
        else:
            probe.status, probe.detail = "error", f"cannot open it: {text}"
        return probe
    try:
        port.reset_input_buffer()
        port.write(b"id?\n")
        other: list[str] = []
        deadline = time.monotonic() + timeout_s
        pending = b""
        while time.monotonic() < deadline:
            pending += port.read(256)
            *lines, pending = pending.split(b"\n")
            for raw in lines:
                line = raw.decode("ascii", "replace").strip()
                if DAC_ID.match(line):
                    probe.status, probe.answer, probe.kind = "found", line, "heater_dac"
                    return probe
                if line and not DAC_NOTICE.match(line):
                    other.append(line)
        if other or pending.strip():
            probe.status, probe.answer = "unknown", (other or [pending.decode("ascii",
                                                                              "replace")])[0]
        else:
            probe.status = "silent"
            probe.detail = f"no answer to id? within {timeout_s:g} s"
    except (serial.SerialException, OSError) as e:
        probe.status, probe.detail = "error", f"{type(e).__name__}: {e}"
    finally:
        port.close()
    return probe


def probe_scpi(resource: str, via: str, timeout_s: float) -> Probe:
    """Open a VISA session (explicit `\\n` terminations), ask `*IDN?`, read one line."""
    import pyvisa
    probe = Probe(via, resource)
    ms = max(1, int(timeout_s * 1000))
    inst: Any
    try:
        rm = pyvisa.ResourceManager("@py")
        inst = rm.open_resource(resource, read_termination="\n", write_termination="\n",
                                timeout=ms, open_timeout=ms)
    except Exception as e:              # pyvisa-py raises plain Exceptions on refused sockets
        probe.status = "error"
        probe.detail = f"cannot open it: {_short(e)}"
        return probe
    got: dict[str, Any] = {}

    def ask() -> None:
        try:
            got["answer"] = inst.query("*IDN?").strip()
        except Exception as e:          # VisaIOError on a timeout, OSError on a reset
            got["error"] = e

    # one deadline for the whole query: a device that keeps talking without a line end
    # restarts pyvisa's per-read timeout for ever
    asker = threading.Thread(target=ask, daemon=True, name=f"probe {resource}")
    asker.start()
    asker.join(timeout_s + 0.5)
    try:
        if asker.is_alive():
            probe.status = "unknown"
            probe.detail = f"it talks, but sent no line within {timeout_s:g} s of *IDN?"
            return probe
        failed = got.get("error")
        if isinstance(failed, UnicodeDecodeError):
            probe.status, probe.detail = "unknown", "it answered *IDN? with bytes that are not text"
            return probe
        if failed is not None:
            if "refused" in str(failed).lower():
                probe.status, probe.detail = "error", "connection refused: nothing listens there"
            else:
                probe.status = "silent"
                probe.detail = f"no answer to *IDN? within {timeout_s:g} s ({_short(failed)})"
            return probe
        answer = got["answer"]
    finally:
        try:
            inst.close()                # (also ends a read still going on)
        except Exception:
            pass
    probe.answer = answer
    fields = [f.strip() for f in answer.split(",")]
    maker, model = (fields + ["", ""])[:2]
    for rule, kind, driver in SCPI_KINDS:
        if rule(maker, model):
            probe.status, probe.kind, probe.driver = "found", kind, driver
            if kind == "power_meter" and model.upper() in METER_PORTS:
                probe.options = {"ports": METER_PORTS[model.upper()]}
            return probe
    probe.status = "unknown"
    return probe


def _short(e: Exception) -> str:
    text = str(e).strip().splitlines()
    return (text[-1] if text else type(e).__name__)[:160]


def discover(*, serial_ports: list[str] | tuple[str, ...] = (),
             resources: list[str] | tuple[str, ...] = (),
             timeout_s: float = DEFAULT_TIMEOUT_S) -> list[Probe]:
    """Probe every serial port (`id?`) and VISA resource (`*IDN?`) given, in parallel; the
    probes in the order given (serial ports first)."""
    jobs = [("serial", p) for p in dict.fromkeys(serial_ports)]
    jobs += [("tcp" if r.upper().endswith("::SOCKET") else "visa", r)
             for r in dict.fromkeys(resources)]
    if not jobs:
        return []
    with concurrent.futures.ThreadPoolExecutor(min(MAX_PROBES_AT_ONCE, len(jobs))) as pool:
        futures = [pool.submit(probe_serial, a, timeout_s) if via == "serial"
                   else pool.submit(probe_scpi, a, via, timeout_s) for via, a in jobs]
        return [f.result() for f in futures]


# ---- the rig file --------------------------------------------------------------------------------

def skeleton(probes: list[Probe], name: str, chip: str = "", base_port: int | None = None):
    """A Rig of the devices found: loopback bus, CURVE off; with `chip` (a topology name) the
    first heater DAC is offered as the chip (the mesh driver owns the board), as an emulated
    rig's file does. Ports: BASE, BASE+1, ... in device order, or free ones when no base."""
    from photonic_testbed.hil import rig as rigfile
    found = [p for p in probes if p.status == "found"]
    if not found:
        raise DiscoveryError("no device answered: nothing to write (see the list above)")
    host = "127.0.0.1"
    count: dict[str, int] = {}
    named = []
    for p in found:
        kind = p.kind
        if chip and kind == "heater_dac" and "chip" not in count:
            count["chip"] = 1
            named.append(("chip", "chip", p))
            continue
        count[kind] = count.get(kind, 0) + 1
        base = DEVICE_NAMES[kind]
        named.append((base if count[kind] == 1 else f"{base}{count[kind]}", kind, p))
    slots = 2 * (len(named) + len(rigfile.PROCESSES))
    ports = (list(range(base_port, base_port + slots)) if base_port is not None
             else rigfile.free_ports(slots, host))
    devices = {}
    for k, (dev, kind, p) in enumerate(named):
        devices[dev] = rigfile.DeviceConfig(dev, kind, p.address, p.driver,
                                            f"tcp://{host}:{ports[2 * k]}",
                                            f"tcp://{host}:{ports[2 * k + 1]}",
                                            options=dict(p.options))
    first = 2 * len(named)
    proc = [f"tcp://{host}:{port}" for port in ports[first:]]      # agent, then gpus
    bus = rigfile.BusConfig(host=host, base_port=base_port or 5600, curve=False,
                            agent_request=proc[0], agent_publish=proc[1],
                            gpus_request=proc[2], gpus_publish=proc[3])
    topology = rigfile.ChipConfig(chip, "", "", "chip") if "chip" in devices else None
    return rigfile.Rig(name, None, bus, devices, topology)
