"""A process of the precompiled tier running a model written as frameworks write theirs.

usage: precompile_framework_model.py OUT_JSON   (store and namespace from the environment)

Each form broke the tier on a real framework's model (issue 43), in a way the repository's own models
did not show:

* the forward of a new shape runs on parameters whose ``.grad`` is set (Lightning's and HF's loops:
  the optimizer's zero_grad after the forward, or none before it), so the second shape's artifact
  is traced then;
* a callable object's ``__call__`` (diffusers' attention processors): dynamo guards that method's
  code, a guard torch cannot save;
* a key looked up in a config dict (diffusers' ``ConfigMixin``: ``name in self._internal_dict``);
* a dataclass output that is also an ``OrderedDict`` (diffusers' and HF's ``BaseOutput``), which dynamo's
  bytecode rebuilds through a global for ``collections`` it installs (where the module's globals lack
  ``collections`` itself), named by the producer's object id.

Two shapes, one forward and backward each; writes the losses and recipecache's metrics.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import sys
from collections import OrderedDict
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

import recipecache


class Config(OrderedDict):
    """A frozen config whose keys are also attributes (diffusers' ``FrozenDict``)."""

    def __init__(self, **items: Any) -> None:
        super().__init__(**items)
        for key, value in self.items():
            setattr(self, key, value)


class BaseOutput(OrderedDict):
    """A model output as diffusers' and HF's ``BaseOutput``: a dataclass (its subclasses) that is also a mapping."""

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):  # type: ignore[arg-type]
            if getattr(self, field.name) is not None:
                self[field.name] = getattr(self, field.name)

    def __setitem__(self, key: str, value: Any) -> None:
        super().__setitem__(key, value)
        super().__setattr__(key, value)


@dataclasses.dataclass
class Output(BaseOutput):
    logits: torch.Tensor


class Processor:
    """A callable object the module holds and calls (diffusers' attention processors)."""

    def __call__(self, hidden: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
        return F.gelu(hidden) * scale


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(16, 8)
        self.fc = torch.nn.Linear(8, 16)
        self.processor = Processor()
        self._internal_dict = Config(scale=0.5, bias=True)

    def __getattr__(self, name: str) -> Any:
        """diffusers' ``ModelMixin``: a config entry read as an attribute, otherwise the module's own."""
        if "_internal_dict" in self.__dict__ and hasattr(self.__dict__["_internal_dict"], name):
            return self._internal_dict[name]
        return super().__getattr__(name)

    def forward(self, tokens: torch.Tensor) -> Output:
        accepted = set(inspect.signature(self.processor.__call__).parameters.keys())  # as diffusers' Attention
        hidden = self.processor(self.embed(tokens), **({"scale": 2.0} if "scale" in accepted else {}))
        return Output(logits=self.fc(hidden * self.scale))


def main() -> None:
    recipecache.enable(precompile=True)
    torch.manual_seed(0)
    model = Net()
    compiled = torch.compile(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for length in (4, 6):
        tokens = torch.randint(0, 16, (2, length), generator=torch.Generator().manual_seed(length))
        loss = compiled(tokens)["logits"].pow(2).mean()
        opt.zero_grad()  # after the forward, as Lightning's closure does: the forward saw the last step's gradients
        loss.backward()
        opt.step()
        losses.append(loss.item())
    from recipecache.torch_integration import metrics

    Path(sys.argv[1]).write_text(json.dumps({"losses": losses, "metrics": metrics()}))


if __name__ == "__main__":
    main()
