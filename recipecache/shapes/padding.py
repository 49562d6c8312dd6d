"""Padding to bucket boundaries at collate time, and batches of a constant token budget.

Bucket boundaries (from :mod:`recipecache.shapes.buckets`) only help if every batch is padded
to one of them: :class:`BucketPadCollate` pads each batch to the smallest boundary that
holds its longest item, for several named inputs at once, each with its own pad value. The
number of distinct sequence lengths the model ever sees is then the number of buckets.

A fixed batch size wastes memory on short buckets or overflows it on long ones;
:class:`BucketBatchSampler` groups items by bucket and sizes each batch at about
``max_tokens / bucket_length`` items, so every batch costs about the same. Both plug into
``torch.utils.data.DataLoader`` (``collate_fn=``, ``batch_sampler=``).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import torch
from torch.utils.data import Sampler, default_collate

from ..errors import ConfigError
from .buckets import BucketsLike, Number, as_boundaries, as_lengths, assign_buckets

log = logging.getLogger(__name__)


class BucketPadCollate:
    """``collate_fn`` padding the inputs named in ``pad_values`` to a bucket boundary.

    Each item is a mapping; the named inputs are sequences (lists or tensors, padded along
    their first dimension), e.g. ``{"input_ids": 0, "attention_mask": 0, "token_type_ids": 0,
    "labels": -100}``. Other keys are collated with torch's ``default_collate``. An item
    longer than the largest boundary is an error: truncating silently would change the data.
    """

    def __init__(self, buckets: BucketsLike, pad_values: Mapping[str, Number]) -> None:
        if not pad_values:
            raise ConfigError("pad_values must name at least one input to pad")
        self.boundaries = as_boundaries(buckets)
        self.pad_values = dict(pad_values)

    def __call__(self, items: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
        if not items:
            raise ConfigError("cannot collate an empty batch")
        sequences = {name: [torch.as_tensor(item[name]) for item in items] for name in self.pad_values}
        longest = max(t.shape[0] for column in sequences.values() for t in column)
        target = int(assign_buckets([longest], self.boundaries)[0])
        batch: dict[str, Any] = {}
        for name, column in sequences.items():
            padded = torch.full(
                (len(column), target, *column[0].shape[1:]), self.pad_values[name], dtype=column[0].dtype
            )
            for row, tensor in enumerate(column):
                padded[row, : tensor.shape[0]] = tensor
            batch[name] = padded
        for name in items[0]:
            if name not in self.pad_values:
                batch[name] = default_collate([item[name] for item in items])
        return batch


class BucketBatchSampler(Sampler[list[int]]):
    """Batches of indices from one bucket each, about ``max_tokens / bucket_length`` items long.

    ``lengths[i]`` is the length of dataset item ``i``. Batches are reshuffled per epoch from
    ``seed`` (call :meth:`set_epoch`, as with ``DistributedSampler``) and dealt round-robin to
    ``num_replicas`` ranks; every rank gets the same number of batches (the list is padded by
    repeating its first batches, or truncated with ``drop_last``), so no rank waits on a
    collective that the others never reach.
    """

    def __init__(
        self,
        lengths: Sequence[Number] | np.ndarray,
        buckets: BucketsLike,
        max_tokens: int,
        *,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
        num_replicas: int = 1,
        rank: int = 0,
    ) -> None:
        if max_tokens < 1:
            raise ConfigError(f"max_tokens must be >= 1, got {max_tokens}")
        if not 0 <= rank < num_replicas:
            raise ConfigError(f"rank must be in [0, num_replicas), got rank={rank} num_replicas={num_replicas}")
        self.item_buckets = assign_buckets(as_lengths(lengths), buckets)
        self.max_tokens = max_tokens
        self.shuffle = shuffle
        self.seed = seed
        self.drop_last = drop_last
        self.num_replicas = num_replicas
        self.rank = rank
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def batch_size_for(self, boundary: float) -> int:
        return max(1, int(self.max_tokens // max(boundary, 1)))

    def _all_batches(self) -> list[list[int]]:
        rng = np.random.default_rng([self.seed, self.epoch])
        batches: list[list[int]] = []
        for boundary in np.unique(self.item_buckets):
            members = np.flatnonzero(self.item_buckets == boundary)
            if self.shuffle:
                members = rng.permutation(members)
            size = self.batch_size_for(boundary)
            full = len(members) - len(members) % size if self.drop_last else len(members)
            batches.extend(members[start : start + size].tolist() for start in range(0, full, size))
        if self.shuffle:
            batches = [batches[i] for i in rng.permutation(len(batches))]
        return batches

    def _per_replica(self, total: int) -> int:
        return total // self.num_replicas if self.drop_last else -(-total // self.num_replicas)

    def __iter__(self) -> Iterator[list[int]]:
        batches = self._all_batches()
        wanted = self._per_replica(len(batches)) * self.num_replicas
        batches += [batches[i % len(batches)] for i in range(wanted - len(batches))]
        yield from batches[self.rank : wanted : self.num_replicas]

    def __len__(self) -> int:
        total = 0
        for boundary, count in zip(*np.unique(self.item_buckets, return_counts=True), strict=True):
            size = self.batch_size_for(boundary)
            total += count // size if self.drop_last else -(-count // size)
        return self._per_replica(total)
