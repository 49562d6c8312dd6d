"""A DDP + torch.compile + gloo script written the usual way: model, optimizer and loss live in globals.

Under ``python script.py`` those globals (and, through the DDP reducer, the process group)
live until the interpreter finalizes, after every atexit handler. ``recipecache-run`` must
give the script the same exit; an atexit handler (``exit_probe``) records what it sees.
Usage: ``ddp_exit.py OUT_PREFIX``.
"""

import atexit
import sys
import weakref

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

import exit_probe

dist.init_process_group("gloo")
torch.manual_seed(0)
model = DistributedDataParallel(torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1)))
compiled = torch.compile(model)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
for _ in range(2):
    loss = compiled(torch.randn(4, 8)).sum()
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
total = loss.detach().clone()
dist.all_reduce(total)  # the last collective ends right before the script does, as a final log line's would
atexit.register(exit_probe.record_at_exit, sys.argv[1], weakref.ref(model))
