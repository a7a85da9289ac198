"""A client of etcd's v3 API through its JSON gateway (HTTP, no gRPC): what the agent needs of a
cluster, and nothing faked.

- `Etcd(["127.0.0.1:2379", ...])`: the members; a call goes to the member that answered last
  and, when that one is down, refuses, or has no leader, to the next, until the call's
  deadline. `EtcdUnavailable` then says which members were tried and what each said.
- Keys and values are bytes (str is taken as UTF-8); the gateway's base64 and its int64
  strings stay in here. `KV` is one key as read (value, create/mod revision, version, lease).
- `txn(compare, success)`: etcd's transaction; `Compare` builds its conditions
  (`Compare.lease(key, id)`: the key is held under this lease, the fence of a leader's
  writes). The answer says whether it succeeded (the gateway leaves out a false one).
- Leases: `grant(ttl)`, `keepalive(id)` (the TTL left; 0: the lease is gone), `revoke(id)`.
- `watch(key, end, revision)`: the changes from `revision` on, batch by batch, on a stream of
  its own (`Watch`), ended by a lost member or leader, silence, compaction or `close()`.
- Every request carries `hasleader`: a member cut off from its cluster's leader answers at
  once that it has none (503) instead of waiting, and the call moves on to another member.

Connections are kept per thread (http.client is not thread safe): a client may be shared by
threads, each talks to the cluster on its own connection.
"""
from __future__ import annotations

import base64
import http.client
import json
import socket
import threading
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["KV", "Compare", "Etcd", "EtcdCompacted", "EtcdError", "EtcdUnavailable", "Event",
           "Watch", "WatchSilent", "prefix_end", "put_op", "range_op", "delete_op",
           "parse_endpoints"]

DEFAULT_TIMEOUT_S = 3.0
ATTEMPT_S = 0.5             # a member is given at least this long before the next is asked
BIG_BYTES = 1 << 20         # ... a request larger than this, the whole deadline


class EtcdError(Exception):
    """etcd refused a request (the message is etcd's own), or answered what is not etcd's."""


class EtcdUnavailable(EtcdError):
    """No member of the cluster answered the request within its deadline (down, unreachable,
    or without a leader: no quorum)."""


def _b64(x: bytes | str) -> str:
    return base64.b64encode(x.encode() if isinstance(x, str) else x).decode()


def _unb64(s: str | None) -> bytes:
    return base64.b64decode(s) if s else b""


def prefix_end(prefix: bytes | str) -> bytes:
    """The range end that makes a range every key starting with `prefix`."""
    b = bytearray(prefix.encode() if isinstance(prefix, str) else prefix)
    while b and b[-1] == 0xFF:
        b.pop()
    if not b:
        return b"\0"
    b[-1] += 1
    return bytes(b)


def parse_endpoints(text: str | Sequence[str]) -> list[tuple[str, int]]:
    """"HOST:PORT,HOST:PORT" (an http:// in front is allowed; IPv6 as [::1]:PORT) as
    (host, port) pairs; ValueError saying what is wrong."""
    items = text.split(",") if isinstance(text, str) else list(text)
    out = []
    for raw in items:
        item = raw.strip()
        for scheme in ("http://",):
            if item.startswith(scheme):
                item = item[len(scheme):]
        if item.startswith("https://"):
            raise ValueError(f"etcd member {raw!r}: TLS (https) is not supported; use a "
                             "member's plain client URL on a trusted network")
        item = item.rstrip("/")
        host, sep, port = item.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"etcd member {raw!r} is not HOST:PORT")
        out.append((host.strip("[]"), int(port)))
    if not out:
        raise ValueError("no etcd member given")
    return out


@dataclass(frozen=True)
class KV:
    """One key as etcd has it."""
    key: bytes
    value: bytes
    create_revision: int
    mod_revision: int
    version: int
    lease: int

    @classmethod
    def of(cls, d: Mapping[str, Any]) -> KV:
        return cls(_unb64(d.get("key")), _unb64(d.get("value")),
                   int(d.get("create_revision", 0)), int(d.get("mod_revision", 0)),
                   int(d.get("version", 0)), int(d.get("lease", 0)))


class Compare:
    """Conditions of a transaction (etcd's Compare), as the gateway takes them."""

    @staticmethod
    def lease(key: bytes | str, lease: int) -> dict:
        """`key` exists and is held under `lease`."""
        return {"key": _b64(key), "result": "EQUAL", "target": "LEASE", "lease": str(lease)}

    @staticmethod
    def absent(key: bytes | str) -> dict:
        """`key` does not exist."""
        return {"key": _b64(key), "result": "EQUAL", "target": "CREATE",
                "create_revision": "0"}

    @staticmethod
    def mod(key: bytes | str, revision: int) -> dict:
        """`key` was last written at `revision` (0: it does not exist)."""
        return {"key": _b64(key), "result": "EQUAL", "target": "MOD",
                "mod_revision": str(revision)}


def put_op(key: bytes | str, value: bytes | str, lease: int = 0) -> dict:
    put: dict[str, Any] = {"key": _b64(key), "value": _b64(value)}
    if lease:
        put["lease"] = str(lease)
    return {"request_put": put}


def range_op(key: bytes | str, end: bytes | None = None, *, limit: int = 0,
             last_first: bool = False, keys_only: bool = False) -> dict:
    """A read of the keys from `key` to `end` (`key` alone without it), as a transaction's
    operation (`Etcd.range` sends its body alone)."""
    body: dict[str, Any] = {"key": _b64(key)}
    if end is not None:
        body["range_end"] = _b64(end)
    if limit:
        body["limit"] = str(limit)
    if last_first:
        body.update(sort_order="DESCEND", sort_target="KEY")
    if keys_only:
        body["keys_only"] = True
    return {"request_range": body}


def delete_op(key: bytes | str, end: bytes | None = None) -> dict:
    """A deletion of `key` (the keys from `key` to `end`), as a transaction's operation."""
    body = {"key": _b64(key)}
    if end is not None:
        body["range_end"] = _b64(end)
    return {"request_delete_range": body}


class EtcdCompacted(EtcdError):
    """A watch asked from a revision etcd has compacted away: read the keys whole again."""

    def __init__(self, message: str, revision: int):
        super().__init__(message)
        self.revision = revision


@dataclass(frozen=True)
class Event:
    """One change a watch saw: the key as written (`deleted`: its deletion, value empty)."""
    kv: KV
    deleted: bool = False


class WatchSilent(EtcdUnavailable):
    """A watch that said nothing for a while: the stream may have been cut without a word."""


class Watch:
    """A watch of the keys from `key` to `end` from `revision` on, on one member (a stream of
    its own): iterate it for each batch of changes as (the store's revision, events); it ends
    with EtcdUnavailable when the member is lost, has lost its leader (the watch asks with
    `hasleader`) or said nothing for `silent_s` (a stream cut off without a word), with
    EtcdCompacted when `revision` is compacted away. `close()` from another thread ends it."""

    def __init__(self, member: tuple[str, int], key: bytes | str, end: bytes | None,
                 revision: int, silent_s: float):
        self.member = member
        self._conn = http.client.HTTPConnection(*member, timeout=silent_s)
        body: dict[str, Any] = {"key": _b64(key), "start_revision": str(revision)}
        if end is not None:
            body["range_end"] = _b64(end)
        self._body = json.dumps({"create_request": body}).encode()
        self._closed = False

    def __iter__(self) -> Iterator[tuple[int, list[Event]]]:
        where = f"etcd {self.member[0]}:{self.member[1]}"
        if self._closed:
            return
        try:
            self._conn.request("POST", "/v3/watch", self._body,
                               {"Content-Type": "application/json",
                                "Grpc-Metadata-hasleader": "true"})
            r = self._conn.getresponse()
            if r.status != 200:
                raise EtcdUnavailable(f"{where} refused a watch (HTTP {r.status}): "
                                      f"{r.read()[:200]!r}")
            while not self._closed:
                line = r.readline()
                if not line:
                    raise EtcdUnavailable(f"{where} ended the watch")
                got = json.loads(line)
                if "error" in got:
                    raise EtcdUnavailable(f"{where}: the watch failed: "
                                          f"{got['error'].get('message', got['error'])}")
                result = got.get("result", {})
                if int(result.get("compact_revision", 0)):
                    raise EtcdCompacted(f"{where}: revisions up to {result['compact_revision']}"
                                        " are compacted", int(result["compact_revision"]))
                if result.get("canceled"):
                    raise EtcdUnavailable(f"{where} canceled the watch: "
                                          f"{result.get('cancel_reason', 'no reason given')}")
                events = [Event(KV.of(e.get("kv", {})), e.get("type") == "DELETE")
                          for e in result.get("events", ())]
                yield int(result.get("header", {}).get("revision", 0)), events
        except TimeoutError:
            if not self._closed:
                raise WatchSilent(f"{where}: the watch said nothing for "
                                  f"{self._conn.timeout} s") from None
        except (OSError, http.client.HTTPException, ValueError) as e:
            if not self._closed:
                raise EtcdUnavailable(f"{where}: the watch was cut: {type(e).__name__}: {e}"
                                      ) from None
        finally:
            self._conn.close()

    def close(self) -> None:
        self._closed = True
        sock = self._conn.sock
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


class Etcd:
    """A client of an etcd cluster (see the module's text)."""

    def __init__(self, endpoints: str | Sequence[str], timeout: float = DEFAULT_TIMEOUT_S):
        self.members = parse_endpoints(endpoints)
        self.timeout = float(timeout)
        self._local = threading.local()
        self._preferred = 0

    def __repr__(self) -> str:
        return f"Etcd({','.join(f'{h}:{p}' for h, p in self.members)})"

    # --- the wire -------------------------------------------------------------------------
    def _connection(self, i: int, timeout: float) -> http.client.HTTPConnection:
        conns: dict[int, http.client.HTTPConnection] = self._local.__dict__.setdefault(
            "conns", {})
        c = conns.get(i)
        if c is None:
            host, port = self.members[i]
            c = conns[i] = http.client.HTTPConnection(host, port, timeout=timeout)
        else:
            c.timeout = timeout
            if c.sock is not None:
                c.sock.settimeout(timeout)
        return c

    def _drop(self, i: int) -> None:
        c = self._local.__dict__.get("conns", {}).pop(i, None)
        if c is not None:
            c.close()

    def call(self, path: str, body: Mapping[str, Any], timeout: float | None = None) -> dict:
        """POST `body` to /v3/`path` on a member with a leader; its answer (JSON). Members are
        tried in turn until `timeout` (the client's by default) has passed, each for its share
        of it (at least `ATTEMPT_S`) to begin its answer, then what is left to read it: a member
        that takes the connection but never answers (stopped, its disk wedged) does not keep
        the call from the others, and a long answer (a whole journal) is read whole."""
        total = self.timeout if timeout is None else timeout
        deadline = time.monotonic() + total
        payload = json.dumps(body).encode()
        # (a big request's upload and parsing alone may take a share: it has the whole time)
        share = total if len(payload) > BIG_BYTES else max(ATTEMPT_S, total / len(self.members))
        said: dict[str, str] = {}
        n = len(self.members)
        attempt = 0
        while True:
            i = (self._preferred + attempt) % n
            left = deadline - time.monotonic()
            if left <= 0:
                tried = "; ".join(f"{m}: {w}" for m, w in said.items()) or "none in time"
                raise EtcdUnavailable(f"no etcd member answered /v3/{path} within "
                                      f"{self.timeout if timeout is None else timeout:.1f} s "
                                      f"({tried})")
            host, port = self.members[i]
            try:
                c = self._connection(i, max(0.05, min(left, share)))
                c.request("POST", f"/v3/{path}", payload,
                          {"Content-Type": "application/json",
                           "Grpc-Metadata-hasleader": "true"})
                r = c.getresponse()
                if c.sock is not None:          # (answering: the rest of the deadline to read it)
                    c.sock.settimeout(max(0.05, deadline - time.monotonic()))
                data = r.read()
            except (OSError, http.client.HTTPException) as e:
                self._drop(i)
                said[f"{host}:{port}"] = f"{type(e).__name__}: {e}" if str(e) else \
                    type(e).__name__
                attempt += 1
                if attempt % n == 0:
                    time.sleep(min(0.05, max(0.0, deadline - time.monotonic())))
                continue
            try:
                answer = json.loads(data) if data else {}
            except ValueError:
                raise EtcdError(f"{host}:{port} answered /v3/{path} with what is not JSON "
                                f"(HTTP {r.status}): {data[:120]!r}") from None
            if r.status == 200:
                self._preferred = i
                return answer
            message = answer.get("message") or answer.get("error") or data[:200].decode(
                errors="replace")
            if r.status in (503, 500) and ("leader" in message or "timed out" in message
                                            or "deadline" in message
                                            or "stopped" in message):
                said[f"{host}:{port}"] = message        # no leader here: another member may
                attempt += 1
                if attempt % n == 0:
                    time.sleep(min(0.05, max(0.0, deadline - time.monotonic())))
                continue
            raise EtcdError(f"etcd {host}:{port} refused /v3/{path}: {message}")

    def close(self) -> None:
        for i in list(self._local.__dict__.get("conns", {})):
            self._drop(i)

    # --- keys -----------------------------------------------------------------------------
    def get(self, key: bytes | str, *, timeout: float | None = None) -> KV | None:
        kvs, _ = self.range(key, timeout=timeout)
        return kvs[0] if kvs else None

    def range(self, key: bytes | str, end: bytes | None = None, *, limit: int = 0,
              last_first: bool = False, keys_only: bool = False,
              timeout: float | None = None) -> tuple[list[KV], int]:
        """The keys from `key` to `end` (`key` alone without it; the last ones first with
        `last_first`), and the store's revision."""
        got = self.call("kv/range", range_op(key, end, limit=limit, last_first=last_first,
                                             keys_only=keys_only)["request_range"], timeout)
        return [KV.of(d) for d in got.get("kvs", ())], int(got["header"]["revision"])

    def prefix(self, prefix: bytes | str, *, timeout: float | None = None
               ) -> tuple[list[KV], int]:
        return self.range(prefix, prefix_end(prefix), timeout=timeout)

    def put(self, key: bytes | str, value: bytes | str, lease: int = 0, *,
            timeout: float | None = None) -> int:
        """Write `key`; the revision it was written at."""
        got = self.call("kv/put", put_op(key, value, lease)["request_put"], timeout)
        return int(got["header"]["revision"])

    def txn(self, compare: Iterable[dict], success: Iterable[dict],
            failure: Iterable[dict] = (), *, timeout: float | None = None
            ) -> tuple[bool, dict]:
        """etcd's transaction: whether every condition held (then `success` ran, else
        `failure`), and the answer."""
        got = self.call("kv/txn", {"compare": list(compare), "success": list(success),
                                   "failure": list(failure)}, timeout)
        return bool(got.get("succeeded", False)), got

    @staticmethod
    def revision_of(answer: Mapping[str, Any]) -> int:
        return int(answer["header"]["revision"])

    def watch(self, key: bytes | str, end: bytes | None, revision: int, *,
              silent_s: float = 5.0, avoid: tuple[str, int] | None = None) -> Watch:
        """A watch of the keys from `key` to `end` from `revision` on (see `Watch`), on the
        member that answered last, or the next if that is `avoid` (whose watch failed)."""
        i = self._preferred % len(self.members)
        if self.members[i] == avoid and len(self.members) > 1:
            i = self._preferred = (i + 1) % len(self.members)
        return Watch(self.members[i], key, end, revision, silent_s)

    # --- leases ---------------------------------------------------------------------------
    def grant(self, ttl: int, *, timeout: float | None = None) -> tuple[int, int]:
        """A new lease: its id and the TTL etcd granted (it may round a short one up)."""
        got = self.call("lease/grant", {"TTL": str(int(ttl))}, timeout)
        if got.get("error"):
            raise EtcdError(f"etcd granted no lease: {got['error']}")
        return int(got["ID"]), int(got.get("TTL", ttl))

    def keepalive(self, lease: int, *, timeout: float | None = None) -> int:
        """Refresh `lease`: the TTL it has now (0: it has expired or was revoked)."""
        got = self.call("lease/keepalive", {"ID": str(lease)}, timeout)
        return int(got.get("result", got).get("TTL", 0))

    def revoke(self, lease: int, *, timeout: float | None = None) -> None:
        self.call("lease/revoke", {"ID": str(lease)}, timeout)

    # --- the cluster ----------------------------------------------------------------------
    def health(self, timeout: float = 1.0) -> dict[str, str]:
        """Each member's own word on its health ("ok", or what it says is wrong)."""
        out = {}
        for host, port in self.members:
            c = http.client.HTTPConnection(host, port, timeout=timeout)
            try:
                c.request("GET", "/health")
                r = c.getresponse()
                got = json.loads(r.read() or b"{}")
                ok = str(got.get("health")) == "true"
                out[f"{host}:{port}"] = "ok" if ok else (got.get("reason") or "unhealthy")
            except (OSError, http.client.HTTPException, ValueError) as e:
                out[f"{host}:{port}"] = f"down ({type(e).__name__})"
            finally:
                c.close()
        return out
