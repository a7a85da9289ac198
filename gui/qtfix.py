"""Work around PySide6 builds that drop a reference to None on every call of a C++ method
returning void (seen with PySide6-Essentials 6.12.0 on CPython 3.11: each `painter.drawLine`,
`widget.update`, `timer.start` lowers None's reference count by one, and a busy GUI reaches
zero within a minute: "Fatal Python error: none_dealloc").

From CPython 3.12 None is immortal and the bug is harmless. On 3.11 we measure the drop once
and, if it is there, add 2**40 references to None: at a million such calls a second that lasts
twelve days, and `check()` tops it up again whenever it runs below half of that.
"""
from __future__ import annotations

import ctypes
import logging
import sys

log = logging.getLogger(__name__)

TOP_UP = 1 << 40
_affected: bool | None = None


def leaks_none(calls: int = 200) -> bool:
    """True when a void PySide6 call lowers None's reference count (the bug is present)."""
    from PySide6.QtCore import QTimer
    timer = QTimer()
    before = sys.getrefcount(None)
    for _ in range(calls):
        timer.setInterval(1)
    return sys.getrefcount(None) - before <= -calls // 2


def _refcount() -> ctypes.c_ssize_t:
    # ob_refcnt is the first field of every object in a release build of CPython.
    return ctypes.c_ssize_t.from_address(id(None))


def check() -> None:
    """Measure once; where the bug is present keep None's reference count far from zero."""
    global _affected
    if sys.version_info >= (3, 12):
        return
    if _affected is None:
        _affected = leaks_none()
        if _affected:
            log.warning("this PySide6 drops references to None on void calls; compensating")
    if _affected:
        count = _refcount()
        if count.value < TOP_UP // 2:
            count.value += TOP_UP


check()
