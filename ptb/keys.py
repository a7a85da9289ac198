"""`ptb keys`: CurveZMQ key pairs for the bus (a server's, each client's)."""
from __future__ import annotations

import pathlib
import shutil

from photonic_testbed.hil.bus.security import KeyFileError, generate
from photonic_testbed.ptb.cli import CommandFailed


def add_parser(sub) -> None:
    p = sub.add_parser("keys", help="make CurveZMQ key pairs for the bus",
                       description="Write NAME.key (public) and NAME.key_secret (secret) for "
                       "each NAME into DIR. With --authorize, also copy each public key into "
                       "DIR/authorized, the folder servers accept clients from.")
    p.add_argument("names", nargs="+", metavar="NAME", help="e.g. server operator agent")
    p.add_argument("--dir", default="keys", help="where to write them (default %(default)s)")
    p.add_argument("--authorize", action="store_true",
                   help="list the new public keys in DIR/authorized (for clients)")
    p.set_defaults(func=run)


def run(args) -> int:
    folder = pathlib.Path(args.dir)
    for name in args.names:
        try:
            public, secret = generate(folder, name)
        except KeyFileError as e:
            raise CommandFailed(str(e)) from None
        print(f"{name}: public {public}, secret {secret}")
        if args.authorize:
            (folder / "authorized").mkdir(exist_ok=True)
            shutil.copy(public, folder / "authorized" / public.name)
            print(f"  listed in {folder / 'authorized'}")
    return 0
