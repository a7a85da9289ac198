"""Where a client reaches a device that the recorder relays or a scripted device plays: a
serial device as a pseudo-terminal published under a link (a path that behaves like
`/dev/serial/by-id/...`), a socket device as a listening TCP socket and its VISA address.

A link is made in a folder the user may name (`--link-dir`), where files of theirs may be: a
link is made only where nothing is, or over a link of ours left by a run that ended without
removing it (it names a pty that is gone), and removed only while it is still the one we made.
"""
from __future__ import annotations

import logging
import os
import pathlib
import socket
import tty
from dataclasses import dataclass

log = logging.getLogger(__name__)

PTY_FOLDER = "/dev/pts/"         # where a pseudo-terminal's name is (Linux)

LISTEN_BACKLOG = 16


class ListenError(Exception):
    """A device's client side could not be set up (the message says which and why)."""


@dataclass(frozen=True)
class SerialLink:
    """A link made to a pseudo-terminal: where, and the pty it names."""
    path: pathlib.Path
    pty: str

    def remove(self) -> None:
        """Remove the link while it still names our pty; whatever else is there now stays."""
        try:
            if os.readlink(self.path) != self.pty:
                log.warning("%s no longer names %s: left in place", self.path, self.pty)
                return
            self.path.unlink()
        except FileNotFoundError:
            pass
        except OSError as e:          # (not a link any more: EINVAL)
            log.warning("%s is no longer our link: left in place (%s)", self.path,
                        e.strerror or e)

    def __str__(self) -> str:
        return str(self.path)


def _clear_for_link(link: pathlib.Path) -> None:
    """Make room for a link at `link`: nothing there, or a stale link of ours (one naming a pty
    that is gone) removed; ListenError for anything else, which is left as it is."""
    if not os.path.lexists(link):
        return
    try:
        target = os.readlink(link)
    except OSError:
        raise ListenError(f"{link} exists and is not a link of ours: not replaced (remove it "
                          "or name another --link-dir)") from None
    if not target.startswith(PTY_FOLDER):
        raise ListenError(f"{link} is a link to {target}, not a pty link of ours: not replaced "
                          "(remove it or name another --link-dir)")
    if os.path.exists(link):
        raise ListenError(f"{link} names the pty {target}, which is open: is another recorder "
                          "or player using it?")
    link.unlink()                     # a run of ours that ended without removing it
    log.info("removed the stale link %s (to %s, gone)", link, target)


def serial_link(link_dir: pathlib.Path, device: str) -> tuple[int, int, SerialLink]:
    """A raw pseudo-terminal (no echo, no newline translation) linked as `link_dir/device`:
    (master fd, slave fd, link). The caller keeps the slave open, so the master never reads
    EIO while no client has the pty open, and closes both fds and removes the link
    (`SerialLink.remove`). ListenError, with nothing made, where a file of someone else's has
    the link's name."""
    link = link_dir / device
    _clear_for_link(link)
    master, slave = os.openpty()
    try:
        tty.setraw(slave)
        pty = os.ttyname(slave)
        try:
            os.symlink(pty, link)     # made whole or not at all, and never over a file
        except FileExistsError:
            raise ListenError(f"{link} appeared while its link was being made: not "
                              "replaced") from None
    except BaseException:
        os.close(master)
        os.close(slave)
        raise
    return master, slave, SerialLink(link, pty)


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
