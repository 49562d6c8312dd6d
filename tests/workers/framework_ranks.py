"""A rank of a job that a framework's own launcher starts, knowing nothing of recipecache (as plain_ranks.py).

* ``lightning``: ``python framework_ranks.py lightning OUT``: a Trainer with 2 CPU processes and the DDP strategy,
  whose launcher re-runs this script for rank 1; rank 0 becomes a rank only then.
* ``accelerate``: ``accelerate launch --num_processes 2 --cpu framework_ranks.py accelerate OUT``.

Each rank compiles the same tiny function (one forward graph: seconds of compile) in its training step and writes
``OUT/rank<R>.json``: its result and whether the start-up hook enabled recipecache there (torch's FX graphs go to
a remote cache, which only recipecache's enable() sets here).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch


@torch.compile(dynamic=False)
def features(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return torch.relu(x @ w + 1.0)


def record(out: Path, rank: int, result: torch.Tensor) -> None:
    out.mkdir(parents=True, exist_ok=True)
    report = {"rank": rank, "result": result.tolist(), "enabled": bool(torch._inductor.config.fx_graph_remote_cache)}
    (out / f"rank{rank}.json").write_text(json.dumps(report))


def inputs() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return torch.randn(4, 8, generator=gen), torch.randn(8, 8, generator=gen)


def lightning(out: Path) -> None:
    import pytorch_lightning as pl
    from torch.utils.data import DataLoader, TensorDataset

    class Tiny(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(8, 1)

        def training_step(self, batch: list[torch.Tensor], _index: int) -> torch.Tensor:
            with torch.no_grad():
                result = features(*inputs())
            if self.global_step == 0:
                record(out, self.global_rank, result.sum(dim=1))
            return self.layer(batch[0]).pow(2).mean()

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    data = DataLoader(TensorDataset(torch.randn(8, 8)), batch_size=4)
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy="ddp", max_steps=1, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(Tiny(), data)


def accelerate(out: Path) -> None:
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True)
    result = features(*inputs())
    record(out, accelerator.process_index, result.sum(dim=1))
    accelerator.wait_for_everyone()
    accelerator.end_training()


if __name__ == "__main__":
    {"lightning": lightning, "accelerate": accelerate}[sys.argv[1]](Path(sys.argv[2]))
