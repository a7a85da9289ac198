"""How deep a file that a user hands us may nest.

Python's JSON and TOML parsers go down one call per level of nesting, so a file of a few
thousand `[` in a row ends them with a RecursionError: a traceback, not an answer. Every reader
of such a file (a session, an endpoints file, a calibration, a topology, a rig file, a job spec)
reads it through here: text nested deeper than MAX_NESTING levels is refused before it is parsed,
with a NestingError (a ValueError, which the readers already turn into their own one-line error)
naming the file and the line. Files of ours nest a handful of levels; the bound leaves room for
more and stays far below the interpreter's recursion limit, so that what is read can also be
walked, copied or pickled.
"""
from __future__ import annotations

import json
import re
import tomllib
from typing import Any

MAX_NESTING = 64

# What can hold a bracket that does not nest: JSON strings (an unterminated one ends at its
# line's end); TOML's strings of four kinds and its comments. TOML also nests by dotted keys
# (`[a.b.c]`, `a.b.c = 1`), which its parser takes in a time that grows with the square of the
# key's parts: a key's dots are counted too (a float's one dot is a run of its own).
_JSON_TOKENS = re.compile(r'"(?:[^"\\\n]|\\.)*"?|[\[\]{}]')
_TOML_TOKENS = re.compile(r'"""[\s\S]*?(?:"""|\Z)|\'\'\'[\s\S]*?(?:\'\'\'|\Z)'
                          r'|"(?:[^"\\\n]|\\.)*"?|\'[^\'\n]*\'?|#[^\n]*|[\[\]{}.=,\n]')
_OPEN, _CLOSE = frozenset("[{"), frozenset("]}")


class NestingError(ValueError):
    """Text nested deeper than MAX_NESTING levels: not a file of ours."""


def check_json(text: str, where: str, limit: int = MAX_NESTING) -> None:
    """NestingError if JSON `text` nests deeper than `limit` levels."""
    if text.count("[") + text.count("{") <= limit:
        return                      # (the usual file: too few brackets to nest that deep)
    _check(text, where, limit, _JSON_TOKENS)


def check_toml(text: str, where: str, limit: int = MAX_NESTING) -> None:
    """NestingError if TOML `text` nests its arrays and inline tables deeper than `limit`
    levels, or names a dotted key of more than `limit` parts."""
    if text.count("[") + text.count("{") <= limit and text.count(".") <= limit:
        return
    _check(text, where, limit, _TOML_TOKENS)


def _check(text: str, where: str, limit: int, tokens: re.Pattern[str]) -> None:
    depth = dots = 0
    for m in tokens.finditer(text):
        c = m.group()
        if c == ".":
            dots += 1
            if dots < limit:
                continue
        elif c in _OPEN:
            depth += 1
            dots = 0
            if depth <= limit:
                continue
        else:
            if c in _CLOSE:
                depth = max(0, depth - 1)
            if c in _CLOSE or c in "=,\n":
                dots = 0
            continue
        raise _too_deep(_at(text, where, m.start()), limit)


def _at(text: str, where: str, pos: int) -> str:
    """`where`, and the line of `pos` in a text of several lines."""
    return f"{where}:{text.count(chr(10), 0, pos) + 1}" if "\n" in text else where


def _too_deep(at: str, limit: int) -> NestingError:
    return NestingError(f"{at}: nested more than {limit} levels deep (nothing of ours nests "
                        "so deep): refused")


def check_depth(value: Any, where: str, limit: int = MAX_NESTING) -> None:
    """NestingError if a parsed value (dicts and lists) nests deeper than `limit` levels;
    walked without recursion."""
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        children = (item.values() if isinstance(item, dict)
                    else item if isinstance(item, list) else None)
        if children is None:
            continue
        if depth > limit:
            raise _too_deep(where, limit)
        stack.extend((c, depth + 1) for c in children if isinstance(c, (dict, list)))


def loads_json(text: str | bytes, where: str, **options: Any) -> Any:
    """`json.loads(text, **options)` once the text's nesting is checked (bytes are read as
    UTF-8: a UnicodeDecodeError, a ValueError, where they are not)."""
    if isinstance(text, (bytes, bytearray)):
        text = bytes(text).decode("utf-8")
    check_json(text, where)
    return json.loads(text, **options)


def loads_toml(text: str, where: str) -> dict[str, Any]:
    """`tomllib.loads(text)` with its nesting checked before (arrays, inline tables) and after
    (dotted keys and tables); tomllib.TOMLDecodeError or NestingError."""
    check_toml(text, where)
    data = tomllib.loads(text)
    check_depth(data, where)
    return data
