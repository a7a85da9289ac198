"""The bus's errors: one hierarchy, raised by servers and by clients alike.

A server that refuses or fails a request answers an `error` message naming the exception's
class (`StaleState`, `BadRequest`, or a driver's own: `DACTimeout`, `CircuitConflict`...); the
client raises the class of that name from this module, so `except StaleState` catches the same
class on both ends. A name this module does not know (a driver's error) comes back as a
`RemoteError` whose `kind` is that name.

    BusError
     +-- ServiceUnavailable       no answer within the deadline (raised by the client)
     +-- RemoteError              the server answered with an error; .kind, .version
          +-- BadRequest          the request or its arguments are wrong
          |    +-- SchemaError    the frame is not a valid message (also a ValueError)
          |         +-- FrameTooLarge, BadFrame, UnknownVersion, UnknownType,
          |             MissingField, WrongType
          +-- UnknownOperation    the server does not offer this operation
          +-- Unauthorized        the caller's key may not do this (its role, its jobs)
          +-- StaleState          compare-and-set refused: the state moved on
          +-- StaleTerm           a change from an agent whose term is below the highest seen
          +-- DeadlineExceeded    the request waited past its deadline and was not run
          +-- UnencodableResult   the result cannot travel as JSON (NaN, bytes)
"""
from __future__ import annotations


class BusError(Exception):
    """Anything that went wrong on the bus."""


class ServiceUnavailable(BusError):
    """No answer from the service within the deadline (down, restarting, or refusing our key)."""


class Cancelled(ServiceUnavailable):
    """The caller gave up waiting (its client is closing): the request may or may not have
    run, as after a timeout."""


class BadResult(BusError):
    """A server's answer is not of its operation's result type (a server at odds with the
    contract)."""


class RemoteError(BusError):
    """A request refused or failed by its server. `kind` is the name on the wire (this class's
    name, or the server-side exception's when this module has no class of that name), and
    `version` the server's state version when it answered, if it said."""

    def __init__(self, message: str = "", *, kind: str | None = None,
                 version: str | None = None):
        self.kind = kind or type(self).__name__
        self.version = version
        self.remote_message = message
        super().__init__(f"{self.kind}: {message}" if message else self.kind)


class BadRequest(RemoteError):
    """The request cannot be run as sent: its frame, its operation's arguments, or what they
    mean for this device."""


class SchemaError(BadRequest, ValueError):
    """A frame that is not a valid message of this protocol version."""


class FrameTooLarge(SchemaError):
    pass


class BadFrame(SchemaError):
    """Not JSON, not an object, not UTF-8, or not one frame after the envelope."""


class UnknownVersion(SchemaError):
    pass


class UnknownType(SchemaError):
    pass


class MissingField(SchemaError):
    pass


class WrongType(SchemaError):
    pass


class UnknownOperation(RemoteError):
    """The server does not offer this operation."""


class Unauthorized(RemoteError):
    """The caller's key may not do this: its role may not call the operation, or it acts on
    a job that is not its own; or the key is no longer authorised."""


class StaleState(RemoteError):
    """Compare-and-set refused: the state version is not the one the request named."""


class StaleTerm(RemoteError):
    """A change from an agent whose term is lower than the highest the server has seen: an
    agent that no longer leads (a fence)."""


class NotLeader(RemoteError):
    """A standby replica of the agent answered: it does not lead its group (the message names
    the replica that does, if one does); ask the rig's other replicas."""


class DeadlineExceeded(RemoteError):
    """The request's deadline passed while it waited its turn; it was not run."""


class UnencodableResult(RemoteError):
    """The result cannot be sent as JSON (NaN, infinity, bytes)."""


BY_NAME: dict[str, type[RemoteError]] = {
    cls.__name__: cls for cls in (
        RemoteError, BadRequest, SchemaError, FrameTooLarge, BadFrame, UnknownVersion,
        UnknownType, MissingField, WrongType, UnknownOperation, Unauthorized, StaleState,
        StaleTerm, NotLeader, DeadlineExceeded, UnencodableResult)}


def from_wire(kind: str, message: str, version: str | None = None) -> RemoteError:
    """The exception an `error` message stands for."""
    cls = BY_NAME.get(kind, RemoteError)
    return cls(message, kind=kind, version=version)


def to_wire(exc: BaseException) -> tuple[str, str]:
    """(name, message) of an exception for an `error` message: a RemoteError keeps the name
    it came with (a server relaying another's error), anything else its class name."""
    if isinstance(exc, RemoteError):
        return exc.kind, exc.remote_message or exc.kind
    return type(exc).__name__, str(exc) or type(exc).__name__
