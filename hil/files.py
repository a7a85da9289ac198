"""Files one command writes and another reads: written whole or not at all, and waited for.

A rig file or an endpoints file is written by `ptb emulate` (or `ptb serve`) while the command
that reads it may already be running: three lines pasted into a shell with `&` start together.
The writer puts the text in a temporary file beside the target and renames it into place, so a
reader finds no file or the whole of it, never a part. A reader told to wait for a file that is
not there yet waits for it, bounded, and says once that it waits and for what.
"""
from __future__ import annotations

import contextlib
import logging
import os
import pathlib
import tempfile
import time
from collections.abc import Callable

log = logging.getLogger(__name__)

WAIT_S = 60.0           # how long a command waits for a file another command is to write
POLL_S = 0.05


class FileNotWritten(FileNotFoundError):
    """The file did not appear within the wait."""


def write_atomic(path: str | os.PathLike, text: str) -> None:
    """Write `text` to `path` whole: a temporary file in the same folder, renamed over it."""
    path = pathlib.Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def wait_for(path: str | os.PathLike, wait_s: float, what: str = "file",
             say: Callable[[str], None] | None = None) -> pathlib.Path:
    """`path` once it exists, waiting up to `wait_s` for it (0: not at all); FileNotWritten
    naming what was waited for when it does not appear. `say` (logging by default) is told
    once, when the wait begins."""
    path = pathlib.Path(path)
    if path.exists() or wait_s <= 0:
        return path
    if not path.parent.is_dir():
        raise FileNotWritten(f"no folder {path.parent} for the {what} {path}")
    (say or log.warning)(f"waiting up to {wait_s:g} s for the {what} {path} (another command "
                         "may be writing it)")
    deadline = time.monotonic() + wait_s
    while not path.exists():
        if time.monotonic() > deadline:
            raise FileNotWritten(f"the {what} {path} did not appear within {wait_s:g} s")
        time.sleep(POLL_S)
    return path

