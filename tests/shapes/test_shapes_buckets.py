"""Bucket boundaries: exactness of optimal_buckets, the binned approximation, caching in a store."""

from __future__ import annotations

import itertools
import logging
from pathlib import Path

import msgpack
import numpy as np
import pytest

from recipecache.errors import ConfigError
from recipecache.shapes import buckets as buckets_module
from recipecache.shapes.buckets import (
    BucketResult,
    assign_buckets,
    length_multiset_key,
    optimal_buckets,
    padding_waste,
    percentile_buckets,
)


def brute_force_waste(lengths: list[float], k: int) -> float:
    """Smallest waste over every choice of at most k boundaries among the distinct lengths."""
    values = sorted(set(lengths))
    best = 1.0
    for extra in range(min(k, len(values))):
        for chosen in itertools.combinations(values[:-1], extra):
            best = min(best, padding_waste(lengths, [*chosen, values[-1]]))
    return best


def quadratic_dp_total(lengths: np.ndarray, k: int) -> float:
    """Textbook O(k * D^2) DP of the minimum padded total, as an independent reference."""
    values, counts = np.unique(lengths, return_counts=True)
    values = values.astype(float)
    cum = np.concatenate(([0.0], np.cumsum(counts)))
    d = values.size
    dp = np.full(d + 1, np.inf)
    dp[0] = 0.0
    for _ in range(k):
        new = dp.copy()
        for i in range(1, d + 1):
            new[i] = min(new[i], np.min(dp[:i] + values[i - 1] * (cum[i] - cum[:i])))
        dp = new
    return float(dp[d])


class FakeStore:
    """The get/put surface of recipecache.open_store(), in memory, counting calls."""

    def __init__(self) -> None:
        self.data: dict[str, bytes] = {}
        self.gets = 0
        self.puts = 0

    def get(self, key: str) -> bytes | None:
        self.gets += 1
        return self.data.get(key)

    def put(self, key: str, data: bytes) -> None:
        self.puts += 1
        self.data[key] = data


def test_optimal_matches_brute_force_on_small_inputs() -> None:
    rng = np.random.default_rng(0)
    for _ in range(150):
        lengths = rng.integers(0, 16, size=int(rng.integers(1, 16))).tolist()
        k = int(rng.integers(1, 6))
        result = optimal_buckets(lengths, k)
        assert result.padding_waste == pytest.approx(brute_force_waste(lengths, k), abs=1e-12), (lengths, k)
        assert result.exact and result.bound_gap == 0.0
        assert len(result.boundaries) <= k
        assert result.boundaries[-1] == max(lengths)
        assert set(result.boundaries) <= set(lengths)
        assert padding_waste(lengths, result) == pytest.approx(result.padding_waste, abs=1e-12)


def test_optimal_matches_quadratic_dp_at_scale() -> None:
    rng = np.random.default_rng(1)
    lengths = np.round(rng.lognormal(4.0, 0.7, size=20_000)).astype(np.int64)
    lengths = lengths[lengths <= 300]
    for k in (1, 2, 7, 16):
        result = optimal_buckets(lengths, k)
        total = float(np.sum(assign_buckets(lengths, result)))
        assert total == quadratic_dp_total(lengths, k)


def test_optimal_is_never_worse_than_percentile() -> None:
    rng = np.random.default_rng(2)
    lengths = np.round(rng.lognormal(3.5, 0.9, size=5000)).astype(np.int64)
    for k in (2, 4, 8, 16):
        assert optimal_buckets(lengths, k).padding_waste <= padding_waste(
            lengths, percentile_buckets(lengths, k)
        )


def test_optimal_with_fewer_distinct_lengths_than_buckets_pads_nothing() -> None:
    result = optimal_buckets([5, 3, 5, 9, 3], 8)
    assert result.boundaries == (3, 5, 9)
    assert result.padding_waste == 0.0


def test_float_lengths_give_float_boundaries() -> None:
    lengths = [0.5, 1.25, 1.5, 3.0, 3.0]
    result = optimal_buckets(lengths, 2)
    assert all(isinstance(b, float) for b in result.boundaries)
    assert result.padding_waste == pytest.approx(brute_force_waste(lengths, 2))


def test_binned_result_is_within_its_reported_gap() -> None:
    rng = np.random.default_rng(3)
    lengths = rng.lognormal(2.0, 1.0, size=3000)
    exact = optimal_buckets(lengths, 6, max_distinct=10_000)
    binned = optimal_buckets(lengths, 6, max_distinct=64)
    assert exact.exact and not binned.exact
    assert binned.bound_gap > 0.0
    assert exact.padding_waste <= binned.padding_waste + 1e-12
    assert binned.padding_waste - binned.bound_gap <= exact.padding_waste + 1e-12
    assert padding_waste(lengths, binned) == pytest.approx(binned.padding_waste)


def test_percentile_buckets_follow_the_percentiles() -> None:
    assert percentile_buckets(list(range(1, 101)), 4) == [25, 50, 75, 100]
    assert percentile_buckets([7, 7, 7, 7, 9], 4) == [7, 9]
    assert percentile_buckets([4, 1, 3], 1) == [4]


def test_padding_waste_and_assignment() -> None:
    lengths = [1, 2, 3, 10]
    assert assign_buckets(lengths, [3, 10]).tolist() == [3, 3, 3, 10]
    assert padding_waste(lengths, [3, 10]) == pytest.approx(3 / 19)
    assert padding_waste([0, 0], [0]) == 0.0


@pytest.mark.parametrize(
    "call",
    [
        lambda: optimal_buckets([], 2),
        lambda: optimal_buckets([[1, 2], [3, 4]], 2),
        lambda: optimal_buckets([1, -2], 2),
        lambda: optimal_buckets([1.0, float("nan")], 2),
        lambda: optimal_buckets(["a", "b"], 2),
        lambda: optimal_buckets([1, 2], 0),
        lambda: optimal_buckets([1, 2], True),
        lambda: optimal_buckets([1, 2], 2, max_distinct=1),
        lambda: percentile_buckets([1, 2], 0),
        lambda: padding_waste([1, 11], [5, 10]),
        lambda: padding_waste([1, 2], [5, 5]),
        lambda: padding_waste([1, 2], []),
    ],
)
def test_bad_input_is_a_config_error(call) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ConfigError):
        call()


def test_results_are_cached_by_length_multiset(monkeypatch: pytest.MonkeyPatch) -> None:
    store = FakeStore()
    lengths = [3, 9, 4, 4, 12, 30, 9, 7]
    first = optimal_buckets(lengths, 3, store=store)
    assert store.puts == 1
    ((key, blob),) = store.data.items()
    assert msgpack.unpackb(blob)["boundaries"] == list(first.boundaries)

    def no_solving(*args: object) -> None:
        raise AssertionError("a cached result must not be recomputed")

    monkeypatch.setattr(buckets_module, "_min_padded_total", no_solving)
    again = optimal_buckets(list(reversed(lengths)), 3, store=store)  # same multiset, other order
    assert again == first
    assert store.puts == 1
    assert key != length_multiset_key(np.asarray(lengths), 4, buckets_module.DEFAULT_MAX_DISTINCT)
    assert key != length_multiset_key(np.asarray([*lengths, 3]), 3, buckets_module.DEFAULT_MAX_DISTINCT)


def test_unreadable_cached_value_is_recomputed_and_replaced(caplog: pytest.LogCaptureFixture) -> None:
    store = FakeStore()
    lengths = [1, 5, 5, 8]
    key = length_multiset_key(np.asarray(lengths), 2, buckets_module.DEFAULT_MAX_DISTINCT)
    store.data[key] = b"\xc1 not msgpack"
    with caplog.at_level(logging.WARNING, logger="recipecache.shapes.buckets"):
        result = optimal_buckets(lengths, 2, store=store)
    assert result == BucketResult((5, 8), 4 / 23, True, 0.0)
    assert "unreadable cached buckets" in caplog.text
    assert msgpack.unpackb(store.data[key])["boundaries"] == [5, 8]


def test_another_rank_reuses_buckets_through_a_real_store(tmp_path: Path) -> None:
    import recipecache

    lengths = np.random.default_rng(3).lognormal(4, 0.6, 5000).astype(int).tolist()
    rank0 = recipecache.open_store(f"file://{tmp_path / 'c'}", namespace="buckets")
    rank1 = recipecache.open_store(f"file://{tmp_path / 'c'}", namespace="buckets")
    first = optimal_buckets(lengths, 8, store=rank0)
    assert rank0.stats()["puts"] == 1
    assert optimal_buckets(lengths, 8, store=rank1) == first
    assert (rank1.stats()["hits"], rank1.stats()["puts"]) == (1, 0)
