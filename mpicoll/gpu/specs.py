"""mpi4py buffer specs holding device arrays, for :class:`mpicoll.Comm`.

mpi4py takes device memory wherever it takes a buffer: a bare device array (CuPy, an
object with ``__cuda_array_interface__`` or CUDA ``__dlpack__``) or a spec around one,
``[buf, datatype]``, ``[buf, count, datatype]``, ``[buf, (count, displ), datatype]``,
``[buf, count, displ, datatype]``. :func:`device_buffer` turns such a spec into one device
argument for the collectives (and so :func:`mpicoll.gpu.route.device_call`): the array
itself when the spec covers it whole with its own dtype, else a zero-copy view of the
described bytes (its device backend's view: CuPy for CUDA).
"""
from __future__ import annotations

from typing import Any

import numpy as np

from . import route

__all__ = ["device_buffer"]


def _dtype(datatype: Any, argname: str) -> np.dtype:
    if isinstance(datatype, str):
        return np.dtype(datatype)
    from mpi4py import MPI  # noqa: PLC0415
    from mpi4py.util import dtlib  # noqa: PLC0415

    if not isinstance(datatype, MPI.Datatype) or not datatype.is_predefined:
        raise TypeError(f"{argname}: mpicoll takes device buffers with predefined MPI "
                        f"datatypes only")
    return dtlib.to_numpy_dtype(datatype)


def device_buffer(spec: Any, argname: str) -> Any:
    """The device argument an mpi4py buffer spec ``spec`` describes (see the module doc).

    Raises:
        TypeError: a derived datatype or vector counts (MPI itself could take them only
            if it is CUDA-aware), a spec of another shape, or a count or displacement that
            does not fit the array (a ``TypeError`` too, so that :class:`mpicoll.Comm`
            never hands the call on to an MPI library that may not be CUDA-aware).
    """
    if not isinstance(spec, (list, tuple)):
        return spec
    items = list(spec)
    if len(items) == 2:
        buf, count, displ, datatype = items[0], None, 0, items[1]
    elif len(items) == 3:
        buf, count, datatype = items
        count, displ = count if isinstance(count, (list, tuple)) and len(count) == 2 \
            else (count, 0)
    elif len(items) == 4:
        buf, count, displ, datatype = items
    else:
        raise TypeError(f"{argname}: a buffer spec of {len(items)} items")
    if isinstance(count, (list, tuple)) or isinstance(displ, (list, tuple)):
        raise TypeError(f"{argname}: vector (counts, displs) specs with device buffers are "
                        f"not handled")
    dtype = _dtype(datatype, argname)
    array, wrap = route.as_device_array(buf)
    if count is None and not displ and np.dtype(array.dtype) == dtype:
        return buf
    raw = array.reshape(-1, order="A").view(np.uint8)
    start = int(displ) * dtype.itemsize
    count = (raw.size - start) // dtype.itemsize if count is None else int(count)
    if count < 0 or start < 0 or start + count * dtype.itemsize > raw.size:
        raise TypeError(f"{argname}: count {count} at displacement {displ} does not fit a "
                         f"device buffer of {raw.size} bytes with {dtype.itemsize}-byte "
                         f"elements")
    return wrap(raw[start:start + count * dtype.itemsize].view(dtype))
