"""PyTorch Lightning: a compiled LightningModule trained with ``Trainer(strategy="ddp")`` on sequences of varying length.

The model is ``torch.compile``'d inside the LightningModule (Lightning's documented way); each
batch's sequence length comes from a cycle of lengths, so the compiled graph meets several shapes,
the first of them after a backward already gave the parameters their gradients. Launched by
torchrun (Lightning detects it and does not start processes itself), or by Lightning alone
(``python lightning_ddp.py``: it re-runs this script once per extra rank).
"""

from __future__ import annotations

import pytorch_lightning as L
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset

from _common import Record, generator, parser, sizes

VOCAB = 64


class Sequences(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Arithmetic sequences mod VOCAB, one batch per item, each item's length from the cycle."""

    def __init__(self, steps: int, lengths: list[int], batch: int) -> None:
        self.steps, self.lengths, self.batch = steps, lengths, batch

    def __len__(self) -> int:
        return self.steps

    def __getitem__(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        gen = generator(step)
        length = self.lengths[step % len(self.lengths)]
        start = torch.randint(0, VOCAB, (self.batch, 1), generator=gen)
        stride = torch.randint(1, 4, (self.batch, 1), generator=gen)
        seq = (start + stride * torch.arange(length + 1)) % VOCAB
        return seq[:, :-1], seq[:, 1:]


class TinyLM(nn.Module):
    def __init__(self, dim: int = 32) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, dim)
        self.mix = nn.Linear(dim, dim)
        self.head = nn.Linear(dim, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(F.gelu(self.mix(self.embed(tokens))))


class Module(L.LightningModule):
    def __init__(self, record: Record) -> None:
        super().__init__()
        self.model = torch.compile(TinyLM())
        self.record = record

    def on_train_start(self) -> None:
        self.record.start()

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], _: int) -> torch.Tensor:
        tokens, targets = batch
        loss = F.cross_entropy(self.model(tokens).flatten(0, 1), targets.flatten())
        self.record.step(loss.item())
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def main() -> None:
    args = parser(__doc__, steps=4, lengths="8,16").parse_args()
    torch.manual_seed(0)
    record = Record(args.out)
    module = Module(record)
    data = DataLoader(Sequences(args.steps, sizes(args.lengths), batch=4), batch_size=None, shuffle=False)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy="ddp",
        max_epochs=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        use_distributed_sampler=False,
    )
    trainer.fit(module, data)
    record.write()
    # Lightning leaves its gloo group to the interpreter's exit, where torch 2.15 aborts ("terminate called
    # without an active exception", plain torchrun as well): end it, as Lightning's own DDP examples do
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
