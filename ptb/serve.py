"""`ptb serve`: put a rig's devices on the bus, each behind its own service."""
from __future__ import annotations

import dataclasses
import json
import logging
import pathlib
import signal
import threading

import zmq

from photonic_testbed.common import heap
from photonic_testbed.hil.bus.security import KeyFileError
from photonic_testbed.hil.devices.kinds import ServiceError
from photonic_testbed.hil.devices.service import DeviceService
from photonic_testbed.hil.devices.supervisor import Manager, SupervisorError
from photonic_testbed.hil.devices.together import serve_together
from photonic_testbed.hil.files import WAIT_S, write_atomic
from photonic_testbed.hil.rig import RigFileError, load
from photonic_testbed.ptb.cli import CommandFailed, check_output

log = logging.getLogger(__name__)


def add_parser(sub) -> None:
    p = sub.add_parser("serve", help="run the device services of a rig on the bus",
                       description="Start one bus service per device of the rig file (or the "
                       "devices named), each in its own process restarted with back-off when "
                       "it dies; or all in this process with --one-process.")
    p.add_argument("--rig", required=True, metavar="FILE", help="the rig file (TOML)")
    p.add_argument("--device", action="append", metavar="NAME",
                   help="serve only this device (repeatable); default every device")
    p.add_argument("--one-process", action="store_true",
                   help="serve every device from this process: one thread answers them "
                   "all, each device's calls in turn (no restarts)")
    p.add_argument("--endpoints", metavar="FILE",
                   help="write {device: [request, publish]} as JSON once every service is up")
    p.add_argument("--metrics-port", type=int, default=0, metavar="PORT",
                   help="serve the services' Prometheus metrics (docs/metrics.md): every "
                   "service on PORT with --one-process, else the n-th device on PORT + n "
                   "(default 0: none)")
    p.add_argument("--metrics-host", default="127.0.0.1", metavar="HOST",
                   help="the address the metrics are served on (default 127.0.0.1)")
    p.add_argument("--state-dir", metavar="DIR",
                   help="where each device keeps the highest agent term it has taken, across "
                   "restarts (default: NAME-state/ beside the rig file NAME.toml)")
    p.set_defaults(func=run)


def _write_endpoints(path: str, endpoints: dict) -> None:
    write_atomic(path, json.dumps({k: list(v) for k, v in endpoints.items()}, indent=2))


def run(args) -> int:
    check_output(args.endpoints, "--endpoints")
    check_output(args.state_dir, "--state-dir", folder=True)
    try:
        rig = load(args.rig, wait_s=WAIT_S)
        state_dir = args.state_dir or rig.state_dir()
        specs = rig.service_specs(args.device, state_dir)
        keys = rig.client_keys()
    except (RigFileError, KeyFileError) as e:
        raise CommandFailed(str(e)) from None
    if not 0 <= args.metrics_port <= 65535 - len(specs):
        raise CommandFailed(f"--metrics-port must leave a port for each of the {len(specs)} "
                            f"services below 65536, not {args.metrics_port}")
    if args.metrics_port:
        try:
            import prometheus_client  # noqa: F401
        except ImportError as e:
            raise CommandFailed(f"--metrics-port needs prometheus-client (pip install "
                                f"'photonic-testbed[metrics]'): {e}") from None
        if not args.one_process:            # each service's process serves its own
            specs = [dataclasses.replace(s, metrics=f"{args.metrics_host}:"
                                                    f"{args.metrics_port + n}")
                     for n, s in enumerate(specs)]
            for s in specs:
                print(f"  {s.name:<12} metrics on http://{s.metrics}/metrics")
    elif not args.one_process:               # where the rig file says, if it does
        for s in specs:
            if s.metrics:
                print(f"  {s.name:<12} metrics on http://{s.metrics}/metrics")
    if state_dir is not None:
        try:
            pathlib.Path(state_dir).mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise CommandFailed(f"cannot make the state folder {state_dir}: "
                                f"{e.strerror or e}") from None
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    if args.one_process:
        return _run_in_process(specs, stop, args)
    manager = Manager(specs, keys=keys)
    try:
        endpoints = manager.start()
    except SupervisorError as e:
        if stop.is_set():                       # Ctrl-C while the services were starting
            print("stopped before every service had started", flush=True)
            return 0
        raise CommandFailed(str(e)) from None
    try:
        _announce(rig.name, endpoints, args)
        manager.run(stop)
    finally:
        manager.close()
    print("stopped", flush=True)
    return 0


def _announce(name: str, endpoints: dict, args) -> None:
    print(f"rig {name}: serving {len(endpoints)} device(s)")
    for device, (request, publish) in endpoints.items():
        print(f"  {device:<12} requests {request}  publishes {publish}")
    if args.endpoints:
        _write_endpoints(args.endpoints, endpoints)
    print("running; Ctrl-C to stop", flush=True)


def _serve_metrics(service, where: str) -> None:
    """One service's metrics on `where` (HOST:PORT, the rig file's `metrics`)."""
    try:
        from photonic_testbed.hil.devices.metrics import ServiceMetrics
        host, port = ServiceMetrics([service]).serve_at(where)
    except ImportError as e:
        raise CommandFailed(f"{service.spec.name}: its metrics need prometheus-client (pip "
                            f"install 'photonic-testbed[metrics]'): {e}") from None
    except (OSError, ValueError) as e:
        raise CommandFailed(f"{service.spec.name}: cannot serve its metrics on {where}: "
                            f"{getattr(e, 'strerror', None) or e}") from None
    print(f"  {service.spec.name:<12} metrics on http://{host}:{port}/metrics")


def _run_in_process(specs, stop: threading.Event, args) -> int:
    services, endpoints = [], {}
    # One ZeroMQ context (one I/O thread) for every service, and one thread answering every
    # service's requests, each device's driver called from its own thread (serve_together;
    # BENCHMARKS.md "datacenter").
    context = zmq.Context()
    loop = None
    try:
        for spec in specs:
            service = DeviceService(spec, context=context)
            try:
                endpoints[spec.name] = service.bind()
            except (ServiceError, KeyFileError, OSError) as e:
                raise CommandFailed(f"{spec.name}: {e}") from None
            services.append(service)
        if args.metrics_port:
            from photonic_testbed.hil.devices.metrics import ServiceMetrics
            try:
                host, port = ServiceMetrics(services).serve(args.metrics_host,
                                                            args.metrics_port)
            except OSError as e:
                raise CommandFailed(f"cannot serve the metrics on {args.metrics_host}:"
                                    f"{args.metrics_port}: {e.strerror or e}") from None
            print(f"metrics of every service on http://{host}:{port}/metrics")
        else:                               # each where the rig file says, if it does
            for service, spec in zip(services, specs, strict=True):
                if spec.metrics:
                    _serve_metrics(service, spec.metrics)
        loop = threading.Thread(target=serve_together, args=(services, stop), name="services",
                                daemon=True)
        heap.settle("start-up")
        loop.start()
        _announce("(one process)", endpoints, args)
        while not stop.wait(0.2):
            if not loop.is_alive():
                raise CommandFailed("the services stopped; see the log")
    finally:
        stop.set()
        if loop is not None:
            loop.join(5.0)
        for service in services:
            service.close()
        if loop is None or not loop.is_alive():
            context.term()            # (a service stuck in its driver keeps the process up)
    print("stopped", flush=True)
    return 0
