"""`ptb keys`: CurveZMQ key pairs for the bus (a server's, each client's), a client's bound to
its role: `--role observer|tenant|operator|agent` (and a tenant's `--job NAME`s) are written in
the public certificate's metadata, which `--authorize` lists in DIR/authorized, the folder
servers accept clients from and look their roles up in (hil.bus.security)."""
from __future__ import annotations

import pathlib
import re

from photonic_testbed.hil.bus.schema import ROLES, TENANT
from photonic_testbed.hil.bus.security import KeyFileError, authorize, generate, role_metadata
from photonic_testbed.ptb.cli import CommandFailed, check_output

NAME = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9_.-]{0,99}")


def add_parser(sub) -> None:
    p = sub.add_parser("keys", help="make CurveZMQ key pairs for the bus",
                       description="Write NAME.key (public) and NAME.key_secret (secret) for "
                       "each NAME into DIR, a client's public key naming its --role. With "
                       "--authorize, also copy each public key into DIR/authorized, the folder "
                       "servers accept clients from (and take their roles from).")
    p.add_argument("names", nargs="+", metavar="NAME", help="e.g. server operator agent")
    p.add_argument("--dir", default="keys", help="where to write them (default %(default)s)")
    p.add_argument("--role", choices=ROLES,
                   help="what a client with this key may do: observer (read, subscribe), "
                   "tenant (its --job's requests), operator (every job's, swaps, manual "
                   "changes), agent (the device services' changes); none: a server's key (a "
                   "client key listed without one is an observer's)")
    p.add_argument("--job", action="append", default=[], metavar="NAME",
                   help="a job a tenant's key may admit and act on (repeatable; a tenant "
                   "names at least one)")
    p.add_argument("--authorize", action="store_true",
                   help="list the new public keys in DIR/authorized (for clients)")
    p.set_defaults(func=run)


def _check_names(names: list[str]) -> None:
    """Each NAME becomes a file name in DIR: a plain name, each once."""
    for name in names:
        if not NAME.fullmatch(name):
            raise CommandFailed(f"key name {name!r}: use letters, digits, '_', '-' and '.', "
                                f"not starting with '.' (it names NAME.key in DIR)")
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise CommandFailed(f"key name(s) given twice: {', '.join(twice)}")


def _os_error(what: str, e: OSError) -> CommandFailed:
    return CommandFailed(f"cannot {what}: {e.strerror or e}")


def run(args) -> int:
    _check_names(args.names)
    try:
        role_metadata(args.role, args.job)
    except ValueError as e:
        hint = " (--role tenant --job NAME)" if args.job or args.role == TENANT else ""
        raise CommandFailed(f"{e}{hint}") from None
    check_output(args.dir, "--dir", folder=True)
    folder = pathlib.Path(args.dir)
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except FileExistsError:
        raise CommandFailed(f"--dir {folder} exists and is not a folder") from None
    except OSError as e:
        raise _os_error(f"make the key folder {folder}", e) from None
    for name in args.names:                 # refuse before writing any
        for suffix in (".key", ".key_secret"):
            if (folder / (name + suffix)).exists():
                raise CommandFailed(f"{folder / (name + suffix)} exists; refusing to "
                                    f"overwrite it")
    for name in args.names:
        try:
            public, secret = generate(folder, name, args.role, args.job)
        except KeyFileError as e:
            raise CommandFailed(str(e)) from None
        except OSError as e:
            raise _os_error(f"write {name}'s keys in {folder}", e) from None
        role = "" if args.role is None else f" ({args.role}" + (
            f" of {', '.join(args.job)})" if args.job else ")")
        print(f"{name}{role}: public {public}, secret {secret}")
        if args.authorize:
            try:
                authorize(public, folder / "authorized")
            except FileExistsError:
                raise CommandFailed(f"{folder / 'authorized'} exists and is not a folder") \
                    from None
            except OSError as e:
                raise _os_error(f"list {name} in {folder / 'authorized'}", e) from None
            print(f"  listed in {folder / 'authorized'}"
                  + ("" if args.role else " as an observer's key (no --role)"))
    return 0
