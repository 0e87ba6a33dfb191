"""Tensors of the torch.distributed backend: reduce ops, argument checks, host views.

Every buffer reaches MPI as a flat numpy array: a zero-copy view of a contiguous CPU
tensor, else a contiguous copy (also for tensors on a device, and for bfloat16/bool in a
reduction, which reduce as float32/uint8) whose result :meth:`Host.finish` writes back.
"""
from __future__ import annotations

from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from ..engine.dtypes import SUPPORTED, numpy_view, reduce_dtype

__all__ = ["op_name", "op_label", "premul_factor", "check_tensor", "check_reduce_dtype", "Host",
           "byte_view"]

_BITWISE = {"BAND": "band", "BOR": "bor", "BXOR": "bxor"}
_OPS = {"SUM": "sum", "AVG": "average", "PRODUCT": "prod", "MIN": "min", "MAX": "max",
        **_BITWISE}
BITWISE = frozenset(_BITWISE.values())


def _is_premul(reduce_op: Any) -> bool:
    # a ReduceOp made by _make_nccl_premul_sum compares equal to PREMUL_SUM in torch 2.13;
    # older versions expose its type as ``.op``
    return (reduce_op == dist.ReduceOp.PREMUL_SUM
            or getattr(reduce_op, "op", None) == dist.ReduceOp.PREMUL_SUM)


def op_name(reduce_op: Any) -> str:
    """mpicoll's name for a torch ``ReduceOp`` (``"sum"`` for PREMUL_SUM, whose factor
    :func:`premul_factor` gives); ``ValueError`` for the others."""
    if _is_premul(reduce_op):
        if premul_factor(reduce_op) is not None:
            return "sum"
        raise ValueError("the mpicoll backend does not support PREMUL_SUM without its "
                         "factor: make the op with dist._make_nccl_premul_sum(factor)")
    for name, ours in _OPS.items():
        if reduce_op == getattr(dist.ReduceOp, name):
            return ours
    raise ValueError(f"the mpicoll backend does not support reduce op {reduce_op}")


def op_label(reduce_op: Any) -> str:
    """The op's name for agreement and messages (``"premul_sum"`` for PREMUL_SUM)."""
    return "premul_sum" if _is_premul(reduce_op) else op_name(reduce_op)


def premul_factor(reduce_op: Any) -> Any:
    """The factor of a PREMUL_SUM op (a number or a one-element tensor), else ``None``."""
    return getattr(reduce_op, "factor", None) if _is_premul(reduce_op) else None


def check_tensor(tensor: Any, argname: str) -> torch.Tensor:
    """``tensor`` if it is a dense CPU (or CUDA) tensor, else ``TypeError``."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{argname} must be a torch.Tensor, not {type(tensor).__name__}")
    if tensor.layout is not torch.strided:
        raise TypeError(f"{argname} is a {tensor.layout} tensor; the mpicoll backend takes "
                        f"dense (strided) tensors")
    if tensor.device.type not in ("cpu", "cuda"):
        raise TypeError(f"{argname} is on {tensor.device}; the mpicoll backend takes CPU and "
                        f"CUDA tensors")
    if tensor.dtype not in SUPPORTED:
        raise TypeError(f"{argname} has dtype {tensor.dtype}, which the mpicoll backend does "
                        f"not handle (supported: {', '.join(map(str, SUPPORTED))})")
    return tensor


def check_reduce_dtype(tensor: torch.Tensor, op: str, argname: str = "tensor",
                       factor: Any = None) -> None:
    """``TypeError`` where ``op`` (a PREMUL_SUM where ``factor`` is given) does not apply
    to ``tensor``'s dtype."""
    if factor is not None and not (tensor.is_floating_point() or tensor.is_complex()):
        raise TypeError(f"reduce op PREMUL_SUM needs a floating or complex {argname}, not "
                        f"{tensor.dtype}")
    if op in BITWISE and (tensor.is_floating_point() or tensor.is_complex()):
        raise TypeError(f"reduce op {op} needs an integer or bool tensor, not {tensor.dtype}")
    if tensor.is_complex() and op in ("min", "max"):
        raise TypeError(f"reduce op {op} is not defined for complex {argname}")


class Host:
    """A flat numpy array for ``tensor``, written back to it by :meth:`finish`.

    Args:
        tensor: a checked tensor.
        reduce: whether the array is reduced (bfloat16/bool then travel as float32/uint8).
        scale: a PREMUL_SUM factor applied to the copy (never to ``tensor`` itself).
    """

    def __init__(self, tensor: torch.Tensor, reduce: bool = False, scale: Any = None) -> None:
        self.tensor = tensor
        dtype = reduce_dtype(tensor.dtype) if reduce else tensor.dtype
        if (tensor.device.type == "cpu" and dtype is tensor.dtype and tensor.is_contiguous()
                and scale is None):
            self.work = tensor
        else:
            self.work = tensor.detach().to("cpu", dtype, copy=True,  # never tensor itself
                                           memory_format=torch.contiguous_format)
            if scale is not None:
                self.work.mul_(scale.to("cpu") if isinstance(scale, torch.Tensor) else scale)
        self.array = numpy_view(self.work)

    def finish(self) -> None:
        """Write the array's values back to the tensor (where the array is a copy)."""
        if self.work is not self.tensor:
            with torch.no_grad():
                self.tensor.copy_(self.work.view(self.tensor.shape))


def byte_view(tensor: torch.Tensor) -> np.ndarray:
    """The bytes of contiguous CPU ``tensor`` as a flat uint8 array (zero copy)."""
    return numpy_view(tensor).view(np.uint8)
