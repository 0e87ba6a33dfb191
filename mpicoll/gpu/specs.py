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

from .. import buffers
from . import backends

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


def device_buffer(spec: Any, argname: str, blocks: int = 1) -> Any:
    """The device argument an mpi4py buffer spec ``spec`` describes (see the module doc;
    ``blocks`` as for :func:`mpicoll.buffers.parse_mpi_buffer`).

    Raises:
        TypeError: a derived datatype or vector counts (MPI itself could take them only
            if it is CUDA-aware), a spec of another shape, or a count or displacement that
            does not fit the array (a ``TypeError`` too, so that :class:`mpicoll.Comm`
            never hands the call on to an MPI library that may not be CUDA-aware).
    """
    if not isinstance(spec, (list, tuple)):
        return spec
    buf, count, displ, datatype = buffers.spec_parts(spec, argname, TypeError, blocks)
    dtype = _dtype(datatype, argname)
    array, wrap = backends.require(buf).view(buf)
    if count is None and not displ and np.dtype(array.dtype) == dtype:
        return buf
    raw = array.reshape(-1, order="A").view(np.uint8)
    return wrap(buffers.spec_bytes(raw, count, displ, dtype, argname, TypeError).view(dtype))
