"""Device arrays: recognising them, their producer streams, and one call's buffer checks.

A *device array* is any of:

- a CuPy ``ndarray``;
- an object exposing ``__cuda_array_interface__`` (Numba device arrays, PyTorch CUDA
  tensors, ...; version 3 carries the producer's ``stream``);
- an object exposing ``__dlpack__`` whose ``__dlpack_device__()`` is a CUDA device
  (``kDLCUDA`` = 2, ``kDLCUDAManaged`` = 13).

Nothing here imports CuPy or torch: everything is duck typing, so these functions run (and
are tested) on machines without a GPU, with fake objects exposing the interfaces.
"""
from __future__ import annotations

import contextlib
from typing import Any

import numpy as np
from numpy.lib.stride_tricks import as_strided

from ..buffers import is_in_place, package_of

__all__ = ["KDL_CUDA", "KDL_CUDA_MANAGED", "ARGUMENT_NAMES", "is_device", "unwrap_spec",
           "cuda_interface", "producer_stream", "device_id", "check_contiguous",
           "any_device", "call_kind", "buffer_arguments", "package_of"]

#: DLPack device types of CUDA memory (``DLDeviceType``): device and managed memory.
KDL_CUDA = 2
KDL_CUDA_MANAGED = 13
_CUDA_DLPACK = (KDL_CUDA, KDL_CUDA_MANAGED)

#: The public functions' argument names, in :func:`mpicoll.collectives.dispatch`'s
#: ``args`` order (the buffer arguments are those :func:`buffer_arguments` picks).
ARGUMENT_NAMES: dict[str, tuple[str, ...]] = {
    "allreduce": ("sendbuf", "recvbuf", "op", "algorithm"),
    "reduce_scatter": ("sendbuf", "recvbuf", "op", "algorithm"),
    "allgather": ("sendbuf", "recvbuf", "algorithm"),
    "broadcast": ("buf", "root", "algorithm"),
    "reduce": ("sendbuf", "recvbuf", "op", "root", "algorithm"),
}
_BUFFERS = {"sendbuf", "recvbuf", "buf"}


def unwrap_spec(a: Any) -> Any:
    """The buffer inside an mpi4py buffer spec (``[buf, MPI.FLOAT]`` ...), else ``a``."""
    if isinstance(a, (list, tuple)) and a:
        return a[0]
    return a


def is_device(a: Any) -> bool:
    """Whether ``a`` (or the buffer of an mpi4py spec) is in CUDA device memory.

    ``None``, ``IN_PLACE``, numpy arrays and other host objects are not. Never raises.
    """
    if a is None or type(a) is np.ndarray:
        return False
    a = unwrap_spec(a)
    if a is None or isinstance(a, (np.ndarray, bytes, bytearray, memoryview, int, str)):
        return False
    with contextlib.suppress(Exception):  # a property that fails: DLPack says where a is
        if hasattr(a, "__cuda_array_interface__"):  # (torch refuses the interface of a
            return True  # CUDA tensor that requires grad)
    dev = getattr(a, "__dlpack_device__", None)
    if dev is not None and hasattr(a, "__dlpack__"):
        try:
            kind = int(dev()[0])
        except Exception:  # noqa: BLE001
            return False
        return kind in _CUDA_DLPACK
    return False


def unsynchronised(a: Any) -> bool:
    """For a device object whose :func:`producer_stream` is ``None``: whether nothing says
    its data is ready (``__cuda_array_interface__`` version 3 does, with stream ``None``),
    so that the whole device must be synchronised before it is read."""
    cai = cuda_interface(unwrap_spec(a))
    return cai is None or cai.get("version", 0) < 3


def cuda_interface(a: Any) -> dict | None:
    """``a.__cuda_array_interface__`` (``None`` when ``a`` has none)."""
    try:
        return getattr(a, "__cuda_array_interface__", None)
    except Exception:  # noqa: BLE001
        return None


def producer_stream(a: Any) -> int | None:
    """The CUDA stream that produces ``a``'s contents, as a ``cudaStream_t`` integer.

    - CuPy arrays: CuPy's current stream (its ``__cuda_array_interface__`` reports it
      too).
    - ``__cuda_array_interface__`` version 3: its ``stream`` (``1`` is the legacy default
      stream, ``2`` the per-thread default stream).
    - torch CUDA tensors (interface version 2, no stream): torch's current stream on the
      tensor's device.

    Returns:
        The stream handle, or ``None`` when the producer gives none (nothing to wait for:
        version 3 says ``None`` means the data is ready; other objects: the caller may
        synchronise the device to be safe).
    """
    a = unwrap_spec(a)
    if package_of(a) == "cupy":
        import cupy  # noqa: PLC0415  (a CuPy array exists: CuPy is importable)

        return int(cupy.cuda.get_current_stream().ptr)
    if package_of(a) == "torch":
        import torch  # noqa: PLC0415

        return int(torch.cuda.current_stream(a.device).cuda_stream)
    cai = cuda_interface(a)
    if cai is not None and cai.get("version", 0) >= 3:
        stream = cai.get("stream")
        return None if stream is None else int(stream)
    return None


def device_id(a: Any) -> int | None:
    """The CUDA device ordinal holding ``a``, when the object says (``None`` otherwise)."""
    a = unwrap_spec(a)
    dev = getattr(a, "device", None)
    for attr in ("id", "index"):
        value = getattr(dev, attr, None)
        if isinstance(value, int):
            return value
    fn = getattr(a, "__dlpack_device__", None)
    if fn is not None:
        with contextlib.suppress(Exception):
            kind, ordinal = fn()
            if int(kind) in _CUDA_DLPACK:
                return int(ordinal)
    return None


def _describe(a: Any) -> str:
    a = unwrap_spec(a)
    where = "device" if is_device(a) else "host"
    name = f"{type(a).__module__}.{type(a).__name__}"
    dev = device_id(a) if where == "device" else None
    return f"a {where} array ({name}{'' if dev is None else f' on cuda:{dev}'})"


def check_contiguous(a: Any, argname: str) -> None:
    """Raise ``ValueError`` unless device array ``a`` is C- or Fortran-contiguous.

    Uses ``__cuda_array_interface__`` (``strides`` ``None`` means C-contiguous) or the
    object's ``flags``/``is_contiguous()``; objects reporting neither are accepted.
    """
    a = unwrap_spec(a)
    flags = getattr(a, "flags", None)
    if flags is not None and hasattr(flags, "c_contiguous"):
        ok = bool(flags.c_contiguous or flags.f_contiguous)
        shape, strides = tuple(getattr(a, "shape", ())), getattr(a, "strides", None)
    elif callable(getattr(a, "is_contiguous", None)) and package_of(a) == "torch":
        itemsize = a.element_size()
        shape, strides = tuple(a.shape), tuple(s * itemsize for s in a.stride())
        ok = _contiguous(shape, strides, itemsize)
    else:
        cai = cuda_interface(a)
        if cai is None:
            return
        shape, strides = tuple(cai["shape"]), cai.get("strides")
        if strides is None:
            return
        itemsize = np.dtype(cai["typestr"]).itemsize
        ok = _contiguous(shape, tuple(strides), itemsize)
    if not ok:
        raise ValueError(f"{argname} must be contiguous (got strides {strides} for shape "
                         f"{shape}); pass a contiguous copy (e.g. cupy.ascontiguousarray"
                         f"({argname}) or {argname}.contiguous())")


def _contiguous(shape: tuple, strides: tuple, itemsize: int) -> bool:
    # numpy's own flags of a view with this layout (no memory is read)
    flags = as_strided(np.empty(1, f"V{itemsize}"), shape, strides).flags
    return bool(flags.c_contiguous or flags.f_contiguous)


def buffer_arguments(collective: str, args: tuple) -> list[tuple[str, Any]]:
    """``(name, value)`` of the buffer arguments of one call (``None``/IN_PLACE dropped).

    Args:
        collective: one of :data:`ARGUMENT_NAMES`.
        args: the call's arguments in :func:`mpicoll.collectives.dispatch` order (the
            trailing ``algorithm`` may be left out).
    """
    names = ARGUMENT_NAMES[collective]
    return [(name, value) for name, value in zip(names, args)
            if name in _BUFFERS and not is_in_place(value)]


def any_device(args: tuple) -> bool:
    """Whether any of ``args`` is a device array: the core's cheap test (never raises).

    ``True`` sends the call to :func:`mpicoll.gpu.route.device_call`, which checks the
    buffers properly (mixed device and host buffers included).
    """
    for a in args:
        if type(a) is np.ndarray or a is None or isinstance(a, (str, int)):
            continue
        if is_device(a):
            return True
    return False


def call_kind(collective: str, args: tuple) -> str:
    """``"device"`` or ``"host"``: where one call's buffers are; checks device buffers.

    Cheap for host calls (numpy arrays are recognised by their exact type first).

    Raises:
        TypeError: device and host buffers mixed in one call (both arguments named).
        ValueError: a non-contiguous device array.
    """
    device, host = [], []
    for name, value in buffer_arguments(collective, args):
        (device if is_device(value) else host).append((name, value))
    if not device:
        return "host"
    if host:
        (dn, dv), (hn, hv) = device[0], host[0]
        raise TypeError(f"{dn} is {_describe(dv)} but {hn} is {_describe(hv)}; pass "
                        f"every buffer of one call on the same side (device or host)")
    devices = {device_id(v) for _, v in device} - {None}
    if len(devices) > 1:
        (n0, v0), (n1, v1) = device[0], device[1]
        raise TypeError(f"{n0} is {_describe(v0)} but {n1} is {_describe(v1)}; pass "
                        f"every buffer of one call on the same GPU")
    for name, value in device:
        check_contiguous(value, name)
    return "device"
