"""The envelope every stored artifact travels in: a msgpack header plus the payload.

Layout (all integers big-endian)::

    b"RCE2" | u32 header length | msgpack header | payload bytes

The header is a map of exactly these fields, each type- and length-checked on read:

``v`` (2), ``ns`` (the namespace), ``key`` (the caller's key), ``host``, ``rank``,
``created`` (unix time), ``size`` (payload bytes), ``blake3`` (the payload's 32-byte BLAKE3
digest), optionally ``meta`` (what the entry is, for ``recipecache ls``: a map of at most
:data:`MAX_META_BYTES` packed, string keys to scalars; see :func:`check_meta`), and, when a
secret is configured, ``sig``: keyed BLAKE3 over the canonical msgpack
of the other fields, with a key derived from the secret (BLAKE3's ``derive_key`` mode, so
the secret itself is never used as a key). The header carries the payload's digest, so the
signature covers the payload too; it names the namespace and the caller's key, so a signed
entry can be neither replayed under another key nor moved to another namespace. One digest
covers the whole payload: formats inside it need none of their own.

The payload is appended raw (not msgpack-wrapped), so a writer sends header and payload as
two buffers without joining them and a reader takes the payload as a ``memoryview`` slice of
what it read, without copying it.

Entries of the previous format (``RCE1``: sha256 and HMAC-SHA256) are refused as
``old_format``, never read as this one. Artifacts are code that every rank executes:
:func:`open_envelope` is the only way to get a payload back, and it refuses anything that
fails a check. msgpack only, never pickle, at this layer.
"""

from __future__ import annotations

import hmac
import math
import os
import socket
import struct
import time
from dataclasses import dataclass, field
from typing import Any

import blake3
import msgpack

from .buffers import Buffer
from .env import process_rank
from .errors import VerificationError
from .keys import NAMESPACE_PATTERN
from .reasons import Reason

MAGIC = b"RCE2"
FORMAT_VERSION = 2
#: Magic numbers of formats this version recognises and refuses as ``old_format``.
OLD_MAGICS = frozenset({b"RCE1"})
_PREFIX = struct.Struct(">4sI")
#: A header is a few hundred bytes; anything far larger is damage, not data.
_MAX_HEADER = 64 * 1024
#: Caller keys are short strings (hashes, paths of a few segments); the cap only bounds damage.
MAX_KEY = 4096
_MAX_HOST = 255
_MAX_RANK = 2**31 - 1
#: No payload is a petabyte: a larger size field is damage.
_MAX_SIZE = 2**50
_DIGEST_LEN = 32
#: Payloads at least this large are hashed on every core (BLAKE3 splits them into a tree).
_THREADED_HASH_MIN = 1 << 20
#: BLAKE3 ``derive_key`` context: a globally unique, hardcoded string naming this one use.
_SIGNING_CONTEXT = "recipecache 2025-01 envelope v2 signing key"
_HOST = socket.gethostname()[:_MAX_HOST]
#: ``meta`` describes an entry (kind, function, shapes, compile seconds); it is no place for data
MAX_META_BYTES = 1024
_SCALARS = (str, int, float, bool, type(None))


@dataclass(frozen=True)
class Header:
    """The decoded, checked envelope header."""

    namespace: str
    key: str
    host: str
    rank: int
    created: float
    size: int
    digest: bytes
    signed: bool
    #: what the producer said the entry is (``{}`` when it said nothing)
    meta: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {
            "namespace": self.namespace,
            "key": self.key,
            "host": self.host,
            "rank": self.rank,
            "created": self.created,
            "size": self.size,
            "blake3": self.digest.hex(),
            "signed": self.signed,
            "meta": dict(self.meta),
        }


def check_meta(meta: Any) -> dict[str, Any]:
    """``meta`` if it is a map of string keys to scalars packing to at most :data:`MAX_META_BYTES`.

    Raises ValueError otherwise: a writer passing more is a bug (a reader finding more
    treats the header as damaged).
    """
    if not isinstance(meta, dict) or not all(isinstance(k, str) and isinstance(v, _SCALARS) for k, v in meta.items()):
        raise ValueError("envelope meta must map strings to scalars (str, int, float, bool, None)")
    size = len(msgpack.packb(meta, use_bin_type=True))
    if size > MAX_META_BYTES:
        raise ValueError(f"envelope meta is {size} bytes packed; at most {MAX_META_BYTES}")
    return meta


#: False in a process forked from another (see :func:`digest`): it hashes on one thread.
_threads_usable = True


def _forked() -> None:
    global _threads_usable
    _threads_usable = False


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forked)


def digest(payload: Buffer) -> bytes:
    """The payload's BLAKE3 digest; large payloads are hashed on all cores, except in a forked child.

    BLAKE3 hashes on a process-wide thread pool (Rust's rayon), started by the first
    threaded hash and not fork-safe: a child forked after it started (a multiprocessing
    pool, a DataLoader worker) inherits the pool without its threads, and its first
    threaded hash waits for them forever. Any code of the parent may have started it, so a
    forked child hashes on its own thread; a spawned process (a new interpreter) is no child
    in this sense and uses every core.
    """
    threads = blake3.blake3.AUTO if _threads_usable and len(payload) >= _THREADED_HASH_MIN else 1
    return blake3.blake3(payload, max_threads=threads).digest()


def _signature(secret: bytes, fields: dict[str, Any]) -> bytes:
    """Keyed BLAKE3 over the canonical (sorted) msgpack of ``fields``, keyed by a key derived from ``secret``."""
    key = blake3.blake3(secret, derive_key_context=_SIGNING_CONTEXT).digest()
    canonical = msgpack.packb(dict(sorted(fields.items())), use_bin_type=True)
    return blake3.blake3(canonical, key=key).digest()


def seal_header(
    key: str,
    payload: Buffer,
    *,
    namespace: str,
    secret: bytes | None = None,
    rank: int | None = None,
    meta: dict[str, Any] | None = None,
) -> bytes:
    """The envelope's prefix and header for ``payload``; the envelope is this followed by the payload.

    A writer sends the two buffers as they are (``backend.put(k, header, payload)``), so the
    payload is never copied to join them. ``meta`` (:func:`check_meta`) says what the entry
    is; it is signed with the rest of the header.
    """
    if not NAMESPACE_PATTERN.match(namespace):
        raise ValueError(f"bad namespace {namespace!r}")
    if len(key) > MAX_KEY:
        raise ValueError(f"store key longer than {MAX_KEY} characters")
    fields: dict[str, Any] = {
        "v": FORMAT_VERSION,
        "ns": namespace,
        "key": key,
        "host": _HOST,
        "rank": process_rank() if rank is None else rank,
        "created": time.time(),
        "size": len(payload),
        "blake3": digest(payload),
    }
    if meta:
        fields["meta"] = check_meta(meta)
    if secret:
        fields["sig"] = _signature(secret, fields)
    header = msgpack.packb(fields, use_bin_type=True)
    return _PREFIX.pack(MAGIC, len(header)) + header


def seal(
    key: str,
    payload: Buffer,
    *,
    namespace: str,
    secret: bytes | None = None,
    rank: int | None = None,
    meta: dict[str, Any] | None = None,
) -> bytes:
    """The whole envelope as one buffer (for tools and tests; the store writes the two parts)."""
    return seal_header(key, payload, namespace=namespace, secret=secret, rank=rank, meta=meta) + bytes(payload)


def _check(ok: bool, field: str) -> None:
    if not ok:
        raise VerificationError(Reason.CORRUPT, f"malformed header field {field!r}")


def _is_int(value: object, low: int, high: int) -> bool:
    return type(value) is int and low <= value <= high  # bool is an int subclass, and not a count


def _is_str(value: object, low: int, high: int) -> bool:
    return type(value) is str and low <= len(value) <= high


def _checked_fields(fields: object) -> dict[str, Any]:
    """``fields`` if it is exactly the header map of this format, every field of its type and size."""
    if not isinstance(fields, dict):
        raise VerificationError(Reason.CORRUPT, "header is not a map")
    if fields.get("v") != FORMAT_VERSION or type(fields.get("v")) is not int:
        raise VerificationError(Reason.CORRUPT, "unknown envelope format version")
    required = {"v", "ns", "key", "host", "rank", "created", "size", "blake3"}
    extra = set(fields) - required - {"sig", "meta"}
    if required - set(fields) or extra:
        raise VerificationError(Reason.CORRUPT, f"header fields {sorted(map(str, fields))} are not this format's")
    _check(_is_str(fields["ns"], 1, 64) and NAMESPACE_PATTERN.match(fields["ns"]) is not None, "ns")
    _check(_is_str(fields["key"], 0, MAX_KEY), "key")
    _check(_is_str(fields["host"], 0, _MAX_HOST), "host")
    _check(_is_int(fields["rank"], -1, _MAX_RANK), "rank")
    created = fields["created"]
    _check(type(created) is float and math.isfinite(created) and created >= 0, "created")
    _check(_is_int(fields["size"], 0, _MAX_SIZE), "size")
    _check(type(fields["blake3"]) is bytes and len(fields["blake3"]) == _DIGEST_LEN, "blake3")
    if "sig" in fields:
        _check(type(fields["sig"]) is bytes and len(fields["sig"]) == _DIGEST_LEN, "sig")
    if "meta" in fields:
        try:
            check_meta(fields["meta"])
        except ValueError:
            _check(False, "meta")
    return fields


def read_header(blob: Buffer) -> tuple[dict[str, Any], int]:
    """The checked header map and the payload's offset; checks framing and field types, not the digest.

    Raises :class:`VerificationError`: ``old_format`` for an envelope of an earlier format,
    ``corrupt`` for anything else that is not a well-formed header of this one.
    """
    view = memoryview(blob)
    if len(view) < _PREFIX.size:
        raise VerificationError(Reason.CORRUPT, "envelope shorter than its prefix")
    magic, header_len = _PREFIX.unpack_from(view)
    if magic in OLD_MAGICS:
        raise VerificationError(Reason.OLD_FORMAT, f"entry of an older envelope format ({magic.decode()})")
    if magic != MAGIC:
        raise VerificationError(Reason.CORRUPT, f"bad magic {bytes(magic)!r}")
    if header_len > _MAX_HEADER or _PREFIX.size + header_len > len(view):
        raise VerificationError(Reason.CORRUPT, "truncated or oversized header")
    try:
        fields = msgpack.unpackb(
            view[_PREFIX.size : _PREFIX.size + header_len], raw=False, strict_map_key=True, use_list=False
        )
    except (
        ValueError,
        msgpack.UnpackException,
    ) as exc:  # ExtraData, UnicodeDecodeError and FormatError are ValueErrors
        raise VerificationError(Reason.CORRUPT, f"undecodable header: {exc}") from None
    return _checked_fields(fields), _PREFIX.size + header_len


def open_envelope(
    blob: Buffer, *, key: str | None, namespace: str | None, secret: bytes | None = None
) -> tuple[Header, memoryview]:
    """Verify ``blob`` and return its header and its payload (a read-only view into ``blob``, not a copy).

    Raises :class:`VerificationError` with reason ``old_format`` (an earlier envelope
    format), ``corrupt`` (framing, a header field, size or digest, or the entry names
    another key or namespace: all checkable without a secret), ``unsigned`` or
    ``bad_signature`` (only when ``secret`` is set). ``key=None`` / ``namespace=None`` skip
    those checks (admin tools that walk every entry check where it is filed themselves).
    """
    fields, offset = read_header(blob)
    view = memoryview(blob).toreadonly()
    size = fields["size"]
    if len(view) - offset != size:
        raise VerificationError(Reason.CORRUPT, f"payload is {len(view) - offset} bytes, header says {size}")
    if key is not None and fields["key"] != key:
        raise VerificationError(Reason.CORRUPT, "entry belongs to another key")
    if namespace is not None and fields["ns"] != namespace:
        raise VerificationError(Reason.CORRUPT, "entry belongs to another namespace")
    payload = view[offset:]
    if not hmac.compare_digest(digest(payload), fields["blake3"]):
        raise VerificationError(Reason.CORRUPT, "payload checksum mismatch (BLAKE3 digest)")
    if secret:
        signature = fields.get("sig")
        if signature is None:
            raise VerificationError(Reason.UNSIGNED, "entry is not signed and a secret is configured")
        unsigned = {name: value for name, value in fields.items() if name != "sig"}
        if not hmac.compare_digest(signature, _signature(secret, unsigned)):
            raise VerificationError(Reason.BAD_SIGNATURE, "entry signature does not match the configured secret")
    header = Header(
        namespace=fields["ns"],
        key=fields["key"],
        host=fields["host"],
        rank=fields["rank"],
        created=fields["created"],
        size=size,
        digest=fields["blake3"],
        signed="sig" in fields,
        meta=dict(fields.get("meta") or {}),
    )
    return header, payload
