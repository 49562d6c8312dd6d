"""HF Accelerate: a small causal LM trained with ``Accelerator(cpu=True, dynamo_backend="inductor")`` on varying lengths.

Accelerate compiles the model itself (``prepare`` wraps it in DDP and ``torch.compile``);
the batches cycle through sequence lengths, so the compiled graph meets several shapes.
Launched by torchrun or ``accelerate launch``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from accelerate import Accelerator
from torch import nn

from _common import Record, generator, parser, sizes

VOCAB = 64


class TinyLM(nn.Module):
    def __init__(self, dim: int = 32) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, dim)
        self.norm = nn.LayerNorm(dim)
        self.mix = nn.Linear(dim, dim)
        self.head = nn.Linear(dim, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(F.gelu(self.mix(self.norm(self.embed(tokens)))))


def batch(step: int, length: int, size: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    gen = generator(step)
    start = torch.randint(0, VOCAB, (size, 1), generator=gen)
    stride = torch.randint(1, 4, (size, 1), generator=gen)
    seq = (start + stride * torch.arange(length + 1)) % VOCAB
    return seq[:, :-1], seq[:, 1:]


def main() -> None:
    args = parser(__doc__, steps=4, lengths="8,16").parse_args()
    lengths = sizes(args.lengths)
    accelerator = Accelerator(cpu=True, dynamo_backend="inductor")
    torch.manual_seed(0)
    model = TinyLM()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer = accelerator.prepare(model, optimizer)
    record = Record(args.out)
    record.start()
    for step in range(args.steps):
        tokens, targets = batch(step, lengths[step % len(lengths)])
        loss = F.cross_entropy(model(tokens).flatten(0, 1), targets.flatten())
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        record.step(loss.item())
    record.write()
    accelerator.end_training()


if __name__ == "__main__":
    main()
