"""A device's driver calls, one at a time in arrival order: the device's one writer, for a
service served from a loop (hil.devices.together).

`DeviceCalls` holds the device's queue of calls, the call under way and the device's own
thread. A call that can be sent at once and its answer awaited on the device's socket (a
switch's new circuits: `DeviceKind.begins`) is sent from the loop's thread, and its answer read
there when the loop sees the socket readable; every other call, and whatever may block (a
refusal's error queue, a dropped or silent session), runs on the device's thread. The loop
cooperates through a small interface (`CallLoop`): it watches the device's socket, wakes for a
timer, and is woken by the device's thread after each call.
"""
from __future__ import annotations

import collections
import math
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Protocol

from photonic_testbed.hil.bus.errors import DeadlineExceeded
from photonic_testbed.hil.bus.server import Answer


class CallLoop(Protocol):
    """What the loop serving a device does for its calls."""

    def watch(self, sock: Any, calls: DeviceCalls) -> None:
        """Wake for this native socket, and hand it to `calls.on_readable`."""

    def unwatch(self, sock: Any) -> None:
        """Stop waking for this socket."""

    def later(self, calls: DeviceCalls, seconds: float) -> None:
        """Call `calls.look_again` this many seconds from now."""

    def wake(self, calls: DeviceCalls) -> None:
        """(From the device's thread) a call of `calls` ended: call `calls.call_done`."""


class DeviceThread:
    """A device's own thread for its driver calls that block: one at a time, and `done()`
    after each (from this thread)."""

    def __init__(self, name: str, done: Callable[[], None]):
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._done = done
        self._thread = threading.Thread(target=self._run, name=f"{name}-device", daemon=True)
        self._thread.start()

    def run(self, fn: Callable[[], Any], future: Future) -> None:
        self._jobs.put((future, fn))

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            future, fn = job
            try:
                future.set_result(fn())
            except Exception as e:
                future.set_exception(e)
            self._done()

    def stop(self) -> None:
        """End once the calls handed over are done (`join` waits for it)."""
        self._jobs.put(None)

    def join(self, timeout: float) -> bool:
        """Wait at most `timeout` for the thread to end (a driver stuck past it is left to its
        daemon thread); returns whether it ended."""
        self._thread.join(max(0.0, timeout))
        return not self._thread.is_alive()


@dataclass
class Call:
    """One driver call in the device's queue."""
    future: Future
    run: Callable[[], Any]                        # the call, on the device's thread
    begin: Callable[[], Any] | None = None        # or sent now (DeviceKind.begins)
    name: str = ""                                # the operation
    deadline: float | None = None                 # not started past this (time.monotonic())


class DeviceCalls:
    """The device's queue of driver calls, the one under way, and a change sent whose answer
    is awaited on the device's socket."""

    def __init__(self, name: str, driver: Any, loop: CallLoop):
        self.name = name
        self.driver = driver
        self._loop = loop
        self._thread = DeviceThread(name, lambda: loop.wake(self))
        self._queue: collections.deque[Call] = collections.deque()
        self._current: Call | None = None
        self._began = 0.0                              # when the call under way started
        self._awaited: tuple[Any, Callable[[Any], Any], Any] | None = None  # change, finish, sock

    def submit(self, run: Callable[[], Any], begin: Callable[[], Any] | None = None,
               name: str = "", deadline: float | None = None) -> Future:
        """A driver call, after those queued before it: the device's one writer. One whose
        turn comes past `deadline` (its request's ttl_ms) is not run."""
        call = Call(Future(), run, begin, name, deadline)
        self._queue.append(call)
        self._start()
        return call.future

    @property
    def busy_since(self) -> float | None:
        """When the call under way started (time.monotonic()); None: the device is idle."""
        return self._began if self._current is not None else None

    @property
    def deadline(self) -> float:
        """When the awaited change's answer is late (time.monotonic()); inf: none awaited."""
        return self._awaited[0].deadline if self._awaited is not None else math.inf

    def _start(self) -> None:
        """Start queued calls while the device is free: one that can be sent now is sent
        from this thread and its answer awaited on the device's socket; any other runs on the
        device's thread."""
        while self._current is None and self._queue:
            call = self._queue.popleft()
            if call.deadline is not None and time.monotonic() > call.deadline:
                call.future.set_exception(DeadlineExceeded(
                    f"{call.name} waited longer than its deadline behind other requests to "
                    f"{self.name} and was not run"))
                continue
            started = None
            if call.begin is not None:
                try:
                    started = call.begin()
                except Exception as e:
                    call.future.set_exception(e)
                    continue
            if isinstance(started, Answer):
                call.future.set_result(started)             # nothing to wait for
                continue
            self._current = call
            self._began = time.monotonic()
            if started is None:
                self._thread.run(call.run, call.future)
                return
            change, finish = started
            sock = self.driver.session_socket()
            self._awaited = (change, finish, sock)
            self._loop.watch(sock, self)
            self._answer_arrived()                          # (it may be there already)
            if self._current is not None:
                return

    def on_readable(self) -> None:
        """The awaited change's socket is readable: its answer taken when whole, and the
        next call started once the device is free."""
        if self._awaited is not None:
            self._answer_arrived(readable=True)
        self._start()

    def on_deadline(self) -> None:
        """The awaited change's deadline passed: its session recovered on the device's
        thread."""
        if self._awaited is not None:
            self._answer_arrived()
        self._start()

    def _answer_arrived(self, readable: bool = False) -> None:
        """The awaited change's socket is readable, or its deadline passed: finish it here
        when its answer is a clean one (the device is then free); hand what may block (a
        refusal's error queue, a dropped or silent session) to the device's thread."""
        assert self._awaited is not None and self._current is not None
        change, finish, sock = self._awaited
        call = self._current
        state = change.state()
        if state == "wait":
            if readable:                  # part of a line: look again shortly, not at once
                self._loop.unwatch(sock)
                self._loop.later(self, 0.001)
            return
        self._loop.unwatch(sock)
        self._awaited = None
        if state == "line":
            try:
                reply = change.take()
            except Exception as e:           # (a line was there: not expected)
                change.lost = e
            else:
                if change.clean(reply):
                    try:
                        call.future.set_result(finish(change.conclude(reply)))
                    except Exception as e:
                        call.future.set_exception(e)
                    self._current = None
                    return
                self._thread.run(lambda: finish(change.conclude(reply)), call.future)
                return
        self._thread.run(lambda: finish(change.recover()), call.future)

    def look_again(self) -> None:
        """The timer `_answer_arrived` set: the socket watched again, its answer looked at."""
        if self._awaited is not None:
            self._loop.watch(self._awaited[2], self)
            self._answer_arrived()
            self._start()

    def call_done(self) -> None:
        """After the device's thread finished a call (on the loop's thread): the next may
        start."""
        if self._current is not None and self._awaited is None and self._current.future.done():
            self._current = None
            self._start()

    def stop(self) -> None:
        """No more calls: the device's thread ends once those handed over are done."""
        self._thread.stop()

    def join(self, timeout: float) -> bool:
        """Wait at most `timeout` for the device's thread to end; returns whether it did."""
        return self._thread.join(timeout)
