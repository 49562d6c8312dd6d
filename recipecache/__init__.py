"""recipecache: a shared, signed, single-flight compile-artifact cache for distributed PyTorch.

``import recipecache`` does not import torch; names that need it load on first use, and so do the store's (its
backends, msgpack, blake3): the start-up hook imports this package in every process of a job that sets
``RECIPECACHE_ENABLE``, most of which never open a store (:mod:`recipecache.autoenable`).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from ._lazy import lazy_getattr
from .env import __version__
from .errors import BackendError, ConfigError, RecipeCacheError, VerificationError
from .reasons import Reason, Role

if TYPE_CHECKING:
    from .flight import Flight
    from .keys import make_key
    from .store import Store, open_store

logging.getLogger(__name__).addHandler(logging.NullHandler())

#: public name -> module that defines it, imported on first access (these import torch or numpy, or the store's
#: dependencies)
_LAZY = {
    "make_key": "recipecache.keys",
    "Flight": "recipecache.flight",
    "Store": "recipecache.store",
    "open_store": "recipecache.store",
    "enable": "recipecache.torch_integration",
    "disable": "recipecache.torch_integration",
    "mark_step": "recipecache.torch_integration",
    "metrics": "recipecache.torch_integration",
    "prewarm": "recipecache.shapes.prewarm",
    "declare_shapes": "recipecache.shapes.prewarm",
    "data_dynamicity": "recipecache.shapes.dynamicity",
    "percentile_buckets": "recipecache.shapes.buckets",
    "optimal_buckets": "recipecache.shapes.buckets",
    "padding_waste": "recipecache.shapes.buckets",
    "assign_buckets": "recipecache.shapes.buckets",
    "BucketResult": "recipecache.shapes.buckets",
    "BucketPadCollate": "recipecache.shapes.padding",
    "BucketBatchSampler": "recipecache.shapes.padding",
    "detect_recompilation": "recipecache.shapes.recompile",
    "RecompilationDetector": "recipecache.shapes.recompile",
}

__all__ = [
    "BackendError",
    "ConfigError",
    "Flight",
    "Reason",
    "RecipeCacheError",
    "Role",
    "Store",
    "VerificationError",
    "__version__",
    "make_key",
    "open_store",
    *_LAZY,
]


__getattr__ = lazy_getattr(__name__, _LAZY, globals())
