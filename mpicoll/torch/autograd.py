"""Autograd through the collectives.

- all-reduce: the gradient is the same all-reduce of the incoming gradients (Average and
  Sum are linear; for Min/Max/Product this follows Horovod and is only an approximation);
- all-gather: the incoming gradients are summed over ranks and each rank keeps the rows it
  contributed;
- broadcast: the incoming gradients are summed over ranks onto the root; other ranks get
  zeros (Horovod averages here instead; the sum is the true gradient of the broadcast).
"""
from __future__ import annotations

from typing import Any

import torch

from . import mpi_ops
from .ops import Sum

__all__ = ["AllreduceFn", "AllgatherFn", "BroadcastFn"]


class AllreduceFn(torch.autograd.Function):
    """Differentiable all-reduce."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, name: str, op: Any, prescale: float,
                postscale: float) -> torch.Tensor:
        ctx.op, ctx.prescale, ctx.postscale = op, prescale, postscale
        return mpi_ops.synchronize(mpi_ops.allreduce_async(
            tensor, name=name, op=op, prescale_factor=prescale, postscale_factor=postscale))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        reduced = mpi_ops.synchronize(mpi_ops.allreduce_async(
            grad.contiguous(), op=ctx.op, prescale_factor=ctx.prescale,
            postscale_factor=ctx.postscale))
        return reduced, None, None, None, None


class AllgatherFn(torch.autograd.Function):
    """Differentiable all-gather along dimension 0."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, name: str) -> torch.Tensor:
        result, dims = mpi_ops._sizes(mpi_ops.allgather_async(tensor, name=name))
        ctx.dims = dims
        ctx.rank = mpi_ops.engine().rank
        return result

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        summed = mpi_ops.synchronize(mpi_ops.allreduce_async(grad.contiguous(), op=Sum))
        start = sum(ctx.dims[:ctx.rank])
        return summed[start:start + ctx.dims[ctx.rank]].clone(), None


class BroadcastFn(torch.autograd.Function):
    """Differentiable broadcast."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, root_rank: int, name: str) -> torch.Tensor:
        ctx.root = root_rank
        return mpi_ops.synchronize(mpi_ops.broadcast_async(tensor, root_rank, name=name))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        summed = mpi_ops.synchronize(mpi_ops.allreduce_async(grad.contiguous(), op=Sum))
        if mpi_ops.engine().rank != ctx.root:
            summed.zero_()
        return summed, None, None
