"""Horovod's ``SyncBatchNorm``: batch normalization over the global batch of all ranks.

A drop-in for ``torch.nn.BatchNorm1d/2d/3d`` (any input ``(N, C, ...)``). In training mode
(and in eval mode without running statistics) the mean and variance of each channel are
those of the whole batch, every rank's part of it put together, whatever each rank's
batch size (a rank may hold no samples at all):

- forward: each rank's sample count, per-channel mean and sum of squared deviations (in
  float64) are all-gathered once (the request ``sync_batch_norm.stats``) and combined in
  rank order (Chan et al.'s pairwise rule), the same bits on every rank. The output is
  ``(x - mean) / sqrt(var + eps) * weight + bias`` with the biased global variance; the
  running statistics move by ``momentum`` (or the cumulative average when it is ``None``)
  toward the global mean and the *unbiased* global variance, as ``BatchNorm`` does;
- backward: the per-channel sums of ``dy`` and ``dy * (x - mean)`` are all-reduced (Sum,
  one request ``sync_batch_norm.grads``) and the input gradient goes through the global
  statistics; ``weight`` and ``bias`` get this rank's own gradients (as in Horovod: the
  DistributedOptimizer's all-reduce combines them).

Eval mode with running statistics, and a single rank, are plain ``F.batch_norm``.
Unlike Horovod (whose kernels are CUDA-only) this runs on CPU tensors.
"""
from __future__ import annotations

import logging
from typing import Any

import torch
import torch.nn.functional as F
from torch.nn.modules.batchnorm import _BatchNorm

from .mpi_ops import allgather_async, allreduce_async, synchronize
from .ops import Sum
from .process_sets import scoped
from .state import engine

__all__ = ["SyncBatchNorm"]

log = logging.getLogger("mpicoll.torch.sync_batch_norm")


class SyncBatchNorm(_BatchNorm):
    """Batch normalization whose training statistics span every rank's batch.

    Args:
        num_features: channels ``C`` of an input ``(N, C, ...)``.
        eps: added to the variance for numerical stability.
        momentum: weight of the new statistics in the running ones; ``None`` for the
            cumulative moving average.
        affine: learnable ``weight`` and ``bias``.
        track_running_stats: keep running statistics (used in eval mode); without them
            eval mode normalizes with the global batch statistics too.
        process_set: the ranks whose batches are normalized together (a registered
            :class:`~mpicoll.torch.ProcessSet`; default all ranks). Only its ranks may call
            the module in training mode.
    """

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: float | None = 0.1,
                 affine: bool = True, track_running_stats: bool = True,
                 process_set: Any = None) -> None:
        super().__init__(num_features, eps, momentum, affine, track_running_stats)
        self.process_set = process_set

    def _check_input_dim(self, input: torch.Tensor) -> None:  # noqa: A002  (torch's name)
        if input.dim() < 2:
            raise ValueError(f"expected at least 2D input (got {input.dim()}D input)")

    def forward(self, input: torch.Tensor) -> torch.Tensor:  # noqa: A002  (torch's name)
        """Normalize ``input`` (see the class).

        Raises:
            ValueError: an input of fewer than 2 dimensions, a channel count other than
                ``num_features``; in training, a global batch of at most one value per
                channel (on every rank of the set).
        """
        self._check_input_dim(input)
        if input.shape[1] != self.num_features:
            raise ValueError(f"expected {self.num_features} channels (dimension 1), got "
                             f"input of shape {tuple(input.shape)}")
        factor = 0.0 if self.momentum is None else float(self.momentum)
        batch_stats = self.training or not self.track_running_stats
        stats = (self.running_mean, self.running_var) if self.track_running_stats else (None, None)
        if self.training and self.track_running_stats:
            self.num_batches_tracked.add_(1)
            if self.momentum is None:
                factor = 1.0 / float(self.num_batches_tracked)
        if not batch_stats or _set_size(self.process_set) == 1:
            return F.batch_norm(input, *stats, self.weight, self.bias, batch_stats, factor,
                                self.eps)
        return _SyncBatchNormFn.apply(input, self.weight, self.bias, *stats, self.eps, factor,
                                      self.process_set)


def _set_size(process_set: Any) -> int:
    """Ranks in ``process_set`` (raises Horovod's error on a rank outside it)."""
    with scoped(process_set):
        return engine().size


def _channel_shape(x: torch.Tensor) -> list[int]:
    """Shape that broadcasts a per-channel vector against ``x``."""
    return [1, x.shape[1]] + [1] * (x.dim() - 2)


def _reduce_dims(x: torch.Tensor) -> list[int]:
    """Every dimension of ``x`` but the channel one."""
    return [0, *range(2, x.dim())]


def global_moments(gathered: torch.Tensor, channels: int) -> tuple[torch.Tensor, torch.Tensor,
                                                                    float]:
    """Combine every rank's ``[count, mean (C), sum of squared deviations (C)]`` rows.

    Args:
        gathered: ``(ranks, 1 + 2C)`` float64, in rank order.
        channels: ``C``.
    Returns:
        (global mean, global sum of squared deviations, global count).
    """
    counts = gathered[:, :1]
    means = gathered[:, 1:1 + channels]
    total = float(counts.sum())
    mean = (counts * means).sum(dim=0) / total
    m2 = (gathered[:, 1 + channels:] + counts * (means - mean) ** 2).sum(dim=0)
    return mean, m2, total


class _SyncBatchNormFn(torch.autograd.Function):
    """Batch normalization with global statistics; see the module docstring."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor | None,
                bias: torch.Tensor | None, running_mean: torch.Tensor | None,
                running_var: torch.Tensor | None, eps: float, factor: float,
                process_set: Any) -> torch.Tensor:
        x = x.contiguous()
        channels = x.shape[1]
        dims = _reduce_dims(x)
        shape = _channel_shape(x)
        count = x.numel() // channels
        x64 = x.to(torch.float64)
        if count:
            local_mean = x64.mean(dim=dims)
            local_m2 = ((x64 - local_mean.view(shape)) ** 2).sum(dim=dims)
        else:
            local_mean = local_m2 = torch.zeros(channels, dtype=torch.float64)
        row = torch.cat([torch.tensor([float(count)], dtype=torch.float64), local_mean,
                         local_m2]).view(1, -1)
        gathered = synchronize(allgather_async(row, name="sync_batch_norm.stats",
                                               process_set=process_set))
        mean, m2, total = global_moments(gathered, channels)
        if total <= 1:
            raise ValueError(f"Expected more than 1 value per channel when training, got "
                             f"{int(total)} over the global batch (this rank's input: "
                             f"{tuple(x.shape)})")
        invstd = torch.rsqrt(m2 / total + eps)
        if running_mean is not None and running_var is not None:
            with torch.no_grad():
                running_mean.mul_(1.0 - factor).add_(mean.to(running_mean.dtype),
                                                     alpha=factor)
                running_var.mul_(1.0 - factor).add_((m2 / (total - 1)).to(running_var.dtype),
                                                    alpha=factor)
        mean_x = mean.to(x.dtype).view(shape)
        invstd_x = invstd.to(x.dtype).view(shape)
        out = (x - mean_x) * invstd_x
        if weight is not None:
            out = out * weight.view(shape)
        if bias is not None:
            out = out + bias.view(shape)
        ctx.save_for_backward(x, weight, mean_x, invstd_x)
        ctx.total = total
        ctx.process_set = process_set
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        x, weight, mean_x, invstd_x = ctx.saved_tensors
        dy = grad.contiguous()
        channels, dims, shape = x.shape[1], _reduce_dims(x), _channel_shape(x)
        xmu = x - mean_x
        sum_dy = dy.sum(dim=dims)
        sum_dy_xmu = (dy * xmu).sum(dim=dims)
        grad_input = None           # (needs_input_grad is False for a None weight or bias)
        if ctx.needs_input_grad[0]:
            sums = synchronize(allreduce_async(torch.cat([sum_dy, sum_dy_xmu]), op=Sum,
                                               name="sync_batch_norm.grads",
                                               process_set=ctx.process_set))
            mean_dy = (sums[:channels] / ctx.total).view(shape)
            mean_dy_xmu = (sums[channels:] / ctx.total).view(shape)
            scale = invstd_x if weight is None else invstd_x * weight.view(shape)
            grad_input = (dy - mean_dy - xmu * invstd_x * invstd_x * mean_dy_xmu) * scale
        grad_weight = sum_dy_xmu * invstd_x.view(-1) if ctx.needs_input_grad[1] else None
        grad_bias = sum_dy if ctx.needs_input_grad[2] else None
        return grad_input, grad_weight, grad_bias, None, None, None, None, None
