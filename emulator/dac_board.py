"""The heater DAC board, emulated: the real firmware core behind a pseudo-terminal.

A client opens the pty's slave path with pyserial exactly as it opens a USB serial adapter.
Like a udev `/dev/serial/by-id/...` name, the path we publish is a symlink that survives an
unplug: `unplug()` closes the pty (the client's reads and writes fail), `replug()` makes a new
one and points the symlink at it, optionally after a power cycle that resets every output.
"""
from __future__ import annotations

import logging
import os
import pathlib
import select
import threading
import time
import tty
from collections.abc import Callable

import numpy as np

from photonic_testbed.firmware.core import Board, make_chain
from photonic_testbed.firmware.hal_emulated import EmulatedHAL

log = logging.getLogger(__name__)

TICK_S = 0.002             # firmware main-loop period (watchdog and ramp resolution)
IDLE_S = 0.05              # the loop's wait when the firmware has nothing timed to do
MAX_PENDING = 1 << 16      # reply bytes held for a client that does not read


def heater_resistances(n: int, seed: int) -> list[float]:
    """Hidden truth: each heater's resistance, ~1 kOhm +/- 5 %."""
    rng = np.random.default_rng([seed, 0xDAC])
    return [float(r) for r in rng.uniform(950.0, 1050.0, n)]


def _clock_ms() -> int:
    return int(time.monotonic() * 1000) & ((1 << 30) - 1)


class EmulatedDACBoard:
    """A daisy chain of `modules` Qontrol-compatible boards on one serial line."""

    def __init__(self, link: str | os.PathLike, *, modules: int = 7, kind: str = "Q8iv",
                 channels_per_module: int = 8, seed: int = 0,
                 resistances: list[float] | None = None,
                 on_output: Callable[[int, float], None] | None = None,
                 photocurrent: Callable[[int], float] | None = None):
        self.link = pathlib.Path(link)
        chain = make_chain(kind, [seed * 0x100 + k + 1 for k in range(modules)],
                           channels_per_module)
        n = modules * channels_per_module
        self.resistances = resistances if resistances is not None else heater_resistances(n, seed)
        self.hal = EmulatedHAL([m.vfull for m in chain for _ in range(m.n)],
                               [m.ifull for m in chain for _ in range(m.n)],
                               self.resistances, _clock_ms, on_output, photocurrent)
        self.board = Board(self.hal, chain)
        self._lock = threading.Lock()
        self._master: int | None = None
        self._slave: int | None = None
        self._pending = bytearray()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.bytes_in = 0
        self.bytes_out = 0

    # ---- lifecycle -----------------------------------------------------------------------

    def start(self) -> str:
        """Power the board up and plug it in; returns the path clients open."""
        self._pending += self.board.power_up()
        self._plug()
        self._thread = threading.Thread(target=self._serve, name="dac-board", daemon=True)
        self._thread.start()
        return str(self.link)

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2)
        with self._lock:
            self._unplug_locked()
        self.link.unlink(missing_ok=True)

    def unplug(self) -> None:
        """The USB cable is pulled: the pty goes away and clients' I/O fails."""
        with self._lock:
            self._unplug_locked()
        log.info("dac board unplugged")

    def replug(self, power_cycle: bool = False) -> str:
        """The cable comes back (a new pty behind the same path); optionally after a reset."""
        with self._lock:
            self._unplug_locked()
            if power_cycle:
                self.board = Board(self.hal, self.board.modules)
                self._pending = bytearray(self.board.power_up())
            self._plug_locked()
        log.info("dac board replugged%s", " after a power cycle" if power_cycle else "")
        return str(self.link)

    @property
    def pty(self) -> str | None:
        """The pseudo-terminal behind the link now (`/dev/pts/N`), None while unplugged."""
        with self._lock:
            return os.ttyname(self._slave) if self._slave is not None else None

    @property
    def outputs(self) -> list[float]:
        """Output voltages, volts, per channel (what the heaters see)."""
        return [self.hal.volts(c) for c in range(self.board.n)]

    # ---- pty plumbing ----------------------------------------------------------------------

    def _plug(self) -> None:
        with self._lock:
            self._plug_locked()

    def _plug_locked(self) -> None:
        master, slave = os.openpty()
        tty.setraw(slave)          # no echo, no newline translation: a clean 8N1 byte pipe
        os.set_blocking(master, False)
        self._master, self._slave = master, slave
        target = os.ttyname(slave)
        tmp = self.link.with_name(self.link.name + ".new")
        tmp.unlink(missing_ok=True)
        os.symlink(target, tmp)
        os.replace(tmp, self.link)

    def _unplug_locked(self) -> None:
        for fd in (self._master, self._slave):
            if fd is not None:
                os.close(fd)
        self._master = self._slave = None
        self.link.unlink(missing_ok=True)

    def _serve(self) -> None:
        while not self._stop.is_set():
            master = self._master
            if master is None:
                time.sleep(TICK_S)
                with self._lock:
                    self.board.tick()
                continue
            try:
                wants_write = bool(self._pending)
                # the firmware's tick does something only with its watchdog armed or a ramp
                # under way; else the loop waits for the host (500 wake-ups a second less)
                wait = TICK_S if self.board.watchdog.busy() else IDLE_S
                readable, writable, _ = select.select(
                    [master], [master] if wants_write else [], [], wait)
            except (OSError, ValueError):
                continue  # unplugged under us
            with self._lock:
                if master != self._master:
                    continue
                try:
                    if readable:
                        data = os.read(master, 4096)
                        if data:
                            self.bytes_in += len(data)
                            self._queue(self.board.feed(data))
                    if self._pending:
                        sent = os.write(master, self._pending)
                        self.bytes_out += sent
                        del self._pending[:sent]
                except BlockingIOError:
                    pass
                except OSError as e:
                    log.debug("pty I/O: %s", e)
                self.board.tick()

    def _queue(self, reply: bytes) -> None:
        self._pending += reply
        if len(self._pending) > MAX_PENDING:
            dropped = len(self._pending) - MAX_PENDING
            del self._pending[:dropped]
            log.warning("dac board: host is not reading; dropped %d reply bytes", dropped)
