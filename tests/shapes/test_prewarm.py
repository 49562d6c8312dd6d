"""prewarm/declare_shapes in one process: every declared shape compiled up front, no training state changed.

The multi-rank case (shares spread over ranks, a 2-rank job meeting no compile in
training) runs in tests/torch_integration/graphs/test_multirank.py.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import recipecache
from recipecache.shapes.prewarm import _shares


def test_shares_keep_every_rank_busy_for_the_same_rounds() -> None:
    assert [_shares(3, r, 2) for r in range(2)] == [[0, 2], [1, 1]]
    assert [_shares(4, r, 2) for r in range(2)] == [[0, 2], [1, 3]]
    assert [_shares(1, r, 3) for r in range(3)] == [[0], [0], [0]]
    covered = {s for r in range(4) for s in _shares(10, r, 4)}
    assert covered == set(range(10))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.norm = nn.BatchNorm1d(8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.lin(x)).relu().sum()


def compiled_net() -> tuple[Net, Any, list[int]]:
    torch._dynamo.reset()
    graphs: list[int] = []

    def counting_backend(gm: torch.fx.GraphModule, example_inputs: list[torch.Tensor]) -> Any:
        graphs.append(1)
        return gm.forward

    model = Net()
    return model, torch.compile(model, backend=counting_backend, dynamic=False), graphs


def test_prewarm_compiles_every_shape_and_restores_state() -> None:
    model, compiled, graphs = compiled_net()
    shapes = [(torch.randn(n, 8),) for n in (2, 4, 6)]
    model.lin.weight.grad = torch.ones_like(model.lin.weight)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    seconds = recipecache.prewarm(compiled, shapes)
    assert set(seconds) == {"compile_s", "install_s"}
    compiled_up_front = len(graphs)
    assert compiled_up_front >= 3
    assert torch.equal(model.lin.weight.grad, torch.ones_like(model.lin.weight)), "gradients restored"
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items()), "buffers restored"
    for (x,) in shapes:
        compiled(x).backward()
    assert len(graphs) == compiled_up_front, "training met no new compile"


def test_declare_shapes_prewarms_only_when_the_launcher_asks(monkeypatch: pytest.MonkeyPatch) -> None:
    _model, compiled, graphs = compiled_net()
    shapes = [(torch.randn(n, 8),) for n in (2, 4)]
    monkeypatch.delenv("RECIPECACHE_PREWARM", raising=False)
    assert recipecache.declare_shapes(compiled, shapes) is None
    assert graphs == []
    monkeypatch.setenv("RECIPECACHE_PREWARM", "1")
    assert recipecache.declare_shapes(compiled, shapes) is not None
    assert len(graphs) >= 2
