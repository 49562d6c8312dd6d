"""Gaudi HPU recipe cache sync: share the bridge's compiled recipes between nodes.

The Intel Gaudi PyTorch bridge keeps compiled graph recipes in the directory named by
``PT_HPU_RECIPE_CACHE_CONFIG`` so that, on one node, one rank compiles and the others
read. Intel requires that directory to be on a local physical disk (its file locks are
not trusted on NFS), so across nodes every node compiles everything again. This package
keeps the directory node-local and lets a per-node agent exchange recipes through the
recipecache store (signed when ``RECIPECACHE_SECRET`` is set):

* :func:`rank_environment` -- the variable for each rank (:mod:`.recipe_cache_config`);
* :class:`HpuSyncAgent` / :func:`start_agent` -- the agent (:mod:`.agent`);
* :mod:`.recipes` -- the directory protocol; :mod:`.index` -- what is in the store.

What Intel documents (Runtime Environment Variables; vLLM warm-up guide): the variable's
format and defaults, clearing on start, the size cap with eviction of the oldest recipes
by file-system creation time, local disk only. What it does not document, and what we
therefore assume (and ``tests/support/hpu_bridge_sim.py`` simulates):

* a recipe is two files, ``<hash>.recipe`` and its metadata ``<hash>.meta``, names
  being hashes (letters, digits, ``_``, ``-``); both are opaque to us;
* a writer creates the metadata file, holds ``flock(LOCK_EX)`` on it while it writes the
  recipe and then the metadata, and the first writer wins (a writer that cannot get the
  lock, or finds the metadata non-empty, does not write);
* a reader takes ``flock(LOCK_SH)`` without waiting; a busy lock or a missing or empty
  metadata file is a miss, and the rank compiles;
* "MB" in the size cap is MiB.

If a bridge release names or locks its files differently, only :mod:`.recipes` changes.
"""

from __future__ import annotations

from .._lazy import lazy_getattr
from .recipe_cache_config import (
    ENV_VAR,
    RecipeCacheConfig,
    format_config,
    node_directory,
    parse_config,
    prepare_node_directory,
    rank_environment,
)

#: loaded on first use, so ``python -m recipecache.hpu.agent`` runs the module once, not twice
_LAZY = {name: "recipecache.hpu.agent" for name in ("HpuSyncAgent", "hpu_fingerprint", "start_agent")}

__all__ = [
    "ENV_VAR",
    "RecipeCacheConfig",
    "format_config",
    "node_directory",
    "parse_config",
    "prepare_node_directory",
    "rank_environment",
    *_LAZY,
]

__getattr__ = lazy_getattr(__name__, _LAZY, globals())
