"""Backends: bytes under keys plus a lease primitive (see :mod:`.base`), one module each.

A store URL picks its backend by scheme through :data:`SCHEMES`; the backend parses the
rest of the URL itself (``from_url``). Adding a backend is one module and one line here.
Backend modules are imported only when their scheme is used, so a filesystem store never
imports the Redis client.
"""

from __future__ import annotations

import importlib

from ..errors import URLError, echo
from .base import Backend
from .url import StoreURL, command_line_password_warning, redact

__all__ = ["SCHEMES", "Backend", "StoreURL", "backend_class", "command_line_password_warning", "open_backend", "redact"]

#: URL scheme -> ``module:class`` of its backend
SCHEMES: dict[str, str] = {
    "file": "recipecache.backends.filesystem:FilesystemBackend",
    "redis": "recipecache.backends.redis:RedisBackend",
    "rediss": "recipecache.backends.redis:RedisBackend",
    "redis+cluster": "recipecache.backends.redis_cluster:RedisClusterBackend",
    "rediss+cluster": "recipecache.backends.redis_cluster:RedisClusterBackend",
    "redis+sentinel": "recipecache.backends.redis_sentinel:RedisSentinelBackend",
    "rediss+sentinel": "recipecache.backends.redis_sentinel:RedisSentinelBackend",
    "memory": "recipecache.backends.memory:MemoryBackend",
}


def backend_class(url: StoreURL) -> type[Backend]:
    """The backend class for ``url``'s scheme; ConfigError for a scheme nobody handles."""
    target = SCHEMES.get(url.scheme)
    if target is None:
        known = ", ".join(f"{scheme}://" for scheme in SCHEMES)
        raise URLError(f"unsupported cache URL {echo(url.redacted)}: the scheme must be one of {known}")
    module, _, name = target.partition(":")
    cls: type[Backend] = getattr(importlib.import_module(module), name)
    return cls


def open_backend(url: str | StoreURL, **defaults: object) -> Backend:
    """Build the backend ``url`` names; raises ConfigError for anything malformed.

    ``defaults`` are options the caller would like unless the URL sets them (for example
    a short ``timeout`` for a reachability probe); a backend that has no such option
    ignores them, so callers need not know which backend they get.
    """
    parsed = url if isinstance(url, StoreURL) else StoreURL.parse(url)
    cls = backend_class(parsed)
    return cls.from_url(parsed.with_defaults(cls.URL_OPTIONS, **defaults))
