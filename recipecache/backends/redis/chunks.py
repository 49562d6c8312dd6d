"""The chunks of a value too large to store inline, written and read only as a validated manifest names them.

Chunks are written with plain ``SET`` (slices of the caller's buffers, never joined, except
a chunk that straddles two of them) under a fresh generation id, each expiring after
:data:`PENDING_CHUNK_TTL_MS`; the script that then swaps the manifest in gives them the
entry's expiry (:mod:`.scripts`). The chunks of a put that fails or dies before its manifest
therefore expire by themselves, and a failed one deletes them at once where it knows its
manifest was not written. A reader asks the server for every chunk's length (``STRLEN``)
and fetches the chunks with ``MGET`` only when each is as long as the manifest says: a
damaged manifest or chunk is a ``corrupt`` :class:`~recipecache.errors.VerificationError`
for that key, and a missing chunk (being replaced, or evicted) a plain miss; nobody ever
sees a partial value.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator

import redis.exceptions

from ...buffers import Buffer
from ...errors import BackendError, VerificationError
from ...reasons import Reason
from .calls import RedisCalls
from .errors import redis_error
from .manifest import Manifest
from .names import KeyNames

log = logging.getLogger(__name__)

#: How long chunks live until the manifest that names them is published (which gives them the
#: entry's expiry): the chunks of a put that failed or died before its manifest expire after
#: it, as the filesystem store takes a temp file that old for a dead writer's. A put whose
#: chunks are gone by then fails instead of publishing a manifest without them.
PENDING_CHUNK_TTL_MS = 3_600_000
#: How many bytes of chunks one MGET asks for.
_MGET_BYTES = 256 * 1024 * 1024


class Chunks:
    """The chunks of one backend's large values: written pending, read back checked, discarded when unnamed."""

    def __init__(self, calls: RedisCalls, names: KeyNames) -> None:
        self._calls = calls
        self._names = names

    def write(self, key: str, manifest: Manifest, parts: tuple[Buffer, ...]) -> list[str]:
        """Write the chunks ``manifest`` names, cut from ``parts``, expiring unless a manifest adopts them; their names.

        A failed write deletes what it wrote: no manifest names it.
        """
        names = [self._names.chunk_key(key, manifest.gen, i) for i in range(manifest.count)]
        pipe = self._calls.client.pipeline(transaction=False)
        for name, chunk in zip(names, _split(parts, manifest.chunk_size), strict=True):
            pipe.set(name, chunk, px=PENDING_CHUNK_TTL_MS)
        try:
            self._calls.within(self._calls.transfer_s(manifest.total), "set chunks", pipe.execute)
        except BackendError:  # e.g. out of memory half-way: no manifest names what was written
            self.discard(names)
            raise
        return names

    def read(self, key: str, manifest: Manifest) -> bytes | None:
        """The value a validated manifest names; None if a chunk is missing (replaced or evicted meanwhile).

        The chunks' lengths are asked for first: a manifest that understates them (damaged, or
        forged) must not make this process download and hold what it never named.
        """
        names = [self._names.chunk_key(key, manifest.gen, i) for i in range(manifest.count)]
        pipe = self._calls.client.pipeline(transaction=False)
        for name in names:
            pipe.strlen(name)
        for i, length in enumerate(self._calls.call("strlen", pipe.execute, raise_on_error=False)):
            if isinstance(length, redis.exceptions.ResponseError):
                raise VerificationError(Reason.CORRUPT, f"chunk {i} of {key} is not a string ({length})")
            if isinstance(length, Exception):
                raise redis_error(length, "strlen")
            if length == 0:  # no such key: chunks are never empty
                return None
            if length != manifest.chunk_len(i):
                raise VerificationError(
                    Reason.CORRUPT, f"chunk {i} of {key} is {length} B, its manifest says {manifest.chunk_len(i)}"
                )
        batch = max(1, _MGET_BYTES // manifest.chunk_size)
        chunks: list[bytes | None] = []
        for i in range(0, len(names), batch):
            chunks += self._calls.within(
                self._calls.transfer_s(batch * manifest.chunk_size),
                "mget",
                self._calls.client.mget,
                names[i : i + batch],
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

    def discard(self, names: list[str]) -> None:
        """Delete chunks no manifest names, as far as the server lets us: the rest expire by themselves."""
        if names:
            try:
                self._calls.call("del", self._calls.client.delete, *names)
            except BackendError as exc:
                log.debug("chunks left to expire: %s", exc)


def _split(parts: tuple[Buffer, ...], size: int) -> Iterator[Buffer]:
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
