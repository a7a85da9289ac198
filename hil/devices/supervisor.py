"""The manager: each device service in its own process, restarted with back-off when it dies
or stops sending heartbeats.

A service that bound port 0 the first time gets the same concrete endpoints on every restart,
so clients and subscribers (which ZeroMQ reconnects by itself) find it again without being
told. Back-off doubles from `backoff_min` to `backoff_max` for a service that keeps failing and
falls back to the minimum once it has run for `stable_s`.
"""
from __future__ import annotations

import dataclasses
import logging
import multiprocessing as mp
import threading
import time
from dataclasses import dataclass
from typing import Any

import zmq

from photonic_testbed.hil.bus import schema
from photonic_testbed.hil.bus.security import ClientKeys, make_client
from photonic_testbed.hil.devices.service import ServiceSpec, run_service

log = logging.getLogger(__name__)


class SupervisorError(Exception):
    """A service could not be started at all."""


@dataclass
class Supervised:
    spec: ServiceSpec
    process: mp.process.BaseProcess | None = None
    started_at: float = 0.0
    restarts: int = 0
    backoff: float = 0.0
    next_start: float = 0.0
    last_error: str = ""
    last_heartbeat: float = 0.0
    heard: bool = False          # a heartbeat of this process was heard (silence counts after)
    warned: bool = False


class Manager:
    """Start services (`start()`), watch them (`check()` or a thread via `run(stop)`)."""

    def __init__(self, specs: list[ServiceSpec], *, backoff_min: float = 0.1,
                 backoff_max: float = 5.0, stable_s: float = 10.0, start_timeout: float = 20.0,
                 missed_heartbeats: int = 6, silence_s: float = 5.0,
                 watch_heartbeats: bool = True,
                 keys: ClientKeys | None = None):
        self._mp = mp.get_context("spawn")
        self.services = {s.name: Supervised(s) for s in specs}
        self.backoff_min, self.backoff_max, self.stable_s = backoff_min, backoff_max, stable_s
        self.start_timeout = start_timeout
        self.missed_heartbeats = missed_heartbeats
        # A service's loop sends heartbeats while its device works, and stops them once a
        # driver call is stuck (ServiceSpec.stuck_s): a silence longer than this is a hang.
        self.silence_s = silence_s
        self._ctx = zmq.Context()
        self._sub: zmq.Socket | None = None
        self.keys = keys
        # Heartbeats of CURVE services are heard only with a listed client key; without one the
        # manager watches the processes alone.
        curve = any(s.curve_secret for s in specs)
        self._watch = watch_heartbeats and (keys is not None or not curve)
        self._lock = threading.Lock()

    def endpoints(self) -> dict[str, tuple[str, str]]:
        """Device name -> (request endpoint, publish endpoint), as bound."""
        return {n: (s.spec.request, s.spec.publish) for n, s in self.services.items()}

    def start(self) -> dict[str, tuple[str, str]]:
        """Start every service and wait until each has bound its sockets."""
        try:
            for sup in self.services.values():
                self._spawn(sup)
        except BaseException:
            self.close()
            raise
        if self._watch:
            self._sub = self._ctx.socket(zmq.SUB)
            self._sub.linger = 0
            make_client(self._sub, self.keys)
            for sup in self.services.values():
                self._sub.subscribe(schema.topic(schema.HEARTBEAT, sup.spec.name))
                self._sub.connect(sup.spec.publish)
        return self.endpoints()

    def _spawn(self, sup: Supervised) -> None:
        parent, child = self._mp.Pipe(duplex=False)
        proc = self._mp.Process(target=run_service, args=(sup.spec, child),
                                name=f"ptb-service-{sup.spec.name}", daemon=True)
        proc.start()
        child.close()
        ok = parent.poll(self.start_timeout)
        try:
            got: tuple[str, Any] = parent.recv() if ok else ("error", "did not start in time")
        except EOFError:                        # it died first (a Ctrl-C during its start)
            proc.join(2.0)
            got = ("error", f"its process ended (exit {proc.exitcode}) before it was ready")
        status, info = got
        parent.close()
        if status != "ready":
            proc.kill()
            proc.join(2.0)
            sup.last_error = info
            raise SupervisorError(f"service {sup.spec.name} failed to start: {info}")
        request, publish = info
        # Keep the concrete endpoints (port 0 resolved) for every later restart.
        sup.spec = dataclasses.replace(sup.spec, request=request, publish=publish)
        sup.process = proc
        sup.started_at = sup.last_heartbeat = time.monotonic()
        sup.heard = sup.warned = False
        log.info("service %s started (pid %d) on %s", sup.spec.name, proc.pid, request)

    def pid(self, name: str) -> int | None:
        proc = self.services[name].process
        return proc.pid if proc is not None else None

    def check(self) -> None:
        """One round of supervision: note heartbeats, restart what died or went silent."""
        now = time.monotonic()
        if self._sub is not None:
            while True:
                try:
                    frames = self._sub.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                try:
                    msg = schema.decode(frames[-1])
                except schema.SchemaError:
                    continue
                sup = self.services.get(msg["device"]) if "device" in msg else None
                if sup is not None:
                    sup.last_heartbeat = now
                    sup.heard = True
        with self._lock:
            for sup in self.services.values():
                self._check_one(sup, now)

    def _check_one(self, sup: Supervised, now: float) -> None:
        proc = sup.process
        if proc is not None:
            silent = now - sup.last_heartbeat > max(self.silence_s,
                                                    self.missed_heartbeats * sup.spec.heartbeat)
            if silent and not sup.heard:
                # Never heard (a client key the service does not list?): a process that never
                # spoke is not judged by its silence.
                if not sup.warned:
                    log.warning("no heartbeat heard from service %s: watching its process only "
                                "(is this host's client key listed?)", sup.spec.name)
                    sup.warned = True
                silent = False
            if proc.is_alive() and not (self._watch and silent):
                if now - sup.started_at > self.stable_s:
                    sup.backoff = 0.0
                return
            if proc.is_alive():
                log.warning("service %s sent no heartbeat for %.1f s: killing it",
                            sup.spec.name, now - sup.last_heartbeat)
                proc.kill()
            proc.join(2.0)
            log.warning("service %s (pid %s) stopped with exit code %s", sup.spec.name,
                        proc.pid, proc.exitcode)
            sup.process = None
            sup.backoff = min(max(sup.backoff * 2, self.backoff_min), self.backoff_max)
            sup.next_start = now + sup.backoff
        if now < sup.next_start:
            return
        try:
            self._spawn(sup)
            sup.restarts += 1
        except SupervisorError as e:
            log.warning("%s; next try in %.1f s", e, sup.backoff)
            sup.backoff = min(max(sup.backoff * 2, self.backoff_min), self.backoff_max)
            sup.next_start = time.monotonic() + sup.backoff

    def run(self, stop: threading.Event, period: float = 0.05) -> None:
        while not stop.wait(period):
            self.check()

    def close(self) -> None:
        with self._lock:
            for sup in self.services.values():
                proc = sup.process
                if proc is not None and proc.is_alive():
                    proc.terminate()
            for sup in self.services.values():
                proc = sup.process
                if proc is not None:
                    proc.join(3.0)
                    if proc.is_alive():
                        proc.kill()
                        proc.join(2.0)
                sup.process = None
        if self._sub is not None:
            self._sub.close(linger=0)
            self._sub = None
        self._ctx.term()

    def __enter__(self) -> Manager:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.close()
