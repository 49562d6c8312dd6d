"""recipecache: a shared, signed, single-flight compile-artifact cache for distributed PyTorch.

``import recipecache`` does not import torch; names that need it load on first use.
"""

from __future__ import annotations

import importlib
import logging
from typing import Any

__version__ = "0.1.0"

from .errors import BackendError, ConfigError, RecipeCacheError, VerificationError  # noqa: E402
from .keys import make_key  # noqa: E402
from .store import Flight, Store, open_store  # noqa: E402

logging.getLogger(__name__).addHandler(logging.NullHandler())

#: public name -> module that defines it, imported on first access (these import torch or numpy)
_LAZY = {
    "enable": "recipecache.torch_integration",
    "disable": "recipecache.torch_integration",
}

__all__ = [
    "BackendError", "ConfigError", "Flight", "RecipeCacheError", "Store", "VerificationError",
    "make_key", "open_store", *_LAZY,
]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'recipecache' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
