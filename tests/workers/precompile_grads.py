"""A process of the precompiled tier whose second input shape is first met while the parameters hold gradients.

usage: precompile_grads.py OUT_JSON   (store and namespace from the environment)

As Lightning's and HF's training loops do (the optimizer's zero_grad after the forward, or none
before it), the forward of a new shape runs on parameters whose ``.grad`` is set: the tier's
artifact for that shape is traced then. Two shapes, one forward and backward each; writes the
losses and recipecache's metrics.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

import recipecache


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(16, 8)
        self.fc = torch.nn.Linear(8, 16)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.fc(F.gelu(self.embed(tokens)))


def main() -> None:
    recipecache.enable(precompile=True)
    torch.manual_seed(0)
    model = Net()
    compiled = torch.compile(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for length in (4, 6):
        tokens = torch.randint(0, 16, (2, length), generator=torch.Generator().manual_seed(length))
        loss = compiled(tokens).pow(2).mean()
        opt.zero_grad()  # after the forward, as Lightning's closure does: the forward saw the last step's gradients
        loss.backward()
        opt.step()
        losses.append(loss.item())
    from recipecache.torch_integration import metrics

    Path(sys.argv[1]).write_text(json.dumps({"losses": losses, "metrics": metrics()}))


if __name__ == "__main__":
    main()
