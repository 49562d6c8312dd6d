"""A Redis URL's options, and the redis-py settings every client of the backend (plain, cluster, sentinel) is made with."""

from __future__ import annotations

import urllib.parse
from typing import Any

import redis.exceptions
from redis.backoff import ExponentialBackoff
from redis.retry import Retry

from ..url import StoreURL
from .manifest import MAX_CHUNK_SIZE

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
#: the options every Redis URL form takes
URL_OPTIONS = frozenset({"ttl", "chunk_size", "timeout"}) | TLS_OPTIONS


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
    url.check_options(URL_OPTIONS)
    return {
        "redacted_url": url.redacted,
        "ttl": url.seconds("ttl", None, TTL_RANGE_S),
        "chunk_size": url.size("chunk_size", DEFAULT_CHUNK_SIZE, CHUNK_SIZE_RANGE) or DEFAULT_CHUNK_SIZE,
        "timeout": url.seconds("timeout", DEFAULT_TIMEOUT_S, TIMEOUT_RANGE_S) or DEFAULT_TIMEOUT_S,
    }
