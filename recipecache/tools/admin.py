"""Whole-store operations behind the admin CLI: stats, list, verify, prune, clear, export, import.

They work on raw envelopes through the store's operator face (:meth:`StoreAdmin.scan`,
:meth:`StoreAdmin.read_raw`, ...), so an export keeps signatures intact and an import verifies
every entry (digest, signature when a secret is set, and that the entry's key hashes to
where it is filed) before writing it. The CLI only parses, calls these and prints.

An envelope names its namespace (the signature covers it), so an entry imported into
another namespace is sealed anew there, signed with the importer's secret: moving signed
entries between namespaces takes the secret (or ``unsigned=True``, which drops the signatures
on purpose).
"""

from __future__ import annotations

import os
import struct
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

import msgpack

from .. import envelope
from ..buffers import Buffer
from ..errors import ConfigError, VerificationError
from ..fsutil import check_output_file, open_named_file
from ..keys import storage_key
from ..reasons import Reason
from ..store_admin import StoreAdmin

#: first object of an export stream; the ``entries`` count lets import tell a whole file from a cut one
EXPORT_FORMAT = "recipecache-export-v2"
#: exports written before the count existed (still read; their end is checked against the file size)
EXPORT_FORMAT_V1 = "recipecache-export-v1"
_COUNT = struct.Struct(">Q")


@dataclass(frozen=True)
class EntryReport:
    """One entry as ``ls``/``verify`` see it; ``problem`` and ``reason`` are None for a good entry."""

    storage_key: str
    size: int
    header: envelope.Header | None
    problem: str | None
    #: last read or write (Unix time) where the backend tracks it (the filesystem store), else None
    last_used: float | None = None
    #: why the entry was refused: only ``corrupt`` is damage; the other refusals are entries this
    #: process cannot accept (another secret, none, an older format) that other jobs may
    reason: Reason | None = None
    #: a copy in this node's directory (the node tier's) of the store's entry ``storage_key``, not the entry itself
    node: bool = False

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "storage_key": self.storage_key,
            "size": self.size,
            "problem": self.problem,
            "reason": self.reason,
            "last_used": self.last_used,
            "node": self.node,
        }
        if self.header is not None:
            out.update(self.header.to_dict())
        return out


@dataclass(frozen=True)
class VerifyResult:
    checked: int
    bad: list[EntryReport] = field(default_factory=list)
    #: the bad entries ``--fix`` removed: the corrupt ones (refused but intact ones stay)
    removed: list[EntryReport] = field(default_factory=list)
    #: corrupt entries ``--fix`` left because they were rewritten after verify read them (a rank published
    #: the key again): what is there now is not what was checked
    changed: list[EntryReport] = field(default_factory=list)


def check_entry(store: StoreAdmin, skey: str, blob: Buffer) -> tuple[envelope.Header | None, VerificationError | None]:
    """Verify one raw envelope filed under ``skey``; returns (header, the refusal or None)."""
    namespace = skey.split("/", 1)[0]
    try:
        header, _payload = envelope.open_envelope(blob, key=None, namespace=namespace, secret=store.settings.secret)
    except VerificationError as exc:
        return None, exc
    if storage_key(namespace, header.key) != skey:
        return header, VerificationError(Reason.CORRUPT, "entry is filed under another key")
    return header, None


def _report(
    info_key: str,
    size: int,
    header: envelope.Header | None,
    refusal: VerificationError | None,
    last_used: float | None,
    node: bool,
) -> EntryReport:
    problem = None if refusal is None else f"{refusal.reason}: {refusal}"
    return EntryReport(info_key, size, header, problem, last_used, None if refusal is None else refusal.reason, node)


#: where ``ls``/``verify``/``clear`` look: the store, then this node's copies of its entries (what its jobs here are
#: served: a damaged or misfiled copy there is as bad as one in the store)
EVERYWHERE = (False, True)


def _read_entries(
    store: StoreAdmin, places: tuple[bool, ...] = EVERYWHERE
) -> Iterator[tuple[EntryReport, Buffer | None]]:
    """Each entry of the store's namespace (in each of ``places``: the store, its node copies), read once and
    verified by :func:`check_entry`, with its raw bytes (None: unreadable)."""
    for node in places:
        for info in store.scan(node=node):
            try:
                blob = store.read_raw(info.key, node=node)
            except VerificationError as exc:  # the backend's own framing of it is damaged
                yield _report(info.key, info.size, None, exc, info.atime or None, node), None
                continue
            if blob is None:
                continue  # evicted or deleted while we listed
            header, refusal = check_entry(store, info.key, blob)
            yield _report(info.key, len(blob), header, refusal, info.atime or None, node), blob


def inspect_entries(store: StoreAdmin) -> Iterator[EntryReport]:
    """Read and verify every entry of the store's namespace, and this node's copies of them."""
    for report, _blob in _read_entries(store):
        yield report


def namespace_sizes(store: StoreAdmin) -> dict[str, Any]:
    """Entries and bytes per namespace and in all, from the backend's listing (no values are read)."""
    namespaces: dict[str, dict[str, int]] = {}
    for info in store.scan(all_namespaces=True):
        ns = namespaces.setdefault(info.key.split("/", 1)[0], {"entries": 0, "bytes": 0})
        ns["entries"] += 1
        ns["bytes"] += info.size
    return {
        "url": store.url,
        "namespaces": namespaces,
        "entries": sum(n["entries"] for n in namespaces.values()),
        "bytes": sum(n["bytes"] for n in namespaces.values()),
    }


def verify(store: StoreAdmin, *, fix: bool) -> VerifyResult:
    """Check every entry of the namespace; with ``fix``, delete the corrupt ones.

    Only damage is removed. An entry refused as ``unsigned``, ``bad_signature`` or
    ``old_format`` is intact and may be what another job (with its secret, or an older
    version) uses; a mistyped secret must not empty the store. A corrupt entry is deleted
    only if it still holds the bytes that were checked (:meth:`StoreAdmin.delete_raw_if`): a rank
    that compiled the key again and published it while verify ran keeps its good entry.
    """
    checked = 0
    bad: list[tuple[EntryReport, Buffer | None]] = []
    for report, blob in _read_entries(store):
        checked += 1
        if report.problem is not None:
            bad.append((report, blob))
    removed: list[EntryReport] = []
    changed: list[EntryReport] = []
    for report, blob in bad if fix else []:
        if report.reason is Reason.CORRUPT:
            (removed if store.delete_raw_if(report.storage_key, blob, node=report.node) else changed).append(report)
    return VerifyResult(checked, [report for report, _blob in bad], removed, changed)


def prune(store: StoreAdmin, max_bytes: int) -> int:
    """Evict least-recently-used entries down to ``max_bytes`` and sweep leftovers; returns bytes freed."""
    freed = store.evict(max_bytes)
    store.vacuum(all_namespaces=True)
    return freed


def clear(store: StoreAdmin, *, all_namespaces: bool = False) -> int:
    """Remove every entry of the store's namespace (or of all), this node's copies of them, and the store's leftovers;
    returns how many entries (copies not counted): a copy left would go on serving this node's jobs what was cleared."""
    removed = 0
    for node in EVERYWHERE:
        for info in store.scan(all_namespaces=all_namespaces, node=node):
            store.delete_raw(info.key, node=node)
            removed += not node
    store.vacuum(all_namespaces=all_namespaces)
    return removed


def export_namespace(store: StoreAdmin, path: Path) -> int:
    """Write every good entry of the store's namespace to ``path`` (a msgpack stream), atomically.

    Each entry is read once. The header's entry count is written last (fixed width, in
    place), so a reader can tell a complete export from one cut at an entry boundary. The
    file is published by a rename, only onto a new name or a regular file: a symlink, FIFO,
    device or directory at ``path`` is a ConfigError and left as it is.
    """
    path = check_output_file(Path(path), "export file")
    directory = path.parent if str(path.parent) else Path(".")
    if not directory.is_dir():
        raise ConfigError(f"cannot export to {path}: directory {directory} does not exist")
    fd, tmp = tempfile.mkstemp(prefix=".export-", dir=directory)
    count = 0
    try:
        with os.fdopen(fd, "wb") as out:
            packer = msgpack.Packer(use_bin_type=True)
            out.write(packer.pack({"format": EXPORT_FORMAT, "namespace": store.namespace}))
            count_at = out.tell()
            out.write(packer.pack(_COUNT.pack(0)))
            for report, blob in _read_entries(store, places=(False,)):  # the entries, not node copies of them
                if report.problem is None and blob is not None:
                    out.write(packer.pack(blob))
                    count += 1
            out.seek(count_at)
            out.write(packer.pack(_COUNT.pack(count)))
        os.replace(tmp, check_output_file(path, "export file"))  # what is there may have changed meanwhile
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return count


class _Damaged(Exception):
    """The export stream ends early or holds something that is not an entry."""


def _export_entries(fh: BinaryIO, path: Path) -> Iterator[bytes]:
    """The entries of an export file, checked to be all there and nothing else (raises _Damaged)."""
    unpacker = msgpack.Unpacker(fh, raw=False, max_buffer_size=2**31 - 1)
    try:
        head = next(unpacker)
    except (StopIteration, ValueError, msgpack.UnpackException):
        head = None
    if not isinstance(head, dict) or head.get("format") not in (EXPORT_FORMAT, EXPORT_FORMAT_V1):
        raise ConfigError(f"{path} is not a recipecache export")
    expected: int | None = None
    try:
        if head["format"] == EXPORT_FORMAT:
            count = next(unpacker)
            if not isinstance(count, bytes) or len(count) != _COUNT.size:
                raise _Damaged("its entry count is damaged")
            expected = _COUNT.unpack(count)[0]
        seen = 0
        for item in unpacker:
            if not isinstance(item, bytes) or (expected is not None and seen == expected):
                raise _Damaged(f"it holds something else after entry {seen}")
            seen += 1
            yield item
    except (StopIteration, ValueError, msgpack.UnpackException) as exc:
        raise _Damaged(f"it cannot be decoded ({exc.__class__.__name__})") from None
    if unpacker.tell() != os.fstat(fh.fileno()).st_size:
        raise _Damaged("it ends in the middle of an entry")
    if expected is not None and seen != expected:
        raise _Damaged(f"it ends after {seen} of {expected} entries")


def _signed_elsewhere(fh: BinaryIO, path: Path, namespace: str) -> bool:
    """Whether the export holds a signed entry of a namespace other than ``namespace``.

    Such an entry is sealed anew on import; without a secret that drops its signature.
    Headers only (no digest); damage is left to the import itself to report.
    """
    try:
        for blob in _export_entries(fh, path):
            try:
                fields, _offset = envelope.read_header(blob)
            except VerificationError:
                continue
            if "sig" in fields and fields["ns"] != namespace:
                return True
    except _Damaged:
        pass
    return False


def import_file(store: StoreAdmin, path: Path, *, unsigned: bool = False) -> tuple[int, int]:
    """Verify and write every entry of an export into the store's namespace; (imported, refused).

    A truncated or otherwise damaged file is a ConfigError that says how many entries
    were imported before the damage (those stay: each one was verified). Without a secret,
    signed entries of another namespace would be sealed anew unsigned: that is a
    ConfigError before anything is written, unless ``unsigned`` says it is wanted.
    """
    fh = open_named_file(path, f"cannot read {path}")  # a FIFO would block the import forever
    imported = refused = 0
    with fh:
        if not store.settings.secret and not unsigned:
            if _signed_elsewhere(fh, Path(path), store.namespace):
                raise ConfigError(
                    f"{path} holds signed entries of another namespace, and importing them into "
                    f"namespace {store.namespace} without a secret would drop their signatures: set "
                    f"RECIPECACHE_SECRET(_FILE) to sign them anew, or pass --unsigned"
                )
            fh.seek(0)
        try:
            for blob in _export_entries(fh, Path(path)):
                try:
                    header, payload = envelope.open_envelope(
                        blob, key=None, namespace=None, secret=store.settings.secret
                    )
                except VerificationError:
                    refused += 1
                    continue
                if header.namespace != store.namespace:
                    blob = envelope.seal(
                        header.key, payload, namespace=store.namespace, secret=store.settings.secret, meta=header.meta
                    )
                store.write_raw(storage_key(store.namespace, header.key), blob)
                imported += 1
        except _Damaged as exc:
            raise ConfigError(
                f"{path} is damaged: {exc}; imported {imported} entries before the damage (refused {refused})"
            ) from None
    return imported, refused
