"""Buffers: whatever the user passed, turned into one flat array view.

Everything an algorithm touches is a flat (1-D) contiguous array: its length is the count,
its dtype the element type, its array module (numpy, or CuPy for device arrays) the
device. All validation of one rank's buffers lives here, with errors naming the argument.
Scratch allocation, copies and message specs also go through here, so algorithms never call
numpy directly and device arrays plug in without changes to any algorithm.
"""
from __future__ import annotations

from typing import Any

import numpy as np
from mpi4py import MPI
from mpi4py.util import dtlib

__all__ = ["IN_PLACE", "Unsupported", "array_module", "is_array", "package_of", "flat_view",
           "is_in_place", "check_dtype", "empty", "copy", "msg", "parse_mpi_buffer",
           "SUPPORTED_KINDS"]

#: Pass as the send buffer to reduce in place (the same object as ``MPI.IN_PLACE``).
IN_PLACE = MPI.IN_PLACE

#: numpy dtype kinds mpicoll handles: bool, signed, unsigned, floating, complex.
SUPPORTED_KINDS = "biufc"


class Unsupported(Exception):
    """A buffer specification mpicoll does not handle itself (derived datatypes ...).

    :class:`mpicoll.Comm` catches it and hands the call to the wrapped communicator.
    """


def package_of(a: Any) -> str:
    """The top-level package of ``a``'s type (``"cupy"``, ``"torch"``, ``"numpy"`` ...)."""
    return type(a).__module__.split(".")[0]


def array_module(a: Any) -> Any:
    """Return the array module (``numpy`` or ``cupy``) that owns array ``a``."""
    if isinstance(a, np.ndarray):
        return np
    if package_of(a) == "cupy":
        import cupy  # noqa: PLC0415  (optional dependency)

        return cupy
    return np


def is_array(a: Any) -> bool:
    """Whether ``a`` is an array mpicoll accepts directly (numpy or CuPy ndarray)."""
    if isinstance(a, np.ndarray):
        return True
    return package_of(a) == "cupy" and hasattr(a, "__cuda_array_interface__")


def is_in_place(a: Any) -> bool:
    """Whether ``a`` asks for an in-place operation (``IN_PLACE`` or ``None``)."""
    return a is None or a is IN_PLACE


def check_dtype(dtype: Any, argname: str) -> None:
    """Raise ``TypeError`` unless mpicoll can move and reduce this dtype."""
    if getattr(dtype, "kind", None) not in SUPPORTED_KINDS or getattr(dtype, "names", None):
        raise TypeError(f"{argname} has dtype {dtype}; mpicoll handles bool, integer, "
                        f"floating and complex dtypes")


def flat_view(a: Any, argname: str, writable: bool = False) -> Any:
    """Return a flat, contiguous view of array ``a`` (no copy).

    Args:
        a: a numpy or CuPy array of any shape, C- or Fortran-contiguous.
        argname: the argument's name, for error messages.
        writable: require that the array can be written (an output buffer).

    Raises:
        TypeError: ``a`` is not an array, or its dtype is not supported.
        ValueError: ``a`` is not contiguous, or is read-only when ``writable``.
    """
    if not is_array(a):
        raise TypeError(f"{argname} must be a numpy or CuPy array, not {type(a).__name__}")
    check_dtype(a.dtype, argname)
    flags = a.flags
    if not (flags.c_contiguous or flags.f_contiguous):
        raise ValueError(f"{argname} must be contiguous (got strides {a.strides} for shape "
                         f"{a.shape}); pass numpy.ascontiguousarray({argname}) instead")
    if writable and not getattr(flags, "writeable", True):
        raise ValueError(f"{argname} is read-only; the result must be written into it")
    return a if a.ndim == 1 else a.reshape(-1, order="A")


def empty(count: int, dtype: Any, like: Any = None) -> Any:
    """Allocate an uninitialised flat scratch array on the same device as ``like``."""
    return array_module(like).empty(int(count), dtype=dtype)


def copy(dst: Any, src: Any) -> None:
    """Copy ``src`` into ``dst`` (same length), on their device."""
    if dst is not src and dst.size:
        array_module(dst).copyto(dst, src)


def msg(a: Any) -> list:
    """The mpi4py message spec that sends or receives array ``a`` as raw bytes.

    A CuPy array (CUDA-aware MPI) waits for the kernels queued on CuPy's current stream
    first: MPI reads and writes device memory when called, not in the stream's order.
    """
    if type(a) is not np.ndarray and package_of(a) == "cupy":
        array_module(a).cuda.get_current_stream().synchronize()
    return [a, MPI.BYTE]


def _one_base(dtype: np.dtype) -> np.dtype | None:
    """The one scalar type a numpy dtype is built of (fields, subarrays), else ``None``."""
    if dtype.names:
        bases = {_one_base(dtype.fields[name][0]) for name in dtype.names}
        return bases.pop() if len(bases) == 1 else None
    return _one_base(dtype.base) if dtype.shape else dtype


def _elements_of(datatype: Any, argname: str) -> tuple[np.dtype, int]:
    """``(element dtype, elements per datatype item)``: a predefined datatype is one
    element; a derived one is taken where it is gap-free copies of one predefined type
    (``Create_contiguous``, a vector without stride gaps), which MPI lets a rank pair
    with that type on another (the same type signature), so mpicoll must take it too."""
    if not isinstance(datatype, MPI.Datatype) or datatype.is_predefined \
            or datatype == MPI.DATATYPE_NULL:
        return _dtype_of(datatype, argname), 1
    try:
        size, (lb, extent), (true_lb, true_extent) = (
            datatype.Get_size(), datatype.Get_extent(), datatype.Get_true_extent())
        base = _one_base(dtlib.to_numpy_dtype(datatype))
    except (MPI.Exception, ValueError, TypeError, KeyError):
        base = None
    if base is None or lb or true_lb or not size == extent == true_extent:
        raise Unsupported(f"{argname}: derived datatypes with gaps or mixed types are "
                          f"handled by MPI itself")
    return _dtype_of(base.str, argname), size // base.itemsize


def _dtype_of(datatype: Any, argname: str) -> np.dtype:
    if isinstance(datatype, str):
        try:
            return np.dtype(datatype)
        except TypeError:
            raise Unsupported(f"{argname}: unknown type code {datatype!r}") from None
    if not isinstance(datatype, MPI.Datatype):
        raise Unsupported(f"{argname}: {type(datatype).__name__} is not an MPI datatype")
    if datatype == MPI.DATATYPE_NULL or not datatype.is_predefined:
        raise Unsupported(f"{argname}: derived datatypes are handled by MPI itself")
    try:
        dtype = dtlib.to_numpy_dtype(datatype)
    except (ValueError, TypeError, KeyError):
        raise Unsupported(f"{argname}: MPI datatype has no numpy equivalent") from None
    if dtype.kind not in SUPPORTED_KINDS or dtype.names or dtype.shape:
        raise Unsupported(f"{argname}: MPI datatype {dtype} is handled by MPI itself")
    return dtype


def _as_byte_array(buf: Any, argname: str) -> np.ndarray:
    if isinstance(buf, np.ndarray):
        if not (buf.flags.c_contiguous or buf.flags.f_contiguous):
            raise ValueError(f"{argname} must be contiguous")
        return buf.reshape(-1, order="A").view(np.uint8)
    try:
        return np.frombuffer(buf, dtype=np.uint8)
    except (TypeError, ValueError, BufferError):
        raise Unsupported(f"{argname}: {type(buf).__name__} does not expose a "
                          f"contiguous buffer") from None


def parse_mpi_buffer(spec: Any, argname: str, writable: bool = False, blocks: int = 1) -> Any:
    """Turn an mpi4py buffer specification into a flat array view.

    Accepts what mpi4py's uppercase methods accept for contiguous data of one predefined
    type (a derived datatype of gap-free copies of one counts as its elements): an array
    or buffer-protocol object; ``[buf, datatype]``; ``[buf, count, datatype]``;
    ``[buf, (count, displ), datatype]``; ``[buf, count, displ, datatype]``; ``None`` as
    ``buf`` for an empty buffer. ``datatype`` may be an ``MPI.Datatype`` or a type code.
    ``blocks``: the number of ranks' blocks the buffer holds (an all-gather's receive
    buffer, a reduce-scatter's send buffer): as in mpi4py, an explicit count is then the
    count of one block, and the view covers ``blocks`` of them.

    Raises:
        Unsupported: derived datatypes with gaps or of mixed types, objects without a
            contiguous buffer: mpicoll leaves these to MPI itself.
        ValueError: a count or displacement that does not fit the buffer, a read-only
            buffer where ``writable``, a non-contiguous array (MPI refuses it too).
    """
    if is_array(spec):
        return flat_view(spec, argname, writable)   # (non-contiguous: ValueError, as MPI's)
    if not isinstance(spec, (list, tuple)):
        if isinstance(spec, (bytes, bytearray, memoryview)) or hasattr(spec, "__buffer__"):
            try:
                arr = np.asarray(memoryview(spec))
            except (TypeError, ValueError, BufferError, NotImplementedError):
                raise Unsupported(f"{argname}: cannot view {type(spec).__name__}") from None
            return parse_mpi_buffer(arr, argname, writable)
        raise Unsupported(f"{argname}: {type(spec).__name__} is not a buffer mpicoll knows")
    buf, count, displ, datatype = spec_parts(spec, argname, Unsupported, blocks)
    dtype, per_item = _elements_of(datatype, argname)
    if per_item != 1:   # counted in the element type
        count = None if count is None else count * per_item
        displ = int(displ) * per_item
    if buf is None:
        if count:
            raise ValueError(f"{argname}: buffer is None but count is {count}")
        return np.empty(0, dtype=dtype)
    raw = _as_byte_array(buf, argname)
    if writable and not raw.flags.writeable:
        raise ValueError(f"{argname} is read-only; the result must be written into it")
    return spec_bytes(raw, count, displ, dtype, argname, ValueError).view(dtype)


def spec_parts(spec: list | tuple, argname: str, error: type, blocks: int = 1) -> tuple:
    """``(buf, count, displ, datatype)`` of a list spec (``count`` ``None``: the rest of
    the buffer; an explicit count is per block, so ``count`` is it times ``blocks``);
    raises ``error`` for another length or vector (counts, displs)."""
    items = list(spec)
    if len(items) == 2:
        return items[0], None, 0, items[1]
    if len(items) == 3:
        buf, count, datatype = items
        displ = 0
        if isinstance(count, (list, tuple)) and len(count) == 2:
            count, displ = count
    elif len(items) == 4:
        buf, count, displ, datatype = items
    else:
        raise error(f"{argname}: buffer spec of {len(items)} items")
    if isinstance(count, (list, tuple)) or isinstance(displ, (list, tuple)):
        raise error(f"{argname}: vector (counts, displs) specs are not handled")
    return buf, None if count is None else int(count) * blocks, displ, datatype


def spec_bytes(raw: Any, count: Any, displ: Any, dtype: np.dtype, argname: str,
               error: type) -> Any:
    """The bytes of ``count`` elements of ``dtype`` at element ``displ`` of byte array
    ``raw`` (``count`` ``None``: up to its end); raises ``error`` if they do not fit."""
    itemsize = dtype.itemsize
    start = int(displ) * itemsize
    count = (raw.size - start) // itemsize if count is None else int(count)
    if count < 0 or start < 0 or start + count * itemsize > raw.size:
        raise error(f"{argname}: count {count} at displacement {displ} does not fit a "
                    f"buffer of {raw.size} bytes with {itemsize}-byte elements")
    return raw[start:start + count * itemsize]
