"""A pyvisa-like resource that checks every line a driver writes against a script, in the
manner of PyMeasure's `expected_protocol`: each step is (line the driver must send, reply or
None). A reply may be `DROP` (the read fails as a reset connection would)."""
from __future__ import annotations

import contextlib

DROP = object()


class ScriptedResource:
    def __init__(self, script: list[tuple[str, object]]):
        self.script = list(script)
        self.timeout = 2000
        self.closed = False
        self._replies: list[object] = []

    def write(self, line: str) -> int:
        assert not self.closed, f"write {line!r} on a closed session"
        assert self.script, f"unexpected write {line!r} (script finished)"
        sent, reply = self.script.pop(0)
        assert line == sent, f"driver sent {line!r}, the script expects {sent!r}"
        if reply is not None:
            self._replies.append(reply)
        return len(line) + 1

    def read(self) -> str:
        assert self._replies, "driver reads but nothing is due"
        reply = self._replies.pop(0)
        if reply is DROP:
            raise ConnectionResetError(104, "Connection reset by peer")
        return f"{reply}\r"          # read_termination "\n" leaves the instrument's "\r"

    def close(self) -> None:
        self.closed = True


@contextlib.contextmanager
def expected_protocol(cls, *sessions: list[tuple[str, object]], **kwargs):
    """Build `cls` on scripted sessions (one per (re)open) and check every script ran out."""
    resources = [ScriptedResource(s) for s in sessions]
    opened = []

    def opener(name, timeout_s):
        assert len(opened) < len(resources), "driver opened more sessions than scripted"
        opened.append(resources[len(opened)])
        return opened[-1]

    inst = cls("TCPIP::127.0.0.1::5025::SOCKET", opener=opener, **kwargs)
    yield inst
    for i, r in enumerate(resources):
        assert not r.script, f"session {i}: the driver did not send {r.script[0][0]!r}"
