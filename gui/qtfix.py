"""Work around PySide6 builds that drop references to None and True (seen with
PySide6-Essentials 6.12.0 on CPython 3.11): every call of a C++ method returning void
(`painter.drawLine`, `widget.update`, ...) lowers None's reference count by one, and every
`signal.emit()` lowers True's. A busy GUI brings one of them to zero within a minute and the
interpreter aborts ("Fatal Python error: none_dealloc" / "bool_dealloc").

From CPython 3.12 these objects are immortal and the bug is harmless. On 3.11 we measure the
drop once and, if it is there, add 2**40 references to None, True and False: at a million such
calls a second that lasts twelve days, and `check()` tops them up again whenever one runs
below half of that.
"""
from __future__ import annotations

import ctypes
import logging
import sys

log = logging.getLogger(__name__)

TOP_UP = 1 << 40
_affected: bool | None = None


def leaks_singletons(calls: int = 200) -> dict[str, int]:
    """How much None's and True's reference counts drop over `calls` void calls and emits."""
    from PySide6.QtCore import QObject, QTimer, Signal

    class _Probe(QObject):
        fired = Signal()

    timer, probe = QTimer(), _Probe()
    none0, true0 = sys.getrefcount(None), sys.getrefcount(True)
    for _ in range(calls):
        timer.setInterval(1)
        probe.fired.emit()
    return {"None": none0 - sys.getrefcount(None), "True": true0 - sys.getrefcount(True)}


def _refcount(obj) -> ctypes.c_ssize_t:
    # ob_refcnt is the first field of every object in a release build of CPython.
    return ctypes.c_ssize_t.from_address(id(obj))


def check() -> None:
    """Measure once; where the bug is present keep the singletons' counts far from zero."""
    global _affected
    if sys.version_info >= (3, 12):
        return
    if _affected is None:
        drops = leaks_singletons()
        _affected = any(d >= 100 for d in drops.values())
        if _affected:
            log.info("this PySide6 drops references to singletons (%s per 200 calls); "
                     "compensating", drops)
    if _affected:
        for obj in (None, True, False):
            count = _refcount(obj)
            if count.value < TOP_UP // 2:
                count.value += TOP_UP


check()
