"""Every Redis key name of the backend, made in one place.

Keys (all under ``rc:`` so an ACL can confine the user to ``~rc:*``)::

    rc:e:<key>                   the value, or a chunk manifest for values above 64 KiB
    rc:c:<key>:<gen>:<i>         chunk i of generation gen
    rc:l:<key>                   a lease: the owner token, with a PX expiry
    rc:w:<key>:<digest>          the wake list of the lease holder whose token hashes to digest

One class makes them all (:meth:`KeyNames.name`), so that Redis Cluster
(:class:`~recipecache.backends.redis_cluster.ClusterKeyNames`) can give all the keys of one
entry one hash tag and one slot.
"""

from __future__ import annotations

import hashlib

from ..base import check_key, is_key


class KeyNames:
    """The names of one server's keys; the other methods derive theirs from :meth:`name` and :meth:`pattern`."""

    def name(self, kind: str, key: str) -> str:
        """The Redis key of ``kind`` (``e`` value, ``c`` chunk prefix, ``l`` lease, ``w`` wake list) for ``key``."""
        return f"rc:{kind}:{check_key(key)}"

    def pattern(self, namespace: str | None, kind: str = "e") -> str:
        """A ``SCAN`` pattern for the names of ``kind`` (values, chunks...) of one namespace, or of every namespace."""
        return f"rc:{kind}:{namespace}/*" if namespace else f"rc:{kind}:*"

    def key_of(self, name: bytes | str, kind: str = "e") -> str | None:
        """The backend key whose ``kind`` name is ``name`` (the inverse of :meth:`name`); None for a name it never makes."""
        text = name.decode(errors="replace") if isinstance(name, bytes) else name
        key = text.removeprefix(f"rc:{kind}:").removeprefix("{").removesuffix("}")  # a cluster's hash tag
        return key if is_key(key) and self.name(kind, key) == text else None

    def entry_keys(self, key: str) -> list[str]:
        """KEYS of the scripts that write or delete an entry: its value and its chunk prefix."""
        return [self.name("e", key), self.name("c", key)]

    def chunk_key(self, key: str, gen: str, index: int) -> str:
        return f"{self.name('c', key)}:{gen}:{index}"

    def chunk_owner(self, name: bytes) -> tuple[str, str] | None:
        """The key and generation of a chunk's name (the inverse of :meth:`chunk_key`); None for another name."""
        prefix, gen, index = [*name.decode(errors="replace").rsplit(":", 2), "", ""][:3]
        key = self.key_of(prefix, "c") if index.isdigit() else None
        return None if key is None else (key, gen)

    def wake_key(self, name: str, token: str) -> str:
        """The wake list of lease ``name``'s holder ``token``: waiters block on it, the release pushes to it."""
        return f"{self.name('w', name)}:{hashlib.sha256(token.encode()).hexdigest()[:16]}"
