"""torchrun integration: process-group setup from the environment, DDP/FSDP wrapping, collectives."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn


@dataclass
class DistributedContext:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def init_distributed(device_type: str) -> DistributedContext:
    """Join the process group torchrun describes (WORLD_SIZE > 1): gloo on CPU, nccl on CUDA."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return DistributedContext()
    rank, local = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
    if not dist.is_initialized():
        dist.init_process_group(backend="nccl" if device_type == "cuda" else "gloo")
    return DistributedContext(rank=rank, world_size=world, local_rank=local)


def wrap_model(model: nn.Module, ctx: DistributedContext, strategy: str, device: torch.device) -> nn.Module:
    if not ctx.enabled:
        return model
    if strategy == "fsdp":
        from torch.distributed.fsdp import fully_shard

        for block in getattr(model, "blocks", []):
            fully_shard(block)
        return fully_shard(model)
    from torch.nn.parallel import DistributedDataParallel

    return DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)


def all_reduce_sum(value: torch.Tensor, ctx: DistributedContext) -> torch.Tensor:
    if ctx.enabled:
        value = value.clone()
        dist.all_reduce(value)
    return value


def all_reduce_mean(value: torch.Tensor, ctx: DistributedContext) -> torch.Tensor:
    return all_reduce_sum(value, ctx) / ctx.world_size


def any_rank(flag: bool, ctx: DistributedContext, device: torch.device) -> bool:
    """True if `flag` is set on any rank (so all ranks stop together)."""
    if not ctx.enabled:
        return flag
    t = torch.tensor([1.0 if flag else 0.0], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item() > 0)


def barrier(ctx: DistributedContext) -> None:
    if ctx.enabled:
        dist.barrier()


def shutdown(ctx: DistributedContext) -> None:
    if ctx.enabled and dist.is_initialized():
        # every rank reaches this point before any tears gloo down: a rank that destroys the group
        # while its peer still has a collective in flight can abort the peer at exit
        dist.barrier()
        dist.destroy_process_group()
