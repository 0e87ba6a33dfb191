"""Horovod's reduction op constants and how they map onto mpicoll's ops.

``Average`` is a sum followed by one scaling by ``postscale_factor / size()`` (ranks that
called :func:`join` count in ``size()``). As in Horovod, scaling factors apply to integer
tensors in float64, cast back toward zero, so an integer average divides toward zero, as C
does (-75 averaged over 2 ranks is -37; without a postscale factor the division is exact
integer arithmetic, with the same result).

``Adasum`` is not an element-wise op: :mod:`mpicoll.algorithms.adasum` runs it (floating tensors
only, a power-of-two number of ranks).
"""
from __future__ import annotations

from typing import Any

import torch


__all__ = ["Average", "Sum", "Adasum", "Min", "Max", "Product", "ReduceOp", "resolve_reduce_op",
           "mpicoll_op", "check_op_dtype", "ADASUM_DTYPES",
           "UnsupportedOpError"]


class UnsupportedOpError(ValueError, RuntimeError):
    """A reduction op that the collective does not take (a reduce-scatter with ``Adasum``,
    ``Min``, ``Max`` or ``Product``): a ``ValueError`` (a bad argument, raised on the
    calling rank before anything is sent) and a ``RuntimeError`` (the class Horovod's
    error has), so either ``except`` catches it."""


class ReduceOp(int):
    """An all-reduce operation (an int, as in Horovod, with a readable name)."""

    _names = {0: "Average", 1: "Sum", 2: "Adasum", 3: "Min", 4: "Max", 5: "Product"}

    def __repr__(self) -> str:
        return self._names.get(int(self), f"ReduceOp({int(self)})")

    __str__ = __repr__


Average = ReduceOp(0)
Sum = ReduceOp(1)
Adasum = ReduceOp(2)
Min = ReduceOp(3)
Max = ReduceOp(4)
Product = ReduceOp(5)

_MPICOLL = {0: "sum", 1: "sum", 3: "min", 4: "max", 5: "prod"}


def resolve_reduce_op(average: Any = None, op: Any = None, adasum: bool = False) -> ReduceOp:
    """Combine Horovod's deprecated ``average=`` with ``op=`` (default ``Average``).

    Args:
        adasum: whether the caller takes ``Adasum`` (the tensor all-reduces do; the
            DistributedOptimizer, whose Horovod Adasum mode is a different algorithm, does
            not).
    Raises:
        ValueError: both given, or an unknown op, or ``Adasum`` where it is not taken.
    """
    if op is not None and average is not None:
        raise ValueError("specify op= or the deprecated average=, not both")
    if op is None:
        op = Average if average is None or average else Sum
    if isinstance(op, bool) or not isinstance(op, int) or int(op) not in ReduceOp._names:
        raise ValueError(f"op must be one of Average, Sum, Min, Max, Product, not {op!r}")
    if int(op) == int(Adasum) and not adasum:
        raise ValueError("op=Adasum is supported by allreduce and grouped_allreduce (and "
                         "their async and in-place forms) only; DistributedOptimizer("
                         "op=Adasum), Horovod's delta-based Adasum optimizer, is not "
                         "implemented by mpicoll.torch")
    return ReduceOp(int(op))


def mpicoll_op(op: ReduceOp) -> str:
    """The mpicoll op name run during the collective (Average runs as ``"sum"``)."""
    return _MPICOLL[int(op)]


#: Tensor dtypes Adasum reduces (Horovod's: float16, float32, float64; bfloat16 reduces in
#: the adapter's float32 buffer).
ADASUM_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def check_op_dtype(op: ReduceOp, dtype: torch.dtype, prescale: float, postscale: float) -> None:
    """Raise ``TypeError``/``ValueError`` for an op or scaling that ``dtype`` cannot take
    (``TypeError`` for Adasum unless it reduces tensors of ``dtype``)."""
    if int(op) == int(Adasum) and dtype not in ADASUM_DTYPES:
        raise TypeError(f"op=Adasum reduces float16, bfloat16, float32 and float64 tensors, "
                        f"not {dtype}")
    if dtype is torch.bool and int(op) not in (3, 4):
        raise TypeError(f"op={op!r} does not apply to torch.bool tensors (use Min or Max)")
    if dtype.is_complex and int(op) in (3, 4):
        raise TypeError(f"op={op!r} does not apply to complex tensors")
    if (prescale != 1.0 or postscale != 1.0) and dtype is torch.bool:
        raise ValueError("prescale_factor/postscale_factor do not apply to torch.bool tensors")
