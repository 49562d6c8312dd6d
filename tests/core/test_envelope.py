"""The envelope (format 2, BLAKE3) against hostile and old bytes, alone and under the store.

Every way the stored bytes can be wrong is a ``VerificationError`` with a counted reason,
never another exception out of ``open_envelope`` or ``Store.get``/``put``/``update``;
``corrupt`` entries are deleted by a reader, everything it merely cannot accept is kept.
"""

from __future__ import annotations

import hashlib
import hmac
import random
import struct
from typing import Any

import msgpack
import pytest

from recipecache import envelope
from recipecache.backends.memory import MemoryBackend
from recipecache.errors import VerificationError
from recipecache.eventlog import EventLog
from recipecache.keys import storage_key
from recipecache.settings import StoreSettings
from recipecache.store import Store

NS = "job"
PAYLOAD = bytes(range(256)) * 40


def make_store(backend: MemoryBackend, secret: bytes | None = None, namespace: str = NS) -> Store:
    return Store(backend, StoreSettings(url="memory://", namespace=namespace, secret=secret), events=EventLog(None))


def fields_of(blob: bytes) -> dict[str, Any]:
    (length,) = struct.unpack_from(">I", blob, 4)
    return dict(msgpack.unpackb(blob[8 : 8 + length], raw=False))


def framed(fields: Any, payload: bytes = PAYLOAD, magic: bytes = b"RCE2") -> bytes:
    header = msgpack.packb(fields, use_bin_type=True)
    return magic + struct.pack(">I", len(header)) + header + payload


def good_fields(secret: bytes | None = None) -> dict[str, Any]:
    return fields_of(envelope.seal("k", PAYLOAD, namespace=NS, secret=secret))


def old_format_entry(key: str, payload: bytes, secret: bytes | None = None) -> bytes:
    """An entry exactly as recipecache's previous envelope (RCE1: sha256, HMAC-SHA256) wrote it."""
    fields: dict[str, Any] = {"v": 1, "key": key, "host": "h", "rank": 0, "created": 1.0, "size": len(payload),
                              "sha256": hashlib.sha256(payload).digest()}
    if secret:
        canonical = msgpack.packb(dict(sorted(fields.items())), use_bin_type=True)
        fields["hmac"] = hmac.new(secret, canonical, hashlib.sha256).digest()
    return framed(fields, payload, magic=b"RCE1")


def reason_of(blob: bytes, secret: bytes | None = None, key: str | None = "k") -> str:
    with pytest.raises(VerificationError) as info:
        envelope.open_envelope(blob, key=key, namespace=NS, secret=secret)
    return str(info.value.reason)


def test_round_trip_hands_out_a_view_not_a_copy() -> None:
    blob = envelope.seal("k", PAYLOAD, namespace=NS, secret=b"s" * 16)
    header, payload = envelope.open_envelope(blob, key="k", namespace=NS, secret=b"s" * 16)
    assert payload == PAYLOAD and payload.readonly and payload.obj is blob
    assert (header.namespace, header.key, header.size, header.signed) == (NS, "k", len(PAYLOAD), True)
    assert len(header.digest) == 32
    head = envelope.seal_header("k", memoryview(PAYLOAD), namespace=NS)
    assert envelope.open_envelope(head + PAYLOAD, key="k", namespace=NS)[1] == PAYLOAD


# -- the previous format ----------------------------------------------------------------
@pytest.mark.parametrize("secret", [None, b"a-secret-of-16-bytes"])
def test_old_format_entry_is_an_old_format_miss_kept_and_replaced(secret: bytes | None) -> None:
    assert reason_of(old_format_entry("k", PAYLOAD, secret), secret) == "old_format"
    backend = MemoryBackend()
    store = make_store(backend, secret)
    skey = storage_key(NS, "k")
    old = old_format_entry("k", b"old artifact", secret)
    backend.put(skey, old)
    assert store.get("k") is None
    assert store.stats()["misses_by_reason"] == {"old_format": 1}
    assert backend.get(skey) == old, "an older recipecache may still read it: a reader leaves it"
    assert store.get_or_compile("k", lambda: b"new artifact") == b"new artifact"
    assert store.get("k") == b"new artifact", "the next put replaces it"
    assert store.stats()["deleted_bad"] == 0


# -- tampering ---------------------------------------------------------------------------
def test_tampered_digest_is_corrupt_and_deleted() -> None:
    backend = MemoryBackend()
    store = make_store(backend, b"right-secret-0123")
    store.put("k", PAYLOAD)
    skey = storage_key(NS, "k")
    fields = fields_of(backend.get(skey) or b"")
    fields["blake3"] = bytes(32)
    backend.put(skey, framed(fields))
    assert reason_of(framed(fields), b"right-secret-0123") == "corrupt"
    assert store.get("k") is None
    assert store.stats()["misses_by_reason"] == {"corrupt": 1}
    assert backend.get(skey) is None, "a digest that does not match its payload is provably bad: deleted"
    assert store.stats()["deleted_bad"] == 1


def test_tampered_payload_under_a_signed_header_is_corrupt() -> None:
    blob = bytearray(envelope.seal("k", PAYLOAD, namespace=NS, secret=b"right-secret-0123"))
    blob[-1] ^= 1
    assert reason_of(bytes(blob), b"right-secret-0123") == "corrupt"


@pytest.mark.parametrize("field", ["sig", "host", "created", "rank"])
def test_tampered_signature_or_signed_field_is_a_bad_signature_kept(field: str) -> None:
    backend = MemoryBackend()
    store = make_store(backend, b"right-secret-0123")
    store.put("k", PAYLOAD)
    skey = storage_key(NS, "k")
    fields = fields_of(backend.get(skey) or b"")
    fields[field] = {"sig": bytes(32), "host": "evil", "created": 2.0, "rank": 7}[field]
    backend.put(skey, framed(fields))
    assert store.get("k") is None
    assert store.stats()["misses_by_reason"] == {"bad_signature": 1}
    assert backend.get(skey) == framed(fields), "no proof it is bad without the signer's secret: kept"
    assert make_store(backend).get("k") == PAYLOAD, "the digest still covers the payload"


def test_entry_moved_to_another_namespace_or_key_is_corrupt() -> None:
    backend = MemoryBackend()
    make_store(backend, b"right-secret-0123").put("k", PAYLOAD)
    blob = backend.get(storage_key(NS, "k")) or b""
    backend.put(storage_key("other", "k"), blob)
    other = make_store(backend, b"right-secret-0123", namespace="other")
    assert other.get("k") is None
    fields = fields_of(blob)
    fields["ns"] = "other"  # rewritten to fit: the signature covers the namespace
    backend.put(storage_key("other", "k"), framed(fields))
    assert other.get("k") is None
    assert other.stats()["misses_by_reason"] == {"corrupt": 1, "bad_signature": 1}


# -- hostile header fields (issue 15, item 2) ------------------------------------------------
def _replaced(**changes: Any) -> Any:
    fields = good_fields()
    fields.update(changes)
    return fields


def _without(name: str) -> Any:
    fields = good_fields()
    del fields[name]
    return fields


HOSTILE_HEADERS: dict[str, Any] = {
    "digest-int-2**63": _replaced(blake3=2**63),  # bytes(2**63): OverflowError out of get before
    "digest-int-huge": _replaced(blake3=2**64 - 1),
    "digest-int-small": _replaced(blake3=10**6),  # bytes(10**6): a megabyte of zeros before
    "digest-short": _replaced(blake3=bytes(31)),
    "digest-long": _replaced(blake3=bytes(33)),
    "digest-str": _replaced(blake3="0" * 32),
    "digest-list": _replaced(blake3=[0] * 32),
    "digest-none": _replaced(blake3=None),
    "size-str": _replaced(size=str(len(PAYLOAD))),
    "size-float": _replaced(size=float(len(PAYLOAD))),
    "size-bool": _replaced(size=True),
    "size-negative": _replaced(size=-1),
    "size-huge": _replaced(size=2**63),
    "size-wrong": _replaced(size=len(PAYLOAD) + 1),
    "key-bytes": _replaced(key=b"k"),
    "key-int": _replaced(key=5),
    "key-too-long": _replaced(key="k" * 5000),
    "ns-other": _replaced(ns="other"),
    "ns-bad-chars": _replaced(ns="../etc"),
    "ns-newline": _replaced(ns="job\n"),
    "ns-int": _replaced(ns=7),
    "host-int": _replaced(host=5),
    "host-long": _replaced(host="h" * 300),
    "rank-str": _replaced(rank="0"),
    "rank-huge": _replaced(rank=2**40),
    "rank-below": _replaced(rank=-2),
    "rank-bool": _replaced(rank=True),
    "created-nan": _replaced(created=float("nan")),
    "created-inf": _replaced(created=float("inf")),
    "created-negative": _replaced(created=-1.0),
    "created-str": _replaced(created="now"),
    "version-1": _replaced(v=1),
    "version-str": _replaced(v="2"),
    "version-float": _replaced(v=2.0),
    "sig-short": _replaced(sig=bytes(31)),
    "sig-str": _replaced(sig="signature"),
    "extra-field": _replaced(evil=1),
    "extra-bytes-key": {**good_fields(), b"ns": "job"},
    "missing-size": _without("size"),
    "missing-blake3": _without("blake3"),
    "missing-ns": _without("ns"),
    "header-list": [1, 2, 3],
    "header-str": "RCE2",
    "header-int": 2**64 - 1,
    "header-nested": [[[[[[[[[[[[[[[[]]]]]]]]]]]]]]]],
}


def _framing_damage() -> dict[str, bytes]:
    blob = envelope.seal("k", PAYLOAD, namespace=NS)
    (length,) = struct.unpack_from(">I", blob, 4)
    header = blob[8 : 8 + length]
    deep = b"\x91" * 100_000 + b"\xc0"  # a list in a list in a list...
    return {
        "empty": b"",
        "prefix-only": blob[:8],
        "three-bytes": b"RCE",
        "bad-magic": b"RCEX" + blob[4:],
        "header-length-max": blob[:4] + struct.pack(">I", 2**32 - 1) + blob[8:],
        "header-length-past-end": blob[:4] + struct.pack(">I", len(blob)) + blob[8:],
        "header-truncated": blob[:4] + struct.pack(">I", length - 5) + header[:-5] + PAYLOAD,
        "header-trailing-garbage": blob[:4] + struct.pack(">I", length + 3) + header + b"\x01\x02\x03" + PAYLOAD,
        "header-not-msgpack": blob[:4] + struct.pack(">I", 4) + b"\xc1\xc1\xc1\xc1" + PAYLOAD,
        "header-non-utf8-str": blob[:4] + struct.pack(">I", 3) + b"\xa2\xff\xfe" + PAYLOAD,
        "header-deeply-nested": b"RCE2" + struct.pack(">I", len(deep)) + deep + PAYLOAD,
        "payload-truncated": blob[:-1],
        "payload-trailing": blob + b"x",
    }


HOSTILE_BLOBS = {**{name: framed(fields) for name, fields in HOSTILE_HEADERS.items()}, **_framing_damage()}


@pytest.mark.parametrize("name", sorted(HOSTILE_BLOBS))
def test_hostile_bytes_are_a_corrupt_miss_never_an_exception(name: str) -> None:
    blob = HOSTILE_BLOBS[name]
    assert reason_of(blob) == "corrupt"
    assert reason_of(blob, b"a-secret-of-16-bytes") == "corrupt"
    backend = MemoryBackend()
    store = make_store(backend)
    skey = storage_key(NS, "k")
    backend.put(skey, blob)
    assert store.get("k") is None
    assert store.stats()["misses_by_reason"] == {"corrupt": 1}
    assert backend.get(skey) is None, "damaged framing or fields: deleted"
    backend.put(skey, blob)
    assert store.update("k", lambda current: b"fresh" if current is None else None).data == b"fresh"
    backend.put(skey, blob)
    assert store.put("k", b"fresh") and store.get("k") == b"fresh"


def test_mutated_and_truncated_envelopes_never_escape_as_other_exceptions() -> None:
    """Property-style: thousands of random mutations of real envelopes (header and payload bytes
    flipped, inserted, deleted, truncated). Each is refused with a VerificationError, or, where
    the mutation left a valid envelope (it only changed unsigned metadata), yields exactly the
    original payload: nothing else ever comes out."""
    rng = random.Random(20250115)
    secret = b"a-secret-of-16-bytes"
    samples = [
        (envelope.seal(k, p, namespace=NS, secret=s), k, p, s)
        for k, p in (("k", PAYLOAD), ("a-longer-key/with/parts", b""), ("k2", b"x"))
        for s in (None, secret)
    ]
    outcomes: dict[str, int] = {}
    for _ in range(6000):
        blob, key, payload, sec = rng.choice(samples)
        data = bytearray(blob)
        header_end = 8 + struct.unpack_from(">I", blob, 4)[0]
        for _ in range(rng.randint(1, 3)):
            at = rng.randrange(0, header_end + 4) if rng.random() < 0.8 else rng.randrange(0, len(data) + 1)
            op = rng.choice(("flip", "set", "insert", "delete", "truncate"))
            if op == "flip" and at < len(data):
                data[at] ^= 1 << rng.randrange(8)
            elif op == "set" and at < len(data):
                data[at] = rng.choice((0x00, 0xFF, 0xC1, 0xCF, 0xDB, 0x7F, 0x80, rng.randrange(256)))
            elif op == "insert":
                data[at:at] = bytes(rng.randrange(256) for _ in range(rng.randint(1, 9)))
            elif op == "delete":
                del data[at : at + rng.randint(1, 9)]
            elif op == "truncate":
                del data[at:]
        try:
            _header, out = envelope.open_envelope(bytes(data), key=key, namespace=NS, secret=sec)
        except VerificationError as exc:
            outcomes[str(exc.reason)] = outcomes.get(str(exc.reason), 0) + 1
            continue
        assert out == payload, "a mutated envelope yielded another payload"
        outcomes["accepted"] = outcomes.get("accepted", 0) + 1
    assert outcomes.get("corrupt", 0) > 3000 and outcomes.get("bad_signature", 0) > 0, outcomes
