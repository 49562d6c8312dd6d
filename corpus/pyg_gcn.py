"""torch_geometric: a two-layer GCN trained with DDP on random graphs whose node count varies per batch.

Graph batches are the dynamic-shape case by nature: every batch has another number of nodes and
edges. PyG's ``GCNConv`` (message passing with scatter) compiled with ``torch.compile``, as PyG
documents; launched by torchrun.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch_geometric.nn import GCNConv

from _common import Record, generator, parser, sizes

FEATURES, CLASSES = 8, 3


class GCN(nn.Module):
    def __init__(self, hidden: int = 16) -> None:
        super().__init__()
        self.conv1 = GCNConv(FEATURES, hidden)
        self.conv2 = GCNConv(hidden, CLASSES)

    def forward(self, x: torch.Tensor, edge_index: torch.Tensor) -> torch.Tensor:
        return self.conv2(F.relu(self.conv1(x, edge_index)), edge_index)


def graph(step: int, nodes: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A random graph of ``nodes`` nodes and 3 edges per node; labels follow the features."""
    gen = generator(step)
    x = torch.randn(nodes, FEATURES, generator=gen)
    src = torch.randint(0, nodes, (3 * nodes,), generator=gen)
    dst = torch.randint(0, nodes, (3 * nodes,), generator=gen)
    labels = x[:, :CLASSES].argmax(dim=1)
    return x, torch.stack([src, dst]), labels


def main() -> None:
    args = parser(__doc__, steps=4, lengths="40,56").parse_args()
    node_counts = sizes(args.lengths)
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = DistributedDataParallel(GCN())
    compiled = torch.compile(model)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    record = Record(args.out)
    record.start()
    for step in range(args.steps):
        x, edge_index, labels = graph(step, node_counts[step % len(node_counts)])
        loss = F.cross_entropy(compiled(x, edge_index), labels)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        record.step(loss.item())
    record.write()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
