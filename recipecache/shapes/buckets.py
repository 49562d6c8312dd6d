"""Bucket boundaries for variable-length inputs, and how much padding they cost.

Every distinct input length is a distinct shape, and every distinct shape is a compile.
Padding each batch up to one of ``k`` bucket boundaries caps the number of shapes at ``k``;
the price is the padded elements the model computes on for nothing. This module picks the
boundaries:

* :func:`percentile_buckets` - boundaries at evenly spaced percentiles (the recipe of
  fairseq's wav2vec2 ``num_batch_buckets``): cheap, and good when lengths are spread evenly.
* :func:`optimal_buckets` - the boundaries that minimise the padded total exactly, by dynamic
  programming over the distinct lengths. The cost of a bucket ``(t, i]`` is
  ``v[i] * (C[i] - C[t])`` (its max length times its item count), which is Monge, so the
  best split point of each layer is monotone in ``i`` and a divide-and-conquer row-minima
  search finds all of them in ``O(D log D)`` per bucket, vectorised with numpy. Inputs with
  more than ``max_distinct`` distinct values (float durations, huge vocabularies of lengths)
  are first grouped into geometric bins, as the Gaudi bucketing guide suggests; the result
  then says it is not exact and bounds how far from optimal it can be.

Results of :func:`optimal_buckets` can be cached in the recipecache store keyed by a hash of
the length multiset, so a rerun or another rank reads them instead of recomputing; they are
serialised with msgpack, never pickle.

Pure numpy: nothing here imports torch.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Protocol

import msgpack
import numpy as np

from ..buffers import Buffer
from ..errors import ConfigError

log = logging.getLogger(__name__)

#: Above this many distinct lengths :func:`optimal_buckets` bins them first (see module doc).
#: 4096 covers token lengths up to 4096 exactly and keeps k = 64 (both bounds of a binned
#: solve included) under a second on one core.
DEFAULT_MAX_DISTINCT = 4096

#: Version of the cached msgpack layout; part of the store key so a layout change never
#: reads an old value.
_CACHE_VERSION = 1

Number = int | float


class BytesStore(Protocol):
    """What :func:`optimal_buckets` needs of a store (``recipecache.open_store()`` fits)."""

    def get(self, key: str) -> Buffer | None: ...

    def put(self, key: str, data: bytes) -> None: ...


@dataclass(frozen=True)
class BucketResult:
    """Bucket boundaries with the padding they cost.

    ``exact`` is False when the lengths were binned before solving; ``bound_gap`` is then an
    upper bound on ``padding_waste`` minus the optimal waste (0.0 when exact), so a caller can
    decide whether the approximation is good enough.
    """

    boundaries: tuple[Number, ...]
    padding_waste: float
    exact: bool
    bound_gap: float

    def to_dict(self) -> dict[str, object]:
        return {**asdict(self), "boundaries": list(self.boundaries)}


BucketsLike = Sequence[Number] | np.ndarray | BucketResult


def as_lengths(lengths: Sequence[Number] | np.ndarray) -> np.ndarray:
    """Validate lengths once for every function here: a non-empty 1-D array of finite values >= 0.

    Integer input stays int64 (boundaries come back as ints); anything else becomes float64.
    """
    arr = np.asarray(lengths)
    if arr.ndim != 1 or arr.size == 0:
        raise ConfigError(f"lengths must be a non-empty 1-D sequence of numbers, got shape {arr.shape}")
    if arr.dtype.kind in "iu":
        arr = arr.astype(np.int64, copy=False)
    elif arr.dtype.kind == "f":
        arr = arr.astype(np.float64, copy=False)
        if not np.all(np.isfinite(arr)):
            raise ConfigError("lengths must be finite numbers")
    else:
        raise ConfigError(f"lengths must be numbers, got dtype {arr.dtype}")
    if arr.min() < 0:
        raise ConfigError(f"lengths must be >= 0, got {arr.min()}")
    return arr


def _check_k(k: int) -> None:
    if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k < 1:
        raise ConfigError(f"k (the number of buckets) must be an integer >= 1, got {k!r}")


def as_boundaries(buckets: BucketsLike) -> np.ndarray:
    values = buckets.boundaries if isinstance(buckets, BucketResult) else buckets
    arr = np.asarray(values, dtype=np.float64)
    if arr.ndim != 1 or arr.size == 0:
        raise ConfigError("buckets must be a non-empty 1-D sequence of boundaries")
    if np.any(np.diff(arr) <= 0):
        raise ConfigError("bucket boundaries must be strictly increasing")
    return arr


def _python_numbers(values: np.ndarray) -> tuple[Number, ...]:
    return tuple(values.tolist())


def assign_buckets(lengths: Sequence[Number] | np.ndarray, buckets: BucketsLike) -> np.ndarray:
    """The boundary each length is padded to: the smallest boundary >= the length.

    A length above the largest boundary cannot be padded to any bucket, so it is an error
    rather than a silent truncation.
    """
    arr = as_lengths(lengths)
    bounds = as_boundaries(buckets)
    index = np.searchsorted(bounds, arr, side="left")
    if index.max() >= bounds.size:
        raise ConfigError(f"length {arr.max()} exceeds the largest bucket boundary {bounds[-1]:g}")
    return bounds[index]


def padding_waste(lengths: Sequence[Number] | np.ndarray, buckets: BucketsLike) -> float:
    """Fraction of all computed elements that are padding when each length is padded to its bucket."""
    padded = assign_buckets(lengths, buckets)
    total = float(padded.sum())
    return 0.0 if total == 0.0 else (total - float(np.asarray(lengths, dtype=np.float64).sum())) / total


def percentile_buckets(lengths: Sequence[Number] | np.ndarray, k: int) -> list[Number]:
    """Boundaries at the 100/k, 200/k, ... 100th percentiles (lower interpolation).

    Lower interpolation makes every boundary a length that occurs, and the last one the
    maximum, so every item fits. Repeated percentiles collapse, so fewer than ``k``
    boundaries come back when the lengths take fewer values.
    """
    arr = as_lengths(lengths)
    _check_k(k)
    bounds = np.unique(np.percentile(arr, np.linspace(0.0, 100.0, int(k) + 1)[1:], method="lower"))
    return list(_python_numbers(bounds.astype(arr.dtype)))


def _row_argmins(intercepts: np.ndarray, slopes: np.ndarray, xs: np.ndarray) -> np.ndarray:
    """For each query ``x`` in ``xs`` (non-decreasing), the smallest ``t`` minimising
    ``intercepts[t] - x * slopes[t]``, with ``slopes`` strictly increasing.

    With increasing slopes the (smallest) minimiser moves right as ``x`` grows, so the
    classic divide and conquer applies: solve the middle query, then the left half only looks
    left of its answer and the right half only right of it. All queries of one recursion level
    are solved together in a few flat numpy operations: O(log D) numpy calls per layer instead
    of O(D) Python steps, O(D log D) work in all.
    """
    n_queries = xs.size
    result = np.empty(n_queries, dtype=np.int64)
    q_lo = np.array([0])
    q_hi = np.array([n_queries - 1])
    t_lo = np.array([0])
    t_hi = np.array([intercepts.size - 1])
    while q_lo.size:
        mid = (q_lo + q_hi) // 2
        widths = t_hi - t_lo + 1
        ends = np.cumsum(widths)
        starts = ends - widths
        flat = np.arange(int(ends[-1]))
        t = flat - np.repeat(starts - t_lo, widths)
        values = intercepts[t] - np.repeat(xs[mid], widths) * slopes[t]
        minima = np.minimum.reduceat(values, starts)
        first = np.minimum.reduceat(np.where(values == np.repeat(minima, widths), flat, flat.size), starts)
        best = t[first]
        result[mid] = best
        left = q_lo < mid
        right = mid < q_hi
        q_lo, q_hi = (
            np.concatenate((q_lo[left], mid[right] + 1)),
            np.concatenate((mid[left] - 1, q_hi[right])),
        )
        t_lo, t_hi = np.concatenate((t_lo[left], best[right])), np.concatenate((best[left], t_hi[right]))
    return result


def _min_padded_total(values: np.ndarray, counts: np.ndarray, k: int) -> tuple[float, np.ndarray]:
    """Minimum of sum(bucket max * bucket size) over partitions of the sorted distinct
    ``values`` (with multiplicities ``counts``) into at most ``k`` contiguous buckets.

    Returns the minimum and the indices of the values that are bucket maxima. ``dp[i]`` is
    the best total for the first ``i`` values; a layer adds one bucket:
    ``dp'[i] = v[i-1] * C[i] + min_t (dp[t] - v[i-1] * C[t])``. Taking the min over *all*
    ``t`` (not only ``t <= i``) is safe: any ``t > i`` is strictly worse than ``t = i``,
    and it turns each layer into one row-minima problem.
    """
    d = values.size
    if k >= d:
        return float(values @ counts), np.arange(d)
    cum = np.zeros(d + 1)
    np.cumsum(counts, out=cum[1:])
    if k == 1:
        return float(values[-1] * cum[-1]), np.array([d - 1])
    dp = np.concatenate(([0.0], values * cum[1:]))
    choices: list[np.ndarray] = []
    for _ in range(k - 2):
        best = _row_argmins(dp, cum, values)
        choices.append(best)
        dp = np.concatenate(([0.0], values * cum[1:] + dp[best] - values * cum[best]))
    last = int(np.argmin(dp - values[-1] * cum))
    total = float(values[-1] * cum[-1] + dp[last] - values[-1] * cum[last])

    tops = [d - 1]
    i = last
    for best in reversed(choices):
        if i == 0:
            break
        t = int(best[i - 1])
        if t < i:
            tops.append(i - 1)
        i = t
    if i > 0:
        tops.append(i - 1)
    return total, np.array(sorted(set(tops)))


def _bin_geometric(values: np.ndarray, counts: np.ndarray, bins: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Group sorted distinct values into at most ``bins`` bins of equal width in
    ``log(v - v_min + span / bins)``: (lowest, highest, count) per non-empty bin.

    The optimality gap comes from how far a bucket-top bin's highest value is above its
    lowest, relative to the lengths around it; geometric bins keep that ratio the same
    everywhere, so a long tail does not blow the gap up the way equal-width bins do (4x to
    40x tighter on log-normal lengths). The offset keeps zero lengths finite.
    """
    offset = (values[-1] - values[0]) / bins
    logs = np.log(values - values[0] + offset)
    index = np.minimum(((logs - logs[0]) * (bins / (logs[-1] - logs[0]))).astype(np.int64), bins - 1)
    starts = np.flatnonzero(np.concatenate(([True], index[1:] != index[:-1])))
    ends = np.concatenate((starts[1:], [values.size])) - 1
    return values[starts], values[ends], np.add.reduceat(counts, starts)


def _waste(padded_total: float, length_total: float) -> float:
    return 0.0 if padded_total == 0.0 else (padded_total - length_total) / padded_total


def length_multiset_key(lengths: np.ndarray, k: int, max_distinct: int) -> str:
    """Store key of an :func:`optimal_buckets` result: the same multiset of lengths (in any
    order, on any rank) and the same parameters give the same key."""
    values, counts = np.unique(lengths, return_counts=True)
    digest = hashlib.sha256()
    digest.update(values.dtype.str.encode())
    digest.update(values.tobytes())
    digest.update(counts.astype(np.int64).tobytes())
    return f"shapes/buckets/v{_CACHE_VERSION}/optimal/k={k}/max_distinct={max_distinct}/{digest.hexdigest()}"


def _load(store: BytesStore, key: str) -> BucketResult | None:
    data = store.get(key)
    if data is None:
        return None
    try:
        fields = msgpack.unpackb(data, raw=False)
        return BucketResult(
            boundaries=tuple(fields["boundaries"]),
            padding_waste=float(fields["padding_waste"]),
            exact=bool(fields["exact"]),
            bound_gap=float(fields["bound_gap"]),
        )
    except (ValueError, TypeError, KeyError, msgpack.UnpackException) as exc:
        log.warning("ignoring unreadable cached buckets under %s: %r", key, exc)
        return None


def optimal_buckets(
    lengths: Sequence[Number] | np.ndarray,
    k: int,
    *,
    max_distinct: int = DEFAULT_MAX_DISTINCT,
    store: BytesStore | None = None,
) -> BucketResult:
    """At most ``k`` boundaries that minimise the total padded size of ``lengths``.

    Each bucket's boundary is its longest member, so every boundary is a length that occurs
    (when exact). With more than ``max_distinct`` distinct lengths the lengths are binned
    first and the result reports ``exact=False`` with a ``bound_gap``. With ``store`` the
    result is read from / written to the recipecache store, so only the first rank computes.
    """
    arr = as_lengths(lengths)
    _check_k(k)
    if max_distinct < 2:
        raise ConfigError(f"max_distinct must be >= 2, got {max_distinct}")
    key = length_multiset_key(arr, int(k), max_distinct) if store is not None else ""
    if store is not None:
        cached = _load(store, key)
        if cached is not None:
            return cached

    values, counts = np.unique(arr, return_counts=True)
    length_total = float(arr.sum(dtype=np.float64))
    as_float = values.astype(np.float64)
    if values.size <= max_distinct:
        total, tops = _min_padded_total(as_float, counts, int(k))
        result = BucketResult(_python_numbers(values[tops]), _waste(total, length_total), True, 0.0)
    else:
        lows, highs, bin_counts = _bin_geometric(as_float, counts, max_distinct)
        upper, tops = _min_padded_total(highs, bin_counts, int(k))
        lower, _ = _min_padded_total(lows, bin_counts, int(k))
        waste = _waste(upper, length_total)
        boundaries = highs[tops].astype(arr.dtype)
        result = BucketResult(_python_numbers(boundaries), waste, False, max(0.0, waste - _waste(lower, length_total)))
        log.info(
            "optimal_buckets: %d distinct lengths binned into %d bins; waste %.4f is within %.4f of optimal",
            values.size,
            lows.size,
            result.padding_waste,
            result.bound_gap,
        )

    if store is not None:
        store.put(key, msgpack.packb(result.to_dict(), use_bin_type=True))
    return result
