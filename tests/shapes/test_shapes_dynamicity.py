"""data_dynamicity: shape histograms of loaders, named inputs, varying dimensions, verdicts."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from recipecache.errors import ConfigError
from recipecache.shapes import data_dynamicity
from recipecache.shapes.dynamicity import LITTLE_MAX_SHAPES, ROOT_PATH, SOME_MAX_SHAPES


def pad_to_longest(items: list[dict[str, torch.Tensor]]) -> dict[str, object]:
    """A typical NLP collate: pad to the longest item, so every batch length is a new shape."""
    longest = max(len(item["input_ids"]) for item in items)
    ids = torch.zeros(len(items), longest, dtype=torch.long)
    mask = torch.zeros(len(items), longest, dtype=torch.long)
    for row, item in enumerate(items):
        ids[row, : len(item["input_ids"])] = item["input_ids"]
        mask[row, : len(item["input_ids"])] = 1
    return {
        "input_ids": ids,
        "attention_mask": mask,
        "labels": torch.tensor([i["label"] for i in items]),
        "source": "train",
    }


def test_dataloader_of_dict_batches() -> None:
    lengths = [8] * 12 + [16] * 4 + [8] * 4 + [32] * 2  # batches of 4: 3x8, 16, 8, then a ragged 32
    dataset = [{"input_ids": torch.arange(n), "label": i % 2} for i, n in enumerate(lengths)]
    report = data_dynamicity(DataLoader(dataset, batch_size=4, collate_fn=pad_to_longest))

    assert report.batches == 6
    assert report.unique_shapes == 3
    assert report.verdict == "little"
    counts = [count for _, count in report.signatures]
    assert counts == [4, 1, 1]  # most common first, then in order of appearance
    top, _ = report.signatures[0]
    assert top == (
        ("input_ids", (4, 8), "int64"),
        ("attention_mask", (4, 8), "int64"),
        ("labels", (4,), "int64"),
    )

    varying = {(v.path, v.dim): v for v in report.varying}
    assert set(varying) == {
        ("input_ids", 0),
        ("input_ids", 1),
        ("attention_mask", 0),
        ("attention_mask", 1),
        ("labels", 0),
    }
    seq = varying[("input_ids", 1)]
    assert (seq.role, seq.sizes, seq.min, seq.max) == ("sequence", {8: 4, 16: 1, 32: 1}, 8, 32)
    assert "maybe_mark_dynamic(input_ids, 1)" in seq.suggestion
    assert varying[("labels", 0)].role == "batch"
    assert "drop_last=True" in varying[("labels", 0)].suggestion

    text = str(report)
    assert "6 batches, 3 unique shapes: little dynamicity" in text
    assert "input_ids=[4, 8] int64  attention_mask=[4, 8] int64" in text
    assert "66.7%" in text


def test_nested_paths_numpy_and_a_single_tensor() -> None:
    batches = [({"mask": np.ones((2, 3), dtype=bool)}, np.zeros(2, dtype=np.float32))]
    ((signature, count),) = data_dynamicity(batches).signatures
    assert signature == (("0.mask", (2, 3), "bool"), ("1", (2,), "float32"))
    ((signature, _),) = data_dynamicity([torch.zeros(5, 3, 8, 8)]).signatures
    assert signature == ((ROOT_PATH, (5, 3, 8, 8), "float32"),)


def test_image_dimensions_are_named_and_bucketing_is_suggested() -> None:
    batches = [torch.zeros(2, 3, 32 + 4 * i, 48) for i in range(LITTLE_MAX_SHAPES + 1)]
    report = data_dynamicity(batches)
    (height,) = report.varying
    assert (height.dim, height.role) == (2, "height")
    assert "bucket '<batch>' dim 2" in height.suggestion
    assert "mark_dynamic(<batch>, 2, min=32, max=64)" in height.suggestion


@pytest.mark.parametrize(
    ("shapes", "verdict"),
    [
        (1, "little"),
        (LITTLE_MAX_SHAPES, "little"),
        (LITTLE_MAX_SHAPES + 1, "some"),
        (SOME_MAX_SHAPES, "some"),
        (SOME_MAX_SHAPES + 1, "a lot"),
    ],
)
def test_verdict_thresholds(shapes: int, verdict: str) -> None:
    assert data_dynamicity([torch.zeros(1, n + 1) for n in range(shapes)]).verdict == verdict


def test_max_batches_and_json() -> None:
    loader = (torch.zeros(2, n) for n in [4, 4, 6, 100])
    report = data_dynamicity(loader, max_batches=3)
    assert report.batches == 3
    data = json.loads(report.to_json())
    assert data["unique_shapes"] == 2
    assert data["verdict"] == "little"
    assert data["signatures"][0] == {
        "count": 2,
        "inputs": [{"path": ROOT_PATH, "shape": [2, 4], "dtype": "float32"}],
    }
    assert data["varying"][0]["sizes"] == {"4": 2, "6": 1}
    assert "... 1 more shapes in 1 batches" in report.format(max_rows=1)


@pytest.mark.parametrize(
    ("batches", "message"),
    [
        (
            [{"x": torch.zeros(1)}, {"x": torch.zeros(1), "meta": {"obj": object()}}],
            "batch 1: unsupported value of type object at 'meta.obj'",
        ),
        ([["a", 1, None]], "batch 0: batch of type list holds no tensors"),
        ([], "no batches"),
    ],
)
def test_bad_batches_name_the_problem(batches: list[object], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        data_dynamicity(batches)


def test_max_batches_must_be_positive() -> None:
    with pytest.raises(ConfigError):
        data_dynamicity([torch.zeros(1)], max_batches=0)
