"""The client side of the emulator's control endpoint (docs/control.md): one JSON request on a
fresh ZeroMQ REQ socket, one JSON answer `{"ok": true, "result": ...}` or `{"ok": false,
"error": "..."}`. No retries: a request the emulator may have run is never sent twice.

Here, not in `emulator`, because tools that drive a rig's test bench from the outside (a
job registering its processes, a benchmark failing a GPU) reach the emulator over this wire and
import nothing of it."""
from __future__ import annotations

import json
from typing import Any

import zmq


class ControlError(Exception):
    """The emulator refused a request (its `error` is the message), or never answered it."""


class ControlTimeout(ControlError):
    """No answer in time: the request may or may not have run."""


def request(endpoint: str, msg: dict, timeout_s: float = 5.0) -> Any:
    """Send one request to a control endpoint; the result, or ControlError."""
    ctx: zmq.Context = zmq.Context.instance()
    sock = ctx.socket(zmq.REQ)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, int(timeout_s * 1000))
    sock.setsockopt(zmq.SNDTIMEO, int(timeout_s * 1000))
    try:
        sock.connect(endpoint)
        sock.send(json.dumps(msg).encode())
        try:
            reply = json.loads(sock.recv())
        except zmq.Again:
            raise ControlTimeout(f"no reply from {endpoint} to {msg.get('cmd')!r} within "
                                 f"{timeout_s:g} s") from None
    finally:
        sock.close(linger=0)
    if not reply.get("ok"):
        raise ControlError(reply.get("error", "refused"))
    return reply.get("result")
