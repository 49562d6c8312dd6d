"""From a URL and the environment to a configured backend and store settings.

One URL picks the backend::

    file:///path[?max_size=10GiB]                       the default (embedded, no server)
    redis://[user:password@]host:port/db[?ttl=86400&chunk_size=8MiB&timeout=5]
    rediss://...[?ssl_ca_certs=/path/ca.pem&ssl_certfile=...&ssl_keyfile=...]   Redis over TLS
    memory://                                           in-process, for tests

Environment: ``RECIPECACHE_URL`` (the URL), ``RECIPECACHE_DIR`` (the filesystem default's
directory, else ``~/.cache/recipecache``), ``RECIPECACHE_NAMESPACE``,
``RECIPECACHE_SECRET`` or ``RECIPECACHE_SECRET_FILE`` (the HMAC key), ``RECIPECACHE_WAIT_TIMEOUT``,
``RECIPECACHE_LEASE_TTL``. Everything wrong here is a :class:`ConfigError` with one line.
"""

from __future__ import annotations

import os
import urllib.parse
from dataclasses import dataclass
from pathlib import Path

from . import env
from .backends.base import Backend
from .errors import ConfigError
from .keys import DEFAULT_NAMESPACE, check_namespace
from .sizes import parse_size

DEFAULT_WAIT_TIMEOUT = 600.0
DEFAULT_LEASE_TTL = 30.0


def default_url() -> str:
    """``$RECIPECACHE_URL``, else the filesystem store in ``$RECIPECACHE_DIR`` or ``~/.cache/recipecache``."""
    url = os.environ.get(env.URL)
    if url:
        return url
    directory = os.environ.get(env.DIR) or str(Path.home() / ".cache" / "recipecache")
    return "file://" + str(Path(directory).expanduser().absolute())


def redact(url: str) -> str:
    """``url`` with its password replaced by ``***``, for logs and reports."""
    parts = urllib.parse.urlsplit(url)
    if parts.password is None:
        return url
    netloc = parts.netloc.replace(f":{parts.password}@", ":***@", 1)
    return urllib.parse.urlunsplit(parts._replace(netloc=netloc))


def read_secret(secret: str | bytes | None = None) -> bytes | None:
    """The HMAC key: the argument, else ``RECIPECACHE_SECRET``, else the file ``RECIPECACHE_SECRET_FILE``."""
    if secret is not None:
        return secret.encode() if isinstance(secret, str) else secret
    if os.environ.get(env.SECRET):
        return os.environ[env.SECRET].encode()
    path = os.environ.get(env.SECRET_FILE)
    return read_secret_file(path, env.SECRET_FILE) if path else None


def read_secret_file(path: str | os.PathLike[str], source: str) -> bytes:
    """The key in file ``path`` (surrounding whitespace stripped); ``source`` names where the path came from."""
    try:
        value = Path(path).read_bytes().strip()
    except OSError as exc:
        raise ConfigError(f"{source} {path}: {exc.strerror}") from None
    if not value:
        raise ConfigError(f"{source} {path} is empty")
    return value


@dataclass(frozen=True)
class StoreSettings:
    """Everything a :class:`~recipecache.store.Store` is built from, resolved and checked."""

    url: str
    namespace: str = DEFAULT_NAMESPACE
    secret: bytes | None = None
    wait_timeout: float = DEFAULT_WAIT_TIMEOUT
    lease_ttl: float = DEFAULT_LEASE_TTL

    @classmethod
    def resolve(
        cls,
        url: str | None = None,
        *,
        namespace: str | None = None,
        secret: str | bytes | None = None,
    ) -> StoreSettings:
        return cls(
            url=url or default_url(),
            namespace=check_namespace(namespace or os.environ.get(env.NAMESPACE) or DEFAULT_NAMESPACE),
            secret=read_secret(secret),
            wait_timeout=env.seconds(env.WAIT_TIMEOUT, DEFAULT_WAIT_TIMEOUT),
            lease_ttl=env.seconds(env.LEASE_TTL, DEFAULT_LEASE_TTL),
        )


#: redis-py's own TLS settings, passed through in a ``rediss://`` URL's query
_REDIS_TLS_OPTIONS = {"ssl_ca_certs", "ssl_certfile", "ssl_keyfile", "ssl_cert_reqs", "ssl_check_hostname"}


def _query_options(parts: urllib.parse.SplitResult, allowed: set[str]) -> dict[str, str]:
    options = dict(urllib.parse.parse_qsl(parts.query, keep_blank_values=True))
    unknown = sorted(set(options) - allowed)
    if unknown:
        raise ConfigError(f"unknown option {unknown[0]!r} in cache URL; known: {', '.join(sorted(allowed))}")
    return options


def _positive_seconds(name: str, text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if value <= 0:
        raise ConfigError(f"cache URL option {name}={text!r} must be a positive number of seconds")
    return value


def open_backend(url: str) -> Backend:
    """Build the backend ``url`` names; raises ConfigError for anything malformed."""
    parts = urllib.parse.urlsplit(url)
    scheme = parts.scheme.lower()
    if scheme == "file":
        from .backends.filesystem import FilesystemBackend

        options = _query_options(parts, {"max_size"})
        if parts.netloc not in ("", "localhost") or not parts.path:
            raise ConfigError(f"bad cache URL {url!r}: use file:///absolute/path")
        max_size = parse_size(options["max_size"]) if "max_size" in options else None
        return FilesystemBackend(urllib.parse.unquote(parts.path), max_size=max_size)
    if scheme in ("redis", "rediss"):
        from .backends.redis import RedisBackend

        options = _query_options(parts, {"ttl", "chunk_size", "timeout", *_REDIS_TLS_OPTIONS})
        try:
            parts.port  # noqa: B018 - raises ValueError for a non-numeric or out-of-range port
        except ValueError:
            raise ConfigError(f"bad port in cache URL {redact(url)!r}") from None
        if not parts.hostname:
            raise ConfigError(f"bad cache URL {redact(url)!r}: use redis://[user:password@]host:port/db")
        db = parts.path.lstrip("/")
        if db and not db.isdigit():
            raise ConfigError(f"bad database {db!r} in cache URL {redact(url)!r}: use a number such as /0")
        tls = urllib.parse.urlencode({k: v for k, v in options.items() if k in _REDIS_TLS_OPTIONS})
        plain_url = urllib.parse.urlunsplit(parts._replace(query=tls))
        return RedisBackend(
            plain_url,
            redacted_url=redact(url),
            ttl=_positive_seconds("ttl", options["ttl"]) if "ttl" in options else None,
            chunk_size=parse_size(options["chunk_size"]) if "chunk_size" in options else 8 * 1024 * 1024,
            timeout=_positive_seconds("timeout", options["timeout"]) if "timeout" in options else 5.0,
        )
    if scheme == "memory":
        from .backends.memory import MemoryBackend

        return MemoryBackend()
    raise ConfigError(f"unsupported cache URL {redact(url)!r}: use file:///path, redis://host:port/db or rediss://")

