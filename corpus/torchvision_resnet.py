"""torchvision: a ResNet (torchvision's own ``ResNet`` and ``BasicBlock``, one block per stage) trained with DDP on
images of varying size.

Image classification at several resolutions (multi-scale training, the last partial batch): each
size is a new input shape for the compiled model. Plain ``torch.distributed`` + DDP, launched by
torchrun.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel
from torchvision.models.resnet import BasicBlock, ResNet

from _common import Record, generator, parser, sizes

CLASSES = 10


def batch(step: int, size: int, count: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    gen = generator(step)
    labels = torch.randint(0, CLASSES, (count,), generator=gen)
    # a class-dependent mean makes the task learnable
    images = torch.randn(count, 3, size, size, generator=gen) + labels.view(-1, 1, 1, 1) / CLASSES
    return images, labels


def main() -> None:
    args = parser(__doc__, steps=4, lengths="32,48").parse_args()
    image_sizes = sizes(args.lengths)
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = DistributedDataParallel(ResNet(BasicBlock, [1, 1, 1, 1], num_classes=CLASSES))
    compiled = torch.compile(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    record = Record(args.out)
    record.start()
    for step in range(args.steps):
        images, labels = batch(step, image_sizes[step % len(image_sizes)])
        loss = F.cross_entropy(compiled(images), labels)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        record.step(loss.item())
    record.write()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
