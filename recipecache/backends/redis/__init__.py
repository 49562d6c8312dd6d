"""The Redis backend, for many nodes: redis-py with a connection pool.

The package's parts, each one job: :mod:`.names` every key name (``rc:e:<key>`` the value,
``rc:c:...`` chunks, ``rc:l:<key>`` a lease, ``rc:w:...`` a wake list: all under ``rc:`` so
an ACL can confine the user to ``~rc:*``), :mod:`.manifest` the framing of a value too large
to store inline, :mod:`.chunks` writing and reading its chunks, :mod:`.scripts` the Lua
scripts that write and delete entries and leases atomically, :mod:`.calls` every call
bounded in time, :mod:`.errors` every failure as a :class:`BackendError`, :mod:`.options`
the URL's options and the client settings, :mod:`.doctor` the checks of ``recipecache
doctor``. Redis Cluster and Sentinel (:mod:`recipecache.backends.redis_cluster`,
:mod:`recipecache.backends.redis_sentinel`) are this backend with another client.

Small values are stored inline; larger ones as chunks under a fresh generation id, then a
manifest swapped in by the same script that gives the chunks the entry's expiry (none
without ``?ttl=``): nobody ever sees a partial value, and chunks no manifest names expire
by themselves. Chunks without an expiry that no manifest names (what earlier versions left
when a put failed between its chunks and its manifest) are removed by ``vacuum``
(``recipecache prune`` and ``clear``). A key of another Redis type (``WRONGTYPE``) is damage
under one key, not a failed service: ``get`` reports it as ``corrupt``, and puts and
deletes replace or remove it. Conditional writes (``put_if``, ``delete_if``) read and
compare the value in Python, then let a script apply the write only if the entry's stored
form is still what was read.

Waiting for a lease holder does not poll: a waiter blocks in ``BLMOVE`` on the holder's
wake list ``rc:w:<key>:<token digest>``, and the holder's release (after it published)
pushes one element there, with an expiry, in the same script that deletes the lease.
``BLMOVE`` from a list to itself rotates the element instead of taking it, so every
waiter blocked on that list, and any that arrives later, wakes at once; the list expires
by itself.
"""

from __future__ import annotations

import functools
import logging
import secrets
import urllib.parse
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, ClassVar

import redis
import redis.exceptions

from ...buffers import Buffer
from ...errors import BackendError, VerificationError
from ...health import HealthCheck
from ...reasons import Reason
from ..base import Backend, EntryInfo, LeaseState, check_key, value_matches
from ..url import StoreURL
from . import doctor, scripts
from .calls import MAX_BLOCK_S, RedisCalls
from .chunks import PENDING_CHUNK_TTL_MS, Chunks
from .doctor import ACL_COMMANDS
from .errors import redis_error
from .manifest import FRAMING, INLINE_MAX, MANIFEST_PEEK, MAX_CHUNKS, MAX_VALUE, Manifest, manifest_of, stored_size
from .names import KeyNames
from .options import DEFAULT_CHUNK_SIZE, DEFAULT_TIMEOUT_S, URL_OPTIONS, client_options, tls_options, url_settings

__all__ = ["ACL_COMMANDS", "PENDING_CHUNK_TTL_MS", "Manifest", "RedisBackend"]

log = logging.getLogger(__name__)

#: How long a released lease's wake list outlives the release: waiters that read the
#: holder just before it released still find the element when they block.
WAKE_TTL_MS = 60_000


@dataclass(frozen=True)
class _Loaded:
    """One read of an entry: its stored form and, if readable, the value ``get`` returns."""

    #: 'absent', 'wrongtype' or 'value'
    state: str
    #: the inline value or the manifest, as stored
    raw: bytes | None = None
    value: bytes | None = None
    #: why a stored value cannot be read (``get`` raises it)
    problem: VerificationError | None = None


class RedisBackend(Backend):
    URL_OPTIONS = URL_OPTIONS
    #: how this backend names its keys (a cluster: with hash tags)
    names: ClassVar[KeyNames] = KeyNames()
    #: how this backend bounds its calls
    calls_class: ClassVar[type[RedisCalls]] = RedisCalls

    @classmethod
    def from_url(cls, url: StoreURL) -> RedisBackend:
        """``redis[s]://[user:password@]host:port/db[?ttl=S&chunk_size=SIZE&timeout=S&ssl_*=...]``."""
        settings = url_settings(url)
        if not url.parts.hostname:
            raise url.error("use redis://[user:password@]host:port/db")
        url.check_host(url.parts.hostname)
        url.database(url.parts.path.lstrip("/"), "/0")
        plain_url = urllib.parse.urlunsplit(url.parts._replace(query=urllib.parse.urlencode(tls_options(url))))
        return cls(plain_url, **settings)

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
        self._calls = self.calls_class(
            connect or functools.partial(redis.Redis.from_url, url, **client_options(timeout)), timeout
        )
        self._client: Any = self._calls.client  # redis.Redis, or the cluster backend's lazy client
        self._chunks = Chunks(self._calls, self.names)
        self._swap = self._client.register_script(scripts.SWAP)
        self._delete = self._client.register_script(scripts.DELETE)
        self._cas = self._client.register_script(scripts.COMPARE_AND_WRITE)
        self._renew = self._client.register_script(scripts.RENEW)
        self._release = self._client.register_script(scripts.RELEASE)
        self._lease_add = self._client.register_script(scripts.LEASE_ADD)

    def ping(self) -> None:
        """Raise BackendError unless the server answers; used to validate a URL up front."""
        self._calls.call("ping", self._client.ping)

    # -- values --------------------------------------------------------------------
    def get(self, key: str) -> bytes | None:
        loaded = self._load(key)
        if loaded.problem is not None:
            raise loaded.problem
        return loaded.value

    def _load(self, key: str) -> _Loaded:
        entry = self.names.name("e", key)

        def read() -> bytes | _Loaded | None:
            try:
                return self._client.get(entry)
            except redis.exceptions.ResponseError as exc:
                if str(exc).startswith("WRONGTYPE"):
                    return _Loaded("wrongtype", problem=VerificationError(Reason.CORRUPT, f"{entry} is not a string"))
                raise

        raw = self._calls.call("get", read)
        if isinstance(raw, _Loaded):
            return raw
        if raw is None:
            return _Loaded("absent")
        if not raw.startswith(FRAMING):
            return _Loaded("value", raw, raw)
        try:
            return _Loaded("value", raw, self._chunks.read(key, Manifest.parse(raw)))
        except VerificationError as exc:
            return _Loaded("value", raw, problem=exc)

    def _stored_form(self, key: str, parts: tuple[Buffer, ...]) -> tuple[bytes, list[str]]:
        """What goes under the entry key for ``parts``: the value inline, or a manifest of chunks written here.

        Returns it with the chunk keys written (to delete if the manifest is not swapped in).
        """
        total = sum(len(p) for p in parts)
        if total <= min(self.chunk_size, INLINE_MAX):
            value = b"".join(parts)
            if not value.startswith(FRAMING):
                return value, []
        if total > MAX_VALUE:
            raise BackendError(Reason.BACKEND_FULL, f"value of {total} B is over this backend's {MAX_VALUE} B cap")
        size = max(self.chunk_size, -(-total // MAX_CHUNKS))
        manifest = Manifest(secrets.token_hex(8), -(-total // size), total, size)
        names = self._chunks.write(key, manifest, parts)
        return manifest.encode(), names

    def _publish(self, what: str, key: str, script: Any, args: list[Any], chunk_names: list[str]) -> bool:
        """Run a publishing script (1: published, 0: the entry changed since it was read, or :data:`scripts.CHUNKS_GONE`).

        Chunks written for it that it did not publish are deleted at once, which matters most
        when the server is out of memory; where the outcome is unknown (a timeout, a lost
        connection) they are left to their pending expiry, since the manifest may name them.
        """
        try:
            result = self._calls.call(what, script, keys=self.names.entry_keys(key), args=args)
        except BackendError as exc:
            if exc.reason in (Reason.BACKEND_FULL, Reason.BACKEND_ERROR):  # an error reply: the script wrote nothing
                self._chunks.discard(chunk_names)
            raise
        if result != 1:
            self._chunks.discard(chunk_names)
        if result == scripts.CHUNKS_GONE:
            raise BackendError(
                Reason.BACKEND_ERROR,
                f"redis {what} {key}: chunks of the value were gone before its "
                "manifest was published (evicted, removed, or older than "
                f"{PENDING_CHUNK_TTL_MS // 60_000} min)",
            )
        return result == 1

    def put(self, key: str, value: Buffer, *more: Buffer) -> None:
        stored, chunk_names = self._stored_form(check_key(key), (value, *more))
        self._publish("set", key, self._swap, [stored, self.ttl_ms or ""], chunk_names)

    def put_if(self, key: str, expected: Buffer | None, value: Buffer, *more: Buffer) -> bool:
        current = self._load(check_key(key))
        if not value_matches(current.value, expected):
            return False
        stored, chunk_names = self._stored_form(key, (value, *more))
        return self._compare_and_write(key, current, "set", stored, chunk_names)

    def delete(self, key: str) -> None:
        self._calls.call("del", self._delete, keys=self.names.entry_keys(key), args=[])

    def delete_if(self, key: str, expected: Buffer) -> bool:
        current = self._load(check_key(key))
        return value_matches(current.value, expected) and self._compare_and_write(key, current, "del")

    def _compare_and_write(
        self, key: str, current: _Loaded, action: str, stored: bytes = b"", chunk_names: list[str] | None = None
    ) -> bool:
        args = [current.state, current.raw or b"", action, stored, self.ttl_ms or ""]
        return self._publish("compare and write", key, self._cas, args, chunk_names or [])

    def scan(self, namespace: str | None = None) -> Iterator[EntryInfo]:
        """The entries under this store's names; a key under ``rc:e:`` that no entry of ours has
        (dropped in by hand, or by other software) is skipped, left alone and counted in a warning."""
        strays: list[str] = []
        for names in self._scan_batches(self.names.pattern(namespace)):
            entries = []
            for name in names:
                key = self.names.key_of(name)
                if key is None:
                    strays.append(name.decode(errors="replace"))
                else:
                    entries.append((name, key))
            if entries:
                # sizes without the values: a plain value's length, or the total a manifest names
                pipe = self._client.pipeline(transaction=False)
                for name, _key in entries:
                    pipe.strlen(name)
                    pipe.getrange(name, 0, MANIFEST_PEEK - 1)
                answers = self._calls.call("scan sizes", pipe.execute, raise_on_error=False)
                for (_name, key), length, head in zip(entries, answers[::2], answers[1::2], strict=True):
                    if isinstance(length, redis.exceptions.ResponseError):  # another type: listed, so verify removes it
                        yield EntryInfo(key, 0, 0.0)
                    elif isinstance(length, Exception):
                        raise redis_error(length, "scan sizes")
                    elif length:
                        yield EntryInfo(key, stored_size(head, length), 0.0)
        if strays:
            log.warning(
                "%s: skipped %d key(s) that are no recipecache entry and left them alone: %s%s",
                self.url,
                len(strays),
                ", ".join(map(repr, strays[:3])),
                ", ..." if len(strays) > 3 else "",
            )

    def vacuum(self, namespace: str | None = None) -> int:
        """Delete chunks that never expire and that no manifest names: what earlier versions left
        when a put failed or died between its chunks and its manifest (this version's expire).

        A chunk's generation is never named again once its manifest is replaced, so a chunk
        found unnamed after its own expiry was read is safe to delete.
        """
        removed = 0
        for names in self._scan_batches(self.names.pattern(namespace, "c")):
            chunks = [(name, owner) for name in names if (owner := self.names.chunk_owner(name)) is not None]
            if not chunks:
                continue
            pipe = self._client.pipeline(transaction=False)
            for name, (key, _gen) in chunks:
                pipe.pttl(name)
                pipe.getrange(self.names.name("e", key), 0, MANIFEST_PEEK - 1)
            answers = self._calls.call("vacuum", pipe.execute, raise_on_error=False)
            orphans = [
                name
                for (name, (_key, gen)), pttl, head in zip(chunks, answers[::2], answers[1::2], strict=True)
                if pttl == -1 and manifest_of(head)[0] != gen
            ]
            if orphans:
                self._calls.call("vacuum", self._client.delete, *orphans)
                removed += len(orphans)
        return removed

    def _scan_batches(self, pattern: str) -> Iterator[list[bytes]]:
        """The names matching ``pattern``, a batch per ``SCAN`` call."""
        cursor = 0
        while True:
            cursor, keys = self._calls.call("scan", self._client.scan, cursor, match=pattern, count=500)
            yield keys
            if cursor == 0:
                return

    # -- leases --------------------------------------------------------------------
    def lease_add(self, name: str, token: str, ttl: float) -> bool:
        return bool(
            self._calls.call("lease", self._lease_add, keys=[self.names.name("l", name)], args=[token, int(ttl * 1000)])
        )

    def lease_renew(self, name: str, token: str, ttl: float) -> bool:
        return bool(
            self._calls.call(
                "lease renew", self._renew, keys=[self.names.name("l", name)], args=[token, int(ttl * 1000)]
            )
        )

    def lease_release(self, name: str, token: str) -> None:
        self._calls.call(
            "lease release",
            self._release,
            keys=[self.names.name("l", name), self.names.wake_key(name, token)],
            args=[token, WAKE_TTL_MS],
        )

    def lease_holder(self, name: str) -> LeaseState | None:
        pipe = self._client.pipeline(transaction=False)
        pipe.get(self.names.name("l", name))
        pipe.pttl(self.names.name("l", name))
        token, pttl = self._calls.call("lease holder", pipe.execute)
        if token is None or pttl == -2:  # -2: released or expired between the two commands
            return None
        # -1: a key without expiry is no lease (it would never expire): expired, for lease_add to take over
        return LeaseState(token.decode(errors="replace"), pttl / 1000 if pttl >= 0 else 0.0)

    def lease_wait(self, name: str, token: str, timeout: float) -> bool:
        key = self.names.wake_key(name, token)
        block = min(max(timeout, 0.01), MAX_BLOCK_S)
        return (
            self._calls.within(
                block + self._calls.timeout,
                "lease wait",
                self._calls.blocking().blmove,
                key,
                key,
                block,
                "RIGHT",
                "LEFT",
            )
            is not None
        )

    def close(self) -> None:
        self._calls.close()

    # -- doctor --------------------------------------------------------------------
    def health_checks(self, probe_key: str) -> list[HealthCheck]:
        """Whether the user may run every command in :data:`ACL_COMMANDS`, and the clock against ``TIME``."""
        keyed = self.names.name("e", probe_key)
        return [doctor.acl_check(self._acl_probes(keyed)), doctor.clock_check(self._run_keyless)]

    def _connection_kwargs(self) -> dict[str, Any]:
        """The settings the client's connections are made with."""
        return self._client.connection_pool.connection_kwargs

    def _run_keyless(self, *args: Any) -> Any:
        """Send a command that names no key (``PING``, ``TIME``...): a cluster sends it to one node."""
        return self._client.execute_command(*args)

    def _acl_probes(self, key: str) -> dict[str, Callable[[], Any]]:
        """One harmless call of each command in :data:`ACL_COMMANDS` on ``key`` (:func:`.doctor.acl_probes`)."""
        return doctor.acl_probes(key, self._client.execute_command, self._run_keyless, self._connection_kwargs())
