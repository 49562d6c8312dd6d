"""Which recipes exist in the store, for which bridge/driver fingerprint: the index.

Store keys are hashed (the store never lists caller keys), so agents find what other
nodes published through one small msgpack entry under :data:`INDEX_KEY`::

    {"v": 1,
     "fingerprints": {<fingerprint id>: {"hpu_bridge": ..., "hpu_driver": ..., ...}},
     "recipes": {<fingerprint id>: {<recipe name>: [<published unix time>, <bytes>]}}}

Every recipe also lives under its own key (:func:`recipe_key`), so the index is only a
directory: losing it loses no recipe. It is updated by read-merge-write without a lock.
Two agents writing at once can drop each other's additions; that heals because an agent
keeps re-adding what it published until it reads an index that has it (see
:class:`recipecache.hpu.agent.HpuSyncAgent`). Merging is a set union, so re-adding is
harmless. The index keeps the newest :data:`INDEX_CAP` entries.

One index for all fingerprints (not one per fingerprint) lets a node see, and count,
recipes it must not take, which is how an operator finds a node whose driver differs.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import msgpack

from ..buffers import Buffer
from ..keys import make_key
from .recipes import valid_name

log = logging.getLogger(__name__)

INDEX_KEY = "recipecache.hpu/index/v2"
#: Entries kept: far more recipes than one job compiles, and still a few hundred KiB.
INDEX_CAP = 8192
_VERSION = 1


def fingerprint_id(fingerprint: Mapping[str, str]) -> str:
    """The id nodes must share to exchange recipes (covers recipecache's base fingerprint too)."""
    return make_key("hpu-fingerprint", fingerprint=fingerprint)


def recipe_key(name: str, fingerprint: Mapping[str, str]) -> str:
    """The store key of recipe ``name`` built under ``fingerprint``."""
    return make_key(f"hpu-recipe:{name}", fingerprint=fingerprint)


@dataclass(frozen=True)
class IndexEntry:
    fingerprint: str
    name: str
    published: float
    size: int


@dataclass(frozen=True)
class Index:
    entries: dict[tuple[str, str], IndexEntry]
    fingerprints: dict[str, dict[str, str]]

    @classmethod
    def empty(cls) -> Index:
        return cls({}, {})

    @classmethod
    def decode(cls, blob: Buffer) -> Index:
        """The index in ``blob``; malformed parts are skipped, never trusted (names become file names)."""
        try:
            doc: Any = msgpack.unpackb(blob, raw=False)
        except (ValueError, msgpack.UnpackException) as exc:
            log.warning("recipecache: undecodable HPU recipe index (%s); starting a new one", exc)
            return cls.empty()
        if not isinstance(doc, dict) or doc.get("v") != _VERSION:
            return cls.empty()
        entries: dict[tuple[str, str], IndexEntry] = {}
        recipes = doc.get("recipes")
        for fp, names in recipes.items() if isinstance(recipes, dict) else ():
            for name, value in names.items() if isinstance(fp, str) and isinstance(names, dict) else ():
                if valid_name(name) and isinstance(value, list) and len(value) == 2:
                    published, size = value
                    if isinstance(published, (int, float)) and isinstance(size, int):
                        entries[(fp, name)] = IndexEntry(fp, name, float(published), size)
        fingerprints = doc.get("fingerprints")
        known = {
            fp: {str(k): str(v) for k, v in parts.items()}
            for fp, parts in (fingerprints.items() if isinstance(fingerprints, dict) else ())
            if isinstance(fp, str) and isinstance(parts, dict)
        }
        return cls(entries, known)

    def encode(self) -> bytes:
        recipes: dict[str, dict[str, list[Any]]] = {}
        for e in self.entries.values():
            recipes.setdefault(e.fingerprint, {})[e.name] = [e.published, e.size]
        fingerprints = {fp: parts for fp, parts in self.fingerprints.items() if fp in recipes}
        return msgpack.packb({"v": _VERSION, "fingerprints": fingerprints, "recipes": recipes}, use_bin_type=True)

    def __contains__(self, item: tuple[str, str]) -> bool:
        return item in self.entries

    def __len__(self) -> int:
        return len(self.entries)

    def merged(self, added: Iterable[IndexEntry], fingerprint: str, parts: Mapping[str, str]) -> Index:
        """This index plus ``added`` (all of ``fingerprint``), the earliest publish time kept, trimmed to the cap."""
        entries = dict(self.entries)
        for e in added:
            old = entries.get((e.fingerprint, e.name))
            if old is None or e.published < old.published:
                entries[(e.fingerprint, e.name)] = e
        if len(entries) > INDEX_CAP:
            newest = sorted(entries.values(), key=lambda e: e.published)[-INDEX_CAP:]
            entries = {(e.fingerprint, e.name): e for e in newest}
        return Index(entries, {**self.fingerprints, fingerprint: dict(parts)})
