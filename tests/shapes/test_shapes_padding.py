"""BucketPadCollate and BucketBatchSampler, alone and inside a DataLoader."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader

from recipecache.errors import ConfigError
from recipecache.shapes import BucketBatchSampler, BucketPadCollate, optimal_buckets

PAD = {"input_ids": 0, "attention_mask": 0, "token_type_ids": 1, "labels": -100}


def item(n: int, index: int = 0) -> dict[str, object]:
    return {
        "input_ids": list(range(1, n + 1)),
        "attention_mask": torch.ones(n, dtype=torch.long),
        "token_type_ids": torch.zeros(n, dtype=torch.long),
        "labels": torch.full((n,), 7),
        "index": index,
    }


def test_collate_pads_every_named_input_to_the_smallest_fitting_bucket() -> None:
    batch = BucketPadCollate([4, 8, 16], PAD)([item(3, 0), item(6, 1)])
    assert batch["input_ids"].tolist() == [[1, 2, 3, 0, 0, 0, 0, 0], [1, 2, 3, 4, 5, 6, 0, 0]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1, 0, 0, 0, 0, 0], [1] * 6 + [0, 0]]
    assert batch["token_type_ids"].tolist() == [[0, 0, 0, 1, 1, 1, 1, 1], [0] * 6 + [1, 1]]
    assert batch["labels"][0].tolist() == [7, 7, 7] + [-100] * 5
    assert batch["index"].tolist() == [0, 1]  # not named: default_collate
    assert BucketPadCollate([4, 8, 16], PAD)([item(4)])["input_ids"].shape == (1, 4)


def test_collate_refuses_items_longer_than_the_largest_bucket() -> None:
    with pytest.raises(ConfigError, match="exceeds the largest bucket boundary 8"):
        BucketPadCollate([4, 8], PAD)([item(9)])
    with pytest.raises(ConfigError):
        BucketPadCollate([4, 8], {})


def test_sampler_batches_one_bucket_each_within_the_token_budget() -> None:
    lengths = [3, 5, 9, 2, 16, 15, 4, 8, 8, 1, 12, 7] * 5
    sampler = BucketBatchSampler(lengths, [4, 8, 16], max_tokens=32, seed=3)
    batches = list(sampler)
    assert len(batches) == len(sampler)
    assert sorted(i for batch in batches for i in batch) == list(range(len(lengths)))
    for batch in batches:
        bucket = {4 if lengths[i] <= 4 else 8 if lengths[i] <= 8 else 16 for i in batch}
        assert len(bucket) == 1
        assert len(batch) * bucket.pop() <= 32
    assert max(len(b) for b in batches) == 8  # 32 tokens / bucket 4


def test_sampler_is_deterministic_per_seed_and_epoch() -> None:
    lengths = list(range(1, 65))
    first = list(BucketBatchSampler(lengths, [16, 32, 64], 64, seed=1))
    assert first == list(BucketBatchSampler(lengths, [16, 32, 64], 64, seed=1))
    other_epoch = BucketBatchSampler(lengths, [16, 32, 64], 64, seed=1)
    other_epoch.set_epoch(1)
    assert list(other_epoch) != first
    in_order = list(BucketBatchSampler(lengths, [16, 32, 64], 64, shuffle=False))
    assert in_order[0] == [0, 1, 2, 3] and in_order[-1] == [63]  # 64 tokens: 4 of bucket 16, 1 of bucket 64


@pytest.mark.parametrize("drop_last", [False, True])
def test_sampler_gives_every_replica_the_same_number_of_batches(drop_last: bool) -> None:
    lengths = [5] * 9 + [20] * 3  # batches: 3 of the 5-bucket (4, 4, 1 items), 3 of the 20-bucket
    shards = [
        list(BucketBatchSampler(lengths, [5, 20], 20, drop_last=drop_last, num_replicas=4, rank=rank))
        for rank in range(4)
    ]
    per_rank = {len(shard) for shard in shards}
    assert per_rank == {1 if drop_last else 2}
    assert (
        len(BucketBatchSampler(lengths, [5, 20], 20, drop_last=drop_last, num_replicas=4, rank=0))
        == per_rank.pop()
    )
    seen = {i for shard in shards for batch in shard for i in batch}
    if not drop_last:
        assert seen == set(range(12))
    else:
        assert all(len(batch) == (4 if lengths[batch[0]] == 5 else 1) for shard in shards for batch in shard)


def test_dataloader_yields_only_bucket_shapes() -> None:
    lengths = [(i * 7) % 30 + 1 for i in range(90)]
    boundaries = optimal_buckets(lengths, 3).boundaries
    dataset = [item(n, i) for i, n in enumerate(lengths)]
    loader = DataLoader(
        dataset,
        batch_sampler=BucketBatchSampler(lengths, boundaries, 64),
        collate_fn=BucketPadCollate(boundaries, PAD),
    )
    widths = set()
    items = 0
    for batch in loader:
        widths.add(batch["input_ids"].shape[1])
        assert batch["input_ids"].numel() <= 64
        items += batch["index"].numel()
    assert widths <= set(boundaries) and len(widths) == len(boundaries)
    assert items == len(lengths)


def test_sampler_rejects_bad_arguments() -> None:
    with pytest.raises(ConfigError):
        BucketBatchSampler([1, 2], [2], max_tokens=0)
    with pytest.raises(ConfigError):
        BucketBatchSampler([1, 2], [2], max_tokens=4, num_replicas=2, rank=2)
    with pytest.raises(ConfigError):
        BucketBatchSampler([1, 3], [2], max_tokens=4)
