"""What an agent under test says: its grants, restart orders and alarms, kept, and grants and
restarts passed on to the job when there is one."""
from __future__ import annotations

from typing import Any

from photonic_testbed.hil.agent.entries import Alarm
from photonic_testbed.hil.agent.events import NoEvents


class Heard(NoEvents):
    def __init__(self, job: Any = None):
        self.job = job                  # a TrainingJob (or anything with grant and restart)
        self.grants: list[tuple[str, int]] = []
        self.restarts: list[dict[int, str]] = []
        self.alarms: list[str] = []

    def on_grant(self, phase: str, round: int) -> None:
        self.grants.append((phase, round))
        if self.job is not None:
            self.job.grant(phase, round)

    def on_restart(self, rank_map: dict[int, str], cause: str) -> None:
        self.restarts.append(rank_map)
        if self.job is not None:
            self.job.restart(rank_map, cause)

    def on_alarm(self, text: str, about: Alarm) -> None:
        self.alarms.append(text)
