"""CurveZMQ on the bus: servers hold a key pair and accept only listed client keys (ZAP).

Keys are ZeroMQ certificate files as `ptb keys` writes them (zmq.auth's format): `NAME.key`
holds the public key, `NAME.key_secret` both. A server reads its secret certificate and a
folder of authorised client public certificates; a client reads its own secret certificate and
the server's public one. Without CURVE (loopback runs that turn it off explicitly) nothing here
is used.
"""
from __future__ import annotations

import logging
import os
import pathlib
from dataclasses import dataclass

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator

log = logging.getLogger(__name__)


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


def generate(folder: str | os.PathLike, name: str) -> tuple[pathlib.Path, pathlib.Path]:
    """Write NAME.key (public) and NAME.key_secret (secret, mode 0600) into `folder`."""
    folder = pathlib.Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    for suffix in (".key", ".key_secret"):
        if (folder / (name + suffix)).exists():
            raise KeyFileError(f"{folder / (name + suffix)} exists; refusing to overwrite it")
    public, secret = zmq.auth.create_certificates(folder, name)
    os.chmod(secret, 0o600)
    return pathlib.Path(public), pathlib.Path(secret)


def start_authenticator(ctx: zmq.Context, keys: ServerKeys) -> ThreadAuthenticator:
    """ZAP handler for this context: CURVE clients whose public key is in the folder only."""
    auth = ThreadAuthenticator(ctx, log=logging.getLogger(__name__ + ".zap"))
    auth.start()
    auth.configure_curve(domain="*", location=str(keys.authorized))
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
