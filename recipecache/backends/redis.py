"""The Redis backend, for many nodes: redis-py with a connection pool.

Keys (all under ``rc:`` so an ACL can confine the user to ``~rc:*``)::

    rc:e:<key>                   the value, or a chunk manifest for large values
    rc:c:<key>:<gen>:<i>         chunk i of generation gen
    rc:l:<key>                   a lease: the owner token, with a PX expiry
    rc:w:<key>:<digest>          the wake list of the lease holder whose token hashes to digest

Values above ``chunk_size`` are split: the chunks are written first under a fresh
generation id, then the manifest is swapped in with one ``SET ... GET``; a reader that
finds a manifest fetches every chunk in one ``MGET`` and treats a missing chunk as a
miss, so nobody ever sees a partial value. The old generation's chunks are deleted after
the swap. Leases are ``SET NX PX`` plus Lua compare-and-renew / compare-and-delete.

Waiting for a lease holder does not poll: a waiter blocks in ``BLMOVE`` on the holder's
wake list ``rc:w:<key>:<token digest>``, and the holder's release (after it published)
pushes one element there, with an expiry, in the same script that deletes the lease.
``BLMOVE`` from a list to itself rotates the element instead of taking it, so every
waiter blocked on that list, and any that arrives later, wakes at once; the list expires
by itself. Blocking calls go through a second connection pool whose socket timeout
exceeds the longest block (:data:`MAX_BLOCK_S`), so a long wait is not a timeout.

Every Redis failure becomes a :class:`BackendError`: ``backend_down`` (connection),
``backend_slow`` (socket timeout), ``backend_full`` (OOM under ``maxmemory``) or
``backend_error``.
"""

from __future__ import annotations

import functools
import hashlib
import secrets
import struct
import threading
import urllib.parse
from collections.abc import Callable, Iterator
from typing import Any

import redis
import redis.exceptions
from redis.backoff import ExponentialBackoff
from redis.retry import Retry

from ..errors import BackendError
from ..reasons import Reason
from .base import Backend, EntryInfo, LeaseState, check_key
from .url import StoreURL

#: Every command this backend sends, as ACL names; deploy/ builds its ACL user from this
#: list. redis-py also sends ``CLIENT SETINFO`` on connect (Redis >= 7.2) and ignores a
#: refusal, so the user needs no ``client`` rights. Lua scripts run with the caller's
#: rights, so their commands are listed too.
ACL_COMMANDS = (
    "get", "getrange", "strlen", "set", "del", "mget", "scan", "pexpire", "pttl", "rpush", "blmove", "evalsha",
    "script|load", "ping", "auth", "hello",
)

_MANIFEST = b"RCM1"
_MANIFEST_HEAD = struct.Struct(">4sIQ")  # magic, chunk count, total size; then the generation id
#: bytes of a value's start that hold a whole manifest (what ``scan`` and the swap script peek at)
_MANIFEST_PEEK = 64

# Publish a value and hand back the previous one only if it was a chunk manifest (whose
# chunks the caller then deletes): a plain ``SET ... GET`` would ship the whole old value
# back over the network on every overwrite.
_SWAP = """
local old = redis.call('getrange', KEYS[1], 0, 63)
if ARGV[2] == '' then
  redis.call('set', KEYS[1], ARGV[1])
else
  redis.call('set', KEYS[1], ARGV[1], 'PX', ARGV[2])
end
if string.sub(old, 1, 4) == 'RCM1' then
  return old
end
return false
"""
_RENEW = """
if redis.call('get', KEYS[1]) == ARGV[1] then
  return redis.call('pexpire', KEYS[1], ARGV[2])
end
return 0
"""
# Delete the lease if ARGV[1] holds it, and wake its waiters: one element on its wake
# list KEYS[2], which expires after ARGV[2] ms (waiters rotate it, never empty it).
_RELEASE = """
if redis.call('get', KEYS[1]) == ARGV[1] then
  redis.call('del', KEYS[1])
  redis.call('rpush', KEYS[2], '1')
  redis.call('pexpire', KEYS[2], ARGV[2])
  return 1
end
return 0
"""


def _error(exc: redis.exceptions.RedisError, what: str) -> BackendError:
    reason: Reason
    if isinstance(exc, redis.exceptions.TimeoutError):
        reason = Reason.BACKEND_SLOW
    elif isinstance(exc, (redis.exceptions.ConnectionError, redis.exceptions.AuthenticationError)):
        reason = Reason.BACKEND_DOWN
    elif isinstance(exc, redis.exceptions.ResponseError) and str(exc).startswith("OOM"):
        reason = Reason.BACKEND_FULL
    else:
        reason = Reason.BACKEND_ERROR
    return BackendError(reason, f"redis {what}: {exc}")


#: redis-py's own TLS settings, passed through in a ``rediss://`` URL's query
TLS_OPTIONS = frozenset({"ssl_ca_certs", "ssl_certfile", "ssl_keyfile", "ssl_cert_reqs", "ssl_check_hostname"})
DEFAULT_CHUNK_SIZE = 8 * 1024 * 1024
DEFAULT_TIMEOUT_S = 5.0
#: The longest one ``lease_wait`` blocks in Redis; a caller waiting longer calls again.
MAX_BLOCK_S = 30.0
#: How long a released lease's wake list outlives the release: waiters that read the
#: holder just before it released still find the element when they block.
WAKE_TTL_MS = 60_000


def client_options(timeout: float) -> dict[str, Any]:
    """redis-py connection settings of every client this backend makes (plain, cluster, sentinel)."""
    return {
        "socket_connect_timeout": timeout,
        "health_check_interval": 30,
        # one quick retry for a dropped connection; redis-py's default retries turn a
        # wrong password or a dead server into seconds of stall per call
        "retry": Retry(ExponentialBackoff(cap=0.2, base=0.02), 1),
    }


class RedisBackend(Backend):
    URL_OPTIONS = frozenset({"ttl", "chunk_size", "timeout"}) | TLS_OPTIONS

    @classmethod
    def from_url(cls, url: StoreURL) -> RedisBackend:
        """``redis[s]://[user:password@]host:port/db[?ttl=S&chunk_size=SIZE&timeout=S&ssl_*=...]``."""
        url.check_options(cls.URL_OPTIONS)
        if not url.parts.hostname:
            raise url.error("use redis://[user:password@]host:port/db")
        db = url.parts.path.lstrip("/")
        if db and not db.isdigit():
            raise url.error(f"bad database {db!r}: use a number such as /0")
        tls = {k: v for k, v in url.options.items() if k in TLS_OPTIONS}
        if tls and url.scheme != "rediss":
            raise url.error(f"option {sorted(tls)[0]!r} needs TLS: use rediss://")
        plain_url = urllib.parse.urlunsplit(url.parts._replace(query=urllib.parse.urlencode(tls)))
        return cls(
            plain_url,
            redacted_url=url.redacted,
            ttl=url.seconds("ttl", None),
            chunk_size=url.size("chunk_size", DEFAULT_CHUNK_SIZE) or DEFAULT_CHUNK_SIZE,
            timeout=url.seconds("timeout", DEFAULT_TIMEOUT_S) or DEFAULT_TIMEOUT_S,
        )

    def __init__(
        self,
        url: str,
        *,
        redacted_url: str,
        ttl: float | None = None,
        chunk_size: int = DEFAULT_CHUNK_SIZE,
        timeout: float = DEFAULT_TIMEOUT_S,
        connect: Callable[..., Any] | None = None,
    ) -> None:
        """``connect(socket_timeout=S)`` makes a redis-py client (default: one server at ``url``)."""
        self.url = redacted_url
        self.ttl_ms = int(ttl * 1000) if ttl else None
        self.chunk_size = chunk_size
        self._timeout = timeout
        self._connect = connect or functools.partial(redis.Redis.from_url, url, **client_options(timeout))
        self._client = self._connect(socket_timeout=timeout)
        self._blocking_client: Any = None
        self._blocking_lock = threading.Lock()
        self._swap = self._client.register_script(_SWAP)
        self._renew = self._client.register_script(_RENEW)
        self._release = self._client.register_script(_RELEASE)

    def _call(self, what: str, fn: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except redis.exceptions.RedisError as exc:
            raise _error(exc, what) from None

    def ping(self) -> None:
        """Raise BackendError unless the server answers; used to validate a URL up front."""
        self._call("ping", self._client.ping)

    # -- values --------------------------------------------------------------------
    def get(self, key: str) -> bytes | None:
        value = self._call("get", self._client.get, self._name("e", key))
        if value is None or not value.startswith(_MANIFEST):
            return value
        count, total, gen = self._parse_manifest(value)
        chunks = self._call("mget", self._client.mget, [self._chunk_key(key, gen, i) for i in range(count)])
        if any(c is None for c in chunks):
            return None  # the entry is being replaced or was partly evicted: a plain miss
        data = b"".join(chunks)
        return data if len(data) == total else None

    def put(self, key: str, value: bytes) -> None:
        entry = self._name("e", key)
        if len(value) > self.chunk_size:
            gen = secrets.token_hex(8)
            count = -(-len(value) // self.chunk_size)
            view = memoryview(value)
            pipe = self._client.pipeline(transaction=False)
            for i in range(count):
                pipe.set(self._chunk_key(key, gen, i), view[i * self.chunk_size : (i + 1) * self.chunk_size], px=self.ttl_ms)
            self._call("set chunks", pipe.execute)
            value = _MANIFEST_HEAD.pack(_MANIFEST, count, len(value)) + gen.encode()
        old = self._call("set", self._swap, keys=[entry], args=[value, self.ttl_ms or ""])
        if old:
            self._delete_chunks(key, old)

    def delete(self, key: str) -> None:
        old = self._call("get", self._client.get, self._name("e", key))
        self._call("del", self._client.delete, self._name("e", key))
        if old is not None and old.startswith(_MANIFEST):
            self._delete_chunks(key, old)

    def scan(self, namespace: str | None = None) -> Iterator[EntryInfo]:
        for keys in self._scan_batches(self._pattern(namespace)):
            if keys:
                # sizes without the values: a plain value's length, or the total a manifest names
                pipe = self._client.pipeline(transaction=False)
                for k in keys:
                    pipe.strlen(k)
                    pipe.getrange(k, 0, _MANIFEST_PEEK - 1)
                answers = self._call("scan sizes", pipe.execute)
                for k, length, head in zip(keys, answers[::2], answers[1::2], strict=True):
                    if length:
                        size = self._parse_manifest(head)[1] if head.startswith(_MANIFEST) else length
                        yield EntryInfo(self._key_of(k.decode()), size, 0.0)

    def _scan_batches(self, pattern: str) -> Iterator[list[bytes]]:
        """The names matching ``pattern``, a batch per ``SCAN`` call."""
        cursor = 0
        while True:
            cursor, keys = self._call("scan", self._client.scan, cursor, match=pattern, count=500)
            yield keys
            if cursor == 0:
                return

    # -- key names -----------------------------------------------------------------
    # The only place Redis key names are made, so that a cluster can keep every key of one
    # entry (value, chunks, lease, wake list) in one hash slot (recipecache.backends.redis_cluster).
    def _name(self, kind: str, key: str) -> str:
        """The Redis key of ``kind`` (``e`` value, ``c`` chunk prefix, ``l`` lease, ``w`` wake list) for ``key``."""
        return f"rc:{kind}:{check_key(key)}"

    def _pattern(self, namespace: str | None) -> str:
        """A ``SCAN`` pattern for the values of one namespace, or of every namespace."""
        return f"rc:e:{namespace}/*" if namespace else "rc:e:*"

    def _key_of(self, name: str) -> str:
        """The backend key of a value's Redis key (the inverse of ``_name("e", key)``)."""
        return name[len("rc:e:"):]

    # -- chunks --------------------------------------------------------------------
    def _chunk_key(self, key: str, gen: str, index: int) -> str:
        return f"{self._name('c', key)}:{gen}:{index}"

    @staticmethod
    def _parse_manifest(value: bytes) -> tuple[int, int, str]:
        _magic, count, total = _MANIFEST_HEAD.unpack_from(value)
        return count, total, value[_MANIFEST_HEAD.size :].decode()

    def _delete_chunks(self, key: str, manifest: bytes) -> None:
        count, _total, gen = self._parse_manifest(manifest)
        self._call("del", self._client.delete, *[self._chunk_key(key, gen, i) for i in range(count)])

    # -- leases --------------------------------------------------------------------
    def lease_add(self, name: str, token: str, ttl: float) -> bool:
        return bool(self._call("lease", self._client.set, self._name("l", name), token, nx=True, px=int(ttl * 1000)))

    def lease_renew(self, name: str, token: str, ttl: float) -> bool:
        return bool(self._call("lease renew", self._renew, keys=[self._name("l", name)], args=[token, int(ttl * 1000)]))

    def lease_release(self, name: str, token: str) -> None:
        self._call("lease release", self._release, keys=[self._name("l", name), self._wake_key(name, token)],
                   args=[token, WAKE_TTL_MS])

    def lease_holder(self, name: str) -> LeaseState | None:
        pipe = self._client.pipeline(transaction=False)
        pipe.get(self._name("l", name))
        pipe.pttl(self._name("l", name))
        token, pttl = self._call("lease holder", pipe.execute)
        if token is None or pttl == -2:  # -2: released or expired between the two commands
            return None
        # -1: a lease without expiry (not one of ours): look again after the longest block
        return LeaseState(token.decode(errors="replace"), pttl / 1000 if pttl >= 0 else MAX_BLOCK_S)

    def lease_wait(self, name: str, token: str, timeout: float) -> bool:
        key = self._wake_key(name, token)
        block = min(max(timeout, 0.01), MAX_BLOCK_S)
        return self._call("lease wait", self._blocking().blmove, key, key, block, "RIGHT", "LEFT") is not None

    def _wake_key(self, name: str, token: str) -> str:
        return f"{self._name('w', name)}:{hashlib.sha256(token.encode()).hexdigest()[:16]}"

    def _blocking(self) -> Any:
        """The client for blocking calls, made on first use: most processes never wait."""
        with self._blocking_lock:
            if self._blocking_client is None:
                self._blocking_client = self._connect(socket_timeout=MAX_BLOCK_S + self._timeout)
            return self._blocking_client

    def close(self) -> None:
        self._client.close()
        if self._blocking_client is not None:
            self._blocking_client.close()
