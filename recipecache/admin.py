"""Whole-store operations behind the admin CLI: list, verify, prune, clear, export, import.

They work on raw envelopes through the backend, so an export keeps signatures intact and
an import verifies every entry (checksum, signature when a secret is set, and that the
entry's key hashes to where it is filed) before writing it.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgpack

from . import envelope
from .errors import ConfigError, VerificationError
from .keys import storage_key
from .store import Store

EXPORT_MAGIC = "recipecache-export-v1"


@dataclass(frozen=True)
class EntryReport:
    """One entry as ``ls``/``verify`` see it; ``problem`` is None for a good entry."""

    storage_key: str
    size: int
    header: envelope.Header | None
    problem: str | None

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"storage_key": self.storage_key, "size": self.size, "problem": self.problem}
        if self.header is not None:
            out.update(self.header.to_dict())
        return out


def check_entry(store: Store, skey: str, blob: bytes) -> tuple[envelope.Header | None, str | None]:
    """Verify one raw envelope filed under ``skey``; returns (header, problem)."""
    try:
        header, _payload = envelope.open_envelope(blob, key=None, secret=store.settings.secret)
    except VerificationError as exc:
        return None, f"{exc.reason}: {exc}"
    namespace = skey.split("/", 1)[0]
    if storage_key(namespace, header.key) != skey:
        return header, "corrupt: entry is filed under another key"
    return header, None


def inspect_entries(store: Store, namespace: str | None = None) -> Iterator[EntryReport]:
    """Read and verify every entry of ``namespace`` (default: the store's)."""
    for info in store.entries(namespace):
        blob = store.backend.get(info.key)
        if blob is None:
            continue  # evicted or deleted while we listed
        header, problem = check_entry(store, info.key, blob)
        yield EntryReport(info.key, len(blob), header, problem)


def clear(store: Store, namespace: str | None = None) -> int:
    removed = 0
    for info in list(store.entries(namespace)):
        store.backend.delete(info.key)
        removed += 1
    return removed


def export_namespace(store: Store, path: Path) -> int:
    """Write every good entry of the store's namespace to ``path`` (msgpack stream), atomically."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=".export-", dir=path.parent if str(path.parent) else ".")
    count = 0
    try:
        with os.fdopen(fd, "wb") as out:
            packer = msgpack.Packer(use_bin_type=True)
            out.write(packer.pack({"format": EXPORT_MAGIC, "namespace": store.namespace}))
            for report in inspect_entries(store):
                if report.problem is None:
                    blob = store.backend.get(report.storage_key)
                    if blob is not None:
                        out.write(packer.pack(blob))
                        count += 1
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return count


def import_file(store: Store, path: Path) -> tuple[int, int]:
    """Verify and write every entry of an export into the store's namespace; (imported, refused)."""
    try:
        fh = open(path, "rb")  # noqa: SIM115 - closed below
    except OSError as exc:
        raise ConfigError(f"cannot read {path}: {exc.strerror}") from None
    imported = refused = 0
    with fh:
        unpacker = msgpack.Unpacker(fh, raw=False, max_buffer_size=2**31 - 1)
        try:
            head = next(unpacker)
        except (StopIteration, ValueError, msgpack.UnpackException):
            head = None
        if not isinstance(head, dict) or head.get("format") != EXPORT_MAGIC:
            raise ConfigError(f"{path} is not a recipecache export")
        for blob in unpacker:
            if not isinstance(blob, bytes):
                refused += 1
                continue
            try:
                header, _payload = envelope.open_envelope(blob, key=None, secret=store.settings.secret)
            except VerificationError:
                refused += 1
                continue
            store.backend.put(storage_key(store.namespace, header.key), blob)
            imported += 1
    return imported, refused
