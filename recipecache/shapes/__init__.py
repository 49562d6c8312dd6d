"""The dynamic-shape toolkit: fewer distinct shapes means fewer compiles to cache.

* :func:`data_dynamicity` - the shape histogram of a data loader and which dimensions vary;
* :func:`percentile_buckets`, :func:`optimal_buckets`, :func:`padding_waste` - bucket
  boundaries for variable lengths and what they cost in padding;
* :class:`BucketPadCollate`, :class:`BucketBatchSampler` - pad batches to those boundaries,
  with a constant token budget per batch;
* :func:`detect_recompilation` - which submodule makes torch.compile recompile, and why.

The first two groups need only numpy; the names that need torch load on first use, so
``import recipecache.shapes`` stays cheap.
"""

from __future__ import annotations

from .._lazy import lazy_getattr
from .buckets import (
    BucketResult,
    assign_buckets,
    optimal_buckets,
    padding_waste,
    percentile_buckets,
)
from .dynamicity import DimVariation, DynamicityReport, batch_signature, data_dynamicity

_LAZY = {
    "BucketPadCollate": "recipecache.shapes.padding",
    "BucketBatchSampler": "recipecache.shapes.padding",
    "detect_recompilation": "recipecache.shapes.recompile",
    "RecompilationDetector": "recipecache.shapes.recompile",
}

__all__ = [
    "BucketResult",
    "DimVariation",
    "DynamicityReport",
    "assign_buckets",
    "batch_signature",
    "data_dynamicity",
    "optimal_buckets",
    "padding_waste",
    "percentile_buckets",
    *_LAZY,
]


__getattr__ = lazy_getattr(__name__, _LAZY, globals())
