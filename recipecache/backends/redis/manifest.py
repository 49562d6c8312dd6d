"""How a Redis entry frames a value too large to store inline: a chunk manifest, validated before anything is fetched.

Small values are stored inline. Larger ones are split into chunks (:mod:`.chunks`) under a
fresh generation id, and a manifest ``RCM2:<gen>:<count>:<total>:<chunk size>`` takes the
entry's place. The manifest names the writer's chunk size, so a reader with another
``chunk_size`` reads it all the same. A reader validates a manifest before it fetches
anything (:class:`Manifest`: its length and characters, ``count == ceil(total / chunk size)``,
caps on count and size), so a damaged manifest never makes a reader download more than it
names. Inline values that begin like a manifest (``RCM``) are stored chunked, so the first
bytes of a stored value always tell framing from data. The Lua scripts parse manifests
themselves (:mod:`.scripts`, the Lua twin of :meth:`Manifest.parse`).
"""

from __future__ import annotations

import re
import struct
from dataclasses import dataclass
from typing import Any

from ...errors import VerificationError
from ...reasons import Reason

#: Values up to this size (and up to ``chunk_size``) are stored inline; a Lua script copies
#: its arguments, which costs more than a second round trip for larger ones.
INLINE_MAX = 64 * 1024
#: The most chunks one value may have; a writer with a small ``chunk_size`` uses larger chunks.
MAX_CHUNKS = 4096
#: Redis's own limit on one string.
MAX_CHUNK_SIZE = 512 * 1024 * 1024
#: The largest value a reader assembles.
MAX_VALUE = 16 * 1024**3
_MANIFEST_V2 = re.compile(rb"\ARCM2:([0-9a-f]{16}):([0-9]{1,9}):([0-9]{1,15}):([0-9]{1,12})\Z")
#: The previous format's manifest: magic, chunk count, total size, then a 16-hex-digit generation id.
MANIFEST_V1 = struct.Struct(">4sIQ")
#: what every stored manifest begins with, and no inline value does
FRAMING = b"RCM"
#: bytes of a value's start that hold a whole manifest (what ``scan`` and the scripts peek at)
MANIFEST_PEEK = 64


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
            if len(raw) == MANIFEST_V1.size + 16:
                _magic, count, total = MANIFEST_V1.unpack_from(raw)
                v1_gen = raw[MANIFEST_V1.size :]
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


def manifest_of(head: Any) -> tuple[str | None, int | None]:
    """The generation and total size a stored value's first bytes name if it is a manifest (either format), else Nones."""
    if isinstance(head, bytes) and head.startswith(FRAMING):
        try:
            manifest = Manifest.parse(head)
            return manifest.gen, manifest.total
        except VerificationError as exc:
            if exc.reason is Reason.OLD_FORMAT:
                return head[MANIFEST_V1.size :].decode(), int(MANIFEST_V1.unpack_from(head)[2])
    return None, None


def stored_size(head: bytes, length: int) -> int:
    """The size of the value an entry holds, from the first bytes and length of its stored form."""
    total = manifest_of(head)[1]
    return length if total is None else total
