"""Received optical power of this host's transceivers, from their digital diagnostics (DDM).

Pluggable optics report what their receivers hear: SFP/SFP+ through the SFF-8472 page A2h,
QSFP+/QSFP28 through SFF-8636, QSFP-DD/OSFP through CMIS. Linux decodes all three with
`ethtool -m IFACE` (module EEPROM), which prints one line per receiver lane, for example

    Receiver signal average optical power     : 0.6180 mW / -2.09 dBm          (SFF-8472)
    Rcvr signal avg optical power(Channel 2)  : 0.4420 mW / -3.55 dBm          (SFF-8636)
    Rcvr signal avg optical power (Channel 7) : 0.0000 mW / -inf dBm           (CMIS, dark)

(older ethtool writes no blank before "(Channel"; a module that reports OMA instead of average
power says "Receiver signal OMA"). `parse_ethtool_module` reads those lines, whatever else the
output holds; `run_ethtool` runs the command with a time limit; `DdmReader` reads several
interfaces at once (in threads: one `ethtool -m` of a QSFP takes tens to hundreds of ms of I2C).

A lane that reports 0 mW is dark (`DARK_DBM`). Anything that prevents a reading (no ethtool,
a time-out, no module, a module without diagnostics, output with no power line or a number
that does not parse) is a `DdmError` with what went wrong: never a guessed value.
"""
from __future__ import annotations

import logging
import math
import re
import subprocess
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

log = logging.getLogger(__name__)

DARK_DBM = -99.0                 # what is reported for no light at all (as the emulated rack)
ETHTOOL_TIMEOUT_S = 1.0

_RX_LINE = re.compile(
    r"^\s*(?P<label>Receiver signal average optical power|Rcvr signal avg optical power"
    r"|Receiver signal OMA)\s*(?:\(\s*(?:Channel|Chan|Lane)\s*(?P<lane>\d{1,3})\s*\))?\s*:"
    r"\s*(?P<value>.*?)\s*$", re.IGNORECASE)
_MW = re.compile(r"([-+]?\d+(?:\.\d*)?(?:[eE][-+]?\d+)?)\s*mW\b")
_DBM = re.compile(r"([-+]?(?:\d+(?:\.\d*)?(?:[eE][-+]?\d+)?|inf(?:inity)?|nan))\s*dBm\b",
                  re.IGNORECASE)
_NO_DIAGNOSTICS = re.compile(r"^\s*Optical diagnostics support\s*:\s*No\b",
                             re.IGNORECASE | re.MULTILINE)


class DdmError(Exception):
    """No received power could be read for a transceiver (the message says why)."""


def dbm_of(mw: float) -> float:
    """Power in dBm; no light (<= 0 mW) is DARK_DBM."""
    return 10.0 * math.log10(mw) if mw > 0 else DARK_DBM


@dataclass(frozen=True)
class RxPower:
    """What one transceiver's receivers hear: mW per lane (lane 1 first)."""
    iface: str
    lanes_mw: tuple[float, ...]
    kind: str = "average"        # "average" power, or "oma" (optical modulation amplitude)

    def mw(self, lane: int | None = None) -> float:
        """One lane's power (1-based), or the sum over the lanes (the light on a WDM fibre)."""
        if lane is None:
            return sum(self.lanes_mw)
        if not 1 <= lane <= len(self.lanes_mw):
            raise DdmError(f"{self.iface}: the transceiver reports {len(self.lanes_mw)} "
                           f"receiver lane(s), 1..{len(self.lanes_mw)}; no lane {lane}")
        return self.lanes_mw[lane - 1]

    def dbm(self, lane: int | None = None) -> float:
        return dbm_of(self.mw(lane))


def _lane_mw(iface: str, line: str, value: str) -> float:
    """mW from one power line's value ("0.6180 mW / -2.09 dBm"). The dBm figure is preferred
    when it is finite: it keeps 0.01 dB where the mW figure has only 0.1 uW (-40 dBm)."""
    dbm = _DBM.search(value)
    mw = _MW.search(value)
    if dbm is not None:
        x = float(dbm.group(1))
        if math.isfinite(x):
            if not -80.0 <= x <= 30.0:
                raise DdmError(f"{iface}: received power {x} dBm is not a plausible reading "
                               f"(line {line.strip()!r})")
            return 10 ** (x / 10.0)
        if x == -math.inf:
            return 0.0
    if mw is not None:
        x = float(mw.group(1))
        if not 0.0 <= x <= 1000.0 or not math.isfinite(x):
            raise DdmError(f"{iface}: received power {x} mW is not a plausible reading "
                           f"(line {line.strip()!r})")
        return x
    raise DdmError(f"{iface}: cannot read a power in mW or dBm from ethtool's line "
                   f"{line.strip()!r}")


def parse_ethtool_module(text: str, iface: str = "?") -> RxPower:
    """The received power per lane in `ethtool -m` output (SFF-8472, SFF-8636 or CMIS)."""
    lanes: dict[int, float] = {}
    single: list[float] = []
    kinds = set()
    for line in text.splitlines():
        m = _RX_LINE.match(line)
        if m is None:
            continue
        kinds.add("oma" if "oma" in m.group("label").lower() else "average")
        mw = _lane_mw(iface, line, m.group("value"))
        if m.group("lane") is None:
            single.append(mw)
            continue
        lane = int(m.group("lane"))
        if lane in lanes:
            raise DdmError(f"{iface}: ethtool printed receiver lane {lane} twice")
        lanes[lane] = mw
    if not lanes and not single:
        if _NO_DIAGNOSTICS.search(text):
            raise DdmError(f"{iface}: the transceiver has no optical diagnostics (DDM), so it "
                           "reports no received power")
        first = next((ln.strip() for ln in text.splitlines() if ln.strip()), "")
        raise DdmError(f"{iface}: `ethtool -m` printed no received-power line (\"Receiver "
                       f"signal average optical power\" or \"Rcvr signal avg optical power"
                       f"(Channel n)\")" + (f"; it begins {first[:80]!r}" if first
                                             else "; it printed nothing"))
    if lanes and single:
        raise DdmError(f"{iface}: ethtool printed both per-lane and whole-module received "
                       "power; cannot tell which is which")
    if len(single) > 1:
        raise DdmError(f"{iface}: ethtool printed {len(single)} received-power lines without "
                       "lane numbers")
    if len(kinds) > 1:
        raise DdmError(f"{iface}: the transceiver reports both OMA and average power")
    # lanes as printed, in order (some ethtool builds number channels from 0)
    values = tuple(lanes[k] for k in sorted(lanes)) if lanes else tuple(single)
    return RxPower(iface, values, kinds.pop())


def run_ethtool(iface: str, *, ethtool: str = "ethtool",
                timeout_s: float = ETHTOOL_TIMEOUT_S) -> str:
    """`ethtool -m IFACE`'s output; DdmError when it is missing, fails or takes too long."""
    try:
        done = subprocess.run([ethtool, "-m", iface], capture_output=True, timeout=timeout_s,
                              check=False)
    except FileNotFoundError:
        raise DdmError(f"cannot run {ethtool!r}: not found (install ethtool, e.g. `apt install "
                       "ethtool`, or name it with --ethtool)") from None
    except subprocess.TimeoutExpired:
        raise DdmError(f"`{ethtool} -m {iface}` did not finish within {timeout_s:g} s") \
            from None
    except OSError as e:
        raise DdmError(f"cannot run {ethtool!r}: {e}") from None
    out = done.stdout.decode("utf-8", errors="replace")
    if done.returncode != 0:
        err = done.stderr.decode("utf-8", errors="replace").strip() or out.strip()
        last = err.splitlines()[-1] if err else "no message"
        raise DdmError(f"`{ethtool} -m {iface}` failed (exit {done.returncode}): {last}")
    return out


class DdmReader:
    """Reads transceivers' received power by interface name. `run(iface) -> text` gives the
    `ethtool -m` output (tests pass recorded outputs; the default runs ethtool)."""

    def __init__(self, run: Callable[[str], str] | None = None, *, ethtool: str = "ethtool",
                 timeout_s: float = ETHTOOL_TIMEOUT_S, workers: int = 8):
        self._run = run or (lambda iface: run_ethtool(iface, ethtool=ethtool,
                                                      timeout_s=timeout_s))
        self._pool = ThreadPoolExecutor(max_workers=max(1, workers),
                                        thread_name_prefix="ddm")

    def read(self, iface: str) -> RxPower:
        return parse_ethtool_module(self._run(iface), iface)

    def read_many(self, ifaces: Iterable[str]) -> dict[str, RxPower | DdmError]:
        """Every interface's reading, or the DdmError that stopped it (read in parallel)."""
        ifaces = sorted(set(ifaces))
        futures = {i: self._pool.submit(self.read, i) for i in ifaces}
        out: dict[str, RxPower | DdmError] = {}
        for iface, fut in futures.items():
            try:
                out[iface] = fut.result()
            except DdmError as e:
                out[iface] = e
            except Exception as e:           # a runner's own failure: reported, not raised
                out[iface] = DdmError(f"{iface}: {type(e).__name__}: {e}")
        return out

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
