"""What the operator can ask the fabric to do from the GUI, and the answers.

`Commands` is the interface the bus adapter implements: `submit` sends a request and returns
at once; the answer comes later, from any thread, through the `done` callback. The GUI wraps
it in a `CommandRunner`, which turns answers into a Qt signal on the main thread.

On a rig with an agent, every command is a request to the agent (gui/bus.py): a swap, or a
manual change that the agent journals and makes itself (`manual_circuits`, `manual_heaters`),
since the device services take changes from the agent alone; the key the GUI runs with must be
an operator's (docs/bus.md, "Security").
"""
from __future__ import annotations

import abc
import itertools
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from PySide6.QtCore import QObject, Qt, Signal

log = logging.getLogger(__name__)

ACTIONS = {
    "connect": ("switch", "input", "output"),
    "disconnect": ("switch", "input"),
    "set_heater": ("switch", "channel", "volts"),
    "swap": ("gpu", "spare"),          # spare may be None: the agent picks one
}


class CommandError(ValueError):
    """A command that cannot even be sent (unknown action, missing parameter)."""


_ids = itertools.count(1)


@dataclass(frozen=True)
class Command:
    action: str
    params: dict[str, Any]
    id: int = field(default_factory=lambda: next(_ids))

    def __post_init__(self):
        if self.action not in ACTIONS:
            raise CommandError(f"unknown action {self.action!r}; one of {', '.join(ACTIONS)}")
        missing = [k for k in ACTIONS[self.action] if k not in self.params]
        if missing:
            raise CommandError(f"{self.action} needs {', '.join(missing)}")


@dataclass(frozen=True)
class CommandResult:
    command: Command
    ok: bool
    reason: str = ""                   # why it was refused, or what was done
    details: dict[str, Any] = field(default_factory=dict)


class Commands(abc.ABC):
    """Sends operator commands to the agent (or, on a rig without one, the device services)."""

    @abc.abstractmethod
    def submit(self, command: Command, done: Callable[[CommandResult], None]) -> None:
        """Send `command` without blocking; call `done` exactly once, from any thread."""

    def close(self) -> None:  # noqa: B027 - not abstract: nothing to release by default
        """Release whatever the implementation holds."""


class NoCommands(Commands):
    """Used when no bus is connected: every command is refused, saying so."""

    def __init__(self, reason: str = "not connected to the agent"):
        self.reason = reason

    def submit(self, command: Command, done: Callable[[CommandResult], None]) -> None:
        done(CommandResult(command, False, self.reason))


class CommandRunner(QObject):
    """Main-thread side of `Commands`: `finished` carries each answer to the GUI thread."""

    finished = Signal(object)          # CommandResult
    _answer = Signal(object)

    def __init__(self, backend: Commands, parent: QObject | None = None):
        super().__init__(parent)
        self.backend = backend
        self.pending: dict[int, Command] = {}
        # Queued always: an answer given inside submit() still arrives after it returns.
        self._answer.connect(self._deliver, type=Qt.ConnectionType.QueuedConnection)

    def submit(self, command: Command) -> None:
        self.pending[command.id] = command
        try:
            self.backend.submit(command, self._answer.emit)
        except Exception as e:      # an adapter bug must not take the GUI down
            log.exception("command %s could not be sent", command)
            self._answer.emit(CommandResult(command, False, f"could not be sent: {e}"))

    def _deliver(self, result: CommandResult) -> None:
        if self.pending.pop(result.command.id, None) is None:
            log.warning("answer to an unknown or already answered command %s", result.command)
            return
        self.finished.emit(result)

