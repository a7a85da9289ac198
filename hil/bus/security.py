"""CurveZMQ on the bus: servers hold a key pair and accept only listed client keys, each bound
to a role.

Keys are ZeroMQ certificate files as `ptb keys` writes them (zmq.auth's format): `NAME.key`
holds the public key, `NAME.key_secret` both. A server reads its secret certificate and a
folder of authorised client public certificates (the rig's `[bus] authorized_keys`); a client
reads its own secret certificate and the server's public one.

The authorised folder is the one home of who may do what: each client certificate there names
its key's role in its metadata section (`role = "tenant"`, and a tenant's `jobs =
"train-a,train-b"`; roles in `schema.ROLES`), and the file's name (`NAME.key`) names the key.
Each process serving the bus runs one ZAP handler per ZeroMQ context (`start_authenticator`):
it accepts a connection only from a key listed there and gives the connection the key's name
and public key as its ZAP User-Id, which every frame received on it carries. The server looks
the User-Id up in the `KeyTable`, read again when the folder changes (looked at every
`KeyTable.CHECK_S`): a key taken out of the folder (or listed again with another public key)
no longer matches, so its next request is refused, and a key whose role or jobs changed is
held to the new ones from its next request, without a restart. A certificate without a role is
taken as an observer's (the keys of before roles).

Without CURVE (loopback runs that turn it off explicitly) nothing here is used, and every local
process is trusted with every role (`TRUSTED`).
"""
from __future__ import annotations

import logging
import os
import pathlib
import shutil
import threading
import time
from dataclasses import dataclass, field

import zmq
import zmq.auth
from zmq.utils import z85

from photonic_testbed.hil.bus.schema import MAX_NAME, OBSERVER, ROLES, TENANT

log = logging.getLogger(__name__)

ZAP_ENDPOINT = "inproc://zeromq.zap.01"      # where ZeroMQ asks (the ZAP specification, 27/ZAP)


class KeyFileError(Exception):
    """A key file is missing or unreadable."""


@dataclass(frozen=True)
class ServerKeys:
    public: bytes
    secret: bytes
    authorized: pathlib.Path       # folder of client *.key files


@dataclass(frozen=True)
class ClientKeys:
    public: bytes
    secret: bytes
    server_public: bytes


def _load(path: str | os.PathLike) -> tuple[bytes, bytes | None]:
    """A key file's public key, and its secret key when it holds one."""
    path = pathlib.Path(path)
    try:
        return zmq.auth.load_certificate(path)
    except (OSError, ValueError) as e:
        raise KeyFileError(f"cannot read the key file {path}: {e}") from None


def _load_secret(path: str | os.PathLike) -> tuple[bytes, bytes]:
    """A .key_secret file's public and secret keys."""
    public, secret = _load(path)
    if not secret:
        raise KeyFileError(f"{path} holds no secret key (use the .key_secret file)")
    return public, secret


def server_keys(secret_file: str | os.PathLike, authorized_dir: str | os.PathLike) -> ServerKeys:
    public, secret = _load_secret(secret_file)
    folder = pathlib.Path(authorized_dir)
    if not folder.is_dir():
        raise KeyFileError(f"the authorised client keys folder {folder} does not exist")
    return ServerKeys(public, secret, folder)


def client_keys(secret_file: str | os.PathLike, server_public_file: str | os.PathLike
                ) -> ClientKeys:
    public, secret = _load_secret(secret_file)
    server_public, _ = _load(server_public_file)
    return ClientKeys(public, secret, server_public)


# ---- certificates and roles -------------------------------------------------------------------

def role_metadata(role: str | None, jobs: tuple[str, ...] | list[str] = ()) -> dict[str, str]:
    """A certificate's metadata for `role` (and a tenant's jobs); ValueError for a role not in
    `schema.ROLES`, jobs given to another role, or a job name that a list cannot carry."""
    if role is None:
        if jobs:
            raise ValueError("jobs are a tenant's: give the role too")
        return {}
    if role not in ROLES:
        raise ValueError(f"role {role!r} is not one of {', '.join(ROLES)}")
    if role != TENANT and jobs:
        raise ValueError(f"jobs are a tenant's; a key of role {role} acts on none or all")
    if role == TENANT and not jobs:
        raise ValueError("a tenant's key names the jobs it may act on")
    bad = [j for j in jobs if not j or len(j) > MAX_NAME or any(c in j for c in ',"\n\r')
           or j != j.strip()]
    if bad:
        raise ValueError(f"job name(s) {bad!r}: 1 to {MAX_NAME} characters, no commas, quotes, "
                         "line breaks or blanks around them")
    out = {"role": role}
    if jobs:
        out["jobs"] = ",".join(jobs)
    return out


def _write_certificate(path: pathlib.Path, public: bytes, secret: bytes | None,
                       metadata: dict[str, str]) -> None:
    """A certificate file in zmq.auth's format (metadata section, then curve)."""
    lines = ["#   ZeroMQ CURVE " + ("**Secret** Certificate" if secret else "Public Certificate"),
             "#   written by ptb keys", "", "metadata"]
    lines += [f'    {k} = "{v}"' for k, v in metadata.items()]
    lines += ["curve", f'    public-key = "{public.decode("ascii")}"']
    if secret:
        lines.append(f'    secret-key = "{secret.decode("ascii")}"')
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")


def read_metadata(path: str | os.PathLike) -> dict[str, str]:
    """The metadata section of a certificate file (`key = "value"` lines), values unquoted."""
    out: dict[str, str] = {}
    section = ""
    for raw in pathlib.Path(path).read_text(encoding="utf-8").splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if not raw[0].isspace():
            section = line
            continue
        if section == "metadata" and "=" in line:
            key, _, value = line.partition("=")
            out[key.strip()] = value.strip().strip("'\"")
    return out


def generate(folder: str | os.PathLike, name: str, role: str | None = None,
             jobs: tuple[str, ...] | list[str] = ()) -> tuple[pathlib.Path, pathlib.Path]:
    """Write NAME.key (public, naming `role` and a tenant's `jobs` in its metadata) and
    NAME.key_secret (secret, mode 0600) into `folder`."""
    metadata = role_metadata(role, jobs)
    folder = pathlib.Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    public_file, secret_file = folder / (name + ".key"), folder / (name + ".key_secret")
    for path in (public_file, secret_file):
        if path.exists():
            raise KeyFileError(f"{path} exists; refusing to overwrite it")
    public, secret = zmq.curve_keypair()
    fd = os.open(secret_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    os.close(fd)                                  # (made private before the secret is in it)
    _write_certificate(secret_file, public, secret, metadata)
    _write_certificate(public_file, public, None, metadata)
    return public_file, secret_file


def authorize(public_file: str | os.PathLike, folder: str | os.PathLike) -> pathlib.Path:
    """List a client's public certificate (with the role it names) in the authorised folder;
    the copy there is what servers read."""
    folder = pathlib.Path(folder)
    folder.mkdir(exist_ok=True)
    return pathlib.Path(shutil.copy(public_file, folder / pathlib.Path(public_file).name))


@dataclass(frozen=True)
class Identity:
    """Who sends a request: a listed key's name, its role, and a tenant's jobs. `role` None:
    a process trusted with every role (a bus without CURVE, or a call in the server's own
    process)."""
    name: str
    role: str | None
    jobs: frozenset[str] = frozenset()

    def may(self, roles: frozenset[str]) -> bool:
        return self.role is None or self.role in roles

    def __str__(self) -> str:
        if self.role is None:
            return "a trusted local process (no CURVE)"
        if self.role == TENANT:
            return f"key {self.name!r} (tenant of {', '.join(sorted(self.jobs)) or 'no job'})"
        return f"key {self.name!r} ({self.role})"


TRUSTED = Identity("", None)


def user_name(user_id: str) -> str:
    """The key's name in a User-Id (`NAME PUBLIC-KEY`)."""
    return user_id.split(" ", 1)[0]


@dataclass
class _Listing:
    """The authorised folder as last read: each file's (name, size, mtime, inode), and what
    was read from them."""
    files: tuple = ()
    by_user: dict[str, Identity] = field(default_factory=dict)
    user_of: dict[bytes, str] = field(default_factory=dict)      # z85 public key -> User-Id


class KeyTable:
    """The authorised client keys and their roles, from the folder; read again when a file
    in it changes, looked at no more often than every CHECK_S (`check`). `revocations`
    counts the reads that took a key away or changed what one may do."""

    CHECK_S = 0.25

    def __init__(self, folder: str | os.PathLike):
        self.folder = pathlib.Path(folder)
        self._lock = threading.Lock()
        self._listing = _Listing()
        self._next_check = 0.0
        self._unreadable: str | None = None          # why the folder cannot be read, if so
        self.revocations = 0
        self.refresh()

    def check(self, now: float | None = None) -> None:
        """Read the folder again if CHECK_S has passed since it was last looked at."""
        now = time.monotonic() if now is None else now
        if now >= self._next_check:
            self.refresh(now)

    def refresh(self, now: float | None = None) -> bool:
        """Look at the folder now, and read it again if any file changed; returns whether a
        key was taken away or changed."""
        with self._lock:
            self._next_check = (time.monotonic() if now is None else now) + self.CHECK_S
            files = self._files()
            if files == self._listing.files:
                return False
            listing = self._read(files)
            old = self._listing.by_user
            taken = [u for u, who in old.items() if listing.by_user.get(u) != who]
            self._listing = listing
            if taken:
                self.revocations += 1
                log.warning("keys no longer authorised as they were: %s",
                            ", ".join(sorted(user_name(u) for u in taken)))
            return bool(taken)

    def _files(self) -> tuple:
        """Each certificate file's (name, size, mtime, inode); none when the folder cannot be
        read (said once, until it can again)."""
        try:
            with os.scandir(self.folder) as it:
                files = tuple(sorted((e.name, s.st_size, s.st_mtime_ns, s.st_ino)
                                     for e in it if e.name.endswith(".key")
                                     for s in (e.stat(),)))
        except OSError as e:
            if self._unreadable is None:
                log.error("cannot read the authorised keys folder %s: %s; no key is accepted",
                          self.folder, e.strerror or e)
            self._unreadable = str(e)
            return ()
        self._unreadable = None
        return files

    def _read(self, files: tuple) -> _Listing:
        by_user: dict[str, Identity] = {}
        user_of: dict[bytes, str] = {}
        twice: set[bytes] = set()
        for name, *_ in files:
            path = self.folder / name
            try:
                public, _ = zmq.auth.load_certificate(path)
                if len(z85.decode(public)) != 32:
                    raise ValueError("the public key is not 32 bytes")
                meta = read_metadata(path)
            except (OSError, ValueError, UnicodeDecodeError) as e:
                log.warning("%s is not a client certificate (%s): not accepted", path, e)
                continue
            who = self._identity(path, name[:-len(".key")], meta)
            if who is None:
                continue
            if public in user_of:
                twice.add(public)
            user = f"{who.name} {public.decode('ascii')}"
            user_of[public] = user
            by_user[user] = who
        for public in twice:
            log.warning("the public key %s... is listed in %s more than once, with different "
                        "names: not accepted until one is removed", public[:8].decode(),
                        self.folder)
            by_user = {u: w for u, w in by_user.items() if not u.endswith(public.decode())}
            del user_of[public]
        return _Listing(files, by_user, user_of)

    @staticmethod
    def _identity(path: pathlib.Path, name: str, meta: dict[str, str]) -> Identity | None:
        role = meta.get("role")
        jobs = frozenset(j.strip() for j in meta.get("jobs", "").split(",") if j.strip())
        if role is None:
            log.warning("%s names no role: taken as an observer's key (`ptb keys --role` "
                        "makes keys with one)", path)
            return Identity(name, OBSERVER)
        if role not in ROLES:
            log.warning("%s names role %r, not one of %s: not accepted", path, role,
                        ", ".join(ROLES))
            return None
        return Identity(name, role, jobs if role == TENANT else frozenset())

    def user_id(self, public_z85: bytes) -> str | None:
        """The User-Id a listed public key's connections get (`NAME PUBLIC-KEY`); None: not
        listed."""
        return self._listing.user_of.get(public_z85)

    def identity(self, user_id: str) -> Identity | None:
        """Who a connection's User-Id stands for now; None: its key is no longer listed as
        it was."""
        return self._listing.by_user.get(user_id)

    @property
    def names(self) -> list[str]:
        return sorted(w.name for w in self._listing.by_user.values())


# ---- the ZAP handler --------------------------------------------------------------------------

class Authenticator:
    """A process's ZAP handler for one ZeroMQ context (ZeroMQ asks one handler per context):
    a thread answering ZeroMQ's questions from the `KeyTable`. Shared by the servers of the
    context (`start_authenticator`); stopped when the last of them is done with it."""

    def __init__(self, ctx: zmq.Context, table: KeyTable):
        self.ctx = ctx
        self.table = table
        self.users = 0
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="zap", daemon=True)

    def start(self) -> None:
        self._thread.start()
        self._ready.wait()
        if self._error is not None:
            raise KeyFileError(f"cannot start the bus's key checks: {self._error}")

    def _run(self) -> None:
        sock = self.ctx.socket(zmq.REP)
        try:
            sock.linger = 0
            sock.bind(ZAP_ENDPOINT)
        except zmq.ZMQError as e:
            sock.close(linger=0)          # (left open, it would hold the context's term)
            self._error = e
            self._ready.set()
            return
        self._ready.set()
        try:
            while not self._stop.is_set():
                if sock.poll(100):
                    sock.send_multipart(self._answer(sock.recv_multipart()))
        finally:
            sock.close(linger=0)

    def _answer(self, frames: list[bytes]) -> list[bytes]:
        """A ZAP reply: 200 with the User-Id for a listed CURVE key, 400 otherwise."""
        if len(frames) < 6:
            return [b"1.0", b"", b"500", b"malformed ZAP request", b"", b""]
        version, request_id, _domain, address, _identity, mechanism, *credentials = frames
        if mechanism != b"CURVE" or len(credentials) != 1 or len(credentials[0]) != 32:
            return [version, request_id, b"400", b"CURVE keys only", b"", b""]
        self.table.check()
        public = z85.encode(credentials[0])
        user = self.table.user_id(public)
        if user is None:          # (debug: a refused client tries again ten times a second)
            log.debug("connection from %s with key %s... refused: not in %s",
                      address.decode(errors="replace"), public[:8].decode(), self.table.folder)
            return [version, request_id, b"400", b"key not authorised", b"", b""]
        return [version, request_id, b"200", b"OK", user.encode(), b""]

    def stop(self) -> None:
        """One server is done with it; the thread ends with the last."""
        with _AUTH_LOCK:
            self.users -= 1
            if self.users > 0:
                return
            _AUTHENTICATORS.pop(id(self.ctx), None)
        self._stop.set()
        self._thread.join(5.0)


_AUTHENTICATORS: dict[int, Authenticator] = {}
_AUTH_LOCK = threading.Lock()


def start_authenticator(ctx: zmq.Context, keys: ServerKeys) -> Authenticator:
    """The ZAP handler of this context (started by its first server): CURVE clients whose
    public key is in the authorised folder only, each known by its key's name and role."""
    with _AUTH_LOCK:
        auth = _AUTHENTICATORS.get(id(ctx))
        if auth is not None and auth.ctx is ctx:
            if auth.table.folder.resolve() != keys.authorized.resolve():
                raise KeyFileError(f"servers of one process share its key checks: "
                                   f"{keys.authorized} is not {auth.table.folder}")
            auth.users += 1
            return auth
        auth = Authenticator(ctx, KeyTable(keys.authorized))
        auth.start()
        auth.users = 1
        _AUTHENTICATORS[id(ctx)] = auth
        return auth


def make_server(sock: zmq.Socket, keys: ServerKeys | None) -> None:
    if keys is None:
        return
    sock.curve_secretkey = keys.secret
    sock.curve_publickey = keys.public
    sock.curve_server = True


def make_client(sock: zmq.Socket, keys: ClientKeys | None) -> None:
    if keys is None:
        return
    sock.curve_secretkey = keys.secret
    sock.curve_publickey = keys.public
    sock.curve_serverkey = keys.server_public
