"""`common.heap.settle`: what a long-running process built is moved out of the collector's sight,
and garbage in reference cycles is still collected (before the freeze, and at the next settle
for what was frozen). Run in a fresh interpreter: it changes the process's collector."""
from __future__ import annotations

import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent("""
    import gc, weakref
    from photonic_testbed.common import heap

    class Node:
        pass

    def cycle():
        a, b = Node(), Node()
        a.other, b.other = b, a
        return a

    freed = []
    kept = [{"gpu": i, "links": [i, i + 1]} for i in range(50_000)]   # what is served with
    garbage = cycle()
    weakref.finalize(garbage, freed.append, "before")
    del garbage
    gc.disable()                   # nothing collects it but settle
    heap.settle("a test")
    gc.enable()
    assert freed == ["before"], freed                  # collected, not frozen
    assert gc.get_freeze_count() >= len(kept), gc.get_freeze_count()
    assert gc.get_threshold() == heap.THRESHOLD, gc.get_threshold()
    assert all(not gc.is_finalized(x) for x in kept[:3])

    late = cycle()                 # frozen at the next settle, then dropped in a cycle
    weakref.finalize(late, freed.append, "frozen")
    heap.settle()
    del late
    gc.collect()
    assert freed == ["before"], freed                  # out of the collector's sight
    heap.settle()
    assert freed == ["before", "frozen"], freed        # the next settle looks at it again
    print("ok", len(kept))
""")


def test_settle_freezes_what_is_alive_and_collects_what_is_not():
    got = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True,
                         timeout=120)
    assert got.returncode == 0, got.stderr
    assert got.stdout.split() == ["ok", "50000"]
