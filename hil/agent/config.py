"""The agent's settings: one frozen value, each setting's default, meaning and check in one
place. The rig file's `[agent]` table (`hil.rig.file`) and `ptb agent`'s flags build it (flags
override the file); `Agent` and `AgentProcess` take it whole."""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from photonic_testbed.common.rack_layout import RECEIVER_SENSITIVITY_DBM
from photonic_testbed.hil.agent import gray

ALLOCATIONS = ("best-fit", "first-fit")


class AgentConfigError(ValueError):
    """A setting of the agent has a value it cannot take; the message names it."""


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _count(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def _setting(default: Any, flag: str, what: str, expected: str,
             ok: Callable[[Any], bool]) -> Any:
    """A setting: its default, its `ptb agent` flag, what it means (for help) and what a good
    value is (for errors), and the check of a value."""
    return dataclasses.field(default=default, metadata={
        "flag": flag, "what": what, "expected": expected, "ok": ok})


@dataclass(frozen=True)
class AgentConfig:
    verify_dbm: float = _setting(
        RECEIVER_SENSITIVITY_DBM, "--verify-dbm",
        "a circuit is verified when its output reads at least this many dBm",
        "a power in dBm (a finite number)", _number)
    quarantine_s: float = _setting(
        60.0, "--quarantine", "seconds a failed GPU stays out of the spares",
        "a number of seconds >= 0", lambda v: _number(v) and v >= 0)
    prestage: bool = _setting(
        False, "--prestage", "hand the next phase's circuits to switches that can stage them",
        "true or false", lambda v: isinstance(v, bool))
    verify_phases: bool = _setting(
        False, "--verify-phases", "verify every phase's circuits by light before its grant",
        "true or false", lambda v: isinstance(v, bool))
    allocation: str = _setting(
        "best-fit", "--allocation", "how a new job's servers are chosen",
        f"one of {', '.join(ALLOCATIONS)}", lambda v: v in ALLOCATIONS)
    diagnosed_per_incident: int = _setting(
        2, "--diagnosed-per-incident",
        "GPUs evicted on the fabric's evidence alone per incident, at most",
        "a count >= 0", _count)
    diagnosed_per_window: int = _setting(
        4, "--diagnosed-per-window",
        "GPUs evicted on the fabric's evidence alone within the eviction window, at most",
        "a count >= 0", _count)
    eviction_window_s: float = _setting(
        600.0, "--eviction-window", "seconds over which diagnosed evictions are counted",
        "a number of seconds > 0", lambda v: _number(v) and v > 0)

    lease_s: int = _setting(
        2, "--lease", "seconds of the etcd lease a replica of an agent group leads under: a "
        "dead leader's successor takes over this long after its last refresh",
        "a whole number of seconds 1..60 (etcd grants at least 2 with its default election "
        "timeout)", lambda v: isinstance(v, int) and not isinstance(v, bool) and 1 <= v <= 60)
    etcd_timeout_s: float = _setting(
        2.0, "--etcd-timeout", "seconds a request to etcd may take, every member tried",
        "a number of seconds > 0", lambda v: _number(v) and v > 0)
    work_ahead: bool = _setting(
        True, "--work-ahead", "a standby replica works its jobs' circuits out from the journal "
        "it follows as it changes, not once it takes the lead",
        "true or false", lambda v: isinstance(v, bool))
    gray_swaps: bool = _setting(
        True, "--gray-swaps", "swap a GPU found slow for a spare at the job's next step "
        "boundary, once the slowness has cost what the swap costs (hil/agent/gray.py)",
        "true or false", lambda v: isinstance(v, bool))
    gray_above: int = _setting(
        gray.ABOVE, "--gray-above", "of the last 24 steps, in how many a GPU waited less than "
        "the job's median makes it a suspect (a healthy GPU: about half)",
        "a whole number 13..24", lambda v: _count(v) and 13 <= v <= 24)
    gray_swap_cost_s: float = _setting(
        0.2, "--gray-swap-cost", "seconds a planned swap is taken to cost the job until one "
        "is measured", "a number of seconds >= 0", lambda v: _number(v) and v >= 0)
    metrics_port: int = _setting(
        0, "--metrics-port", "serve the agent's Prometheus metrics on this TCP port "
        "(hil/agent/metrics.py; 0: none)", "a port 0..65535",
        lambda v: isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= 65535)
    metrics_host: str = _setting(
        "127.0.0.1", "--metrics-host", "the address the metrics are served on",
        "an IP address or host name", lambda v: isinstance(v, str) and 0 < len(v) <= 255)
    link_moves: bool = _setting(
        True, "--link-moves", "move a circuit whose light fades or flaps to other cells of "
        "its chip, with no rank changed (hil/agent/linkwatch.py)",
        "true or false", lambda v: isinstance(v, bool))

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if not f.metadata["ok"](value):
                raise AgentConfigError(f"{f.name}: expected {f.metadata['expected']}, "
                                       f"got {value!r}")


SETTINGS: dict[str, dataclasses.Field[Any]] = {f.name: f for f in dataclasses.fields(AgentConfig)}


def expected(name: str, value: Any) -> str | None:
    """What setting `name` expects, when `value` is not that; None when it is."""
    f = SETTINGS[name]
    return None if f.metadata["ok"](value) else f.metadata["expected"]
