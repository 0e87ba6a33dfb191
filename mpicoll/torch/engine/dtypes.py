"""torch dtypes as numpy arrays: which dtype moves the bytes and which one reduces them.

Every CPU dtype from ``uint8`` to ``float64`` maps to a numpy dtype of the same size, so a
contiguous tensor is handed to mpicoll as a zero-copy numpy view (``tensor.numpy()``).
``bfloat16`` has no numpy dtype: it *moves* as ``int16`` (bit patterns; broadcast and
allgather are exact) and *reduces* in ``float32`` (packed into a float32 buffer, reduced,
rounded back to bfloat16 once at the end). ``bool`` moves as numpy ``bool`` and reduces as
``uint8`` with Min/Max only (logical and/or).
"""
from __future__ import annotations

import functools

import numpy as np
import torch

__all__ = ["SUPPORTED", "numpy_view", "reduce_dtype", "check_supported", "dtype_name", "from_name",
           "move_dtype", "numpy_dtype"]

#: torch dtype -> the torch dtype whose numpy view carries its bytes.
_MOVE: dict[torch.dtype, torch.dtype] = {
    torch.uint8: torch.uint8, torch.int8: torch.int8, torch.int16: torch.int16,
    torch.int32: torch.int32, torch.int64: torch.int64, torch.float16: torch.float16,
    torch.float32: torch.float32, torch.float64: torch.float64, torch.bool: torch.bool,
    torch.bfloat16: torch.int16, torch.complex64: torch.complex64,
    torch.complex128: torch.complex128,
}
for _name in ("uint16", "uint32", "uint64"):
    if hasattr(torch, _name):
        _MOVE[getattr(torch, _name)] = getattr(torch, _name)

#: Every dtype the adapter accepts.
SUPPORTED = tuple(_MOVE)


def check_supported(tensor: object, argname: str = "tensor") -> torch.Tensor:
    """Raise unless ``tensor`` is a CPU or CUDA tensor of a supported dtype; return it.

    Raises:
        TypeError: not a tensor, on another kind of device, or an unsupported dtype.
    """
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{argname} must be a torch.Tensor, not {type(tensor).__name__}")
    if not tensor.is_cpu and not tensor.is_cuda:
        raise TypeError(f"{argname} is on {tensor.device}; mpicoll.torch handles CPU and CUDA "
                        f"tensors (move it with .cpu() or .cuda())")
    if tensor.dtype not in _MOVE:
        raise TypeError(f"{argname} has dtype {tensor.dtype}, which mpicoll.torch does not "
                        f"handle (supported: {', '.join(str(d) for d in SUPPORTED)})")
    if tensor.is_sparse:
        raise TypeError(f"{argname} is sparse; mpicoll.torch handles dense tensors")
    return tensor


def numpy_view(tensor: torch.Tensor) -> np.ndarray:
    """A flat numpy array sharing memory with contiguous CPU ``tensor`` (bfloat16 as int16)."""
    return tensor.detach().reshape(-1).view(_MOVE[tensor.dtype]).numpy()


def move_dtype(dtype: torch.dtype) -> torch.dtype:
    """The torch dtype that carries the bytes of ``dtype`` (bfloat16 -> int16)."""
    return _MOVE[dtype]


@functools.cache
def numpy_dtype(dtype: torch.dtype) -> np.dtype:
    """The numpy dtype of :func:`move_dtype` (``dtype``)'s numpy views."""
    return torch.empty(0, dtype=_MOVE[dtype]).numpy().dtype


_REDUCE = {torch.bfloat16: torch.float32, torch.bool: torch.uint8}


def reduce_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype in which tensors of ``dtype`` are reduced (bfloat16 -> float32, bool ->
    uint8, where Min/Max of 0/1 are logical and/or)."""
    return _REDUCE.get(dtype, dtype)


def dtype_name(dtype: torch.dtype) -> str:
    """Short name used in negotiation metadata and error messages (``"float32"``)."""
    return str(dtype).replace("torch.", "")


def from_name(name: str) -> torch.dtype:
    """The torch dtype called ``name`` (as made by :func:`dtype_name`)."""
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype name {name!r}")
    return dtype
