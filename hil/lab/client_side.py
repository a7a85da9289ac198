"""Where a client reaches a device that the recorder relays or a scripted device plays: a
serial device as a pseudo-terminal published under a link (a path that behaves like
`/dev/serial/by-id/...`), a socket device as a listening TCP socket and its VISA address."""
from __future__ import annotations

import os
import pathlib
import socket
import tty

LISTEN_BACKLOG = 16


class ListenError(Exception):
    """A device's client side could not be set up (the message says which and why)."""


def serial_link(link_dir: pathlib.Path, device: str) -> tuple[int, int, pathlib.Path]:
    """A raw pseudo-terminal (no echo, no newline translation) linked as `link_dir/device`:
    (master fd, slave fd, link). The caller keeps the slave open, so the master never reads
    EIO while no client has the pty open, and closes both fds and removes the link."""
    master, slave = os.openpty()
    tty.setraw(slave)
    link = link_dir / device
    tmp = link.with_name(device + ".new")
    tmp.unlink(missing_ok=True)
    os.symlink(os.ttyname(slave), tmp)
    os.replace(tmp, link)       # a client never sees the link half made
    return master, slave, link


def listen_tcp(host: str, port: int, device: str) -> tuple[socket.socket, str]:
    """A socket listening on `host`:`port` (0: any free port) for `device`'s clients, and the
    VISA resource they open it by."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    s = socket.socket(family, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        s.bind((host, port))
    except OSError as e:
        s.close()
        raise ListenError(f"cannot listen for {device}'s clients on {host} port {port}: "
                          f"{e.strerror or e}") from None
    s.listen(LISTEN_BACKLOG)
    shown = f"[{host}]" if ":" in host else host
    return s, f"TCPIP::{shown}::{s.getsockname()[1]}::SOCKET"
