"""Exports: the events as CSV (readable details and the raw JSON side by side), and any view
as a PNG picture."""
from __future__ import annotations

import csv
import json
import os
import time
from collections.abc import Iterable

from PySide6.QtWidgets import QWidget

from photonic_testbed.gui.events import readable
from photonic_testbed.hil.agent.entries import builtins
from photonic_testbed.hil.agent.journal import Entry

CSV_COLUMNS = ("seq", "time", "unix_time", "kind", "cause", "latency_ms", "details",
               "details_json")


class ExportError(OSError):
    """An export that could not be written; the message names the file and why."""


def events_csv(entries: Iterable[Entry], path: str | os.PathLike) -> int:
    """Write `entries` as CSV to `path`; the number of rows written."""
    n = 0
    try:
        with open(path, "w", newline="", encoding="utf-8") as f:
            w = csv.writer(f)
            w.writerow(CSV_COLUMNS)
            for e in entries:
                stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(e.ts)) + \
                    f"{e.ts % 1:.3f}"[1:]
                w.writerow((e.seq, stamp, f"{e.ts:.6f}", e.kind, e.cause,
                            "" if e.latency_s is None else f"{e.latency_s * 1e3:.3f}",
                            readable(e.details),
                            json.dumps(builtins(e.details), sort_keys=True, default=str)))
                n += 1
    except OSError as err:
        raise ExportError(f"cannot write {os.fspath(path)}: {err.strerror or err}") from None
    return n


def view_png(widget: QWidget, path: str | os.PathLike) -> None:
    """Save what `widget` shows now as a PNG."""
    where = os.fspath(path)
    if not widget.grab().save(where, "PNG"):
        raise ExportError(f"cannot write {where} (is the folder there and writable?)")
