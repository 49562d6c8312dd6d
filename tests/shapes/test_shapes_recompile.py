"""detect_recompilation on Gaudi's seed example: it must blame the inner module's ``x[x > 0]``,
and go quiet about dynamic ops once that line uses ``torch.where``.

Compiles are the slow part on a 2-core machine, so the model is tiny, the backend is
``eager``, and each variant runs once per module (fixtures) for all its assertions.
"""

from __future__ import annotations

import csv
from pathlib import Path

import pytest
import torch

from recipecache.shapes import detect_recompilation
from recipecache.shapes.recompile import (
    DYNAMIC_CHILD,
    DYNAMIC_OPS,
    FIRST,
    NEW_INPUT_SHAPE,
    ROOT,
    STEPS_CSV,
    SUMMARY_CSV,
    RecompilationDetector,
)

BATCH_SIZES = [20, 20, 30, 30]  # the batch size changes at step 2


class InnerNet(torch.nn.Module):
    def __init__(self, masked: bool) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(1, 8, 3, 3)
        self.masked = masked

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.flatten(self.conv(x), 1)
        if self.masked:
            x = x[x > 0]  # data-dependent output shape
        else:
            x = torch.where(x > 0, x, 0)
        return x.sum()


class OuterNet(torch.nn.Module):
    def __init__(self, masked: bool) -> None:
        super().__init__()
        self.fc1 = torch.nn.ReLU()
        self.inner = InnerNet(masked)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(self.fc1(x))


def run(masked: bool, tmp_path: Path) -> tuple[RecompilationDetector, str]:
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = OuterNet(masked)
    with detect_recompilation(model) as detector:
        for batch_size in BATCH_SIZES:
            detector(torch.rand(batch_size, 1, 48, 48))
        text = detector.analyse_dynamicity(csv_dir=tmp_path)
    assert "forward" not in model.__dict__ and "forward" not in model.inner.__dict__  # restored
    return detector, text


@pytest.fixture(scope="module")
def masked(tmp_path_factory: pytest.TempPathFactory) -> tuple[RecompilationDetector, str, Path]:
    directory = tmp_path_factory.mktemp("masked")
    return (*run(True, directory), directory)


@pytest.fixture(scope="module")
def where(tmp_path_factory: pytest.TempPathFactory) -> tuple[RecompilationDetector, str, Path]:
    directory = tmp_path_factory.mktemp("where")
    return (*run(False, directory), directory)


def comments(detector: RecompilationDetector) -> dict[tuple[int, str], str]:
    return {(row.step, row.module): row.comment for row in detector.rows}


def test_masking_is_blamed_on_the_inner_module(masked: tuple[RecompilationDetector, str, Path]) -> None:
    detector, text, _ = masked
    seen = comments(detector)
    assert {module for step, module in seen if step == 0} == {ROOT, "fc1", "inner", "inner.conv"}
    assert all(comment == FIRST for (step, _), comment in seen.items() if step == 0)
    # Step 1 repeats the input shape; only the masked inner module recompiles.
    assert {k: v for k, v in seen.items() if k[0] == 1} == {
        (1, "inner"): DYNAMIC_OPS,
        (1, ROOT): DYNAMIC_CHILD,
    }
    assert seen[(2, "inner.conv")] == NEW_INPUT_SHAPE
    inner_step1 = next(row for row in detector.rows if (row.step, row.module) == (1, "inner"))
    assert not inner_step1.new_input and inner_step1.own_graphs >= 1
    assert any("size mismatch" in reason for reason in inner_step1.reasons)

    top = detector.summary()[0]
    assert (top.module, top.cls, top.dynamic_ops) == ("inner", "InnerNet", 1)
    assert top.verdict.startswith("dynamic ops")

    (finding,) = [f for f in detector.findings() if f.kind == "data-dependent op"]
    assert finding.module == "inner"
    assert finding.code == "x = x[x > 0]  # data-dependent output shape"
    assert finding.location.endswith(f"{Path(__file__).name}:{InnerNet.forward.__code__.co_firstlineno + 3}")
    assert "nonzero" in finding.detail
    assert DYNAMIC_OPS in text and "x = x[x > 0]" in text


def test_where_goes_quiet(where: tuple[RecompilationDetector, str, Path]) -> None:
    detector, text, _ = where
    seen = comments(detector)
    assert DYNAMIC_OPS not in seen.values() and DYNAMIC_CHILD not in seen.values()
    assert {step for step, _ in seen} == {0, 2}  # compiles only for the first and the new batch size
    assert all(comment == NEW_INPUT_SHAPE for (step, _), comment in seen.items() if step == 2)
    assert detector.findings() == []
    assert "no graph breaks or data-dependent ops found" in text
    assert all(not s.verdict.startswith("dynamic ops") for s in detector.summary())


def test_csv_files_hold_the_tables(masked: tuple[RecompilationDetector, str, Path]) -> None:
    detector, _, directory = masked
    with open(directory / STEPS_CSV, newline="") as handle:
        steps = list(csv.DictReader(handle))
    assert len(steps) == len(detector.rows)
    assert {"step": "1", "module": "inner", "comment": DYNAMIC_OPS}.items() <= next(
        row for row in steps if row["step"] == "1" and row["module"] == "inner"
    ).items()
    with open(directory / SUMMARY_CSV, newline="") as handle:
        summary = list(csv.DictReader(handle))
    assert [row["module"] for row in summary] == [s.module for s in detector.summary()]
    assert summary[0]["module"] == "inner" and summary[0]["dynamic_ops"] == "1"


class Unique(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.unique(x).sum()


class Counting(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.unique = Unique()
        self.register_buffer("steps", torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.steps += 1
        return self.unique(x)


def test_data_dependent_op_captured_in_a_graph_is_found_and_explain_leaves_buffers_alone() -> None:
    torch._dynamo.reset()
    model = Counting()
    with (
        torch._dynamo.config.patch(capture_dynamic_output_shape_ops=True),
        detect_recompilation(model) as detector,
    ):
        for _ in range(2):
            detector(torch.tensor([1, 2, 2, 0]))
        findings = detector.findings()
    assert [(f.kind, f.module, f.code) for f in findings] == [
        ("data-dependent op", "unique", "return torch.unique(x).sum()")
    ]
    assert "captured in the graph" in findings[0].detail
    assert model.steps.item() == 2  # explain ran the model a third time, and its update was undone
    assert {row.step for row in detector.rows} == {0}  # no graph break, nothing recompiled at step 1
