"""FSDP2 + tensor parallel: the repository's TorchTitan-style transformer block on a dp=2 x tp=2 mesh (4 ranks).

The block and its parallel plan are ``benchmarks/tp_block_worker.py``'s (``parallel_block``): the
compiled graphs carry all_gather and reduce_scatter over the tp group, and FSDP2 shards the block
over dp. Two sequence lengths; each rank trains on its tp part of the sequence. Launched by
torchrun with 4 ranks.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from _common import Record, parser, sizes

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
from tp_block_worker import BATCH, DIM, parallel_block


def main() -> None:
    args = parser(__doc__, steps=2, lengths="16,32").parse_args()
    lengths = sizes(args.lengths)
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size() // 2, 2), mesh_dim_names=("dp", "tp"))
    block = parallel_block(mesh, "fsdp_tp")
    compiled = torch.compile(block)
    optimizer = torch.optim.SGD(block.parameters(), lr=0.1)
    dp_rank, tp_rank = mesh.get_local_rank("dp"), mesh.get_local_rank("tp")
    record = Record(args.out)
    record.start()
    for step in range(args.steps):
        # the same batch on both ranks of a tp group: seeded by the step and the dp rank
        gen = torch.Generator().manual_seed(1000 * step + dp_rank)
        x = torch.randn(BATCH, lengths[step % len(lengths)], DIM, generator=gen)
        loss = compiled(x.chunk(2, dim=1)[tp_rank]).pow(2).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        record.step(loss.item())
    record.write()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
