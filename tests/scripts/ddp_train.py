"""A torchrun script: DDP or FSDP2 over the ranks torchrun starts, nccl on GPUs, gloo without.

    torchrun --nproc-per-node 2 ddp_train.py [--fsdp] [--steps 3]
"""
import argparse
import os

import torch
import torch.distributed as dist
import torch.nn as nn

parser = argparse.ArgumentParser()
parser.add_argument("--fsdp", action="store_true")
parser.add_argument("--steps", type=int, default=3)
args = parser.parse_args()

cuda = torch.cuda.is_available()
dist.init_process_group("nccl" if cuda else "gloo")
rank, local_rank, world = dist.get_rank(), int(os.environ["LOCAL_RANK"]), dist.get_world_size()
if cuda:
    torch.cuda.set_device(local_rank)
device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(256, 1024), nn.GELU(), nn.Linear(1024, 1024), nn.GELU(), nn.Linear(1024, 256))
if args.fsdp:
    from torch.distributed.fsdp import fully_shard

    model.to(device)
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer)
    fully_shard(model)
else:
    model = nn.parallel.DistributedDataParallel(model.to(device), device_ids=[local_rank] if cuda else None)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
for step in range(args.steps):
    x = torch.randn(32, 256, device=device)
    loss = model(x).pow(2).mean()
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    if rank == 0:
        print(f"step {step}: loss {loss.item():.4f} on {world} ranks")
dist.destroy_process_group()
