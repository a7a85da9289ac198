"""A device's state on the bus and its changes: the one vocabulary of every publisher (device
services, the agent, the GPU monitors), every mirror (hil.bus.mirror) and the GUI's model.

A state is a JSON object. A change is a list of operations, applied in order:

    Set(path, value)    the value at `path`; at a list's next index it is appended
    Delete(path)        the object key or list item at `path` removed

`path` is a list of object keys (strings) and list indices (integers) from the root of the
state: `Set(["gpus", "gpu3"], {...})`, `Delete(["events", 0])`. On the wire (a `delta`
message's `ops`, docs/bus.md) an operation is a JSON array, `["set", path, value]` or
`["del", path]`: these Structs are encoded and decoded as exactly that.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

import msgspec

Path = list[str | int]


class Set(msgspec.Struct, array_like=True, tag="set", frozen=True):
    """Set the value at `path` (appended at a list's next index)."""
    path: Path
    value: Any


class Delete(msgspec.Struct, array_like=True, tag="del", frozen=True):
    """Remove the object key or list item at `path`."""
    path: Path


StateOp = Set | Delete
_MISSING = object()


def _same(value: Any) -> Any:
    return value


class StateError(Exception):
    """A change that does not fit the state it is applied to."""


def apply(state: dict, ops: Iterable[StateOp]) -> None:
    """Apply a change to `state` in place (its values are taken as they are: copy them first
    where something else may change them). StateError names an operation whose path is not
    there."""
    for op in ops:
        path = op.path
        if not path:
            raise StateError(f"an operation's path is a non-empty list, not {path!r}")
        target: Any = state
        try:
            for key in path[:-1]:
                target = target[key]
            last = path[-1]
            if type(op) is Set:
                if isinstance(target, list) and last == len(target):
                    target.append(op.value)
                else:
                    target[last] = op.value
            elif type(op) is Delete:
                del target[last]
            else:
                raise StateError(f"a state operation is a Set or a Delete, not {op!r}")
        except (KeyError, IndexError, TypeError) as e:
            raise StateError(f"path {path!r} does not exist in the state ({e!r})") from None


def touched(ops: Iterable[StateOp]) -> set[str | int]:
    """The top-level keys a change touches."""
    return {op.path[0] for op in ops if op.path}


def changes(old: Mapping, new: Mapping,
            copy: Callable[[Any], Any] | None = None) -> list[StateOp]:
    """The operations that set the top-level keys of `new` in `old`, only those whose value
    differs. A list of the same length with few changed items (a heater vector) changes as those
    items alone, and so does an object with few changed members (a chip's cells). Each value
    set goes through `copy` (the owner's state must not share what the caller keeps), when
    given."""
    if copy is None:
        copy = _same
    ops: list[StateOp] = []
    for k, v in new.items():
        was = old.get(k, _MISSING)
        if was == v:
            continue
        if isinstance(was, list) and isinstance(v, list) and len(was) == len(v):
            items = [i for i, (a, b) in enumerate(zip(was, v, strict=True)) if a != b]
            if len(items) * 2 < len(v):
                ops += [Set([k, i], copy(v[i])) for i in items]
                continue
        elif isinstance(was, dict) and isinstance(v, dict) and v and \
                all(type(m) is str for m in v):
            members = [m for m, x in v.items() if was.get(m, _MISSING) != x]
            gone = [m for m in was if m not in v]
            if (len(members) + len(gone)) * 2 < len(v):
                ops += [Set([k, m], copy(v[m])) for m in members]
                ops += [Delete([k, m]) for m in gone]
                continue
        ops.append(Set([k], copy(v)))
    return ops


def wire(op: StateOp) -> list:
    """An operation as JSON has it: `["set", path, value]` or `["del", path]`."""
    return ["set", op.path, op.value] if type(op) is Set else ["del", op.path]
