"""The Redis backend, for many nodes: redis-py with a connection pool.

Keys (all under ``rc:`` so an ACL can confine the user to ``~rc:*``)::

    rc:e:<key>                   the value, or a chunk manifest for values above 64 KiB
    rc:c:<key>:<gen>:<i>         chunk i of generation gen
    rc:l:<key>                   a lease: the owner token, with a PX expiry
    rc:w:<key>:<digest>          the wake list of the lease holder whose token hashes to digest

Every name is made by one method (``RedisBackend._name``), so that Redis Cluster
(:mod:`.redis_cluster`) can give all the keys of one entry one hash tag and one slot.

Small values are stored inline. Larger ones are split into chunks of ``chunk_size``
bytes, written with plain ``SET`` (slices of the caller's buffers, never joined, except a
chunk that straddles two of them) under a fresh generation id, each expiring after
:data:`PENDING_CHUNK_TTL_MS`; then a manifest ``RCM2:<gen>:<count>:<total>:<chunk size>``
is swapped in, and the same script gives the chunks the entry's expiry (none without
``?ttl=``). The chunks of a put that fails or dies before its manifest therefore expire by
themselves (and a failed one deletes them at once where it knows its manifest was not
written), and a manifest whose chunks are gone by then is not published (the put fails).
The manifest names the writer's chunk size, so a reader with another ``chunk_size`` reads
it all the same. A reader validates a manifest before it fetches anything
(:class:`Manifest`: its length and characters, ``count == ceil(total / chunk size)``, caps
on count and size), asks the server for every chunk's length (``STRLEN``) and fetches the
chunks with ``MGET`` only when each is as long as the manifest says, so a damaged
manifest never makes a reader download more than it names: a damaged manifest or chunk is
a ``corrupt`` :class:`~recipecache.errors.VerificationError` for that key, and a missing
chunk (being replaced, or evicted) a plain miss; nobody ever sees a partial value.
Inline values that begin like a manifest (``RCM``) are stored chunked, so the first bytes
of a stored value always tell framing from data.

Every write and delete of an entry is one Lua script that also deletes the chunks of the
manifest it replaces or removes, so no GET-then-DEL race deletes a newer entry and no
chunks are orphaned. Chunks without an expiry that no manifest names (what earlier
versions left when a put failed between its chunks and its manifest) are removed by
``vacuum`` (``recipecache prune`` and ``clear``). The scripts parse manifests themselves
(the Lua twin of :class:`Manifest`): a damaged old value is overwritten or deleted, never an
error. A key of another Redis type (``WRONGTYPE``) is damage under one key, not a failed
service: ``get`` reports it as ``corrupt``, and puts and deletes replace or remove it.
Conditional writes (``put_if``, ``delete_if``) read and compare the value in Python,
then let a script apply the write only if the entry's stored form is still what was
read. Leases are ``SET NX PX`` (in a script that takes over a key there that is no lease:
another type, or no expiry) plus Lua compare-and-renew / compare-and-delete.

Waiting for a lease holder does not poll: a waiter blocks in ``BLMOVE`` on the holder's
wake list ``rc:w:<key>:<token digest>``, and the holder's release (after it published)
pushes one element there, with an expiry, in the same script that deletes the lease.
``BLMOVE`` from a list to itself rotates the element instead of taking it, so every
waiter blocked on that list, and any that arrives later, wakes at once; the list expires
by itself. Blocking calls go through a second connection pool whose socket timeout
exceeds the longest block (:data:`MAX_BLOCK_S`), so a long wait is not a timeout.

Every call is bounded by ``timeout`` as a whole (:meth:`RedisBackend._call_within`): a
server that accepts connections and never answers costs one timeout per call, whatever
redis-py does inside it (the connection handshake, its retry, asking each sentinel, each
seed node); calls that move chunks get more time in proportion to their bytes
(:data:`MIN_RATE`), and a blocking wait its block.

Every Redis failure becomes a :class:`BackendError`: ``backend_down`` (connection),
``backend_slow`` (no answer in time), ``backend_full`` (OOM under ``maxmemory``) or
``backend_error``. A failure of the keys of one call rather than of the service (a key of
another type, a hash slot in migration: :func:`_concerns_keys`) is a
:class:`BackendKeyError`: that key misses, the store's circuit breaker stays closed.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import queue
import re
import secrets
import struct
import threading
import time
import urllib.parse
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import redis
import redis.exceptions
from redis.backoff import ExponentialBackoff
from redis.retry import Retry

from ...buffers import Buffer
from ...errors import BackendError, BackendKeyError, VerificationError
from ...health import FAIL, PASS, WARN, HealthCheck
from ...reasons import Reason
from ..base import Backend, EntryInfo, LeaseState, check_key, is_key, value_matches
from ..url import StoreURL

log = logging.getLogger(__name__)

#: Every command this backend sends, as ACL names; deploy/ builds its ACL user from this
#: list. redis-py also sends ``CLIENT SETINFO`` on connect (Redis >= 7.2) and ignores a
#: refusal, so the user needs no ``client`` rights. Lua scripts run with the caller's
#: rights, so their commands are listed too.
ACL_COMMANDS = (
    "get",
    "getrange",
    "strlen",
    "set",
    "del",
    "mget",
    "scan",
    "pexpire",
    "persist",
    "pttl",
    "rpush",
    "blmove",
    "evalsha",
    "script|load",
    "ping",
    "auth",
    "hello",
)

#: Clock difference to the server above which event timelines of several hosts no longer line up
#: (leases are unaffected: they expire on the server's clock)
MAX_CLOCK_SKEW_S = 1.0
_DOCTOR_SCRIPT = "return 1"

#: Values up to this size (and up to ``chunk_size``) are stored inline; a Lua script copies
#: its arguments, which costs more than a second round trip for larger ones.
INLINE_MAX = 64 * 1024
#: The most chunks one value may have; a writer with a small ``chunk_size`` uses larger chunks.
MAX_CHUNKS = 4096
#: Redis's own limit on one string.
MAX_CHUNK_SIZE = 512 * 1024 * 1024
#: The largest value a reader assembles.
MAX_VALUE = 16 * 1024**3
#: How many bytes of chunks one MGET asks for.
_MGET_BYTES = 256 * 1024 * 1024
#: How long chunks live until the manifest that names them is published (which gives them the
#: entry's expiry): the chunks of a put that failed or died before its manifest expire after
#: it, as the filesystem store takes a temp file that old for a dead writer's. A put whose
#: chunks are gone by then fails instead of publishing a manifest without them.
PENDING_CHUNK_TTL_MS = 3_600_000
#: what the publishing scripts answer when a chunk of the manifest they would publish is gone
_CHUNKS_GONE = -1
_MANIFEST_V2 = re.compile(rb"\ARCM2:([0-9a-f]{16}):([0-9]{1,9}):([0-9]{1,15}):([0-9]{1,12})\Z")
#: The previous format's manifest: magic, chunk count, total size, then a 16-hex-digit generation id.
_MANIFEST_V1 = struct.Struct(">4sIQ")
_FRAMING = b"RCM"
#: bytes of a value's start that hold a whole manifest (what ``scan`` and the scripts peek at)
_MANIFEST_PEEK = 64


@dataclass(frozen=True)
class Manifest:
    """A validated chunk manifest (this format's): nothing is fetched for a manifest that does not pass."""

    gen: str
    count: int
    total: int
    #: the writer's chunk size: a reader with another ``chunk_size`` reads the value all the same
    chunk_size: int

    @classmethod
    def parse(cls, raw: bytes) -> Manifest:
        """The manifest in ``raw``; VerificationError ``corrupt`` if damaged, ``old_format`` for an RCM1 one."""
        if raw.startswith(b"RCM1"):
            if len(raw) == _MANIFEST_V1.size + 16:
                _magic, count, total = _MANIFEST_V1.unpack_from(raw)
                v1_gen = raw[_MANIFEST_V1.size :]
                if re.fullmatch(rb"[0-9a-f]{16}", v1_gen) and 1 <= count <= MAX_CHUNKS and count <= total <= MAX_VALUE:
                    raise VerificationError(Reason.OLD_FORMAT, "chunk manifest of an older recipecache (RCM1)")
            raise VerificationError(Reason.CORRUPT, "damaged RCM1 chunk manifest")
        match = _MANIFEST_V2.match(raw)
        if match is None:
            raise VerificationError(Reason.CORRUPT, f"damaged chunk manifest {raw[:80]!r}")
        gen, count, total, size = match.group(1).decode(), *(int(g) for g in match.groups()[1:])
        if not (1 <= size <= MAX_CHUNK_SIZE and 1 <= total <= MAX_VALUE and 1 <= count <= MAX_CHUNKS):
            raise VerificationError(Reason.CORRUPT, f"chunk manifest out of bounds: {count} x {size} B for {total} B")
        if count != -(-total // size):
            raise VerificationError(Reason.CORRUPT, f"chunk manifest says {count} chunks of {size} B for {total} B")
        return cls(gen, count, total, size)

    def encode(self) -> bytes:
        return f"RCM2:{self.gen}:{self.count}:{self.total}:{self.chunk_size}".encode()

    def chunk_len(self, index: int) -> int:
        return min(self.chunk_size, self.total - index * self.chunk_size)


# The Lua twin of Manifest.parse: the chunk keys a stored value names if it is a valid
# manifest (either format), else none. Shared by every script that replaces or removes an
# entry, so the chunks of what it replaces go in the same atomic step. Every such script
# gets the entry as KEYS[1] and its chunk prefix (``_name("c", key)``, same hash slot) as KEYS[2].
_LUA_CHUNKS = f"""
local function chunk_keys(prefix, value)
  if type(value) ~= 'string' then return {{}} end
  local gen, count, total, size
  if string.sub(value, 1, 5) == 'RCM2:' then
    gen, count, total, size = string.match(value, '^RCM2:([0-9a-f]+):([0-9]+):([0-9]+):([0-9]+)$')
    if not gen or #gen ~= 16 or #count > 9 or #total > 15 or #size > 12 then return {{}} end
    count, total, size = tonumber(count), tonumber(total), tonumber(size)
    if size < 1 or size > {MAX_CHUNK_SIZE} or total < 1 or total > {MAX_VALUE}
       or count ~= math.floor((total + size - 1) / size) then return {{}} end
  elseif string.sub(value, 1, 4) == 'RCM1' and #value == {_MANIFEST_V1.size + 16} then
    count, total = struct.unpack('>I4I8', string.sub(value, 5, {_MANIFEST_V1.size}))
    gen = string.sub(value, {_MANIFEST_V1.size + 1})
    if not string.match(gen, '^[0-9a-f]+$') or total < count or total > {MAX_VALUE} then return {{}} end
  else
    return {{}}
  end
  if count < 1 or count > {MAX_CHUNKS} then return {{}} end
  local keys = {{}}
  local base = prefix .. ':' .. gen .. ':'
  for i = 0, count - 1 do keys[#keys + 1] = base .. i end
  return keys
end
local function delete_keys(keys)
  for i = 1, #keys, 1000 do
    redis.call('del', unpack(keys, i, math.min(i + 999, #keys)))
  end
end
local function store(key, value, ttl)
  if ttl == '' then redis.call('set', key, value) else redis.call('set', key, value, 'PX', ttl) end
end
-- The chunks of a manifest about to be published take the entry's expiry (none: PERSIST),
-- all or none: false, and nothing changed, if one is gone (expired, evicted or removed).
local function adopt(keys, ttl)
  for i = 1, #keys do
    if redis.call('pttl', keys[i]) == -2 then return false end
  end
  for i = 1, #keys do
    if ttl == '' then redis.call('persist', keys[i]) else redis.call('pexpire', keys[i], ttl) end
  end
  return true
end
"""
# Publish ARGV[1] (ttl ARGV[2]); delete the chunks of the manifest it replaces. A key of
# another type gives an error reply from the pcall'd GETRANGE, and SET replaces it.
_SWAP = (
    _LUA_CHUNKS
    + f"""
if not adopt(chunk_keys(KEYS[2], ARGV[1]), ARGV[2]) then return {_CHUNKS_GONE} end
local old = redis.pcall('getrange', KEYS[1], 0, {_MANIFEST_PEEK - 1})
store(KEYS[1], ARGV[1], ARGV[2])
delete_keys(chunk_keys(KEYS[2], old))
return 1
"""
)
_DELETE = (
    _LUA_CHUNKS
    + f"""
local old = redis.pcall('getrange', KEYS[1], 0, {_MANIFEST_PEEK - 1})
redis.call('del', KEYS[1])
delete_keys(chunk_keys(KEYS[2], old))
return 1
"""
)
# Apply a write only if the entry is still as the caller read it: ARGV[1] is 'absent',
# 'wrongtype' or 'value' (then ARGV[2] is the stored form: inline value or manifest);
# ARGV[3] 'set' (ARGV[4] the new stored form, ARGV[5] the ttl) or 'del'.
_COMPARE_AND_WRITE = (
    _LUA_CHUNKS
    + f"""
local cur = redis.pcall('get', KEYS[1])
local state = 'value'
if cur == false then state = 'absent' elseif type(cur) == 'table' then state = 'wrongtype' end
if state ~= ARGV[1] or (state == 'value' and cur ~= ARGV[2]) then return 0 end
if ARGV[3] == 'set' then
  if not adopt(chunk_keys(KEYS[2], ARGV[4]), ARGV[5]) then return {_CHUNKS_GONE} end
  store(KEYS[1], ARGV[4], ARGV[5])
else
  redis.call('del', KEYS[1])
end
delete_keys(chunk_keys(KEYS[2], cur))
return 1
"""
)
_RENEW = """
if redis.call('get', KEYS[1]) == ARGV[1] then
  return redis.call('pexpire', KEYS[1], ARGV[2])
end
return 0
"""
# Take lease KEYS[1] for ARGV[1], expiring after ARGV[2] ms, if nobody holds it. A key there
# that is no lease is taken over as if it had expired: one of another Redis type, or a
# string without expiry (PTTL -1), which would never expire and keep every waiter waiting.
_LEASE_ADD = """
if redis.call('set', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) then return 1 end
if type(redis.pcall('get', KEYS[1])) == 'table' or redis.call('pttl', KEYS[1]) == -1 then
  redis.call('set', KEYS[1], ARGV[1], 'PX', ARGV[2])
  return 1
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


#: Error replies about the keys of one command, not the service: a key of another type, keys in
#: several hash slots, a slot in migration (TRYAGAIN while its keys move, MOVED/ASK redirections)
_KEY_ERROR_CODES = frozenset({"WRONGTYPE", "CROSSSLOT", "TRYAGAIN", "MOVED", "ASK"})
#: how redis-py's cluster client raises those (the code stripped from the message)
_KEY_ERRORS = (redis.exceptions.TryAgainError, redis.exceptions.AskError, redis.exceptions.ClusterCrossSlotError)
#: what redis-py puts before the reply of a failed command in a pipeline's error
_PIPELINE_ERROR = re.compile(r"\ACommand # \d+ \(.*?\) of pipeline caused error: ", re.DOTALL)


def _concerns_keys(exc: Exception) -> bool:
    """Whether ``exc`` is a failure of the keys of one call, which the service answered.

    redis-py's cluster client follows MOVED/ASK/TRYAGAIN replies itself and raises a plain
    ``ClusterError`` ("TTL exhausted") when a slot keeps redirecting or refusing: a slot in
    migration, one hash slot's problem.
    """
    if type(exc) is redis.exceptions.ClusterError or isinstance(exc, _KEY_ERRORS):
        return True
    if not isinstance(exc, redis.exceptions.ResponseError):
        return False
    code = _PIPELINE_ERROR.sub("", str(exc)).partition(" ")[0]
    return code in _KEY_ERROR_CODES


def _error(exc: Exception, what: str) -> BackendError:
    reason: Reason
    if isinstance(exc, redis.exceptions.TimeoutError):
        reason = Reason.BACKEND_SLOW
    elif isinstance(exc, (redis.exceptions.ConnectionError, redis.exceptions.AuthenticationError)):
        reason = Reason.BACKEND_DOWN
    elif isinstance(exc, redis.exceptions.OutOfMemoryError) or (  # the class also inside a pipeline ("Command # n")
        isinstance(exc, redis.exceptions.ResponseError) and str(exc).startswith("OOM")
    ):
        reason = Reason.BACKEND_FULL
    elif _concerns_keys(exc):
        return BackendKeyError(Reason.BACKEND_ERROR, f"redis {what}: {exc}")
    else:
        reason = Reason.BACKEND_ERROR
    return BackendError(reason, f"redis {what}: {exc}")


class _CallThreads:
    """Daemon threads that run Redis calls, so a caller can stop waiting at its deadline.

    A socket timeout alone bounds each read, not a call: redis-py may connect, retry, and
    ask one sentinel or seed node after another within one call. So each call runs on one
    of these threads and the caller waits for it at most its bound; a call given up on is
    left to end by itself (redis-py's socket timeout ends it soon after). The threads are
    kept between calls (starting a thread per call cost several times a loopback round
    trip) and one more is started whenever none is idle; they are daemons, so a call left
    hanging never holds the interpreter's exit. A forked child starts with none
    (:func:`_fresh_threads_after_fork`): the parent's threads do not exist there.
    """

    def __init__(self) -> None:
        self._tasks: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._idle = 0
        self._lock = threading.Lock()

    def call(self, seconds: float, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """``fn(*args, **kwargs)``, waited for at most ``seconds``; the builtin TimeoutError after that."""
        done = threading.Event()
        outcome: list[tuple[bool, Any]] = []

        def task() -> None:
            try:
                outcome.append((True, fn(*args, **kwargs)))
            except BaseException as exc:  # noqa: BLE001 - handed to the caller's thread
                outcome.append((False, exc))
            finally:
                done.set()

        with self._lock:
            start = self._idle == 0
            if not start:
                self._idle -= 1  # that idle thread takes this task
        if start:
            try:
                threading.Thread(target=self._work, name="recipecache-redis-call", daemon=True).start()
            except RuntimeError:
                # no new threads here (Python 3.12 in atexit handlers, which release the leases of
                # compiles cut short): the call runs bounded per read, as a release must still happen
                return fn(*args, **kwargs)
        self._tasks.put(task)
        if not done.wait(seconds):
            raise TimeoutError(f"no answer within {seconds:g} s")
        ok, value = outcome[0]
        if not ok:
            raise value
        return value

    def _work(self) -> None:
        while True:
            self._tasks.get()()
            with self._lock:
                self._idle += 1


_call_threads = _CallThreads()


def _fresh_threads_after_fork() -> None:
    global _call_threads
    _call_threads = _CallThreads()


os.register_at_fork(after_in_child=_fresh_threads_after_fork)


def _bounded(seconds: float, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)``, waited for at most ``seconds`` (see :class:`_CallThreads`)."""
    return _call_threads.call(seconds, fn, *args, **kwargs)


#: redis-py's own TLS settings, passed through in a ``rediss://`` URL's query
TLS_OPTIONS = frozenset({"ssl_ca_certs", "ssl_certfile", "ssl_keyfile", "ssl_cert_reqs", "ssl_check_hostname"})
DEFAULT_CHUNK_SIZE = 8 * 1024 * 1024
DEFAULT_TIMEOUT_S = 5.0
#: ``?chunk_size=``: a chunk is one Redis string, at most proto-max-bulk-len (512 MiB by
#: default; a larger one would be written but refused by every reader); under 1 KiB a value
#: would be mostly key names
CHUNK_SIZE_RANGE = (1024, MAX_CHUNK_SIZE)
#: ``?ttl=`` in seconds: Redis expires keys in whole milliseconds (PX: at least 1, below
#: 2**63); at least a second, at most ten years (for longer, leave ``ttl`` out)
TTL_RANGE_S = (1.0, 10 * 365 * 86400.0)
#: ``?timeout=`` in seconds, of a connect and of a command: a socket timeout must be finite,
#: under 10 ms a loaded server answers nothing in time, and a stalled server holds a rank
#: one timeout, which should not exceed how long a rank waits for another's compile (600 s)
TIMEOUT_RANGE_S = (0.01, 600.0)
#: Bytes per second a call that moves chunks is given on top of ``timeout``: a backend
#: slower than this is a slow backend.
MIN_RATE = 1024 * 1024
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
        # wrong password or a dead server into seconds of stall per call, and a retried
        # timeout pays the timeout again
        "retry": Retry(ExponentialBackoff(cap=0.2, base=0.02), 1, supported_errors=(redis.exceptions.ConnectionError,)),
    }


def tls_options(url: StoreURL) -> dict[str, str]:
    """The ``ssl_*`` options of ``url``; a one-line URLError if there are some and its scheme is not a TLS one."""
    tls = {k: v for k, v in url.options.items() if k in TLS_OPTIONS}
    if tls and not url.scheme.startswith("rediss"):
        raise url.error(f"option {sorted(tls)[0]!r} needs TLS: use {url.scheme.replace('redis', 'rediss', 1)}://")
    return tls


def client_credentials(url: StoreURL) -> dict[str, Any]:
    """The user, password and TLS settings in ``url``, as redis-py connection arguments.

    For the clients that take them as arguments rather than from a URL (cluster, sentinel).
    """
    out: dict[str, Any] = {}
    if url.parts.username:
        out["username"] = urllib.parse.unquote(url.parts.username)
    if url.parts.password is not None:
        out["password"] = urllib.parse.unquote(url.parts.password)
    tls = tls_options(url)
    if url.scheme.startswith("rediss"):
        out["ssl"] = True
        out.update(tls)
        if "ssl_check_hostname" in out:
            out["ssl_check_hostname"] = out["ssl_check_hostname"].lower() in ("1", "true", "yes")
    return out


def url_settings(url: StoreURL) -> dict[str, Any]:
    """The backend settings every Redis URL form carries in its options (``ttl``, ``chunk_size``, ``timeout``).

    Checks the options first: every Redis URL form takes the same ones.
    """
    url.check_options(RedisBackend.URL_OPTIONS)
    return {
        "redacted_url": url.redacted,
        "ttl": url.seconds("ttl", None, TTL_RANGE_S),
        "chunk_size": url.size("chunk_size", DEFAULT_CHUNK_SIZE, CHUNK_SIZE_RANGE) or DEFAULT_CHUNK_SIZE,
        "timeout": url.seconds("timeout", DEFAULT_TIMEOUT_S, TIMEOUT_RANGE_S) or DEFAULT_TIMEOUT_S,
    }


class RedisBackend(Backend):
    URL_OPTIONS = frozenset({"ttl", "chunk_size", "timeout"}) | TLS_OPTIONS

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
        self._timeout = timeout
        self._connect = connect or functools.partial(redis.Redis.from_url, url, **client_options(timeout))
        self._client: Any = self._connect(socket_timeout=timeout)  # redis.Redis, or the cluster backend's lazy client
        self._blocking_client: Any = None
        self._blocking_lock = threading.Lock()
        self._swap = self._client.register_script(_SWAP)
        self._delete = self._client.register_script(_DELETE)
        self._cas = self._client.register_script(_COMPARE_AND_WRITE)
        self._renew = self._client.register_script(_RENEW)
        self._release = self._client.register_script(_RELEASE)
        self._lease_add = self._client.register_script(_LEASE_ADD)

    def _call(self, what: str, fn: Any, *args: Any, **kwargs: Any) -> Any:
        """``fn(*args, **kwargs)`` within ``timeout``; every failure a BackendError (see :meth:`_call_within`)."""
        return self._call_within(self._timeout, what, fn, *args, **kwargs)

    def _transfer_s(self, nbytes: int) -> float:
        """The time a call that moves ``nbytes`` of chunks is given."""
        return self._timeout + nbytes / MIN_RATE

    def _call_within(self, seconds: float, what: str, fn: Any, *args: Any, **kwargs: Any) -> Any:
        """``fn(*args, **kwargs)``, given ``seconds`` as a whole; a BackendError for any failure or a late answer.

        The whole call, not each read: a hung server (or sentinel, or seed node) costs the
        caller one timeout, and the store's circuit breaker takes over from there.
        """
        try:
            return _bounded(seconds, fn, *args, **kwargs)
        except redis.exceptions.RedisError as exc:
            raise _error(exc, what) from None
        except TimeoutError as exc:
            raise BackendError(Reason.BACKEND_SLOW, f"redis {what}: {exc}") from None

    def ping(self) -> None:
        """Raise BackendError unless the server answers; used to validate a URL up front."""
        self._call("ping", self._client.ping)

    # -- values --------------------------------------------------------------------
    def get(self, key: str) -> bytes | None:
        loaded = self._load(key)
        if loaded.problem is not None:
            raise loaded.problem
        return loaded.value

    def _load(self, key: str) -> _Loaded:
        entry = self._name("e", key)

        def read() -> bytes | _Loaded | None:
            try:
                return self._client.get(entry)
            except redis.exceptions.ResponseError as exc:
                if str(exc).startswith("WRONGTYPE"):
                    return _Loaded("wrongtype", problem=VerificationError(Reason.CORRUPT, f"{entry} is not a string"))
                raise

        raw = self._call("get", read)
        if isinstance(raw, _Loaded):
            return raw
        if raw is None:
            return _Loaded("absent")
        if not raw.startswith(_FRAMING):
            return _Loaded("value", raw, raw)
        try:
            return _Loaded("value", raw, self._assemble(key, Manifest.parse(raw)))
        except VerificationError as exc:
            return _Loaded("value", raw, problem=exc)

    def _assemble(self, key: str, manifest: Manifest) -> bytes | None:
        """The value a validated manifest names; None if a chunk is missing (replaced or evicted meanwhile).

        The chunks' lengths are asked for first: a manifest that understates them (damaged, or
        forged) must not make this process download and hold what it never named.
        """
        names = [self._chunk_key(key, manifest.gen, i) for i in range(manifest.count)]
        pipe = self._client.pipeline(transaction=False)
        for name in names:
            pipe.strlen(name)
        for i, length in enumerate(self._call("strlen", pipe.execute, raise_on_error=False)):
            if isinstance(length, redis.exceptions.ResponseError):
                raise VerificationError(Reason.CORRUPT, f"chunk {i} of {key} is not a string ({length})")
            if isinstance(length, Exception):
                raise _error(length, "strlen")
            if length == 0:  # no such key: chunks are never empty
                return None
            if length != manifest.chunk_len(i):
                raise VerificationError(
                    Reason.CORRUPT, f"chunk {i} of {key} is {length} B, its manifest says {manifest.chunk_len(i)}"
                )
        batch = max(1, _MGET_BYTES // manifest.chunk_size)
        chunks: list[bytes | None] = []
        for i in range(0, len(names), batch):
            chunks += self._call_within(
                self._transfer_s(batch * manifest.chunk_size), "mget", self._client.mget, names[i : i + batch]
            )
        if any(c is None for c in chunks):
            return None
        for i, chunk in enumerate(chunks):  # again: a chunk written over since its length was asked for
            assert chunk is not None
            if len(chunk) != manifest.chunk_len(i):
                raise VerificationError(
                    Reason.CORRUPT, f"chunk {i} of {key} is {len(chunk)} B, its manifest says {manifest.chunk_len(i)}"
                )
        return chunks[0] if len(chunks) == 1 else b"".join(chunks)  # type: ignore[arg-type]  # no None: checked above

    def _stored_form(self, key: str, parts: tuple[Buffer, ...]) -> tuple[bytes, list[str]]:
        """What goes under the entry key for ``parts``: the value inline, or a manifest of chunks written here.

        Returns it with the chunk keys written (to delete if the manifest is not swapped in).
        """
        total = sum(len(p) for p in parts)
        if total <= min(self.chunk_size, INLINE_MAX):
            value = b"".join(parts)
            if not value.startswith(_FRAMING):
                return value, []
        if total > MAX_VALUE:
            raise BackendError(Reason.BACKEND_FULL, f"value of {total} B is over this backend's {MAX_VALUE} B cap")
        size = max(self.chunk_size, -(-total // MAX_CHUNKS))
        manifest = Manifest(secrets.token_hex(8), -(-total // size), total, size)
        names = [self._chunk_key(key, manifest.gen, i) for i in range(manifest.count)]
        pipe = self._client.pipeline(transaction=False)
        for name, chunk in zip(names, _chunks(parts, size), strict=True):
            pipe.set(name, chunk, px=PENDING_CHUNK_TTL_MS)
        try:
            self._call_within(self._transfer_s(total), "set chunks", pipe.execute)
        except BackendError:  # e.g. out of memory half-way: no manifest names what was written
            self._discard(names)
            raise
        return manifest.encode(), names

    def _publish(self, what: str, key: str, script: Any, args: list[Any], chunk_names: list[str]) -> bool:
        """Run a publishing script (1: published, 0: the entry changed since it was read, or :data:`_CHUNKS_GONE`).

        Chunks written for it that it did not publish are deleted at once, which matters most
        when the server is out of memory; where the outcome is unknown (a timeout, a lost
        connection) they are left to their pending expiry, since the manifest may name them.
        """
        try:
            result = self._call(what, script, keys=self._entry_keys(key), args=args)
        except BackendError as exc:
            if exc.reason in (Reason.BACKEND_FULL, Reason.BACKEND_ERROR):  # an error reply: the script wrote nothing
                self._discard(chunk_names)
            raise
        if result != 1:
            self._discard(chunk_names)
        if result == _CHUNKS_GONE:
            raise BackendError(
                Reason.BACKEND_ERROR,
                f"redis {what} {key}: chunks of the value were gone before its "
                "manifest was published (evicted, removed, or older than "
                f"{PENDING_CHUNK_TTL_MS // 60_000} min)",
            )
        return result == 1

    def _discard(self, chunk_names: list[str]) -> None:
        """Delete chunks no manifest names, as far as the server lets us: the rest expire by themselves."""
        if chunk_names:
            try:
                self._call("del", self._client.delete, *chunk_names)
            except BackendError as exc:
                log.debug("chunks left to expire: %s", exc)

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
        self._call("del", self._delete, keys=self._entry_keys(key), args=[])

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
        for names in self._scan_batches(self._pattern(namespace)):
            entries = []
            for name in names:
                key = self._key_of(name)
                if key is None:
                    strays.append(name.decode(errors="replace"))
                else:
                    entries.append((name, key))
            if entries:
                # sizes without the values: a plain value's length, or the total a manifest names
                pipe = self._client.pipeline(transaction=False)
                for name, _key in entries:
                    pipe.strlen(name)
                    pipe.getrange(name, 0, _MANIFEST_PEEK - 1)
                answers = self._call("scan sizes", pipe.execute, raise_on_error=False)
                for (_name, key), length, head in zip(entries, answers[::2], answers[1::2], strict=True):
                    if isinstance(length, redis.exceptions.ResponseError):  # another type: listed, so verify removes it
                        yield EntryInfo(key, 0, 0.0)
                    elif isinstance(length, Exception):
                        raise _error(length, "scan sizes")
                    elif length:
                        yield EntryInfo(key, _stored_size(head, length), 0.0)
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
        for names in self._scan_batches(self._pattern(namespace, "c")):
            chunks = [(name, owner) for name in names if (owner := self._chunk_owner(name)) is not None]
            if not chunks:
                continue
            pipe = self._client.pipeline(transaction=False)
            for name, (key, _gen) in chunks:
                pipe.pttl(name)
                pipe.getrange(self._name("e", key), 0, _MANIFEST_PEEK - 1)
            answers = self._call("vacuum", pipe.execute, raise_on_error=False)
            orphans = [
                name
                for (name, (_key, gen)), pttl, head in zip(chunks, answers[::2], answers[1::2], strict=True)
                if pttl == -1 and _manifest_of(head)[0] != gen
            ]
            if orphans:
                self._call("vacuum", self._client.delete, *orphans)
                removed += len(orphans)
        return removed

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

    def _pattern(self, namespace: str | None, kind: str = "e") -> str:
        """A ``SCAN`` pattern for the names of ``kind`` (values, chunks...) of one namespace, or of every namespace."""
        return f"rc:{kind}:{namespace}/*" if namespace else f"rc:{kind}:*"

    def _key_of(self, name: bytes | str, kind: str = "e") -> str | None:
        """The backend key whose ``kind`` name is ``name`` (the inverse of ``_name``); None for a name ``_name`` never makes."""
        text = name.decode(errors="replace") if isinstance(name, bytes) else name
        key = text.removeprefix(f"rc:{kind}:").removeprefix("{").removesuffix("}")  # a cluster's hash tag
        return key if is_key(key) and self._name(kind, key) == text else None

    def _entry_keys(self, key: str) -> list[str]:
        """KEYS of the scripts that write or delete an entry: its value and its chunk prefix."""
        return [self._name("e", key), self._name("c", key)]

    # -- chunks --------------------------------------------------------------------
    def _chunk_key(self, key: str, gen: str, index: int) -> str:
        return f"{self._name('c', key)}:{gen}:{index}"

    def _chunk_owner(self, name: bytes) -> tuple[str, str] | None:
        """The key and generation of a chunk's name (the inverse of ``_chunk_key``); None for another name."""
        prefix, gen, index = [*name.decode(errors="replace").rsplit(":", 2), "", ""][:3]
        key = self._key_of(prefix, "c") if index.isdigit() else None
        return None if key is None else (key, gen)

    # -- leases --------------------------------------------------------------------
    def lease_add(self, name: str, token: str, ttl: float) -> bool:
        return bool(self._call("lease", self._lease_add, keys=[self._name("l", name)], args=[token, int(ttl * 1000)]))

    def lease_renew(self, name: str, token: str, ttl: float) -> bool:
        return bool(self._call("lease renew", self._renew, keys=[self._name("l", name)], args=[token, int(ttl * 1000)]))

    def lease_release(self, name: str, token: str) -> None:
        self._call(
            "lease release",
            self._release,
            keys=[self._name("l", name), self._wake_key(name, token)],
            args=[token, WAKE_TTL_MS],
        )

    def lease_holder(self, name: str) -> LeaseState | None:
        pipe = self._client.pipeline(transaction=False)
        pipe.get(self._name("l", name))
        pipe.pttl(self._name("l", name))
        token, pttl = self._call("lease holder", pipe.execute)
        if token is None or pttl == -2:  # -2: released or expired between the two commands
            return None
        # -1: a key without expiry is no lease (it would never expire): expired, for lease_add to take over
        return LeaseState(token.decode(errors="replace"), pttl / 1000 if pttl >= 0 else 0.0)

    def lease_wait(self, name: str, token: str, timeout: float) -> bool:
        key = self._wake_key(name, token)
        block = min(max(timeout, 0.01), MAX_BLOCK_S)
        return (
            self._call_within(
                block + self._timeout, "lease wait", self._blocking().blmove, key, key, block, "RIGHT", "LEFT"
            )
            is not None
        )

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

    # -- doctor --------------------------------------------------------------------
    def health_checks(self, probe_key: str) -> list[HealthCheck]:
        """Whether the user may run every command in :data:`ACL_COMMANDS`, and the clock against ``TIME``."""
        return [self._acl_check(self._name("e", probe_key)), self._clock_check()]

    def _connection_kwargs(self) -> dict[str, Any]:
        """The settings the client's connections are made with."""
        return self._client.connection_pool.connection_kwargs

    def _run_keyless(self, *args: Any) -> Any:
        """Send a command that names no key (``PING``, ``TIME``...): a cluster sends it to one node."""
        return self._client.execute_command(*args)

    def _credentials(self) -> list[str]:
        """The user name (if any) and password the client authenticates with; none without a password."""
        auth = self._connection_kwargs()
        return [auth[k] for k in ("username", "password") if auth.get(k)] if auth.get("password") else []

    def _acl_probes(self, key: str) -> dict[str, Callable[[], Any]]:
        """One harmless call of each command in :data:`ACL_COMMANDS` on ``key``, in an order that works (``del`` last).

        The list commands of waiting (``rpush``, ``blmove``) go to a list beside ``key``
        (same hash tag on a cluster), which ``del`` removes with it.
        """
        run, keyless = self._client.execute_command, self._run_keyless
        credentials = self._credentials()
        wake = key + ":doctor-wake"
        return {
            "ping": lambda: keyless("PING"),
            "hello": lambda: keyless("HELLO", 2),
            "auth": lambda: keyless("AUTH", *credentials) if credentials else None,
            "set": lambda: run("SET", key, b"recipecache doctor", "PX", 60_000),
            "get": lambda: run("GET", key),
            "getrange": lambda: run("GETRANGE", key, 0, 3),
            "strlen": lambda: run("STRLEN", key),
            "mget": lambda: run("MGET", key),
            "pexpire": lambda: run("PEXPIRE", key, 60_000),
            "persist": lambda: run("PERSIST", key),
            "pttl": lambda: run("PTTL", key),
            "rpush": lambda: run("RPUSH", wake, b"1"),
            "blmove": lambda: run("BLMOVE", wake, wake, "RIGHT", "LEFT", 0.01),
            "scan": lambda: keyless("SCAN", 0, "MATCH", key, "COUNT", 10),
            "script|load": lambda: keyless("SCRIPT", "LOAD", _DOCTOR_SCRIPT),
            "evalsha": lambda: run("EVALSHA", hashlib.sha1(_DOCTOR_SCRIPT.encode()).hexdigest(), 1, key),
            "del": lambda: run("DEL", key, wake),
        }

    def _acl_check(self, key: str) -> HealthCheck:
        """A real call per command: ``ACL DRYRUN`` needs rights a job user must not have."""
        refused = []
        probes = self._acl_probes(key)
        for command, probe in probes.items():
            try:
                probe()
            except redis.exceptions.NoPermissionError:
                refused.append(command)
            except redis.exceptions.ResponseError:
                pass  # an answer other than a refusal: the user may run it (e.g. HELLO on an old server)
            except redis.exceptions.RedisError as exc:
                error = _error(exc, command)
                return HealthCheck(
                    "acl",
                    FAIL,
                    f"could not check the user's rights: {error.reason}: {error}",
                    "make the server reachable first",
                )
        if refused:
            grants = " ".join(f"+{c}" for c in refused)
            return HealthCheck(
                "acl",
                FAIL,
                f"the user may not run {', '.join(refused)}",
                f"ACL SETUSER <user> {grants} (deploy/redis/users.acl.template grants what the backend sends)",
            )
        return HealthCheck("acl", PASS, f"the user may run all {len(probes)} commands the backend sends on rc:* keys")

    def _clock_check(self) -> HealthCheck:
        before = time.time()
        try:
            seconds, micros = self._run_keyless("TIME")
        except redis.exceptions.NoPermissionError:
            return HealthCheck(
                "clock",
                PASS,
                "not measured (the user may not run TIME); Redis leases expire on the "
                "server's clock, so client clocks do not affect them",
            )
        except redis.exceptions.RedisError as exc:
            return HealthCheck("clock", FAIL, f"TIME failed: {exc}", "make the server reachable first")
        skew = (before + time.time()) / 2 - (int(seconds) + int(micros) / 1e6)
        detail = f"this host's clock is {skew:+.3f} s off the server's"
        if abs(skew) > MAX_CLOCK_SKEW_S:
            return HealthCheck(
                "clock",
                WARN,
                detail + " (leases are unaffected; timelines of several hosts are skewed)",
                "synchronise the clocks (NTP)",
            )
        return HealthCheck("clock", PASS, detail)


def _manifest_of(head: Any) -> tuple[str | None, int | None]:
    """The generation and total size a stored value's first bytes name if it is a manifest (either format), else Nones."""
    if isinstance(head, bytes) and head.startswith(_FRAMING):
        try:
            manifest = Manifest.parse(head)
            return manifest.gen, manifest.total
        except VerificationError as exc:
            if exc.reason is Reason.OLD_FORMAT:
                return head[_MANIFEST_V1.size :].decode(), int(_MANIFEST_V1.unpack_from(head)[2])
    return None, None


def _stored_size(head: bytes, length: int) -> int:
    """The size of the value an entry holds, from the first bytes and length of its stored form."""
    total = _manifest_of(head)[1]
    return length if total is None else total


def _chunks(parts: tuple[Buffer, ...], size: int) -> Iterator[Buffer]:
    """The concatenation of ``parts`` in pieces of ``size`` bytes: views of the parts, joined only where one straddles two."""
    pending: list[memoryview] = []
    pending_len = 0
    for part in parts:
        view = memoryview(part).cast("B")
        while len(view):
            take = min(size - pending_len, len(view))
            pending.append(view[:take])
            pending_len += take
            view = view[take:]
            if pending_len == size:
                yield pending[0] if len(pending) == 1 else b"".join(pending)
                pending, pending_len = [], 0
    if pending:
        yield pending[0] if len(pending) == 1 else b"".join(pending)
