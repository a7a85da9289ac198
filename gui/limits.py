"""The thresholds of the GUI's alarms (no Qt here: `ptb gui --help` reads the defaults)."""
from __future__ import annotations

from dataclasses import dataclass

from photonic_testbed.common.rack_layout import RECEIVER_SENSITIVITY_DBM


@dataclass(frozen=True)
class Limits:
    report_old_s: float = 5.0      # a running job silent this long is stuck (it reports at 2 Hz)
    failed_s: float = 3.0          # failed or restarting this long is an alarm (a failover
                                   # takes about a second)
    stuck_s: float = 15.0          # ... and this long, stuck
    link_dbm: float = RECEIVER_SENSITIVITY_DBM      # the agent's verification threshold by
                                                    # default (hil.agent.config)
    link_settle_s: float = 1.0     # readings this soon after a circuit change are not judged
