"""diffusers: a ``UNet2DModel`` from a tiny config trained with DDP as a denoiser (DDPM noise prediction) at two
resolutions.

No weights are downloaded: the UNet is built from its config (two down/up blocks, small channel
counts). Each step adds noise with diffusers' ``DDPMScheduler`` at a seeded timestep and trains the
UNet to predict it; the resolution alternates, so the compiled UNet meets two shapes. Launched by
torchrun.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from diffusers import DDPMScheduler, UNet2DModel
from torch.nn.parallel import DistributedDataParallel

from _common import Record, generator, parser, sizes


def main() -> None:
    args = parser(__doc__, steps=4, lengths="16,24").parse_args()
    resolutions = sizes(args.lengths)
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    unet = UNet2DModel(
        sample_size=resolutions[0],
        in_channels=3,
        out_channels=3,
        layers_per_block=1,
        block_out_channels=(8, 16),
        down_block_types=("DownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "UpBlock2D"),
        norm_num_groups=4,
    )
    model = DistributedDataParallel(unet)
    compiled = torch.compile(model)
    scheduler = DDPMScheduler(num_train_timesteps=100)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    record = Record(args.out)
    record.start()
    for step in range(args.steps):
        gen = generator(step)
        size = resolutions[step % len(resolutions)]
        clean = torch.rand(2, 3, size, size, generator=gen) * 2 - 1
        noise = torch.randn(clean.shape, generator=gen)
        timesteps = torch.randint(0, scheduler.config.num_train_timesteps, (2,), generator=gen)
        noisy = scheduler.add_noise(clean, noise, timesteps)
        loss = F.mse_loss(compiled(noisy, timesteps).sample, noise)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        record.step(loss.item())
    record.write()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
