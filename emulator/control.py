"""The emulator's control endpoint: a ZeroMQ REP socket speaking JSON, for tests and demos.

A request is one JSON object `{"cmd": NAME, ...arguments}`; the reply is `{"ok": true,
"result": ...}` or `{"ok": false, "error": "what was wrong"}`. The endpoint is generic: it holds
a dict of named handlers (`handler(request: dict) -> JSON-able result`), and each rig registers
its own (OCS, power meter, laser today; the chip and the GPU rack later). Messages are listed in
docs/control.md. Faults are injected here and ground truth is read here, never through the
instruments' own wires.

Who can reach it: the endpoint can kill processes (`fail_gpu` ends those registered on the GPU)
and move any switch behind the agent's back, so it listens on an `ipc://` socket in a folder of
its own, mode 0700, made when it starts and removed when it closes: only its user (and root)
can connect. A handler that must know who asks (`register_with_peer`) is given the
sender's pid, uid and gid as the kernel reports them for a Unix socket (SO_PEERCRED, which
ZeroMQ hands on as the message's `Peer-Address`), not as the request claims.
"""
from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import pathlib
import stat
import tempfile
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import zmq

from photonic_testbed.common import nesting

# the client side, and the error a handler raises to refuse (re-exported for the emulator's users)
from photonic_testbed.hil.lab.control_client import ControlError, ControlTimeout, request  # noqa: F401

log = logging.getLogger(__name__)

POLL_MS = 100
MAX_REQUEST = 1 << 20
SOCKET_NAME = "control"
UNIX_PATH_MAX = 107          # sun_path holds 108 bytes, the last a NUL


@dataclass(frozen=True)
class Peer:
    """Who sent a request: the sending process, its user and group, as the kernel says."""
    pid: int
    uid: int
    gid: int


def peer_of(frame: zmq.Frame) -> Peer | None:
    """The sender of a received frame on an ipc:// socket (ZeroMQ's `Peer-Address` ends in
    `:uid:gid:pid` there); None where the transport does not say."""
    try:
        address = frame.get("Peer-Address")
    except (zmq.ZMQError, TypeError):
        return None
    parts = str(address).rsplit(":", 3)
    if len(parts) != 4:
        return None
    try:
        uid, gid, pid = (int(p) for p in parts[1:])
    except ValueError:
        return None
    return Peer(pid, uid, gid) if pid > 0 else None


Handler = Callable[[dict], Any]
PeerHandler = Callable[[dict, Peer | None], Any]


class ControlServer:
    """Serves `handlers` on a REP socket at `ipc://FOLDER/control`, FOLDER its own (0700)."""

    def __init__(self, handlers: dict[str, Handler] | None = None):
        self.handlers: dict[str, Handler] = dict(handlers or {})
        self.handlers.setdefault("ping", lambda req: "pong")
        self.handlers.setdefault("help", lambda req: sorted(self.handlers))
        self._with_peer: dict[str, PeerHandler] = {}
        self._ctx: zmq.Context = zmq.Context.instance()
        self._sock: zmq.Socket | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.folder: pathlib.Path | None = None      # from start() to close()
        self.endpoint = ""

    def register(self, name: str, handler: Handler) -> None:
        """Serve `name` with `handler(request)`."""
        self._with_peer.pop(name, None)
        self.handlers[name] = handler

    def register_with_peer(self, name: str, handler: PeerHandler) -> None:
        """Serve `name` with `handler(request, peer)`: the sender as the kernel names it (None
        where it cannot). Called as `handlers[name](request)` it is told of no sender."""
        self._with_peer[name] = handler
        self.handlers[name] = lambda req: handler(req, None)

    def start(self) -> str:
        folder = pathlib.Path(tempfile.mkdtemp(prefix="ptb-control-"))
        self.folder = folder
        try:
            _check_private(folder)
            path = folder / SOCKET_NAME
            if len(os.fsencode(path)) > UNIX_PATH_MAX:
                raise OSError(errno.ENAMETOOLONG, f"the control socket's path {path} is longer "
                              f"than a Unix socket's {UNIX_PATH_MAX} bytes: set TMPDIR to a "
                              "shorter folder")
            sock = self._ctx.socket(zmq.REP)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.MAXMSGSIZE, MAX_REQUEST)
            try:
                sock.bind(f"ipc://{path}")
            except zmq.ZMQError:
                sock.close(linger=0)
                raise
        except BaseException:
            self._remove_folder()
            raise
        self.endpoint = sock.getsockopt(zmq.LAST_ENDPOINT).decode()
        self._sock = sock
        self._thread = threading.Thread(target=self._serve, args=(sock,), name="emulator-control",
                                        daemon=True)
        self._thread.start()
        log.info("control endpoint on %s", self.endpoint)
        return self.endpoint

    @property
    def thread_id(self) -> int | None:
        """The serving thread's id (the kernel's), while it runs."""
        return self._thread.native_id if self._thread is not None else None

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2)
            self._thread = None
        if self._sock is not None:
            self._sock.close(linger=0)
            self._sock = None
        self._remove_folder()

    def _remove_folder(self) -> None:
        """Remove the socket and the folder made for it, and nothing else: a folder that holds
        more than our socket is left (and said)."""
        folder, self.folder = self.folder, None
        if folder is None:
            return
        with contextlib.suppress(FileNotFoundError):
            (folder / SOCKET_NAME).unlink()
        try:
            folder.rmdir()
        except FileNotFoundError:
            pass
        except OSError as e:
            log.warning("control folder %s left in place: %s", folder, e.strerror or e)

    def handle(self, raw: bytes, peer: Peer | None = None) -> dict:
        try:
            req = nesting.loads_json(raw, "the request")
        except nesting.NestingError as e:
            return {"ok": False, "error": str(e)}
        except ValueError as e:                  # (a UnicodeDecodeError is one)
            return {"ok": False, "error": f"request is not JSON: {e}"}
        if not isinstance(req, dict) or not isinstance(req.get("cmd"), str):
            return {"ok": False, "error": 'a request is a JSON object with a "cmd" string'}
        cmd = req["cmd"]
        if cmd not in self.handlers:
            return {"ok": False, "error": f"unknown cmd {cmd!r}; known: "
                                          f"{', '.join(sorted(self.handlers))}"}
        try:
            with_peer = self._with_peer.get(cmd)
            result = with_peer(req, peer) if with_peer is not None else self.handlers[cmd](req)
            return {"ok": True, "result": result}
        except (ControlError, KeyError, ValueError, TypeError) as e:
            msg = str(e) if not isinstance(e, KeyError) else f"missing or unknown {e}"
            log.warning("control %s refused: %s", cmd, msg)
            return {"ok": False, "error": msg}
        except Exception as e:                   # a handler's bug: answered, never fatal
            log.exception("control %s failed", cmd)
            return {"ok": False, "error": f"{cmd} failed: {type(e).__name__}: {e}"}

    def _serve(self, sock: zmq.Socket) -> None:
        while not self._stop.is_set():
            try:
                if not sock.poll(POLL_MS):
                    continue
                frame = sock.recv(copy=False)
            except zmq.ZMQError as e:
                if self._stop.is_set():
                    return
                log.warning("control receive failed: %s", e)
                continue
            reply = self.handle(frame.bytes, peer_of(frame))
            try:
                sock.send(json.dumps(reply, default=str).encode())
            except (zmq.ZMQError, TypeError, ValueError) as e:
                log.error("control reply failed: %s", e)
                sock.send(json.dumps({"ok": False, "error": f"reply failed: {e}"}).encode())


def _check_private(folder: pathlib.Path) -> None:
    """The folder is ours and nobody else's (mkdtemp makes it so; said here, not assumed)."""
    st = folder.stat()
    if st.st_uid != os.getuid() or stat.S_IMODE(st.st_mode) & 0o077:
        raise OSError(errno.EPERM, f"the control folder {folder} is not private to this user "
                      f"(owner uid {st.st_uid}, mode {stat.S_IMODE(st.st_mode):o})")
