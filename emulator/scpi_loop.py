"""The thread that serves emulated SCPI instruments: one `SCPILoop` is a selector over the
listening and session sockets of any number of servers (a datacenter rig's 64 switches share
one), with timers and calls posted from other threads. A server given no loop has its own.
"""
from __future__ import annotations

import collections
import heapq
import itertools
import logging
import selectors
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

from photonic_testbed.emulator.scpi import is_time

log = logging.getLogger(__name__)

CANCELLED_KEPT = 64         # cancelled timers left in a loop's heap before it is cleaned


class SCPILoop:
    """One thread serving the sockets of any number of `SCPIServer`s: a selector over their
    listening and session sockets, timers (a command's wait, a session's idle and send
    deadlines) and calls posted from other threads. It runs while a server started on it is
    open (`acquire` / `release`)."""

    def __init__(self, name: str = "scpi"):
        self.name = name
        self._lock = threading.Lock()
        self._users = 0
        self._thread: threading.Thread | None = None
        self._sel: selectors.BaseSelector | None = None
        self._wake_r: socket.socket | None = None
        self._wake_w: socket.socket | None = None
        self._calls: collections.deque[Callable[[], None]] = collections.deque()
        self._timers: list[list] = []         # heap of [when, seq, fn]; fn None: cancelled
        self._cancelled = 0                    # cancelled entries still in the heap
        self._seq = itertools.count()
        self._stop = threading.Event()         # this run's: set by the last `release`

    # ---- life -----------------------------------------------------------------------------

    def acquire(self) -> None:
        """A server starts on this loop: the thread runs from the first one."""
        with self._lock:
            self._users += 1
            if self._thread is not None:
                return
            self._sel = selectors.DefaultSelector()
            self._wake_r, self._wake_w = socket.socketpair()
            for s in (self._wake_r, self._wake_w):
                s.setblocking(False)
            self._sel.register(self._wake_r, selectors.EVENT_READ, None)
            self._stop = threading.Event()
            self._calls, self._timers = collections.deque(), []     # this run's
            self._cancelled = 0
            self._thread = threading.Thread(target=self._run, args=(self._stop,),
                                            name=f"{self.name}-loop", daemon=True)
            self._thread.start()

    def release(self) -> None:
        """A server on this loop closed: the thread ends with the last one."""
        with self._lock:
            self._users -= 1
            if self._users > 0 or self._thread is None:
                return
            thread, self._thread = self._thread, None
            stop, wake = self._stop, self._wake_w
        stop.set()
        if wake is not None:
            try:
                wake.send(b"\0")
            except OSError:        # full (it is awake anyway) or closed (it has ended)
                pass
        if thread is not threading.current_thread():
            thread.join(timeout=5)

    @property
    def on_loop(self) -> bool:
        return threading.current_thread() is self._thread

    # ---- what the loop runs -----------------------------------------------------------------

    def call(self, fn: Callable[[], None]) -> None:
        """Run fn on the loop's thread soon (from any thread; returns at once)."""
        self._calls.append(fn)
        w = self._wake_w
        if w is not None:
            try:
                w.send(b"\0")
            except OSError:      # its buffer is full (a wake is pending anyway), or closed
                pass

    def call_wait(self, fn: Callable[[], Any], timeout: float = 10.0) -> Any:
        """Run fn on the loop's thread and return what it returns (raises what it raises)."""
        if self.on_loop or self._thread is None:
            return fn()
        done = threading.Event()
        out: dict[str, Any] = {}

        def run() -> None:
            try:
                out["value"] = fn()
            except BaseException as e:     # handed to the caller
                out["error"] = e
            finally:
                done.set()
        self.call(run)
        if not done.wait(timeout):
            raise TimeoutError(f"{self.name}: the serving thread did not answer in {timeout} s")
        if "error" in out:
            raise out["error"]
        return out.get("value")

    def at(self, when: float, fn: Callable[[], None]) -> list:
        """Run fn on the loop's thread at time.monotonic() `when` (call it on the loop);
        returns the timer, for `cancel`."""
        if not is_time(when):
            raise ValueError(f"a timer is due at a finite time.monotonic(), not {when!r}")
        timer = [when, next(self._seq), fn]
        heapq.heappush(self._timers, timer)
        return timer

    def cancel(self, timer: list | None) -> None:
        """A timer of `at` that is no longer wanted (one that ran or was cancelled: nothing
        happens), on the loop. What it would have run is let go at once; cancelled timers are
        taken out of the heap once they are half of it (a closed session's idle timer would
        otherwise stay for the idle timeout: a client reconnecting in a loop piled them up)."""
        if timer is None or timer[2] is None:
            return
        timer[2] = None
        self._cancelled += 1
        timers = self._timers
        if self._cancelled > CANCELLED_KEPT and 2 * self._cancelled > len(timers):
            timers[:] = [t for t in timers if t[2] is not None]
            heapq.heapify(timers)
            self._cancelled = 0

    def register(self, sock: socket.socket, events: int, on_event: Callable[[int], None]
                 ) -> None:
        assert self._sel is not None
        self._sel.register(sock, events, on_event)

    def modify(self, sock: socket.socket, events: int, on_event: Callable[[int], None]) -> None:
        assert self._sel is not None
        self._sel.modify(sock, events, on_event)

    def unregister(self, sock: socket.socket) -> None:
        if self._sel is not None:
            try:
                self._sel.unregister(sock)
            except (KeyError, ValueError):
                pass

    def _run(self, stop: threading.Event) -> None:
        sel, wake, wake_w = self._sel, self._wake_r, self._wake_w
        calls, timers = self._calls, self._timers       # this run's (a later run has its own)
        assert sel is not None and wake is not None and wake_w is not None
        try:
            while not stop.is_set():
                try:
                    self._turn(sel, wake, calls, timers)
                except Exception:      # never seen; the thread serves every instrument on it
                    log.exception("%s: unexpected failure in the serving loop", self.name)
                    time.sleep(0.01)
        finally:
            with self._lock:
                if self._wake_w is wake_w:       # not already started again
                    self._wake_w = self._sel = self._wake_r = None
            timers.clear()
            calls.clear()
            sel.close()
            wake.close()
            wake_w.close()

    def _turn(self, sel: selectors.BaseSelector, wake: socket.socket,
              calls: collections.deque, timers: list) -> None:
        """Wait for a socket, a timer or a call, then run what is ready."""
        timeout = None
        if calls:
            timeout = 0.0
        elif timers:
            timeout = max(0.0, timers[0][0] - time.monotonic())
        for key, mask in sel.select(timeout):
            if key.data is None:
                try:
                    while wake.recv(4096):
                        pass
                except OSError:
                    pass
                continue
            self._guarded(key.data, mask)
        now = time.monotonic()
        while timers and timers[0][0] <= now:
            timer = heapq.heappop(timers)
            fn, timer[2] = timer[2], None                # ran: `cancel` does nothing now
            if fn is None:
                self._cancelled = max(0, self._cancelled - 1)
            else:
                self._guarded(fn)
        for _ in range(len(calls)):
            self._guarded(calls.popleft())

    def _guarded(self, fn: Callable[..., None], *args: Any) -> None:
        try:
            fn(*args)
        except BaseException:
            # one session's fault (even a handler's sys.exit) must not stop every instrument
            # this thread serves
            log.exception("%s: unexpected failure on the serving thread", self.name)
