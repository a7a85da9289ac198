"""What the agent tells the outside: one object with a method per event, given at construction.

`AgentEvents` is the interface; `NoEvents` does nothing on any event, and a caller subclasses
it and overrides the events it listens to (the agent on the bus: restart orders and alarms; a
test: grants and restarts passed to its job). The agent calls them in the caller's thread,
holding its lock, after the journal holds what they announce.
"""
from __future__ import annotations

from typing import Protocol

from photonic_testbed.hil.agent.entries import Alarm
from photonic_testbed.hil.agent.policies import RankMap


class AgentEvents(Protocol):
    def on_grant(self, phase: str, round: int) -> None:
        """The job may communicate in (phase, round): its circuits are up."""

    def on_restart(self, rank_map: RankMap, cause: str) -> None:
        """The job is to restart on `rank_map` (a swap, or its fabric verified again)."""

    def on_order(self, job: str, rank_map: RankMap, cause: str) -> None:
        """The same restart order, naming the job (several jobs share the rack)."""

    def on_rank_map(self, rank_map: RankMap) -> None:
        """A job's rank map as announced (at admission too)."""

    def on_alarm(self, text: str, about: Alarm) -> None:
        """Something a person has to look at, and what it concerns (as journaled)."""


class NoEvents:
    """Every event ignored: subclass it and override the events to listen to."""

    def on_grant(self, phase: str, round: int) -> None:
        return None

    def on_restart(self, rank_map: RankMap, cause: str) -> None:
        return None

    def on_order(self, job: str, rank_map: RankMap, cause: str) -> None:
        return None

    def on_rank_map(self, rank_map: RankMap) -> None:
        return None

    def on_alarm(self, text: str, about: Alarm) -> None:
        return None
