"""The envelope every stored artifact travels in: a msgpack header plus the payload.

Layout (all integers big-endian)::

    b"RCE1" | u32 header length | msgpack header | payload bytes

The header is a map ``{"v", "key", "host", "rank", "created", "size", "sha256"}``, an
optional ``"meta"`` (what the entry is, for ``recipecache ls``: a small map of scalars,
see :func:`check_meta`) and, when a secret is configured, ``"hmac"``: HMAC-SHA256 over the canonical msgpack of the
other header fields. The header carries the payload's sha256, so the HMAC covers the
payload too, and it names the caller's key, so a signed entry cannot be replayed under
another key. The payload is appended raw (not msgpack-wrapped) so that a reader slices
it out without re-encoding.

Artifacts are code that every rank executes: :func:`open_envelope` is the only way to
get a payload back, and it refuses anything that fails a check. msgpack only, never
pickle, at this layer.
"""

from __future__ import annotations

import hashlib
import hmac
import socket
import struct
import time
from dataclasses import dataclass, field
from typing import Any

import msgpack

from .env import process_rank
from .errors import VerificationError
from .reasons import Reason

MAGIC = b"RCE1"
FORMAT_VERSION = 1
_PREFIX = struct.Struct(">4sI")
#: A header is a few hundred bytes; anything far larger is damage, not data.
_MAX_HEADER = 64 * 1024
#: ``meta`` describes an entry (kind, function, shapes, compile seconds); it is no place for data
MAX_META_BYTES = 1024
_SCALARS = (str, int, float, bool, type(None))
_HOST = socket.gethostname()


@dataclass(frozen=True)
class Header:
    """The decoded, verified envelope header."""

    key: str
    host: str
    rank: int
    created: float
    size: int
    sha256: bytes
    signed: bool
    #: what the producer said the entry is (``{}`` when it said nothing)
    meta: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {
            "key": self.key,
            "host": self.host,
            "rank": self.rank,
            "created": self.created,
            "size": self.size,
            "sha256": self.sha256.hex(),
            "signed": self.signed,
            "meta": dict(self.meta),
        }


def check_meta(meta: Any) -> dict[str, Any]:
    """``meta`` if it is a map of string keys to scalars packing to at most :data:`MAX_META_BYTES`.

    Raises ValueError otherwise: a writer passing more is a bug, and a reader finding more
    treats the header as damaged.
    """
    if not isinstance(meta, dict) or not all(isinstance(k, str) and isinstance(v, _SCALARS) for k, v in meta.items()):
        raise ValueError("envelope meta must map strings to scalars (str, int, float, bool, None)")
    size = len(msgpack.packb(meta, use_bin_type=True))
    if size > MAX_META_BYTES:
        raise ValueError(f"envelope meta is {size} bytes packed; at most {MAX_META_BYTES}")
    return meta


def _signature(secret: bytes, fields: dict[str, Any]) -> bytes:
    canonical = msgpack.packb(dict(sorted(fields.items())), use_bin_type=True)
    return hmac.new(secret, canonical, hashlib.sha256).digest()


def seal(
    key: str, payload: bytes, *, secret: bytes | None = None, rank: int | None = None, meta: dict[str, Any] | None = None
) -> bytes:
    """Wrap ``payload`` for storage under ``key``, signing it when ``secret`` is given.

    ``meta`` (checked by :func:`check_meta`) says what the entry is; it is signed with the
    rest of the header.
    """
    fields: dict[str, Any] = {
        "v": FORMAT_VERSION,
        "key": key,
        "host": _HOST,
        "rank": process_rank() if rank is None else rank,
        "created": time.time(),
        "size": len(payload),
        "sha256": hashlib.sha256(payload).digest(),
    }
    if meta:
        fields["meta"] = check_meta(meta)
    if secret:
        fields["hmac"] = _signature(secret, fields)
    header = msgpack.packb(fields, use_bin_type=True)
    return b"".join((_PREFIX.pack(MAGIC, len(header)), header, payload))


def read_header(blob: bytes | memoryview) -> tuple[dict[str, Any], int]:
    """Decode the header map and return it with the payload's offset; checks framing only."""
    view = memoryview(blob)
    if len(view) < _PREFIX.size:
        raise VerificationError(Reason.CORRUPT, "envelope shorter than its prefix")
    magic, header_len = _PREFIX.unpack_from(view)
    if magic != MAGIC:
        raise VerificationError(Reason.CORRUPT, f"bad magic {bytes(magic)!r}")
    if header_len > _MAX_HEADER or _PREFIX.size + header_len > len(view):
        raise VerificationError(Reason.CORRUPT, "truncated or oversized header")
    try:
        fields = msgpack.unpackb(view[_PREFIX.size : _PREFIX.size + header_len], raw=False, strict_map_key=True)
    except (ValueError, msgpack.UnpackException) as exc:
        raise VerificationError(Reason.CORRUPT, f"undecodable header: {exc}") from None
    if not isinstance(fields, dict) or fields.get("v") != FORMAT_VERSION:
        raise VerificationError(Reason.CORRUPT, "unknown envelope format version")
    return fields, _PREFIX.size + header_len


def open_envelope(blob: bytes, *, key: str | None, secret: bytes | None = None) -> tuple[Header, bytes]:
    """Verify ``blob`` and return its header and payload.

    Raises :class:`VerificationError` with reason ``corrupt`` (framing, size, checksum or
    key mismatch), ``unsigned`` or ``bad_signature`` (only when ``secret`` is set).
    ``key=None`` skips the key check (used by admin tools that walk every entry).
    """
    fields, offset = read_header(blob)
    try:
        size = int(fields["size"])
        digest = bytes(fields["sha256"])
        header = Header(
            key=str(fields["key"]),
            host=str(fields.get("host", "")),
            rank=int(fields.get("rank", -1)),
            created=float(fields.get("created", 0.0)),
            size=size,
            sha256=digest,
            signed="hmac" in fields,
            meta=check_meta(fields.get("meta", {})),
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise VerificationError(Reason.CORRUPT, f"malformed header: {exc}") from None
    if len(blob) - offset != size:
        raise VerificationError(Reason.CORRUPT, f"payload is {len(blob) - offset} bytes, header says {size}")
    if key is not None and header.key != key:
        raise VerificationError(Reason.CORRUPT, "entry belongs to another key")
    if secret:
        signature = fields.pop("hmac", None)
        if signature is None:
            raise VerificationError(Reason.UNSIGNED, "entry is not signed and a secret is configured")
        if not hmac.compare_digest(bytes(signature), _signature(secret, fields)):
            raise VerificationError(Reason.BAD_SIGNATURE, "entry signature does not match the configured secret")
    payload = blob[offset:] if offset else blob
    if not hmac.compare_digest(hashlib.sha256(payload).digest(), digest):
        raise VerificationError(Reason.CORRUPT, "payload checksum mismatch")
    return header, payload
