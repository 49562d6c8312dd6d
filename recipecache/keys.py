"""Fixed-length cache keys.

A key names one compiled artifact: the namespace (job or project) keeps jobs apart, the
toolchain fingerprint keeps incompatible builds apart (library versions, device kind,
flags that change generated code), and the graph hash plus the input-shape signature
name the compile itself. Everything is encoded canonically with msgpack and hashed, so
equal inputs give equal keys on every rank and host, and any input gives a key that is
safe as a file name and a Redis key.
"""

from __future__ import annotations

import hashlib
import platform
import re
from collections.abc import Iterable, Mapping
from typing import Any

import msgpack

from .env import __version__
from .errors import ConfigError, echo

#: what a namespace may be: a path component and a key prefix, in stores and in envelopes
NAMESPACE_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}\Z")
DEFAULT_NAMESPACE = "default"


def check_namespace(namespace: str) -> str:
    """Return ``namespace`` if it is usable as a path component and key prefix, else raise."""
    if not NAMESPACE_PATTERN.match(namespace):
        raise ConfigError(
            f"bad namespace {echo(namespace)}: use 1-64 characters from A-Z a-z 0-9 . _ -, starting with a letter or digit"
        )
    return namespace


def base_fingerprint() -> dict[str, str]:
    """The parts of the toolchain fingerprint every artifact depends on."""
    return {
        "recipecache": __version__,
        "python": platform.python_version(),
        "machine": platform.machine(),
    }


def _canonical(value: Any) -> Any:
    """Make ``value`` deterministic under msgpack: sorted maps, tuples as lists, shapes as ints."""
    if isinstance(value, Mapping):
        return [[str(k), _canonical(v)] for k, v in sorted(value.items(), key=lambda kv: str(kv[0]))]
    if isinstance(value, (list, tuple)):
        return [_canonical(v) for v in value]
    if isinstance(value, (str, bytes, int, float, bool)) or value is None:
        return value
    return str(value)


def make_key(graph_hash: str, shapes: Iterable[Any] = (), *, fingerprint: Mapping[str, Any] | None = None) -> str:
    """The key of one artifact: sha256 over fingerprint, graph hash and shape signature.

    ``shapes`` is any nesting of sequences of ints (or symbolic sizes as strings), e.g.
    ``[(8, 128), (8,)]``. ``fingerprint`` adds to :func:`base_fingerprint`.
    """
    fp = base_fingerprint()
    if fingerprint:
        fp.update({str(k): str(v) for k, v in fingerprint.items()})
    blob = msgpack.packb(
        ["recipecache-key-v1", _canonical(fp), graph_hash, _canonical(list(shapes))], use_bin_type=True
    )
    return hashlib.sha256(blob).hexdigest()


def storage_key(namespace: str, key: str) -> str:
    """The backend key of caller key ``key``: ``<namespace>/<sha256 hex>``."""
    return f"{namespace}/{hashlib.sha256(key.encode()).hexdigest()}"
