"""The emulator's control endpoint: a ZeroMQ REP socket speaking JSON, for tests and demos.

A request is one JSON object `{"cmd": NAME, ...arguments}`; the reply is `{"ok": true,
"result": ...}` or `{"ok": false, "error": "what was wrong"}`. The endpoint is generic: it holds
a dict of named handlers (`handler(request: dict) -> JSON-able result`), and each rig registers
its own (OCS, power meter, laser today; the chip and the GPU rack later). Messages are listed in
docs/control.md. Faults are injected here and ground truth is read here, never through the
instruments' own wires.
"""
from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable
from typing import Any

import zmq

# the client side, and the error a handler raises to refuse (re-exported for the emulator's users)
from photonic_testbed.hil.lab.control_client import ControlError, ControlTimeout, request  # noqa: F401

log = logging.getLogger(__name__)

POLL_MS = 100
MAX_REQUEST = 1 << 20


Handler = Callable[[dict], Any]


class ControlServer:
    """Serves `handlers` on a REP socket bound to `bind` (port 0 or `*` = ephemeral)."""

    def __init__(self, handlers: dict[str, Handler] | None = None,
                 bind: str = "tcp://127.0.0.1:0"):
        self.handlers: dict[str, Handler] = dict(handlers or {})
        self.handlers.setdefault("ping", lambda req: "pong")
        self.handlers.setdefault("help", lambda req: sorted(self.handlers))
        self._bind = bind
        self._ctx: zmq.Context = zmq.Context.instance()
        self._sock: zmq.Socket | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.endpoint = ""

    def register(self, name: str, handler: Handler) -> None:
        self.handlers[name] = handler

    def start(self) -> str:
        sock = self._ctx.socket(zmq.REP)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, MAX_REQUEST)
        bind = self._bind
        if bind.endswith(":0"):
            sock.bind(bind[:-2] + ":*")
        else:
            sock.bind(bind)
        self.endpoint = sock.getsockopt(zmq.LAST_ENDPOINT).decode()
        self._sock = sock
        self._thread = threading.Thread(target=self._serve, args=(sock,), name="emulator-control",
                                        daemon=True)
        self._thread.start()
        log.info("control endpoint on %s", self.endpoint)
        return self.endpoint

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2)
            self._thread = None
        if self._sock is not None:
            self._sock.close(linger=0)
            self._sock = None

    def handle(self, raw: bytes) -> dict:
        try:
            req = json.loads(raw)
        except (ValueError, UnicodeDecodeError) as e:
            return {"ok": False, "error": f"request is not JSON: {e}"}
        if not isinstance(req, dict) or not isinstance(req.get("cmd"), str):
            return {"ok": False, "error": 'a request is a JSON object with a "cmd" string'}
        handler = self.handlers.get(req["cmd"])
        if handler is None:
            return {"ok": False, "error": f"unknown cmd {req['cmd']!r}; known: "
                                          f"{', '.join(sorted(self.handlers))}"}
        try:
            return {"ok": True, "result": handler(req)}
        except (ControlError, KeyError, ValueError, TypeError) as e:
            msg = str(e) if not isinstance(e, KeyError) else f"missing or unknown {e}"
            log.warning("control %s refused: %s", req["cmd"], msg)
            return {"ok": False, "error": msg}
        except Exception as e:                   # a handler's bug: answered, never fatal
            log.exception("control %s failed", req["cmd"])
            return {"ok": False, "error": f"{req['cmd']} failed: {type(e).__name__}: {e}"}

    def _serve(self, sock: zmq.Socket) -> None:
        while not self._stop.is_set():
            try:
                if not sock.poll(POLL_MS):
                    continue
                raw = sock.recv()
            except zmq.ZMQError as e:
                if self._stop.is_set():
                    return
                log.warning("control receive failed: %s", e)
                continue
            reply = self.handle(raw)
            try:
                sock.send(json.dumps(reply, default=str).encode())
            except (zmq.ZMQError, TypeError, ValueError) as e:
                log.error("control reply failed: %s", e)
                sock.send(json.dumps({"ok": False, "error": f"reply failed: {e}"}).encode())


