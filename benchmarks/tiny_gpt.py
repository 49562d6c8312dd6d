"""The small causal transformer LM the benchmarks train: pre-LN blocks, causal attention, MLP.

Shared by ``first_step_bench.py`` (its ``lm`` model) and ``cold_bench.py`` (every rank of
its job), imported from the benchmark's own directory (the script's directory is first
on ``sys.path`` under ``python``, torchrun and ``recipecache-run``). Built after
``torch.manual_seed``, every process gets the same parameters.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class CausalBlock(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.fc1, self.fc2 = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2)
                   for z in self.qkv(self.ln1(x)).split(c, dim=2))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, c))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class TinyGPT(nn.Module):
    """A small causal transformer LM whose forward returns the next-token loss (sequences up to ``seq``)."""

    def __init__(self, vocab: int, seq: int, dim: int = 64, heads: int = 4, layers: int = 2,
                 head_bias: bool = False) -> None:
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, dim), nn.Embedding(seq, dim)
        self.blocks = nn.ModuleList(CausalBlock(dim, heads) for _ in range(layers))
        self.ln, self.head = nn.LayerNorm(dim), nn.Linear(dim, vocab, bias=head_bias)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.tok(tokens) + self.pos(torch.arange(tokens.shape[1]))
        for block in self.blocks:
            x = block(x)
        return F.cross_entropy(self.head(self.ln(x)).flatten(0, 1), targets.flatten())
