"""Distributed FP8 training with fp8kit:

    torchrun --nproc-per-node 2 examples/distributed.py

Runs on CPU with the gloo backend (or on GPUs with NCCL when every rank has one). It shows
1. data parallelism (DistributedDataParallel) with delayed scaling: the amaxes are all-reduced (MAX) over the
   data-parallel group, so every rank keeps identical weights, amax histories and scales;
2. a tensor-parallel, sequence-parallel MLP block (column-parallel -> GELU -> row-parallel): the sequence-split
   input `[s / tp, b, h]` is cast to FP8 with a scale shared by the tensor-parallel ranks and all-gathered as FP8
   bytes, and the output is reduce-scattered back to `[s / tp, b, h]`.
See docs/distributed.md.
"""

import gc
import os

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import fp8kit.pytorch as te
from fp8kit.recipe import DelayedScaling, Float8CurrentScaling


def data_parallel(rank: int, world: int, device: torch.device, steps: int) -> None:
    torch.manual_seed(0)  # the same initial weights on every rank (DDP also broadcasts them)
    model = DDP(torch.nn.Sequential(te.Linear(64, 128), torch.nn.GELU(), te.Linear(128, 64)).to(device))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    recipe = DelayedScaling(amax_history_len=16)  # reduce_amax=True is the default
    gen = torch.Generator().manual_seed(1000 + rank)  # every rank its own data
    for step in range(steps):
        x = (torch.randn(32, 64, generator=gen) * (1 + rank)).to(device)
        with te.autocast(recipe=recipe):  # amax_reduction_group=None: the default (here data-parallel) group
            loss = (model(x) - x).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        if rank == 0:
            print(f"DDP step {step}: loss {loss.item():.4f}")
    te.distributed.apply_pending_updates()  # the last step's backward-state update, before reading the state
    first = model.module[0]
    scale = first.fp8_meta["scaling_fwd"].scale
    scales = [torch.empty_like(scale) for _ in range(world)]
    dist.all_gather(scales, scale)
    if rank == 0:
        same = all(torch.equal(s, scales[0]) for s in scales)
        print(f"forward scales of the first layer (input, weight, output): {scale.tolist()}; "
              f"identical on all {world} ranks: {same}")


def tensor_parallel(rank: int, world: int, device: torch.device) -> None:
    group = dist.group.WORLD  # one tensor-parallel group of every rank
    torch.manual_seed(1)
    fc1 = te.Linear(64, 256, parallel_mode="column", tp_group=group, sequence_parallel=True, device=device)
    fc2 = te.Linear(256, 64, parallel_mode="row", tp_group=group, sequence_parallel=True, device=device)
    seq, batch = 8 * world, 4
    x = torch.randn(seq // world, batch, 64, device=device, requires_grad=True)  # this rank's part of the sequence
    with te.autocast(recipe=Float8CurrentScaling()):
        y = fc2(torch.nn.functional.gelu(fc1(x)))
    y.sum().backward()
    if rank == 0:
        print(f"tensor parallel over {world} ranks: input {tuple(x.shape)} -> fc1 weight {tuple(fc1.weight.shape)} "
              f"-> fc2 weight {tuple(fc2.weight.shape)} -> output {tuple(y.shape)}, input grad {tuple(x.grad.shape)}")


def main(steps: int = 5) -> None:
    created = not dist.is_initialized()
    if created:  # torchrun sets RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT
        use_cuda = torch.cuda.is_available() and torch.cuda.device_count() >= int(os.environ.get("LOCAL_WORLD_SIZE", 1))
        dist.init_process_group("nccl" if use_cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cpu")
    if "nccl" in str(dist.get_backend()).lower():
        device = torch.device("cuda", rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
    data_parallel(rank, world, device, steps)
    tensor_parallel(rank, world, device)
    if created:
        # Free what still holds the group (DDP's reducer sits in reference cycles) before tearing it down: a gloo
        # group destroyed at interpreter exit instead aborts the process ("terminate called ...") under load.
        gc.collect()
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
